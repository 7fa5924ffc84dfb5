"""Faults across processes, for each pattern: the process driving the parent and its children is
killed (SIGKILL) while a child is inside a side-effecting call, or the parent is interrupted through
the store from another process; a second process resumes the parent. Counted: the side effects
that happened (each at most once), the child sessions (one per call: none started twice), and the
children's model calls (none repeated)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from fsm_agent.store import ControlKind, SQLiteStore
from fsm_agent.store.sessions import descendants, send_control

WORKER = Path(__file__).parent / "multiagent_worker.py"
PATTERNS = ["agent_tool", "handoff", "team"]
CHILDREN = {"agent_tool": 1, "handoff": 1, "team": 2}


def _start(db: Path, work: Path, action: str, pattern: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(WORKER), str(db), str(work), action, pattern, "s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _wait_ready(proc: subprocess.Popen[bytes], work: Path, pattern: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    effects = work / "effects"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the worker ended early: {proc.communicate()}")
        ann_done = effects.exists() and "ann" in effects.read_text().split()
        if (work / "ready").exists() and ann_done:
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the worker never reached the send to bob")


def _finish(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> dict[str, object]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]
    return orjson.loads(out.decode().strip().splitlines()[-1])


async def _children_model_calls(db: Path) -> tuple[int, list[int]]:
    store = SQLiteStore(db)
    try:
        links = await descendants(store, "s")
        calls = [len(await store.read_events(x.child_id, types=("model_call",))) for x in links]
        return len(links), calls
    finally:
        await store.close()


@pytest.mark.parametrize("pattern", PATTERNS)
async def test_killed_mid_child_and_resumed_in_another_process_nothing_runs_twice(tmp_path: Path,
                                                                                    pattern: str) -> None:
    db = tmp_path / "s.db"
    first = _start(db, tmp_path, "run", pattern)
    _wait_ready(first, tmp_path, pattern)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=10)  # reaps it and closes its pipes
    time.sleep(1.7)  # the dead worker's leases (1.5 s) run out
    (tmp_path / "ready").unlink()
    second = _finish(_start(db, tmp_path, "resume", pattern))
    assert second["stop"] == "COMPLETED", second
    assert sorted((tmp_path / "effects").read_text().split()) == ["ann", "bob"]  # each side effect once
    children, calls = await _children_model_calls(db)
    assert children == CHILDREN[pattern]  # the resume found its children: none was started twice
    assert calls == ([3] if pattern != "team" else [2, 2])  # no model call of a child repeated


@pytest.mark.parametrize("pattern", PATTERNS)
async def test_an_interrupt_sent_from_another_process_stops_the_children_and_a_resume_finishes(
        tmp_path: Path, pattern: str) -> None:
    db = tmp_path / "s.db"
    first = _start(db, tmp_path, "run", pattern)
    _wait_ready(first, tmp_path, pattern)
    store = SQLiteStore(db)
    try:
        await send_control(store, "s", ControlKind.INTERRUPT, "ops wants a pause")
        stopped = _finish(first)
        assert stopped["stop"] == "INTERRUPTED", stopped
        states = {x.child_id: (await store.get_session(x.child_id)).state for x in await descendants(store, "s")}
    finally:
        await store.close()
    assert "INTERRUPTED" in states.values()  # the child working on bob was cut with its parent
    (tmp_path / "ready").unlink()
    second = _finish(_start(db, tmp_path, "resume", pattern))
    assert second["stop"] == "COMPLETED", second
    # the send to bob was cut before it happened: outcome unknown, never run again; ann's happened once
    assert (tmp_path / "effects").read_text().split() == ["ann"]
    children, calls = await _children_model_calls(db)
    assert children == CHILDREN[pattern]
    assert calls == ([3] if pattern != "team" else [2, 2])
