"""Agent2Agent (A2A 1.0), JSON-RPC binding: serve the app's agent to A2A clients.

Mount it on the app :func:`~fsm_agent.server.create_app` built::

    app = create_app(agent)
    add_a2a_routes(app, A2AConfig(name="support", description="Answers support questions"))

Routes:

* ``GET /.well-known/agent-card.json``: the agent card (public, like ``/healthz``): name,
  description, version, ``supportedInterfaces`` (one: JSONRPC, protocol version 1.0, at
  :attr:`A2AConfig.path`), capabilities (streaming yes, push notifications no, extended card no),
  skills, and a bearer security scheme when the server has tokens.
* ``POST /a2a`` (:attr:`A2AConfig.path`): one JSON-RPC 2.0 request per POST. Methods:
  ``SendMessage``, ``SendStreamingMessage``, ``GetTask``, ``ListTasks``, ``CancelTask``,
  ``SubscribeToTask``; the push-notification config methods answer -32003 and
  ``GetExtendedAgentCard`` -32004. Authentication is the server's (:mod:`.auth`): the same bearer
  tokens and tenants as every other route, so A2A is no back door; another tenant's task is
  -32001, like one that does not exist.

**Task = session.** A task's ``id`` is the session id, so a task is also visible at
``/sessions/{id}``. A new task's id is derived from the tenant and the message's ``messageId``:
sending the same message again (a client's retry) answers with the task it created, never a
second one. ``contextId`` is the client's when given, else a new one; it groups tasks (``ListTasks``
filters by it) and shares no transcript: each task is its own session. A message naming a
``taskId`` continues that task (see :func:`task_state` for the states):

* working: its text is queued as a followup (the model reads it after the current step);
* input required: approvals are answered by a data part ``{"decisions": {CALL_ID: {"decision":
  "approve"|"edit"|"reject"|"respond", "arguments"?, "message"?, "is_error"?}}}``, a paused budget
  by ``{"limits": {"max_iterations": 80, ...}}``; text parts go in as a steer; the session resumes;
* terminal (completed, failed, canceled, rejected): -32004.

A message is applied once: a repeat of its ``messageId`` (a client's retry, also after the task
ended) answers with the task and applies nothing again (:meth:`_A2A._continue`). A task's
``history`` keeps the ``messageId`` of every message a client sent.

**Streams.** Each SSE ``data:`` is a JSON-RPC response whose ``result`` is ``task``,
``statusUpdate`` or ``artifactUpdate``. Our extension: each frame's ``id:`` is the seq of the
session-log event it comes from, and ``SubscribeToTask`` takes a ``Last-Event-ID`` header: it
replays the frames after that seq (a finished task included), then goes live, with no gap and no
duplicate. A frame per log event: ``session_started``/``resume``/``recovered`` → WORKING; a tool
call started and a tool's progress → WORKING with a message; an assistant message with text →
the ``answer`` artifact (``append`` false: it replaces the earlier text; ``lastChunk`` true when
the message has no tool calls); ``run_stopped`` → the mapped state with the stop's detail, and
``metadata.fsm_agent`` = the stop reason, usage and cost. While the model streams, its text deltas
go out live as chunks of the ``answer`` artifact (``append`` true after the first), carrying the
seq they follow as ``id:``: previews that the logged message then replaces.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import hashlib
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import orjson
from aiohttp import web
from attrs import field, frozen

from ..control import Decision
from ..errors import ConfigurationError, DecisionRefused, ResumeError, SessionExistsError
from ..config import RunConfig
from ..store.base import QUEUED, ControlKind, EventRecord, SessionRecord
from ..store.decisions import DECISION_KINDS, write_decisions
from ..store.sessions import send_control
from ..types.run import StopReason
from .app import A2A_ID_PREFIX, AGENT_KEY, RUNNER_KEY, STORE_KEY, TAIL_KEY, TENANT, TENANTS_KEY
from .auth import tenant_of
from .notify import NotifyingStore
from .runs import RESUME_LIMITS, SERVER_STOPPING, STOPPED_STATES, RunRequest, Runner
from .sse import encode_frame
from .tail import GONE_POLL, LogTail, client_gone

__all__ = ["A2A_VERSION", "AGENT_CARD_PATH", "REFUSAL_KINDS", "A2AConfig", "A2ASkill", "RpcError",
           "add_a2a_routes", "event_result", "stop_task_state", "task_state"]

log = logging.getLogger("fsm_agent.server.a2a")

A2A_VERSION = "1.0"
"""The protocol version served (``A2A-Version`` header; the card's ``protocolVersion``)."""
AGENT_CARD_PATH = "/.well-known/agent-card.json"
"""Where the agent card is served (A2A's well-known URI)."""

REFUSAL_KINDS = frozenset({"refusal", "content_filtered", "policy", "guardrail"})
"""``stop.error.kind`` values of a FAILED_TERMINAL stop that mean *refused*, not *failed*: the task
is REJECTED. ``refusal`` and ``content_filtered`` come from the model; a policy middleware that
refuses a task raises ``StopRun(StopReason.FAILED_TERMINAL, detail, error={"kind": "policy"})``."""

# JSON-RPC 2.0 and A2A error codes, with the A2A reason each carries in error.data
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = -32700, -32600, -32601, -32602, -32603
TASK_NOT_FOUND, TASK_NOT_CANCELABLE, PUSH_NOT_SUPPORTED, UNSUPPORTED_OPERATION = -32001, -32002, -32003, -32004
CONTENT_TYPE_NOT_SUPPORTED, VERSION_NOT_SUPPORTED = -32005, -32009
_REASONS = {PARSE_ERROR: "PARSE_ERROR", INVALID_REQUEST: "INVALID_REQUEST", METHOD_NOT_FOUND: "METHOD_NOT_FOUND",
            INVALID_PARAMS: "INVALID_PARAMS", INTERNAL_ERROR: "INTERNAL_ERROR", TASK_NOT_FOUND: "TASK_NOT_FOUND",
            TASK_NOT_CANCELABLE: "TASK_NOT_CANCELABLE", PUSH_NOT_SUPPORTED: "PUSH_NOTIFICATION_NOT_SUPPORTED",
            UNSUPPORTED_OPERATION: "UNSUPPORTED_OPERATION", CONTENT_TYPE_NOT_SUPPORTED: "CONTENT_TYPE_NOT_SUPPORTED",
            VERSION_NOT_SUPPORTED: "VERSION_NOT_SUPPORTED"}

# task states (the enum names of the JSON binding)
SUBMITTED, WORKING = "TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"
COMPLETED, FAILED = "TASK_STATE_COMPLETED", "TASK_STATE_FAILED"
CANCELED, INPUT_REQUIRED, REJECTED = "TASK_STATE_CANCELED", "TASK_STATE_INPUT_REQUIRED", "TASK_STATE_REJECTED"
AUTH_REQUIRED = "TASK_STATE_AUTH_REQUIRED"
TERMINAL_STATES = frozenset({COMPLETED, FAILED, CANCELED, REJECTED})
ALL_STATES = frozenset({SUBMITTED, WORKING, COMPLETED, FAILED, CANCELED, INPUT_REQUIRED, REJECTED, AUTH_REQUIRED})

ANSWER_ARTIFACT = "answer"
"""The artifact id of the task's answer (the last assistant text)."""
_MAX_TEXT = 100_000
_MAX_ID = 200
_PUSH_METHODS = ("CreateTaskPushNotificationConfig", "GetTaskPushNotificationConfig",
                 "ListTaskPushNotificationConfigs", "DeleteTaskPushNotificationConfig")
_LIMITS = RESUME_LIMITS
_DECISIONS = DECISION_KINDS
_SEQ = re.compile(r"^[0-9]{1,19}$")
_INT = re.compile(r"^-?[0-9]{1,10}$")
_MESSAGE_KEY = "a2a-message:"
"""Prefix of the idempotency key under which a message that continued a task is recorded
(``a2a-message:<messageId>``): its digest, the seq it followed, its id, text and data part."""


class RpcError(Exception):
    """A JSON-RPC error answer: ``code`` (JSON-RPC or A2A), ``message`` (what was wrong and what to
    do) and ``data`` (extra fields for the ``google.rpc.ErrorInfo`` metadata)."""

    def __init__(self, code: int, message: str, data: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, dict(data or {})

    def to_json(self) -> dict[str, Any]:
        """The ``error`` member: ``code``, ``message`` and ``data`` (a ``google.rpc.ErrorInfo`` with
        the A2A reason, as the official SDK sends it)."""
        info = {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": _REASONS.get(self.code, "UNKNOWN_ERROR"),
                "domain": "a2a-protocol.org", "metadata": {k: str(v) for k, v in self.data.items()}}
        return {"code": self.code, "message": self.message, "data": [info]}


@frozen
class A2ASkill:
    """One skill of the agent card (A2A ``AgentSkill``)."""

    id: str
    """Unique within the card."""
    name: str
    description: str
    tags: tuple[str, ...] = field(default=("general",), converter=tuple)
    """Keywords (the card requires at least one)."""
    examples: tuple[str, ...] = field(default=(), converter=tuple)
    """Example prompts."""


@frozen
class A2AConfig:
    """What the A2A routes serve, and how long they wait.

    Streams use the app's settings (``create_app(heartbeat=, send_timeout=)``).

    Raises:
        ConfigurationError: an empty name or description, a path that does not start with ``/`` (or
            is the card's), a skill without tags, two skills with one id, a wait that is not positive.
    """

    name: str
    """The agent's name on its card."""
    description: str
    """What the agent does, for people and for calling agents."""
    version: str = "1.0.0"
    """The agent's own version (not the protocol's)."""
    skills: tuple[A2ASkill, ...] = field(default=(), converter=tuple)
    """Skills on the card; none given: one skill named after the agent."""
    path: str = "/a2a"
    """The JSON-RPC endpoint."""
    url: str | None = None
    """The endpoint's public URL on the card; ``None``: built from each card request's scheme and
    host (set it behind a proxy)."""
    provider_organization: str | None = None
    provider_url: str | None = None
    documentation_url: str | None = None
    icon_url: str | None = None
    blocking_timeout: float = 300.0
    """Seconds a blocking ``SendMessage`` waits for the task to stop before answering with it as it
    is (then poll ``GetTask``)."""
    cancel_wait: float = 10.0
    """Seconds ``CancelTask`` waits for a running task to end CANCELED before answering."""

    def __attrs_post_init__(self) -> None:
        if not self.name.strip() or not self.description.strip():
            raise ConfigurationError("A2AConfig needs a non-empty name and description (the agent card requires them)")
        if not self.path.startswith("/") or self.path == AGENT_CARD_PATH:
            raise ConfigurationError(f"A2AConfig.path must be an absolute path other than {AGENT_CARD_PATH}, "
                                     f"not {self.path!r}")
        ids = [s.id for s in self.skills]
        if len(set(ids)) != len(ids):
            raise ConfigurationError(f"A2AConfig.skills: skill ids must be unique, got {ids}")
        for s in self.skills:
            if not s.tags:
                raise ConfigurationError(f"A2AConfig.skills: skill {s.id!r} needs at least one tag")
        for name in ("blocking_timeout", "cancel_wait"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(f"A2AConfig.{name} must be positive (seconds), not {getattr(self, name)!r}")


# -- the state mapping ---------------------------------------------------------------------------
def _reason(stop: Mapping[str, Any] | None) -> str:
    r = (stop or {}).get("reason")
    return str(getattr(r, "value", r) or "")


def stop_task_state(stop: Mapping[str, Any]) -> str:
    """The A2A task state of a run's stop (an unstructured RunStop).

    ========================================= =====================
    StopReason                                task state
    ========================================= =====================
    COMPLETED                                 COMPLETED
    FAILED_TERMINAL, error kind in            REJECTED
    :data:`REFUSAL_KINDS` (a refusal)
    FAILED_TERMINAL, FAILED_RETRYABLE         FAILED
    CANCELLED                                 CANCELED
    WAITING_HUMAN                             INPUT_REQUIRED
    PAUSED_BUDGET                             INPUT_REQUIRED (the budget in the status message)
    INTERRUPTED                               INPUT_REQUIRED (WORKING when the server stopped it:
                                              the next server start resumes it)
    ========================================= =====================
    """
    reason = _reason(stop)
    if reason == StopReason.COMPLETED.value:
        return COMPLETED
    if reason in (StopReason.FAILED_TERMINAL.value, StopReason.FAILED_RETRYABLE.value):
        kind = (stop.get("error") or {}).get("kind") if isinstance(stop.get("error"), dict) else None
        return REJECTED if reason == StopReason.FAILED_TERMINAL.value and kind in REFUSAL_KINDS else FAILED
    if reason == StopReason.CANCELLED.value:
        return CANCELED
    if reason == StopReason.INTERRUPTED.value and str(stop.get("detail") or "").startswith(SERVER_STOPPING):
        return WORKING
    return INPUT_REQUIRED


def task_state(record: SessionRecord, busy: bool) -> str:
    """The A2A state of a session now: SUBMITTED while QUEUED, WORKING in a phase or while a run of a
    stopped session is queued or running (``busy``), else :func:`stop_task_state` of its stop."""
    if record.state == QUEUED:
        return SUBMITTED
    try:
        stopped = StopReason(record.state)
    except ValueError:
        return WORKING  # a phase
    if busy and stopped.resumable:
        return WORKING
    return stop_task_state(record.stop or {"reason": stopped.value})


def _status_text(stop: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The status message of a stop: text for the client, and a data part (or None)."""
    reason, detail = _reason(stop), str(stop.get("detail") or "")
    if reason == StopReason.WAITING_HUMAN.value:
        pending = [{"call_id": p["call"]["id"], "tool": p["call"]["name"], "arguments": p["call"].get("input"),
                    "reason": p.get("reason") or "",
                    "allowed_decisions": list(p.get("allowed_decisions") or _DECISIONS)}
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
                f'{{"limits": {{"max_iterations": N}}}} raising the {budget} budget ({", ".join(_LIMITS)})',
                {"budget": stop.get("budget")})
    if reason == StopReason.INTERRUPTED.value:
        return f"interrupted: {detail}. Send a message to this task to continue", None
    return detail, None


# -- wire shapes ----------------------------------------------------------------------------------
def _ts(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")[:-6] + "Z"


def _agent_message(text: str, task_id: str, context_id: str, message_id: str,
                   data: dict[str, Any] | None = None) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"text": text}]
    if data is not None:
        parts.append({"data": data})
    return {"messageId": message_id, "contextId": context_id, "taskId": task_id, "role": "ROLE_AGENT", "parts": parts}


def _stop_status(stop: Mapping[str, Any], task_id: str, context_id: str, ts: float, seq: int) -> dict[str, Any]:
    state = stop_task_state(stop)
    text, data = _status_text(stop)
    status: dict[str, Any] = {"state": state, "timestamp": _ts(ts)}
    if text and state != COMPLETED:  # a completed task's answer is its artifact
        status["message"] = _agent_message(text, task_id, context_id, f"{task_id}-{seq}", data)
    return status


def _text_of(message: Mapping[str, Any]) -> str:
    return "".join(b.get("text", "") for b in message.get("content") or () if b.get("type") == "text")


def _has_tool_calls(message: Mapping[str, Any]) -> bool:
    return any(b.get("type") == "tool_use" for b in message.get("content") or ())


def _answer(text: str) -> dict[str, Any]:
    return {"artifactId": ANSWER_ARTIFACT, "name": ANSWER_ARTIFACT, "parts": [{"text": text}]}


def _usage_json(usage: tuple[int, int], cost: float | None) -> dict[str, Any]:
    return {"usage": {"input_tokens": usage[0], "output_tokens": usage[1]}, "cost_usd": cost}


def _add_usage(events: Sequence[EventRecord]) -> tuple[tuple[int, int], float | None]:
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
        return {"statusUpdate": {**base, "status": {"state": WORKING, "timestamp": _ts(ev.ts)}}}
    if t == "message":
        m = p.get("message") or {}
        text = _text_of(m) if m.get("role") == "assistant" else ""
        if not text:
            return None
        return {"artifactUpdate": {**base, "artifact": _answer(text), "append": False,
                                   "lastChunk": not _has_tool_calls(m)}}
    if t == "tool_call" and p.get("status") == "started":
        msg = _agent_message(f"running tool {p.get('tool')}", task_id, context_id, f"{task_id}-{ev.seq}")
        return {"statusUpdate": {**base, "status": {"state": WORKING, "message": msg, "timestamp": _ts(ev.ts)}}}
    if t == "tool_progress":
        total = p.get("total")
        how = f"{p.get('progress'):g}" + (f"/{total:g}" if isinstance(total, (int, float)) else "")
        text = f"tool {p.get('tool')}: {how}" + (f" {p['message']}" if p.get("message") else "")
        msg = _agent_message(text, task_id, context_id, f"{task_id}-{ev.seq}")
        return {"statusUpdate": {**base, "status": {"state": WORKING, "message": msg, "timestamp": _ts(ev.ts)}}}
    if t == "run_stopped":
        stop = p.get("stop") or {}
        meta: dict[str, Any] = {"stop_reason": _reason(stop), "detail": str(stop.get("detail") or ""), "seq": ev.seq}
        if usage is not None:
            meta.update(_usage_json(*usage))
        return {"statusUpdate": {**base, "status": _stop_status(stop, task_id, context_id, ev.ts, ev.seq),
                                 "metadata": {"fsm_agent": meta}}}
    return None


def _rpc_result(rid: Any, result: Any) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": rid, "result": result}, option=orjson.OPT_NON_STR_KEYS)


def _rpc_error(rid: Any, err: RpcError) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": rid, "error": err.to_json()})


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")


# -- request parsing ------------------------------------------------------------------------------
def _get(obj: Mapping[str, Any], camel: str, snake: str | None = None) -> Any:
    """A field by its JSON name, or by its proto field name (the SDK's parser accepts both)."""
    if camel in obj:
        return obj[camel]
    return obj.get(snake) if snake else None


def _bad_char(c: str) -> bool:
    return ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c == "/"


def _id_field(obj: Mapping[str, Any], camel: str, snake: str | None, where: str, *, required: bool) -> str | None:
    v = _get(obj, camel, snake)
    if v is None or v == "":
        if required:
            raise RpcError(INVALID_PARAMS, f"{where}.{camel} is required")
        return None
    if not isinstance(v, str) or len(v) > _MAX_ID or any(_bad_char(c) for c in v):
        raise RpcError(INVALID_PARAMS, f"{where}.{camel} must be a string of 1 to {_MAX_ID} characters without "
                                       f"control characters or '/', not {str(v)[:40]!r}")
    return v


def _opt_int(obj: Mapping[str, Any], camel: str, snake: str, where: str, lo: int, hi: int) -> int | None:
    v = _get(obj, camel, snake)
    if v is None:
        return None
    if isinstance(v, str) and _INT.match(v.strip()):  # ASCII digits only: proto3 JSON allows int32 as a string
        v = int(v.strip())
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RpcError(INVALID_PARAMS, f"{where}.{camel} must be an integer from {lo} to {hi}, not {str(v)[:40]!r}")
    return v


def _object(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise RpcError(INVALID_PARAMS, f"{where} must be a JSON object, not {type(v).__name__}")
    return v


@attrs.define
class _Inbound:
    """A client's message, as this server uses it."""

    message_id: str
    context_id: str | None
    task_id: str | None
    text: str
    decisions: dict[str, Decision] | None
    limits: dict[str, Any] | None
    digest: str
    """sha256 of the message's canonical JSON: a retry must send the same message."""
    control: dict[str, Any] | None = None
    """The data part that carried ``decisions`` / ``limits``, as sent."""


def _decision(call_id: str, raw: Any) -> Decision:
    where = f"params.message data part: decisions[{call_id!r}]"
    d = _object(raw, where)
    unknown = sorted(set(d) - {"decision", "arguments", "message", "is_error"})
    if unknown:
        raise RpcError(INVALID_PARAMS, f"{where}: unknown field(s) {', '.join(unknown)}; allowed: decision, "
                                       "arguments, message, is_error")
    kind = d.get("decision")
    if kind not in _DECISIONS:
        raise RpcError(INVALID_PARAMS, f"{where}.decision must be one of {', '.join(_DECISIONS)}, not {kind!r}")
    message, is_error = d.get("message", ""), d.get("is_error", False)
    if not isinstance(message, str) or len(message) > _MAX_TEXT or not isinstance(is_error, bool):
        raise RpcError(INVALID_PARAMS, f"{where}: 'message' must be a string (at most {_MAX_TEXT:,} characters) and "
                                       "'is_error' true or false")
    if kind == "edit":
        if not isinstance(d.get("arguments"), dict):
            raise RpcError(INVALID_PARAMS, f"{where}: an edit needs 'arguments', the new arguments (an object)")
        return Decision.edit(d["arguments"])
    if d.get("arguments") is not None or (message and kind == "approve") or ("is_error" in d and kind != "respond"):
        raise RpcError(INVALID_PARAMS, f"{where}: 'arguments' belongs to an edit, 'message' to a reject or a "
                                       "respond, 'is_error' to a respond")
    if kind == "approve":
        return Decision.approve()
    if kind == "reject":
        return Decision.reject(message or "rejected by an A2A client")
    if not message:
        raise RpcError(INVALID_PARAMS, f"{where}: a respond needs 'message', the result the model is given")
    return Decision.respond(message, is_error=is_error)


def _limits(raw: Any) -> dict[str, Any]:
    where = "params.message data part: limits"
    d = _object(raw, where)
    for key, value in d.items():
        types = _LIMITS.get(key)
        if types is None:
            raise RpcError(INVALID_PARAMS, f"{where}.{key} cannot be raised; raise one of: {', '.join(_LIMITS)}")
        positive = isinstance(value, (int, float)) and value > 0
        if isinstance(value, bool) or not isinstance(value, types) or not positive:
            kind = "a positive integer" if types == (int,) else "a positive number"
            raise RpcError(INVALID_PARAMS, f"{where}.{key} must be {kind}, not {value!r}")
    try:
        attrs.evolve(RunConfig(), **d)
    except (TypeError, ValueError, ConfigurationError) as e:
        raise RpcError(INVALID_PARAMS, f"{where}: {e}") from e
    return dict(d)


def _inbound(params: dict[str, Any]) -> _Inbound:
    m = _object(_get(params, "message"), "params.message") if _get(params, "message") is not None else None
    if m is None:
        raise RpcError(INVALID_PARAMS, "params.message is required: the message to send "
                                       '({"messageId", "role": "ROLE_USER", "parts": [{"text": ...}]})')
    mid = _id_field(m, "messageId", "message_id", "params.message", required=True)
    assert mid is not None
    role = m.get("role")
    if not (isinstance(role, str) and role in ("ROLE_USER", "user") or type(role) is int and role == 1):
        raise RpcError(INVALID_PARAMS, f"params.message.role must be ROLE_USER (a message to the agent), not {role!r}")
    parts = m.get("parts")
    if not isinstance(parts, list) or not parts:
        raise RpcError(INVALID_PARAMS, "params.message.parts must be a non-empty list of parts")
    texts: list[str] = []
    decisions: dict[str, Decision] | None = None
    limits: dict[str, Any] | None = None
    control: dict[str, Any] | None = None
    for i, part in enumerate(parts):
        where = f"params.message.parts[{i}]"
        part = _object(part, where)
        kinds = [k for k in ("text", "data", "raw", "url") if k in part]
        if len(kinds) != 1:
            raise RpcError(INVALID_PARAMS, f"{where} must have exactly one of text, data, raw, url (has "
                                           f"{', '.join(kinds) or 'none'})")
        kind = kinds[0]
        media = str(_get(part, "mediaType", "media_type") or "")
        if kind == "text":
            if not isinstance(part["text"], str):
                raise RpcError(INVALID_PARAMS, f"{where}.text must be a string")
            texts.append(part["text"])
        elif kind == "data":
            data = part["data"]
            if isinstance(data, dict) and data and set(data) <= {"decisions", "limits"}:
                control = data
                if "decisions" in data:
                    decisions = {str(k): _decision(str(k), v) for k, v in
                                 _object(data["decisions"], "params.message data part: decisions").items()}
                    if not decisions:
                        raise RpcError(INVALID_PARAMS, "params.message data part: decisions is empty")
                if "limits" in data:
                    limits = _limits(data["limits"])
            else:
                texts.append(orjson.dumps(data).decode())
        elif kind == "raw" and (media.startswith("text/") or media in ("application/json", "")):
            try:
                texts.append(base64.b64decode(str(part["raw"]), validate=True).decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise RpcError(INVALID_PARAMS, f"{where}.raw must be base64 of UTF-8 text ({e})") from e
        else:
            raise RpcError(CONTENT_TYPE_NOT_SUPPORTED,
                           f"{where}: this agent reads text and JSON data parts; a {kind} part"
                           f"{' of ' + media if media else ''} is not supported (send its content as text)",
                           {"part": i, "media_type": media})
    text = "\n".join(t for t in texts if t)
    if len(text) > _MAX_TEXT:
        raise RpcError(INVALID_PARAMS, f"params.message: the text is longer than {_MAX_TEXT:,} characters")
    return _Inbound(mid, _id_field(m, "contextId", "context_id", "params.message", required=False),
                    _id_field(m, "taskId", "task_id", "params.message", required=False), text, decisions, limits,
                    hashlib.sha256(orjson.dumps(m, option=orjson.OPT_SORT_KEYS)).hexdigest(), control)


def _configuration(params: dict[str, Any]) -> tuple[int | None, bool]:
    """(historyLength, returnImmediately) of a SendMessage configuration."""
    raw = _get(params, "configuration")
    if raw is None:
        return None, False
    conf = _object(raw, "params.configuration")
    if _get(conf, "taskPushNotificationConfig", "task_push_notification_config") is not None:
        raise RpcError(PUSH_NOT_SUPPORTED, "this agent does not send push notifications (capabilities."
                                           "pushNotifications is false): stream the task or poll GetTask")
    modes = _get(conf, "acceptedOutputModes", "accepted_output_modes")
    if modes is not None:
        if not isinstance(modes, list) or not all(isinstance(x, str) for x in modes):
            raise RpcError(INVALID_PARAMS, "params.configuration.acceptedOutputModes must be a list of media types")
        if modes and not any(x in ("text/plain", "text/*", "*/*") for x in modes):
            raise RpcError(CONTENT_TYPE_NOT_SUPPORTED, f"this agent answers in text/plain; the client accepts only "
                                                       f"{', '.join(modes)}")
    immediately = _get(conf, "returnImmediately", "return_immediately")
    if immediately is not None and not isinstance(immediately, bool):
        raise RpcError(INVALID_PARAMS, "params.configuration.returnImmediately must be true or false")
    return _opt_int(conf, "historyLength", "history_length", "params.configuration", 0, 2**31 - 1), bool(immediately)


def _envelope(body: Any) -> tuple[Any, str, dict[str, Any]]:
    """(id, method, params) of a JSON-RPC request, or RpcError (its ``data['id']``: the id to echo)."""
    if isinstance(body, list):
        raise RpcError(INVALID_REQUEST, "batch requests are not supported: send one JSON-RPC request per HTTP POST")
    if not isinstance(body, dict):
        raise RpcError(INVALID_REQUEST, f"the request must be a JSON-RPC 2.0 request object, not {type(body).__name__}")
    rid = body.get("id")
    if isinstance(rid, bool) or not (rid is None or isinstance(rid, (str, int))) or (
            isinstance(rid, str) and len(rid) > 256):
        raise RpcError(INVALID_REQUEST, "'id' must be a string (at most 256 characters), an integer or null")
    if body.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, "'jsonrpc' must be exactly \"2.0\"", {"id": rid})
    if "id" not in body:
        raise RpcError(INVALID_REQUEST, "'id' is missing: A2A methods are requests, not notifications; give an id",
                       {"id": rid})
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise RpcError(INVALID_REQUEST, "'method' must be a non-empty string", {"id": rid})
    params = body.get("params", {})
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, f"'params' must be an object, not {type(params).__name__}", {"id": rid})
    return rid, method, params


def _check_version(request: web.Request) -> None:
    raw = request.headers.get("A2A-Version", "").strip()
    version = raw or "0.3"
    major = version.split(".", 1)[0]
    if major != "1" or not re.fullmatch(r"1(\.[0-9]+){0,2}", version):
        missing = " (no A2A-Version header means 0.3)" if not raw else ""
        raise RpcError(VERSION_NOT_SUPPORTED, f"A2A version {version[:20]!r}{missing} is not supported: this server "
                                              f"speaks A2A {A2A_VERSION} only; send the header 'A2A-Version: "
                                              f"{A2A_VERSION}' with 1.0 method names (SendMessage ...)",
                       {"supported": A2A_VERSION})


def _task_id_for(tenant: str, message_id: str) -> str:
    return A2A_ID_PREFIX + hashlib.sha256(f"{tenant}\0{message_id}".encode()).hexdigest()[:32]


def _a2a_meta(rec: SessionRecord) -> dict[str, Any]:
    m = rec.metadata.get("a2a") if isinstance(rec.metadata, dict) else None
    return m if isinstance(m, dict) else {}


def _context_of(rec: SessionRecord) -> str:
    return str(_a2a_meta(rec).get("context_id") or rec.session_id)


class _Frames:
    """Turns log events into A2A frames for one stream (and live deltas into answer chunks)."""

    def __init__(self, srv: _A2A, rid: Any, task_id: str, context_id: str) -> None:
        self.srv, self.rid, self.task_id, self.context_id = srv, rid, task_id, context_id
        self.chunking = False

    async def of(self, ev: EventRecord) -> bytes | None:
        usage = None
        if ev.type == "run_stopped":
            usage = _add_usage(await self.srv.store.read_events(
                ev.session_id, until_seq=ev.seq, types=("model_call", "usage_rolled_up")))
        result = event_result(ev, self.task_id, self.context_id, usage)
        if result is None:
            return None
        if "artifactUpdate" in result:
            self.chunking = False  # the logged text replaces the previews
        return encode_frame(_rpc_result(self.rid, result), id=ev.seq)

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
                                     "artifact": _answer(d["text"]), "append": append, "lastChunk": False}}
        return encode_frame(_rpc_result(self.rid, result), id=basis)


class _A2A:
    """The A2A routes over one app's agent, store, runner and tenants."""

    def __init__(self, app: web.Application, config: A2AConfig) -> None:
        self.app, self.config = app, config
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self.methods: dict[str, Callable[[web.Request, Any, dict[str, Any]], Awaitable[web.StreamResponse]]] = {
            "SendMessage": self.send_message, "SendStreamingMessage": self.send_streaming_message,
            "GetTask": self.get_task, "ListTasks": self.list_tasks, "CancelTask": self.cancel_task,
            "SubscribeToTask": self.subscribe, "GetExtendedAgentCard": self.extended_card,
            **{m: self.push_config for m in _PUSH_METHODS}}

    @property
    def store(self) -> NotifyingStore:
        return self.app[STORE_KEY]

    @property
    def runner(self) -> Runner:
        return self.app[RUNNER_KEY]

    @property
    def tail(self) -> LogTail:
        """The app's streams (shared with the REST event stream: one loop, one shutdown)."""
        return self.app[TAIL_KEY]

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, key: str) -> AsyncIterator[None]:
        """Serialise the handling of one message (a client's retry racing its first attempt)."""
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    # -- the card ------------------------------------------------------------------------------
    def card(self, request: web.Request) -> dict[str, Any]:
        """The agent card for a request (its URL from the request's host unless configured)."""
        c = self.config
        url = c.url or f"{request.scheme}://{request.host}{c.path}"
        skills = c.skills or (A2ASkill(id="default", name=c.name, description=c.description),)
        card: dict[str, Any] = {
            "name": c.name, "description": c.description, "version": c.version,
            "supportedInterfaces": [{"url": url, "protocolBinding": "JSONRPC", "protocolVersion": A2A_VERSION}],
            "capabilities": {"streaming": True, "pushNotifications": False, "extendedAgentCard": False},
            "defaultInputModes": ["text/plain", "application/json"], "defaultOutputModes": ["text/plain"],
            "skills": [{"id": s.id, "name": s.name, "description": s.description, "tags": list(s.tags),
                        **({"examples": list(s.examples)} if s.examples else {})} for s in skills]}
        if c.provider_organization and c.provider_url:
            card["provider"] = {"organization": c.provider_organization, "url": c.provider_url}
        if c.documentation_url:
            card["documentationUrl"] = c.documentation_url
        if c.icon_url:
            card["iconUrl"] = c.icon_url
        if self.app[TENANTS_KEY].enabled:
            card["securitySchemes"] = {"bearer": {"httpAuthSecurityScheme": {
                "scheme": "Bearer", "description": "a tenant's token (the server's tokens file)"}}}
            card["securityRequirements"] = [{"schemes": {"bearer": {"list": []}}}]
        return card

    async def get_card(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.card(request)), content_type="application/json",
                            headers={"Cache-Control": "no-cache"})

    # -- the endpoint --------------------------------------------------------------------------
    async def rpc(self, request: web.Request) -> web.StreamResponse:
        rid: Any = None
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge as e:
                raise RpcError(INVALID_REQUEST, f"the request body is over the server's limit "
                                                f"({e.text or 'too large'}): send a smaller message") from e
            try:
                body = orjson.loads(raw) if raw.strip() else None
            except orjson.JSONDecodeError as e:
                raise RpcError(PARSE_ERROR, f"the body is not valid JSON: {e}") from e
            if body is None:
                raise RpcError(PARSE_ERROR, "the body is empty: send one JSON-RPC 2.0 request object")
            if isinstance(body, dict):  # the id to echo when the rest of the envelope is wrong
                raw_id = body.get("id")
                if (isinstance(raw_id, int) and not isinstance(raw_id, bool)
                        or isinstance(raw_id, str) and len(raw_id) <= 256):
                    rid = raw_id
            rid, method, params = _envelope(body)
            _check_version(request)
            handler = self.methods.get(method)
            if handler is None:
                hint = (" (A2A 0.3 method names are not served: 1.0 names are PascalCase)"
                        if "/" in method else "")
                raise RpcError(METHOD_NOT_FOUND, f"unknown method {method[:60]!r}{hint}; methods: "
                                                 + ", ".join(m for m in self.methods if m not in _PUSH_METHODS))
            return await handler(request, rid, params)
        except RpcError as e:
            return _json(_rpc_error(rid if "id" not in e.data else e.data.pop("id"), e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a JSON-RPC error, never a crashed handler
            log.exception("A2A request failed")
            return _json(_rpc_error(rid, RpcError(INTERNAL_ERROR, f"internal error ({type(e).__name__}); the server's "
                                                                  "log has the details")))

    async def session(self, request: web.Request, task_id: Any, where: str = "params.id") -> SessionRecord:
        if not isinstance(task_id, str) or not task_id:
            raise RpcError(INVALID_PARAMS, f"{where} is required: the task id")
        if len(task_id) > _MAX_ID or any(_bad_char(c) for c in task_id):
            raise RpcError(TASK_NOT_FOUND, f"no task {task_id[:60]!r}")
        rec = await self.store.get_session(task_id)
        if rec is None or tenant_of(rec) != request[TENANT]:
            raise RpcError(TASK_NOT_FOUND, f"no task {task_id!r}", {"task_id": task_id})
        return rec

    async def task(self, rec: SessionRecord, *, history_length: int | None = None, artifacts: bool = True,
                   usage: bool = True) -> dict[str, Any]:
        """The A2A task of a session now."""
        sid, ctx = rec.session_id, _context_of(rec)
        busy = await self.runner.busy(sid)
        state = task_state(rec, busy)
        status: dict[str, Any] = {"state": state, "timestamp": _ts(rec.updated_at)}
        if rec.stop and state not in (SUBMITTED, WORKING):
            status = _stop_status(rec.stop, sid, ctx, rec.updated_at, rec.last_seq)
        task: dict[str, Any] = {"id": sid, "contextId": ctx, "status": status}
        want_history = history_length is None or history_length > 0
        if artifacts or want_history or usage:
            types = ("message",) + (("model_call", "usage_rolled_up") if usage else ())
            events = await self.store.read_events(sid, types=types)
            msgs = [e for e in events if e.type == "message"]
            if artifacts:
                texts = [_text_of(e.payload.get("message") or {}) for e in msgs
                         if (e.payload.get("message") or {}).get("role") == "assistant"]
                texts = [t for t in texts if t]
                if texts:
                    task["artifacts"] = [_answer(texts[-1])]
            if want_history:
                sent = await self.store.idempotency_records(sid, _MESSAGE_KEY)
                history = self.history(rec, msgs, list(sent.values()))
                task["history"] = history[-history_length:] if history_length else history
            meta: dict[str, Any] = {"session_id": sid, "session_state": rec.state}
            if usage:
                meta.update(_usage_json(*_add_usage([e for e in events if e.type != "message"])))
            task["metadata"] = {"fsm_agent": meta}
        return task

    def history(self, rec: SessionRecord, msgs: Sequence[EventRecord],
                sent: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
        """The task's messages: the transcript's user and assistant texts, in order. Each message a
        client sent keeps the client's ``messageId``: the first one (that made the task), and those
        that continued it (``sent``: their records), matched to the user message the run made of
        its text (a followup, a steer) after the seq it followed; one the run has not read yet, or
        one with only a data part (decisions, limits: no transcript message), is listed as sent,
        where it arrived. Other messages get ``<task id>-<seq>``."""
        sid, ctx = rec.session_id, _context_of(rec)
        first = _a2a_meta(rec).get("message_id")
        user = [e for e in msgs if (e.payload.get("message") or {}).get("role") == "user"
                and _text_of(e.payload.get("message") or {})]
        claimed: dict[int, Mapping[str, Any]] = {}
        unread: list[tuple[float, Mapping[str, Any]]] = []
        for r in sorted(sent, key=lambda r: int(r.get("after") or 0)):
            after, text = int(r.get("after") or 0), str(r.get("text") or "")
            found = next((e for e in user if e.seq > after and e.seq not in claimed and text
                          and text in _text_of(e.payload.get("message") or {})), None)
            if found is not None:
                claimed[found.seq] = r
            else:
                unread.append((after + 0.5, r))
        entries: list[tuple[float, dict[str, Any]]] = []
        for e in msgs:
            m = e.payload.get("message") or {}
            role = m.get("role")
            text = _text_of(m)
            if role not in ("user", "assistant") or not text:
                continue
            if role == "assistant":
                entries.append((e.seq, _agent_message(text, sid, ctx, f"{sid}-{e.seq}")))
                continue
            mine = claimed.get(e.seq)
            if mine is not None:
                entries.append((e.seq, self._sent(mine, sid, ctx, text)))
            else:
                mid = str(first) if first and not entries else f"{sid}-{e.seq}"
                entries.append((e.seq, {"messageId": mid, "contextId": ctx, "taskId": sid, "role": "ROLE_USER",
                                        "parts": [{"text": text}]}))
        entries += [(at, self._sent(r, sid, ctx, str(r.get("text") or ""))) for at, r in unread]
        entries.sort(key=lambda x: x[0])
        return [m for _, m in entries]

    @staticmethod
    def _sent(record: Mapping[str, Any], sid: str, ctx: str, text: str) -> dict[str, Any]:
        """A message a client sent to continue the task, as the history lists it."""
        parts: list[dict[str, Any]] = [{"text": text}] if text else []
        if isinstance(record.get("data"), dict):
            parts.append({"data": record["data"]})
        return {"messageId": str(record.get("message_id") or ""), "contextId": ctx, "taskId": sid,
                "role": "ROLE_USER", "parts": parts}

    # -- methods -------------------------------------------------------------------------------
    async def get_task(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        rec = await self.session(request, _get(params, "id"))
        hl = _opt_int(params, "historyLength", "history_length", "params", 0, 2**31 - 1)
        return _json(_rpc_result(rid, await self.task(rec, history_length=hl)))

    async def list_tasks(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        ctx = _id_field(params, "contextId", "context_id", "params", required=False)
        status = _get(params, "status")
        if isinstance(status, str) and status in ("", "TASK_STATE_UNSPECIFIED") or type(status) is int and status == 0:
            status = None
        if status is not None and (not isinstance(status, str) or status not in ALL_STATES):
            raise RpcError(INVALID_PARAMS, f"params.status must be one of {', '.join(sorted(ALL_STATES))}, "
                                           f"not {str(status)[:40]!r}")
        size = _opt_int(params, "pageSize", "page_size", "params", 1, 100) or 50
        hl = _opt_int(params, "historyLength", "history_length", "params", 0, 2**31 - 1)
        include = _get(params, "includeArtifacts", "include_artifacts")
        if include is not None and not isinstance(include, bool):
            raise RpcError(INVALID_PARAMS, "params.includeArtifacts must be true or false")
        after_raw = _get(params, "statusTimestampAfter", "status_timestamp_after")
        after = None
        if after_raw is not None:
            try:
                when = datetime.datetime.fromisoformat(str(after_raw).replace("Z", "+00:00"))
                if when.tzinfo is None:
                    raise ValueError("no time zone")
                after = when.timestamp()
            except (ValueError, OverflowError, OSError) as e:
                raise RpcError(INVALID_PARAMS, "params.statusTimestampAfter must be an RFC 3339 time with its time "
                                               "zone (2026-01-31T12:00:00Z)") from e
        cursor: tuple[float, str] | None = None
        token = _get(params, "pageToken", "page_token")
        if token:
            try:
                raw = orjson.loads(base64.urlsafe_b64decode(str(token) + "=" * (-len(str(token)) % 4)))
                cursor = (float(raw["ts"]), str(raw["id"]))
                if not math.isfinite(cursor[0]):
                    raise ValueError("not a finite time")
            except (ValueError, KeyError, TypeError, orjson.JSONDecodeError) as e:
                raise RpcError(INVALID_PARAMS, "params.pageToken is not a token this server gave "
                                               "(use nextPageToken of the previous page)") from e
        tenant = request[TENANT]
        recs = [r for r in await self.store.list_sessions(100_000) if tenant_of(r) == tenant
                and (ctx is None or _context_of(r) == ctx) and (after is None or r.updated_at > after)]
        if status is not None:
            recs = [r for r in recs if task_state(r, await self.runner.busy(r.session_id)) == status]
        recs.sort(key=lambda r: (r.updated_at, r.session_id), reverse=True)
        total = len(recs)
        if cursor is not None:
            recs = [r for r in recs if (r.updated_at, r.session_id) < cursor]
        page = recs[:size]
        nxt = ""
        if len(recs) > size:
            last = page[-1]
            nxt = base64.urlsafe_b64encode(orjson.dumps({"ts": last.updated_at, "id": last.session_id})
                                           ).decode().rstrip("=")
        tasks = [await self.task(r, history_length=hl, artifacts=bool(include), usage=False) for r in page]
        return _json(_rpc_result(rid, {"tasks": tasks, "nextPageToken": nxt, "pageSize": size, "totalSize": total}))

    async def push_config(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        raise RpcError(PUSH_NOT_SUPPORTED, "this agent does not send push notifications (capabilities."
                                           "pushNotifications is false): stream the task (SendStreamingMessage, "
                                           "SubscribeToTask) or poll GetTask")

    async def extended_card(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        raise RpcError(UNSUPPORTED_OPERATION, "this agent has no extended card (capabilities.extendedAgentCard is "
                                              f"false): its card is at {AGENT_CARD_PATH}")

    async def cancel_task(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        rec = await self.session(request, _get(params, "id"))
        sid = rec.session_id
        state = task_state(rec, await self.runner.busy(sid))
        if state in TERMINAL_STATES:
            raise RpcError(TASK_NOT_CANCELABLE, f"task {sid} is {state.removeprefix('TASK_STATE_')}: only a "
                                                "submitted, working or input-required task can be canceled")
        sub = self.store.notifier.subscribe(sid)
        try:
            try:
                await send_control(self.store, sid, ControlKind.CANCEL, "canceled by an A2A client (CancelTask)")
            except ResumeError as e:
                raise RpcError(TASK_NOT_CANCELABLE, f"task {sid} cannot be canceled: {e}") from e
            deadline = time.monotonic() + self.config.cancel_wait
            submitted = 0
            while True:
                rec = await self.store.get_session(sid) or rec
                if rec.state in STOPPED_STATES and not await self.runner.busy(sid):
                    if rec.state == StopReason.CANCELLED.value or not StopReason(rec.state).resumable or submitted >= 2:
                        break
                    # stopped (waiting for input, paused, or asking to confirm the cancel): resume it to
                    # apply the cancel; a CancelTask confirms a cancel that waits on side effects without
                    # compensation (they stay as they are)
                    await self.runner.submit(RunRequest(sid, "resume", confirm_cancel=True))
                    submitted += 1
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sub.wake.clear()
                try:
                    async with asyncio.timeout(min(left, 1.0)):
                        await sub.wake.wait()
                except TimeoutError:
                    pass
        finally:
            self.store.notifier.unsubscribe(sub)
        rec = await self.store.get_session(sid) or rec
        return _json(_rpc_result(rid, await self.task(rec)))

    # -- sending -------------------------------------------------------------------------------
    async def _accept(self, request: web.Request, params: dict[str, Any]) -> tuple[SessionRecord, int, bool]:
        """Create the task of a new message, or apply a message to its task. Returns (the session,
        the seq the stream of this message follows, whether this message did something new)."""
        msg = _inbound(params)
        tenant = request[TENANT]
        if msg.task_id is None:
            if msg.decisions is not None or msg.limits is not None:
                raise RpcError(INVALID_PARAMS, "decisions and limits answer a task waiting for input: name it in "
                                               "params.message.taskId")
            if not msg.text.strip():
                raise RpcError(INVALID_PARAMS, "params.message has no text: a new task needs text parts")
            return await self._create(request, msg, tenant)
        rec = await self.session(request, msg.task_id, "params.message.taskId")
        if msg.context_id is not None and msg.context_id != _context_of(rec):
            raise RpcError(INVALID_PARAMS, f"params.message.contextId {msg.context_id!r} is not the context of task "
                                           f"{rec.session_id} ({_context_of(rec)!r})")
        return await self._continue(rec, msg)

    async def _create(self, request: web.Request, msg: _Inbound, tenant: str) -> tuple[SessionRecord, int, bool]:
        sid = _task_id_for(tenant, msg.message_id)
        rec = SessionRecord(sid, QUEUED, goal=msg.text[:2000], metadata={
            "tenant": tenant, "task": msg.text,
            "a2a": {"context_id": msg.context_id or uuid.uuid4().hex, "message_id": msg.message_id,
                    "digest": msg.digest}})
        try:
            await self.store.create_session(rec)
        except SessionExistsError:
            old = await self.store.get_session(sid)
            if old is None or tenant_of(old) != tenant or _a2a_meta(old).get("digest") != msg.digest:
                raise RpcError(INVALID_PARAMS, f"messageId {msg.message_id!r} was already used for a different "
                                               "message: give each new message a new messageId") from None
            # a retry of the same message: the task it created (queued again when the first attempt
            # failed between creating the task and queueing its run; a duplicate start is a no-op)
            if old.state == QUEUED and not await self.runner.busy(sid):
                await self.runner.submit(RunRequest(sid, "start", task=msg.text))
            return old, 0, False
        await self.runner.submit(RunRequest(sid, "start", task=msg.text))
        return rec, 0, True

    async def _continue(self, rec: SessionRecord, msg: _Inbound) -> tuple[SessionRecord, int, bool]:
        """Apply a message to its task, once: a message already applied (a client's retry, also after
        the task ended) answers with what the first one did. The record that says so is written
        after the message took effect, so a failure half way leaves a retry that applies it again,
        never one that is told it was applied when it was not (retries in this process wait for the
        first attempt; a decision already stored is not stored twice)."""
        sid = rec.session_id
        key = _MESSAGE_KEY + msg.message_id
        async with self._one_at_a_time(f"{sid}\0{key}"):
            prior = (await self.store.idempotency_records(sid, key)).get(key)
            if prior is not None:
                if prior.get("digest") != msg.digest:
                    raise RpcError(INVALID_PARAMS, f"messageId {msg.message_id!r} was already used for a different "
                                                   "message: give each new message a new messageId")
                return rec, int(prior.get("after") or 0), False
            rec = await self.store.get_session(sid) or rec
            state = task_state(rec, await self.runner.busy(sid))
            if state in TERMINAL_STATES:
                raise RpcError(UNSUPPORTED_OPERATION, f"task {sid} is {state.removeprefix('TASK_STATE_')} (terminal): "
                                                      "it takes no more messages; send a message without taskId (same "
                                                      "contextId) to start a new task")
            running = state in (SUBMITTED, WORKING)
            if running:
                if msg.decisions is not None or msg.limits is not None:
                    raise RpcError(INVALID_PARAMS, f"task {sid} is working: decisions and limits answer a task "
                                                   "waiting for input (send them after it stops INPUT_REQUIRED)")
                if not msg.text.strip():
                    raise RpcError(INVALID_PARAMS, "params.message has no text to pass to the working task")
            else:
                self._check_answers(rec, msg)
            after = rec.last_seq
            if running:
                await send_control(self.store, sid, ControlKind.FOLLOWUP, msg.text)
            else:
                if msg.decisions:
                    await self._decide(sid, msg.decisions)
                if msg.text.strip():
                    await send_control(self.store, sid, ControlKind.STEER, msg.text)
                await self.runner.submit(RunRequest(sid, "resume", limits=dict(msg.limits or {})))
            record = {"digest": msg.digest, "after": after, "message_id": msg.message_id, "text": msg.text,
                      "data": msg.control}
            stored, first = await self.store.claim_idempotency_key(sid, key, record)
            if not first:  # another server process applied the same message meanwhile
                log.warning("A2A message %s of task %s was applied by two requests at once", msg.message_id, sid)
                return rec, int(stored.get("after") or after), False
            return rec, after, True

    def _check_answers(self, rec: SessionRecord, msg: _Inbound) -> None:
        """Check that a message answers what its stopped task waits for (the decisions themselves
        are checked by the one writer, :meth:`_decide`)."""
        sid, stop = rec.session_id, rec.stop or {}
        reason = _reason(stop) or rec.state
        pending = {p["call"]["id"]: p for p in stop.get("pending_actions") or ()} \
            if reason == StopReason.WAITING_HUMAN.value else {}
        if msg.decisions is not None and not pending:
            raise RpcError(INVALID_PARAMS, f"task {sid} has no tool call waiting for a decision")
        if reason == StopReason.WAITING_HUMAN.value and stop.get("required_decision") == "confirm_cancel":
            raise RpcError(INVALID_PARAMS, f"task {sid} waits for a cancel to be confirmed ({stop.get('detail')}): "
                                           "send CancelTask to confirm it; a message cannot continue it")
        if pending and msg.decisions is None:
            calls = ", ".join(f"{p['call']['name']}({cid})" for cid, p in pending.items())
            raise RpcError(INVALID_PARAMS, f"task {sid} waits for decisions on tool call(s) {calls}: send a data part "
                                           '{"decisions": {"CALL_ID": {"decision": "approve"}}} (text alone does '
                                           "not answer them)")
        if reason == StopReason.PAUSED_BUDGET.value and not msg.limits:
            raise RpcError(INVALID_PARAMS, f"task {sid} is paused: {stop.get('detail') or 'a budget ran out'}; send a "
                                           f'data part {{"limits": {{"max_iterations": N}}}} raising it '
                                           f"({', '.join(_LIMITS)})")

    async def _decide(self, sid: str, decisions: Mapping[str, Decision]) -> None:
        """Take a message's decisions through the one writer: all are checked before any is stored;
        a repeat of a decision taken before is no error (the message's retry)."""
        try:
            await write_decisions(self.store, sid, decisions, tools=self.app[AGENT_KEY].tools)
        except DecisionRefused as e:
            if e.kind == "conflict":
                first = e.prior.kind if e.prior is not None else "another decision"
                raise RpcError(INVALID_PARAMS, f"tool call {e.call_id!r} was already decided differently ({first}); "
                               "a different decision is refused") from e
            raise RpcError(INVALID_PARAMS, f"decisions[{e.call_id!r}]: {e}") from e

    async def _wait_stopped(self, request: web.Request, sid: str, timeout: float) -> None:
        """Wait until no run of ``sid`` is queued or running and it stopped, or ``timeout`` seconds,
        or the server stops, or the client of ``request`` hangs up (looked at every
        :data:`~fsm_agent.server.tail.GONE_POLL` seconds: nobody would read the answer)."""
        notifier = self.store.notifier
        sub = notifier.subscribe(sid)
        deadline = time.monotonic() + timeout
        try:
            while True:
                sub.wake.clear()
                rec = await self.store.get_session(sid)
                if rec is None or rec.state != QUEUED and rec.state in STOPPED_STATES and not await self.runner.busy(sid):
                    return
                left = deadline - time.monotonic()
                if left <= 0 or self.tail.closing or client_gone(request):
                    return
                try:
                    async with asyncio.timeout(min(left, GONE_POLL)):
                        await sub.wake.wait()
                except TimeoutError:
                    pass
        finally:
            notifier.unsubscribe(sub)

    async def send_message(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        hl, immediately = _configuration(params)
        rec, _after, _new = await self._accept(request, params)
        if not immediately:
            await self._wait_stopped(request, rec.session_id, self.config.blocking_timeout)
        rec = await self.store.get_session(rec.session_id) or rec
        return _json(_rpc_result(rid, {"task": await self.task(rec, history_length=hl)}))

    async def send_streaming_message(self, request: web.Request, rid: Any, params: dict[str, Any]
                                     ) -> web.StreamResponse:
        hl, _ = _configuration(params)
        rec, after, _new = await self._accept(request, params)
        if after == 0:  # a new task (or a retry of the message that made it): its stream from the start
            ctx = _context_of(rec)
            first: dict[str, Any] = {"id": rec.session_id, "contextId": ctx,
                                     "status": {"state": SUBMITTED, "timestamp": _ts(rec.created_at)}}
            if hl is None or hl > 0:
                first["history"] = [{"messageId": str(_a2a_meta(rec).get("message_id") or rec.session_id),
                                     "contextId": ctx, "taskId": rec.session_id, "role": "ROLE_USER",
                                     "parts": [{"text": str(rec.metadata.get("task") or rec.goal)}]}]
        else:
            first = await self.task(rec, history_length=hl)
        return await self.stream(request, rid, rec, after, {"task": first})

    async def subscribe(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.StreamResponse:
        rec = await self.session(request, _get(params, "id"))
        raw = request.headers.get("Last-Event-ID", "").strip()
        if raw:
            if not _SEQ.match(raw) or int(raw) > 2**63 - 1:
                raise RpcError(INVALID_PARAMS, "Last-Event-ID must be an event seq (the id: of a frame), "
                                               f"not {raw[:40]!r}")
            if int(raw) > rec.last_seq:
                raise RpcError(INVALID_PARAMS, f"Last-Event-ID {raw} is past the end of task {rec.session_id}'s log "
                                               f"(last seq {rec.last_seq}): it comes from another task or server")
            return await self.stream(request, rid, rec, int(raw), None)
        state = task_state(rec, await self.runner.busy(rec.session_id))
        if state in TERMINAL_STATES:
            raise RpcError(UNSUPPORTED_OPERATION, f"task {rec.session_id} is {state.removeprefix('TASK_STATE_')} "
                                                  "(terminal): nothing more will stream; GetTask returns it (or send "
                                                  "Last-Event-ID to replay its frames)")
        return await self.stream(request, rid, rec, rec.last_seq, {"task": await self.task(rec)})

    async def stream(self, request: web.Request, rid: Any, rec: SessionRecord, after: int,
                     first: dict[str, Any] | None) -> web.StreamResponse:
        """The SSE answer: ``first`` (a snapshot, ``id:`` = ``after``), then the frames of the log
        events after ``after``, then live ones; closes once the session stopped and no run of it is
        queued or running (the app's :class:`~fsm_agent.server.tail.LogTail`)."""
        sid = rec.session_id
        frames = _Frames(self, rid, sid, _context_of(rec))

        def failed(e: Exception) -> bytes:
            log.error("A2A stream of task %s failed", sid, exc_info=e)
            err = RpcError(INTERNAL_ERROR, f"the stream failed ({type(e).__name__}); SubscribeToTask with "
                                           "Last-Event-ID resumes it")
            return encode_frame(_rpc_error(rid, err), event="error")

        return await self.tail.stream(request, sid, after, frame=frames.of, live=frames.live, retry=False,
                                      first=None if first is None else encode_frame(_rpc_result(rid, first), id=after),
                                      on_error=failed)




A2A_KEY = web.AppKey("fsm_a2a", _A2A)


def add_a2a_routes(app: web.Application, config: A2AConfig) -> None:
    """Serve the app's agent over A2A 1.0 (JSON-RPC binding): the card at :data:`AGENT_CARD_PATH`
    and the endpoint at ``config.path`` (see the module docstring). Call it before the app starts.

    Raises:
        ConfigurationError: ``app`` was not made by :func:`~fsm_agent.server.create_app`, or has A2A
            routes already.
    """
    if any(k not in app for k in (STORE_KEY, RUNNER_KEY, TENANTS_KEY, AGENT_KEY, TAIL_KEY)):
        raise ConfigurationError("add_a2a_routes needs an app made by fsm_agent.server.create_app")
    if A2A_KEY in app:
        raise ConfigurationError("this app serves A2A already: call add_a2a_routes once")
    srv = _A2A(app, config)
    app[A2A_KEY] = srv
    app.router.add_get(AGENT_CARD_PATH, srv.get_card)
    app.router.add_post(config.path, srv.rpc)
