"""Workers across hosts on PostgreSQL: two worker processes (``tests/pg_worker.py``, the
``fsm-agent worker`` handler) and two server replicas (``create_app`` with a ``QueueRunner``, in
this process, on two ports) over one throwaway database.

* A run driven by a worker reaches an SSE client of the other replica live: its events while
  the run is blocked in a tool, then the rest, each seq once; model deltas arrive live too.
* SIGKILL of a worker in the middle of a side-effecting tool: the other worker finishes the run;
  the effect happened once.
* The same approval POSTed to both replicas at once: the tool runs once.
* An interrupt POSTed to a replica stops the run a worker drives; SIGTERM to a worker interrupts
  its run and hands the job to the other worker.
* The LISTEN connection of a replica comes back after its backend is killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

import pg_worker  # noqa: E402

from fsm_agent.server import create_app  # noqa: E402
from fsm_agent.server.notify import Notifier  # noqa: E402
from fsm_agent.server.queue import QueueRunner  # noqa: E402
from fsm_agent.server.worker import STOP_REASON  # noqa: E402
from fsm_agent.store import EventRecord, PostgresStore, SessionRecord, WriteBatch  # noqa: E402

TIMEOUT = 30.0


class Workers:
    """Worker processes over one database; each effect or gate line names the pid that made it."""

    def __init__(self, dsn: str, workdir: Path) -> None:
        self.dsn, self.dir = dsn, workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, n: int = 2) -> None:
        env = {**os.environ, "PG_WORKER_LEASE_TTL": "1.0", "PYTHONUNBUFFERED": "1"}
        for i in range(n):
            log = open(self.dir / f"worker{i}.log", "wb")  # noqa: SIM115 - closed with the process
            self.procs.append(subprocess.Popen([sys.executable, str(TESTS / "pg_worker.py"), self.dsn, str(self.dir),
                                                "--concurrency", "2"], stdout=log, stderr=subprocess.STDOUT,
                                               cwd=TESTS, env=env))
            log.close()
        deadline = time.monotonic() + TIMEOUT
        for i in range(n):
            while b"fsm-agent worker " not in (self.dir / f"worker{i}.log").read_bytes():
                if self.procs[i].poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"worker {i} did not start:\n{self.logs()}")
                time.sleep(0.05)

    def by_pid(self, pid: int) -> subprocess.Popen[bytes]:
        return next(p for p in self.procs if p.pid == pid)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.dir.glob("worker*.log")))

    def lines(self, name: str) -> list[list[str]]:
        path = self.dir / name
        return [ln.split() for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Replica:
    """One server app over its own PostgresStore and QueueRunner, on its own port."""

    def __init__(self, dsn: str) -> None:
        self.store = PostgresStore(dsn)
        app = create_app(pg_worker.build(), self.store, runner=lambda agent, store: QueueRunner(store, ping=1.0),
                         heartbeat=1.0)
        self.client = TestClient(TestServer(app, host="127.0.0.1"))

    async def snapshot(self, sid: str) -> dict[str, Any]:
        async with self.client.get(f"/sessions/{sid}") as r:
            assert r.status == 200, await r.text()
            return await r.json()  # type: ignore[no-any-return]

    async def wait_for(self, sid: str, check: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        deadline = time.monotonic() + TIMEOUT
        snap: dict[str, Any] = {}
        while time.monotonic() < deadline:
            snap = await self.snapshot(sid)
            if check(snap):
                return snap
            await asyncio.sleep(0.05)
        raise AssertionError(f"session {sid}: {what} not reached in {TIMEOUT} s; last snapshot {snap}")

    async def wait_state(self, sid: str, state: str) -> dict[str, Any]:
        return await self.wait_for(sid, lambda s: s["state"] == state and not s["running"], f"{state}, not running")

    async def create(self, task: str) -> str:
        async with self.client.post("/sessions", json={"task": task}) as r:
            assert r.status == 201, await r.text()
            return (await r.json())["session_id"]  # type: ignore[no-any-return]


@pytest.fixture
def workers(postgres_dsn: str, tmp_path: Path) -> Any:
    asyncio.run(_migrate(postgres_dsn))  # once, before the processes race to it
    w = Workers(postgres_dsn, tmp_path)
    try:
        yield w
    finally:
        w.stop()


async def _migrate(dsn: str) -> None:
    s = PostgresStore(dsn)
    await s.migrate()
    await s.close()


@pytest.fixture
async def replicas(postgres_dsn: str, workers: Workers) -> AsyncIterator[tuple[Replica, Replica]]:
    a, b = Replica(postgres_dsn), Replica(postgres_dsn)
    await a.client.start_server()
    await b.client.start_server()
    try:
        yield a, b
    finally:
        for r in (a, b):
            await r.client.close()
            await r.store.close()


async def wait_until(check: Callable[[], bool], what: str, workers: Workers) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {TIMEOUT} s\n{workers.logs()}")
        await asyncio.sleep(0.05)


class SSE:
    """Reads an event stream in the background: ``frames`` is every (id, event, data) in order."""

    def __init__(self, client: TestClient, sid: str) -> None:
        self.frames: list[tuple[int | None, str, Any]] = []
        self.closed = asyncio.Event()
        self.task = asyncio.ensure_future(self._read(client, sid))

    async def _read(self, client: TestClient, sid: str) -> None:
        try:
            async with client.get(f"/sessions/{sid}/events") as r:
                assert r.status == 200, await r.text()
                fid: int | None = None
                event, data = "message", ""
                async for raw in r.content:
                    line = raw.decode().rstrip("\r\n")
                    if not line:
                        if data:
                            self.frames.append((fid, event, orjson.loads(data)))
                        fid, event, data = None, "message", ""
                    elif line.startswith("id:"):
                        fid = int(line[3:].strip())
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data += line[5:].strip()
        finally:
            self.closed.set()

    def events(self) -> list[tuple[int, str, Any]]:
        return [(i, e, d) for i, e, d in self.frames if i is not None]

    def deltas(self) -> list[Any]:
        return [d for i, e, d in self.frames if i is None and e == "delta"]


async def test_run_driven_by_a_worker_reaches_a_client_of_the_other_replica_live(replicas, workers):
    a, b = replicas
    workers.start()
    sid = await a.create("gate: wait, then answer")
    sse = SSE(b.client, sid)
    # the run is blocked in wait_gate until DIR/go exists: what the client has by then came live
    await wait_until(lambda: len(workers.lines("gate")) == 1, "the tool started", workers)
    await wait_until(lambda: any(e[2].get("payload", e[2]).get("status") == "started" for e in sse.events()
                                 if e[1] == "tool_call"), "the tool_call 'started' event on replica B", workers)
    before = len(sse.events())
    assert before >= 3
    (workers.dir / "go").touch()
    await asyncio.wait_for(sse.closed.wait(), TIMEOUT)
    seqs = [i for i, _e, _d in sse.events()]
    log = await b.store.read_events(sid)
    assert seqs == [ev.seq for ev in log] == list(range(1, len(log) + 1))  # every event once, in order
    assert len(seqs) > before
    assert log[-1].type == "run_stopped" and log[-1].payload["stop"]["reason"] == "COMPLETED"
    # the answer's deltas travelled worker -> NOTIFY fsm_live -> replica B (best effort: at least one)
    texts = [d["text"] for d in sse.deltas() if d["kind"] == "text"]
    assert texts and all(t in pg_worker.FINAL_TEXT for t in texts)
    assert (await b.snapshot(sid))["running"] is False
    assert await b.store.queued_runs() == []


async def test_sigkill_mid_tool_the_other_worker_finishes_without_a_duplicate_effect(replicas, workers):
    a, b = replicas
    workers.start()
    (workers.dir / "hold").touch()  # charge() waits after its effect while this exists
    sid = await a.create("charge the card")
    await wait_until(lambda: len(workers.lines("effects")) == 1, "the effect", workers)
    victim = workers.by_pid(int(workers.lines("effects")[0][1]))
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    (workers.dir / "hold").unlink()  # a second execution would not wait: it would only add a line
    snap = await b.wait_state(sid, "COMPLETED")
    assert len(workers.lines("effects")) == 1  # 0 duplicate side effects
    types = [ev.type for ev in await b.store.read_events(sid)]
    assert "recovered" in types
    assert snap["stop"]["reason"] == "COMPLETED"
    results = [ev.payload["message"] for ev in await b.store.read_events(sid, types=("message",))
               if ev.payload["message"].get("role") == "tool"]
    assert len(results) == 1 and "charged 10" in orjson.dumps(results[0]).decode()
    assert await b.store.queued_runs() == []
    survivor = next(p for p in workers.procs if p is not victim)
    assert survivor.poll() is None


async def test_the_same_approval_posted_to_both_replicas_at_once_runs_the_tool_once(replicas, workers):
    a, b = replicas
    workers.start()
    sid = await a.create("pay the invoice")
    snap = await b.wait_state(sid, "WAITING_HUMAN")
    assert [p["call"]["id"] for p in snap["pending_approvals"]] == ["call_pay"]

    async def approve(r: Replica) -> tuple[int, dict[str, Any]]:
        async with r.client.post(f"/sessions/{sid}/approvals/call_pay", json={"decision": "approve"}) as resp:
            return resp.status, await resp.json()

    answers = await asyncio.gather(approve(a), approve(b))
    assert sorted(s for s, _ in answers) == [200, 202], answers  # one accepted, one replay of it
    assert sum(bool(body.get("replayed")) for _, body in answers) == 1
    await b.wait_state(sid, "COMPLETED")
    assert len(workers.lines("effects")) == 1
    assert await a.store.queued_runs() == []


async def test_an_interrupt_posted_to_a_replica_stops_the_run_a_worker_drives(replicas, workers):
    a, b = replicas
    workers.start()
    sid = await a.create("gate: wait")
    await wait_until(lambda: len(workers.lines("gate")) == 1, "the tool started", workers)
    async with b.client.post(f"/sessions/{sid}/control", json={"kind": "interrupt"}) as r:
        assert r.status == 202, await r.text()
    snap = await a.wait_state(sid, "INTERRUPTED")
    assert snap["stop"]["reason"] == "INTERRUPTED"
    controls = [ev for ev in await a.store.read_events(sid, types=("control",))]
    assert [c.payload["kind"] for c in controls] == ["interrupt"]
    # and it resumes on a worker when asked through either replica
    (workers.dir / "go").touch()
    async with a.client.post(f"/sessions/{sid}/runs", json={}) as r:
        assert r.status == 202, await r.text()
    await b.wait_state(sid, "COMPLETED")


async def test_sigterm_interrupts_the_run_and_the_other_worker_continues_it(replicas, workers):
    a, b = replicas
    workers.start()
    sid = await a.create("gate: wait")
    await wait_until(lambda: len(workers.lines("gate")) == 1, "the tool started", workers)
    first = workers.by_pid(int(workers.lines("gate")[0][1]))
    first.send_signal(signal.SIGTERM)
    assert first.wait(TIMEOUT) == 0
    first_log = next(p for p in workers.dir.glob("worker*.log") if f":{first.pid}:" in p.read_text())
    assert "stopped after 0 job(s)" in first_log.read_text()  # it gave its job back
    await b.wait_state(sid, "COMPLETED")  # finished by the other worker
    stops = [ev.payload["stop"] for ev in await b.store.read_events(sid, types=("run_stopped",))]
    assert [s["reason"] for s in stops] == ["INTERRUPTED", "COMPLETED"]
    assert STOP_REASON in stops[0]["detail"] and stops[0]["resumable"]
    assert await b.store.queued_runs() == []


async def test_the_listen_connection_comes_back_and_wakes_every_watched_session(postgres_dsn):
    store = PostgresStore(postgres_dsn)
    notifier = Notifier()
    runner = QueueRunner(store, notifier, ping=0.2)
    await runner.start()
    try:
        await store.create_session(SessionRecord("s1", "IDLE", goal="g"))
        sub = notifier.subscribe("s1")
        await store.write(WriteBatch("s1", [EventRecord("s1", 1, "note", {})]))
        await asyncio.wait_for(sub.wake.wait(), TIMEOUT)
        pid = runner.listener._con.get_server_pid()
        sub.wake.clear()
        pool = await store.pool()
        assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
        await asyncio.wait_for(sub.wake.wait(), TIMEOUT)  # woken once the connection is back
        assert runner.listener.connections == 2
        sub.wake.clear()
        await store.write(WriteBatch("s1", [EventRecord("s1", 2, "note", {})]))
        await asyncio.wait_for(sub.wake.wait(), TIMEOUT)  # and commits are heard again
        assert await runner.busy("s1") is False
        notifier.unsubscribe(sub)
    finally:
        await runner.close()
        await store.close()


async def test_two_claimers_never_claim_the_same_job(postgres_dsn):
    one, two = PostgresStore(postgres_dsn), PostgresStore(postgres_dsn)
    try:
        jobs = {f"j{i}" for i in range(60)}
        for j in sorted(jobs):
            await one.enqueue_run(j, f"s{j}", "start", {"session_id": f"s{j}", "kind": "start"})

        async def drain(store: PostgresStore, owner: str) -> list[str]:
            got: list[str] = []
            while batch := await store.claim_runs(owner, 30.0, 3):
                got += [r.job_id for r in batch]
            return got

        a, b = await asyncio.gather(drain(one, "w1"), drain(two, "w2"))
        assert not set(a) & set(b)
        assert sorted(a + b) == sorted(jobs)
        assert all(r.attempts == 1 for r in await one.queued_runs())
    finally:
        await one.close()
        await two.close()


async def test_a_job_whose_session_another_worker_leases_waits_then_runs(postgres_dsn, caplog):
    import logging

    from fsm_agent.server.runs import RunRequest
    from fsm_agent.server.worker import Worker
    from fsm_agent.store import QUEUED

    caplog.set_level(logging.INFO, "fsm_agent.server")
    store = PostgresStore(postgres_dsn)
    worker = Worker(pg_worker.build(), store, concurrency=1, poll=0.1, busy_delay=0.2)
    await store.create_session(SessionRecord("s1", QUEUED, goal="hello"))
    assert await store.acquire_lease("s1", "another-host:1:x", 30.0)
    await QueueRunner(store, Notifier()).submit(RunRequest("s1", "start", task="hello"))
    running = asyncio.ensure_future(worker.run_forever())
    try:
        deadline = time.monotonic() + TIMEOUT
        while sum("s1 is busy" in r.getMessage() for r in caplog.records) < 2:
            assert time.monotonic() < deadline, "the worker never tried the job"
            await asyncio.sleep(0.05)
        [job] = await store.queued_runs("s1")
        assert job.attempts == 0  # a busy session does not use up attempts
        assert (await store.get_session("s1")).state == QUEUED
        await store.release_lease("s1", "another-host:1:x")
        while (await store.get_session("s1")).state != "COMPLETED" or await store.queued_runs():
            assert time.monotonic() < deadline, "the job did not run once the lease was free"
            await asyncio.sleep(0.05)
        assert worker.completed == 1
    finally:
        await worker.stop()
        await asyncio.wait_for(running, TIMEOUT)
        await store.close()


def test_worker_command_checks_its_arguments():
    import argparse

    from fsm_agent.errors import ConfigurationError
    from fsm_agent.cli.agent_ref import load_agent
    from fsm_agent.cli.worker import add_worker_command

    parser = argparse.ArgumentParser()
    add_worker_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["worker", "--store", "/tmp/x.db", "--agent", "pg_worker:build"])
    with pytest.raises(ConfigurationError, match="postgresql://"):
        args.handler(args, sys.stdout, sys.stderr)
    assert load_agent("pg_worker:build").tools.names
    for spec, message in [("pg_worker", "MODULE:ATTRIBUTE"), ("pg_worker:nope", "nope"),
                          ("no_such_module_x:a", "no_such_module_x"), ("pg_worker:FINAL_TEXT", "not an fsm_agent Agent")]:
        with pytest.raises(ConfigurationError, match=message):
            load_agent(spec)


async def test_each_committed_write_is_announced_and_a_refused_one_is_not(postgres_dsn):
    from fsm_agent.errors import LeaseLost

    store, quiet = PostgresStore(postgres_dsn), PostgresStore(postgres_dsn, notify=False)
    con = await store.connect()
    heard: list[str] = []
    await con.add_listener("fsm_events", lambda _c, _p, _ch, payload: heard.append(payload))
    try:
        await store.create_session(SessionRecord("a b", "IDLE", goal="g"))
        assert await store.acquire_lease("a b", "w1", 30.0)
        await store.write(WriteBatch("a b", [EventRecord("a b", 1, "note", {}), EventRecord("a b", 2, "note", {})],
                                     expected_owner="w1"))
        with pytest.raises(LeaseLost):  # rolled back: nothing announced
            await store.write(WriteBatch("a b", [EventRecord("a b", 3, "note", {})], expected_owner="w2"))
        await quiet.write(WriteBatch("a b", [EventRecord("a b", 3, "note", {})]))
        await store.write(WriteBatch("a b", [EventRecord("a b", 4, "note", {})]))
        deadline = time.monotonic() + TIMEOUT
        while len(heard) < 3:
            assert time.monotonic() < deadline, heard
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert heard == ["a b 0", "a b 2", "a b 4"]
    finally:
        await con.close()
        await store.close()
        await quiet.close()
