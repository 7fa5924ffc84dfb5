"""Runs across hosts on PostgreSQL: server replicas queue runs, workers carry them out.

* :class:`QueueRunner` is the :class:`~fsm_agent.server.runs.Runner` of a server replica: it
  puts each :class:`~fsm_agent.server.runs.RunRequest` in the ``run_queue`` table (workers are
  woken by ``NOTIFY fsm_queue``), and it listens on ``fsm_events`` and ``fsm_live`` so that this
  replica's event streams wake for commits and live deltas made by a worker on any host.
* :class:`PgLiveDeltas` is the worker's side of live deltas: the observer of
  :class:`~fsm_agent.server.notify.LiveDeltas`, publishing each frame with ``NOTIFY fsm_live``.
* :class:`PgWakeups` is that listening part alone; :class:`ListeningRunner` puts it beside another
  runner, for a server whose runs happen elsewhere but are committed to the same database (an
  agent on Temporal whose workers publish with :meth:`PgLiveDeltas.attach`).
* :class:`PgListener` keeps one dedicated ``LISTEN`` connection up, reconnecting when it drops.
* The worker itself is :class:`fsm_agent.server.worker.Worker`.

Nothing is lost when a notification is: a stream re-reads the log after each wake, and after the
``LISTEN`` connection comes back every session with a subscriber is woken once. Live deltas are
best effort (a lost one is superseded by the ``message`` event that follows).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from ..errors import FsmAgentError
from ..hooks import HookBus
from ..store.base import Store
from ..store.postgres import EVENTS_CHANNEL, LIVE_CHANNEL, PostgresStore
from ..types.codec import unstructure
from ..types.events import ModelStreamEvent
from .notify import LiveDeltas, Notifier, NotifyingStore
from .runs import RunRequest, Runner

if TYPE_CHECKING:
    from ..agent import Agent

__all__ = ["LIVE_MAX", "ListeningRunner", "PgListener", "PgLiveDeltas", "PgWakeups", "QueueRunner", "postgres_of"]

log = logging.getLogger("fsm_agent.server")

LIVE_MAX = 7000
"""Largest ``fsm_live`` payload sent, in bytes; a larger delta is not sent live (the log has it)."""


def postgres_of(store: Store) -> PostgresStore:
    """The :class:`PostgresStore` under ``store`` (itself, or what wrappers such as
    :class:`NotifyingStore` wrap, through their ``inner``).

    Raises:
        TypeError: no PostgresStore underneath.
    """
    seen: Any = store
    for _ in range(16):
        if isinstance(seen, PostgresStore):
            return seen
        seen = getattr(seen, "inner", None)
        if seen is None:
            break
    raise TypeError(f"{store!r} is not a PostgresStore (the run queue lives in PostgreSQL)")


class PgListener:
    """One dedicated connection ``LISTEN`` ing on ``handlers``' channels, kept up.

    Each notification's payload (str) is passed to its channel's handler, in the event loop's
    thread, in the order PostgreSQL delivers them (commit order). A handler must not block; one
    that raises is logged. The connection is checked every ``ping`` seconds (a ``SELECT 1`` that
    must answer within ``ping`` seconds) and replaced when it drops, with a backoff from ``retry``
    up to ``max_retry`` seconds. ``on_connect(reconnected)`` runs after each connection is made
    (``reconnected`` is false the first time): notifications sent while the connection was down
    are lost, so that is where a user catches up.

    Args:
        store: the database (the connection is made with its DSN, outside its pool).
        handlers: channel name -> ``handler(payload)``.
        on_connect: see above.
    """

    def __init__(self, store: PostgresStore, handlers: Mapping[str, Callable[[str], None]], *,
                 on_connect: Callable[[bool], None] | None = None, ping: float = 5.0, retry: float = 0.2,
                 max_retry: float = 5.0) -> None:
        self.store = store
        self.handlers = dict(handlers)
        self.on_connect = on_connect
        self.ping, self.retry, self.max_retry = ping, retry, max_retry
        self.connections = 0
        """How many connections were made (1 + reconnections)."""
        self._con: Any = None
        self._lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        """Whether the ``LISTEN`` connection is up now."""
        return self._con is not None and not self._con.is_closed()

    async def start(self) -> None:
        """Connect and listen, then keep the connection up in the background.

        Raises:
            StoreError: the first connection could not be made.
            ConfigurationError: asyncpg is missing, or the DSN, password or database is wrong.
        """
        if self._task is not None:
            return
        await self._connect()
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name="fsm-pg-listen")

    async def _connect(self) -> None:
        con = await self.store.connect()
        try:
            self._lost = asyncio.Event()
            lost = self._lost
            con.add_termination_listener(lambda _con: lost.set())
            for channel in self.handlers:
                await con.add_listener(channel, self._dispatch)
        except BaseException:
            con.terminate()
            raise
        self._con = con
        self.connections += 1
        if self.on_connect is not None:
            try:
                self.on_connect(self.connections > 1)
            except Exception:  # noqa: BLE001 - a user callback
                log.exception("LISTEN on_connect callback failed")

    def _dispatch(self, _con: Any, _pid: int, channel: str, payload: str) -> None:
        handler = self.handlers.get(channel)
        if handler is None:
            return
        try:
            handler(payload)
        except Exception:  # noqa: BLE001 - one bad message must not stop the listener
            log.exception("handling a %s notification failed (payload %.200r)", channel, payload)

    async def _alive(self) -> bool:
        con = self._con
        if con is None or con.is_closed() or self._lost.is_set():
            return False
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), self.ping)
                return False
            async with asyncio.timeout(self.ping):
                await con.fetchval("SELECT 1")
        except (TimeoutError, OSError, FsmAgentError) as exc:
            log.warning("LISTEN connection to %s is not answering: %s", self.store.location, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - asyncpg's errors: the connection is unusable
            log.warning("LISTEN connection to %s failed: %s", self.store.location, exc)
            return False
        return True

    async def _supervise(self) -> None:
        delay = self.retry
        while True:
            if await self._alive():
                continue
            con, self._con = self._con, None
            if con is not None:
                con.terminate()
            log.warning("LISTEN connection to %s lost; reconnecting", self.store.location)
            while True:
                try:
                    await self._connect()
                    break
                except (OSError, FsmAgentError) as exc:
                    log.warning("LISTEN reconnect to %s failed: %s; next try in %.1f s", self.store.location,
                                exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.max_retry)
            delay = self.retry

    async def close(self) -> None:
        """Stop listening and close the connection (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        con, self._con = self._con, None
        if con is not None:
            try:
                async with asyncio.timeout(2.0):
                    await con.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                con.terminate()

    def __repr__(self) -> str:
        return f"PgListener({sorted(self.handlers)}, connected={self.connected})"


class PgWakeups:
    """A replica's ears on PostgreSQL: commits and live deltas made on any host wake this
    process's event streams. :class:`QueueRunner` listens through one; so does a server whose
    runs go elsewhere and whose workers write to the same database
    (:class:`ListeningRunner`: ``fsm-agent serve --temporal`` over PostgreSQL).

    ``fsm_events`` payloads (``"<session id> <last seq>"``) go to ``notifier.notify(sid, seq)``;
    ``fsm_live`` payloads (JSON ``{"sid": str, "basis": int, "frame": str}``) go to
    ``notifier.publish_live(sid, frame bytes, basis)``. After the ``LISTEN`` connection comes
    back from a drop, every session with a subscriber is notified once (its stream re-reads the
    log, so nothing committed meanwhile is missed).

    Args:
        store: a :class:`PostgresStore` or a wrapper of one
            (:class:`~fsm_agent.server.notify.NotifyingStore`).
        notifier: the notifier of the replica's event streams (default: ``store.notifier`` when
            ``store`` is a NotifyingStore).
        ping: seconds between health checks of the ``LISTEN`` connection.

    Raises:
        TypeError: ``store`` is not (a wrapper of) a PostgresStore; no notifier given or found.
    """

    def __init__(self, store: Store, notifier: Notifier | None = None, *, ping: float = 5.0) -> None:
        self.store = postgres_of(store)
        if notifier is None:
            notifier = getattr(store, "notifier", None)
            if not isinstance(notifier, Notifier):
                raise TypeError("PgWakeups(store, notifier): give the notifier of the app's event streams")
        self.notifier = notifier
        self.listener = PgListener(self.store, {EVENTS_CHANNEL: self._on_event, LIVE_CHANNEL: self._on_live},
                                   on_connect=self._on_connect, ping=ping)

    async def start(self) -> None:
        """Start listening.

        Raises:
            StoreError: PostgreSQL cannot be reached.
        """
        await self.listener.start()

    async def close(self) -> None:
        """Stop listening."""
        await self.listener.close()

    def _on_event(self, payload: str) -> None:
        sid, _, seq = payload.rpartition(" ")
        try:
            last = int(seq)
        except ValueError:
            log.warning("malformed %s payload %.200r", EVENTS_CHANNEL, payload)
            return
        self.notifier.notify(sid, last)

    def _on_live(self, payload: str) -> None:
        data = orjson.loads(payload)
        self.notifier.publish_live(data["sid"], data["frame"].encode(), int(data["basis"]))

    def _on_connect(self, reconnected: bool) -> None:
        if reconnected:
            for sid in self.notifier.sessions():
                self.notifier.notify(sid)

    def __repr__(self) -> str:
        return f"PgWakeups({self.store!r}, connected={self.listener.connected})"


class QueueRunner(Runner):
    """A server replica's runner: requests go to the ``run_queue`` table, for
    :class:`~fsm_agent.server.worker.Worker` s on any host; commits and live deltas made there
    wake this replica's event streams (through :class:`PgWakeups`).

    With :func:`~fsm_agent.server.app.create_app`, give a factory so that the runner wakes the
    app's own notifier::

        create_app(agent, PostgresStore(dsn), runner=lambda agent, store: QueueRunner(store))

    Args:
        store: the replica's store: a :class:`PostgresStore` or a wrapper of one
            (:class:`~fsm_agent.server.notify.NotifyingStore`).
        notifier: the notifier of the replica's event streams (default: ``store.notifier`` when
            ``store`` is a NotifyingStore).
        ping: seconds between health checks of the ``LISTEN`` connection.

    Raises:
        TypeError: ``store`` is not (a wrapper of) a PostgresStore; no notifier given or found.
    """

    def __init__(self, store: Store, notifier: Notifier | None = None, *, ping: float = 5.0) -> None:
        self.wakeups = PgWakeups(store, notifier, ping=ping)
        self.store, self.notifier, self.listener = self.wakeups.store, self.wakeups.notifier, self.wakeups.listener

    async def start(self) -> None:
        """Start listening.

        Raises:
            StoreError: PostgreSQL cannot be reached.
        """
        await self.wakeups.start()

    async def submit(self, request: RunRequest) -> None:
        """Queue ``request`` (a new job, committed before this returns) and wake the workers.

        Raises:
            StoreError: the queue could not be written.
        """
        await self.store.enqueue_run(uuid.uuid4().hex, request.session_id, request.kind, unstructure(request))

    async def busy(self, session_id: str) -> bool:
        """Whether a job of ``session_id`` is queued or being run, or a worker's lease of the session
        has not expired (the database's clock)."""
        return await self.store.run_pending(session_id)

    async def close(self) -> None:
        """Stop listening. Runs are not touched: they belong to the workers."""
        await self.wakeups.close()

    def __repr__(self) -> str:
        return f"QueueRunner({self.store!r})"


class ListeningRunner(Runner):
    """``runner`` (it carries out the requests), with this replica's event streams woken by
    PostgreSQL (:class:`PgWakeups`): for a server whose runs happen in other processes that write
    to the same database and publish live deltas there (an agent on Temporal, whose workers
    attach :meth:`PgLiveDeltas.attach`). ``fsm-agent serve --temporal`` over a PostgreSQL store
    uses it::

        create_app(agent, PostgresStore(dsn),
                   runner=lambda agent, store: ListeningRunner(LocalRunner(agent, store.notifier), store))

    Args:
        runner: who drives runs (its ``submit``, ``busy``, ``start`` and ``close`` are used).
        store, notifier, ping: as for :class:`PgWakeups`.

    Raises:
        TypeError: as for :class:`PgWakeups`.
    """

    def __init__(self, runner: Runner, store: Store, notifier: Notifier | None = None, *,
                 ping: float = 5.0) -> None:
        self.runner = runner
        self.wakeups = PgWakeups(store, notifier, ping=ping)

    async def start(self) -> None:
        """Start listening, then start ``runner``.

        Raises:
            StoreError: PostgreSQL cannot be reached.
        """
        await self.wakeups.start()
        await self.runner.start()

    async def submit(self, request: RunRequest) -> None:
        """``runner.submit(request)``."""
        await self.runner.submit(request)

    async def busy(self, session_id: str) -> bool:
        """``runner.busy(session_id)``."""
        return await self.runner.busy(session_id)

    async def close(self) -> None:
        """Close ``runner``, then stop listening."""
        try:
            await self.runner.close()
        finally:
            await self.wakeups.close()

    def __repr__(self) -> str:
        return f"ListeningRunner({self.runner!r}, {self.wakeups!r})"


class _LiveSink(Notifier):
    """The notifier a worker's :class:`PgLiveDeltas` publishes through: it learns each session's
    last committed seq from a :class:`NotifyingStore` (``notify``), and sends live frames to
    ``fsm_live`` with that seq as basis, whatever replica may be watching."""

    def __init__(self, store: PostgresStore, backlog: int) -> None:
        super().__init__()
        self.store = store
        self.seqs: dict[str, int] = {}
        self.pending: collections.deque[str] = collections.deque(maxlen=backlog)
        self.sent = 0
        self.skipped = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def notify(self, session_id: str, last_seq: int | None = None) -> None:
        if last_seq is not None:
            self.seqs[session_id] = last_seq

    def subscribers(self, session_id: str) -> int:
        return 1  # the watchers are on other hosts: always publish

    def publish_live(self, session_id: str, frame: bytes, basis: int | None = None) -> None:
        b = self.seqs.get(session_id) if basis is None else basis
        if b is None:
            return  # no committed position known: the message event will carry the text
        payload = orjson.dumps({"sid": session_id, "basis": b, "frame": frame.decode()}).decode()
        if len(payload.encode()) > LIVE_MAX:
            self.skipped += 1
            return
        self.pending.append(payload)
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._send(), name="fsm-live-notify")
        assert self._wake is not None
        self._wake.set()

    async def _send(self) -> None:
        assert self._wake is not None
        wake = self._wake
        while True:
            await wake.wait()
            wake.clear()
            while self.pending:
                batch = [self.pending.popleft() for _ in range(min(len(self.pending), 200))]
                try:
                    await self.store.notify_live(batch)
                    self.sent += len(batch)
                except Exception as exc:  # noqa: BLE001 - best effort: the log has everything
                    log.debug("live deltas not sent: %s", exc)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class PgLiveDeltas(LiveDeltas):
    """A worker's live-delta observer: each text, thinking, refusal and tool-call-arguments delta
    of a model call becomes the same ``delta`` SSE frame as :class:`LiveDeltas` makes, sent with
    ``NOTIFY fsm_live`` (JSON ``{"sid", "basis", "frame"}``) to every replica's
    :class:`QueueRunner`. The basis is the session's last seq this worker committed, which it
    learns through :meth:`track`. Deltas whose payload would exceed :data:`LIVE_MAX` bytes are
    skipped. Never blocks the run: frames are queued (at most ``backlog``; the oldest are
    dropped) and sent in batches by a background task.

        live = PgLiveDeltas(pg_store)
        agent = Agent(provider, store=live.track(pg_store), observers=[live])
    """

    def __init__(self, store: Store, *, backlog: int = 4096) -> None:
        self.sink = _LiveSink(postgres_of(store), backlog)
        super().__init__(self.sink)

    def track(self, store: Store) -> NotifyingStore:
        """``store`` wrapped so that each commit tells this observer the session's last seq: give
        that to the Agent whose runs are published."""
        return NotifyingStore(store, self.sink)

    @classmethod
    def attach(cls, agent: Agent, store: Store | None = None, *, states: bool = True,
               backlog: int = 4096) -> PgLiveDeltas:
        """Publish ``agent``'s live deltas: a new observer over ``store`` (default: the agent's
        store), with ``agent.store`` set to ``track(store)`` and the observer added to
        ``agent.hooks``. :meth:`aclose` it when the worker stops.

        ``states=False``: only the model's deltas are published, not the machine's moves (the
        ``state`` frames). That is the form for a Temporal worker, where the machine runs inside
        the workflow (no database there, and its moves are committed as ``transition`` events)
        and the deltas come from the ``model_call`` activity::

            live = PgLiveDeltas.attach(agent, states=False)    # agent.store: a PostgresStore
            async with create_worker(client, {"myapp.agents:support": agent}):
                ...
            await live.aclose()

        Raises:
            TypeError: the store is not (a wrapper of) a PostgresStore.
        """
        store = agent.store if store is None else store
        live = cls(store, backlog=backlog)
        agent.store = live.track(store)
        agent.hooks = HookBus([*agent.hooks.observers, live if states else _ModelDeltas(live)])
        return live

    def forget(self, session_id: str) -> None:
        """Drop what is known of ``session_id`` (after its run ended in this process)."""
        self.sink.seqs.pop(session_id, None)

    async def aclose(self) -> None:
        """Stop the sender (frames not yet sent are dropped)."""
        await self.sink.aclose()

    def __repr__(self) -> str:
        return f"PgLiveDeltas(sent={self.sink.sent}, skipped={self.sink.skipped})"


class _ModelDeltas:
    """The model-delta half of a :class:`PgLiveDeltas` (an observer with no ``on_transition``)."""

    def __init__(self, live: PgLiveDeltas) -> None:
        self.live = live

    def on_model_event(self, event: ModelStreamEvent) -> None:
        self.live.on_model_event(event)

    def __repr__(self) -> str:
        return f"model deltas of {self.live!r}"
