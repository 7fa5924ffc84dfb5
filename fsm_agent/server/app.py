"""The HTTP app (issue 10, foundation): sessions, background runs, snapshots and the SSE join.

Routes (JSON; errors are RFC 9457 problem documents, ``application/problem+json``):

* ``POST /sessions`` ``{"task": str, "session_id"?: str}``: create a session and start its first
  run in the background; 201 + ``Location``.
* ``POST /sessions/{sid}/runs`` ``{"task"?: str}``: start a run in the background (a new session
  with ``task`` when ``sid`` is unknown, else a resume); 202 + ``Location: /sessions/{sid}``.
* ``GET /sessions/{sid}``: the snapshot (state, stop, pending approvals, last seq).
* ``GET /sessions?state=…&limit=…``: sessions, most recently updated first.
* ``GET /sessions/{sid}/events``: the SSE join. Replays every event after ``Last-Event-ID`` (or
  ``?after=N``), then live events, with no gap and no duplicate; the stream closes after a
  ``run_stopped`` event that is the last one in the log.
* ``GET /healthz``.

Live tailing: the app wraps the store in a :class:`NotifyingStore`, which wakes a per-session
:class:`Notifier` after each committed :meth:`~fsm_agent.store.base.Store.write`. A stream
clears its wake-up flag, then reads the log after the last seq it sent, so a commit made between
the two is never missed and nothing is sent twice. The run only sets flags: it never waits on a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from ..agent import Agent
from ..errors import ResumeError, SessionExistsError
from ..store.base import (Checkpoint, ControlKind, ControlRecord, EventRecord, LedgerEntry, SessionRecord, Store,
                          WriteBatch)
from .sse import ClientGone, SSEWriter, event_frame

__all__ = ["AGENT_KEY", "RUNS_KEY", "STORE_KEY", "Notifier", "NotifyingStore", "create_app"]

TERMINAL_EVENT = "run_stopped"



class Notifier:
    """Per-session wake-up flags, set after each commit (in process)."""

    def __init__(self) -> None:
        self._subs: dict[str, set[asyncio.Event]] = {}

    def subscribe(self, session_id: str) -> asyncio.Event:
        """A flag set on every later commit of ``session_id``; :meth:`unsubscribe` it when done."""
        ev = asyncio.Event()
        self._subs.setdefault(session_id, set()).add(ev)
        return ev

    def unsubscribe(self, session_id: str, ev: asyncio.Event) -> None:
        """Stop waking ``ev``."""
        subs = self._subs.get(session_id)
        if subs is not None:
            subs.discard(ev)
            if not subs:
                del self._subs[session_id]

    def notify(self, session_id: str) -> None:
        """Wake every subscriber of ``session_id`` (never blocks)."""
        for ev in self._subs.get(session_id, ()):
            ev.set()

    def subscribers(self, session_id: str) -> int:
        """How many streams watch ``session_id``."""
        return len(self._subs.get(session_id, ()))


class NotifyingStore(Store):
    """A :class:`Store` that calls :meth:`Notifier.notify` after each successful write or session
    creation, and passes everything else to ``inner``."""

    def __init__(self, inner: Store, notifier: Notifier | None = None) -> None:
        self.inner = inner
        self.notifier = notifier or Notifier()

    async def create_session(self, record: SessionRecord) -> None:
        await self.inner.create_session(record)
        self.notifier.notify(record.session_id)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        return await self.inner.get_session(session_id)

    async def list_sessions(self, limit: int = 50) -> list[SessionRecord]:
        return await self.inner.list_sessions(limit)

    async def update_metadata(self, session_id: str, metadata: dict[str, Any], goal_version: int | None = None) -> None:
        await self.inner.update_metadata(session_id, metadata, goal_version)

    async def write(self, batch: WriteBatch) -> None:
        await self.inner.write(batch)
        self.notifier.notify(batch.session_id)

    async def read_events(self, session_id: str, after_seq: int = 0, until_seq: int | None = None,
                          types: Sequence[str] | None = None) -> list[EventRecord]:
        return await self.inner.read_events(session_id, after_seq, until_seq, types)

    async def latest_checkpoint(self, session_id: str) -> Checkpoint | None:
        return await self.inner.latest_checkpoint(session_id)

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        return await self.inner.get_checkpoint(checkpoint_id)

    async def ledger(self, session_id: str) -> dict[str, LedgerEntry]:
        return await self.inner.ledger(session_id)

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> bool:
        return await self.inner.acquire_lease(session_id, owner, ttl)

    async def release_lease(self, session_id: str, owner: str) -> None:
        await self.inner.release_lease(session_id, owner)

    async def push_control(self, record: ControlRecord) -> None:
        await self.inner.push_control(record)

    async def take_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> list[ControlRecord]:
        return await self.inner.take_controls(session_id, kinds)

    async def peek_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> bool:
        return await self.inner.peek_controls(session_id, kinds)

    async def close(self) -> None:
        await self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"NotifyingStore({self.inner!r})"


# App keys: the agent, its notifying store, the background run tasks.
AGENT_KEY = web.AppKey("fsm_agent", Agent)
STORE_KEY = web.AppKey("fsm_store", NotifyingStore)
RUNS_KEY = web.AppKey("fsm_runs", set)


class _Problem(Exception):
    def __init__(self, status: int, title: str, detail: str = "") -> None:
        super().__init__(detail or title)
        self.status, self.title, self.detail = status, title, detail


def _problem(status: int, title: str, detail: str, instance: str) -> web.Response:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, "instance": instance}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/problem+json")


@web.middleware
async def _problems(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
    try:
        return await handler(request)
    except _Problem as p:
        return _problem(p.status, p.title, p.detail, request.path)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _problem(e.status, e.reason, e.text if e.text and not e.text.startswith(str(e.status)) else e.reason,
                        request.path)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json", headers=headers)


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge -> 413
    if not raw:
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _Problem(400, "Malformed JSON", str(e)) from e
    if not isinstance(data, dict):
        raise _Problem(400, "Bad request body", "the body must be a JSON object")
    return data


def _opt_str(data: dict[str, Any], key: str, *, required: bool = False) -> str | None:
    v = data.get(key)
    if v is None:
        if required:
            raise _Problem(400, "Missing field", f"{key!r} is required")
        return None
    if not isinstance(v, str) or not v:
        raise _Problem(400, "Wrong field", f"{key!r} must be a non-empty string")
    return v


def _check_sid(sid: str) -> str:
    if len(sid) > 200 or any(c in sid for c in "\r\n\0/"):
        raise _Problem(400, "Wrong field", "session_id must be at most 200 characters, without CR, LF, NUL or '/'")
    return sid


def create_app(agent: Agent | Callable[[Store], Agent], store: Store | None = None, *, max_body: int = 256 * 1024,
               heartbeat: float = 15.0, send_timeout: float = 10.0, retry_ms: int = 3000) -> web.Application:
    """The server app.

    Args:
        agent: an :class:`Agent` (its store is replaced by a :class:`NotifyingStore` over ``store``,
            or over its own store), or a factory called with that store.
        store: where sessions live (default: the agent's store).
        max_body: largest request body in bytes (larger: 413).
        heartbeat: seconds of idle before a ``: hb`` comment on an event stream.
        send_timeout: seconds a stream write may take before the client is dropped.
        retry_ms: the ``retry:`` sent at the start of each event stream.
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
    runs: set[asyncio.Task[Any]] = set()

    def spawn(coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        runs.add(task)
        task.add_done_callback(runs.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # consume: failures live in the log
        return task

    async def wait_created(sid: str, task: asyncio.Task[Any]) -> None:
        for _ in range(1000):
            if await nstore.get_session(sid) is not None:
                return
            if task.done():
                exc = task.exception()
                if isinstance(exc, SessionExistsError):
                    raise _Problem(409, "Session exists", f"session {sid!r} exists")
                raise _Problem(500, "Run failed to start", repr(exc))
            await asyncio.sleep(0.005)
        raise _Problem(503, "Run did not start", f"session {sid!r} was not created in time")

    async def start_new(sid: str | None, task_text: str) -> str:
        sid = sid or uuid.uuid4().hex
        if await nstore.get_session(sid) is not None:
            raise _Problem(409, "Session exists", f"session {sid!r} exists")
        task = spawn(the_agent.run(task_text, session_id=sid))
        await wait_created(sid, task)
        return sid

    async def get_or_404(sid: str) -> SessionRecord:
        rec = await nstore.get_session(sid)
        if rec is None:
            raise _Problem(404, "Unknown session", f"no session {sid!r}")
        return rec

    async def healthz(request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def create_session(request: web.Request) -> web.Response:
        data = await _body(request)
        task_text = _opt_str(data, "task", required=True)
        sid = _opt_str(data, "session_id")
        if sid is not None:
            _check_sid(sid)
        assert task_text is not None
        sid = await start_new(sid, task_text)
        return _json({"session_id": sid}, 201, {"Location": f"/sessions/{sid}"})

    async def start_run(request: web.Request) -> web.Response:
        sid = _check_sid(request.match_info["sid"])
        data = await _body(request)
        task_text = _opt_str(data, "task")
        rec = await nstore.get_session(sid)
        if rec is None:
            if task_text is None:
                raise _Problem(404, "Unknown session", f"no session {sid!r}; give a task to create it")
            await start_new(sid, task_text)
        else:
            if task_text is not None:
                raise _Problem(409, "Session exists", f"session {sid!r} exists: start a run without a task to resume it")
            try:
                await the_agent.check_resume(sid)
            except ResumeError as e:
                raise _Problem(409, "Cannot resume", str(e)) from e
            spawn(the_agent.resume(sid))
        return _json({"session_id": sid}, 202, {"Location": f"/sessions/{sid}"})

    def snapshot(rec: SessionRecord) -> dict[str, Any]:
        stop = rec.stop or None
        return {"session_id": rec.session_id, "state": rec.state, "goal": rec.goal, "stop": stop,
                "pending_approvals": list((stop or {}).get("pending_actions") or ()), "last_seq": rec.last_seq,
                "created_at": rec.created_at, "updated_at": rec.updated_at}

    async def get_session(request: web.Request) -> web.Response:
        rec = await get_or_404(request.match_info["sid"])
        return _json(snapshot(rec))

    async def list_sessions(request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "50"))
        except ValueError as e:
            raise _Problem(400, "Wrong field", "limit must be an integer") from e
        if not 1 <= limit <= 1000:
            raise _Problem(400, "Wrong field", "limit must be between 1 and 1000")
        state = request.query.get("state")
        recs = await nstore.list_sessions(limit if state is None else 1000)
        if state is not None:
            recs = [r for r in recs if r.state == state][:limit]
        return _json({"sessions": [snapshot(r) for r in recs]})

    def after_of(request: web.Request) -> int:
        raw = request.headers.get("Last-Event-ID")
        if raw is None or raw.strip() == "":
            raw = request.query.get("after", "0")
        try:
            after = int(raw)
        except ValueError as e:
            raise _Problem(400, "Wrong field", f"Last-Event-ID / after must be an event seq, not {raw!r}") from e
        if after < 0:
            raise _Problem(400, "Wrong field", "Last-Event-ID / after must be >= 0")
        return after

    async def join(request: web.Request) -> web.StreamResponse:
        sid = request.match_info["sid"]
        after = after_of(request)
        await get_or_404(sid)
        wake = nstore.notifier.subscribe(sid)  # subscribe first, then read the log: no gap
        writer = SSEWriter(request, retry_ms=retry_ms, send_timeout=send_timeout, heartbeat=heartbeat)
        try:
            await writer.prepare()
            last = after
            while True:
                wake.clear()
                events = await nstore.read_events(sid, after_seq=last)
                for ev in events:
                    if ev.seq <= last:  # duplicate of one already sent
                        continue
                    await writer.write(event_frame(ev))
                    last = ev.seq
                if events and events[-1].type == TERMINAL_EVENT and events[-1].seq == last:
                    await writer.close()
                    break
                if not events and last > 0 and await _ended_at(sid, last):
                    await writer.close()
                    break
                try:
                    async with asyncio.timeout(heartbeat):
                        await wake.wait()
                except TimeoutError:
                    await writer.send_heartbeat()
        except ClientGone:
            pass
        finally:
            nstore.notifier.unsubscribe(sid, wake)
        return writer.response

    async def _ended_at(sid: str, last: int) -> bool:
        evs = await nstore.read_events(sid, after_seq=last - 1, until_seq=last)
        return bool(evs) and evs[-1].type == TERMINAL_EVENT

    async def on_cleanup(app: web.Application) -> None:
        for t in list(runs):
            t.cancel()
        for t in list(runs):
            with contextlib.suppress(BaseException):
                await t

    app = web.Application(client_max_size=max_body, middlewares=[_problems])
    app[AGENT_KEY] = the_agent
    app[STORE_KEY] = nstore
    app[RUNS_KEY] = runs
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/sessions", create_session)
    app.router.add_get("/sessions", list_sessions)
    app.router.add_get("/sessions/{sid}", get_session)
    app.router.add_post("/sessions/{sid}/runs", start_run)
    app.router.add_get("/sessions/{sid}/events", join)
    app.on_cleanup.append(on_cleanup)
    return app
