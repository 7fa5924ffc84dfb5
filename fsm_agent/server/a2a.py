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

The routes are here; what a client sends is checked by :mod:`.a2a_requests`, a run is told as a
task by :mod:`.a2a_tasks`, and the wire both sides speak (the JSON-RPC envelope, task states and
the stop-to-task-state mapping, messages and frames) is :mod:`fsm_agent.orchestration.a2a_wire`,
which fsm_agent's A2A client uses too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from attrs import field, frozen

from ..control import Decision
from ..errors import ConfigurationError, DecisionRefused, ResumeError, SessionExistsError
from ..orchestration.a2a_wire import (A2A_VERSION, AGENT_CARD_PATH, ALL_STATES, ANSWER_ARTIFACT, AUTH_REQUIRED,
                                      CANCELED, COMPLETED, FAILED, INPUT_REQUIRED, INTERNAL_ERROR, INVALID_PARAMS,
                                      INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR, PUSH_NOT_SUPPORTED,
                                      REFUSAL_KINDS, REJECTED, SUBMITTED, TASK_NOT_CANCELABLE, TASK_NOT_FOUND,
                                      TERMINAL_STATES, UNSUPPORTED_OPERATION, WORKING, RpcError, TaskState,
                                      answer_artifact, parse_request, rpc_error, rpc_result, stop_reason,
                                      stop_task_state, task_state, usage_metadata)
from ..store.base import QUEUED, ControlKind, SessionRecord
from ..store.decisions import write_decisions
from ..store.sessions import send_control
from ..types.run import StopReason
from .a2a_requests import (MAX_ID, Inbound, bad_char, check_version, get_field, id_field, opt_int,
                           parse_configuration, parse_message)
from .a2a_tasks import (MESSAGE_KEY, Frames, a2a_meta, add_usage, context_of, event_result, history, stop_status,
                        task_id_for, text_of, timestamp)
from .app import AGENT_KEY, RUNNER_KEY, STORE_KEY, TAIL_KEY, TENANT, TENANTS_KEY
from .auth import tenant_of
from .notify import NotifyingStore
from .runs import RESUME_LIMITS, STOPPED_STATES, RunRequest, Runner
from .sse import encode_frame
from .tail import GONE_POLL, LogTail, client_gone

__all__ = ["A2A_VERSION", "AGENT_CARD_PATH", "ALL_STATES", "ANSWER_ARTIFACT", "AUTH_REQUIRED", "CANCELED", "COMPLETED",
           "FAILED", "INPUT_REQUIRED", "REFUSAL_KINDS", "REJECTED", "SUBMITTED", "TERMINAL_STATES", "WORKING",
           "A2AConfig", "A2ASkill", "RpcError", "add_a2a_routes", "event_result", "stop_task_state", "task_state"]

log = logging.getLogger("fsm_agent.server.a2a")

_PUSH_METHODS = ("CreateTaskPushNotificationConfig", "GetTaskPushNotificationConfig",
                 "ListTaskPushNotificationConfigs", "DeleteTaskPushNotificationConfig")
