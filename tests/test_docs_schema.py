"""docs/schema.md names everything that is stored: every RunState field (a checkpoint is the whole
RunState), every ledger status, and every event type the runtime writes."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs
import pytest

from fsm_agent.machine.state import RunState
from fsm_agent.store import SCHEMA_VERSION, LedgerStatus
from fsm_agent.types import BudgetWarning, ModelRetry

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "schema.md").read_text()


def _written_event_types() -> set[str]:
    """The first argument of every ``<journal>.record("type", ...)`` call in fsm_agent."""
    found = set()
    for path in (ROOT / "fsm_agent").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "record"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                found.add(node.args[0].value)
    return found


def test_the_current_version_is_stated() -> None:
    assert f"records `{SCHEMA_VERSION}`" in DOC
    assert f"## Event types (version {SCHEMA_VERSION})" in DOC


@pytest.mark.parametrize("name", [f.name for f in attrs.fields(RunState)])
def test_every_run_state_field_is_listed(name: str) -> None:
    assert f"`{name}`" in DOC, f"RunState.{name} is checkpointed but docs/schema.md does not list it"


@pytest.mark.parametrize("status", [s.value for s in LedgerStatus])
def test_every_ledger_status_is_described(status: str) -> None:
    closed = LedgerStatus(status).final
    rows = [line for line in DOC.splitlines() if line.startswith(f"| `{status}` |")]
    assert len(rows) == 1, f"ledger status {status!r} has no row in docs/schema.md"
    assert rows[0].split("|")[2].strip() == ("yes" if closed else "no")


def test_every_event_type_written_is_in_the_table() -> None:
    types = _written_event_types() | {BudgetWarning.TAG, ModelRetry.TAG}
    assert {"transition", "turn", "model_call", "run_stopped"} <= types  # the walker finds them
    table = DOC.split("## Event types", 1)[1]
    missing = sorted(t for t in types if f"| `{t}` |" not in table)
    assert not missing, f"event types written but not documented in docs/schema.md: {missing}"
