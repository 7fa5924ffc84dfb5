"""Live deltas of a session on Temporal over PostgreSQL: the worker's model activity publishes each
streaming delta (``NOTIFY fsm_live``), the server (``serve`` with a TemporalHost agent) listens and
sends them on its SSE stream before the event that commits the answer; the workflow's history holds
none of them (the model_call activity's result is the final response only). ``fsm-agent worker
--temporal`` publishes them over a PostgreSQL store, and publishes none with ``--no-live-deltas``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from fsm_agent import Agent, ScriptedProvider
from fsm_agent.server.auth import Tenants
from fsm_agent.server.queue import PgLiveDeltas
from fsm_agent.server.serve import serve
from fsm_agent.store import PostgresStore
from fsm_agent.temporal import TemporalHost, create_worker
from tests.temporal.live_agent import ANSWER

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60.0


class Gated(ScriptedProvider):
    """Streams only once the test's SSE client is connected (so every delta has a watcher)."""

    def __init__(self, gate: asyncio.Event) -> None:
        super().__init__([ANSWER], stream_delay=0.02, chunk_chars=4)
        self.gate = gate

    async def chat_stream(self, request: Any) -> Any:  # type: ignore[override]
        await self.gate.wait()
        async for ev in super().chat_stream(request):
            yield ev


@contextlib.asynccontextmanager
async def serving(agent: Agent) -> AsyncIterator[str]:
    """``fsm-agent serve``'s function on a free loopback port; yields the base URL."""
    url: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(agent, port=0, tenants=Tenants(), ready=url.set_result))
    try:
        yield await asyncio.wait_for(asyncio.shield(url), TIMEOUT)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def read_sse(base: str, sid: str, frames: list[tuple[int | None, str, Any]], connected: asyncio.Event) -> None:
    """Every frame of ``GET /sessions/{sid}/events`` as (id, event, data), until the stream ends."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/sessions/{sid}/events") as r:
        assert r.status == 200, await r.text()
        connected.set()
        fid: int | None = None
        event, data = "message", ""
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if not line:
                if data:
                    frames.append((fid, event, orjson.loads(data)))
                fid, event, data = None, "message", ""
            elif line.startswith("id:"):
                fid = int(line[3:].strip())
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()


async def watch_a_run(base: str, sid: str, open_gate: Any) -> list[tuple[int | None, str, Any]]:
    """Start session ``sid`` on the server at ``base``, follow its event stream, ``open_gate()`` once
    the stream is connected; returns the stream's frames when it ends (the run stopped)."""
    async with aiohttp.ClientSession() as http, \
            http.post(f"{base}/sessions", json={"task": "capital of France?", "session_id": sid}) as r:
        assert r.status == 201, await r.text()
    frames: list[tuple[int | None, str, Any]] = []
    connected = asyncio.Event()
    reader = asyncio.ensure_future(read_sse(base, sid, frames, connected))
    await asyncio.wait_for(connected.wait(), TIMEOUT)
    open_gate()
    await asyncio.wait_for(reader, TIMEOUT)
    return frames


def history_payloads(history: Any) -> list[tuple[str, Any]]:
    """(event type, decoded JSON) of every payload in a workflow history."""
    out: list[tuple[str, Any]] = []

    def walk(kind: str, node: Any) -> None:
        if isinstance(node, dict):
            if "data" in node and "metadata" in node:
                out.append((kind, orjson.loads(base64.b64decode(node["data"]))))
                return
            for v in node.values():
                walk(kind, v)
        elif isinstance(node, list):
            for v in node:
                walk(kind, v)

    for ev in orjson.loads(history.to_json())["events"]:
        walk(ev["eventType"], ev)
    return out


