"""A run as an A2A task: what the server (:mod:`fsm_agent.server.a2a`) says of a session.

* ids: a new task's id (:func:`task_id_for`), its context (:func:`context_of`);
* a stop's status: its state (:func:`~fsm_agent.orchestration.a2a_wire.stop_task_state`, shared
  with the client), and the status message that says what the task waits for (:func:`status_text`,
  :func:`stop_status`);
* the stream: one frame per session-log event (:func:`event_result`), and the live answer chunks
  (:class:`Frames`);
* a task's ``history`` (:func:`history`) and its usage (:func:`add_usage`).
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from ..orchestration.a2a_wire import (COMPLETED, WORKING, agent_message, answer_artifact, rpc_result, stop_reason,
                                      stop_task_state, usage_metadata)
from ..store.base import EventRecord, SessionRecord, Store
from ..store.decisions import DECISION_KINDS
from ..types.run import StopReason
from .app import A2A_ID_PREFIX
from .runs import RESUME_LIMITS
from .sse import encode_frame

__all__ = ["MESSAGE_KEY", "Frames", "a2a_meta", "add_usage", "context_of", "event_result", "history",
           "sent_message", "status_text", "stop_status", "task_id_for", "text_of", "timestamp"]

MESSAGE_KEY = "a2a-message:"
"""Prefix of the idempotency key under which a message that continued a task is recorded
(``a2a-message:<messageId>``): its digest, the seq it followed, its id, text and data part."""


def status_text(stop: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The status message of a stop: text for the client, and a data part (or None)."""
    reason, detail = stop_reason(stop), str(stop.get("detail") or "")
    if reason == StopReason.WAITING_HUMAN.value:
        pending = [{"call_id": p["call"]["id"], "tool": p["call"]["name"], "arguments": p["call"].get("input"),
                    "reason": p.get("reason") or "",
                    "allowed_decisions": list(p.get("allowed_decisions") or DECISION_KINDS)}
                   for p in stop.get("pending_actions") or ()]
        if pending:
            calls = ", ".join(f"{p['tool']}({p['call_id']}): {'/'.join(p['allowed_decisions'])}" for p in pending)
            return (f"input required: {detail}. Decide each pending tool call ({calls}) with a message to this "
                    'task whose data part is {"decisions": {"CALL_ID": {"decision": "approve"}}} (decision: '
                    'approve, edit with "arguments", reject or respond with "message")',
                    {"pending_approvals": pending})
        if stop.get("required_decision") == "confirm_cancel":
            return f"input required: {detail}. Send CancelTask to confirm the cancel", None
        return f"input required: {detail}. Answer with a message to this task", None
    if reason == StopReason.PAUSED_BUDGET.value:
        budget = stop.get("budget") or "a"
        return (f"input required: paused, {detail}. To continue, send a message to this task with a data part "
                f'{{"limits": {{"max_iterations": N}}}} raising the {budget} budget ({", ".join(RESUME_LIMITS)})',
                {"budget": stop.get("budget")})
    if reason == StopReason.INTERRUPTED.value:
        return f"interrupted: {detail}. Send a message to this task to continue", None
    return detail, None


