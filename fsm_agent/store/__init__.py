"""Session stores: the event log, checkpoints, the tool-call ledger, controls and leases."""

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
from .memory import MemoryStore
from .sessions import LoadedSession, descendants, load_session, read_turns, send_control, upgrade_checkpoint, upgrade_event
from .sqlite import SQLiteStore

__all__ = [
    "Checkpoint",
    "ControlKind",
    "ControlRecord",
    "EventRecord",
    "LeaseLost",
    "LedgerEntry",
    "LedgerStatus",
    "LinkKind",
    "LoadedSession",
    "MemoryStore",
    "PostgresStore",
    "QUEUED",
    "SCHEMA_VERSION",
    "SQLiteStore",
    "SessionLink",
    "SessionRecord",
    "Store",
    "WriteBatch",
    "descendants",
    "load_session",
    "read_turns",
    "send_control",
    "upgrade_checkpoint",
    "upgrade_event",
]


def __getattr__(name: str) -> object:
    if name == "PostgresStore":  # asyncpg is optional: import it only when asked for
        from .postgres import PostgresStore

        return PostgresStore
    raise AttributeError(name)
