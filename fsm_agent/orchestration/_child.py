"""Driving one linked child session from inside a parent's tool call: the machinery shared by
the agent-as-tool, the handoff and the leader's workers.

:func:`drive_child` starts the child once, or finds it again: a child that finished is taken as
it is (never run twice), one cut by its parent's interrupt or left mid-run by a crash is resumed
(waiting, when needed, for the dead worker's lease to run out), one waiting for a person is
resumed only with the person's decision. When the parent's call is cancelled (an Interrupt, a
Cancel, ``Task.cancel()``), the cancellation runs into the child's own run, which records
INTERRUPTED at its checkpoint; the usage it had used by then is rolled up first.

:func:`roll_up` adds to the parent the part of the child's usage and cost the parent has not
counted yet (the parent's log keeps a ``usage_rolled_up`` event per roll-up, so a call run again
after a resume never counts the child twice).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..agent import Agent
from ..control import Cancel, Decision
from ..errors import SessionBusyError, SessionExistsError
from ..machine.state import RunState
from ..store.base import ControlKind, ControlRecord
from ..store.sessions import load_session
from ..tools.registry import ToolContext
from ..types.codec import structure
from ..types.messages import AssistantMessage, Message, Usage
from ..types.run import RunResult, RunStop, StopReason
from .links import link_child

__all__ = ["Counted", "cancel_child", "drive_child", "roll_up", "stored_result"]

LEASE_WAIT = 120.0
"""Seconds :func:`drive_child` waits, at most, for another worker's lease of the child to end."""
INHERITED_METADATA = ("tenant",)
"""Session metadata a child copies from its parent when it is created: ``tenant``, the owner the
server (:mod:`fsm_agent.server`) gives each session, so that exactly who may read the parent may
read its children (an untagged child would belong to no tenant, or to the wrong one)."""


def _terminal(state: str) -> StopReason | None:
    try:
        return StopReason(state)
    except ValueError:
        return None


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


def _approve_all(stop: RunStop, decision: Decision) -> dict[str, Decision]:
    """A parent's decision on its waiting call, applied to each of the child's pending calls."""
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
      its session given the parent's :data:`INHERITED_METADATA`;
    * COMPLETED, FAILED_*, CANCELLED, PAUSED_BUDGET: its stored result, nothing runs;
    * INTERRUPTED or left mid-run: resumed (its own checkpoint and ledger: nothing done twice);
    * WAITING_HUMAN: resumed with ``decision`` applied to each of its pending calls when given
      (``approve``, ``reject``, ``respond``), else its stored result.

    With ``ctx`` (the parent's tool call), the child's usage and cost roll up into the parent
    (:func:`roll_up`, with ``counted``: this run of the call's roll-ups so far) when it stops, and
    when the call is cancelled.

    Raises:
        asyncio.CancelledError: the parent's call was cancelled; the child stopped INTERRUPTED first.
        SessionLinkError: ``child_id`` belongs to another parent or call.
        SessionBusyError: another worker kept the child's lease for :data:`LEASE_WAIT` seconds.
        StoreError: the store failed.
    """
    store = agent.store
    counted = {} if counted is None else counted
    await link_child(store, parent_id, child_id, kind, call_id=call_id, metadata=link_metadata)
    # The child runs in a task of its own, cancelled once when this call is: the parent's driver may
    # cancel the call several times while it stops, and the child must finish recording its stop
    # (INTERRUPTED, at its checkpoint) before the call ends.
    parent = await store.get_session(parent_id)
    inherited = {k: parent.metadata[k] for k in INHERITED_METADATA
                 if parent is not None and isinstance(parent.metadata, dict) and k in parent.metadata}
    run = asyncio.ensure_future(_drive(agent, child_id, task, limits, decision, inherited))
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
                 metadata: Mapping[str, Any]) -> RunResult:
    rec = await agent.store.get_session(child_id)
    if rec is None:
        try:
            return await agent.run(task, session_id=child_id, metadata=metadata, **dict(limits or {}))
        except SessionExistsError:  # created by a racing start of the same call: find it again
            return await _resume_when_free(agent, child_id)
    stopped = _terminal(rec.state)
    if stopped is StopReason.WAITING_HUMAN and decision is not None:
        current = await stored_result(agent, child_id)
        assert current is not None
        decisions = _approve_all(current.stop, decision)
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


async def cancel_child(agent: Agent, child_id: str, reason: str) -> StopReason | None:
    """Cancel a child that has not finished, wherever it stopped: a Cancel is queued and the child
    is resumed to apply it (its own compensation hooks run, or it stops WAITING_HUMAN for a person to
    confirm side effects that cannot be undone). Returns the child's stop after that, or ``None``
    for an unknown child. A child that finished is left as it is (its stop is returned).

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
    text = reason or Cancel().reason
    await agent.store.push_control(ControlRecord(child_id, ControlKind.CANCEL, text))
    result = await _resume_when_free(agent, child_id)
    return result.stop.reason