async def run_watched(temporal_client: Any, task_queue: str, dsn: str, middleware: list[Any]) -> tuple[Any, Any, Any]:
    """One session of a worker agent (``middleware``, live deltas attached) in this process, served by
    ``serve`` over the same PostgreSQL database; returns (SSE frames, session log, workflow history)."""
    worker_store, server_store = PostgresStore(dsn), PostgresStore(dsn)
    gate = asyncio.Event()
    sid = "tl-" + uuid.uuid4().hex[:8]  # the dev server outlives the test: a workflow id of its own
    name = "tests.live:" + uuid.uuid4().hex[:6]
    worker_agent = Agent(Gated(gate), store=worker_store, middleware=middleware)
    live = PgLiveDeltas.attach(worker_agent, states=False)
    served = Agent(ScriptedProvider([]), store=server_store,
                   host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    try:
        async with create_worker(temporal_client, {name: worker_agent}, task_queue=task_queue), \
                serving(served) as base:
            frames = await watch_a_run(base, sid, gate.set)
        history = await temporal_client.get_workflow_handle(sid).fetch_history()
        log = await server_store.read_events(sid)
    finally:
        await live.aclose()
        await worker_store.close()
        await server_store.close()
    return frames, log, history


async def test_deltas_of_a_temporal_session_reach_the_sse_stream_live_and_never_the_history(
        temporal_client, task_queue, postgres_dsn) -> None:
    frames, log, history = await run_watched(temporal_client, task_queue, postgres_dsn, [])
    assert log[-1].type == "run_stopped" and log[-1].payload["stop"]["reason"] == "COMPLETED"
    assert [i for i, _e, _d in frames if i is not None] == [e.seq for e in log]  # every event once, in order
    deltas = [(at, d) for at, (i, e, d) in enumerate(frames) if i is None and e == "delta"]
    assert [d["text"] for _at, d in deltas] == [ANSWER[i:i + 4] for i in range(0, len(ANSWER), 4)]  # each chunk
    assert "".join(d["text"] for _at, d in deltas) == ANSWER
    assert {d["kind"] for _at, d in deltas} == {"text"}
    # all of them before the first event that holds the answer (the committed message)
    answer_at = next(at for at, (i, _e, d) in enumerate(frames) if i is not None and ANSWER in orjson.dumps(d).decode())
    assert deltas[-1][0] < answer_at
    # each one follows the last event committed before the model call (its basis), with no event between
    first, last = deltas[0][0], deltas[-1][0]
    assert all(i is None and e == "delta" for i, e, _d in frames[first:last + 1])
    assert frames[first - 1][0] is not None

    # the history: the model_call activity returned the final response only, no stream event anywhere
    payloads = history_payloads(history)
    results = [p for kind, p in payloads if kind == "EVENT_TYPE_ACTIVITY_TASK_COMPLETED"
               and isinstance(p, dict) and "response" in p]
    assert len(results) == 1
    assert sorted(results[0]) == ["response", "retries", "trace"]
    assert results[0]["retries"] == [] and results[0]["trace"] == [ANSWER]  # the streamed text in one piece
    assert ANSWER in orjson.dumps(results[0]["response"]).decode()
    text = orjson.dumps([p for _k, p in payloads]).decode()
    assert "event: delta" not in text and "text_delta" not in text
    assert all(f'"{d["text"]}"' not in text for _at, d in deltas)  # no delta stored on its own


@pytest.mark.parametrize("flag", ["", "--no-live-deltas"])
async def test_the_temporal_worker_command_publishes_deltas_over_postgresql_unless_told_not_to(
        temporal_client, temporal_target, task_queue, postgres_dsn, tmp_path, flag) -> None:
    agent_ref = "tests.temporal.live_agent:agent"
    sid = "tc-" + uuid.uuid4().hex[:8]  # the dev server outlives the test: a workflow id of its own
    gate = tmp_path / "gate"
    env = {**os.environ, "FSM_TEST_STORE": postgres_dsn, "FSM_TEST_GATE": str(gate), "PYTHONPATH": str(ROOT)}
    env.pop("FSM_AGENT_TEMPORAL", None)
    cmd = [sys.executable, "-m", "fsm_agent.cli", "worker", "--temporal", temporal_target, "--task-queue", task_queue,
           "--agent", agent_ref, *([flag] if flag else [])]
    worker = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    store = PostgresStore(postgres_dsn)
    try:
        assert worker.stderr is not None
        line = await asyncio.to_thread(worker.stderr.readline)
        assert f"worker serving {agent_ref}" in line, line
        assert ("live deltas by PostgreSQL NOTIFY" in line) is (not flag), line
        served = Agent(ScriptedProvider([]), store=store,
                       host=TemporalHost(temporal_client, agent_name=agent_ref, task_queue=task_queue))
        async with serving(served) as base:
            frames = await watch_a_run(base, sid, gate.touch)
        log = await store.read_events(sid)
    finally:
        worker.terminate()
        try:
            # it stops on SIGTERM; its exit status is not this test's subject: Temporal's Rust bridge
            # may crash the interpreter's finalization after a clean stop (temporalio/sdk-python#300,
            # seen with tests/temporal/test_cli.py too)
            await asyncio.to_thread(worker.wait, 20)
        finally:
            if worker.poll() is None:
                worker.kill()
            worker.stderr.close()  # type: ignore[union-attr]
            await store.close()
    assert log[-1].type == "run_stopped" and log[-1].payload["stop"]["reason"] == "COMPLETED"
    assert [i for i, _e, _d in frames if i is not None] == [e.seq for e in log]
    texts = [d["text"] for i, e, d in frames if i is None and e == "delta"]
    assert texts == ([] if flag else [ANSWER[i:i + 4] for i in range(0, len(ANSWER), 4)])


async def test_a_worker_whose_plugin_filters_stream_events_publishes_no_delta(
        temporal_client, task_queue, postgres_dsn) -> None:
    """The redaction rule: raw deltas would bypass the filter, so the activity sends none (the run
    above, without the plugin, shows that they would arrive)."""
    from fsm_agent_middleware.redaction import Redaction

    frames, log, _history = await run_watched(temporal_client, task_queue, postgres_dsn, [Redaction(literals=["Seine"])])
    assert log[-1].type == "run_stopped" and log[-1].payload["stop"]["reason"] == "COMPLETED"
    assert [i for i, _e, _d in frames if i is not None] == [e.seq for e in log]
    assert [d for i, e, d in frames if i is None and e == "delta"] == []
