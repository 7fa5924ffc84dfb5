"""Fault matrix, part 1: a worker process killed with SIGKILL at every step of a tool call's ledger
life (approved, started, after the effect before ``completed`` is recorded, after ``completed``) ×
{approved by a person, no approval needed} × {pure, idempotent, side_effect} × {SQLite, PostgreSQL},
then resumed in a new process, against the strict server (tests/fault_scenarios.py)."""

from __future__ import annotations

import pytest

from fault_scenarios import APPROVALS, KILL_POINTS, kill_cell
from faults_common import EFFECTS
from fsm_agent.store import PostgresStore, SQLiteStore


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request, tmp_path):
    if request.param == "sqlite":
        path = str(tmp_path / "s.db")
        return path, lambda: SQLiteStore(path)
    dsn = request.getfixturevalue("postgres_dsn")
    return dsn, lambda: PostgresStore(dsn)


@pytest.mark.parametrize("effect", EFFECTS)
@pytest.mark.parametrize("approval", APPROVALS)
@pytest.mark.parametrize("point", KILL_POINTS)
async def test_sigkill_at_every_ledger_step_then_resume(backend, tmp_path, point: str, approval: str,
                                                        effect: str) -> None:
    url, make = backend
    fig = await kill_cell(make, url, tmp_path, effect, approval, point, "k1")
    assert fig["killed"], fig["worker_stderr"]
    assert fig["rejected"] == 0, fig["rejections"]
    assert fig["unanswered"] == 0 and fig["lies"] == 0, fig
    assert fig["duplicates"] == 0, fig  # a side effect happens exactly once, whatever the kill point
    assert fig["recovered"], fig
    if effect == "side_effect":
        assert fig["executions"] == 1, fig
        if point in ("started", "effect"):  # started, outcome unknown: a person is asked, never a silent re-run
            assert fig["stops"][-1] == "COMPLETED" and fig["decisions"] >= 1, fig
    else:  # pure / idempotent may run again (same idempotency key): at most once more
        assert fig["executions"] - fig["at_kill"] <= 1 and fig["reruns"] <= 1, fig
