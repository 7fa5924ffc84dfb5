"""Handoff: an agent hands its task over to another with a recovery package, and the other takes
over in a session of its own.

    team = Handoffs({"triage": triage, "billing": billing, "tech": tech},
                    routes={"triage": ["billing", "tech"]}, limits={"billing": {"max_iterations": 10}})
    result = await team.run("My invoice is wrong", start="triage")
    result.output, result.stop.reason, [step.agent for step in result.chain]   # ..., COMPLETED, [triage, billing]

**The package** (:class:`RecoveryPackage`): ``goal`` (what the task is now), ``verified_facts``
(what is known for sure), ``open_actions`` (what is left to do) and a short ``summary``. The
agent hands over by calling the tool ``handoff_to_<name>`` with the package as its arguments; the
tool's JSON Schema (:data:`PACKAGE_SCHEMA`) checks it, then its content (no blank goal or summary):
a bad package is an error tool result the model reads and can fix (``invalid_arguments`` or
``invalid_handoff``), and nothing is handed over.

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
  (the decision given to the first session travels down the chain); CANCELLED / INTERRUPTED /
  FAILED_TERMINAL when the successor stopped so; FAILED_TERMINAL (error kind ``handoff_failed``)
  when it paused on its budget or failed retryably (resume that session itself to go on);
* an Interrupt or Cancel sent to it reaches the agent working now; a resume continues that agent;
* usage and cost of every successor roll up into it (``HandoffResult.usage``, ``cost_usd``).

One handoff per turn (a second call in the same turn is denied); at most ``max_handoffs`` in a
chain (then the tool answers ``handoff_limit`` and the agent must finish itself).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from attrs import field, frozen

from ..agent import Agent
from ..errors import ConfigurationError, StopRun, ToolError, WaitForHuman
from ..machine.context import RunContext
from ..middleware import Complete, Deny, Middleware, Ordering
from ..store.base import LinkKind
from ..tools.execution import idempotency_key
from ..tools.registry import Tool, ToolContext, ToolEffect
from ..types.content import ToolUseBlock, _tuple
from ..types.messages import Message, ToolResultMessage, Usage
from ..types.run import RunResult, RunStop, StopReason
from ._child import cancel_child, drive_child, stored_result
from .subagent import checked_limits, waiting_for

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

        Raises:
            ToolError: (kind ``invalid_handoff``) a goal or summary that is only blanks, or a blank fact or action.
        """
        pkg = cls(str(arguments.get("goal", "")).strip(), [str(x).strip() for x in arguments.get("verified_facts", ())],
                  [str(x).strip() for x in arguments.get("open_actions", ())], str(arguments.get("summary", "")).strip())
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
        """The successor's first user message: the package, said plainly."""
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
class HandoffResult:
    """How a handoff chain ended."""

    session_id: str
    """The first agent's session: the chain's handle (resume it, send it controls)."""
    stop: RunStop
    """The chain's stop: the first session's (see the module docstring)."""
    output: str
    """The last agent's answer."""
    output_data: Any
    """The last agent's structured answer, when it had an output schema."""
    usage: Usage
    """Tokens of every agent of the chain (rolled up into the first session)."""
    cost_usd: float | None
    """USD of every agent of the chain; ``None`` when a price was unknown."""
    chain: tuple[HandoffStep, ...]
    """The agents in the order they worked."""
    result: RunResult
    """The first session's own :class:`RunResult`."""


def _tool_name(target: str) -> str:
    return f"handoff_to_{target}"


