"""PostgreSQL store (asyncpg) for many workers on many hosts.

Same records and semantics as the SQLite store. Leases use the database's clock (not the
workers'), so hosts with skewed clocks still agree on who holds a session; ``acquire_lease`` is
one conditional ``UPDATE``, so of two racing workers exactly one wins. Every driver write is one
transaction that locks the session row and refuses to commit for a worker that lost its lease.
Migrations run under an advisory lock, so workers starting together migrate once.

Announcements: each committed write and session creation sends ``NOTIFY fsm_events`` with
``"<session id> <last seq>"`` from inside its transaction (only the id and the seq: a payload is
capped near 8 KB; readers fetch the events from the log). The run queue of
:mod:`fsm_agent.server.queue` lives in the ``run_queue`` table (:meth:`PostgresStore.enqueue_run`,
:meth:`PostgresStore.claim_runs` ...); queuing wakes workers on ``fsm_queue``.

Failures: an error from the server or the connection becomes a
:class:`~fsm_agent.errors.StoreError` naming the DSN (never its password), the operation and the
cause, chained to asyncpg's exception. ``transient`` is true for a lost, refused or reset
connection (SQLSTATE class 08, an administrator's or crash shutdown 57P01/57P02/57P03, an idle
session timeout 57P05), too many connections (53300), out of memory (53200), a serialization
failure or deadlock (class 40), a lock not available (55P03) and a cancelled statement (57014);
it is false for a full disk (53100), a read-only transaction (25006), a missing permission
(42501) and every other error. A bad password or an unknown database is a
:class:`~fsm_agent.errors.ConfigurationError`. A failed write is rolled back; a dropped
connection is replaced by the pool on the next call.

Requires the ``asyncpg`` package (``pip install 'fsm-agent[postgres]'``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import orjson
from attrs import frozen

from ..errors import ConfigurationError, LeaseLost, SessionConflictError, SessionExistsError, StoreError
from .base import (
    Checkpoint,
    ControlKind,
    ControlRecord,
    EventRecord,
    LedgerEntry,
    LedgerStatus,
    SessionLink,
    SessionRecord,
    Store,
    WriteBatch,
    check_link,
)

__all__ = ["EVENTS_CHANNEL", "LIVE_CHANNEL", "MIGRATIONS", "NOTIFY_MAX", "QUEUE_CHANNEL", "PostgresStore",
           "QueuedRun"]

MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY, state TEXT NOT NULL, goal TEXT NOT NULL, goal_version INTEGER NOT NULL,
        stop JSONB, metadata JSONB NOT NULL, last_seq BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL, lease_owner TEXT, lease_until DOUBLE PRECISION);
    CREATE INDEX sessions_updated ON sessions(updated_at);
    CREATE TABLE events (
        session_id TEXT NOT NULL, seq BIGINT NOT NULL, event_id TEXT NOT NULL, turn_id TEXT, type TEXT NOT NULL,
        ts DOUBLE PRECISION NOT NULL, payload JSONB NOT NULL, schema_version INTEGER NOT NULL,
        PRIMARY KEY (session_id, seq));
    CREATE TABLE checkpoints (
        checkpoint_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, seq BIGINT NOT NULL, safe_point TEXT NOT NULL,
        data JSONB NOT NULL, ts DOUBLE PRECISION NOT NULL, schema_version INTEGER NOT NULL);
    CREATE INDEX checkpoints_session ON checkpoints(session_id, seq);
    CREATE TABLE ledger (
        session_id TEXT NOT NULL, call_id TEXT NOT NULL, tool TEXT NOT NULL, arguments JSONB NOT NULL,
        idempotency_key TEXT NOT NULL, effect TEXT NOT NULL, status TEXT NOT NULL, turn INTEGER NOT NULL,
        result JSONB, updated_at DOUBLE PRECISION NOT NULL, schema_version INTEGER NOT NULL,
        PRIMARY KEY (session_id, call_id));
    CREATE TABLE controls (
        control_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, kind TEXT NOT NULL, text TEXT NOT NULL,
        ts DOUBLE PRECISION NOT NULL);
    CREATE INDEX controls_session ON controls(session_id, ts);
    """,
    # 2: idempotency keys of the server's decisions and controls; the queue of runnable runs that
    # workers claim (fsm_agent.server.queue)
    """
    CREATE TABLE idempotency (
        session_id TEXT NOT NULL, key TEXT NOT NULL, value JSONB NOT NULL, ts DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (session_id, key));
    CREATE TABLE run_queue (
        job_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, kind TEXT NOT NULL, payload JSONB NOT NULL,
        available_at DOUBLE PRECISION NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
        claimed_by TEXT, claimed_until DOUBLE PRECISION, created_at DOUBLE PRECISION NOT NULL);
    CREATE INDEX run_queue_available ON run_queue(available_at);
    """,
    # 3: parent/child links between sessions (fsm_agent.orchestration)
    """
    CREATE TABLE session_links (
        child_id TEXT PRIMARY KEY, parent_id TEXT NOT NULL, kind TEXT NOT NULL, call_id TEXT,
        metadata JSONB NOT NULL, created_at DOUBLE PRECISION NOT NULL);
    CREATE INDEX session_links_parent ON session_links(parent_id, created_at);
    """,
)
_LOCK_ID = 0x46534D41  # "FSMA": the advisory lock taken while migrating
_NOW = "extract(epoch from clock_timestamp())"

