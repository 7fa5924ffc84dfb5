"""A2A (issue 12): what fsm_agent's A2A client and server cost against the official ``a2a-sdk``.

In alternating rounds, on loopback TCP, the same streamed task (``echo ...``: three artifact chunks
and COMPLETED, or a scripted one-line answer on our side):

* **client**: fsm_agent's ``A2AClient.stream_message`` against the SDK's own client
  (``send_message``, streaming), both against one server built with the SDK (uvicorn in a thread):
  the time from the request to the final frame, per task;
* **server**: the SDK's client against fsm_agent's server (a real governed run per task: a
  session, the log, the checkpoint, on the memory store, a ScriptedProvider model) against the same
  client to the SDK's server (its executor does no work); each server in a thread with its own
  event loop: the price of a governed, logged, resumable task behind A2A;
* **replay**: ``SubscribeToTask`` with ``Last-Event-ID: 0`` of a finished 200-step task on
  fsm_agent's server: frames per second and µs per frame (reading the log, mapping, encoding,
  writing, and the client's read).

    .venv/bin/python bench/bench_a2a.py            # 7 rounds × 40 tasks, 5 replays
    .venv/bin/python bench/bench_a2a.py --quick    # 3 rounds × 15 tasks, 2 replays
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import aiohttp  # noqa: E402
from _common import machine, median, source, table, versions, write_results  # noqa: E402
from a2a_peers import Live, SdkExecutor, sdk_server, sse_frames, user_message  # noqa: E402

from fsm_agent import Agent, ScriptedProvider, tool  # noqa: E402
from fsm_agent.orchestration.a2a import A2AClient  # noqa: E402
from fsm_agent.providers import tool_call_response  # noqa: E402
from fsm_agent.server import create_app  # noqa: E402
from fsm_agent.server.a2a import A2AConfig, add_a2a_routes  # noqa: E402
from fsm_agent.server.auth import Tenants  # noqa: E402
from fsm_agent.store import MemoryStore  # noqa: E402
from fsm_agent.types import ToolResultMessage  # noqa: E402


@tool
def step(n: int) -> str:
    """One step."""
    return f"step {n}"


def our_server(steps: int = 0) -> Live:
    def answer(request: Any) -> Any:
        done = sum(isinstance(m, ToolResultMessage) for m in request.messages)
        return tool_call_response(("step", {"n": done})) if done < steps else "echo: a benchmark task"

    from fsm_agent import RunConfig

    agent = Agent(ScriptedProvider([answer], repeat_last=True), tools=[step], store=MemoryStore(),
                  config=RunConfig(max_iterations=steps + 5))
    app = create_app(agent, tenants=Tenants(), live_deltas=False)
    add_a2a_routes(app, A2AConfig(name="bench", description="benchmark agent"))
    return Live(app)


async def sdk_client_task(client: Any, n: int) -> float:
    from a2a.types import a2a_pb2 as p

    req = p.SendMessageRequest(message=p.Message(message_id=f"sdk-{n}-{time.perf_counter_ns()}", role=p.ROLE_USER,
                                                 parts=[p.Part(text="echo a benchmark task")]))
    started = time.perf_counter()
    last = None
    async for ev in client.send_message(req):
        last = ev
    assert last is not None and last.status_update.status.state == p.TASK_STATE_COMPLETED, last
    return time.perf_counter() - started


async def our_client_task(client: A2AClient, n: int) -> float:
    started = time.perf_counter()
    events = [ev async for ev in client.stream_message(user_message("echo a benchmark task",
                                                                    f"ours-{n}-{time.perf_counter_ns()}"))]
    assert events[-1].data["status"]["state"] == "TASK_STATE_COMPLETED", events[-1]
    return time.perf_counter() - started


async def client_rounds(base: str, rounds: int, tasks: int) -> dict[str, list[float]]:
    from a2a.client import ClientConfig, create_client

    sdk = await create_client(base, client_config=ClientConfig(streaming=True))
    out: dict[str, list[float]] = {"fsm_agent": [], "sdk": []}
    async with A2AClient(base) as ours:
        for i in range(5):  # warm-up
            await our_client_task(ours, -i - 1)
            await sdk_client_task(sdk, -i - 1)
        for r in range(rounds):
            for which in (("fsm_agent", "sdk") if r % 2 == 0 else ("sdk", "fsm_agent")):
                samples = [await (our_client_task(ours, i) if which == "fsm_agent" else sdk_client_task(sdk, i))
                           for i in range(tasks)]
                out[which].append(median(samples))
    await sdk.close()
    return out


class Threaded:
    """Our server in a thread with its own event loop, as the SDK's runs under uvicorn: the client
    in the main loop reaches both across a thread."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.base = ""
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        async with our_server() as live:
            self.base = live.base
            self.ready.set()
            await self.stop.wait()

    def __enter__(self) -> Threaded:
        self.thread.start()
        self.ready.wait(20)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.loop is not None and self.stop is not None
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


