"""SQLite store: the default for durable sessions. Embedded, zero setup, WAL mode.

One file holds every session; several processes may share it (writes take ``BEGIN IMMEDIATE``
and wait up to ``busy_timeout`` seconds for one another), so a control event can be queued from
another process and a crashed worker's session resumed by a new one. Calls are made directly on
the event loop: each is a short local transaction (tens of microseconds with
``synchronous=NORMAL``), cheaper than a thread hop.

Durability: in WAL mode with ``synchronous=NORMAL`` a committed transaction survives a killed
process (SIGKILL) but may be lost on power failure; pass ``synchronous="FULL"`` to survive that
too, at the cost of an fsync per commit.

WAL checkpoints (copying the log into the database file, two fsyncs) run off the event loop: every
:attr:`SQLiteStore.CHECKPOINT_EVERY` write transactions a ``PRAGMA wal_checkpoint(PASSIVE)`` runs
on a second connection in a worker thread. SQLite's own automatic checkpoint, which would run
inside a COMMIT on the loop (up to tens of milliseconds), only starts past
:attr:`SQLiteStore.AUTOCHECKPOINT_PAGES` pages, as a safety net.

Failures: every SQLite error becomes a :class:`~fsm_agent.errors.StoreError` that names the file,
the operation and SQLite's own message, chained to the ``sqlite3`` exception. ``transient`` is true
for "database is locked" / busy (another process held the write lock past ``busy_timeout``) and
out-of-memory; it is false for a full disk, a read-only file, a file that cannot be opened, an I/O
error or a corrupt database, which a person must fix. A failed write is rolled back as a whole
(nothing of it is visible) and the store stays usable: reads, and writes once the cause is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson

from ..errors import LeaseLost, SessionConflictError, SessionExistsError, StoreError
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

__all__ = ["MIGRATIONS", "SQLiteStore"]

log = logging.getLogger("fsm_agent.store.sqlite")

MIGRATIONS: tuple[str, ...] = (
    # 1: the initial schema
    """
    CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY, state TEXT NOT NULL, goal TEXT NOT NULL, goal_version INTEGER NOT NULL,
        stop BLOB, metadata BLOB NOT NULL, last_seq INTEGER NOT NULL, created_at REAL NOT NULL,
        updated_at REAL NOT NULL, lease_owner TEXT, lease_until REAL);
    CREATE INDEX sessions_updated ON sessions(updated_at);
    CREATE TABLE events (
        session_id TEXT NOT NULL, seq INTEGER NOT NULL, event_id TEXT NOT NULL, turn_id TEXT, type TEXT NOT NULL,
        ts REAL NOT NULL, payload BLOB NOT NULL, schema_version INTEGER NOT NULL,
        PRIMARY KEY (session_id, seq)) WITHOUT ROWID;
    CREATE TABLE checkpoints (
        checkpoint_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, seq INTEGER NOT NULL, safe_point TEXT NOT NULL,
        data BLOB NOT NULL, ts REAL NOT NULL, schema_version INTEGER NOT NULL);
    CREATE INDEX checkpoints_session ON checkpoints(session_id, seq);
    CREATE TABLE ledger (
        session_id TEXT NOT NULL, call_id TEXT NOT NULL, tool TEXT NOT NULL, arguments BLOB NOT NULL,
        idempotency_key TEXT NOT NULL, effect TEXT NOT NULL, status TEXT NOT NULL, turn INTEGER NOT NULL,
        result BLOB, updated_at REAL NOT NULL, schema_version INTEGER NOT NULL,
        PRIMARY KEY (session_id, call_id)) WITHOUT ROWID;
    CREATE TABLE controls (
        control_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, kind TEXT NOT NULL, text TEXT NOT NULL, ts REAL NOT NULL);
    CREATE INDEX controls_session ON controls(session_id, ts);
    """,
    # 2: idempotency keys of the server's decisions and controls
    """
    CREATE TABLE idempotency (
        session_id TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, ts REAL NOT NULL,
        PRIMARY KEY (session_id, key)) WITHOUT ROWID;
    """,
    # 3: parent/child links between sessions (fsm_agent.orchestration)
    """
    CREATE TABLE session_links (
        child_id TEXT PRIMARY KEY, parent_id TEXT NOT NULL, kind TEXT NOT NULL, call_id TEXT,
        metadata BLOB NOT NULL, created_at REAL NOT NULL) WITHOUT ROWID;
    CREATE INDEX session_links_parent ON session_links(parent_id, created_at);
    """,
)
"""Schema migrations, applied in order; ``schema_migrations`` records what a database has."""


def _j(value: Any) -> bytes:
    return orjson.dumps(value)


# Primary SQLite result codes (https://www.sqlite.org/rescode.html) after which the same operation
# may succeed later: another connection held the lock past busy_timeout, or memory ran short.
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_NOMEM = 5, 6, 7
_TRANSIENT_CODES = frozenset({_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_NOMEM})


def is_transient(exc: sqlite3.Error) -> bool:
    """Whether retrying after ``exc`` may succeed: locked / busy / out of memory. A full disk
    (``SQLITE_FULL``), a read-only database (``SQLITE_READONLY``), a file that cannot be opened
    (``SQLITE_CANTOPEN``), an I/O error (``SQLITE_IOERR``), a corrupt file (``SQLITE_CORRUPT``,
    ``SQLITE_NOTADB``) and everything else are not."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _TRANSIENT_CODES
    text = str(exc).lower()  # an error without a result code (raised by hand, or by the sqlite3 module)
    return "locked" in text or "busy" in text


