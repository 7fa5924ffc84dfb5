"""Session stores: the event log, checkpoints, the tool-call ledger, controls and leases; and, beside
them, episode stores (episodic memory: :mod:`fsm_agent.store.episodes`)."""

from .base import (
    QUEUED,
    SCHEMA_VERSION,
    Checkpoint,
    ControlKind,
    ControlRecord,
    EventRecord,
    LeaseLost,
    LedgerEntry,
    LedgerStatus,
    LinkKind,
    SessionLink,
    SessionRecord,
    Store,
    WriteBatch,
)
from .episodes import Episode, EpisodeHit, EpisodeStep, EpisodeStore
from .episodes_open import open_episode_store
from .episodes_sqlite import SQLiteEpisodeStore
from .memory import MemoryStore
from .sessions import LoadedSession, descendants, load_session, read_turns, send_control, upgrade_checkpoint, upgrade_event
from .sqlite import SQLiteStore

__all__ = [
    "Checkpoint",
    "ControlKind",
    "ControlRecord",
    "Episode",
    "EpisodeHit",
    "EpisodeStep",
    "EpisodeStore",
    "EventRecord",
    "LeaseLost",
    "LedgerEntry",
    "LedgerStatus",
    "LinkKind",
    "LoadedSession",
    "MemoryStore",
    "PostgresEpisodeStore",
    "PostgresStore",
    "QUEUED",
    "SCHEMA_VERSION",
    "SQLiteEpisodeStore",
    "SQLiteStore",
    "SessionLink",
    "SessionRecord",
    "Store",
    "WriteBatch",
    "descendants",
    "load_session",
    "open_episode_store",
    "read_turns",
    "send_control",
    "upgrade_checkpoint",
    "upgrade_event",
]


def __getattr__(name: str) -> object:
    if name == "PostgresStore":  # asyncpg is optional: import it only when asked for
        from .postgres import PostgresStore

        return PostgresStore
    if name == "PostgresEpisodeStore":
        from .episodes_postgres import PostgresEpisodeStore

        return PostgresEpisodeStore
    raise AttributeError(name)
