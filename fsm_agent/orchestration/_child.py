"""Driving one linked child session from inside a parent's tool call: the machinery shared by
the agent-as-tool, the handoff and the leader's workers.

:func:`drive_child` starts the child once, or finds it again: a child that finished is taken as
it is (never run twice), one cut by its parent's interrupt or left mid-run by a crash is resumed
(waiting, when needed, for the dead worker's lease to run out), one waiting for a person is
resumed only with the person's decision. A session that exists under the child's id but was not
started by this call is never taken over (:class:`~fsm_agent.errors.SessionLinkError`). When the
parent's call is cancelled (an Interrupt, a Cancel, ``Task.cancel()``), the cancellation runs into
the child's own run, which records INTERRUPTED at its checkpoint; the usage it had used by then is
rolled up first.

:func:`roll_up` adds to the parent the part of the child's usage and cost the parent has not
counted yet (the parent's log keeps a ``usage_rolled_up`` event per roll-up, so a call run again
after a resume never counts the child twice).

:func:`child_answer` is the one mapping of a child's stop to what its parent's call gets (an
answer, an error result, a call left open, a wait for a person); :func:`waiting_on` says what a
waiting child waits for, following nested waits down; :func:`compensate_by_cancelling` is the
one ``on_compensate`` hook of the patterns (a Cancel of the parent cancels its children).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import orjson

from ..agent import Agent
from ..control import Cancel, Decision
from ..errors import (
    ConfigurationError,
    SessionBusyError,
    SessionExistsError,
    SessionLinkError,
    SuspendCall,
    ToolError,
    WaitForHuman,
)
from ..config import RunConfig
from ..context import RunContext
from ..machine.state import RunState
from ..store.base import ControlKind, ControlRecord, SessionRecord, Store
from ..store.sessions import load_session
from ..tools.registry import Tool, ToolContext
from ..types.codec import structure
from ..types.content import ToolUseBlock
from ..types.messages import AssistantMessage, Message, Usage
from ..types.plan import one_line
from ..types.run import RunResult, RunStop, StopReason
from .links import claim_child

__all__ = [
    "CHILD_HOSTS",
    "CHILD_OF",
    "ChildHosts",
    "Children",
    "Counted",
    "cancel_child",
    "checked_limits",
    "child_answer",
    "compensate_by_cancelling",
    "drive_child",
    "first_of_turn",
    "forwardable",
    "roll_up",
    "stored_result",
    "waiting_on",
]

LEASE_WAIT = 120.0
"""Seconds :func:`drive_child` waits, at most, for another worker's lease of the child to end."""
INHERITED_METADATA = ("tenant",)
"""Session metadata a child copies from its parent when it is created: ``tenant``, the owner the
server (:mod:`fsm_agent.server`) gives each session, so that exactly who may read the parent may
read its children (an untagged child would belong to no tenant, or to the wrong one)."""
CHILD_OF = "child_of"
"""Session metadata key of a child :func:`drive_child` created: ``{"session": parent id, "call":
parent call id}``. A session under the child's id without it (or with another one) was not
started by that call and is never driven as its child."""
FORWARDED_DECISIONS = ("approve", "reject", "respond")
"""The decision kinds a parent's call passes on to the calls its waiting child waits on."""
MAX_WAIT_DEPTH = 8
"""How deep :func:`waiting_on` follows a wait through waiting children."""


class ChildHosts(Protocol):
    """Where the child sessions started in this context run, when their agent has no host of its own
    (a Temporal worker's activity sets one: the children become workflows on its client and task
    queue, :mod:`fsm_agent.temporal`)."""

    def host_for(self, agent: Agent, *, parent_id: str, call_id: str | None) -> Any:
        """A durable host for ``agent``'s child session (with ``attach`` and ``stop_child``), or
        ``None`` when this host cannot serve that agent (it then runs here, in process)."""


CHILD_HOSTS: contextvars.ContextVar[ChildHosts | None] = contextvars.ContextVar("fsm_agent_child_hosts",
                                                                                default=None)