class _Guard:
    """``with store._guard(op):`` turns a ``sqlite3.Error`` raised inside into a :class:`StoreError`."""

    __slots__ = ("op", "store")

    def __init__(self, store: SQLiteStore, op: str) -> None:
        self.store, self.op = store, op

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, sqlite3.Error):
            raise self.store._error(self.op, exc) from exc


class _Transaction:
    """``with store._transaction(op):`` runs the block in ``BEGIN IMMEDIATE`` ... ``COMMIT``; on any
    exception (or a failed COMMIT) it rolls back, so nothing of the block is visible, and turns
    ``sqlite3`` errors into :class:`StoreError`. Other exceptions (``KeyError``, ``LeaseLost`` ...)
    pass through unchanged."""

    __slots__ = ("op", "store")

    def __init__(self, store: SQLiteStore, op: str) -> None:
        self.store, self.op = store, op

    def __enter__(self) -> None:
        try:
            self.store._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self.store._rollback()
            raise self.store._error(self.op, exc) from exc

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        store = self.store
        if exc is None:
            try:
                store._db.execute("COMMIT")
            except sqlite3.Error as commit_exc:
                store._rollback()
                raise store._error(self.op, commit_exc) from commit_exc
            return
        store._rollback()
        if isinstance(exc, sqlite3.Error):
            raise store._error(self.op, exc) from exc


