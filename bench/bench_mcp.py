"""MCP tools: what the fsm_agent adapter costs over the official SDK, per transport.

For each transport (in process, stdio, Streamable HTTP to a server in its own process) the script
measures, in alternating rounds:

* **connect**: ``MCPToolset.connect()`` (start or reach the server, handshake, list the tools)
  against the SDK's ``async with Client(...)`` plus one ``list_tools()``: the floor;
* **call**: one ``add`` call through fsm_agent (``execute_tool_call``: our schema check, the
  ToolContext, the content mapping, the error path) against the same call made with
  ``client.call_tool`` on the same session: the difference is the adapter's overhead per call.

The server is the tests' ``MCPServer`` (tests/orchestration/mcp_server.py).

    .venv/bin/python bench/bench_mcp.py            # 7 rounds × 200 calls, 5 connects per transport
    .venv/bin/python bench/bench_mcp.py --quick    # 3 rounds × 50 calls, 2 connects
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
        rows_connect, rows_call, data = [], [], {}
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
    path = write_results("bench_mcp", {"results": data, "rounds": rounds, "calls": calls, "connects": connects,
                                       "machine": machine(), "versions": versions(("fsm-agent", "mcp", "httpx2")),
                                       "source": source()})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