def timestamp(t: float) -> str:
    """Unix time ``t`` as A2A writes times: RFC 3339, UTC, milliseconds (``2026-01-31T12:00:00.000Z``)."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")[:-6] + "Z"


def stop_status(stop: Mapping[str, Any], task_id: str, context_id: str, ts: float, seq: int) -> dict[str, Any]:
    """The TaskStatus of a stop (its state; its status message, unless COMPLETED)."""
    state = stop_task_state(stop)
    text, data = status_text(stop)
    status: dict[str, Any] = {"state": state, "timestamp": timestamp(ts)}
    if text and state != COMPLETED:  # a completed task's answer is its artifact
        status["message"] = agent_message(text, task_id, context_id, f"{task_id}-{seq}", data)
    return status


def text_of(message: Mapping[str, Any]) -> str:
    """The text blocks of a logged (unstructured) message, joined."""
    return "".join(b.get("text", "") for b in message.get("content") or () if b.get("type") == "text")


def _has_tool_calls(message: Mapping[str, Any]) -> bool:
    return any(b.get("type") == "tool_use" for b in message.get("content") or ())


def add_usage(events: Sequence[EventRecord]) -> tuple[tuple[int, int], float | None]:
    """((input tokens, output tokens), cost in USD or ``None`` when unknown) of ``model_call`` and
    ``usage_rolled_up`` events."""
    inp = out = 0
    cost: float | None = 0.0
    for ev in events:
        u = ev.payload.get("usage") or {}
        inp += int(u.get("input_tokens") or 0)
        out += int(u.get("output_tokens") or 0)
        c = ev.payload.get("cost_usd")
        cost = None if c is None or cost is None else cost + float(c)
    return (inp, out), cost


def event_result(ev: EventRecord, task_id: str, context_id: str,
                 usage: tuple[tuple[int, int], float | None] | None = None) -> dict[str, Any] | None:
    """The stream result (``statusUpdate`` / ``artifactUpdate``) of one log event, or ``None`` for
    an event that makes no frame. ``usage``: the session's usage and cost up to the event (for
    ``run_stopped``)."""
    t, p = ev.type, ev.payload
    base = {"taskId": task_id, "contextId": context_id}
    if t in ("session_started", "resume", "recovered"):
        return {"statusUpdate": {**base, "status": {"state": WORKING, "timestamp": timestamp(ev.ts)}}}
    if t == "message":
        m = p.get("message") or {}
        text = text_of(m) if m.get("role") == "assistant" else ""
        if not text:
            return None
        return {"artifactUpdate": {**base, "artifact": answer_artifact(text), "append": False,
                                   "lastChunk": not _has_tool_calls(m)}}
    if t == "tool_call" and p.get("status") == "started":
        msg = agent_message(f"running tool {p.get('tool')}", task_id, context_id, f"{task_id}-{ev.seq}")
        return {"statusUpdate": {**base, "status": {"state": WORKING, "message": msg, "timestamp": timestamp(ev.ts)}}}
    if t == "tool_progress":
        total = p.get("total")
        how = f"{p.get('progress'):g}" + (f"/{total:g}" if isinstance(total, (int, float)) else "")
        text = f"tool {p.get('tool')}: {how}" + (f" {p['message']}" if p.get("message") else "")
        msg = agent_message(text, task_id, context_id, f"{task_id}-{ev.seq}")
        return {"statusUpdate": {**base, "status": {"state": WORKING, "message": msg, "timestamp": timestamp(ev.ts)}}}
    if t == "run_stopped":
        stop = p.get("stop") or {}
        meta: dict[str, Any] = {"stop_reason": stop_reason(stop), "detail": str(stop.get("detail") or ""), "seq": ev.seq}
        if usage is not None:
            meta.update(usage_metadata(*usage))
        return {"statusUpdate": {**base, "status": stop_status(stop, task_id, context_id, ev.ts, ev.seq),
                                 "metadata": {"fsm_agent": meta}}}
    return None


def task_id_for(tenant: str, message_id: str) -> str:
    """The id of the task a tenant's new message makes: a retry of the message names the same task."""
    return A2A_ID_PREFIX + hashlib.sha256(f"{tenant}\0{message_id}".encode()).hexdigest()[:32]


def a2a_meta(rec: SessionRecord) -> dict[str, Any]:
    """What the server keeps of a task in its session's metadata (``context_id``, ``message_id``, ``digest``)."""
    m = rec.metadata.get("a2a") if isinstance(rec.metadata, dict) else None
    return m if isinstance(m, dict) else {}


def context_of(rec: SessionRecord) -> str:
    """A task's ``contextId``."""
    return str(a2a_meta(rec).get("context_id") or rec.session_id)


