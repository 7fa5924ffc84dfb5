"""The HTTP app: sessions, runs, the SSE event stream, control, approvals, the diagram, the review page.

Routes (``docs/server.md`` describes each; ``GET /openapi.json`` serves the OpenAPI document).
JSON in and out; every error is an RFC 9457 problem document (``application/problem+json``):

* ``POST /sessions`` ``{"task", "session_id"?, "permissions"?}``: create a session (state ``QUEUED``)
  and start its first run; 201 + ``Location``. ``task`` is a message, or a task definition (an
  object: task mode, docs/tasks.md). The session's permissions are the tenant's default narrowed
  by ``permissions`` and a task's own (docs/permissions.md).
* ``POST /sessions/{sid}/runs`` ``{"task"?, "limits"?, "confirm_cancel"?}``: start a run in the
  background (a new session with ``task`` when ``sid`` is unknown, else a resume); 202 + ``Location``.
* ``POST /sessions/{sid}/runs/stream``: the same, answered with the event stream from that point
  (``Location`` names the join URL).
* ``GET /sessions/{sid}/events``: the SSE join. ``id:`` is the log seq. Replays every event after
  ``Last-Event-ID`` (or ``?after=N``), then live events, with no gap and no duplicate. Streaming
  deltas (``event: delta``) are live only: no id, never stored. Closes after a ``run_stopped``
  that is the last event of the log while no run of the session is queued or running.
* ``GET /sessions/{sid}``: the snapshot; ``GET /sessions?state=…&limit=…``: the tenant's sessions.
* ``POST /sessions/{sid}/control`` ``{"kind": "interrupt"|"cancel"|"steer"|"followup", "text"?}``, or
  ``{"kind": "restrict", "restriction": {...}}`` / ``{"kind": "request_permissions", "permissions": {...}}``
  (``"reason"?``): narrow the session's permissions, or ask a person to widen them.
* ``POST /sessions/{sid}/approvals/{call_id}`` ``{"decision": "approve"|"edit"|"reject"|"respond",
  "arguments"?, "message"?, "is_error"?}``: through the one writer of decisions
  (:func:`fsm_agent.store.decisions.write_decision`); idempotent (a repeat returns the first
  outcome; a different decision for the same call is 409).
* ``GET /sessions/{sid}/diagram``: the Mermaid source, current state and path (``?format=json``);
  ``?view=plan`` gives the session's PlanAct plan as a flowchart instead (404 without one), and the
  JSON form always carries ``plan`` and ``plan_mermaid`` (null without one).
* ``GET /review/{sid}`` and ``/static/…``: the review page (:mod:`fsm_agent.server.review`).
* ``GET /memory/episodes`` (``?q=`` to search), ``GET|DELETE /memory/episodes/{eid}``, ``DELETE
  /memory/episodes?all=true``: the tenant's episodic memory (:mod:`fsm_agent.server.memory`).
* ``POST /auth/login`` / ``/auth/logout``, ``GET /healthz``, ``GET /openapi.json``.

Who drives runs is a :class:`~fsm_agent.server.runs.Runner`: by default a
:class:`~fsm_agent.server.runs.LocalRunner` in this process; with PostgreSQL, a
:class:`~fsm_agent.server.queue.QueueRunner` that hands runs to ``fsm-agent worker`` processes.
A run never waits on a client: the store only sets wake-up flags (:mod:`fsm_agent.server.notify`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import attrs
from aiohttp import web

from ..agent import Agent
from ..control import Decision
from ..diagrams import latest_plan, render_machine, render_plan
from ..errors import ConfigurationError, DecisionRefused, PermissionsError, ResumeError, SessionExistsError, \
    TaskDefinitionError
from ..hooks import HookBus
from ..store.base import QUEUED, ControlKind, SessionRecord, Store
from ..store.decisions import DECISION_KINDS, read_decisions, write_decision
from ..permissions import PERMISSIONS_METADATA_KEY, Permissions, control_text
from ..store.sessions import send_control
from ..task import TASK_DEFINITION_KEY, Task
from ..types.codec import unstructure
from ..machine.phases import Phase
from ..types.run import StopReason
from .auth import (AUTH_COOKIE, CSRF_COOKIE, DEFAULT_TENANT, PUBLIC, Forbidden, Tenants, Unauthorized,
                   authenticate, check_same_origin, set_cookies, tenant_of)
from .http import Problem, check_fields, json_body, json_response, opt_bool, opt_str, problems
from .notify import LiveDeltas, Notifier, NotifyingStore
from .openapi import openapi_document
from .memory import add_memory_routes
from .review import add_review_routes
from .runs import RESUME_LIMITS, LocalRunner, RunRequest, Runner
from .tail import LogTail

__all__ = ["AGENT_KEY", "RUNNER_KEY", "STORE_KEY", "TAIL_KEY", "Notifier", "NotifyingStore", "create_app"]

CONTROL_KEY = "control:"
"""Prefix of the idempotency key of a control sent with an ``Idempotency-Key`` header."""

AGENT_KEY = web.AppKey("fsm_agent", Agent)
TAIL_KEY = web.AppKey("fsm_tail", LogTail)
"""The app's :class:`~fsm_agent.server.tail.LogTail`: its event streams (REST and A2A) and their settings."""
STORE_KEY = web.AppKey("fsm_store", NotifyingStore)
RUNNER_KEY = web.AppKey("fsm_runner", Runner)
TENANTS_KEY = web.AppKey("fsm_tenants", Tenants)
TENANT = web.RequestKey("fsm_tenant", str)
"""The request's tenant (set by the auth middleware; ``""`` on public routes)."""

