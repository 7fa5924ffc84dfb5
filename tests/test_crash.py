"""Crash tests: a worker killed with SIGKILL at each point of a tool call's life, resumed in a new
process. The side-effecting tool counts its executions: zero duplicates, nothing lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "crash_worker.py"


def worker(*args: str, lease_ttl: float = 1.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CRASH_LEASE_TTL": str(lease_ttl)}
    return subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=120, env=env)


def effects(counter: Path) -> int:
    return len(counter.read_text().split()) if counter.exists() else 0


POINTS = [
    # (crash point, side effects when killed, what the resumed run sees)
    ("before_start", 0),
    ("after_start_before_effect", 0),
    ("after_effect", 1),
    ("after_completion_before_record", 1),
    ("after_ledger_completed", 1),
]


@pytest.mark.parametrize("point,effects_at_crash", POINTS)
def test_killed_worker_resumes_with_no_duplicate_side_effects(tmp_path: Path, point: str, effects_at_crash: int) -> None:
    db, counter = tmp_path / "s.db", tmp_path / "effects"
    crashed = worker(str(db), str(counter), "run", "s1", point, "reconcile")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert effects(counter) == effects_at_crash
    time.sleep(1.2)  # the dead worker's lease (1 s) expires
    resumed = worker(str(db), str(counter), "resume", "s1")
    assert resumed.returncode == 0, resumed.stderr
    out = json.loads(resumed.stdout)
    assert out["reason"] == "COMPLETED", out
    assert effects(counter) == 1  # exactly once, whatever the crash point
    assert out["tool_results"] == ["charged 10"]


@pytest.mark.parametrize("point", ["after_effect", "after_completion_before_record"])
def test_unknown_outcome_without_reconcile_asks_a_person(tmp_path: Path, point: str) -> None:
    db, counter = tmp_path / "s.db", tmp_path / "effects"
    crashed = worker(str(db), str(counter), "run", "s1", point, "no_reconcile")
    assert crashed.returncode == -signal.SIGKILL
    assert effects(counter) == 1
    time.sleep(1.2)
    waiting = json.loads(worker(str(db), str(counter), "resume", "s1").stdout)
    assert waiting["reason"] == "WAITING_HUMAN"
    assert waiting["pending"] == ["unknown_outcome"]
    assert "outcome of side-effect call(s) is unknown after a crash: charge(call_charge)" in waiting["detail"]
    assert effects(counter) == 1  # not silently re-run
    done = json.loads(worker(str(db), str(counter), "resume", "s1", "respond").stdout)
    assert done["reason"] == "COMPLETED" and done["tool_results"] == ["charged 10"]
    assert effects(counter) == 1


def test_crash_before_start_needs_no_reconcile(tmp_path: Path) -> None:
    db, counter = tmp_path / "s.db", tmp_path / "effects"
    assert worker(str(db), str(counter), "run", "s1", "before_start", "no_reconcile").returncode == -signal.SIGKILL
    time.sleep(1.2)
    out = json.loads(worker(str(db), str(counter), "resume", "s1").stdout)
    assert out["reason"] == "COMPLETED" and effects(counter) == 1


def test_a_live_lease_refuses_a_second_worker(tmp_path: Path) -> None:
    db, counter = tmp_path / "s.db", tmp_path / "effects"
    crashed = worker(str(db), str(counter), "run", "s1", "after_effect", "reconcile", lease_ttl=60)
    assert crashed.returncode == -signal.SIGKILL
    early = worker(str(db), str(counter), "resume", "s1")  # the dead worker's 60 s lease still holds
    assert early.returncode != 0 and "is being driven by worker" in early.stderr
