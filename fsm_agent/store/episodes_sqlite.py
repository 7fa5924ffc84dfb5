"""Episodes in SQLite, ranked by FTS5's BM25 (see :mod:`fsm_agent.store.episodes`).

The tables live beside the session store's, in the same file by default, and have their own
migrations (recorded in ``memory_migrations``): ``episodes`` (one row per episode: its JSON, its
tenant, its optional vector) and ``episodes_fts``, an FTS5 index of three columns (goal, outcome,
steps; weighted 4 : 2 : 1) with the Porter stemmer. Calls run on the event loop, as the session
store's do: each is one short local transaction. Every SQLite error becomes a
:class:`~fsm_agent.errors.StoreError` naming the file and the operation.
"""

from __future__ import annotations

import array
import os
import sqlite3
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
from attrs import evolve

from ..errors import ConfigurationError, StoreError
from ..types.codec import structure, unstructure
from .episodes import Embed, Episode, EpisodeHit, EpisodeStore, SearchTerms, search_terms
from .sqlite import is_transient

__all__ = ["MIGRATIONS", "SQLiteEpisodeStore"]

MIGRATIONS: tuple[str, ...] = (
    # 1: episodes and their full-text index
    """
    CREATE TABLE episodes (
        episode_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT NOT NULL, outcome TEXT NOT NULL,
        data BLOB NOT NULL, embedding BLOB, created_at REAL NOT NULL, updated_at REAL NOT NULL);
    CREATE INDEX episodes_tenant ON episodes(tenant, updated_at);
    CREATE VIRTUAL TABLE episodes_fts USING fts5(goal, outcome, steps, tokenize = 'porter unicode61 remove_diacritics 2');
    """,
)
"""Schema migrations of the episode tables, applied in order; ``memory_migrations`` records them."""

_WEIGHTS = "4.0, 2.0, 1.0"
_COLS = "data, created_at, updated_at"


class _Guard:
    __slots__ = ("op", "store", "tx")

    def __init__(self, store: SQLiteEpisodeStore, op: str, tx: bool) -> None:
        self.store, self.op, self.tx = store, op, tx

    def __enter__(self) -> None:
        if self.tx:
            try:
                self.store._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self.store._error(self.op, exc) from exc

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        db = self.store._db
        if self.tx:
            if exc is None:
                try:
                    db.execute("COMMIT")
                    return
                except sqlite3.Error as commit_exc:
                    self.store._rollback()
                    raise self.store._error(self.op, commit_exc) from commit_exc
            self.store._rollback()
        if isinstance(exc, sqlite3.Error):
            raise self.store._error(self.op, exc) from exc


