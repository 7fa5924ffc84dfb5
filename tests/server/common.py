"""What the server tests share: a side-effect tool that counts its runs, an agent whose tool call
waits for approval, and a dump of every table of a SQLite store (to prove nothing changed)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsm_agent import ScriptedProvider, tool
from fsm_agent.agent import Agent
from fsm_agent.providers import tool_call_response
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.approval import DECISIONS, HumanApproval

RAN: list[str] = []
"""The ``to`` of every ``send_mail`` that ran (cleared around each test by ``conftest.py``)."""

TABLES = ("sessions", "events", "checkpoints", "ledger", "controls", "idempotency")


@tool(effect="side_effect")
async def send_mail(to: str) -> str:
    """Send a mail."""
    RAN.append(to)
    return f"sent to {to}"


def approval_agent(store: Any, calls: int = 1, *, allowed: Iterable[str] = DECISIONS,
                   repeat_last: bool = False) -> Agent:
    """The first model call asks for ``calls`` ``send_mail`` calls (ids ``c0``…, held for approval);
    the next answers "done" (every later one too with ``repeat_last``)."""
    script: list[Any] = [tool_call_response(*[ToolUseBlock(f"c{i}", "send_mail", {"to": f"a{i}@x"})
                                              for i in range(calls)]), "done"]
    return Agent(ScriptedProvider(script, repeat_last=repeat_last), tools=[send_mail],
                 middleware=[HumanApproval(["send_mail"], allowed_decisions=allowed)], store=store)


def dump(db: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table (the log payloads' bytes included), read with a connection of its own."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {t: sorted(con.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in TABLES}  # noqa: S608
    finally:
        con.close()
