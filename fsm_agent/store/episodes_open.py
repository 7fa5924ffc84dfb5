"""Where episodes are by default, and opening an episode store from a location (a SQLite path or a
``postgresql://`` DSN), as the CLI's ``--store`` names the session store."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigurationError
from .episodes import Embed, EpisodeStore
from .episodes_sqlite import SQLiteEpisodeStore

__all__ = ["default_location", "open_episode_store"]


def default_location() -> str:
    """``$FSM_AGENT_STORE``, else ``~/.fsm-agent/sessions.db`` (under ``$FSM_AGENT_HOME`` when set):
    where the CLI keeps sessions, so that episodes sit beside them."""
    loc = os.environ.get("FSM_AGENT_STORE")
    if loc:
        return loc
    return str(Path(os.environ.get("FSM_AGENT_HOME") or "~/.fsm-agent").expanduser() / "sessions.db")


def open_episode_store(location: str | Path | None = None, *, embed: Embed | None = None,
                       create: bool = True) -> EpisodeStore:
    """The episode store at ``location``: a SQLite file path, or a ``postgresql://`` DSN; ``None``:
    beside the CLI's session store (:func:`default_location`).

    Raises:
        ConfigurationError: ``create`` is false and there is no SQLite file there.
        StoreError: the SQLite file cannot be opened or migrated (PostgreSQL connects at first use).
    """
    loc = str(location) if location is not None else default_location()
    if loc.startswith(("postgres://", "postgresql://")):
        from .episodes_postgres import PostgresEpisodeStore  # imported when asked for, as PostgresStore is

        return PostgresEpisodeStore(loc, embed=embed)
    if not create and loc != ":memory:" and not loc.startswith("file:") and not Path(loc).is_file():
        raise ConfigurationError(f"no store at {loc}: check --store or $FSM_AGENT_STORE")
    return SQLiteEpisodeStore(loc, embed=embed)
