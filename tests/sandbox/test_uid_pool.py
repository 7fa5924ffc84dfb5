"""The dedicated uids across sandbox objects, OS processes, crashes and cancellations, on the REAL
sandboxes as root: a uid runs one call at a time machine-wide (another fsm_agent process waits for
it instead of running beside it, reading its files and killing its processes); the leftovers of a
process that died mid-call are killed by the next taker instead of blocking the uid forever; a
second sandbox object starts while another runs on the same uids; a uid some other program uses is
still refused; a cancellation at any point leaves no work dir and frees the uid. Each test failed on
the code before the fix (the last only sometimes: the leak was a race).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsm_agent.sandbox import SandboxUnavailableError
from fsm_agent.sandbox._local import LocalSandbox
from fsm_agent.sandbox._uids import BUSY_UIDS, processes_of, try_lock

from .conftest import UIDS, build

Make = Callable[..., LocalSandbox]
REPO = str(Path(__file__).resolve().parents[2])


def one_uid(kind: str) -> tuple[int]:
    return (UIDS[3],) if kind == "bubblewrap" else (UIDS[6],)


def helper(kind: str, uid: int, workdir_root: Path, code: str) -> subprocess.Popen[str]:
    """Another fsm_agent process (this venv's python, this tree) running ``code`` in a sandbox of
    ``kind`` on ``uid``; it prints ``ready`` once its sandbox started, then the run's return value."""
    script = f"""
import asyncio, json, sys
from fsm_agent.sandbox import BubblewrapSandbox, SubprocessSandbox
async def main():
    cls = BubblewrapSandbox if {kind!r} == "bubblewrap" else SubprocessSandbox
    sb = cls(uids=[{uid}], workdir_root={str(workdir_root)!r})
    await sb.start()
    print("ready", flush=True)
    r = await sb.run({code!r}, timeout=30)
    print(json.dumps([r.ok, r.return_value, r.signal_name]), flush=True)
asyncio.run(main())
"""
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={"PATH": os.environ["PATH"], "PYTHONPATH": REPO})


async def wait_for(predicate: Callable[[], bool], seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def orphaned(uid: int) -> bool:
    """A process of ``uid`` runs in a session whose leader is gone (what a double fork leaves)."""
    pids = processes_of(uid)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                session = int(fh.read().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        if session not in pids:
            return True
    return False


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)  # reaps it and closes its pipes


SPAN = "import time\nstart = time.time()\ntime.sleep({})\n[start, time.time()]"


async def test_another_process_waits_for_a_uid_in_use(kind: str, reachable_dir: Path,
                                                      procs: list[subprocess.Popen[str]]) -> None:
    (uid,) = one_uid(kind)
    other = helper(kind, uid, reachable_dir, SPAN.format(2.0))
    procs.append(other)
    assert other.stdout is not None and other.stdout.readline().strip() == "ready"
    await wait_for(lambda: bool(processes_of(uid)))  # the other process's call runs as the uid now
    sb = build(kind, uids=[uid], workdir_root=reachable_dir)
    mine = await sb.run(SPAN.format(0))
    out, err = other.communicate(timeout=30)
    ok, (their_start, their_end), sig = json.loads(out)
    assert ok and sig is None, (out, err)  # the other call was neither killed nor disturbed
    my_start, _ = mine.return_value
    assert my_start >= their_end, "two calls ran as one uid at once"


async def test_a_crashed_callers_leftovers_are_killed_by_the_next_taker(kind: str, reachable_dir: Path,
                                                                       procs: list[subprocess.Popen[str]]) -> None:
    (uid,) = one_uid(kind)
    daemon = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            time.sleep(0.2)
    os._exit(0)
time.sleep(60)
"""
    other = helper(kind, uid, reachable_dir, daemon)
    procs.append(other)
    assert other.stdout is not None and other.stdout.readline().strip() == "ready"
    await wait_for(lambda: orphaned(uid))  # the grandchild runs, its session leader gone
    other.send_signal(signal.SIGKILL)  # the agent process dies mid-call
    other.wait(10)
    sb = build(kind, uids=[uid], workdir_root=reachable_dir)
    await sb.start()  # was: "uid ... is meant to be used by the sandbox alone" forever
    r = await sb.run("1 + 1")
    assert r.return_value == 2
    assert processes_of(uid) == []
    assert [p.name for p in reachable_dir.iterdir() if p.name.startswith("fsm-sandbox-")] == []  # its work dir too


async def test_a_uid_some_other_program_uses_is_refused(kind: str, reachable_dir: Path,
                                                      procs: list[subprocess.Popen[str]]) -> None:
    (uid,) = one_uid(kind)
    squatter = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                                 "sleep", "30"], text=True)
    procs.append(squatter)
    await wait_for(lambda: bool(processes_of(uid)))
    with pytest.raises(SandboxUnavailableError, match=f"uid {uid} is meant to be used by the {kind} sandbox alone"):
        await build(kind, uids=[uid], workdir_root=reachable_dir).start()
    assert squatter.poll() is None  # not killed: it is no leftover of a call


async def test_a_second_sandbox_starts_while_another_runs_on_its_uids(make: Make) -> None:
    first = make()
    pool = first.uids[:2]
    first = make(uids=pool)
    task = asyncio.ensure_future(first.run("import time\ntime.sleep(2)\n1"))
    await wait_for(lambda: any(processes_of(u) for u in pool))
    second = make(uids=pool)
    await second.start()  # skips the uid the first one's call holds
    r = await second.run("2")
    assert r.return_value == 2
    assert (await task).return_value == 1


async def test_cancelling_at_any_point_leaves_no_work_dir_and_frees_the_uid(make: Make, reachable_dir: Path) -> None:
    root = reachable_dir / "wd"
    root.mkdir()
    root.chmod(0o755)
    sb = make(workdir_root=root)
    await sb.start()
    for steps in range(14):  # cancel after 0, 1, 2 ... turns of the event loop: each point of the set-up
        task = asyncio.ensure_future(sb.run("import time\ntime.sleep(10)", files={"a/b.txt": "x"}))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert list(root.iterdir()) == [], f"a work dir was left after a cancel at step {steps}"
    for delay in (0.01, 0.05, 0.2):
        task = asyncio.ensure_future(sb.run("import time\ntime.sleep(10)"))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert list(root.iterdir()) == []
    daemons = "import os, time\nfor i in range(4):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(60)\ntime.sleep(60)"
    for delay in (0.0, 0.001, 0.01):  # cancelled again while the first cancellation cleans up
        task = asyncio.ensure_future(sb.run(daemons))
        await wait_for(lambda: sum(len(processes_of(u)) for u in sb.uids) >= 4)
        task.cancel()
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert list(root.iterdir()) == [] and not any(processes_of(u) for u in sb.uids)
    assert not BUSY_UIDS & set(sb.uids)
    for uid in sb.uids:  # every lock is free again, and says that no call runs
        slot = try_lock(uid)
        assert slot is not None and slot.previous is None
        slot.release()
    assert not any(processes_of(u) for u in sb.uids)
