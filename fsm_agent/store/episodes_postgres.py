"""Episodes in PostgreSQL, ranked by ``ts_rank`` (see :mod:`fsm_agent.store.episodes`).

The tables live beside the session store's, in the same database by default, and have their own
migrations (recorded in ``memory_migrations``, applied once under an advisory lock): ``episodes``
holds each episode's JSON, its tenant, its optional vector and a ``tsvector`` of its terms (goal
weighted ``A``, outcome ``B``, steps ``C``) with a GIN index. Words go through the ``english``
configuration (stemmed, common words dropped); pairs of CJK characters are stored as they are
(``array_to_tsvector``), so they match whatever the database's locale. Errors become
:class:`~fsm_agent.errors.StoreError` naming the DSN without its password, as the session store's do.

Requires ``asyncpg`` (``pip install 'fsm-agent[postgres]'``).
"""

from __future__ import annotations

from typing import Any

import orjson
from attrs import evolve

from ..errors import ConfigurationError, StoreError
from ..types.codec import structure, unstructure
from .episodes import Embed, Episode, EpisodeHit, EpisodeStore, SearchTerms, search_terms
from .postgres import _CONFIG_STATES, _passwords, _root, is_transient, redact_dsn

__all__ = ["MIGRATIONS", "PostgresEpisodeStore"]

MIGRATIONS: tuple[str, ...] = (
    # 1: episodes with their terms
    """
    CREATE TABLE episodes (
        episode_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT NOT NULL, outcome TEXT NOT NULL,
        data JSONB NOT NULL, terms TSVECTOR NOT NULL, embedding DOUBLE PRECISION[],
        created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL);
    CREATE INDEX episodes_tenant ON episodes(tenant, updated_at);
    CREATE INDEX episodes_terms ON episodes USING GIN (terms);
    """,
)
"""Schema migrations of the episode tables, applied in order; ``memory_migrations`` records them."""

_LOCK_ID = 0x46534D4D  # "FSMM": the advisory lock taken while migrating the episode tables
_COLS = "data, created_at, updated_at"
_FIELD = "setweight(to_tsvector('english', ${w}) || array_to_tsvector(${g}::text[]), '{weight}')"
_TERMS = " || ".join(_FIELD.format(w=w, g=g, weight=k) for w, g, k in ((9, 10, "A"), (11, 12, "B"), (13, 14, "C")))


def _lexeme(term: str) -> str:
    """``term`` as a quoted tsquery lexeme (terms are letters and digits only; quoted anyway)."""
    return "'" + term.replace("\\", "\\\\").replace("'", "''") + "'"