_CONTROL_KINDS = {"restrict": ControlKind.RESTRICT, "request_permissions": ControlKind.REQUEST_PERMISSIONS,
                  "interrupt": ControlKind.INTERRUPT, "cancel": ControlKind.CANCEL, "steer": ControlKind.STEER,
                  "followup": ControlKind.FOLLOWUP}
_DECISION_KINDS = DECISION_KINDS
_RESUMABLE = {r.value for r in StopReason if r.resumable}
_STATES = frozenset({QUEUED} | {p.value for p in Phase} | {r.value for r in StopReason})


_LIMITS = RESUME_LIMITS
_REFUSED = {"not_pending": (404, "Not pending"), "not_waiting": (409, "Not waiting"),
            "not_allowed": (409, "Decision not allowed"), "bad_arguments": (400, "Wrong field"),
            "conflict": (409, "Conflict"), "unknown_session": (404, "Unknown session")}
"""The problem (status, title) of each DecisionRefused kind."""
_MAX_SEQ = 2**63 - 1
A2A_ID_PREFIX = "a2a-"
"""Session ids with this prefix belong to A2A tasks (:mod:`fsm_agent.server.a2a` derives them from
the tenant and the message id). The REST routes refuse it for a session id a client chooses, before
looking anything up: no tenant can take another tenant's task id first, nor learn whether one
exists."""


def _bad_char(c: str) -> bool:
    return ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c == "/"


def _check_id(value: str, what: str) -> str:
    if not value or len(value) > 200 or any(_bad_char(c) for c in value):
        raise Problem(400, "Wrong field", f"a {what} is 1 to 200 characters, without control characters or '/'")
    return value


def _check_sid(sid: str) -> str:
    return _check_id(sid, "session id")


def _check_new_sid(sid: str) -> str:
    """A session id a client chooses for a new session."""
    _check_sid(sid)
    if sid.startswith(A2A_ID_PREFIX):
        raise Problem(400, "Wrong field", f"session ids starting with {A2A_ID_PREFIX!r} are reserved for A2A tasks: "
                                          "choose another id, or none (the server then picks one)")
    return sid


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def _trace_context(request: web.Request) -> dict[str, str] | None:
    """The caller's W3C trace context (``traceparent``, ``tracestate``), to be stored in the session's
    metadata (``otel_parent``): the run this request starts or resumes continues the caller's trace
    (:mod:`fsm_agent.otel`, on whichever worker drives it). ``None``: none, or not well formed."""
    parent = request.headers.get("traceparent", "").strip().lower()
    if not _TRACEPARENT.match(parent) or parent.startswith("ff"):
        return None
    state = request.headers.get("tracestate", "").strip()
    return {"traceparent": parent, **({"tracestate": state} if state and len(state) <= 512 else {})}


def _permissions(raw: Any, field: str) -> Permissions:
    """Permissions in the file format from a request's field.

    Raises:
        Problem: 400 listing every problem.
    """
    try:
        return Permissions.from_dict(raw, source=f"'{field}'")
    except PermissionsError as e:
        raise Problem(400, "Wrong field", "; ".join(e.problems)) from e