def history(rec: SessionRecord, msgs: Sequence[EventRecord],
            sent: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The task's messages: the transcript's user and assistant texts, in order. Each message a
    client sent keeps the client's ``messageId``: the first one (that made the task), and those
    that continued it (``sent``: their records), matched to the user message the run made of
    its text (a followup, a steer) after the seq it followed; one the run has not read yet, or
    one with only a data part (decisions, limits: no transcript message), is listed as sent,
    where it arrived. Other messages get ``<task id>-<seq>``."""
    sid, ctx = rec.session_id, context_of(rec)
    first = a2a_meta(rec).get("message_id")
    user = [e for e in msgs if (e.payload.get("message") or {}).get("role") == "user"
            and text_of(e.payload.get("message") or {})]
    claimed: dict[int, Mapping[str, Any]] = {}
    unread: list[tuple[float, Mapping[str, Any]]] = []
    for r in sorted(sent, key=lambda r: int(r.get("after") or 0)):
        after, text = int(r.get("after") or 0), str(r.get("text") or "")
        found = next((e for e in user if e.seq > after and e.seq not in claimed and text
                      and text in text_of(e.payload.get("message") or {})), None)
        if found is not None:
            claimed[found.seq] = r
        else:
            unread.append((after + 0.5, r))
    entries: list[tuple[float, dict[str, Any]]] = []
    for e in msgs:
        m = e.payload.get("message") or {}
        role = m.get("role")
        text = text_of(m)
        if role not in ("user", "assistant") or not text:
            continue
        if role == "assistant":
            entries.append((e.seq, agent_message(text, sid, ctx, f"{sid}-{e.seq}")))
            continue
        mine = claimed.get(e.seq)
        if mine is not None:
            entries.append((e.seq, sent_message(mine, sid, ctx, text)))
        else:
            mid = str(first) if first and not entries else f"{sid}-{e.seq}"
            entries.append((e.seq, {"messageId": mid, "contextId": ctx, "taskId": sid, "role": "ROLE_USER",
                                    "parts": [{"text": text}]}))
    entries += [(at, sent_message(r, sid, ctx, str(r.get("text") or ""))) for at, r in unread]
    entries.sort(key=lambda x: x[0])
    return [m for _, m in entries]


def sent_message(record: Mapping[str, Any], sid: str, ctx: str, text: str) -> dict[str, Any]:
    """A message a client sent to continue the task, as the history lists it."""
    parts: list[dict[str, Any]] = [{"text": text}] if text else []
    if isinstance(record.get("data"), dict):
        parts.append({"data": record["data"]})
    return {"messageId": str(record.get("message_id") or ""), "contextId": ctx, "taskId": sid,
            "role": "ROLE_USER", "parts": parts}


class Frames:
    """Turns log events into A2A frames for one stream (and live deltas into answer chunks)."""

    def __init__(self, store: Store, rid: Any, task_id: str, context_id: str) -> None:
        self.store, self.rid, self.task_id, self.context_id = store, rid, task_id, context_id
        self.chunking = False

    async def of(self, ev: EventRecord) -> bytes | None:
        """The frame of one log event (``id:`` its seq), or ``None`` for an event that makes none."""
        usage = None
        if ev.type == "run_stopped":
            usage = add_usage(await self.store.read_events(
                ev.session_id, until_seq=ev.seq, types=("model_call", "usage_rolled_up")))
        result = event_result(ev, self.task_id, self.context_id, usage)
        if result is None:
            return None
        if "artifactUpdate" in result:
            self.chunking = False  # the logged text replaces the previews
        return encode_frame(rpc_result(self.rid, result), id=ev.seq)

    def live(self, frame: bytes, basis: int) -> bytes | None:
        """An answer chunk from a LiveDeltas ``delta`` frame (text only), or ``None``."""
        if not frame.startswith(b"event: delta\n"):
            return None
        start = frame.find(b"data: ")
        try:
            d = orjson.loads(frame[start + 6:].strip())
        except orjson.JSONDecodeError:
            return None
        if d.get("kind") != "text" or not d.get("text"):
            return None
        append, self.chunking = self.chunking, True
        result = {"artifactUpdate": {"taskId": self.task_id, "contextId": self.context_id,
                                     "artifact": answer_artifact(d["text"]), "append": append, "lastChunk": False}}
        return encode_frame(rpc_result(self.rid, result), id=basis)