EVENTS_CHANNEL = "fsm_events"
"""The ``NOTIFY`` channel of committed writes: payload ``"<session id> <last seq>"``."""
QUEUE_CHANNEL = "fsm_queue"
"""The ``NOTIFY`` channel that wakes workers when a run is queued: payload the job id."""
LIVE_CHANNEL = "fsm_live"
"""The ``NOTIFY`` channel of live stream deltas (:mod:`fsm_agent.server.queue`): payload JSON."""
NOTIFY_MAX = 7900
"""Largest ``NOTIFY`` payload sent, in bytes (PostgreSQL refuses 8000 and more)."""


def _notify_events(rows: str) -> str:
    """A SELECT announcing each ``(session_id, last_seq)`` of ``rows`` on :data:`EVENTS_CHANNEL`
    (a session id too long for a payload is not announced)."""
    return (f"SELECT pg_notify('{EVENTS_CHANNEL}', session_id || ' ' || last_seq) FROM {rows} "
            f"WHERE octet_length(session_id) < {NOTIFY_MAX - 24}")


def _j(value: Any) -> str:
    return orjson.dumps(value).decode()


def _l(value: Any) -> Any:
    return orjson.loads(value) if isinstance(value, (str, bytes)) else value


_KV_PASSWORD = re.compile(r"""\bpassword\s*=\s*('(?:[^'\\]|\\.)*'|\S+)""", re.IGNORECASE)


def redact_dsn(dsn: str) -> str:
    """``dsn`` without its password, for messages and logs: ``postgresql://user@host:5432/db``.
    Handles URLs (a password in the user part or a ``password=`` query parameter) and libpq
    ``key=value`` strings."""
    if "://" not in dsn:
        return re.sub(r"\s{2,}", " ", _KV_PASSWORD.sub("", dsn)).strip()
    parts = urlsplit(dsn)
    netloc = parts.netloc
    if "@" in netloc:
        user, hosts = netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}@{hosts}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.lower() != "password"])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _passwords(dsn: str) -> list[str]:
    found: list[str] = []
    if "://" in dsn:
        parts = urlsplit(dsn)
        user = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
        if ":" in user:
            found.append(user.split(":", 1)[1])
        found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.lower() == "password"]
    else:
        found += [m.group(1).strip("'") for m in _KV_PASSWORD.finditer(dsn)]
    found += [unquote(p) for p in found]
    return sorted({p for p in found if p}, key=len, reverse=True)


# SQLSTATEs after which the same call may succeed later (https://www.postgresql.org/docs/current/errcodes-appendix.html)
_TRANSIENT_STATES = frozenset({"53200", "53300", "55P03", "57014", "57P01", "57P02", "57P03", "57P05"})
_TRANSIENT_CLASSES = ("08", "40")
_CONFIG_STATES = ("28", "3D000")  # invalid authorization / password; unknown database


