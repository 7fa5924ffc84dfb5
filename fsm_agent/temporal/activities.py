"""The activities of a session's workflow: every effect that leaves the workflow.

* ``fsm_agent.model_call``: one logical model call through the agent's provider (its own HTTP
  retries, honouring Retry-After, included), streamed when configured; live deltas go to the
  worker's observers, never into the workflow's history (over PostgreSQL, an observer of
  ``fsm_agent.server.queue.PgLiveDeltas.attach`` sends them on to every server's event streams).
  It heartbeats, so a dead worker is seen in seconds. A provider error is non-retryable here: the
  provider has already retried what could be, and the engine decides (FAILED_RETRYABLE or
  FAILED_TERMINAL, as in process).
* ``fsm_agent.run_tool`` and ``fsm_agent.tool_hook``: a tool call and a tool's recovery hook, with
  the same idempotency key on every attempt (it is the session's and the call's, not the attempt's).
  The workflow sets the retry policy from the tool's declared effect.
* ``fsm_agent.apply_writes``: the journal's writes the workflow made since the last activity.
  Every activity applies the writes it carries first, so a ledger ``started`` lands before its tool
  runs. Applying is idempotent (a retried activity applies a batch once).
* ``fsm_agent.load_session``: what a workflow needs to continue a session the store holds.
* ``fsm_agent.system_prompt``: the agent's system prompt now (version, text, digest, source), run
  as a local activity at a session's start and at each PreTurn (its prompt file read again).

Messages cross the line once: a request's messages that an earlier call already stored (in the
session's store, by content hash) are sent as references, so a session's history grows with its
length, not with its square.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from ..control import Decision
from ..errors import ProviderError, SessionExistsError, SuspendCall
from ..machine.live import LivePort
from ..machine.port import EffectPort, ModelTrace
from ..otel import activity_port
from ..store.base import Checkpoint, LedgerEntry, SessionLink, SessionRecord, Store, WriteBatch
from ..store.sessions import upgrade_event
from ..tools.registry import ToolContext
from ..types.codec import structure, unstructure
from ..types.content import ToolUseBlock
from ..types.events import ModelStreamEvent, ToolProgress, UsageRolledUp
from ..types.requests import MessageRequest
from ..types.stream import StreamEvent
from ._codec import exception_form, form, message_digest, value_of
from .children import children_as_workflows
from .registry import agent_named, provider_named

__all__ = ["ACTIVITIES", "MESSAGE_KEY", "apply_writes", "load_session", "message_digest", "model_call",
           "plugin_effect", "run_tool", "system_prompt", "tool_hook"]

log = logging.getLogger("fsm_agent.temporal")

MESSAGE_KEY = "msg:"
"""Key prefix of a message's form in the session's key-value records (``msg:<sha256>``)."""

HEARTBEAT_EVERY = 1.0
"""Seconds between an activity's heartbeats."""


# -- writes ------------------------------------------------------------------------------------------
async def _apply(store: Store, writes: list[dict[str, Any]]) -> None:
    """Apply the workflow's queued writes to the real store, each at most once."""
    for w in writes:
        op = w["op"]
        if op == "create":
            try:
                await store.create_session(structure(w["record"], SessionRecord))
            except SessionExistsError:
                pass
        elif op == "write":
            batch = structure(w["batch"], WriteBatch)
            rec = await store.get_session(batch.session_id)
            if rec is not None and batch.events and rec.last_seq >= batch.events[-1].seq:
                continue  # applied by an earlier attempt of this activity
            if batch.checkpoint is not None and await store.get_checkpoint(batch.checkpoint.checkpoint_id) is not None:
                continue
            await store.write(batch)
        elif op == "metadata":
            await store.update_metadata(w["session_id"], w["metadata"], w.get("goal_version"))
        elif op == "claim":
            await store.claim_idempotency_key(w["session_id"], w["key"], w["value"])
        elif op == "link":
            await store.link_session(structure(w["link"], SessionLink))
        else:  # pragma: no cover - the mirror queues only these
            raise ApplicationError(f"unknown write {op!r}", non_retryable=True)