class SQLiteStore(Store):
    """Sessions in one SQLite file.

    Args:
        path: the database file (created with its directory), ``":memory:"``, or a SQLite ``file:``
            URI such as ``"file:/srv/sessions.db?mode=ro"`` (a read-only view: reads work, writes
            raise a :class:`StoreError`).
        busy_timeout: seconds to wait for another process's write lock before an operation fails
            with a transient :class:`StoreError` ("database is locked").
        synchronous: ``"NORMAL"`` (default) or ``"FULL"``.

    Raises:
        StoreError: the file cannot be opened, created or migrated (``operation="open"``).

    Attributes:
        location: the absolute file path (or URI, or ``":memory:"``) that errors name.
    """

    CHECKPOINT_EVERY = 100
    """Write transactions between two WAL checkpoints run in a worker thread (file databases)."""
    AUTOCHECKPOINT_PAGES = 10_000
    """WAL pages past which SQLite checkpoints inside a COMMIT anyway (its default is 1,000)."""

    def __init__(self, path: str | Path, *, busy_timeout: float = 30.0, synchronous: str = "NORMAL") -> None:
        self.path = str(path)
        self._busy_timeout = busy_timeout
        self._commits = 0
        self._ckpt_db: sqlite3.Connection | None = None
        self._ckpt_task: asyncio.Future[None] | None = None
        self._ckpt_lock = threading.Lock()
        self._closed = False
        uri = self.path.startswith("file:")
        self.location = self.path if uri or self.path == ":memory:" else os.path.abspath(self.path)
        try:
            if not uri and self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None,
                                       check_same_thread=False, uri=uri)
        except (OSError, sqlite3.Error) as exc:
            raise self._error("open", exc) from exc
        try:
            with self._guard("open"):
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute(f"PRAGMA synchronous={synchronous}")
                self._db.execute("PRAGMA foreign_keys=ON")
                self._background_checkpoints = self.path != ":memory:" and "mode=memory" not in self.path
                if self._background_checkpoints:
                    self._db.execute(f"PRAGMA wal_autocheckpoint={self.AUTOCHECKPOINT_PAGES}")
            self.migrate()
        except BaseException:
            self._db.close()
            raise

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    # -- failures -----------------------------------------------------------------------
    def _error(self, operation: str, exc: BaseException) -> StoreError:
        transient = is_transient(exc) if isinstance(exc, sqlite3.Error) else False
        return StoreError(self.location, operation, exc, transient=transient)

    def _guard(self, operation: str) -> _Guard:
        return _Guard(self, operation)

    def _transaction(self, operation: str) -> _Transaction:
        return _Transaction(self, operation)

    def _rollback(self) -> None:
        # SQLite rolls back by itself after some errors (SQLITE_FULL, SQLITE_IOERR ...): a ROLLBACK
        # then would fail with "no transaction is active" and hide the real cause.
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    # -- schema -------------------------------------------------------------------------
    def _have_version(self) -> int:
        row = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='schema_migrations'").fetchone()
        if row is None:
            return 0
        return int(self._db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0])

    def migrate(self) -> int:
        """Apply missing migrations; returns the schema version now in effect. A database that is
        already current is only read (so a read-only file opens)."""
        db = self._db
        with self._guard("open"):
            if self._have_version() >= len(MIGRATIONS):
                return len(MIGRATIONS)
        with self._transaction("migrate"):
            db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                       "applied_at REAL NOT NULL)")
            have = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0]
            for version, script in enumerate(MIGRATIONS, 1):
                if version <= have:
                    continue
                for stmt in script.split(";"):
                    if stmt.strip():
                        db.execute(stmt)
                db.execute("INSERT INTO schema_migrations VALUES (?, ?)", (version, time.time()))
        return len(MIGRATIONS)

    def schema_version(self) -> int:
        with self._guard("schema_version"):
            return self._have_version()

    # -- sessions -----------------------------------------------------------------------
    @staticmethod
    def _session(row: tuple[Any, ...]) -> SessionRecord:
        return SessionRecord(
            session_id=row[0], state=row[1], goal=row[2], goal_version=row[3],
            stop=orjson.loads(row[4]) if row[4] else None, metadata=orjson.loads(row[5]), last_seq=row[6],
            created_at=row[7], updated_at=row[8], lease_owner=row[9], lease_until=row[10],
        )

    _COLS = ("session_id, state, goal, goal_version, stop, metadata, last_seq, created_at, updated_at, "
             "lease_owner, lease_until")

    async def create_session(self, record: SessionRecord) -> None:
        try:
            self._db.execute(
                f"INSERT INTO sessions ({self._COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (record.session_id, record.state, record.goal, record.goal_version,
                 _j(record.stop) if record.stop is not None else None, _j(record.metadata), record.last_seq,
                 record.created_at, record.updated_at, record.lease_owner, record.lease_until),
            )
        except sqlite3.IntegrityError as exc:
            if "UNIQUE" in str(exc):
                raise SessionExistsError(record.session_id) from None
            raise self._error("create_session", exc) from exc
        except sqlite3.Error as exc:
            raise self._error("create_session", exc) from exc

    async def get_session(self, session_id: str) -> SessionRecord | None:
        with self._guard("get_session"):
            row = self._db.execute(f"SELECT {self._COLS} FROM sessions WHERE session_id=?", (session_id,)).fetchone()
        return self._session(row) if row else None

    async def list_sessions(self, limit: int = 50) -> list[SessionRecord]:
        with self._guard("list_sessions"):
            rows = self._db.execute(f"SELECT {self._COLS} FROM sessions ORDER BY updated_at DESC LIMIT ?",
                                    (limit,)).fetchall()
        return [self._session(r) for r in rows]

    async def update_metadata(self, session_id: str, metadata: dict[str, Any], goal_version: int | None = None) -> None:
        db = self._db
        with self._transaction("update_metadata"):
            row = db.execute("SELECT metadata, goal_version FROM sessions WHERE session_id=?", (session_id,)).fetchone()
            if row is None:
                raise KeyError(f"unknown session {session_id}")
            merged = {**orjson.loads(row[0]), **metadata}
            db.execute("UPDATE sessions SET metadata=?, goal_version=?, updated_at=? WHERE session_id=?",
                       (_j(merged), goal_version or row[1], time.time(), session_id))

    # -- the one write path ---------------------------------------------------------------
    # One conditional UPDATE claims the seq range, checks the lease and moves the state; only when it
    # matches nothing is the row read, to say why.
    _CLAIM = ("UPDATE sessions SET last_seq=COALESCE(?, last_seq), updated_at=?, state=COALESCE(?, state), "
              "stop=COALESCE(?, stop) WHERE session_id=? AND (? IS NULL OR last_seq=?) AND (? IS NULL OR lease_owner=?)")

    def _claim(self, batch: WriteBatch) -> None:
        db = self._db
        first = batch.events[0].seq if batch.events else None
        last = batch.events[-1].seq if batch.events else None
        cur = db.execute(self._CLAIM, (
            last, time.time(), batch.state, _j(batch.stop) if batch.stop is not None else None, batch.session_id,
            first, (first or 1) - 1, batch.expected_owner, batch.expected_owner))
        if cur.rowcount != 1:
            row = db.execute("SELECT last_seq, lease_owner FROM sessions WHERE session_id=?",
                             (batch.session_id,)).fetchone()
            if row is None:
                raise KeyError(f"unknown session {batch.session_id}")
            if batch.expected_owner is not None and row[1] != batch.expected_owner:
                raise LeaseLost(f"session {batch.session_id} is leased by {row[1]}, not {batch.expected_owner}")
            # A batch without events has no seq test: only a missing session or a lost lease refuse it.
            assert first is not None
            raise SessionConflictError(batch.session_id, first, row[0])

    async def write(self, batch: WriteBatch) -> None:
        db = self._db
        if not batch.events and batch.checkpoint is None and not batch.ledger:
            # Only the session row changes: one UPDATE, atomic by itself (no BEGIN / COMMIT).
            with self._guard("write"):
                self._claim(batch)
            return
        self._commits += 1
        if self._commits >= self.CHECKPOINT_EVERY and self._background_checkpoints:
            self._start_wal_checkpoint()
        with self._transaction("write"):
            self._claim(batch)
            if batch.events:
                db.executemany(
                    "INSERT INTO events VALUES (?,?,?,?,?,?,?,?)",
                    [(e.session_id, e.seq, e.event_id, e.turn_id, e.type, e.ts, _j(e.payload), e.schema_version)
                     for e in batch.events],
                )
            ck = batch.checkpoint
            if ck is not None:
                db.execute("INSERT INTO checkpoints VALUES (?,?,?,?,?,?,?)",
                           (ck.checkpoint_id, ck.session_id, ck.seq, ck.safe_point, _j(ck.data), ck.ts, ck.schema_version))
            if batch.ledger:
                db.executemany(
                    "INSERT OR REPLACE INTO ledger VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    [(x.session_id, x.call_id, x.tool, _j(x.arguments), x.idempotency_key, x.effect, x.status.value,
                      x.turn, _j(x.result) if x.result is not None else None, x.updated_at, x.schema_version)
                     for x in batch.ledger],
                )

    # -- reads --------------------------------------------------------------------------
    async def read_events(self, session_id: str, after_seq: int = 0, until_seq: int | None = None,
                          types: Sequence[str] | None = None) -> list[EventRecord]:
        only = f" AND type IN ({','.join('?' * len(types))})" if types else ""
        with self._guard("read_events"):
            rows = self._db.execute(
                "SELECT session_id, seq, type, payload, turn_id, ts, event_id, schema_version FROM events "
                f"WHERE session_id=? AND seq>? AND seq<=?{only} ORDER BY seq",
                (session_id, after_seq, until_seq if until_seq is not None else 2**62, *(types or ())),
            ).fetchall()
        return [EventRecord(r[0], r[1], r[2], orjson.loads(r[3]), r[4], r[5], r[6], r[7]) for r in rows]

    @staticmethod
    def _checkpoint(r: tuple[Any, ...]) -> Checkpoint:
        return Checkpoint(r[0], r[1], r[2], r[3], orjson.loads(r[4]), r[5], r[6])

    async def latest_checkpoint(self, session_id: str) -> Checkpoint | None:
        with self._guard("latest_checkpoint"):
            r = self._db.execute("SELECT * FROM checkpoints WHERE session_id=? ORDER BY seq DESC, ts DESC LIMIT 1",
                                 (session_id,)).fetchone()
        return self._checkpoint(r) if r else None

    async def get_checkpoint(self, checkpoint_id: str) -> Checkpoint | None:
        with self._guard("get_checkpoint"):
            r = self._db.execute("SELECT * FROM checkpoints WHERE checkpoint_id=?", (checkpoint_id,)).fetchone()
        return self._checkpoint(r) if r else None

    async def ledger(self, session_id: str) -> dict[str, LedgerEntry]:
        with self._guard("ledger"):
            rows = self._db.execute("SELECT * FROM ledger WHERE session_id=?", (session_id,)).fetchall()
        return {
            r[1]: LedgerEntry(r[0], r[1], r[2], orjson.loads(r[3]), r[4], r[5], LedgerStatus(r[6]), r[7],
                              orjson.loads(r[8]) if r[8] is not None else None, r[9], r[10])
            for r in rows
        }

    # -- leases and controls ------------------------------------------------------------------
    async def acquire_lease(self, session_id: str, owner: str, ttl: float) -> bool:
        # One conditional UPDATE is atomic by itself: of two racing workers exactly one matches.
        now = time.time()
        with self._guard("acquire_lease"):
            cur = self._db.execute(
                "UPDATE sessions SET lease_owner=?, lease_until=? WHERE session_id=? AND "
                "(lease_owner IS NULL OR lease_owner=? OR lease_until IS NULL OR lease_until<?)",
                (owner, now + ttl, session_id, owner, now),
            )
        return cur.rowcount == 1

    async def release_lease(self, session_id: str, owner: str) -> None:
        with self._guard("release_lease"):
            self._db.execute("UPDATE sessions SET lease_owner=NULL, lease_until=NULL WHERE session_id=? AND lease_owner=?",
                             (session_id, owner))

    async def push_control(self, record: ControlRecord) -> None:
        if await self.get_session(record.session_id) is None:
            raise KeyError(f"unknown session {record.session_id}")
        with self._guard("push_control"):
            self._db.execute("INSERT INTO controls VALUES (?,?,?,?,?)",
                             (record.control_id, record.session_id, record.kind.value, record.text, record.ts))

    async def take_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> list[ControlRecord]:
        if not await self.peek_controls(session_id, kinds):  # the common case takes no write lock
            return []
        db = self._db
        marks = ",".join("?" * len(kinds))
        with self._transaction("take_controls"):
            rows = db.execute(
                f"SELECT control_id, session_id, kind, text, ts FROM controls WHERE session_id=? AND kind IN ({marks}) "
                "ORDER BY ts", (session_id, *[k.value for k in kinds])).fetchall()
            if rows:
                db.executemany("DELETE FROM controls WHERE control_id=?", [(r[0],) for r in rows])
        return [ControlRecord(r[1], ControlKind(r[2]), r[3], r[0], r[4]) for r in rows]

    async def peek_controls(self, session_id: str, kinds: Sequence[ControlKind]) -> bool:
        marks = ",".join("?" * len(kinds))
        with self._guard("peek_controls"):
            row = self._db.execute(f"SELECT 1 FROM controls WHERE session_id=? AND kind IN ({marks}) LIMIT 1",
                                   (session_id, *[k.value for k in kinds])).fetchone()
        return row is not None

    async def claim_idempotency_key(self, session_id: str, key: str, value: dict[str, Any]
                                    ) -> tuple[dict[str, Any], bool]:
        if await self.get_session(session_id) is None:
            raise KeyError(f"unknown session {session_id}")
        db = self._db
        with self._transaction("claim_idempotency_key"):
            cur = db.execute("INSERT OR IGNORE INTO idempotency VALUES (?,?,?,?)", (session_id, key, _j(value), time.time()))
            if cur.rowcount == 1:
                return value, True
            row = db.execute("SELECT value FROM idempotency WHERE session_id=? AND key=?", (session_id, key)).fetchone()
        return orjson.loads(row[0]), False

    async def idempotency_records(self, session_id: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        with self._guard("idempotency_records"):
            rows = self._db.execute("SELECT key, value FROM idempotency WHERE session_id=? AND substr(key, 1, ?)=? "
                                    "ORDER BY ts", (session_id, len(prefix), prefix)).fetchall()
        return {r[0]: orjson.loads(r[1]) for r in rows}

    # -- parent/child links -----------------------------------------------------------------
    _LINK_COLS = "child_id, parent_id, kind, call_id, metadata, created_at"

    @staticmethod
    def _link(r: tuple[Any, ...]) -> SessionLink:
        return SessionLink(r[0], r[1], r[2], r[3], orjson.loads(r[4]), r[5])

    async def link_session(self, link: SessionLink) -> tuple[SessionLink, bool]:
        check_link(link)
        db = self._db
        with self._transaction("link_session"):
            if db.execute("SELECT 1 FROM sessions WHERE session_id=?", (link.parent_id,)).fetchone() is None:
                raise KeyError(f"unknown parent session {link.parent_id}")
            cur = db.execute(f"INSERT OR IGNORE INTO session_links ({self._LINK_COLS}) VALUES (?,?,?,?,?,?)",
                             (link.child_id, link.parent_id, link.kind, link.call_id, _j(link.metadata),
                              link.created_at))
            if cur.rowcount == 1:
                return link, True
            row = db.execute(f"SELECT {self._LINK_COLS} FROM session_links WHERE child_id=?",
                             (link.child_id,)).fetchone()
        return self._link(row), False

    async def parent(self, session_id: str) -> SessionLink | None:
        with self._guard("parent"):
            row = self._db.execute(f"SELECT {self._LINK_COLS} FROM session_links WHERE child_id=?",
                                   (session_id,)).fetchone()
        return self._link(row) if row else None

    async def children(self, session_id: str) -> list[SessionLink]:
        with self._guard("children"):
            rows = self._db.execute(f"SELECT {self._LINK_COLS} FROM session_links WHERE parent_id=? "
                                    "ORDER BY created_at, child_id", (session_id,)).fetchall()
        return [self._link(r) for r in rows]

    # -- WAL checkpoints, off the event loop -------------------------------------------------
    def _start_wal_checkpoint(self) -> None:
        if self._ckpt_task is not None and not self._ckpt_task.done():
            return  # one at a time; the next write tries again
        self._commits = 0
        self._ckpt_task = asyncio.get_running_loop().run_in_executor(None, self._wal_checkpoint)

    def _wal_checkpoint(self) -> None:
        """``PRAGMA wal_checkpoint(PASSIVE)`` on the checkpoint connection (a worker thread). PASSIVE
        never blocks a writer; a failure is only logged: the log stays complete and durable, and the
        next attempt (or SQLite's automatic checkpoint) copies it."""
        with self._ckpt_lock:
            if self._closed:
                return
            try:
                if self._ckpt_db is None:
                    self._ckpt_db = sqlite3.connect(self.path, timeout=self._busy_timeout, isolation_level=None,
                                                    check_same_thread=False, uri=self.path.startswith("file:"))
                self._ckpt_db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error as exc:
                log.warning("%s: WAL checkpoint failed (%s); it is retried later", self.location, exc)

    async def close(self) -> None:
        task, self._ckpt_task = self._ckpt_task, None
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            await asyncio.gather(task, return_exceptions=True)
        with self._ckpt_lock:  # a checkpoint still running (started on another loop) ends first
            self._closed = True
            for db in (self._db, self._ckpt_db):
                if db is None:
                    continue
                try:
                    db.close()
                except sqlite3.Error:
                    pass