class SQLiteEpisodeStore(EpisodeStore):
    """Episodes in a SQLite file (see the module doc).

    Args:
        path: the database file (created with its directory; the session store's file is a good
            place), ``":memory:"``, or a SQLite ``file:`` URI.
        embed: the optional embedding hook (:mod:`fsm_agent.store.episodes`).
        busy_timeout: seconds to wait for another process's write lock.

    Raises:
        StoreError: the file cannot be opened or migrated, or this SQLite has no FTS5.
    """

    def __init__(self, path: str | Path, *, embed: Embed | None = None, busy_timeout: float = 30.0,
                 vector_scan: int = 2000) -> None:
        super().__init__(embed=embed, vector_scan=vector_scan)
        self.path = str(path)
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
            self.migrate()
        except BaseException:
            self._db.close()
            raise

    def __repr__(self) -> str:
        return f"SQLiteEpisodeStore({self.path!r})"

    def _error(self, operation: str, exc: BaseException) -> StoreError:
        transient = is_transient(exc) if isinstance(exc, sqlite3.Error) else False
        return StoreError(self.location, f"memory {operation}", exc, transient=transient)

    def _guard(self, operation: str, *, tx: bool = False) -> _Guard:
        return _Guard(self, operation, tx)

    def _rollback(self) -> None:
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    # -- schema -------------------------------------------------------------------------------------
    def _have(self) -> int:
        row = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='memory_migrations'").fetchone()
        if row is None:
            return 0
        return int(self._db.execute("SELECT COALESCE(MAX(version), 0) FROM memory_migrations").fetchone()[0])

    def migrate(self) -> int:
        """Apply missing migrations; returns the schema version in effect (a current database is only read)."""
        with self._guard("open"):
            if self._have() >= len(MIGRATIONS):
                return len(MIGRATIONS)
        with self._guard("migrate", tx=True):
            db = self._db
            db.execute("CREATE TABLE IF NOT EXISTS memory_migrations (version INTEGER PRIMARY KEY, "
                       "applied_at REAL NOT NULL)")
            have = db.execute("SELECT COALESCE(MAX(version), 0) FROM memory_migrations").fetchone()[0]
            for version, script in enumerate(MIGRATIONS, 1):
                if version <= have:
                    continue
                for stmt in script.split(";"):
                    if stmt.strip():
                        db.execute(stmt)
                db.execute("INSERT INTO memory_migrations VALUES (?, ?)", (version, time.time()))
        return len(MIGRATIONS)

    def schema_version(self) -> int:
        """The version of the episode tables in this file."""
        with self._guard("schema_version"):
            return self._have()

    # -- rows ---------------------------------------------------------------------------------------
    @staticmethod
    def _episode(row: Any) -> Episode:
        ep: Episode = structure(orjson.loads(row[0]), Episode)
        return evolve(ep, created_at=row[1], updated_at=row[2])

    async def _save(self, episode: Episode, vector: list[float] | None) -> Episode:
        db = self._db
        goal, outcome, steps = (search_terms(t).as_text() for t in episode.fields_text())
        blob = array.array("d", vector).tobytes() if vector is not None else None
        with self._guard("save", tx=True):
            row = db.execute("SELECT rowid, tenant, created_at FROM episodes WHERE episode_id=?",
                             (episode.episode_id,)).fetchone()
            if row is not None and row[1] != episode.tenant:
                raise ConfigurationError(f"episode {episode.episode_id!r} belongs to another tenant; an episode id "
                                         "is unique across tenants")
            created = row[2] if row is not None else episode.created_at or episode.updated_at
            stored = evolve(episode, created_at=created)
            data = orjson.dumps(unstructure(stored))
            if row is None:
                cur = db.execute("INSERT INTO episodes (episode_id, tenant, session_id, outcome, data, embedding, "
                                 "created_at, updated_at) VALUES (?,?,?,?,?,?,?,?)",
                                 (stored.episode_id, stored.tenant, stored.session_id, stored.outcome, data, blob,
                                  stored.created_at, stored.updated_at))
                rowid = cur.lastrowid
            else:
                rowid = row[0]
                db.execute("UPDATE episodes SET session_id=?, outcome=?, data=?, embedding=?, updated_at=? "
                           "WHERE rowid=?", (stored.session_id, stored.outcome, data, blob, stored.updated_at, rowid))
                db.execute("DELETE FROM episodes_fts WHERE rowid=?", (rowid,))
            db.execute("INSERT INTO episodes_fts (rowid, goal, outcome, steps) VALUES (?,?,?,?)",
                       (rowid, goal, outcome, steps))
        return stored

    async def _text_search(self, tenant: str, terms: SearchTerms, limit: int, exclude: tuple[str, ...]
                           ) -> list[EpisodeHit]:
        match = " OR ".join(f'"{t}"' for t in (*terms.words, *terms.grams))
        skip = f" AND e.episode_id NOT IN ({','.join('?' * len(exclude))})" if exclude else ""
        with self._guard("search"):
            rows = self._db.execute(
                f"SELECT e.data, e.created_at, e.updated_at, bm25(episodes_fts, {_WEIGHTS}) AS rank "
                f"FROM episodes_fts JOIN episodes e ON e.rowid = episodes_fts.rowid "
                f"WHERE episodes_fts MATCH ? AND e.tenant = ?{skip} ORDER BY rank, e.updated_at DESC LIMIT ?",
                (match, tenant, *exclude, limit)).fetchall()
        return [EpisodeHit(self._episode(r), round(-float(r[3]), 9)) for r in rows]

    async def _vectors(self, tenant: str, limit: int, exclude: tuple[str, ...]) -> list[tuple[Episode, list[float]]]:
        skip = f" AND episode_id NOT IN ({','.join('?' * len(exclude))})" if exclude else ""
        with self._guard("search"):
            rows = self._db.execute(
                f"SELECT {_COLS}, embedding FROM episodes WHERE tenant=? AND embedding IS NOT NULL{skip} "
                "ORDER BY updated_at DESC LIMIT ?", (tenant, *exclude, limit)).fetchall()
        out = []
        for r in rows:
            vec = array.array("d")
            vec.frombytes(r[3])
            out.append((self._episode(r), vec.tolist()))
        return out

    async def _get(self, episode_id: str, tenant: str | None) -> Episode | None:
        with self._guard("get"):
            if tenant is None:
                row = self._db.execute(f"SELECT {_COLS} FROM episodes WHERE episode_id=?", (episode_id,)).fetchone()
            else:
                row = self._db.execute(f"SELECT {_COLS} FROM episodes WHERE episode_id=? AND tenant=?",
                                       (episode_id, tenant)).fetchone()
        return self._episode(row) if row else None

    async def _list(self, tenant: str | None, limit: int) -> list[Episode]:
        with self._guard("list"):
            if tenant is None:
                rows = self._db.execute(f"SELECT {_COLS} FROM episodes ORDER BY updated_at DESC, episode_id "
                                        "LIMIT ?", (limit,)).fetchall()
            else:
                rows = self._db.execute(f"SELECT {_COLS} FROM episodes WHERE tenant=? ORDER BY updated_at DESC, "
                                        "episode_id LIMIT ?", (tenant, limit)).fetchall()
        return [self._episode(r) for r in rows]

    async def _delete(self, episode_id: str, tenant: str | None) -> bool:
        db = self._db
        with self._guard("delete", tx=True):
            row = db.execute("SELECT rowid, tenant FROM episodes WHERE episode_id=?", (episode_id,)).fetchone()
            if row is None or (tenant is not None and row[1] != tenant):
                return False
            db.execute("DELETE FROM episodes WHERE rowid=?", (row[0],))
            db.execute("DELETE FROM episodes_fts WHERE rowid=?", (row[0],))
        return True

    async def _delete_tenant(self, tenant: str) -> int:
        db = self._db
        with self._guard("delete", tx=True):
            rowids = [r[0] for r in db.execute("SELECT rowid FROM episodes WHERE tenant=?", (tenant,))]
            db.executemany("DELETE FROM episodes_fts WHERE rowid=?", [(r,) for r in rowids])
            db.execute("DELETE FROM episodes WHERE tenant=?", (tenant,))
        return len(rowids)

    async def close(self) -> None:
        self._db.close()
