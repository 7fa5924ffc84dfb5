"""Session stores: the event log, checkpoints, the tool-call ledger, controls and leases."""

from .base import (
    SCHEMA_VERSION,
    Checkpoint,
    ControlKind,
    ControlRecord,
    EventRecord,
    LeaseLost,
    LedgerEntry,
    LedgerStatus,
    SessionRecord,
    Store,
    WriteBatch,
)
from .memory import MemoryStore
from .sqlite import SQLiteStore

__all__ = [
    "SCHEMA_VERSION",
    "Checkpoint",
    "ControlKind",
    "ControlRecord",
    "EventRecord",
    "LeaseLost",
    "LedgerEntry",
    "LedgerStatus",
    "MemoryStore",
    "PostgresStore",
    "SQLiteStore",
    "SessionRecord",
    "Store",
    "WriteBatch",
]


def __getattr__(name: str) -> object:
    if name == "PostgresStore":  # asyncpg is optional: import it only when asked for
        from .postgres import PostgresStore

        return PostgresStore
    raise AttributeError(name)