class PostgresEpisodeStore(EpisodeStore):
    """Episodes in PostgreSQL (see the module doc).

    Args:
        dsn: a libpq connection string or URL (the session store's is a good place).
        embed: the optional embedding hook (:mod:`fsm_agent.store.episodes`).
        min_size / max_size: connection pool bounds.

    Raises (from any method):
        StoreError: the server or the connection failed.
        ConfigurationError: asyncpg is missing, the password is wrong or the database is unknown.
    """

    def __init__(self, dsn: str, *, embed: Embed | None = None, min_size: int = 1, max_size: int = 4,
                 vector_scan: int = 2000) -> None:
        super().__init__(embed=embed, vector_scan=vector_scan)
        self.dsn = dsn
        self.location = redact_dsn(dsn)
        self._secrets = _passwords(dsn)
        self.min_size, self.max_size = min_size, max_size
        self._pool: Any = None
        self._catch: tuple[type[BaseException], ...] = (OSError,)

    def __repr__(self) -> str:
        return f"PostgresEpisodeStore({self.location!r})"

    def _error(self, operation: str, exc: BaseException) -> StoreError:
        root = _root(exc)
        cause = f"{type(root).__name__}: {root}"
        state = getattr(root, "sqlstate", None)
        if state:
            cause += f" (SQLSTATE {state})"
        for secret in self._secrets:
            cause = cause.replace(secret, "***")
        return StoreError(self.location, f"memory {operation}", cause, transient=is_transient(root))

    async def _call(self, operation: str, fn: Any) -> Any:
        pool = await self.pool()
        try:
            return await fn(pool)
        except self._catch as exc:
            raise self._error(operation, exc) from exc

    async def pool(self) -> Any:
        """The connection pool (connects and migrates on first use)."""
        if self._pool is None:
            try:
                import asyncpg  # type: ignore[import-untyped]
            except ImportError:
                raise ConfigurationError("PostgresEpisodeStore needs asyncpg: pip install 'fsm-agent[postgres]'") \
                    from None
            self._catch = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)
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
            except ValueError as exc:
                raise ConfigurationError(f"invalid PostgreSQL DSN {self.location}: {exc}") from None
            try:
                await self._migrate(pool)
            except BaseException:
                pool.terminate()
                raise
            self._pool = pool
        return self._pool

    async def _migrate(self, pool: Any) -> int:
        try:
            if (await pool.fetchval("SELECT to_regclass('memory_migrations') IS NOT NULL") and
                    await pool.fetchval("SELECT COALESCE(MAX(version), 0) FROM memory_migrations") >= len(MIGRATIONS)):
                return len(MIGRATIONS)
            async with pool.acquire() as con, con.transaction():
                await con.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_ID)
                await con.execute("CREATE TABLE IF NOT EXISTS memory_migrations (version INTEGER PRIMARY KEY, "
                                  "applied_at DOUBLE PRECISION NOT NULL)")
                have = await con.fetchval("SELECT COALESCE(MAX(version), 0) FROM memory_migrations")
                for version, script in enumerate(MIGRATIONS, 1):
                    if version > have:
                        await con.execute(script)
                        await con.execute("INSERT INTO memory_migrations VALUES ($1, extract(epoch from now()))",
                                          version)
        except self._catch as exc:
            raise self._error("migrate", exc) from exc
        return len(MIGRATIONS)

    async def schema_version(self) -> int:
        """The version of the episode tables in this database."""
        return int(await self._call("schema_version",
                                    lambda p: p.fetchval("SELECT COALESCE(MAX(version), 0) FROM memory_migrations")))

    @staticmethod
    def _episode(row: Any) -> Episode:
        data = row[0]
        ep: Episode = structure(orjson.loads(data) if isinstance(data, (str, bytes)) else data, Episode)
        return evolve(ep, created_at=row[1], updated_at=row[2])

    async def _save(self, episode: Episode, vector: list[float] | None) -> Episode:
        fields: list[Any] = []
        for text in episode.fields_text():
            t = search_terms(text)
            fields += [" ".join(t.words), list(dict.fromkeys(t.grams))]
        data = orjson.dumps(unstructure(episode)).decode()
        sql = ("INSERT INTO episodes (episode_id, tenant, session_id, outcome, data, embedding, created_at, updated_at, "
               f"terms) VALUES ($1,$2,$3,$4,$5::jsonb,$6,$7,$8,{_TERMS}) ON CONFLICT (episode_id) DO UPDATE SET "
               "session_id=EXCLUDED.session_id, outcome=EXCLUDED.outcome, data=EXCLUDED.data, "
               "embedding=EXCLUDED.embedding, updated_at=EXCLUDED.updated_at, terms=EXCLUDED.terms "
               "WHERE episodes.tenant = EXCLUDED.tenant RETURNING created_at")
        created = await self._call("save", lambda p: p.fetchval(
            sql, episode.episode_id, episode.tenant, episode.session_id, episode.outcome, data, vector,
            episode.created_at or episode.updated_at, episode.updated_at, *fields))
        if created is None:
            raise ConfigurationError(f"episode {episode.episode_id!r} belongs to another tenant; an episode id "
                                     "is unique across tenants")
        return evolve(episode, created_at=created)  # reads take the times from their columns

    async def _text_search(self, tenant: str, terms: SearchTerms, limit: int, exclude: tuple[str, ...]
                           ) -> list[EpisodeHit]:
        args: list[Any] = [tenant, list(exclude), limit]
        parts = []
        if terms.words:  # stemmed and stop-worded by the english configuration
            args.append(" | ".join(_lexeme(w) for w in terms.words))
            parts.append(f"to_tsquery('english', ${len(args)})")
        if terms.grams:  # CJK pairs, as stored
            args.append(" | ".join(_lexeme(g) for g in terms.grams))
            parts.append(f"${len(args)}::tsquery")
        sql = (f"SELECT {_COLS}, ts_rank(terms, q, 1) AS score FROM episodes, (SELECT {' || '.join(parts)} AS q) AS qq "
               "WHERE tenant = $1 AND terms @@ q AND NOT (episode_id = ANY($2::text[])) "
               "ORDER BY score DESC, updated_at DESC LIMIT $3")
        rows = await self._call("search", lambda p: p.fetch(sql, *args))
        return [EpisodeHit(self._episode(r), round(float(r[3]), 9)) for r in rows]

    async def _vectors(self, tenant: str, limit: int, exclude: tuple[str, ...]) -> list[tuple[Episode, list[float]]]:
        rows = await self._call("search", lambda p: p.fetch(
            f"SELECT {_COLS}, embedding FROM episodes WHERE tenant=$1 AND embedding IS NOT NULL "
            "AND NOT (episode_id = ANY($2::text[])) ORDER BY updated_at DESC LIMIT $3", tenant, list(exclude), limit))
        return [(self._episode(r), list(r[3])) for r in rows]

    async def _get(self, episode_id: str, tenant: str | None) -> Episode | None:
        row = await self._call("get", lambda p: p.fetchrow(
            f"SELECT {_COLS} FROM episodes WHERE episode_id=$1 AND ($2::text IS NULL OR tenant=$2)",
            episode_id, tenant))
        return self._episode(row) if row else None

    async def _list(self, tenant: str | None, limit: int) -> list[Episode]:
        rows = await self._call("list", lambda p: p.fetch(
            f"SELECT {_COLS} FROM episodes WHERE ($1::text IS NULL OR tenant=$1) "
            "ORDER BY updated_at DESC, episode_id LIMIT $2", tenant, limit))
        return [self._episode(r) for r in rows]

    async def _delete(self, episode_id: str, tenant: str | None) -> bool:
        done = await self._call("delete", lambda p: p.execute(
            "DELETE FROM episodes WHERE episode_id=$1 AND ($2::text IS NULL OR tenant=$2)", episode_id, tenant))
        return bool(done.endswith(" 1"))

    async def _delete_tenant(self, tenant: str) -> int:
        done = await self._call("delete", lambda p: p.execute("DELETE FROM episodes WHERE tenant=$1", tenant))
        return int(done.rsplit(" ", 1)[-1])

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()
