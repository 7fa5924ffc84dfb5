"""bench/control_vs_model.py cannot rot silently: its ``--quick`` scripted run, imported and run here.

The run drives the real OpenAI-compatible HTTP provider through the bench's fault proxy against the
strict scripted server, in both modes. What must hold: the faults really fired in both modes (and
the same schedule was given to both), the model-only loop really had to start over, the runtime's
control ended every run correctly with no side effect done twice, and the strict server refused no
request (no unpaired tool call reached it, after interrupts, drops and resumes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import control_vs_model as cvm  # noqa: E402
from _control_world import TASKS, World, classify, grounded_problems, scripted_reply  # noqa: E402

from fsm_agent import ToolUseBlock  # noqa: E402
from fsm_agent.testing.strict import StrictServer  # noqa: E402
from fsm_agent.tools import ToolRegistry  # noqa: E402
from fsm_agent.tools.execution import execute_tool_call  # noqa: E402


async def test_quick_scripted_run_injects_faults_and_control_keeps_effects_once(tmp_path: Path) -> None:
    # --quick's schedule; a shorter wait for a hung tool (the timings are not under test here)
    args = cvm.parse_args(["--quick", "--no-local", "--no-docs", "--wall", "3", "--tool-timeout", "1",
                           "--concurrency", "8"])
    s = cvm.Settings("scripted", wall=args.wall, tool_timeout=args.tool_timeout, user_attempts=args.user_attempts,
                     max_turns=args.max_turns, max_output_tokens=None, temperature=None, run_limit=60.0)
    server = StrictServer(scripted_reply)
    await server.start()
    try:
        records = await cvm.bench("scripted", TASKS, args.repeats, s, args.seed, server.base_url, "scripted",
                                  tmp_path, args.concurrency, args.modes, clean=False, progress=lambda _: None)
    finally:
        await server.close()
    assert server.rejected == []
    by_mode = {m: [r for r in records if r["mode"] == m] for m in cvm.MODES}
    assert [len(rs) for rs in by_mode.values()] == [len(TASKS)] * 3

    # the same seeded schedule for both modes, task by task
    plans = [{r["task"]: r["plan"] for r in rs} for rs in by_mode.values()]
    assert plans[0] == plans[1] == plans[2]

    # every fault kind fired, in both modes
    for mode, rs in by_mode.items():
        fired = [k for r in rs for k in r["faults"]]
        assert set(fired) == {"tool_timeout", "interrupt", "sse_drop"}, (mode, fired)

    # the model-only loop had to start over; the runtime retried, timed out, resumed instead
    assert sum(r["actions"]["restarts from scratch"] for r in by_mode["model only"]) > 0
    control = by_mode["runtime control"]
    acted = {k for r in control for k, v in r["actions"].items() if v}
    assert {"model retries", "tool timeouts", "resumes"} <= acted, acted

    # the runtime's promises, with PlanAct and with the plain Verifier: every run ends correct, and no
    # side effect ran twice
    for controlled in (control, by_mode["runtime control, verifier only"]):
        assert sum(r["duplicates"] for r in controlled) == 0
        assert [r["task"] for r in controlled if not r["correct"]] == []
        assert all(r["recovery_s"] is not None for r in controlled if r["faults"])
    assert sum(r["actions"].get("plans made", 0) for r in control) == len(TASKS)

    rows = cvm.summarize(records)
    total = {r["mode"]: r for r in rows if r["faults"] == "all faulted runs"}
    assert total["runtime control"]["duplicates"] == 0 and total["runtime control"]["success_rate"] == 1.0
    assert total["model only"]["faults_fired"] == total["runtime control"]["faults_fired"] > 0


def test_fault_schedule_is_seeded_and_covers_every_combination() -> None:
    combos = set()
    for ti, task in enumerate(TASKS):
        for r in range(4):
            plan = cvm.draw_plan(ti, r, 4, task.model_calls, task.tool_calls)
            assert plan == cvm.draw_plan(ti, r, 4, task.model_calls, task.tool_calls)
            combos.add(plan.combo)
            if plan.hang is not None:
                assert 1 <= plan.hang <= task.tool_calls
            if plan.drop is not None:
                assert 1 <= plan.drop[0] <= task.model_calls and 2 <= plan.drop[1] <= 5
            assert (plan.interrupt_stream is None) or (plan.interrupt_tool is None)
    assert combos == set(cvm.COMBOS)
    assert cvm.draw_plan(0, 0, 4, 3, 2) != cvm.draw_plan(0, 0, 5, 3, 2) or cvm.draw_plan(1, 0, 4, 3, 2) != \
        cvm.draw_plan(1, 0, 5, 3, 2)


async def test_side_effects_are_counted_by_key_and_outcome_is_judged_on_the_world() -> None:
    task = next(t for t in TASKS if t.name == "refund")
    world = World()
    tools = {t.name: t for t in world.tools(task.tool_names)}
    assert set(tools) == {"lookup_order", "issue_refund", "find_refunds"}
    first = await tools["issue_refund"].fn(order_id="ORD-1003", amount=129.9)
    assert task.outcome(world, f"Refunded 129.90 USD (refund {first['refund_id']}).")["correct"]
    await tools["issue_refund"].fn(order_id="ORD-1003", amount=129.9)
    verdict = task.outcome(world, f"Refunded 129.90 USD (refund {first['refund_id']}).")
    assert verdict["duplicates"] == 1 and not verdict["correct"]
    # the acceptance rule reads the transcript, not the world: an answer must quote a tool's result
    results = [("issue_refund", '{"refund_id": "R-701", "order_id": "ORD-1003", "amount": 129.9}', False)]
    assert grounded_problems(task.grounded, results, "Refunded, refund R-701.") == []
    assert grounded_problems(task.grounded, results, "Refunded.") != []
    assert grounded_problems(task.grounded, [], "Refunded, refund R-701.") != []


@pytest.mark.parametrize("status,text", [
    ("unknown", "The run stopped while this tool call was running; its outcome is unknown: it may or may not "
                "have taken effect."),
    ("not_run", "The run stopped before this tool call started; it did not run."),
    ("ok", '{"rate": 1.09}'),
    ("error", "Tool 'get_rate' failed: LookupError: no rate for X/Y"),
])
def test_the_scripted_model_reads_the_runtimes_result_texts(status: str, text: str) -> None:
    """The scripted model keys on the runtime's wording (fsm_agent/machine/driver.py
    ``_close_open_calls``): if that wording changes, this fails here instead of the bench quietly
    measuring something else."""
    assert classify(text)[0] == status


async def test_the_scripted_model_reads_a_real_tool_timeout() -> None:
    world = World(on_tool_start=lambda index, tool: "hang")
    registry = ToolRegistry(world.tools(["get_rate"]))
    result = await execute_tool_call(ToolUseBlock("c1", "get_rate", {"base": "EUR", "quote": "USD"}), registry,
                                     timeout=0.05)
    assert classify(result.text)[0] == "timeout"
    assert [e.outcome for e in world.executions] == ["cancelled"]