def is_transient(exc: BaseException) -> bool:
    """Whether retrying after ``exc`` (an asyncpg or OS error) may succeed: see the module docstring."""
    state = getattr(exc, "sqlstate", None)
    if state:
        return state in _TRANSIENT_STATES or state.startswith(_TRANSIENT_CLASSES)
    if isinstance(exc, OSError):  # refused, reset, timed out, unreachable
        return True
    text = str(exc).lower()  # asyncpg.InterfaceError: "connection is closed", "connection was closed ..."
    return "connection" in text and ("closed" in text or "lost" in text or "reset" in text)


def _root(exc: BaseException) -> BaseException:
    """The error to report: when asyncpg raises an InterfaceError ("the underlying connection is
    closed") while cleaning up after another error, the first error says more."""
    ctx = exc.__context__
    if ctx is not None and not getattr(exc, "sqlstate", None) and getattr(ctx, "sqlstate", None):
        return ctx
    return exc


@frozen
class QueuedRun:
    """A job of the run queue (``run_queue``): a run a server accepted, for a worker to carry out."""

    job_id: str
    session_id: str
    kind: str
    payload: dict[str, Any]
    """The request, unstructured (:class:`fsm_agent.server.runs.RunRequest`)."""
    attempts: int
    """Claims so far, this one included."""
    created_at: float
    """Unix seconds (the database's clock)."""


class _Guard:
    """``with store._guard(op):`` turns an asyncpg / connection error raised inside into a StoreError."""

    __slots__ = ("op", "store")

    def __init__(self, store: PostgresStore, op: str) -> None:
        self.store, self.op = store, op

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None and isinstance(exc, self.store._catch):
            raise self.store._error(self.op, exc) from exc