"""The :class:`ChildHosts` of the current context (``None``: children run in process)."""


def hosted(agent: Agent, *, parent_id: str, call_id: str | None) -> Agent:
    """``agent``, or, when it has no host and the context has :data:`CHILD_HOSTS` that serve it, a
    shallow copy of it driven by that host (its store, tools and config are the same objects)."""
    hosts = CHILD_HOSTS.get()
    if agent.host is not None or hosts is None:
        return agent
    host = hosts.host_for(agent, parent_id=parent_id, call_id=call_id)
    if host is None:
        return agent
    twin = copy.copy(agent)
    twin.host = host
    _IN_PROCESS[twin] = agent
    return twin


_IN_PROCESS: weakref.WeakKeyDictionary[Agent, Agent] = weakref.WeakKeyDictionary()
"""The agent each :func:`hosted` copy was made from, for what runs in process."""


def _terminal(state: str) -> StopReason | None:
    try:
        return StopReason(state)
    except ValueError:
        return None


def checked_limits(agent: Agent, limits: Mapping[str, Any] | None, who: str) -> dict[str, Any]:
    """``limits`` as RunConfig overrides for ``agent``'s runs, checked now rather than at the first call.

    Raises:
        ConfigurationError: a name that is no RunConfig field, or a value RunConfig refuses.
    """
    out = dict(limits or {})
    names = {a.name for a in attrs.fields(RunConfig)}
    unknown = sorted(set(out) - names)
    if unknown:
        raise ConfigurationError(f"{who}: unknown limit(s) {', '.join(unknown)}; the RunConfig fields are "
                                 f"{', '.join(sorted(names))}")
    attrs.evolve(agent.config, **out)  # RunConfig checks the values (ConfigurationError)
    return out


def _capped(agent: Agent, limits: Mapping[str, Any] | None, left: Mapping[str, float]) -> dict[str, Any]:
    """``limits`` with the child's token and cost budgets lowered to what its parent has ``left``
    (``ToolContext.budget_left``), where the child's own are larger or unset."""
    out = dict(limits or {})
    own = attrs.evolve(agent.config, **out)
    if "max_tokens" in left:
        cap = max(1, int(left["max_tokens"]))
        if own.max_tokens is None or own.max_tokens > cap:
            out["max_tokens"] = cap
    if "max_cost_usd" in left:
        cost_cap = max(0.0, float(left["max_cost_usd"]))
        if own.max_cost_usd is None or own.max_cost_usd > cost_cap:
            out["max_cost_usd"] = cost_cap
    return out


async def stored_result(agent: Agent, session_id: str) -> RunResult | None:
    """The :class:`RunResult` of a stored session as it stands (stop, last answer, usage, cost,
    structured output), without running anything; ``None`` for an unknown session."""
    loaded = await load_session(agent.store, session_id)
    if loaded is None:
        return None
    rec = loaded.record
    state = structure(loaded.state_data, RunState) if loaded.state_data is not None else RunState()
    stop = structure(rec.stop, RunStop) if rec.stop else RunStop(StopReason.FAILED_RETRYABLE,
                                                                 f"session {session_id} has not stopped ({rec.state})")
    output = next((m.text for m in reversed(loaded.transcript) if isinstance(m, AssistantMessage) and m.text.strip()),
                  "")
    return RunResult(session_id, stop, output, tuple(loaded.transcript), state.usage, state.turn,
                     state.tool_calls_made, None, state.cost_usd, 0.0, state.metadata.get("output_data"))


