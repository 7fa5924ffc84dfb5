"""Handoff: an agent hands its task over to another with a recovery package, and the other takes
over in a session of its own.

    team = Handoffs({"triage": triage, "billing": billing, "tech": tech},
                    routes={"triage": ["billing", "tech"]}, limits={"billing": {"max_iterations": 10}})
    result = await team.run("My invoice is wrong", start="triage")
    result.output, result.stop.reason, [step.agent for step in result.chain]   # ..., COMPLETED, [triage, billing]

**The package** (:class:`RecoveryPackage`): ``goal`` (what the task is now), ``verified_facts``
(what is known for sure), ``open_actions`` (what is left to do) and a short ``summary``. The
agent hands over by calling the tool ``handoff_to_<name>`` with the package as its arguments; the
tool's JSON Schema (:data:`PACKAGE_SCHEMA`) checks it, then its content (no goal, summary, fact or
action without a visible character): a bad package is an error tool result the model reads and can
fix (``invalid_arguments`` or ``invalid_handoff``), and nothing is handed over. Every text of the
package is kept as one printable line (no control or invisible character, no line breaks), so a
fact cannot forge another section of the successor's message.

**The boundary**: the successor runs in its own session, linked ``handoff`` to the predecessor's
session and call (the link's metadata keeps the package), seeded with its own system prompt and
the package only. It does not inherit the predecessor's transcript: what was verified travels as
facts, not as a conversation it would have to re-read (and could be misled by); the predecessor's
session stays as it was, for audit. It has its own budget (its config with ``limits[name]``).

**Control**: the successor runs inside the predecessor's handoff call (an
:func:`~fsm_agent.orchestration.subagent.agent_tool`-like call), and the predecessor's run ends at
the end of that turn: the model never gets the turn back. So the chain is one tree of sessions
under the first one, which is the chain's handle:

* its stop is the chain's: COMPLETED when the last agent completed (detail ``handed off to
  '<name>' (session <id>): it completed``); WAITING_HUMAN when the last agent waits for a person
  (the decision given to the first session travels down the chain); CANCELLED / FAILED_TERMINAL
  when the successor stopped so; INTERRUPTED, with the handoff call left open, when the successor
  stopped in a state it can go on from (INTERRUPTED from outside, PAUSED_BUDGET, FAILED_RETRYABLE):
  ``resume`` of the chain (or of that successor, with a larger budget) continues it, and the
  predecessor never gets its turn back;
* an Interrupt or Cancel sent to it reaches the agent working now; a resume continues that agent;
* usage and cost of every successor roll up into it (``HandoffResult.usage``, ``cost_usd``).

One handoff per turn (a second call in the same turn is denied); at most ``max_handoffs`` in a
chain (then the tool answers ``handoff_limit`` and the agent must finish itself).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from attrs import field, frozen

from ..agent import Agent, drain_on_signals
from ..errors import ConfigurationError, ResumeError, SessionLinkError, StopRun, ToolError
from ..context import RunContext
from ..middleware import Complete, Deny, Middleware, Ordering
from ..store.base import LinkKind, SessionLink
from ..tools.registry import Tool, ToolContext, ToolEffect
from ..types.content import ToolUseBlock, _tuple
from ..types.messages import Message, ToolResultMessage
from ..types.plan import one_line
from ..types.run import RunResult, StopReason
from ._child import (
    CHILD_OF,
    checked_limits,
    child_answer,
    compensate_by_cancelling,
    drive_child,
    first_of_turn,
    stored_result,
)
from .links import child_session_id
from .result import PatternResult

__all__ = ["PACKAGE_SCHEMA", "HandoffResult", "HandoffStep", "Handoffs", "RecoveryPackage"]

PACKAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "goal": {"type": "string", "minLength": 1, "maxLength": 400,
                 "description": "The task as it stands now, for the agent that takes over."},
        "verified_facts": {"type": "array", "maxItems": 8,
                           "items": {"type": "string", "minLength": 1, "maxLength": 240},
                           "description": "What is known for sure (checked, not guessed)."},
        "open_actions": {"type": "array", "maxItems": 8,
                         "items": {"type": "string", "minLength": 1, "maxLength": 240},
                         "description": "What is left to do, in order."},
        "summary": {"type": "string", "minLength": 1, "maxLength": 400,
                    "description": "A short summary of what happened so far."},
    },
    "required": ["goal", "verified_facts", "open_actions", "summary"],
    "additionalProperties": False,
}
"""The JSON Schema of a recovery package (the handoff tool's arguments). Every list and string is
bounded: a package is a summary, and a small model writing under a grammar cannot run on until its
output limit cuts the JSON."""


@frozen
class RecoveryPackage:
    """What an agent hands over (seed 004 §3): the task, what is verified, what is left."""

    goal: str
    """The task as it stands now."""
    verified_facts: tuple[str, ...] = field(default=(), converter=_tuple)
    """Facts the predecessor checked."""
    open_actions: tuple[str, ...] = field(default=(), converter=_tuple)
    """What is left to do."""
    summary: str = ""
    """A short account of what happened so far."""

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> RecoveryPackage:
        """The package of a handoff call's (schema-checked) arguments.

        Every text is kept as one printable line (:func:`fsm_agent.types.plan.one_line`: whitespace
        runs, line breaks among them, become one space; control and invisible characters go).

        Raises:
            ToolError: (kind ``invalid_handoff``) a goal or summary without a visible character, or such
                a fact or action.
        """
        pkg = cls(one_line(str(arguments.get("goal", ""))),
                  [one_line(str(x)) for x in arguments.get("verified_facts", ())],
                  [one_line(str(x)) for x in arguments.get("open_actions", ())],
                  one_line(str(arguments.get("summary", ""))))
        problems = [f"{name} is blank" for name in ("goal", "summary") if not getattr(pkg, name)]
        problems += [f"{name}[{i}] is blank" for name in ("verified_facts", "open_actions")
                     for i, x in enumerate(getattr(pkg, name)) if not x]
        if problems:
            raise ToolError(f"The recovery package is not valid: {'; '.join(problems)}. Call the handoff tool again "
                            "with a goal, the verified facts, the open actions and a summary.", kind="invalid_handoff")
        return pkg

    def to_dict(self) -> dict[str, Any]:
        """The package as JSON-safe data (the link's ``metadata["package"]``)."""
        return {"goal": self.goal, "verified_facts": list(self.verified_facts), "open_actions": list(self.open_actions),
                "summary": self.summary}

    def message(self, source: str) -> str:
        """The successor's first user message: the package, said plainly (each text on one line)."""
        lines = [f"You are taking over a task from agent {source!r}. You get its recovery package, not its "
                 "conversation.", f"Goal: {self.goal}", "Verified facts:"]
        lines += [f"- {x}" for x in self.verified_facts] or ["- (none)"]
        lines.append("Open actions:")
        lines += [f"- {x}" for x in self.open_actions] or ["- (none)"]
        lines.append(f"Summary: {self.summary}")
        return "\n".join(lines)


@frozen
class HandoffStep:
    """One agent of a handoff chain, in order."""

    agent: str
    session_id: str
    stop: StopReason | None
    """Its session's stop (``None`` while it runs, or if it never started)."""
    package: RecoveryPackage | None = None
    """The package it was given (``None`` for the first agent)."""


@frozen
class HandoffResult(PatternResult):
    """How a handoff chain ended: a :class:`~fsm_agent.orchestration.result.PatternResult` whose top
    session is the first agent's (the chain's stop is that session's, see the module docstring), whose
    answer is the last agent's, and whose usage and cost count every agent of the chain; plus the
    chain itself."""

    chain: tuple[HandoffStep, ...]
    """The agents in the order they worked."""


def _tool_name(target: str) -> str:
    return f"handoff_to_{target}"


_SUSPEND = frozenset({StopReason.INTERRUPTED, StopReason.PAUSED_BUDGET, StopReason.FAILED_RETRYABLE})
"""A successor's stops that leave the handoff call open (the chain stops INTERRUPTED; a resume goes on)."""
_FINAL = {f"handoff_{r.value.lower()}": r for r in (StopReason.CANCELLED, StopReason.FAILED_TERMINAL)}
"""Error kinds of a handoff call whose successor ended for good: the chain ends the same way."""


class _HandoffStop(Middleware):
    """Ends a run at the end of the turn in which it handed over, and allows one handoff per turn."""

    name = "handoff"
    ordering = Ordering(position="innermost")

    def __init__(self, targets: Mapping[str, str]) -> None:
        self.targets = dict(targets)
        """Handoff tool name -> the target agent's name."""

    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Deny | None:
        first = first_of_turn(ctx, self.targets) if call.name in self.targets else None
        if first is not None and first.id != call.id:
            return Deny(f"only one handoff per turn: {first.name} was called first")
        return None

    def post_turn(self, ctx: RunContext) -> Complete | None:
        call = first_of_turn(ctx, self.targets)
        if call is None:
            return None
        result = next((m for m in reversed(ctx.transcript)
                       if isinstance(m, ToolResultMessage) and m.tool_call_id == call.id), None)
        if result is None:
            return None
        target = self.targets[call.name]
        child = child_session_id((ctx.session_id, call.id), call.name)
        if not result.is_error:
            return Complete((f"handoff:{child}",), f"handed off to {target!r} (session {child}): it completed")
        stop = _FINAL.get(str((result.metadata or {}).get("error") or ""))
        if stop is None:
            return None  # nothing was handed over (a bad package, no more handoffs ...): the agent goes on
        raise StopRun(stop.value, f"handed off to {target!r} (session {child}), which stopped {stop.value}: "
                      f"{result.text[:400]}", evidence_refs=(f"handoff:{child}",))


class Handoffs:
    """Agents that can hand a task over to one another (see the module docstring).

    Args:
        agents: the agents by name (``^[a-zA-Z0-9_-]{1,50}$``); they must share one store.
        routes: who may hand over to whom (default: every agent to every other one).
        limits: per agent name, :class:`~fsm_agent.RunConfig` fields over its config when it takes over.
        descriptions: per agent name, what the handoff tool tells the model about that agent.
        max_handoffs: the longest chain (handoffs after the first agent).

    Raises:
        ConfigurationError: an unknown name in ``routes`` / ``limits`` / ``descriptions``, a bad
            name, agents with different stores, a bad limit, ``max_handoffs`` < 1.
    """

    def __init__(self, agents: Mapping[str, Agent], *, routes: Mapping[str, Sequence[str]] | None = None,
                 limits: Mapping[str, Mapping[str, Any]] | None = None,
                 descriptions: Mapping[str, str] | None = None, max_handoffs: int = 4) -> None:
        if not agents:
            raise ConfigurationError("Handoffs needs at least one agent")
        if max_handoffs < 1:
            raise ConfigurationError(f"max_handoffs must be at least 1, not {max_handoffs}")
        names = list(agents)
        for n in names:
            if not n or len(n) > 50 or not all(ch.isalnum() or ch in "_-" for ch in n) or not n.isascii():
                raise ConfigurationError(f"agent name {n!r} must match ^[a-zA-Z0-9_-]{{1,50}}$ (it names a tool)")
        stores = {id(a.store) for a in agents.values()}
        if len(stores) != 1:
            raise ConfigurationError("the agents of a handoff chain must share one store (the links and the "
                                     "sessions are read together)")
        routes = {n: list(routes.get(n, ())) for n in names} if routes is not None else \
            {n: [m for m in names if m != n] for n in names}
        for src, targets in routes.items():
            for t in (src, *targets):
                if t not in agents:
                    raise ConfigurationError(f"routes name {t!r}, which is not one of the agents ({', '.join(names)})")
        for what, table in (("limits", limits or {}), ("descriptions", descriptions or {})):
            for n in table:
                if n not in agents:
                    raise ConfigurationError(f"{what} name {n!r}, which is not one of the agents ({', '.join(names)})")
        self.max_handoffs = max_handoffs
        self.routes = routes
        self.limits = {n: checked_limits(agents[n], (limits or {}).get(n), f"Handoffs limits[{n!r}]") for n in names}
        self.descriptions = dict(descriptions or {})
        self.store = next(iter(agents.values())).store
        self.agents: dict[str, Agent] = {
            n: agents[n].derive(tools=[self._handoff_tool(n, t) for t in routes[n]],
                                middleware=[_HandoffStop({_tool_name(t): t for t in routes[n]})])
            for n in names}
        """The agents as the chain runs them: each given agent with its handoff tools and middleware
        (:meth:`Agent.derive`: draining the given agent drains the chain's runs of it too)."""

    def interrupt_all(self, reason: str) -> int:
        """Interrupt every run of the chain's agents in this process (:meth:`Agent.interrupt_all`):
        each chain stops INTERRUPTED, resumable (the agent working is cut and continues on
        :meth:`resume`). Returns how many runs were interrupted."""
        registries = {id(a._active): a for a in self.agents.values()}
        return sum(a.interrupt_all(reason) for a in registries.values())

    @contextlib.asynccontextmanager
    async def drain_on_signals(self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
                               ) -> AsyncIterator[None]:
        """:meth:`Agent.drain_on_signals` for the whole chain: each of ``signals`` interrupts every
        run of its agents in this process (:meth:`interrupt_all`)."""
        async with drain_on_signals(self.interrupt_all, signals):
            yield

    def _handoff_tool(self, source: str, target: str) -> Tool:
        name = _tool_name(target)
        about = self.descriptions.get(target, "")
        description = (f"Hand the task over to agent {target!r}" + (f" ({about})" if about else "") +
                       ": it takes over with your recovery package (goal, verified facts, open actions, summary) and "
                       "does not see this conversation. Your turn ends with the handoff.")

        async def handoff(_fsm_context: ToolContext, **arguments: Any) -> str:
            ctx = _fsm_context
            package = RecoveryPackage.from_arguments(arguments)
            hop = await self._hop(ctx.session_id) + 1
            if hop > self.max_handoffs:
                raise ToolError(f"No more handoffs: this chain has had {hop - 1} (the limit is {self.max_handoffs}). "
                                "Finish the task yourself.", kind="handoff_limit")
            child_id = child_session_id(ctx, name)
            try:
                result = await drive_child(
                    self.agents[target], child_id, package.message(source), parent_id=ctx.session_id,
                    kind=LinkKind.HANDOFF.value, call_id=ctx.call_id, ctx=ctx,
                    link_metadata={"from": source, "to": target, "hop": hop, "package": package.to_dict()},
                    limits=self.limits[target], decision=ctx.decision)
            except SessionLinkError as e:
                raise ToolError(f"Nothing was handed over: {e}", kind="handoff_session_conflict") from e
            return await child_answer(self.agents[target], result, prefix="handoff", suspend=_SUSPEND,
                                      label=f"agent {target!r}, which took over (session {child_id}),")

        t = Tool(handoff, name=name, description=description, parameters=PACKAGE_SCHEMA, timeout=None,
                 effect=ToolEffect.IDEMPOTENT, resumable=True)
        compensate_by_cancelling(t, lambda arguments, ctx: [(self.agents[target], child_session_id(ctx, name))],
                                 "the agent that handed over was cancelled")
        return t

    async def _hop(self, session_id: str) -> int:
        link = await self.store.parent(session_id)
        if link is None or link.kind != LinkKind.HANDOFF.value:
            return 0
        return int(link.metadata.get("hop", 0))

    async def run(self, task: str | Message | Sequence[Message], *, start: str, session_id: str | None = None,
                  **limits: Any) -> HandoffResult:
        """Run the chain from agent ``start`` on ``task`` to its stop.

        ``limits``: RunConfig fields for the first agent's run (over ``limits[start]``).

        Raises:
            ConfigurationError: ``start`` is not one of the agents.
            SessionExistsError: ``session_id`` exists (use :meth:`resume`).
        """
        if start not in self.agents:
            raise ConfigurationError(f"unknown agent {start!r}; one of {', '.join(self.agents)}")
        result = await self.agents[start].run(task, session_id=session_id, metadata={"handoff_agent": start},
                                              **{**self.limits[start], **limits})
        return await self._result(result)

    async def resume(self, session_id: str, **kwargs: Any) -> HandoffResult:
        """Resume a chain: ``session_id`` is its first session, or one of its successors.

        The first session: resumed with ``kwargs`` (``Agent.resume`` arguments: ``decisions`` for its
        pending handoff call, ``confirm_cancel`` ...); its open handoff call runs again and continues
        the agent that was working. A successor: resumed first with ``kwargs`` (its own
        ``decisions``, a larger budget for one that stopped PAUSED_BUDGET: ``max_iterations=20`` ...;
        one that has finished already is not), then the chain's first session, which takes the
        successor's result. Nothing finished runs again.

        Raises:
            ResumeError: an unknown session, one this chain did not start, or one that cannot be resumed.
        """
        rec = await self.store.get_session(session_id)
        if rec is None:
            raise ResumeError(f"unknown session {session_id!r}")
        name = (rec.metadata or {}).get("handoff_agent")
        if name in self.agents:
            return await self._result(await self.agents[name].resume(session_id, **kwargs))
        first, link = session_id, await self.store.parent(session_id)
        if link is None or link.kind != LinkKind.HANDOFF.value or link.metadata.get("to") not in self.agents:
            raise ResumeError(f"session {session_id!r} is neither the first session nor a successor of a chain of "
                              f"these agents ({', '.join(self.agents)})")
        state = rec.state
        if state not in (StopReason.COMPLETED.value, StopReason.FAILED_TERMINAL.value, StopReason.CANCELLED.value):
            await self.agents[str(link.metadata["to"])].resume(session_id, **kwargs)
        while link is not None and link.kind == LinkKind.HANDOFF.value:
            first, link = link.parent_id, await self.store.parent(link.parent_id)
        root = await self.store.get_session(first)
        name = (root.metadata or {}).get("handoff_agent") if root is not None else None
        if name not in self.agents:
            raise ResumeError(f"session {first!r}, the first of the chain of {session_id!r}, was not started by "
                              "these agents")
        return await self._result(await self.agents[name].resume(first))

    async def _took_over(self, session_id: str, link: SessionLink) -> bool:
        """Whether the handoff ``link`` of ``session_id`` is part of the chain: its session was started
        by that call (not a session squatting its id), and no person refused the call (a ``reject``
        or ``respond`` gave the predecessor its turn back)."""
        rec = await self.store.get_session(link.child_id)
        if rec is None or (rec.metadata or {}).get(CHILD_OF) != {"session": session_id, "call": link.call_id}:
            return False
        entry = (await self.store.ledger(session_id)).get(link.call_id or "")
        decided = ((entry.result or {}).get("metadata") or {}).get("decision") if entry is not None else None
        return decided not in ("reject", "respond")

    async def _result(self, first: RunResult) -> HandoffResult:
        rec = await self.store.get_session(first.session_id)
        steps = [HandoffStep(str((rec.metadata if rec else {}).get("handoff_agent", "")), first.session_id,
                             first.stop.reason)]
        last = first
        sid = first.session_id
        while True:
            links = [x for x in await self.store.children(sid) if x.kind == LinkKind.HANDOFF.value]
            if not links or not await self._took_over(sid, links[-1]):
                break
            link = links[-1]
            found = await stored_result(self.agents[str(link.metadata.get("to"))], link.child_id)
            pkg = link.metadata.get("package") or {}
            steps.append(HandoffStep(str(link.metadata.get("to")), link.child_id,
                                     found.stop.reason if found is not None else None,
                                     RecoveryPackage(pkg.get("goal", ""), pkg.get("verified_facts", ()),
                                                     pkg.get("open_actions", ()), pkg.get("summary", ""))))
            if found is None:
                break
            last, sid = found, link.child_id
        return HandoffResult.from_run(first, answer=last, chain=tuple(steps))