async def server_rounds(sdk_base: str, rounds: int, tasks: int) -> dict[str, list[float]]:
    from a2a.client import ClientConfig, create_client

    out: dict[str, list[float]] = {"fsm_agent": [], "sdk": []}
    with Threaded() as live:
        ours = await create_client(live.base, client_config=ClientConfig(streaming=True))
        theirs = await create_client(sdk_base, client_config=ClientConfig(streaming=True))
        for i in range(5):
            await sdk_client_task(ours, -i - 1)
            await sdk_client_task(theirs, -i - 1)
        for r in range(rounds):
            for which in (("fsm_agent", "sdk") if r % 2 == 0 else ("sdk", "fsm_agent")):
                client = ours if which == "fsm_agent" else theirs
                out[which].append(median([await sdk_client_task(client, i) for i in range(tasks)]))
        await ours.close()
        await theirs.close()
    return out


async def replay(n: int, steps: int = 200) -> dict[str, Any]:
    async with our_server(steps) as live, aiohttp.ClientSession() as cs:
        async with A2AClient(live.base) as client:
            events = [ev async for ev in client.stream_message(user_message("go", "replay-1"))]
        tid = events[0].data["id"]
        times, frames = [], 0
        for _ in range(n):
            started = time.perf_counter()
            got = await sse_frames(cs, live.rpc_url, "SubscribeToTask", {"id": tid}, headers={"Last-Event-ID": "0"})
            times.append(time.perf_counter() - started)
            frames = len(got)
        return {"frames": frames, "seconds": times}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, tasks, replays = (3, 15, 2) if args.quick else (7, 40, 5)
    ex = SdkExecutor()
    with sdk_server(ex) as base:
        client = await client_rounds(base, rounds, tasks)
        server = await server_rounds(base, rounds, tasks)
    rep = await replay(replays)
    rows = [
        ("client: stream one task from the SDK's server", f"{median(client['fsm_agent']) * 1e3:.2f}",
         f"{median(client['sdk']) * 1e3:.2f}", f"{median(client['fsm_agent']) / median(client['sdk']):.2f}"),
        ("server: the SDK's client streams one task", f"{median(server['fsm_agent']) * 1e3:.2f}",
         f"{median(server['sdk']) * 1e3:.2f}", f"{median(server['fsm_agent']) / median(server['sdk']):.2f}"),
    ]
    print(table(["what", "fsm_agent ms/task", "a2a-sdk ms/task", "ratio"], rows,
                title=f"A2A, loopback (median of {rounds} round medians × {tasks} tasks)"))
    per = median(rep["seconds"]) / rep["frames"]
    print(table(["frames", "ms per replay", "frames/s", "µs/frame"],
                [(rep["frames"], f"{median(rep['seconds']) * 1e3:.1f}", f"{1 / per:,.0f}", f"{per * 1e6:.0f}")],
                title=f"SubscribeToTask replay (Last-Event-ID: 0) of a 200-step task, median of {replays}"))
    path = write_results("bench_a2a", {"client_s_round_medians": client, "server_s_round_medians": server,
                                       "replay": rep, "rounds": rounds, "tasks": tasks, "machine": machine(),
                                       "versions": versions(("fsm-agent", "a2a-sdk", "aiohttp", "httpx")),
                                       "source": source()})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
