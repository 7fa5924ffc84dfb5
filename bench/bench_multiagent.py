"""Multi-agent patterns (issue 12): what a real boundary costs, and what bounded parallel workers buy.

**Boundary overhead** (a scripted, zero-latency model; SQLite and memory stores; no peers): a parent
run whose model makes N tool calls, one per turn, where the tool is (a) a plain async function
returning a fixed text, and (b) ``agent_tool`` over a sub-agent that answers in one model call. The
difference per call is what the boundary costs: a linked child session (link, session row, its
log, checkpoints and lease), its run through the machine, and the usage roll-up (a read of the
parent's ``usage_rolled_up`` events, a ``usage_rolled_up`` event). Alternating rounds, medians.

**Team fan-out** (scripted workers with a fixed 100 ms model latency): a leader splitting into 6
subtasks, with ``max_parallel`` 1, 2, 3 and 6; wall time of the whole team run against the ideal
``ceil(6 / max_parallel) x 100 ms`` (+ the leader's two calls).

    .venv/bin/python bench/bench_multiagent.py            # 7 rounds, N = 40
    .venv/bin/python bench/bench_multiagent.py --quick    # 3 rounds, N = 20
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _common import machine, median, table, versions, write_results  # noqa: E402

from fsm_agent import Agent, MemoryStore, ScriptedProvider, SQLiteStore, StopReason, tool  # noqa: E402
from fsm_agent.orchestration.subagent import agent_tool  # noqa: E402
from fsm_agent.orchestration.team import DISPATCH, Team  # noqa: E402
from fsm_agent.providers import text_response, tool_call_response  # noqa: E402
from fsm_agent.types import MessageRequest, ToolResultMessage  # noqa: E402


def _parent_script(n: int, name: str) -> Any:
    def answer(request: MessageRequest) -> Any:
        done = sum(isinstance(m, ToolResultMessage) for m in request.messages)
        return tool_call_response((name, {"task": f"part {done}"})) if done < n else text_response("all done")

    return answer


async def _run_boundary(kind: str, n: int, store_kind: str, tmp: Path, r: int) -> float:
    store: Any = SQLiteStore(tmp / f"{kind}-{store_kind}-{r}.db") if store_kind == "sqlite" else MemoryStore()
    try:
        if kind == "plain":
            @tool(name="helper")
            async def helper(task: str) -> str:
                """Help."""
                return "helped"

            the_tool: Any = helper
        else:
            child = Agent(ScriptedProvider(["helped"], repeat_last=True), store=store)
            the_tool = agent_tool(child, name="helper", description="Help.")
        parent = Agent(ScriptedProvider([_parent_script(n, "helper")], repeat_last=True), tools=[the_tool],
                       store=store)
        started = time.perf_counter()
        result = await parent.run("go", max_iterations=n + 2)
        took = time.perf_counter() - started
        assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
        assert [m.text for m in result.messages if m.role == "tool"] == ["helped"] * n
        return took / n
    finally:
        await store.close()


async def boundary(rounds: int, n: int) -> list[list[Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for store_kind in ("memory", "sqlite"):
            times: dict[str, list[float]] = {"plain": [], "agent": []}
            for r in range(rounds):
                for kind in (("plain", "agent") if r % 2 == 0 else ("agent", "plain")):
                    times[kind].append(await _run_boundary(kind, n, store_kind, tmp, r))
            plain, agent = median(times["plain"]) * 1000, median(times["agent"]) * 1000
            rows.append([store_kind, f"{plain:.2f}", f"{agent:.2f}", f"{agent - plain:.2f}"])
    return rows


async def fan_out(rounds: int) -> list[list[Any]]:
    rows = []
    latency, subtasks = 0.1, 6
    for parallel in (1, 2, 3, 6):
        times = []
        for _ in range(rounds):
            store = MemoryStore()
            leader = Agent(ScriptedProvider([tool_call_response((DISPATCH, {"subtasks": [
                {"task": f"part {i}"} for i in range(subtasks)]})), "merged"]), store=store)
            worker = Agent(ScriptedProvider(["done"], repeat_last=True, delay=latency), store=store)
            team = Team(leader, worker, max_workers=subtasks, max_parallel=parallel)
            started = time.perf_counter()
            result = await team.run("go")
            times.append(time.perf_counter() - started)
            assert result.stop.reason is StopReason.COMPLETED and len(result.workers) == subtasks
        ideal = math.ceil(subtasks / parallel) * latency
        rows.append([parallel, f"{median(times) * 1000:.0f}", f"{ideal * 1000:.0f}",
                     f"{(median(times) - ideal) * 1000:.0f}"])
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, n = (3, 20) if args.quick else (7, 40)
    b = await boundary(rounds, n)
    print(table(["store", "plain tool ms/call", "agent_tool ms/call", "boundary ms/call"], b,
                f"A child session per tool call (scripted, zero latency; N = {n}; median of {rounds} rounds)"))
    f = await fan_out(rounds)
    print(table(["max_parallel", "team wall ms", "ideal workers ms", "over ideal ms"], f,
                f"6 workers, 100 ms per worker model call (median of {rounds} rounds)"))
    write_results("multiagent", {"boundary": b, "fan_out": f, "rounds": rounds, "n": n, "machine": machine(),
                                 "versions": versions(("fsm-agent",))})


if __name__ == "__main__":
    asyncio.run(main())