_SEQ = re.compile(r"^[0-9]{1,19}$")


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")


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
            rid, method, params = parse_request(body)
            check_version(request.headers.get("A2A-Version"))
            handler = self.methods.get(method)
            if handler is None:
                hint = (" (A2A 0.3 method names are not served: 1.0 names are PascalCase)"
                        if "/" in method else "")
                raise RpcError(METHOD_NOT_FOUND, f"unknown method {method[:60]!r}{hint}; methods: "
                                                 + ", ".join(m for m in self.methods if m not in _PUSH_METHODS))
            return await handler(request, rid, params)
        except RpcError as e:
            return _json(rpc_error(rid if "id" not in e.data else e.data.pop("id"), e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a JSON-RPC error, never a crashed handler
            log.exception("A2A request failed")
            return _json(rpc_error(rid, RpcError(INTERNAL_ERROR, f"internal error ({type(e).__name__}); the server's "
                                                                  "log has the details")))

    async def session(self, request: web.Request, task_id: Any, where: str = "params.id") -> SessionRecord:
        if not isinstance(task_id, str) or not task_id:
            raise RpcError(INVALID_PARAMS, f"{where} is required: the task id")
        if len(task_id) > MAX_ID or any(bad_char(c) for c in task_id):
            raise RpcError(TASK_NOT_FOUND, f"no task {task_id[:60]!r}")
        rec = await self.store.get_session(task_id)
        if rec is None or tenant_of(rec) != request[TENANT]:
            raise RpcError(TASK_NOT_FOUND, f"no task {task_id!r}", {"task_id": task_id})
        return rec

    async def task(self, rec: SessionRecord, *, history_length: int | None = None, artifacts: bool = True,
                   usage: bool = True) -> dict[str, Any]:
        """The A2A task of a session now."""
        sid, ctx = rec.session_id, context_of(rec)
        busy = await self.runner.busy(sid)
        state = task_state(rec, busy)
        status: dict[str, Any] = {"state": state, "timestamp": timestamp(rec.updated_at)}
        if rec.stop and state not in (SUBMITTED, WORKING):
            status = stop_status(rec.stop, sid, ctx, rec.updated_at, rec.last_seq)
        task: dict[str, Any] = {"id": sid, "contextId": ctx, "status": status}
        want_history = history_length is None or history_length > 0
        if artifacts or want_history or usage:
            types = ("message",) + (("model_call", "usage_rolled_up") if usage else ())
            events = await self.store.read_events(sid, types=types)
            msgs = [e for e in events if e.type == "message"]
            if artifacts:
                texts = [text_of(e.payload.get("message") or {}) for e in msgs
                         if (e.payload.get("message") or {}).get("role") == "assistant"]
                texts = [t for t in texts if t]
                if texts:
                    task["artifacts"] = [answer_artifact(texts[-1])]
            if want_history:
                sent = await self.store.idempotency_records(sid, MESSAGE_KEY)
                listed = history(rec, msgs, list(sent.values()))
                task["history"] = listed[-history_length:] if history_length else listed
            meta: dict[str, Any] = {"session_id": sid, "session_state": rec.state}
            if usage:
                meta.update(usage_metadata(*add_usage([e for e in events if e.type != "message"])))
            task["metadata"] = {"fsm_agent": meta}
        return task

    # -- methods -------------------------------------------------------------------------------
    async def get_task(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        rec = await self.session(request, get_field(params, "id"))
        hl = opt_int(params, "historyLength", "history_length", "params", 0, 2**31 - 1)
        return _json(rpc_result(rid, await self.task(rec, history_length=hl)))

    async def list_tasks(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        ctx = id_field(params, "contextId", "context_id", "params", required=False)
        status = get_field(params, "status")
        if isinstance(status, str) and status in ("", TaskState.UNSPECIFIED.value) or type(status) is int and status == 0:
            status = None
        if status is not None and (not isinstance(status, str) or status not in ALL_STATES):
            raise RpcError(INVALID_PARAMS, f"params.status must be one of {', '.join(sorted(ALL_STATES))}, "
                                           f"not {str(status)[:40]!r}")
        size = opt_int(params, "pageSize", "page_size", "params", 1, 100) or 50
        hl = opt_int(params, "historyLength", "history_length", "params", 0, 2**31 - 1)
        include = get_field(params, "includeArtifacts", "include_artifacts")
        if include is not None and not isinstance(include, bool):
            raise RpcError(INVALID_PARAMS, "params.includeArtifacts must be true or false")
        after_raw = get_field(params, "statusTimestampAfter", "status_timestamp_after")
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
        token = get_field(params, "pageToken", "page_token")
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
                and (ctx is None or context_of(r) == ctx) and (after is None or r.updated_at > after)]
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
        return _json(rpc_result(rid, {"tasks": tasks, "nextPageToken": nxt, "pageSize": size, "totalSize": total}))

    async def push_config(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        raise RpcError(PUSH_NOT_SUPPORTED, "this agent does not send push notifications (capabilities."
                                           "pushNotifications is false): stream the task (SendStreamingMessage, "
                                           "SubscribeToTask) or poll GetTask")

    async def extended_card(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        raise RpcError(UNSUPPORTED_OPERATION, "this agent has no extended card (capabilities.extendedAgentCard is "
                                              f"false): its card is at {AGENT_CARD_PATH}")

    async def cancel_task(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.Response:
        rec = await self.session(request, get_field(params, "id"))
        sid = rec.session_id
        state = task_state(rec, await self.runner.busy(sid))
        if state in TERMINAL_STATES:
            raise RpcError(TASK_NOT_CANCELABLE, f"task {sid} is {TaskState(state).short}: only a "
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
        return _json(rpc_result(rid, await self.task(rec)))

    # -- sending -------------------------------------------------------------------------------
    async def _accept(self, request: web.Request, params: dict[str, Any]) -> tuple[SessionRecord, int, bool]:
        """Create the task of a new message, or apply a message to its task. Returns (the session,
        the seq the stream of this message follows, whether this message did something new)."""
        msg = parse_message(params)
        tenant = request[TENANT]
        if msg.task_id is None:
            if msg.decisions is not None or msg.limits is not None:
                raise RpcError(INVALID_PARAMS, "decisions and limits answer a task waiting for input: name it in "
                                               "params.message.taskId")
            if not msg.text.strip():
                raise RpcError(INVALID_PARAMS, "params.message has no text: a new task needs text parts")
            return await self._create(request, msg, tenant)
        rec = await self.session(request, msg.task_id, "params.message.taskId")
        if msg.context_id is not None and msg.context_id != context_of(rec):
            raise RpcError(INVALID_PARAMS, f"params.message.contextId {msg.context_id!r} is not the context of task "
                                           f"{rec.session_id} ({context_of(rec)!r})")
        return await self._continue(rec, msg)

    async def _create(self, request: web.Request, msg: Inbound, tenant: str) -> tuple[SessionRecord, int, bool]:
        sid = task_id_for(tenant, msg.message_id)
        rec = SessionRecord(sid, QUEUED, goal=msg.text[:2000], metadata={
            "tenant": tenant, "task": msg.text,
            "a2a": {"context_id": msg.context_id or uuid.uuid4().hex, "message_id": msg.message_id,
                    "digest": msg.digest}})
        try:
            await self.store.create_session(rec)
        except SessionExistsError:
            old = await self.store.get_session(sid)
            if old is None or tenant_of(old) != tenant or a2a_meta(old).get("digest") != msg.digest:
                raise RpcError(INVALID_PARAMS, f"messageId {msg.message_id!r} was already used for a different "
                                               "message: give each new message a new messageId") from None
            # a retry of the same message: the task it created (queued again when the first attempt
            # failed between creating the task and queueing its run; a duplicate start is a no-op)
            if old.state == QUEUED and not await self.runner.busy(sid):
                await self.runner.submit(RunRequest(sid, "start", task=msg.text))
            return old, 0, False
        await self.runner.submit(RunRequest(sid, "start", task=msg.text))
        return rec, 0, True

    async def _continue(self, rec: SessionRecord, msg: Inbound) -> tuple[SessionRecord, int, bool]:
        """Apply a message to its task, once: a message already applied (a client's retry, also after
        the task ended) answers with what the first one did. The record that says so is written
        after the message took effect, so a failure half way leaves a retry that applies it again,
        never one that is told it was applied when it was not (retries in this process wait for the
        first attempt; a decision already stored is not stored twice)."""
        sid = rec.session_id
        key = MESSAGE_KEY + msg.message_id
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
                raise RpcError(UNSUPPORTED_OPERATION, f"task {sid} is {TaskState(state).short} (terminal): "
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

    def _check_answers(self, rec: SessionRecord, msg: Inbound) -> None:
        """Check that a message answers what its stopped task waits for (the decisions themselves
        are checked by the one writer, :meth:`_decide`)."""
        sid, stop = rec.session_id, rec.stop or {}
        reason = stop_reason(stop) or rec.state
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
                                           f"({', '.join(RESUME_LIMITS)})")

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
        hl, immediately = parse_configuration(params)
        rec, _after, _new = await self._accept(request, params)
        if not immediately:
            await self._wait_stopped(request, rec.session_id, self.config.blocking_timeout)
        rec = await self.store.get_session(rec.session_id) or rec
        return _json(rpc_result(rid, {"task": await self.task(rec, history_length=hl)}))

    async def send_streaming_message(self, request: web.Request, rid: Any, params: dict[str, Any]
                                     ) -> web.StreamResponse:
        hl, _ = parse_configuration(params)
        rec, after, _new = await self._accept(request, params)
        if after == 0:  # a new task (or a retry of the message that made it): its stream from the start
            ctx = context_of(rec)
            first: dict[str, Any] = {"id": rec.session_id, "contextId": ctx,
                                     "status": {"state": SUBMITTED, "timestamp": timestamp(rec.created_at)}}
            if hl is None or hl > 0:
                first["history"] = [{"messageId": str(a2a_meta(rec).get("message_id") or rec.session_id),
                                     "contextId": ctx, "taskId": rec.session_id, "role": "ROLE_USER",
                                     "parts": [{"text": str(rec.metadata.get("task") or rec.goal)}]}]
        else:
            first = await self.task(rec, history_length=hl)
        return await self.stream(request, rid, rec, after, {"task": first})

    async def subscribe(self, request: web.Request, rid: Any, params: dict[str, Any]) -> web.StreamResponse:
        rec = await self.session(request, get_field(params, "id"))
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
            raise RpcError(UNSUPPORTED_OPERATION, f"task {rec.session_id} is {TaskState(state).short} "
                                                  "(terminal): nothing more will stream; GetTask returns it (or send "
                                                  "Last-Event-ID to replay its frames)")
        return await self.stream(request, rid, rec, rec.last_seq, {"task": await self.task(rec)})

    async def stream(self, request: web.Request, rid: Any, rec: SessionRecord, after: int,
                     first: dict[str, Any] | None) -> web.StreamResponse:
        """The SSE answer: ``first`` (a snapshot, ``id:`` = ``after``), then the frames of the log
        events after ``after``, then live ones; closes once the session stopped and no run of it is
        queued or running (the app's :class:`~fsm_agent.server.tail.LogTail`)."""
        sid = rec.session_id
        frames = Frames(self.store, rid, sid, context_of(rec))

        def failed(e: Exception) -> bytes:
            log.error("A2A stream of task %s failed", sid, exc_info=e)
            err = RpcError(INTERNAL_ERROR, f"the stream failed ({type(e).__name__}); SubscribeToTask with "
                                           "Last-Event-ID resumes it")
            return encode_frame(rpc_error(rid, err), event="error")

        return await self.tail.stream(request, sid, after, frame=frames.of, live=frames.live, retry=False,
                                      first=None if first is None else encode_frame(rpc_result(rid, first), id=after),
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