class PostgresStore(Store):
    """Sessions in PostgreSQL.

    Args:
        dsn: a libpq connection string or URL (``postgresql://user@host:port/db``).
        min_size / max_size: connection pool bounds.
        notify: announce each committed :meth:`write` and :meth:`create_session` with
            ``NOTIFY fsm_events, '<session id> <last seq>'`` from inside its transaction, so that a
            listener (:class:`fsm_agent.server.queue.QueueRunner`, on any host) hears of it exactly
            when the commit is visible. Session ids of 7,876 bytes and more are not announced.
            PostgreSQL serializes the commits of notifying transactions (one lock, taken at
            commit); ``False`` spares that where no server listens (a single-process embedding).

    Raises (from any method):
        StoreError: the server or the connection failed (see the module docstring).
        ConfigurationError: asyncpg is missing, the password is wrong or the database is unknown.

    Attributes:
        location: the DSN without its password, as errors name it.
    """

    def __init__(self, dsn: str, *, min_size: int = 1, max_size: int = 10, notify: bool = True) -> None:
        self.dsn = dsn
        self.location = redact_dsn(dsn)
        self._secrets = _passwords(dsn)
        self.min_size, self.max_size = min_size, max_size
        self.notify = notify
        create = f"INSERT INTO sessions ({self._COLS}) VALUES ($1,$2,$3,$4,$5::jsonb,$6::jsonb,$7,$8,$9,$10,$11)"
        update = (f"UPDATE sessions SET last_seq=$2, updated_at={_NOW}, state=COALESCE($3, state), "
                  "stop=COALESCE($4::jsonb, stop) WHERE session_id=$1")
        if notify:  # one statement each; the NOTIFY is delivered exactly when the transaction commits
            create = f"WITH i AS ({create} RETURNING session_id, last_seq) {_notify_events('i')}"
            update = f"WITH u AS ({update} RETURNING session_id, last_seq) {_notify_events('u')}"
        self._create_sql, self._update_sql = create, update
        self._pool: Any = None
        self._catch: tuple[type[BaseException], ...] = (OSError,)

    def __repr__(self) -> str:
        return f"PostgresStore({self.dsn.split('@')[-1]!r})"

    # -- failures -----------------------------------------------------------------------
    def _error(self, operation: str, exc: BaseException) -> StoreError:
        root = _root(exc)
        cause = f"{type(root).__name__}: {root}"
        state = getattr(root, "sqlstate", None)
        if state:
            cause += f" (SQLSTATE {state})"
        for secret in self._secrets:
            cause = cause.replace(secret, "***")
        return StoreError(self.location, operation, cause, transient=is_transient(root))

    def _guard(self, operation: str) -> _Guard:
        return _Guard(self, operation)

    async def pool(self) -> Any:
        if self._pool is None:
            try:
                import asyncpg  # type: ignore[import-untyped]
            except ImportError:
                raise ConfigurationError("PostgresStore needs asyncpg: pip install 'fsm-agent[postgres]'") from None
            self._catch = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError,
                           asyncpg.exceptions._base.InternalClientError)
            try:
                pool = await asyncpg.create_pool(self.dsn, min_size=self.min_size, max_size=self.max_size)
            except asyncpg.PostgresError as exc:
                if (exc.sqlstate or "").startswith(_CONFIG_STATES):
                    cause = str(exc)
                    for secret in self._secrets:
                        cause = cause.replace(secret, "***")
                    raise ConfigurationError(f"cannot connect to PostgreSQL at {self.location}: {cause}") from None
                raise self._error("connect", exc) from exc
            except self._catch as exc:
                raise self._error("connect", exc) from exc
            except ValueError as exc:  # a DSN asyncpg cannot parse
                raise ConfigurationError(f"invalid PostgreSQL DSN {self.location}: {exc}") from None
            try:
                await self._migrate(pool)
            except BaseException:
                pool.terminate()
                raise
            self._pool = pool
        return self._pool

    async def migrate(self) -> int:
        """Apply missing migrations (once, under an advisory lock); returns the version in effect."""
        return await self._migrate(await self.pool())

    async def _migrate(self, pool: Any) -> int:
        with self._guard("migrate"):
            # An up-to-date schema is only read: no lock, no write (a read-only database opens).
            if (await pool.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL") and
                    await pool.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_migrations") >= len(MIGRATIONS)):
                return len(MIGRATIONS)
            async with pool.acquire() as con, con.transaction():
                await con.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_ID)
                await con.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                                  "applied_at DOUBLE PRECISION NOT NULL)")
                have = await con.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
                for version, script in enumerate(MIGRATIONS, 1):
                    if version > have:
                        await con.execute(script)
                        await con.execute(f"INSERT INTO schema_migrations VALUES ($1, {_NOW})", version)
        return len(MIGRATIONS)

    async def schema_version(self) -> int:
        pool = await self.pool()
        with self._guard("schema_version"):
            return int(await pool.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_migrations"))

    _COLS = ("session_id, state, goal, goal_version, stop, metadata, last_seq, created_at, updated_at, "
             "lease_owner, lease_until")

    @staticmethod
    def _session(r: Any) -> SessionRecord:
        return SessionRecord(r[0], r[1], r[2], r[3], _l(r[4]) if r[4] is not None else None, _l(r[5]), r[6], r[7],
                             r[8], r[9], r[10])

    async def create_session(self, record: SessionRecord) -> None:
        import asyncpg

        pool = await self.pool()
        try:
            with self._guard("create_session"):
                await pool.execute(
                    self._create_sql,
                    record.session_id, record.state, record.goal, record.goal_version,
                    _j(record.stop) if record.stop is not None else None, _j(record.metadata), record.last_seq,
                    record.created_at, record.updated_at, record.lease_owner, record.lease_until)
        except StoreError as exc:
            if isinstance(exc.__cause__, asyncpg.UniqueViolationError):
                raise SessionExistsError(record.session_id) from None
            raise

    async def get_session(self, session_id: str) -> SessionRecord | None:
        pool = await self.pool()
        with self._guard("get_session"):
            r = await pool.fetchrow(f"SELECT {self._COLS} FROM sessions WHERE session_id=$1", session_id)
        return self._session(r) if r else None

    async def list_sessions(self, limit: int = 50) -> list[SessionRecord]:
        pool = await self.pool()
        with self._guard("list_sessions"):
            rows = await pool.fetch(f"SELECT {self._COLS} FROM sessions ORDER BY updated_at DESC LIMIT $1", limit)
        return [self._session(r) for r in rows]

    async def update_metadata(self, session_id: str, metadata: dict[str, Any], goal_version: int | None = None) -> None:
        pool = await self.pool()
        with self._guard("update_metadata"):
            status = await pool.execute(
                f"UPDATE sessions SET metadata = metadata || $2::jsonb, goal_version = COALESCE($3, goal_version), "
                f"updated_at = {_NOW} WHERE session_id=$1", session_id, _j(metadata), goal_version)
        if status.endswith(" 0"):
            raise KeyError(f"unknown session {session_id}")

    async def write(self, batch: WriteBatch) -> None:
        pool = await self.pool()
        with self._guard("write"):
            async with pool.acquire() as con, con.transaction():
                await self._write(con, batch)

    async def _write(self, con: Any, batch: WriteBatch) -> None:
        row = await con.fetchrow("SELECT last_seq, lease_owner FROM sessions WHERE session_id=$1 FOR UPDATE",
                                 batch.session_id)
        if row is None:
            raise KeyError(f"unknown session {batch.session_id}")
        last_seq, owner = row
        if batch.expected_owner is not None and owner != batch.expected_owner:
            raise LeaseLost(f"session {batch.session_id} is leased by {owner}, not {batch.expected_owner}")
        if batch.events:
            if batch.events[0].seq != last_seq + 1:
                raise SessionConflictError(batch.session_id, batch.events[0].seq, last_seq)
            await con.executemany(
                "INSERT INTO events VALUES ($1,$2,$3,$4,$5,$6,$7::jsonb,$8)",
                [(e.session_id, e.seq, e.event_id, e.turn_id, e.type, e.ts, _j(e.payload), e.schema_version)
                 for e in batch.events])
            last_seq = batch.events[-1].seq
        ck = batch.checkpoint
        if ck is not None:
            await con.execute("INSERT INTO checkpoints VALUES ($1,$2,$3,$4,$5::jsonb,$6,$7)",
                              ck.checkpoint_id, ck.session_id, ck.seq, ck.safe_point, _j(ck.data), ck.ts,
                              ck.schema_version)
        if batch.ledger:
            await con.executemany(
                "INSERT INTO ledger VALUES ($1,$2,$3,$4::jsonb,$5,$6,$7,$8,$9::jsonb,$10,$11) "
                "ON CONFLICT (session_id, call_id) DO UPDATE SET tool=EXCLUDED.tool, arguments=EXCLUDED.arguments, "
                "idempotency_key=EXCLUDED.idempotency_key, effect=EXCLUDED.effect, status=EXCLUDED.status, "
                "turn=EXCLUDED.turn, result=EXCLUDED.result, updated_at=EXCLUDED.updated_at, "
                "schema_version=EXCLUDED.schema_version",
                [(x.session_id, x.call_id, x.tool, _j(x.arguments), x.idempotency_key, x.effect, x.status.value,
                  x.turn, _j(x.result) if x.result is not None else None, x.updated_at, x.schema_version)
                 for x in batch.ledger])
        await con.execute(self._update_sql, batch.session_id, last_seq, batch.state,
                          _j(batch.stop) if batch.stop is not None else None)

    async def read_events(self, session_id: str, after_seq: int = 0, until_seq: int | None = None,
                          types: Sequence[str] | None = None) -> list[EventRecord]:
        pool = await self.pool()
        with self._guard("read_events"):
            rows = await pool.fetch(
                "SELECT session_id, seq, type, payload, turn_id, ts, event_id, schema_version FROM events "
                "WHERE session_id=$1 AND seq>$2 AND seq<=$3 AND ($4::text[] IS NULL OR type = ANY($4::text[])) "
                "ORDER BY seq",
                session_id, after_seq, until_seq if until_seq is not None else 2**62, list(types) if types else None)
        return [EventRecord(r[0], r[1], r[2], _l(r[3]), r[4], r[5], r[6], r[7]) for r in rows]

    @staticmethod
    def _checkpoint(r: Any) -> Checkpoint:
        return Checkpoint(r[0], r[1], r[2], r[3], _l(r[4]), r[5], r[6])

    async def latest_checkpoint(self, session_id: str) -> Checkpoint | None:
        pool = await self.pool()
        with self._guard("latest_checkpoint"):
            r = await pool.fetchrow("SELECT * FROM checkpoints WHERE session_id=$1 ORDER BY seq DESC, ts DESC LIMIT 1",
                                    session_id)
        return self._checkpoint(r) if r else None

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        pool = await self.pool()
        with self._guard("get_checkpoint"):
            r = await pool.fetchrow("SELECT * FROM checkpoints WHERE checkpoint_id=$1", checkpoint_id)
        return self._checkpoint(r) if r else None

    async def ledger(self, session_id: str) -> dict[str, LedgerEntry]:
        pool = await self.pool()
        with self._guard("ledger"):
            rows = await pool.fetch("SELECT * FROM ledger WHERE session_id=$1", session_id)
        return {r[1]: LedgerEntry(r[0], r[1], r[2], _l(r[3]), r[4], r[5], LedgerStatus(r[6]), r[7],
                                  _l(r[8]) if r[8] is not None else None, r[9], r[10]) for r in rows}

    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> bool:
        pool = await self.pool()
        with self._guard("acquire_lease"):
            status = await pool.execute(
                f"UPDATE sessions SET lease_owner=$2, lease_until={_NOW} + $3 WHERE session_id=$1 AND "
                f"(lease_owner IS NULL OR lease_owner=$2 OR lease_until IS NULL OR lease_until < {_NOW})",
                session_id, owner, ttl)
        return bool(status == "UPDATE 1")

    async def release_lease(self, session_id: str, owner: str) -> None:
        pool = await self.pool()
        with self._guard("release_lease"):
            await pool.execute("UPDATE sessions SET lease_owner=NULL, lease_until=NULL WHERE session_id=$1 AND "
                               "lease_owner=$2", session_id, owner)

    async def push_control(self, record: ControlRecord) -> None:
        import asyncpg

        pool = await self.pool()
        if await self.get_session(record.session_id) is None:
            raise KeyError(f"unknown session {record.session_id}")
        try:
            with self._guard("push_control"):
                await pool.execute("INSERT INTO controls VALUES ($1,$2,$3,$4,$5)", record.control_id,
                                   record.session_id, record.kind.value, record.text, record.ts)
        except StoreError as exc:
            if isinstance(exc.__cause__, asyncpg.UniqueViolationError):
                raise KeyError(f"control {record.control_id} already queued") from None
            raise

    async def take_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> list[ControlRecord]:
        pool = await self.pool()
        with self._guard("take_controls"):
            rows = await pool.fetch(
                "DELETE FROM controls WHERE control_id IN (SELECT control_id FROM controls WHERE session_id=$1 AND "
                "kind = ANY($2::text[]) ORDER BY ts FOR UPDATE SKIP LOCKED) "
                "RETURNING control_id, session_id, kind, text, ts",
                session_id, [k.value for k in kinds])
        return sorted((ControlRecord(r[1], ControlKind(r[2]), r[3], r[0], r[4]) for r in rows), key=lambda c: c.ts)

    async def peek_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> bool:
        pool = await self.pool()
        with self._guard("peek_controls"):
            return bool(await pool.fetchval(
                "SELECT EXISTS (SELECT 1 FROM controls WHERE session_id=$1 AND kind = ANY($2::text[]))",
                session_id, [k.value for k in kinds]))

    async def claim_idempotency_key(self, session_id: str, key: str, value: dict[str, Any]
                                    ) -> tuple[dict[str, Any], bool]:
        pool = await self.pool()
        if await self.get_session(session_id) is None:
            raise KeyError(f"unknown session {session_id}")
        with self._guard("claim_idempotency_key"):
            stored = await pool.fetchval(
                "INSERT INTO idempotency VALUES ($1,$2,$3::jsonb,extract(epoch from clock_timestamp())) "
                "ON CONFLICT (session_id, key) DO NOTHING RETURNING 1", session_id, key, _j(value))
            if stored:
                return value, True
            row = await pool.fetchval("SELECT value FROM idempotency WHERE session_id=$1 AND key=$2", session_id, key)
        return _l(row), False

    async def idempotency_records(self, session_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        pool = await self.pool()
        with self._guard("idempotency_records"):
            rows = await pool.fetch("SELECT key, value FROM idempotency WHERE session_id=$1 AND starts_with(key, $2) "
                                    "ORDER BY ts", session_id, prefix)
        return {r[0]: _l(r[1]) for r in rows}

    # -- parent/child links -----------------------------------------------------------------
    _LINK_COLS = "child_id, parent_id, kind, call_id, metadata, created_at"

    @staticmethod
    def _link(r: Any) -> SessionLink:
        return SessionLink(r[0], r[1], r[2], r[3], _l(r[4]), r[5])

    async def link_session(self, link: SessionLink) -> tuple[SessionLink, bool]:
        check_link(link)
        pool = await self.pool()
        with self._guard("link_session"):
            # one statement: the parent's existence, the insert and the earlier link (when there is one)
            row = await pool.fetchrow(
                f"WITH p AS (SELECT 1 FROM sessions WHERE session_id=$2), "
                f"i AS (INSERT INTO session_links ({self._LINK_COLS}) SELECT $1,$2,$3,$4,$5::jsonb,$6 "
                "WHERE EXISTS (SELECT 1 FROM p) ON CONFLICT (child_id) DO NOTHING RETURNING child_id) "
                "SELECT EXISTS (SELECT 1 FROM p), EXISTS (SELECT 1 FROM i)",
                link.child_id, link.parent_id, link.kind, link.call_id, _j(link.metadata), link.created_at)
            if not row[0]:
                raise KeyError(f"unknown parent session {link.parent_id}")
            if row[1]:
                return link, True
            kept = await pool.fetchrow(f"SELECT {self._LINK_COLS} FROM session_links WHERE child_id=$1", link.child_id)
        return self._link(kept), False

    async def parent(self, session_id: str) -> SessionLink | None:
        pool = await self.pool()
        with self._guard("parent"):
            r = await pool.fetchrow(f"SELECT {self._LINK_COLS} FROM session_links WHERE child_id=$1", session_id)
        return self._link(r) if r else None

    async def children(self, session_id: str) -> list[SessionLink]:
        pool = await self.pool()
        with self._guard("children"):
            rows = await pool.fetch(f"SELECT {self._LINK_COLS} FROM session_links WHERE parent_id=$1 "
                                    "ORDER BY created_at, child_id", session_id)
        return [self._link(r) for r in rows]

    # -- the run queue of fsm_agent.server.queue; clocks are the database's ------------------
    async def enqueue_run(self, job_id: str, session_id: str, kind: str, payload: dict[str, Any],
                          delay: float = 0.0) -> None:
        """Queue a run, runnable in ``delay`` seconds, and wake workers (``NOTIFY fsm_queue``
        with the job id) in the same transaction.

        Raises:
            StoreError: the database could not be written (a job id already queued: not transient).
        """
        pool = await self.pool()
        with self._guard("enqueue_run"):
            await pool.execute(
                "WITH i AS (INSERT INTO run_queue (job_id, session_id, kind, payload, available_at, attempts, "
                f"created_at) VALUES ($1,$2,$3,$4::jsonb,{_NOW} + $5,0,{_NOW}) RETURNING job_id) "
                f"SELECT pg_notify('{QUEUE_CHANNEL}', job_id) FROM i", job_id, session_id, kind, _j(payload), delay)

    async def claim_runs(self, owner: str, ttl: float, limit: int) -> list[QueuedRun]:
        """Claim up to ``limit`` runnable jobs for ``owner`` for ``ttl`` seconds (``SELECT … FOR
        UPDATE SKIP LOCKED``: two claimers never get the same job), oldest first.

        Runnable: ``available_at`` has passed, no unexpired claim, and no other job of the same
        session holds an unexpired claim (runs of one session go one at a time). Each claimed
        job's ``attempts`` is counted up.
        """
        pool = await self.pool()
        with self._guard("claim_runs"):
            rows = await pool.fetch(
                f"UPDATE run_queue q SET claimed_by=$1, claimed_until={_NOW} + $2, attempts=q.attempts + 1 "
                "WHERE q.job_id IN (SELECT c.job_id FROM run_queue c "
                f"  WHERE c.available_at <= {_NOW} AND (c.claimed_until IS NULL OR c.claimed_until < {_NOW}) "
                "  AND NOT EXISTS (SELECT 1 FROM run_queue o WHERE o.session_id = c.session_id "
                f"    AND o.job_id <> c.job_id AND o.claimed_until >= {_NOW}) "
                "  ORDER BY c.available_at, c.created_at LIMIT $3 FOR UPDATE SKIP LOCKED) "
                "RETURNING q.job_id, q.session_id, q.kind, q.payload, q.attempts, q.created_at",
                owner, ttl, limit)
        runs = [QueuedRun(r[0], r[1], r[2], _l(r[3]), r[4], r[5]) for r in rows]
        return sorted(runs, key=lambda r: r.created_at)

    async def renew_claims(self, owner: str, job_ids: Sequence[str], ttl: float) -> set[str]:
        """Extend ``owner``'s claims of ``job_ids`` to ``ttl`` seconds from now; returns the ids
        still claimed by ``owner`` (a claim that expired and was taken by another worker is lost)."""
        if not job_ids:
            return set()
        pool = await self.pool()
        with self._guard("renew_claims"):
            rows = await pool.fetch(f"UPDATE run_queue SET claimed_until={_NOW} + $3 WHERE job_id = ANY($1::text[]) "
                                    "AND claimed_by=$2 RETURNING job_id", list(job_ids), owner, ttl)
        return {r[0] for r in rows}

    async def finish_run(self, job_id: str, owner: str) -> None:
        """Delete a job ``owner`` claimed (nothing when the claim went to another worker) and
        announce its session on ``fsm_events`` so that event streams re-check whether it is busy."""
        pool = await self.pool()
        with self._guard("finish_run"):
            await pool.execute(
                "WITH d AS (DELETE FROM run_queue WHERE job_id=$1 AND claimed_by=$2 RETURNING session_id), "
                "x AS (SELECT s.session_id, s.last_seq FROM d JOIN sessions s USING (session_id)) "
                + _notify_events("x"), job_id, owner)

    async def release_run(self, job_id: str, owner: str, delay: float, *, count_attempt: bool = True) -> None:
        """Give back ``owner``'s claim of a job, runnable again in ``delay`` seconds (workers are
        woken at once when ``delay`` <= 0). ``count_attempt=False``: the claim does not count
        as an attempt (the job never ran: its session was busy)."""
        pool = await self.pool()
        with self._guard("release_run"):
            await pool.execute(
                f"WITH u AS (UPDATE run_queue SET claimed_by=NULL, claimed_until=NULL, available_at={_NOW} + $3, "
                "attempts = attempts - CASE WHEN $4 THEN 0 ELSE 1 END WHERE job_id=$1 AND claimed_by=$2 "
                f"RETURNING job_id) SELECT pg_notify('{QUEUE_CHANNEL}', job_id) FROM u WHERE $3 <= 0",
                job_id, owner, delay, count_attempt)

    async def run_pending(self, session_id: str) -> bool:
        """Whether a job of ``session_id`` is queued, or a worker's lease of it has not expired."""
        pool = await self.pool()
        with self._guard("run_pending"):
            return bool(await pool.fetchval(
                "SELECT EXISTS (SELECT 1 FROM run_queue WHERE session_id=$1) OR "
                f"EXISTS (SELECT 1 FROM sessions WHERE session_id=$1 AND lease_until > {_NOW})", session_id))

    async def queued_runs(self, session_id: str | None = None) -> list[QueuedRun]:
        """The jobs in the queue (of ``session_id``, or all), oldest first."""
        pool = await self.pool()
        with self._guard("queued_runs"):
            rows = await pool.fetch(
                "SELECT job_id, session_id, kind, payload, attempts, created_at FROM run_queue "
                "WHERE $1::text IS NULL OR session_id=$1 ORDER BY created_at", session_id)
        return [QueuedRun(r[0], r[1], r[2], _l(r[3]), r[4], r[5]) for r in rows]

    async def notify_live(self, payloads: Sequence[str]) -> None:
        """Send each of ``payloads`` (each under 8,000 bytes), in order, on ``fsm_live``; not stored."""
        if not payloads:
            return
        pool = await self.pool()
        with self._guard("notify_live"):
            await pool.execute(f"SELECT pg_notify('{LIVE_CHANNEL}', p) FROM unnest($1::text[]) AS p", list(payloads))

    async def connect(self) -> Any:
        """A new asyncpg connection of its own, outside the pool (for ``LISTEN``); close it when done.

        Raises:
            StoreError: the server could not be reached.
            ConfigurationError: see :meth:`pool`.
        """
        await self.pool()  # asyncpg present, DSN valid, schema migrated
        import asyncpg

        with self._guard("connect"):
            return await asyncpg.connect(self.dsn)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
