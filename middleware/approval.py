"""HumanApproval: tool calls that wait for a person's decision (seed 004 §5, MidTurn intervention).

``on_tool_call`` returns :class:`~fsm_agent.AskApproval` for every call that
needs approval: its tool name matches one of ``tools`` (glob patterns,
:func:`fnmatch.fnmatchcase`), or the predicate ``when(call, ctx) -> bool``
says so. The driver then stops the run in WAITING_HUMAN (Stop-Resume, the
default human-in-the-loop mode) with one :class:`~fsm_agent.PendingAction`
per asked call in ``result.stop.pending_actions`` (the call as proposed, the
reason, the allowed decisions), detail ``"<n> tool call(s) need approval:
<names>"`` and ``required_decision`` set. While any call of a turn waits,
**no call of that turn runs**, not even those that need no approval; they
are decided again when the run resumes (``Agent.resume(session_id,
decisions={call_id: Decision...})``).

Modes:

* ``"batch"`` (default): every call of the turn that needs approval is
  pending at once, so one person answers them together.
* ``"per_call"``: only the first call of the turn that needs approval is
  asked. Each later call of that turn that needs approval is denied
  (``Deny``: the model gets an error result saying which call waits and to
  propose this one again after that one is decided; nothing ran), so one stop holds exactly one decision and
  resuming with it settles the whole turn. The model proposes the denied
  calls again in later turns, one approval each.

Decisions a person can make (the strings of ``allowed_decisions``):

* ``approve`` — run the call as proposed;
* ``edit`` — run it with new arguments, validated against the tool's schema;
* ``reject`` — do not run it; the model gets an error result with the message;
* ``respond`` — do not run it; the person's answer is the tool result.

:func:`apply_decisions` is the pure form of what a resume does with them:
decisions keyed by tool-call id (the core's ``fsm_agent.control.Decision``
objects or their JSON form ``{"kind": "edit", "arguments": {...}, "message":
"", "is_error": false}``) become :class:`~fsm_agent.Allow`,
:class:`~fsm_agent.Edit`, :class:`~fsm_agent.Deny` or :class:`~fsm_agent.Respond`
outcomes, and anything that cannot be applied (a missing or stray decision,
one the pending action does not allow, an edit that fails the tool's
schema) raises :class:`DecisionError` instead of reaching the model. Use it
to check a person's input before resuming.

Order: ToolPolicy (if present) wraps this middleware, so a call the policy
denies is never put to a person.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attrs import evolve, frozen

from fsm_agent import (
    Allow,
    AskApproval,
    ConfigurationError,
    Deny,
    Edit,
    Middleware,
    Ordering,
    PendingAction,
    Respond,
    RunContext,
    RunError,
    ToolRegistry,
    ToolUseBlock,
    UserError,
)

__all__ = ["DECISIONS", "DecisionError", "HumanApproval", "Resolution", "apply_decisions"]

DECISIONS: tuple[str, ...] = ("approve", "edit", "reject", "respond")
"""Every decision a person can make, in the order shown to them."""


class DecisionError(UserError, ValueError):
    """A decision cannot be applied (missing, unknown call id, not allowed, malformed, invalid edit)."""


@frozen
class Resolution:
    """What to do with one pending call: the call as it should run and the outcome."""

    call: ToolUseBlock
    """The call, with the edited arguments for ``edit``."""
    decision: Allow | Edit | Deny | Respond
    """The outcome to apply, as for a middleware decision."""
    decided: str
    """The person's decision: ``approve``, ``edit``, ``reject`` or ``respond``."""


def _field(decision: Any, name: str, default: Any = None) -> Any:
    if isinstance(decision, Mapping):
        return decision.get(name, default)
    return getattr(decision, name, default)


def _outcome(call: ToolUseBlock, decision: Any, tools: Any) -> Resolution:
    kind = _field(decision, "kind")
    if kind == "approve":
        return Resolution(call, Allow(), kind)
    message = _field(decision, "message", "")
    if kind in ("reject", "respond") and not isinstance(message, str):
        raise DecisionError(f"decision {kind!r} for tool call {call.id!r} needs a string message, not {message!r}")
    if kind == "reject":
        return Resolution(call, Deny(message or "rejected by a person"), kind)
    if kind == "respond":
        return Resolution(call, Respond(message, is_error=bool(_field(decision, "is_error", False))), kind)
    if kind != "edit":
        raise DecisionError(f"unknown decision kind {kind!r} for tool call {call.id!r} "
                            f"(use one of: {', '.join(DECISIONS)})")
    arguments = _field(decision, "arguments")
    if not isinstance(arguments, Mapping):
        raise DecisionError(f"decision 'edit' for tool call {call.id!r} needs an arguments object, not {arguments!r}")
    tool = tools.get(call.name)
    if tool is None:
        raise DecisionError(f"cannot edit tool call {call.id!r}: no tool named {call.name!r} is registered")
    try:
        tool.validate(arguments)
    except RunError as exc:  # ToolArgumentsError, which fsm_agent does not export
        raise DecisionError(f"edited arguments for tool call {call.id!r} are invalid: {exc}") from exc
    edited = evolve(call, input=dict(arguments), raw_input=None)
    return Resolution(edited, Edit(dict(arguments), reason="edited by a person"), kind)