class _HandoffStop(Middleware):
    """Ends a run at the end of the turn in which it handed over, and allows one handoff per turn."""

    name = "handoff"
    ordering = Ordering(position="innermost")

    def __init__(self, targets: Mapping[str, str]) -> None:
        self.targets = dict(targets)
        """Handoff tool name -> the target agent's name."""

    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Deny | None:
        if call.name not in self.targets or ctx.last_response is None:
            return None
        first = next(c for c in ctx.last_response.tool_calls if c.name in self.targets)
        if first.id != call.id:
            return Deny(f"only one handoff per turn: {first.name} was called first")
        return None

    def post_turn(self, ctx: RunContext) -> Complete | None:
        resp = ctx.last_response
        if resp is None:
            return None
        calls = [c for c in resp.tool_calls if c.name in self.targets]
        if not calls:
            return None
        call = calls[0]
        result = next((m for m in reversed(ctx.transcript)
                       if isinstance(m, ToolResultMessage) and m.tool_call_id == call.id), None)
        if result is None:
            return None
        target = self.targets[call.name]
        child = f"{call.name}-{idempotency_key(ctx.session_id, call.id)[:20]}"
        kind = str((result.metadata or {}).get("error") or "") if result.is_error else ""
        if not result.is_error:
            return Complete((f"handoff:{child}",), f"handed off to {target!r} (session {child}): it completed")
        if not kind.startswith("handoff_") or kind == "handoff_limit":
            return None  # a bad package or no more handoffs: the agent goes on and can fix it
        stop = kind[len("handoff_"):].upper()
        detail = f"handed off to {target!r} (session {child}), which stopped {stop}: {result.text[:400]}"
        if stop in (StopReason.CANCELLED.value, StopReason.INTERRUPTED.value, StopReason.FAILED_TERMINAL.value):
            raise StopRun(stop, detail, evidence_refs=(f"handoff:{child}",))
        raise StopRun(StopReason.FAILED_TERMINAL.value, detail + f" (resume session {child} to go on)",
                      evidence_refs=(f"handoff:{child}",),
                      error={"kind": "handoff_failed", "successor": child, "stop": stop, "message": result.text[:400]})


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
        self.agents: dict[str, Agent] = {}
        for n in names:
            a = agents[n]
            tools = [self._handoff_tool(n, t) for t in routes[n]]
            stop = _HandoffStop({_tool_name(t): t for t in routes[n]})
            self.agents[n] = Agent(a.provider, tools=[*a.tools, *tools], system_prompt=a.system_prompt,
                                   middleware=[*a.middleware, stop], observers=a.hooks.observers, config=a.config,
                                   store=a.store, worker_id=a.worker_id, lease_ttl=a.lease_ttl,
                                   control_poll=a.control_poll)

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
            child_id = f"{name}-{ctx.idempotency_key[:20]}"
            result = await drive_child(
                self.agents[target], child_id, package.message(source), parent_id=ctx.session_id,
                kind=LinkKind.HANDOFF.value, call_id=ctx.call_id, ctx=ctx,
                link_metadata={"from": source, "to": target, "hop": hop, "package": package.to_dict()},
                limits=self.limits[target], decision=ctx.decision)
            stop = result.stop
            if stop.reason is StopReason.COMPLETED:
                return result.output or "(the agent that took over answered with no text)"
            if stop.reason is StopReason.WAITING_HUMAN:
                raise WaitForHuman(f"agent {target!r} took over (session {child_id}) and waits for a person: "
                                   f"{waiting_for(stop)}. Approve to let it go on, reject or respond to answer its "
                                   "pending calls with your message", reason="handoff_waiting",
                                   allowed_decisions=("approve", "reject", "respond"))
            raise ToolError(f"Agent {target!r} took over (session {child_id}) and stopped {stop.reason.value}: "
                            f"{stop.detail}", kind=f"handoff_{stop.reason.value.lower()}")

        t = Tool(handoff, name=name, description=description, parameters=PACKAGE_SCHEMA, timeout=None,
                 effect=ToolEffect.IDEMPOTENT, resumable=True)

        @t.on_compensate
        async def _cancel(arguments: dict[str, Any], result: Any, ctx: ToolContext) -> bool:
            stopped = await cancel_child(self.agents[target], f"{name}-{ctx.idempotency_key[:20]}",
                                         "the agent that handed over was cancelled")
            return stopped is StopReason.CANCELLED

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
        """Resume the chain whose first session is ``session_id`` (``Agent.resume`` arguments:
        ``decisions`` for the first session's pending call, raised limits ...). The agent working
        when it stopped continues; nothing finished runs again.

        Raises:
            ResumeError: the session cannot be resumed, or was not started by this chain.
        """
        from ..errors import ResumeError

        rec = await self.store.get_session(session_id)
        name = (rec.metadata or {}).get("handoff_agent") if rec is not None else None
        if name not in self.agents:
            raise ResumeError(f"session {session_id!r} is not the first session of a chain of these agents")
        return await self._result(await self.agents[name].resume(session_id, **kwargs))

    async def _result(self, first: RunResult) -> HandoffResult:
        rec = await self.store.get_session(first.session_id)
        steps = [HandoffStep(str((rec.metadata if rec else {}).get("handoff_agent", "")), first.session_id,
                             first.stop.reason)]
        last = first
        sid = first.session_id
        while True:
            links = [x for x in await self.store.children(sid) if x.kind == LinkKind.HANDOFF.value]
            if not links:
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
        return HandoffResult(first.session_id, first.stop, last.output, last.output_data, first.usage,
                             first.cost_usd, tuple(steps), first)