async def _resume_when_free(agent: Agent, session_id: str, *, decisions: Mapping[str, Decision] | None = None,
                            confirm_cancel: bool = False, wait: float = LEASE_WAIT) -> RunResult:
    """Resume, waiting up to ``wait`` seconds for a lease held by a worker that died (or is finishing)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return await agent.resume(session_id, decisions=decisions, confirm_cancel=confirm_cancel)
        except SessionBusyError:
            rec = await agent.store.get_session(session_id)
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            until = (rec.lease_until or 0) - time.time() if rec is not None else 0
            await asyncio.sleep(min(left, max(0.05, min(until + 0.05, 1.0))))


def _forwarded(stop: RunStop, decision: Decision) -> dict[str, Decision]:
    """A parent's decision on its waiting call, as a decision on each of the child's pending calls
    that accepts its kind."""
    out: dict[str, Decision] = {}
    for p in stop.pending_actions:
        kind = decision.kind if decision.kind in p.allowed_decisions else None
        if kind == "approve":
            out[p.call.id] = Decision.approve()
        elif kind == "reject":
            out[p.call.id] = Decision.reject(decision.message or "rejected by a person")
        elif kind == "respond":
            out[p.call.id] = Decision.respond(decision.message, is_error=decision.is_error)
    return out


def _owned(rec: SessionRecord, marker: Mapping[str, Any]) -> bool:
    return isinstance(rec.metadata, dict) and rec.metadata.get(CHILD_OF) == dict(marker)


def _not_ours(child_id: str, parent_id: str, call_id: str | None) -> SessionLinkError:
    by = f" by call {call_id}" if call_id else ""
    return SessionLinkError(
        f"session {child_id!r} exists already and was not started by session {parent_id!r}{by}: it is not taken "
        "over as that call's child (nothing was run in it). Delete or rename that session, or call again "
        "(another call names another child)")


async def drive_child(
    agent: Agent,
    child_id: str,
    task: str | Message | Sequence[Message],
    *,
    parent_id: str,
    kind: str,
    call_id: str | None = None,
    link_metadata: Mapping[str, Any] | None = None,
    limits: Mapping[str, Any] | None = None,
    decision: Decision | None = None,
    ctx: ToolContext | None = None,
    counted: Counted | None = None,
) -> RunResult:
    """Run (or find again) the child session ``child_id`` of ``parent_id`` and return its result.

    * unknown: linked (``kind``, ``call_id``), then run with ``task`` and ``limits`` (RunConfig fields),
      its session given the parent's :data:`INHERITED_METADATA` and :data:`CHILD_OF`; with ``ctx``,
      its token and cost budgets are capped at what the parent's run has left
      (``ToolContext.budget_left``);
    * COMPLETED, FAILED_*, CANCELLED, PAUSED_BUDGET: its stored result, nothing runs;
    * INTERRUPTED or left mid-run: resumed (its own checkpoint and ledger: nothing done twice);
    * WAITING_HUMAN: resumed with ``decision`` passed on to each of its pending calls that accepts
      its kind (``approve``, ``reject``, ``respond``; a confirmed cancel for ``approve`` when it waits
      for one), else its stored result.

    With ``ctx`` (the parent's tool call), the child's usage and cost roll up into the parent
    (:func:`roll_up`, with ``counted``: this run of the call's roll-ups so far) when it stops, and
    when the call is cancelled.

    Raises:
        asyncio.CancelledError: the parent's call was cancelled; the child stopped INTERRUPTED first.
        SessionLinkError: ``child_id`` belongs to another parent or call, or is a session this call
            did not start (it is left untouched).
        SessionBusyError: another worker kept the child's lease for :data:`LEASE_WAIT` seconds.
        StoreError: the store failed.
    """
    agent = hosted(agent, parent_id=parent_id, call_id=call_id)
    store = agent.store
    counted = {} if counted is None else counted
    _link, created = await claim_child(store, parent_id, child_id, kind, call_id=call_id, metadata=link_metadata)
    marker = {"session": parent_id, "call": call_id}
    rec = await store.get_session(child_id)
    if rec is not None and (created or not _owned(rec, marker)):
        raise _not_ours(child_id, parent_id, call_id)
    parent = await store.get_session(parent_id)
    metadata: dict[str, Any] = {k: parent.metadata[k] for k in INHERITED_METADATA
                                if parent is not None and isinstance(parent.metadata, dict) and k in parent.metadata}
    metadata[CHILD_OF] = marker
    if rec is None and ctx is not None:
        limits = _capped(agent, limits, ctx.budget_left())
    # The child runs in a task of its own, cancelled once when this call is: the parent's driver may
    # cancel the call several times while it stops, and the child must finish recording its stop
    # (INTERRUPTED, at its checkpoint) before the call ends.
    run = asyncio.ensure_future(_drive(agent, child_id, task, limits, decision, metadata, rec))
    try:
        result = await asyncio.shield(run)
    except asyncio.CancelledError:
        run.cancel()
        await _settle(run)
        if ctx is not None:
            await _settle(asyncio.ensure_future(roll_up(ctx, agent, child_id, counted)))
        raise
    if ctx is not None:
        await roll_up(ctx, agent, child_id, counted, result)
    return result


async def _settle(fut: asyncio.Future[Any]) -> None:
    """Wait for ``fut`` to end while this task is being cancelled (again): bounded work that must
    complete (a stop being recorded, a roll-up). Its own outcome is not raised."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except Exception:  # noqa: BLE001 - reported by the caller's next step, not here
            break
    if fut.done() and not fut.cancelled():
        fut.exception()  # retrieved: no "exception was never retrieved" warning


async def _drive(agent: Agent, child_id: str, task: str | Message | Sequence[Message],
                 limits: Mapping[str, Any] | None, decision: Decision | None,
                 metadata: Mapping[str, Any], rec: SessionRecord | None) -> RunResult:
    host = agent.host
    if host is None or not hasattr(host, "attach"):
        return await _drive_here(agent, child_id, task, limits, decision, metadata, rec)
    # a durable host (a workflow per child): a run of it already going (started by an earlier attempt
    # of this call, on a worker that was lost) is waited for, never started again; when this call is
    # cancelled, the child's run is interrupted and its stop waited for
    try:
        if rec is None or _terminal(rec.state) in (None, StopReason.INTERRUPTED):
            found = await host.attach(agent, child_id, metadata[CHILD_OF])
            if found is not None:
                return found  # type: ignore[no-any-return]
        return await _drive_here(agent, child_id, task, limits, decision, metadata, rec)
    except asyncio.CancelledError:
        await host.stop_child(agent, child_id, "interrupt", "the parent's call was cut")
        raise


async def _drive_here(agent: Agent, child_id: str, task: str | Message | Sequence[Message],
                      limits: Mapping[str, Any] | None, decision: Decision | None,
                      metadata: Mapping[str, Any], rec: SessionRecord | None) -> RunResult:
    if rec is None:
        try:
            return await agent.run(task, session_id=child_id, metadata=metadata, **dict(limits or {}))
        except SessionExistsError:  # created meanwhile: by a racing start of the same call, or not ours
            host = agent.host
            if host is not None and hasattr(host, "attach"):
                found = await host.attach(agent, child_id, metadata[CHILD_OF])
                if found is not None:
                    return found  # type: ignore[no-any-return]
            rec = await agent.store.get_session(child_id)
            if rec is None or not _owned(rec, metadata[CHILD_OF]):
                marker = metadata[CHILD_OF]
                raise _not_ours(child_id, marker["session"], marker["call"]) from None
            return await _resume_when_free(agent, child_id)
    stopped = _terminal(rec.state)
    if stopped is StopReason.WAITING_HUMAN and decision is not None:
        current = await stored_result(agent, child_id)
        assert current is not None
        decisions = _forwarded(current.stop, decision)
        if decisions:
            return await _resume_when_free(agent, child_id, decisions=decisions)
        if current.stop.required_decision == "confirm_cancel" and decision.kind == "approve":
            return await _resume_when_free(agent, child_id, confirm_cancel=True)
        return current
    if stopped is None or stopped is StopReason.INTERRUPTED:
        return await _resume_when_free(agent, child_id)
    found = await stored_result(agent, child_id)
    assert found is not None
    return found


Counted = dict[str, tuple[Usage, float]]
"""Usage and USD rolled up per child by one run of a tool call (:func:`roll_up`)."""


async def roll_up(ctx: ToolContext, agent: Agent, child_id: str, counted: Counted,
                  result: RunResult | None = None) -> None:
    """Add to the parent's run (``ctx.add_usage``) the child's usage and cost not rolled up before.

    What was counted: the parent's committed log (its ``usage_rolled_up`` events naming
    ``child_id``, read the first time this run of the call rolls the child up), then ``counted``,
    where this run of the call keeps its own roll-ups (they reach the log at the parent's next
    commit). ``result``: the child's result when the caller has it (else it is read from the store).
    A child whose cost is unknown makes the parent's cost unknown."""
    found = result if result is not None else await stored_result(agent, child_id)
    if found is None:
        return
    if child_id not in counted:
        logged, logged_cost = Usage(), 0.0
        for ev in await agent.store.read_events(ctx.session_id, types=("usage_rolled_up",)):
            if ev.payload.get("child_session_id") == child_id:
                logged = logged + structure(ev.payload.get("usage") or {}, Usage)
                logged_cost += float(ev.payload.get("cost_usd") or 0.0)
        counted.setdefault(child_id, (logged, logged_cost))
    before, before_cost = counted[child_id]
    total = found.usage
    delta = Usage(max(0, total.input_tokens - before.input_tokens),
                  max(0, total.output_tokens - before.output_tokens),
                  max(0, total.cache_read_tokens - before.cache_read_tokens),
                  max(0, total.cache_write_tokens - before.cache_write_tokens),
                  max(0, total.reasoning_tokens - before.reasoning_tokens), total.estimated)
    cost = None if found.cost_usd is None else max(0.0, found.cost_usd - before_cost)
    if delta.total_tokens == 0 and cost == 0.0:
        return
    counted[child_id] = (before + delta, before_cost + (cost or 0.0))
    ctx.add_usage(delta, cost, child_session_id=child_id)


# -- what a child's stop becomes for its parent's call --------------------------------------------

def _call_text(call: ToolUseBlock) -> str:
    return f"{call.name}({one_line(orjson.dumps(call.input).decode(), 200)})"


async def waiting_on(store: Store, session_id: str, stop: RunStop, *, depth: int = 0) -> str:
    """What the WAITING_HUMAN session ``session_id`` (stopped ``stop``) waits for, in words: each
    pending call (name, arguments, reason); a pending call that is itself a waiting child session
    (an agent tool, a handoff, a team's dispatch) is followed down to the calls that really wait,
    with the path of sessions (``outer → session outer-…: send({"to":"zed"}) [needs approval]``).
    Without pending calls: the decision it requires (a confirmation of a cancel).

    Raises:
        StoreError: the store could not be read.
    """
    if not stop.pending_actions:
        return one_line(stop.detail, 400) if stop.required_decision == "confirm_cancel" else \
            (stop.required_decision or "a decision")
    links = await store.children(session_id) if depth < MAX_WAIT_DEPTH else []
    parts: list[str] = []
    for p in stop.pending_actions:
        below: list[str] = []
        for link in links:
            if link.call_id != p.call.id:
                continue
            rec = await store.get_session(link.child_id)
            if rec is not None and rec.state == StopReason.WAITING_HUMAN.value and rec.stop:
                inner = await waiting_on(store, link.child_id, structure(rec.stop, RunStop), depth=depth + 1)
                below.append(f"session {link.child_id}: {inner}")
        if below:
            parts.append(f"{p.call.name} → " + "; ".join(below))
        else:
            parts.append(f"{_call_text(p.call)} [{p.reason}]")
    return ", ".join(parts)


def forwardable(stops: Sequence[RunStop]) -> tuple[str, ...]:
    """The decision kinds a parent's call may take for children stopped WAITING_HUMAN with ``stops``:
    those every pending call accepts (of :data:`FORWARDED_DECISIONS`), or those some call accepts
    when no kind suits all (a call that does not accept the kind given keeps waiting); ``approve``
    alone for a child that waits for the confirmation of its cancel."""
    kinds: list[set[str]] = []
    for stop in stops:
        if stop.pending_actions:
            kinds += [set(p.allowed_decisions) & set(FORWARDED_DECISIONS) for p in stop.pending_actions]
        else:
            kinds.append({"approve"})
    common = set.intersection(*kinds) if kinds else set(FORWARDED_DECISIONS)
    chosen = common or set().union(*kinds) or {"approve"}
    return tuple(k for k in FORWARDED_DECISIONS if k in chosen)


def _how(allowed: Sequence[str]) -> str:
    says = {"approve": "approve to let it go on", "reject": "reject to refuse its pending calls with your message",
            "respond": "respond to answer its pending calls with your message"}
    return "; ".join(says[k] for k in allowed).capitalize()


_WHAT_TO_DO: Mapping[StopReason, str] = {
    StopReason.PAUSED_BUDGET: "Give it a smaller task, or go on without it.",
    StopReason.FAILED_RETRYABLE: "It may work if called again later.",
    StopReason.FAILED_TERMINAL: "Calling it again with the same task will fail the same way.",
    StopReason.CANCELLED: "It was cancelled from outside; do not call it again for this task.",
    StopReason.INTERRUPTED: "It was interrupted from outside; its session can be resumed by whoever stopped it.",
}


def _short(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def child_answer(agent: Agent, result: RunResult, *, label: str, prefix: str, structured: bool = False,
                       suspend: frozenset[StopReason] = frozenset()) -> str:
    """What the parent's call gets for its child's ``result`` (the one mapping of the patterns):

    * COMPLETED: the answer (``structured``: the structured answer as JSON);
    * WAITING_HUMAN: :class:`WaitForHuman` (reason ``<prefix>_waiting``), naming what the child
      waits for (:func:`waiting_on`) and accepting the decisions it can pass on (:func:`forwardable`);
      a ``reject`` runs the call again, to pass it on;
    * a stop in ``suspend``: :class:`SuspendCall` (reason ``<prefix>_<stop>``): the call stays open
      and a resume of the parent runs it again, which continues the child;
    * any other stop: :class:`ToolError` (kind ``<prefix>_<stop>``) naming the stop, why, the
      partial answer and what the caller can do.

    ``label`` names the child in the texts (``sub-agent 'x' (session …)``).

    Raises:
        WaitForHuman, SuspendCall, ToolError: as above.
        StoreError: the store could not be read.
    """
    stop = result.stop
    if stop.reason is StopReason.COMPLETED:
        if structured and result.output_data is not None:
            return orjson.dumps(result.output_data).decode()
        return result.output or "(it answered with no text)"
    if stop.reason is StopReason.WAITING_HUMAN:
        allowed = forwardable([stop])
        what = await waiting_on(agent.store, result.session_id, stop)
        raise WaitForHuman(f"{label} waits for a person: {what}. {_how(allowed)}", reason=f"{prefix}_waiting",
                           allowed_decisions=allowed, run_on_reject=True)
    code = f"{prefix}_{stop.reason.value.lower()}"
    said = f"{label[:1].upper()}{label[1:]} stopped {stop.reason.value}: {_short(stop.detail, 400)}."
    if stop.reason in suspend:
        raise SuspendCall(f"{said} Resume session {result.session_id} (with a larger budget if it ran out), or "
                          "resume this session, which continues it", reason=code)
    partial = f" Its last answer: {_short(result.output, 600)!r}." if result.output.strip() else ""
    raise ToolError(f"{said}{partial} {_WHAT_TO_DO.get(stop.reason, '')}".strip(), kind=code)


# -- cancel --------------------------------------------------------------------------------------

async def cancel_child(agent: Agent, child_id: str, reason: str, *, confirm: bool = False) -> StopReason | None:
    """Cancel a child that has not finished, wherever it stopped: a Cancel is queued and the child
    is resumed to apply it (its own compensation hooks run, or it stops WAITING_HUMAN for a person to
    confirm side effects that cannot be undone). ``confirm``: a person confirmed the cancel: a child
    waiting for that confirmation gets it. Returns the child's stop after that, or ``None`` for an
    unknown child. A child that finished is left as it is (its stop is returned).

    Raises:
        SessionBusyError: another worker kept the child's lease for :data:`LEASE_WAIT` seconds.
        StoreError: the store failed.
    """
    rec = await agent.store.get_session(child_id)
    if rec is None:
        return None
    stopped = _terminal(rec.state)
    if stopped is not None and not stopped.resumable:
        return stopped
    host = agent.host
    if host is not None and hasattr(host, "stop_child") and not confirm:
        found = await host.stop_child(agent, child_id, "cancel", reason or Cancel().reason)
        if found is not None:  # its workflow was open: it applied the Cancel
            return found.stop.reason  # type: ignore[no-any-return]
        # no workflow of it is open (its wait ran out): a child hosted for this context is cancelled
        # here, in process, from the store (a new workflow would not see a Cancel queued in the store)
        agent = _IN_PROCESS.get(agent, agent)
    awaits_confirmation = (rec.stop or {}).get("required_decision") == "confirm_cancel"
    if confirm and stopped is StopReason.WAITING_HUMAN and awaits_confirmation:
        return (await _resume_when_free(agent, child_id, confirm_cancel=True)).stop.reason
    text = reason or Cancel().reason
    await agent.store.push_control(ControlRecord(child_id, ControlKind.CANCEL, text))
    result = await _resume_when_free(agent, child_id, confirm_cancel=confirm)
    return result.stop.reason


Children = Callable[[Mapping[str, Any], ToolContext], Sequence[tuple[Agent, str]]]
"""``(arguments, ctx) -> [(agent, child session id), ...]``: the children of a call."""


def compensate_by_cancelling(tool: Tool, children: Children, reason: str) -> None:
    """Give ``tool`` its ``on_compensate`` hook: a Cancel of the parent cancels each child of the call
    (``children(arguments, ctx)``: ``(agent, child session id)`` pairs) under the child's own rules
    (:func:`cancel_child`). The call counts as undone when a child was cancelled and none is left
    unfinished. A child that waits for a person to confirm its cancel makes the hook raise
    :class:`WaitForHuman`, so the parent waits for that confirmation too (``confirm_cancel``); the
    person's confirmation of the parent's cancel is passed on."""

    async def compensate(arguments: dict[str, Any], result: Any, ctx: ToolContext) -> bool:
        confirm = ctx.decision is not None and ctx.decision.kind == "approve"
        stops = [(agent, cid, await cancel_child(hosted(agent, parent_id=ctx.session_id, call_id=ctx.call_id), cid,
                                                 reason, confirm=confirm))
                 for agent, cid in children(arguments, ctx)]
        waiting = [(agent, cid) for agent, cid, s in stops if s is StopReason.WAITING_HUMAN]
        if waiting and not confirm:
            parts = []
            for agent, cid in waiting:
                rec = await agent.store.get_session(cid)
                stop = structure(rec.stop, RunStop) if rec is not None and rec.stop else None
                parts.append(f"session {cid}: " + (await waiting_on(agent.store, cid, stop) if stop else "a decision"))
            raise WaitForHuman("its cancel waits for a person to confirm, in the child session(s): " + "; ".join(parts),
                               reason="child_cancel_unconfirmed", allowed_decisions=("approve",))
        return any(s is StopReason.CANCELLED for _, _, s in stops) and \
            not any(s is not None and s.resumable for _, _, s in stops)

    tool.on_compensate(compensate)


def first_of_turn(ctx: RunContext, names: Mapping[str, Any] | Sequence[str]) -> ToolUseBlock | None:
    """The first call of the current turn to one of the tools ``names`` (one such call per turn)."""
    if ctx.last_response is None:
        return None
    return next((c for c in ctx.last_response.tool_calls if c.name in names), None)