def apply_decisions(
    pending_actions: Sequence[PendingAction],
    decisions: Mapping[str, Any],
    tools: ToolRegistry | Mapping[str, Any],
) -> list[Resolution]:
    """Turn a person's decisions into outcomes, one :class:`Resolution` per pending action, in order.

    Pure: nothing runs and nothing is stored; call it to check decisions before resuming
    (e.g. to answer a bad request with an error instead of resuming with it).

    Args:
        pending_actions: ``result.stop.pending_actions`` of the WAITING_HUMAN stop.
        decisions: tool-call id -> decision: a ``fsm_agent.control.Decision`` (``kind``,
            ``arguments``, ``message``, ``is_error``) or a mapping with those keys (its JSON form).
        tools: the agent's registry (or ``{name: Tool}``), to validate edited arguments.

    Returns:
        ``approve`` → ``Allow()``; ``edit`` → ``Edit(arguments, reason="edited by a person")``
        (the resolution's ``call`` carries the new arguments); ``reject`` → ``Deny(message)``;
        ``respond`` → ``Respond(message, is_error)``.

    Raises:
        DecisionError: a pending call has no decision; a decision names a call that is not pending;
            a decision is not among the call's ``allowed_decisions`` or is malformed; an edit targets
            an unknown tool or its arguments fail the tool's schema (the message carries the errors).
    """
    pending_ids = [p.call.id for p in pending_actions]
    stray = [k for k in decisions if k not in pending_ids]
    if stray:
        raise DecisionError(f"decision for tool call(s) {', '.join(map(repr, stray))}, which are not pending "
                            f"(pending: {', '.join(map(repr, pending_ids)) or 'none'})")
    missing = [p for p in pending_actions if p.call.id not in decisions]
    if missing:
        raise DecisionError("no decision for pending tool call(s) " + ", ".join(
            f"{p.call.id!r} ({p.call.name})" for p in missing) + "; each needs one of its allowed decisions")
    out: list[Resolution] = []
    for action in pending_actions:
        decision = decisions[action.call.id]
        kind = _field(decision, "kind")
        if kind in DECISIONS and kind not in action.allowed_decisions:
            raise DecisionError(f"decision {kind!r} is not allowed for tool call {action.call.id!r} "
                                f"({action.call.name}); allowed: {', '.join(action.allowed_decisions)}")
        out.append(_outcome(action.call, decision, tools))
    return out


def _patterns(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


class HumanApproval(Middleware):
    """Ask a person before running chosen tool calls; the run stops WAITING_HUMAN.

    Args:
        tools: tool-name glob patterns that always need approval (``"*"``: every call).
        when: ``(call, ctx) -> bool``; a call needs approval when it returns true (or its name matches ``tools``).
        mode: ``"batch"`` (default: all asked calls of a turn pend together) or ``"per_call"``.
        reason: the reason shown to the person; ``{tool}`` is replaced by the tool name.
        allowed_decisions: a non-empty subset of approve, edit, reject, respond.

    Raises:
        ConfigurationError: neither ``tools`` nor ``when``, an unknown mode, or an unknown decision.
    """

    name = "approval"

    ordering = Ordering(wrapped_by=("tool_policy",))

    def __init__(
        self,
        tools: str | Iterable[str] | None = None,
        *,
        when: Callable[[ToolUseBlock, RunContext], bool] | None = None,
        mode: str = "batch",
        reason: str = "tool {tool!r} needs human approval",
        allowed_decisions: Iterable[str] = DECISIONS,
    ) -> None:
        patterns = _patterns(tools)
        decisions = tuple(allowed_decisions)
        if not patterns and when is None:
            raise ConfigurationError("HumanApproval: give tools=[...] and/or when=(call, ctx) -> bool "
                                     "(tools='*' asks for every call)")
        if mode not in ("batch", "per_call"):
            raise ConfigurationError(f"HumanApproval: mode must be 'batch' or 'per_call', not {mode!r}")
        if not decisions or any(d not in DECISIONS for d in decisions):
            raise ConfigurationError(f"HumanApproval: allowed_decisions must be a non-empty subset of "
                                     f"{', '.join(DECISIONS)}, not {decisions!r}")
        self.tools = patterns
        self.when = when
        self.mode = mode
        self.reason = reason
        self.allowed_decisions = decisions

    def needs_approval(self, call: ToolUseBlock, ctx: RunContext) -> bool:
        """Whether ``call`` must wait for a person (name pattern first, then the predicate)."""
        if any(fnmatch.fnmatchcase(call.name, p) for p in self.tools):
            return True
        return bool(self.when is not None and self.when(call, ctx))

    def on_run_start(self, ctx: RunContext) -> None:
        ctx.state(self).clear()  # a resumed run asks afresh

    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> AskApproval | Deny | None:
        if not self.needs_approval(call, ctx):
            return None
        if self.mode == "per_call":
            st = ctx.state(self)
            first = st.get("asked")
            if first is not None and first[0] == ctx.turn and first[1] != call.id:
                return Deny(f"not run: tool call {first[1]} ({first[2]}) is waiting for a person's approval and "
                            "only one call that needs approval is asked per turn; propose this call again after "
                            "that one is decided")
            st["asked"] = (ctx.turn, call.id, call.name)
        return AskApproval(self.reason.format(tool=call.name), self.allowed_decisions)

    def __repr__(self) -> str:
        when = getattr(self.when, "__qualname__", repr(self.when)) if self.when is not None else None
        return (f"HumanApproval(tools={list(self.tools)!r}, when={when}, mode={self.mode!r}, "
                f"reason={self.reason!r}, allowed_decisions={list(self.allowed_decisions)!r})")