def _task_definition(raw: dict[str, Any]) -> Task:
    """A task definition from a request's ``task`` object (task mode; docs/tasks.md). A client may not
    name code for the server to run: a ``python`` check is refused.

    Raises:
        Problem: 400 listing every problem.
    """
    checks = raw.get("check")
    if isinstance(checks, list) and any(isinstance(c, dict) and "python" in c for c in checks):
        raise Problem(400, "Wrong field", "'task': a check over HTTP cannot name Python code (python = ...); use "
                                          "value checks and graded criteria, or run such a task from Python")
    try:
        return Task.from_dict(raw, source="'task'")
    except TaskDefinitionError as e:
        raise Problem(400, "Wrong field", "; ".join(e.problems)) from e


def _exists(sid: str) -> Problem:
    return Problem(409, "Session exists", f"session {sid!r} exists: start a run without a task to resume it")


def _limits(data: dict[str, Any]) -> dict[str, Any]:
    raw = data.get("limits")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise Problem(400, "Wrong field", "'limits' must be an object of budgets to raise: "
                                          + ", ".join(_LIMITS))
    for key, value in raw.items():
        types = _LIMITS.get(key)
        if types is None:
            raise Problem(400, "Wrong field", f"'limits.{key}' cannot be changed by a resume; "
                                              f"raise one of: {', '.join(_LIMITS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(value, types) \
                or not value > 0:
            kind = "a positive integer" if types == (int,) else "a positive number"
            raise Problem(400, "Wrong field", f"'limits.{key}' must be {kind}, not {value!r}")
    return dict(raw)


def _seq(raw: str, what: str) -> int:
    raw = raw.strip()
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19 or int(raw) > _MAX_SEQ:
        raise Problem(400, "Wrong field", f"{what} must be an event seq >= 0 (at most 2**63-1), not {raw[:40]!r}")
    return int(raw)


class _Server:
    """The routes over one agent, store, runner and set of tenants."""

    def __init__(self, agent: Agent, store: NotifyingStore, runner: Runner, tenants: Tenants,
                 cors_origins: frozenset[str], tail: LogTail) -> None:
        self.agent, self.store, self.runner, self.tenants = agent, store, runner, tenants
        self.cors_origins = cors_origins
        self.tail = tail

    # -- auth, CORS ------------------------------------------------------------------------
    @web.middleware
    async def auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
        path = request.path
        if request.method == "OPTIONS" and self.cors_origins:
            return self._preflight(request)
        if path in PUBLIC or path.startswith(("/review/", "/static/")):
            request[TENANT] = ""
            if request.method == "POST":  # sign-in and sign-out: no login CSRF from another site
                try:
                    check_same_origin(request, self.cors_origins)
                except Forbidden as e:
                    raise Problem(403, "Forbidden", str(e)) from e
            return await handler(request)
        try:
            request[TENANT] = authenticate(request, self.tenants, self.cors_origins)
        except Unauthorized as e:
            raise Problem(401, "Unauthorized", str(e), {"WWW-Authenticate": 'Bearer realm="fsm-agent"'}) from e
        except Forbidden as e:
            raise Problem(403, "Forbidden", str(e)) from e
        return await handler(request)

    def _preflight(self, request: web.Request) -> web.Response:
        origin = request.headers.get("Origin", "")
        if origin not in self.cors_origins:
            raise Problem(403, "Forbidden", f"CORS is not allowed for origin {origin or '(none)'}")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Vary": "Origin",
            "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
            "Access-Control-Allow-Headers": "Authorization, Content-Type, Last-Event-ID, Idempotency-Key",
            "Access-Control-Max-Age": "600"})

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and origin in self.cors_origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
            response.headers["Access-Control-Expose-Headers"] = "Location, Idempotent-Replayed"
        # the page's CSRF cookie, bound to its sign-in cookie (double submit; see fsm_agent.server.auth)
        expected = self.tenants.csrf_for(request.cookies.get(AUTH_COOKIE, ""))
        if request.cookies.get(CSRF_COOKIE) != expected and CSRF_COOKIE not in response.cookies:
            set_cookies(response, self.tenants, None, secure=request.secure)

    async def login(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        check_fields(data, {"token"})
        if not self.tenants.enabled:
            resp = json_response({"tenant": DEFAULT_TENANT, "note": "this server has no tokens: nothing to sign in to"})
            set_cookies(resp, self.tenants, "", secure=request.secure)
            return resp
        token = opt_str(data, "token", required=True, max_len=1000)
        assert token is not None
        tenant = self.tenants.tenant_for(token)
        if tenant is None:
            raise Problem(401, "Unauthorized", "this token is not valid",
                          {"WWW-Authenticate": 'Bearer realm="fsm-agent"'})
        resp = json_response({"tenant": tenant})
        set_cookies(resp, self.tenants, self.tenants.cookie_for(tenant), secure=request.secure)
        return resp

    async def logout(self, request: web.Request) -> web.Response:
        resp = json_response({"signed_out": True})
        resp.del_cookie(AUTH_COOKIE, path="/")
        return resp

    # -- sessions --------------------------------------------------------------------------
    async def session_of(self, request: web.Request, sid: str | None = None) -> SessionRecord:
        """The session of the path, for the request's tenant (another tenant's session is 404)."""
        sid = _check_sid(sid if sid is not None else request.match_info["sid"])
        rec = await self.store.get_session(sid)
        if rec is None or tenant_of(rec) != request[TENANT]:
            raise Problem(404, "Unknown session", f"no session {sid!r}")
        return rec

    async def create(self, request: web.Request, sid: str | None, task: str, definition: Task | None = None,
                     permissions: Permissions | None = None) -> SessionRecord:
        sid = _check_new_sid(sid) if sid is not None else uuid.uuid4().hex
        trace = _trace_context(request)
        meta: dict[str, Any] = {"tenant": request[TENANT], "task": task,
                                **({"otel_parent": trace} if trace else {})}
        tenant_default = self.tenants.permissions_for(request[TENANT])
        if tenant_default is not None and permissions is not None:
            permissions = tenant_default.narrow(permissions, "the request's permissions")
        permissions = permissions if permissions is not None else tenant_default
        if permissions is not None:
            meta[PERMISSIONS_METADATA_KEY] = permissions.to_dict()
        if definition is not None:
            meta[TASK_DEFINITION_KEY] = definition.to_dict()
        goal = definition.goal if definition is not None else task
        rec = SessionRecord(sid, QUEUED, goal=goal[:2000], metadata=meta)
        try:
            await self.store.create_session(rec)
        except SessionExistsError as e:
            # another tenant's session of that id is none of this tenant's business: same answer as its own
            raise _exists(sid) from e
        await self.runner.submit(RunRequest(sid, "start", task=task))
        return rec

    async def create_session(self, request: web.Request) -> web.Response:
        data = await json_body(request)
        check_fields(data, {"task", "session_id", "permissions"})
        raw = data.get("task")
        definition = _task_definition(raw) if isinstance(raw, dict) else None
        task = definition.prompt() if definition is not None else opt_str(data, "task", required=True)
        assert task is not None
        permissions = _permissions(data.get("permissions"), "permissions") if "permissions" in data else None
        rec = await self.create(request, opt_str(data, "session_id", max_len=200), task, definition, permissions)
        return json_response(await self.snapshot(rec), 201, {"Location": f"/sessions/{rec.session_id}"})

    async def _start_run(self, request: web.Request) -> tuple[str, int]:
        """Start or resume; returns the session id and the seq the new run's events follow."""
        sid = _check_sid(request.match_info["sid"])
        data = await json_body(request)
        check_fields(data, {"task", "limits", "confirm_cancel"})
        task = opt_str(data, "task")
        limits = _limits(data)
        confirm = opt_bool(data, "confirm_cancel")
        if task is not None:
            _check_new_sid(sid)  # before the lookup: the answer says nothing of whether it exists
        rec = await self.store.get_session(sid)
        if rec is None or tenant_of(rec) != request[TENANT]:
            if task is None:
                raise Problem(404, "Unknown session", f"no session {sid!r}; give a task to create it")
            if rec is not None:
                raise _exists(sid)  # another tenant's: the same answer as for one's own
            await self.create(request, sid, task)
            return sid, 0
        if task is not None:
            raise _exists(sid)
        if rec.state == QUEUED:
            raise Problem(409, "Cannot resume", f"session {sid} is queued: its first run has not started")
        if await self.runner.busy(sid):
            raise Problem(409, "Cannot resume", f"session {sid} has a run queued or in progress; "
                                                "interrupt it or wait for it to stop")
        try:
            attrs.evolve(self.agent.config, **limits)
        except (TypeError, ValueError, ConfigurationError) as e:  # RunConfig's own checks
            raise Problem(400, "Wrong field", f"'limits': {e}") from e
        try:
            await self.agent.check_resume(sid)
        except ResumeError as e:
            raise Problem(409, "Cannot resume", str(e)) from e
        if rec.state == StopReason.WAITING_HUMAN.value and not limits and not confirm \
                and not await read_decisions(self.store, rec) and not await self.store.peek_controls(
                    sid, [ControlKind.STEER, ControlKind.FOLLOWUP, ControlKind.CANCEL]):
            stop = rec.stop or {}
            pending = [p["call"]["id"] for p in stop.get("pending_actions") or ()]
            what = (f"decisions on the pending tool call(s) {', '.join(pending)}: POST "
                    f"/sessions/{sid}/approvals/CALL_ID" if pending else str(stop.get("required_decision") or
                                                                               "a decision"))
            raise Problem(409, "Nothing to resume with", f"session {sid} waits for {what}; a resume without it "
                                                          "would stop at once")
        trace = _trace_context(request)
        if trace or rec.metadata.get("otel_parent"):  # this resume continues this caller's trace (or none)
            await self.store.update_metadata(sid, {"otel_parent": trace})
        await self.runner.submit(RunRequest(sid, "resume", limits=dict(limits), confirm_cancel=confirm))
        return sid, rec.last_seq

    async def start_run(self, request: web.Request) -> web.Response:
        sid, _ = await self._start_run(request)
        rec = await self.store.get_session(sid)
        assert rec is not None
        return json_response(await self.snapshot(rec), 202, {"Location": f"/sessions/{sid}"})

    async def start_run_stream(self, request: web.Request) -> web.StreamResponse:
        sid, after = await self._start_run(request)
        return await self.stream(request, sid, after, {"Location": f"/sessions/{sid}/events"})

    async def snapshot(self, rec: SessionRecord, *, usage: bool = True) -> dict[str, Any]:
        stop = rec.stop or None
        out: dict[str, Any] = {
            "session_id": rec.session_id, "tenant": tenant_of(rec), "state": rec.state, "goal": rec.goal,
            "stop": stop, "pending_approvals": list((stop or {}).get("pending_actions") or ()) if
            rec.state == StopReason.WAITING_HUMAN.value else [],
            "last_seq": rec.last_seq, "running": await self.runner.busy(rec.session_id),
            "created_at": rec.created_at, "updated_at": rec.updated_at}
        if usage:
            out.update(await self._permissions_and_task(rec))
        if usage:
            inp = outp = 0
            cost: float | None = 0.0
            for ev in await self.store.read_events(rec.session_id, types=("model_call",)):
                u = ev.payload.get("usage") or {}
                inp += int(u.get("input_tokens") or 0)
                outp += int(u.get("output_tokens") or 0)
                c = ev.payload.get("cost_usd")
                cost = None if c is None or cost is None else cost + float(c)
            out["usage"] = {"input_tokens": inp, "output_tokens": outp}
            out["cost_usd"] = cost
        return out

    async def _permissions_and_task(self, rec: SessionRecord) -> dict[str, Any]:
        """A single session's snapshot adds ``permissions`` (in force now: its last checkpoint's, else
        those it was created with; null: no limit) and, for a task session, ``task``:
        ``{"definition", "result"}`` (the TaskResult once it stopped, else null)."""
        meta = rec.metadata if isinstance(rec.metadata, dict) else {}
        perms: Any = meta.get(PERMISSIONS_METADATA_KEY)
        ck = await self.store.latest_checkpoint(rec.session_id)
        if ck is not None and isinstance(ck.data, dict) and "permissions" in ck.data:
            from ..types.codec import structure

            now = ck.data["permissions"]
            perms = structure(now, Permissions).to_dict() if now is not None else None
        out: dict[str, Any] = {"permissions": perms}
        if TASK_DEFINITION_KEY in meta:
            result = None
            if rec.state in {r.value for r in StopReason}:
                try:
                    result = (await self.agent.task_result(rec.session_id)).to_json()
                except (ResumeError, ConfigurationError):
                    result = None
            out["task"] = {"definition": meta[TASK_DEFINITION_KEY], "result": result}
        return out

    async def get_session(self, request: web.Request) -> web.Response:
        return json_response(await self.snapshot(await self.session_of(request)))

    async def list_sessions(self, request: web.Request) -> web.Response:
        q = request.query
        unknown = sorted(set(q) - {"state", "limit"})
        if unknown:
            raise Problem(400, "Unknown field", f"unknown query parameter(s) {', '.join(unknown)}; allowed: limit, state")
        raw = q.get("limit", "50")
        limit = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 6 else 0
        if not 1 <= limit <= 1000:
            raise Problem(400, "Wrong field", "limit must be between 1 and 1000")
        state = q.get("state")
        if state is not None and state not in _STATES:
            raise Problem(400, "Wrong field", f"state must be one of {', '.join(sorted(_STATES))}, not {state[:40]!r}")
        recs = [r for r in await self.store.list_sessions(10_000)
                if tenant_of(r) == request[TENANT] and (state is None or r.state == state)][:limit]
        return json_response({"sessions": [await self.snapshot(r, usage=False) for r in recs]})

    # -- the event stream ------------------------------------------------------------------
    @staticmethod
    def _after(request: web.Request) -> int:
        raw = request.headers.get("Last-Event-ID")
        if raw is not None and raw.strip() != "":
            return _seq(raw, "Last-Event-ID")
        return _seq(request.query.get("after", "0"), "after")

    async def join(self, request: web.Request) -> web.StreamResponse:
        after = self._after(request)
        rec = await self.session_of(request)
        if after > rec.last_seq:
            raise Problem(400, "Wrong field", f"event {after} is past the end of session {rec.session_id}'s log "
                                              f"(last seq {rec.last_seq}): the id comes from another session or store")
        return await self.stream(request, rec.session_id, after)

    async def stream(self, request: web.Request, sid: str, after: int,
                     headers: dict[str, str] | None = None) -> web.StreamResponse:
        """Replay the log after ``after``, then tail it live (see the module docstring)."""
        return await self.tail.stream(request, sid, after, headers=headers)

    # -- control and approvals -------------------------------------------------------------
    async def _idempotent(self, request: web.Request, sid: str, key: str, value: dict[str, Any],
                          describe: str) -> web.Response | None:
        """The replayed first outcome, or 409 for a different request, when ``key`` is taken."""
        prior = (await self.store.idempotency_records(sid, key)).get(key)
        if prior is None:
            return None
        return self._replay(prior, value, describe)

    @staticmethod
    def _replay(prior: dict[str, Any], value: dict[str, Any], describe: str) -> web.Response:
        if prior.get("request") != value:
            raise Problem(409, "Conflict", f"{describe} was already answered with {prior.get('request')}; "
                                           "a different request is refused")
        return json_response({**prior["outcome"], "replayed": True}, 200, {"Idempotent-Replayed": "true"})

    async def control(self, request: web.Request) -> web.Response:
        rec = await self.session_of(request)
        sid = rec.session_id
        data = await json_body(request)
        check_fields(data, {"kind", "text", "restriction", "permissions", "reason"})
        kind_name = opt_str(data, "kind", required=True)
        if kind_name not in _CONTROL_KINDS:
            raise Problem(400, "Wrong field", f"'kind' must be one of {', '.join(_CONTROL_KINDS)}, not {kind_name!r}")
        kind = _CONTROL_KINDS[kind_name]
        text = opt_str(data, "text") or ""
        if kind in (ControlKind.STEER, ControlKind.FOLLOWUP) and not text:
            raise Problem(400, "Missing field", f"a {kind_name} needs 'text'")
        field = {ControlKind.RESTRICT: "restriction", ControlKind.REQUEST_PERMISSIONS: "permissions"}.get(kind)
        for other in ("restriction", "permissions", "reason"):
            if other in data and (field is None or other not in (field, "reason")):
                raise Problem(400, "Wrong field", f"'{other}' goes with kind "
                                                  f"{'restrict' if other == 'restriction' else 'request_permissions'}"
                                                  + (" (or either, for 'reason')" if other == "reason" else ""))
        if field is not None:
            if field not in data:
                raise Problem(400, "Missing field", f"a {kind_name} needs '{field}': permissions in the file format "
                                                    "(docs/permissions.md)")
            text = control_text(field, _permissions(data[field], field), opt_str(data, "reason") or "")  # type: ignore[arg-type]
        value = {"kind": kind_name, "text": text}
        ikey = request.headers.get("Idempotency-Key")
        key = None
        if ikey is not None:
            if not ikey or len(ikey) > 200:
                raise Problem(400, "Wrong field", "Idempotency-Key must be 1 to 200 characters")
            key = CONTROL_KEY + ikey
            replay = await self._idempotent(request, sid, key, value, f"control with Idempotency-Key {ikey!r}")
            if replay is not None:
                return replay
        try:
            note = await send_control(self.store, sid, kind, text)
        except ResumeError as e:
            raise Problem(409, "Cannot control", str(e)) from e
        outcome = {"session_id": sid, "kind": kind_name, "status": "queued", "note": note}
        # a change of permissions applies when the session runs next; it does not start a run by itself
        resumes = (rec.state in _RESUMABLE and kind in (ControlKind.CANCEL, ControlKind.STEER, ControlKind.FOLLOWUP)
                   and not await self.runner.busy(sid))
        if resumes:
            outcome["note"] = f"queued {kind_name} for session {sid}; the session is resumed to apply it"
            await self.runner.submit(RunRequest(sid, "resume"))
        if key is not None:
            stored, first = await self.store.claim_idempotency_key(sid, key, {"request": value, "outcome": outcome})
            if not first:
                return self._replay(stored, value, f"control with Idempotency-Key {ikey!r}")
        return json_response(outcome, 202)

    async def decide(self, request: web.Request) -> web.Response:
        rec = await self.session_of(request)
        sid, call_id = rec.session_id, _check_id(request.match_info["call_id"], "call id")
        decision = self._decision(await json_body(request))
        try:
            outcome = await write_decision(self.store, sid, call_id, decision, tools=self.agent.tools)
        except DecisionRefused as e:
            status, title = _REFUSED[e.kind]
            if e.kind == "conflict":
                first = {"call_id": call_id, "decision": unstructure(e.prior)} if e.prior is not None else None
                raise Problem(status, title, f"tool call {call_id!r} was already answered with {first}; a different "
                                             "request is refused") from e
            raise Problem(status, title, str(e)) from e
        if outcome.replayed:
            return json_response(outcome.to_json(), 200, {"Idempotent-Replayed": "true"})
        await self.runner.submit(RunRequest(sid, "resume"))
        return json_response(outcome.to_json(), 202)

    @staticmethod
    def _decision(data: dict[str, Any]) -> Decision:
        check_fields(data, {"decision", "arguments", "message", "is_error"})
        kind = opt_str(data, "decision", required=True)
        if kind not in _DECISION_KINDS:
            raise Problem(400, "Wrong field", f"'decision' must be one of {', '.join(_DECISION_KINDS)}, not {kind!r}")
        message = data.get("message", "")
        if not isinstance(message, str) or len(message) > 100_000:
            raise Problem(400, "Wrong field", "'message' must be a string (at most 100,000 characters)")
        is_error = opt_bool(data, "is_error")
        if "is_error" in data and kind != "respond":
            raise Problem(400, "Wrong field", f"'is_error' belongs to a respond, not a {kind}")
        if message and kind in ("approve", "edit"):
            raise Problem(400, "Wrong field", f"'message' belongs to a reject or a respond, not a {kind}")
        if kind == "edit":
            args = data.get("arguments")
            if not isinstance(args, dict):
                raise Problem(400, "Wrong field", "an edit needs 'arguments': the new arguments, a JSON object")
            return Decision.edit(args)
        if data.get("arguments") is not None:
            raise Problem(400, "Wrong field", f"'arguments' belongs to an edit, not a {kind}")
        if kind == "approve":
            return Decision.approve()
        if kind == "reject":
            return Decision.reject(message or "rejected by a person")
        if not message:
            raise Problem(400, "Missing field", "a respond needs 'message': the result the model is given")
        return Decision.respond(message, is_error=is_error)

    # -- diagram, health, OpenAPI ----------------------------------------------------------
    async def diagram(self, request: web.Request) -> web.Response:
        rec = await self.session_of(request)
        fmt = request.query.get("format", "mermaid")
        if fmt not in ("mermaid", "json"):
            raise Problem(400, "Wrong field", "format must be 'mermaid' or 'json'")
        view = request.query.get("view", "machine")
        if view not in ("machine", "plan"):
            raise Problem(400, "Wrong field", "view must be 'machine' or 'plan'")
        path = [(ev.payload["from"], ev.payload["trigger"], ev.payload["to"])
                for ev in await self.store.read_events(rec.session_id, types=("transition",))]
        plan = latest_plan(await self.store.read_events(rec.session_id, types=("plan_updated",)))
        plan_text = render_plan(plan) if plan is not None else None
        if view == "plan" and plan_text is None:
            raise Problem(404, "No plan", f"session {rec.session_id} has no plan (it runs without the planact plugin, "
                                          "or its planner has not answered yet); drop view=plan for the machine")
        active = None if rec.state == QUEUED else rec.state
        text = plan_text if view == "plan" and plan_text is not None else render_machine(
            trace=path, active=active, title=f"session {rec.session_id}")
        if fmt == "json":
            return json_response({"session_id": rec.session_id, "state": rec.state, "mermaid": text,
                                  "path": [list(p) for p in path],
                                  "plan": unstructure(plan) if plan is not None else None,
                                  "plan_mermaid": plan_text})
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(openapi_document())


def _with_live_deltas(agent: Agent, notifier: Notifier) -> None:
    if not any(isinstance(o, LiveDeltas) for o in agent.hooks.observers):
        agent.hooks = HookBus((*agent.hooks.observers, LiveDeltas(notifier)))


def create_app(
    agent: Agent | Callable[[Store], Agent],
    store: Store | None = None,
    *,
    runner: Runner | Callable[[Agent, NotifyingStore], Runner] | None = None,
    tenants: Tenants | None = None,
    cors_origins: Iterable[str] = (),
    max_body: int = 256 * 1024,
    heartbeat: float = 15.0,
    send_timeout: float = 10.0,
    retry_ms: int = 3000,
    live_deltas: bool = True,
) -> web.Application:
    """The server app (mount it in your own ``aiohttp`` app with ``add_subapp``, or run it with
    ``fsm-agent serve``).

    Args:
        agent: an :class:`Agent` (its store is replaced by a :class:`NotifyingStore` over ``store``,
            or over its own store), or a factory called with that store.
        store: where sessions live (default: the agent's store). The server's decisions need a store
            with idempotency keys (the SQLite, PostgreSQL and memory stores).
        runner: who drives runs: a :class:`Runner`, or a factory ``(agent, store) -> Runner``
            (default: :class:`LocalRunner`, in this process).
        tenants: bearer tokens by tenant (default: :meth:`Tenants.from_env`; none: one tenant, no sign-in).
        cors_origins: origins allowed cross-origin calls (default: none; CORS off).
        max_body: largest request body in bytes (larger: 413).
        heartbeat: seconds of idle before a ``: hb`` comment on an event stream.
        send_timeout: seconds a stream write may take before the client is dropped.
        retry_ms: the ``retry:`` sent at the start of each event stream (milliseconds).
        live_deltas: send the model's streaming deltas live (``event: delta``, no id).

    Raises:
        TypeError: a factory without a store.
    """
    if isinstance(agent, Agent):
        inner = store if store is not None else agent.store
        nstore = inner if isinstance(inner, NotifyingStore) else NotifyingStore(inner)
        agent.store = nstore
        the_agent = agent
    else:
        if store is None:
            raise TypeError("create_app(factory, store): a factory needs a store")
        nstore = store if isinstance(store, NotifyingStore) else NotifyingStore(store)
        the_agent = agent(nstore)
        if the_agent.store is not nstore:
            the_agent.store = nstore
    if live_deltas:
        _with_live_deltas(the_agent, nstore.notifier)
    if runner is None:
        the_runner: Runner = LocalRunner(the_agent, nstore.notifier)
    elif isinstance(runner, Runner):
        the_runner = runner
    else:
        the_runner = runner(the_agent, nstore)
    the_tenants = tenants if tenants is not None else Tenants.from_env()
    tail = LogTail(nstore, the_runner, heartbeat=heartbeat, send_timeout=send_timeout, retry_ms=retry_ms)
    srv = _Server(the_agent, nstore, the_runner, the_tenants, frozenset(cors_origins), tail)

    async def on_startup(app: web.Application) -> None:
        await the_runner.start()

    async def on_cleanup(app: web.Application) -> None:
        await the_runner.close()

    app = web.Application(client_max_size=max_body, middlewares=[problems, srv.auth])
    app[AGENT_KEY] = the_agent
    app[STORE_KEY] = nstore
    app[RUNNER_KEY] = the_runner
    app[TENANTS_KEY] = the_tenants
    app[TAIL_KEY] = tail
    r = app.router
    r.add_get("/healthz", srv.healthz)
    r.add_get("/openapi.json", srv.openapi)
    r.add_post("/auth/login", srv.login)
    r.add_post("/auth/logout", srv.logout)
    r.add_post("/sessions", srv.create_session)
    r.add_get("/sessions", srv.list_sessions)
    r.add_get("/sessions/{sid}", srv.get_session)
    r.add_post("/sessions/{sid}/runs", srv.start_run)
    r.add_post("/sessions/{sid}/runs/stream", srv.start_run_stream)
    r.add_get("/sessions/{sid}/events", srv.join)
    r.add_post("/sessions/{sid}/control", srv.control)
    r.add_post("/sessions/{sid}/approvals/{call_id}", srv.decide)
    r.add_get("/sessions/{sid}/diagram", srv.diagram)
    add_review_routes(app)
    add_memory_routes(app, tenant_key=TENANT, agent_key=AGENT_KEY)
    app.on_response_prepare.append(srv.on_prepare)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(tail.on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app