@contextlib.asynccontextmanager
async def _heartbeating() -> AsyncIterator[None]:
    """Heartbeat every :data:`HEARTBEAT_EVERY` seconds while the block runs (so a worker that dies is
    noticed within the workflow's heartbeat timeout, not its whole start-to-close timeout)."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_EVERY)

    task = asyncio.ensure_future(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def _children() -> AsyncIterator[None]:
    """Child sessions the activity's tool starts run as workflows on this worker's client and task queue."""
    with children_as_workflows(activity.client(), activity.info().task_queue):
        yield


def _error(exc: BaseException, retryable: bool = False, **extra: Any) -> ApplicationError:
    return ApplicationError(f"{type(exc).__name__}: {exc}", {"exception": exception_form(exc), **extra},
                            type=type(exc).__name__, non_retryable=not retryable)


# -- activities ----------------------------------------------------------------------------------------
def _traced(agent: Any, port: EffectPort, session_id: str, turn: int) -> EffectPort:
    """``port`` with OpenTelemetry spans, when the agent's runs are traced (``chat`` and
    ``execute_tool`` spans, children of the activity's span when Temporal's TracingInterceptor is on)."""
    inst = agent._instrumentation()
    if inst is None:
        return port
    return activity_port(port, session_id=session_id, turn=turn, instrumentation=inst)


@activity.defn(name="fsm_agent.apply_writes")
async def apply_writes(data: dict[str, Any]) -> None:
    """Apply the writes the workflow queued (at a stop, before it waits or ends)."""
    agent = agent_named(data["agent"])
    await _apply(agent.store, data["writes"])


@activity.defn(name="fsm_agent.model_call")
async def model_call(data: dict[str, Any]) -> dict[str, Any]:
    """One model call (see the module doc). Returns ``{"response", "trace", "retries"}`` (``trace``: the
    streamed text as one piece, for a call the run cuts after it returned; never the deltas)."""
    agent = agent_named(data["agent"])
    store = agent.store
    await _apply(store, data["writes"])
    sid = data["session_id"]
    provider = provider_named(data["agent"], data["provider"])
    forms = await _messages(store, sid, data["messages"])
    request = structure({**data["request"], "messages": forms}, MessageRequest)
    trace = ModelTrace()
    retries: list[dict[str, Any]] = []

    async def on_retry(exc: ProviderError, attempt: int, delay_s: float) -> None:
        retries.append({"exception": exception_form(exc), "attempt": attempt, "delay_s": delay_s})

    live = (data.get("events", True) and agent.hooks.wants(ModelStreamEvent)
            and not agent.chain.filters_model_events)

    async def on_event(event: StreamEvent) -> None:
        # live deltas reach the worker's observers (never the workflow's history); when a plugin
        # filters stream events (redaction), only the engine may show them, so none go live here
        await agent.hooks.emit(ModelStreamEvent(sid, data["turn"], event, data["phase"]))

    port = _traced(agent, LivePort(store), sid, data["turn"])
    try:
        async with _heartbeating():
            response = await port.call_model(provider, request, stream=data["stream"],
                                             on_event=on_event if live else None, on_retry=on_retry, trace=trace,
                                             deadline_s=data.get("deadline_s"))
    except ProviderError as exc:
        raise _error(exc, trace=_streamed(trace), retries=retries) from exc
    except asyncio.CancelledError:
        # the run cut the call: what had streamed is the user's (the engine keeps it)
        raise ApplicationError("the model call was cut", {"trace": _streamed(trace), "retries": retries},
                               type="ModelCallCut", non_retryable=True) from None
    return {"response": unstructure(response), "trace": _streamed(trace), "retries": retries}


def _streamed(trace: ModelTrace) -> list[str]:
    """What the call streamed, as one piece (``ModelTrace.streamed`` is the same): the deltas
    themselves never reach the workflow's history."""
    return [trace.streamed] if trace.text else []


async def _messages(store: Store, sid: str, refs: list[Any]) -> list[Any]:
    """The request's message forms: references resolved from the session's records, new forms
    stored there for the next call."""
    wanted = [r["ref"] for r in refs if "ref" in r]
    known = await store.idempotency_records(sid, MESSAGE_KEY) if wanted else {}
    out = []
    for r in refs:
        if "ref" in r:
            hit = known.get(MESSAGE_KEY + r["ref"])
            if hit is None:
                raise ApplicationError(f"message {r['ref']} of session {sid} is not in the store", non_retryable=True)
            out.append(hit["message"])
        else:
            out.append(r["message"])
            await store.claim_idempotency_key(sid, MESSAGE_KEY + r["digest"], {"message": r["message"]})
    return out


