"""PlanAct (issue 12): what the plugin costs per node, and how often a small local model's plan is usable.

**Overhead** (a scripted, zero-latency model; no peers): an N-node plan run through ``PlanAct`` (a
programmatic check passes each node, no grader) against the same N model turns driven by a bare
PostTurn middleware that only appends the next instruction. Both write the same transcript shape to
the same store; the difference per node is PlanAct's own work: the plan note, the check, the
``plan_updated`` event with the whole plan, and the plan in every checkpoint. Also reported: the
bytes the plan adds to the last checkpoint and to the log.

**Planner on the local model** (``--local``; SmolLM2-135M on the embedded llama.cpp server): one
planner call per task for a fixed set of tasks, in the free form (ids and dependencies checked after
the call) and in the numbered form (``numbered=True``: the grammar admits only earlier
dependencies), alternating; reported: the share of first answers that give a valid plan, the
latency, the nodes per plan, and the share of nodes whose goal differs from every other node's
(a rough quality signal: SmolLM2 often repeats one goal).

    .venv/bin/python bench/bench_planact.py              # overhead: 7 rounds of 3- and 6-node plans
    .venv/bin/python bench/bench_planact.py --quick      # 3 rounds
    .venv/bin/python bench/bench_planact.py --local      # also the planner on SmolLM2 (≈ 1–2 min more)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _common import machine, median, table, versions, write_results  # noqa: E402

from fsm_agent import (  # noqa: E402
    Agent,
    Continue,
    MemoryStore,
    Middleware,
    ScriptedProvider,
    SQLiteStore,
    StopReason,
    StopRun,
    UserMessage,
)
from fsm_agent.providers import text_response  # noqa: E402
from fsm_agent_middleware.planact import PlanAct  # noqa: E402
from fsm_agent_middleware.verifier import Verdict  # noqa: E402

TASKS = [
    "Write a short note about cats: list two facts about cats, write a title, then write one closing sentence.",
    "Plan a picnic: choose a park, list the food to bring, and write an invitation.",
    "Compute the total price of 3 apples at 2 euros and 2 pears at 3 euros, then state it.",
    "Prepare a job application: read the job ad, list the matching skills, write a cover letter.",
    "Fix a flat bicycle tyre: remove the wheel, patch the tube, put the wheel back.",
    "Organise a book club meeting: pick a book, choose a date, send the invitations.",
]


def plan_of(n: int) -> dict[str, Any]:
    return {"nodes": [{"id": f"s{i}", "goal": f"Do part {i} of the task", "depends_on": [f"s{i - 1}"] if i > 1 else [],
                       "acceptance": f"part {i} is done"} for i in range(1, n + 1)]}


class Steps(Middleware):
    """The baseline: N turns, each continued with the next instruction (no plan, no checks)."""

    name = "steps"

    def __init__(self, n: int) -> None:
        self.n = n

    def post_turn(self, ctx: Any) -> Any:
        done = sum(1 for m in ctx.transcript if m.role == "assistant")
        if done >= self.n:
            return None
        return Continue(message=UserMessage(f"Next step s{done + 1}: Do part {done + 1} of the task\n"
                                            f"Done when: part {done + 1} is done"), reason="next step")


def scripted(plan: dict[str, Any]) -> ScriptedProvider:
    def answer(request: Any) -> Any:
        if request.output_schema is not None and request.output_schema.name == "plan":
            return text_response(orjson.dumps(plan).decode())
        return text_response("part done")

    return ScriptedProvider([answer], repeat_last=True)


async def one_run(kind: str, n: int, store_kind: str, tmp: Path, i: int) -> tuple[float, int, int]:
    """(seconds, bytes of the last checkpoint, bytes of the session's events) of one run."""
    store: Any = MemoryStore() if store_kind == "memory" else SQLiteStore(tmp / f"{kind}-{n}-{i}.db")
    try:
        if kind == "planact":
            agent = Agent(scripted(plan_of(n)), store=store,
                          middleware=[PlanAct(check=lambda ctx, node: Verdict(True, "ok"), grade=False)])
        else:
            agent = Agent(scripted(plan_of(n)), store=store, middleware=[Steps(n)])
        t = time.perf_counter()
        result = await agent.run("Do the task in parts", max_iterations=n + 5)
        took = time.perf_counter() - t
        assert result.stop.reason is StopReason.COMPLETED and result.turns == n, (kind, result.stop.detail)
        ck = await store.latest_checkpoint(result.session_id)
        events = await store.read_events(result.session_id)
        return took, len(orjson.dumps(ck.data)), sum(len(orjson.dumps(e.payload)) for e in events)
    finally:
        await store.close()


async def overhead(rounds: int, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for store_kind in ("memory", "sqlite"):
            for n in (3, 6):
                samples: dict[str, list[float]] = {"planact": [], "steps": []}
                size: dict[str, tuple[int, int]] = {}
                for r in range(rounds):
                    for kind in (("planact", "steps") if r % 2 == 0 else ("steps", "planact")):
                        times = []
                        for i in range(runs):
                            took, ck, ev = await one_run(kind, n, store_kind, tmp, r * runs + i)
                            times.append(took)
                            size[kind] = (ck, ev)
                        samples[kind].append(median(times))
                pa, base = median(samples["planact"]), median(samples["steps"])
                out[f"{store_kind}/{n}"] = {
                    "store": store_kind, "nodes": n, "planact_ms": pa * 1000, "baseline_ms": base * 1000,
                    "per_node_ms": (pa - base) * 1000 / n, "checkpoint_bytes": size["planact"][0],
                    "checkpoint_bytes_baseline": size["steps"][0], "log_bytes": size["planact"][1],
                    "log_bytes_baseline": size["steps"][1], "rounds": samples,
                }
    return out


class StopAfterPlanning(Middleware):
    name = "stop_after_planning"

    def pre_turn(self, ctx: Any) -> None:
        raise StopRun(StopReason.PAUSED_BUDGET, "bench: planned")


async def planner_on_local(rounds: int) -> dict[str, Any]:
    from fsm_agent import create_provider
    from fsm_agent.local import LocalLlamaServer
    from fsm_agent.providers import ProviderConfig

    results: dict[str, list[dict[str, Any]]] = {"free": [], "numbered": []}
    with LocalLlamaServer(ctx_size=8192) as server:
        provider = create_provider("llamacpp", ProviderConfig(base_url=server.base_url, first_token_timeout=300.0))
        try:
            for r in range(rounds):
                for task in TASKS:
                    for form in (("free", "numbered") if r % 2 == 0 else ("numbered", "free")):
                        store = MemoryStore()
                        agent = Agent(provider, store=store, middleware=[
                            PlanAct(numbered=form == "numbered", plan_attempts=1, min_nodes=3, max_nodes=4),
                            StopAfterPlanning()])
                        t = time.perf_counter()
                        result = await agent.run(task)
                        took = time.perf_counter() - t
                        plans = [e.payload["plan"] for e in await store.read_events(result.session_id,
                                                                                    types=("plan_updated",))]
                        goals = [n["goal"].strip().lower() for n in plans[0]["nodes"]] if plans else []
                        distinct = sum(goals.count(g) == 1 for g in goals)
                        results[form].append({"task": task, "valid": bool(plans), "seconds": took,
                                              "nodes": len(goals), "distinct_goals": distinct,
                                              "problem": None if plans else result.stop.detail[:300]})
        finally:
            await provider.aclose()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    ap.add_argument("--local", action="store_true", help="also measure the planner on the local SmolLM2 model")
    ap.add_argument("--local-rounds", type=int, default=1, help="rounds over the task set on the local model")
    args = ap.parse_args()
    rounds, runs = (3, 5) if args.quick else (7, 10)
    data: dict[str, Any] = {"machine": machine(), "versions": versions(), "rounds": rounds, "runs_per_round": runs}
    data["overhead"] = oh = asyncio.run(overhead(rounds, runs))
    print(table(["store", "nodes", "PlanAct run ms", "baseline run ms", "PlanAct per node ms",
                 "checkpoint bytes (baseline)", "log bytes (baseline)"],
                [[v["store"], v["nodes"], v["planact_ms"], v["baseline_ms"], v["per_node_ms"],
                  f"{v['checkpoint_bytes']:,} ({v['checkpoint_bytes_baseline']:,})",
                  f"{v['log_bytes']:,} ({v['log_bytes_baseline']:,})"] for v in oh.values()],
                title=f"PlanAct overhead, scripted zero-latency model (medians of {rounds} rounds × {runs} runs)"))
    if args.local:
        data["planner_local"] = pl = asyncio.run(planner_on_local(args.local_rounds))
        rows = []
        for form, rs in pl.items():
            nodes = sum(r["nodes"] for r in rs)
            rows.append([form, f"{sum(r['valid'] for r in rs)} of {len(rs)}", median([r["seconds"] for r in rs]),
                         (nodes / sum(r["valid"] for r in rs)) if any(r["valid"] for r in rs) else float("nan"),
                         f"{sum(r['distinct_goals'] for r in rs)} of {nodes}"])
        print(table(["plan form", "valid first answers", "median s per planner call", "nodes per plan",
                     "nodes with a goal of their own"], rows,
                    title=f"The planner on SmolLM2-135M (llama.cpp, temperature 0), {len(TASKS)} tasks"))
    path = write_results("planact", data)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
