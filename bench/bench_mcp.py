"""MCP tools: what the fsm_agent adapter costs over the official SDK, per transport.

For each transport (in process, stdio, Streamable HTTP to a server in its own process) the script
measures, in alternating rounds:

* **connect**: ``MCPToolset.connect()`` (start or reach the server, handshake, list the tools)
  against the SDK's ``async with Client(...)`` plus one ``list_tools()``: the floor;
* **call**: one ``add`` call through fsm_agent (``execute_tool_call``: our schema check, the
  ToolContext, the content mapping, the error path) against the same call made with
  ``client.call_tool`` on the same session: the difference is the adapter's overhead per call.

The server is the tests' ``MCPServer`` (tests/orchestration/mcp_server.py).

and, through a whole agent run (a scripted model calling ``add`` 20 times, one call per turn), the
time per call with the MCP tool against the same run with a local ``add`` tool, in fsm_agent and in
pydantic-ai (its ``MCPToolset``, over fastmcp; measured when ``pydantic-ai-slim[mcp]`` is
installed, reported ABSENT otherwise). The difference is what an MCP tool costs a runtime beyond a
local one, transport included.

    .venv/bin/python bench/bench_mcp.py            # 7 rounds × 200 calls, 5 connects per transport
    .venv/bin/python bench/bench_mcp.py --quick    # 3 rounds × 50 calls, 2 connects
    /work/bench-venv/bin/python bench/bench_mcp.py # with the pydantic-ai peer (needs pydantic-ai-slim[mcp], mcp 2.x)
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "orchestration"))

from _common import machine, median, source, table, versions, write_results  # noqa: E402
from mcp import Client  # noqa: E402
from mcp_server import build_server  # noqa: E402

from fsm_agent import ToolRegistry  # noqa: E402
from fsm_agent.orchestration.mcp import mcp_tools  # noqa: E402
from fsm_agent.tools import execute_tool_call  # noqa: E402
from fsm_agent.types import ToolUseBlock  # noqa: E402

SERVER = str(REPO / "tests" / "orchestration" / "mcp_server.py")


async def http_server() -> tuple[str, asyncio.subprocess.Process]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    proc = await asyncio.create_subprocess_exec(sys.executable, SERVER, "--http-fd", str(sock.fileno()),
                                                pass_fds=(sock.fileno(),))
    sock.close()
    return url, proc


def target(kind: str, url: str) -> Any:
    if kind == "in_process":
        return build_server()[0]
    if kind == "stdio":
        return [sys.executable, SERVER]
    return url


def sdk_target(kind: str, url: str) -> Any:
    from mcp import StdioServerParameters

    t = target(kind, url)
    return StdioServerParameters(command=t[0], args=t[1:]) if kind == "stdio" else t


async def connect_times(kind: str, url: str, n: int) -> tuple[list[float], list[float]]:
    ours, floor = [], []
    for i in range(n):
        for which in (("ours", "sdk") if i % 2 == 0 else ("sdk", "ours")):
            started = time.perf_counter()
            if which == "ours":
                async with mcp_tools(target(kind, url)) as ts:
                    assert len(ts) > 0
                    ours.append(time.perf_counter() - started)
            else:
                async with Client(sdk_target(kind, url)) as client:
                    assert (await client.list_tools()).tools
                    floor.append(time.perf_counter() - started)
    return ours, floor


async def call_times(kind: str, url: str, rounds: int, calls: int) -> tuple[list[float], list[float]]:
    """Median seconds per call, per round: (through fsm_agent, the SDK's call_tool), on one session."""
    ours, floor = [], []
    async with mcp_tools(target(kind, url)) as ts:
        registry = ToolRegistry(ts)
        client = ts.client
        for i in range(5):  # warm-up
            await execute_tool_call(ToolUseBlock(f"w{i}", "add", {"a": i, "b": 1}), registry)
        for r in range(rounds):
            for which in (("ours", "sdk") if r % 2 == 0 else ("sdk", "ours")):
                samples = []
                for i in range(calls):
                    started = time.perf_counter()
                    if which == "ours":
                        res = await execute_tool_call(ToolUseBlock(f"c{i}", "add", {"a": i, "b": 1}), registry,
                                                      session_id="bench")
                        assert res.text == str(i + 1), res
                    else:
                        out = await client.call_tool("add", {"a": i, "b": 1})
                        assert not out.is_error
                    samples.append(time.perf_counter() - started)
                (ours if which == "ours" else floor).append(median(samples))
    return ours, floor


# -- through an agent: fsm_agent and pydantic-ai, MCP tool against a local tool ---------------------

AGENT_CALLS = 20
"""Tool calls per agent run (one per model turn)."""


def fsm_agent_run(tools: list[Any]) -> Any:
    """An fsm_agent run whose scripted model calls ``add`` AGENT_CALLS times, one call per turn."""
    from fsm_agent import Agent, ScriptedProvider, ToolResultMessage
    from fsm_agent.providers import text_response, tool_call_response

    def next_turn(request: Any) -> Any:
        n = sum(isinstance(m, ToolResultMessage) for m in request.messages)
        return tool_call_response(("add", {"a": n, "b": 1})) if n < AGENT_CALLS else text_response(f"done {n}")

    async def run() -> str:
        agent = Agent(ScriptedProvider([next_turn], repeat_last=True), tools=tools)
        result = await agent.run("go", max_iterations=AGENT_CALLS + 5)
        return str(result.output)

    return run


def pydantic_ai_run(toolsets: list[Any], tools: list[Any]) -> Any:
    """The same run in pydantic-ai: a FunctionModel calling ``add`` AGENT_CALLS times."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import FunctionModel

    def next_turn(messages: list[Any], info: Any) -> Any:
        n = sum(isinstance(p, ToolReturnPart) for m in messages for p in getattr(m, "parts", []))
        if n < AGENT_CALLS:
            return ModelResponse(parts=[ToolCallPart("add", {"a": n, "b": 1})])
        return ModelResponse(parts=[TextPart(f"done {n}")])

    from pydantic_ai import Tool as PaiTool

    agent = Agent(FunctionModel(next_turn), toolsets=toolsets, tools=[PaiTool(t, name="add") for t in tools])

    async def run() -> str:
        return str((await agent.run("go")).output)

    return run


def local_add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def agent_times(kind: str, url: str, rounds: int) -> dict[str, Any]:
    """Median µs per tool call of a whole agent run, per runtime: with the MCP ``add``, with a local
    ``add``, and the difference (what the MCP tool costs that a local tool does not)."""
    from fsm_agent import tool

    out: dict[str, Any] = {}
    async with mcp_tools(target(kind, url)) as ts:
        runners: dict[str, tuple[Any, Any]] = {
            "fsm_agent": (fsm_agent_run([ts["add"]]), fsm_agent_run([tool(local_add, name="add")]))}
        peer_cm: Any = None
        try:
            from pydantic_ai.mcp import MCPToolset as PaiMCPToolset

            peer_cm = PaiMCPToolset(Path(SERVER) if kind == "stdio" else url, include_instructions=False)
            await peer_cm.__aenter__()
            runners["pydantic-ai"] = (pydantic_ai_run([peer_cm.filtered(lambda ctx, t: t.name == "add")], []),
                                      pydantic_ai_run([], [local_add]))
        except ImportError as exc:
            out["pydantic-ai"] = f"ABSENT: {exc}"
        try:
            for name, (mcp_run, local_run) in runners.items():
                assert await mcp_run() == await local_run() == f"done {AGENT_CALLS}"  # warm-up, and the same work
                mcp_s, local_s = [], []
                for r in range(rounds):
                    for which in (("mcp", "local") if r % 2 == 0 else ("local", "mcp")):
                        started = time.perf_counter()
                        await (mcp_run if which == "mcp" else local_run)()
                        (mcp_s if which == "mcp" else local_s).append((time.perf_counter() - started) / AGENT_CALLS)
                out[name] = {"mcp_s_per_call": mcp_s, "local_s_per_call": local_s}
        finally:
            if peer_cm is not None:
                await peer_cm.__aexit__(None, None, None)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, calls, connects = (3, 50, 2) if args.quick else (7, 200, 5)
    url, proc = await http_server()
    try:
        for _ in range(100):  # the HTTP server is up when a connect succeeds
            try:
                async with Client(url) as c:
                    await c.list_tools()
                break
            except Exception:  # noqa: BLE001 - not up yet
                await asyncio.sleep(0.1)
        rows_connect, rows_call, rows_agent, data = [], [], [], {}
        for kind in ("stdio", "http"):
            agents = await agent_times(kind, url, rounds)
            data[f"agent_{kind}"] = agents
            for name, figures in agents.items():
                if isinstance(figures, str):
                    rows_agent.append((kind, name, figures, "", ""))
                    continue
                m, loc = median(figures["mcp_s_per_call"]), median(figures["local_s_per_call"])
                rows_agent.append((kind, name, f"{m * 1e6:.0f}", f"{loc * 1e6:.0f}", f"{(m - loc) * 1e6:+.0f}"))
        for kind in ("in_process", "stdio", "http"):
            ours_c, floor_c = await connect_times(kind, url, connects)
            ours, floor = await call_times(kind, url, rounds, calls)
            data[kind] = {"connect_s": {"fsm_agent": ours_c, "sdk": floor_c},
                          "call_s_round_medians": {"fsm_agent": ours, "sdk": floor}}
            rows_connect.append((kind, f"{median(ours_c) * 1e3:.1f}", f"{median(floor_c) * 1e3:.1f}",
                                 f"{(median(ours_c) - median(floor_c)) * 1e3:+.1f}"))
            rows_call.append((kind, f"{median(ours) * 1e6:.0f}", f"{median(floor) * 1e6:.0f}",
                              f"{(median(ours) - median(floor)) * 1e6:+.0f}", f"{median(ours) / median(floor):.2f}"))
    finally:
        proc.kill()
        await proc.wait()
    print(table(["transport", "fsm_agent connect ms", "SDK connect+list ms", "difference ms"], rows_connect,
                title=f"Connect (median of {connects})"))
    print(table(["transport", "fsm_agent µs/call", "SDK call_tool µs/call", "overhead µs", "ratio"], rows_call,
                title=f"One `add` call (median of {rounds} round medians × {calls} calls)"))
    print(table(["transport", "runtime", "MCP add µs/call", "local add µs/call", "MCP − local µs"], rows_agent,
                title=f"A whole agent run, {AGENT_CALLS} tool calls (median of {rounds} rounds)"))
    path = write_results("bench_mcp", {"results": data, "rounds": rounds, "calls": calls, "connects": connects,
                                       "machine": machine(), "versions": versions(("fsm-agent", "mcp", "httpx2", "pydantic-ai-slim", "fastmcp-slim")),
                                       "source": source()})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