@activity.defn(name="fsm_agent.run_tool")
async def run_tool(data: dict[str, Any]) -> dict[str, Any]:
    """One tool call. Returns ``{"result", "reports"}``; a tool that leaves its call open raises a
    non-retryable error carrying its ``SuspendCall`` (or ``WaitForHuman``)."""
    agent = agent_named(data["agent"])
    await _apply(agent.store, data["writes"])
    call = structure(data["call"], ToolUseBlock)
    decision = structure(data["decision"], Decision) if data.get("decision") else None
    reports: list[Any] = []

    def report(event: ToolProgress | UsageRolledUp) -> None:
        reports.append(form(event))
        if agent.hooks.wants(type(event)):
            asyncio.ensure_future(agent.hooks.emit(event))

    left = data.get("budget_left") or {}
    try:
        # a child session a tool starts (an agent tool's sub-agent) runs as a workflow of its own
        async with _children(), _heartbeating():
            result = await _traced(agent, LivePort(agent.store), data["session_id"], data["turn"]).run_tool(
                call, agent.tools, session_id=data["session_id"], turn=data["turn"], timeout=data.get("timeout"),
                decision=decision, report=report, budget_left=lambda: dict(left))
    except SuspendCall as wait:
        raise _error(wait, reports=reports) from wait
    return {"result": unstructure(result), "reports": reports}


@activity.defn(name="fsm_agent.tool_hook")
async def tool_hook(data: dict[str, Any]) -> Any:
    """A tool's ``on_reconcile`` or ``on_compensate`` hook; returns what it returned (as a form)."""
    agent = agent_named(data["agent"])
    await _apply(agent.store, data["writes"])
    tool = agent.tools.get(data["tool"])
    if tool is None:
        raise ApplicationError(f"no tool {data['tool']!r} on this worker", non_retryable=True)
    ctx = value_of(data["ctx"])
    assert isinstance(ctx, ToolContext)
    try:
        async with _children(), _heartbeating():
            out = await LivePort(agent.store).tool_hook(tool, data["hook"], value_of(data["args"]), ctx)
    except SuspendCall as wait:
        raise _error(wait) from wait
    return form(out)


@activity.defn(name="fsm_agent.plugin_effect")
async def plugin_effect(data: dict[str, Any]) -> Any:
    """A plugin's own I/O (``ctx.plugin_effect``): the method of the agent's middleware of that name."""
    agent = agent_named(data["agent"])
    await _apply(agent.store, data["writes"])
    plugin = next((m for m in agent.middleware if (getattr(m, "middleware_name", None) or type(m).__name__)
                   == data["plugin"]), None)
    if plugin is None:
        raise ApplicationError(f"no middleware {data['plugin']!r} in agent {data['agent']!r} on this worker",
                               non_retryable=True)
    try:
        async with _heartbeating():
            out = await LivePort(agent.store).plugin_effect(plugin, data["method"], value_of(data["args"]))
    except Exception as exc:
        raise _error(exc) from exc
    return form(out)


@activity.defn(name="fsm_agent.load_session")
async def load_session(data: dict[str, Any]) -> dict[str, Any] | None:
    """What continuing a stored session needs: its record, message events, latest checkpoint, ledger
    and decision records (``None`` for an unknown session)."""
    agent = agent_named(data["agent"])
    store, sid = agent.store, data["session_id"]
    rec = await store.get_session(sid)
    if rec is None:
        return None
    ck = await store.latest_checkpoint(sid)
    messages = [upgrade_event(e) for e in await store.read_events(sid, types=("message",))]
    ledger = await store.ledger(sid)
    kept = await store.idempotency_records(sid, "decision:")
    return {"record": unstructure(rec), "messages": unstructure(messages),
            "checkpoint": unstructure(ck) if ck is not None else None,
            "ledger": {k: unstructure(v) for k, v in ledger.items()}, "kept": kept}


@activity.defn(name="fsm_agent.system_prompt")
async def system_prompt(data: dict[str, Any]) -> dict[str, Any]:
    """The system prompt of the agent this worker serves under ``data["agent"]``, now (a
    :class:`~fsm_agent.PromptSnapshot`'s form; its prompt file read again)."""
    return unstructure(agent_named(data["agent"]).current_system_prompt())  # type: ignore[no-any-return]


def loaded(data: dict[str, Any]) -> tuple[SessionRecord, list[Any], Checkpoint | None, dict[str, LedgerEntry],
                                          dict[str, Any]]:
    """The parts of :func:`load_session`'s answer, typed."""
    from ..store.base import EventRecord

    ck = structure(data["checkpoint"], Checkpoint) if data.get("checkpoint") else None
    return (structure(data["record"], SessionRecord), structure(data["messages"], list[EventRecord]), ck,
            {k: structure(v, LedgerEntry) for k, v in (data.get("ledger") or {}).items()}, data.get("kept") or {})


ACTIVITIES = (apply_writes, model_call, run_tool, tool_hook, plugin_effect, load_session, system_prompt)
"""Every activity a worker of fsm_agent sessions registers."""
