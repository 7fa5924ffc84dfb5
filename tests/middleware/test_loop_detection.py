"""Loop detection (DESIGN §4, seed 000 §5.4, case B22): identities, the pattern finder, the three B22
cases through real runs, the warn → block → stop escalation, and the real local model."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from fsm_agent import Agent, Middleware, RunConfig, ScriptedProvider, StopReason, Tool, create_provider
from fsm_agent.providers import ProviderConfig, tool_call_response
from fsm_agent.tools.demo import calculator
from fsm_agent.types import Message, RunResult, ToolResultMessage, ToolUseBlock, UserMessage
from fsm_agent_middleware.loop_detection import NOTICE_PREFIX, LoopDetection, call_identity, find_repetition
from fsm_agent_middleware.repair import MessageRepair

from corpus import CASES
B22 = {c["name"]: c for c in json.loads((CASES / "B22.json").read_text())["cases"]}
B22_WANT = json.loads((CASES / "B22.expected.json").read_text())


def notices(messages: tuple[Message, ...] | list[Message]) -> list[str]:
    return [m.text for m in messages if isinstance(m, UserMessage) and m.text.startswith(NOTICE_PREFIX)]


def denials(result: RunResult) -> list[ToolResultMessage]:
    return [m for m in result.messages if isinstance(m, ToolResultMessage)
            and (m.metadata or {}).get("denied_by") == "loop_detection"]


class Recorded:
    """Tools that answer with the results recorded in a case, in execution order, and count executions."""

    def __init__(self, steps: list[dict[str, Any]]) -> None:
        self.results = [s["result"] for s in steps]
        self.executed: list[tuple[str, dict[str, Any]]] = []
        self.tools = []
        for name in dict.fromkeys(s["tool"] for s in steps):
            props = {k: {"type": "string"} for s in steps if s["tool"] == name for k in s["args"]}
            self.tools.append(Tool(self._fn(name), name=name, parameters={"type": "object", "properties": props}))

    def _fn(self, name: str) -> Any:
        def run(**arguments: Any) -> str:
            self.executed.append((name, arguments))
            return self.results[len(self.executed) - 1]
        return run


async def run_steps(steps: list[dict[str, Any]], mw: LoopDetection | None = None,
                    final: str = "done") -> tuple[RunResult, Recorded, ScriptedProvider, LoopDetection, Any]:
    tools = Recorded(steps)
    provider = ScriptedProvider([tool_call_response((s["tool"], s["args"])) for s in steps] + [final])
    mw = mw or LoopDetection()
    agent = Agent(provider, tools=tools.tools, middleware=[mw])
    ctx = agent.new_context([UserMessage("go")])
    result = await agent.driver(ctx).run()
    return result, tools, provider, mw, ctx


# -- identities and the pattern finder ------------------------------------------------------
def test_call_identity_ignores_key_order_and_keeps_raw_text() -> None:
    a = ToolUseBlock("1", "fetch_report", {"report": "sales", "quarter": "Q3"})
    b = ToolUseBlock("2", "fetch_report", {"quarter": "Q3", "report": "sales"})
    assert call_identity(a) == call_identity(b) == 'fetch_report\x00{"quarter":"Q3","report":"sales"}'
    assert call_identity(ToolUseBlock("3", "fetch_report", {"quarter": "Q4", "report": "sales"})) != call_identity(a)
    assert call_identity(ToolUseBlock("4", "f", {}, raw_input="{oops")) == "f\x00raw:{oops"


@pytest.mark.parametrize(("steps", "want"), [
    ([("A", "1"), ("A", "1"), ("A", "1")], 1),
    ([("A", "1"), ("A", "1"), ("A", "1"), ("A", None)], 1),  # a proposal that continues a known loop
    ([("A", "1"), ("A", "2"), ("A", None)], None),  # same call, new result: progress, not a loop
    ([("A", "1"), ("A", "1")], None),  # too few
    ([("X", "0"), ("A", "1"), ("B", "2"), ("A", "1"), ("B", "2"), ("A", "1"), ("B", "2")], 2),
    ([("A", "1"), ("B", "2")] * 3 + [("A", None)], 2),
    ([("A", "1"), ("B", "2"), ("A", "1"), ("B", "3"), ("A", "1"), ("B", "3")], None),
    ([("A", "1"), ("B", "2"), ("C", "3")] * 3, 3),
    ([("A", "1"), ("B", "2"), ("C", "3")] * 3 + [("A", None), ("B", None)], 3),
    ([("A", "1"), ("B", "2"), ("C", "3")] * 2 + [("A", "1"), ("C", "2"), ("C", "3")], None),
    # a call without a result matches any result, but does not join two different results
    ([("A", "1"), ("A", None), ("A", "2")], None),
    ([("A", "1"), ("A", None), ("A", "1"), ("A", "1")], 1),
])
def test_find_repetition(steps: list[tuple[str, str | None]], want: int | None) -> None:
    assert find_repetition(steps, repeats=3) == want


@pytest.mark.parametrize("steps", [
    [("A", "1"), ("A", "1"), ("A", None)],  # the 3rd result is not in yet: it may differ (a poll)
    [("A", "1"), ("A", None), ("A", None)],  # parallel identical calls still running
    [("A", "1"), ("B", "2"), ("A", "1"), ("B", "2"), ("A", "1"), ("B", None)],
    [("A", "1"), ("B", "2"), ("C", "3")] * 2 + [("A", "1"), ("B", "2"), ("C", None)],
    [("A", "1"), ("A", None), ("A", "1")],  # a denied call is no repetition either
])
def test_find_repetition_counts_only_repeats_whose_result_is_in(steps: list[tuple[str, str | None]]) -> None:
    # issue 19 item 6: a repeat counts once its result is known, the same call with the same result
    assert find_repetition(steps, repeats=3) is None


def test_find_repetition_options() -> None:
    polling = [("A", "10%"), ("A", "45%"), ("A", "90%")]
    assert find_repetition(polling, repeats=3, same_results=False) == 1
    assert find_repetition(polling[:2] + [("A", None)], repeats=3, same_results=False) is None
    assert find_repetition([("A", "1"), ("A", "1")], repeats=2) == 1
    abc = [("A", "1"), ("B", "2"), ("C", "3")] * 3
    assert find_repetition(abc, repeats=3, max_pattern=2) is None
    assert find_repetition(abc, repeats=3, max_pattern=3) == 3


# -- B22 through real runs -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp_repetitive_but_progressing", "fp_polling_with_changing_results"])
async def test_b22_false_positives_run_every_step(name: str) -> None:
    want = B22_WANT[name]
    result, tools, provider, mw, ctx = await run_steps(B22[name]["steps"])
    loop_detected = bool(mw.detections(ctx) or denials(result)
                         or any(notices(r.messages) for r in provider.requests))
    assert loop_detected is want["loop_detected"] is False
    assert len(tools.executed) == want["executed"] == len(B22[name]["steps"])
    assert [(n, a) for n, a in tools.executed] == [(s["tool"], s["args"]) for s in B22[name]["steps"]]
    assert result.stop.reason is StopReason.COMPLETED


async def test_b22_true_positive_is_warned_blocked_then_stopped() -> None:
    # Issue 19 item 6 judges a repeat once its result is in: the same call with the same result 3
    # times (seed 000 §5.4.2) is the loop. B22.expected.json still says "after 2 executions, the 3rd
    # proposal intercepted" (a prediction of the 3rd result, which is what denied polls); here the 3rd
    # runs, its identical result makes the loop, and the 4th proposal is the one intercepted.
    name = "tp_same_call_same_result"
    want = B22_WANT[name]
    steps = B22[name]["steps"]
    result, tools, provider, mw, ctx = await run_steps(steps)
    assert want["loop_detected"] and len(tools.executed) == 3
    assert list(tools.executed[0][1]) == ["report", "quarter"] and list(tools.executed[1][1]) == ["quarter", "report"]
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.reason is not StopReason.COMPLETED
    assert result.stop.detail.startswith('loop detected: fetch_report {"quarter":"Q3","report":"sales"} already ran '
                                         "3 times in a row with the same result each time ('ERROR: upstream timeout')")
    assert "after a warning, 1 repeat(s) were denied" in result.stop.detail
    assert result.stop.error == {"kind": "loop_detected", "pattern": ['fetch_report {"quarter":"Q3","report":"sales"}'],
                                 "executed_in_loop": 3, "blocked": 1}
    # the proposal at index 3 was intercepted: answered with a denial, never executed
    proposals = [c for m in result.messages if m.role == "assistant" for c in m.tool_calls]  # type: ignore[union-attr]
    (denied,) = denials(result)
    assert denied.tool_call_id == proposals[3].id and denied.is_error
    assert "it was not run again" in denied.text and "give your final answer" in denied.text
    assert len(provider.requests) == 5  # the 5th proposal stopped the run; the final answer was never asked for
    # the warning reached the 4th model call only, and never the transcript
    assert [bool(notices(r.messages)) for r in provider.requests] == [False, False, False, True, False]
    assert notices(provider.requests[3].messages)[0].startswith(
        f'{NOTICE_PREFIX} You called fetch_report {{"quarter":"Q3","report":"sales"}} 3 times in a row')
    assert notices(result.messages) == []
    assert [(d["action"], d["turn"]) for d in mw.detections(ctx)] == [("warn", 4), ("block", 4), ("stop", 5)]


async def test_a_model_that_listens_after_the_denial_can_still_finish() -> None:
    step = {"tool": "ping", "args": {"host": "a"}, "result": "timeout"}
    result, tools, _, _, _ = await run_steps([step] * 4, final="The host does not answer.")
    assert len(tools.executed) == 3 and len(denials(result)) == 1
    assert result.stop.reason is StopReason.COMPLETED and result.output == "The host does not answer."


async def test_a_pattern_of_two_calls() -> None:
    a = {"tool": "read", "args": {"path": "x"}, "result": "same"}
    b = {"tool": "build", "args": {}, "result": "error: x"}
    result, tools, provider, mw, ctx = await run_steps([a, b, a, b, a, b, a])
    assert [n for n, _ in tools.executed] == ["read", "build"] * 3
    assert [bool(notices(r.messages)) for r in provider.requests] == [False] * 6 + [True, False]
    (notice,) = notices(provider.requests[6].messages)
    assert 'repeated the sequence read {"path":"x"} -> build {} 3 times' in notice
    (denied,) = denials(result)
    assert "read {\"path\":\"x\"} -> build {} already ran 3 times in a row (as a sequence)" in denied.text
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block"]
    assert result.stop.reason is StopReason.COMPLETED  # the scripted model gave up after the denial


async def test_max_blocks_zero_stops_at_the_first_repeat() -> None:
    steps = B22["tp_same_call_same_result"]["steps"]
    result, tools, _, _, _ = await run_steps(steps, LoopDetection(max_blocks=0))
    assert len(tools.executed) == 3 and denials(result) == []
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.error["blocked"] == 0  # type: ignore[index]


async def test_parallel_repeats_in_one_turn_are_denied_and_only_a_later_turn_stops() -> None:
    call = ("fetch", {"q": "1"})
    tools = Recorded([{"tool": "fetch", "args": {"q": "1"}, "result": "same"}] * 3)
    script = [tool_call_response(call), tool_call_response(call), tool_call_response(call),
              tool_call_response(call, call), tool_call_response(call), "never"]
    provider = ScriptedProvider(script)
    result = await Agent(provider, tools=tools.tools, middleware=[LoopDetection()]).run("go")
    assert len(tools.executed) == 3
    assert len(denials(result)) == 2  # both calls of the 4th turn; the model had not seen a denial yet
    assert result.stop.reason is StopReason.FAILED_TERMINAL and len(provider.requests) == 5


@pytest.mark.parametrize("results", [["same"] * 3, ["queued", "running 40%", "done"], ["running", "running", "done"]])
async def test_parallel_identical_calls_in_one_turn_all_run_and_are_judged_on_their_results(results: list[str]) -> None:
    # issue 19 item 6: three identical calls proposed together have no result yet; none is denied
    call = ("job_status", {"job": "J-1"})
    tools = Recorded([{"tool": "job_status", "args": {"job": "J-1"}, "result": r} for r in results])
    provider = ScriptedProvider([tool_call_response(call, call, call), "ok"])
    mw = LoopDetection()
    agent = Agent(provider, tools=tools.tools, middleware=[mw])
    ctx = agent.new_context([UserMessage("go")])
    result = await agent.driver(ctx).run()
    assert len(tools.executed) == 3 and denials(result) == []
    assert result.stop.reason is StopReason.COMPLETED
    # only three equal results make a loop: the model is warned before its next call
    assert bool(notices(provider.requests[1].messages)) is (len(set(results)) == 1)
    assert [d["action"] for d in mw.detections(ctx)] == (["warn"] if len(set(results)) == 1 else [])


async def test_parallel_identical_calls_after_a_known_loop_are_denied_in_one_turn() -> None:
    call = ("fetch", {"q": "1"})
    tools = Recorded([{"tool": "fetch", "args": {"q": "1"}, "result": "same"}] * 3)
    provider = ScriptedProvider([tool_call_response(call, call, call), tool_call_response(call, call),
                                 tool_call_response(call), "never"])
    result = await Agent(provider, tools=tools.tools, middleware=[LoopDetection()]).run("go")
    assert len(tools.executed) == 3 and len(denials(result)) == 2
    assert result.stop.reason is StopReason.FAILED_TERMINAL and len(provider.requests) == 3


async def test_parallel_calls_are_recorded_in_proposal_order() -> None:
    finished: list[str] = []
    slow_first = {0: "a", 1: "b", 2: "a"}  # turns 1 and 3: "a" finishes last; turn 2: "b" finishes last

    async def step(name: str) -> str:
        turn = sum(1 for f in finished if f == name)
        await asyncio.sleep(0.05 if slow_first[turn] == name else 0)
        finished.append(name)
        return f"{name}: same"

    tools = [Tool(step, name="step", parameters={"type": "object", "properties": {"name": {"type": "string"}}})]
    pair = tool_call_response(("step", {"name": "a"}), ("step", {"name": "b"}))
    again = [tool_call_response(("step", {"name": "a"}), ("step", {"name": "b"})) for _ in range(2)]
    provider = ScriptedProvider([pair, *again, "ok"])
    await Agent(provider, tools=tools, middleware=[LoopDetection()]).run("go")
    assert finished == ["b", "a", "a", "b", "b", "a"]
    # proposal order a, b, a, b, a, b is three repetitions of one pattern, whatever order they finished in
    assert notices(provider.requests[3].messages)


async def test_state_is_per_run() -> None:
    tools = Recorded([{"tool": "fetch", "args": {}, "result": "same"}] * 4)
    script = [tool_call_response(("fetch", {})), tool_call_response(("fetch", {})), "done"] * 2  # fresh call ids
    mw = LoopDetection()
    agent = Agent(ScriptedProvider(script), tools=tools.tools, middleware=[mw])
    first, second = await agent.run("one"), await agent.run("two")
    assert len(tools.executed) == 4 and denials(first) == denials(second) == []


def test_options_and_repr() -> None:
    assert repr(LoopDetection()) == ("LoopDetection(window=12, max_pattern=3, repeats=3, max_blocks=1, "
                                     "same_results=True)")
    for bad in ({"repeats": 1}, {"window": 8}, {"max_blocks": -1}, {"max_pattern": 0}):
        with pytest.raises(ValueError):
            LoopDetection(**bad)

    class Policy(Middleware):
        def on_tool_call(self, call: ToolUseBlock, ctx: Any) -> None:
            return None

    # innermost: after policy middleware whatever the list order (DESIGN §4: policy, loop detection, run)
    agent = Agent(ScriptedProvider([]), middleware=[LoopDetection(), Policy(), MessageRepair()])
    assert [m.middleware_name for m in agent.middleware] == ["Policy", "loop_detection", "repair"]


# -- the real local model ----------------------------------------------------------------------
@pytest.mark.llama
async def test_local_model_loop_ends_in_a_loop_stop_or_an_answer(llama_server) -> None:
    """SmolLM2-135M tends to repeat one calculator call forever; without loop detection this run would
    end PAUSED_BUDGET at the iteration limit."""
    provider = create_provider("llamacpp", ProviderConfig(base_url=llama_server.base_url))
    mw = LoopDetection()
    agent = Agent(provider, tools=[calculator], middleware=[MessageRepair(), mw],
                  config=RunConfig(max_iterations=12, max_output_tokens=80))
    ctx = agent.new_context([UserMessage("Use the calculator to compute 17 * 23.")])
    try:
        result = await agent.driver(ctx).run()
    finally:
        await provider.aclose()
    assert result.stop.reason is not StopReason.PAUSED_BUDGET, result.stop.detail
    assert result.stop.reason in (StopReason.COMPLETED, StopReason.FAILED_TERMINAL), result.stop.detail
    if result.stop.reason is StopReason.FAILED_TERMINAL:
        assert result.stop.detail.startswith("loop detected: calculator {"), result.stop.detail
        assert result.stop.error and result.stop.error["kind"] == "loop_detected"
        assert [d["action"] for d in mw.detections(ctx)][-1] == "stop"
        assert result.turns < 12
    else:
        assert result.output.strip()


async def test_a_call_denied_by_another_middleware_again_and_again_is_a_loop() -> None:
    from fsm_agent import Deny, Middleware, StopReason as SR
    from fsm_agent.providers import ScriptedProvider, tool_call_response

    class NoClock(Middleware):
        def on_tool_call(self, call, ctx):
            return Deny("the clock is blocked") if call.name == "clock" else None

    from fsm_agent import Agent
    from fsm_agent.tools.demo import clock

    script = [tool_call_response(("clock", {"timezone": "UTC"})) for _ in range(10)]
    provider = ScriptedProvider(script)
    result = await Agent(provider, tools=[clock], middleware=[NoClock(), LoopDetection()]).run("time?")
    assert result.stop.reason is SR.FAILED_TERMINAL
    assert result.stop.error["kind"] == "loop_detected"
    assert result.stop.detail.startswith('loop detected: clock {"timezone":"UTC"} was proposed 4 times in a row')
    assert result.turns == 4 and result.tool_calls == 0  # stopped before the 5th model call
    notice = [m for m in provider.requests[3].messages if m.text.startswith(NOTICE_PREFIX)]
    assert len(notice) == 1  # the model was warned first


# -- progress versus no progress, alternation through denials, resume (issue 8 item 4) ---------------
# Seed 000 §5.4.2: a window of 12 call signatures, patterns of length 1-3, "the same pattern 3 times in
# a row". A repetition counts once its result is in (issue 19 item 6). Defaults here: warned once 3
# repetitions came back with the same results, the next proposal in the loop is denied, the next one
# (after the model saw that denial) stops the run.

def _alternating(pattern: list[str], results: dict[str, list[str]]) -> tuple[list[Tool], list[str]]:
    """Tools named in ``pattern`` (no arguments) answering from ``results[name]`` in turn (the last repeats)."""
    ran: list[str] = []

    def make(name: str) -> Tool:
        def run() -> str:
            n = ran.count(name)
            ran.append(name)
            answers = results.get(name, [f"{name}: nothing new"])
            return answers[min(n, len(answers) - 1)]
        return Tool(run, name=name, parameters={"type": "object", "properties": {}})

    return [make(n) for n in dict.fromkeys(pattern)], ran


async def _run_names(names: list[str], results: dict[str, list[str]] | None = None,
                     extra: tuple[Middleware, ...] = (), mw: LoopDetection | None = None,
                     final: str = "final answer") -> tuple[RunResult, list[str], ScriptedProvider, LoopDetection, Any]:
    tools, ran = _alternating(names, results or {})
    provider = ScriptedProvider([tool_call_response((n, {})) for n in names] + [final])
    mw = mw or LoopDetection()
    agent = Agent(provider, tools=tools, middleware=[*extra, mw])
    ctx = agent.new_context([UserMessage("go")])
    result = await agent.driver(ctx).run()
    return result, ran, provider, mw, ctx


async def test_polling_that_makes_progress_runs_a_dozen_times_without_a_warning() -> None:
    # the same call 14 times (more than the window of 12), a new status every time
    statuses = [f"build 7f3a: {pct}% of 40 targets compiled" for pct in range(5, 75, 5)]
    result, ran, provider, mw, ctx = await _run_names(["build_status"] * len(statuses), {"build_status": statuses})
    assert ran == ["build_status"] * 14
    assert mw.detections(ctx) == [] and denials(result) == []
    assert not any(notices(r.messages) for r in provider.requests)
    assert result.stop.reason is StopReason.COMPLETED


async def test_polling_that_stalls_is_warned_blocked_and_stopped() -> None:
    # progress first (10% -> 20%), then the same answer: the stall counts from the first repeated result
    result, ran, provider, mw, ctx = await _run_names(["job"] * 7, {"job": ["10%", "20%", "20%"]})
    assert ran == ["job"] * 4  # 10%, 20%, 20%, 20%; the 5th proposal is denied, the 6th stops the run
    assert [(d["action"], d["turn"]) for d in mw.detections(ctx)] == [("warn", 5), ("block", 5), ("stop", 6)]
    assert [bool(notices(r.messages)) for r in provider.requests] == [False] * 4 + [True, False]
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error == {"kind": "loop_detected", "pattern": ["job {}"], "blocked": 1, "executed_in_loop": 3}


@pytest.mark.parametrize("statuses", [
    ["running", "running", "succeeded"],                              # repeats once while the job runs
    ["queued", "queued", "running", "running", "succeeded"],          # once per stage
    ["10%", "10%", "55%", "55%", "90%", "90%", "100%"],
    ["running", "running", "running 50%", "running 50%", "running", "running", "done"],
])
async def test_a_poll_whose_status_repeats_once_before_it_changes_is_never_denied(statuses: list[str]) -> None:
    # issue 19 item 6: the 3rd poll after two equal answers is not denied before its answer is known
    result, ran, provider, mw, ctx = await _run_names(["job_status"] * len(statuses), {"job_status": statuses})
    assert ran == ["job_status"] * len(statuses)
    assert mw.detections(ctx) == [] and denials(result) == []
    assert not any(notices(r.messages) for r in provider.requests)
    assert result.stop.reason is StopReason.COMPLETED


@pytest.mark.parametrize("pattern", [["deploy_status"], ["refresh", "deploy_status"],
                                     ["refresh", "fetch_log", "deploy_status"]])
async def test_a_pattern_whose_last_call_repeats_once_then_changes_is_not_denied(pattern: list[str]) -> None:
    # patterns of length 1, 2 and 3: every call but the last always answers the same; the last
    # ("deploy_status") answers "rolling" twice, then "done". Nothing was denied before it answered.
    results = {"refresh": ["refreshed"], "fetch_log": ["no new lines"],
               "deploy_status": ["rolling", "rolling", "done", "done 2", "done 3"]}
    result, ran, provider, mw, ctx = await _run_names(pattern * 3, results)
    assert ran == pattern * 3 and denials(result) == [] and mw.detections(ctx) == []
    assert result.stop.reason is StopReason.COMPLETED


@pytest.mark.parametrize(("max_blocks", "executed", "proposals", "actions"), [
    (1, 3, 5, ["warn", "block", "stop"]),          # the defaults: 3 equal results, 4th proposal denied, 5th stops
    (2, 3, 6, ["warn", "block", "block", "stop"]),  # one more denial seen before the stop
    (0, 3, 4, ["warn", "stop"]),                    # no denial: the 4th proposal stops
])
async def test_the_same_result_escalates_at_the_seed_thresholds(max_blocks: int, executed: int, proposals: int,
                                                                actions: list[str]) -> None:
    result, ran, provider, mw, ctx = await _run_names(["list_dir"] * 8, {"list_dir": ["0 entries"]},
                                                      mw=LoopDetection(max_blocks=max_blocks))
    assert len(ran) == executed
    assert len(provider.requests) == proposals  # the model call whose proposal stopped the run is the last
    assert [d["action"] for d in mw.detections(ctx)] == actions
    assert len(denials(result)) == max_blocks
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.error["kind"] == "loop_detected"  # type: ignore[index]


async def test_a_result_that_flips_between_two_values_is_no_progress() -> None:
    # one call, results on/off/on/off: no length-1 repeat, but a length-2 pattern whose results repeat
    result, ran, _, mw, ctx = await _run_names(["toggle"] * 9, {"toggle": ["on", "off"] * 5})
    assert ran == ["toggle"] * 6  # on, off, on, off, on, off; the 7th is denied, the 8th stops
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block", "stop"]
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.detail.startswith("loop detected: toggle {} -> toggle {} already ran 3 times in a row "
                                         "(as a sequence) with the same result each time ('on'; 'off')")


async def test_a_pattern_counts_only_when_its_results_repeat_too() -> None:
    # check, wait, check, wait ...: "wait" always says the same, but "check" makes progress, so the
    # length-2 pattern is not a loop (and "wait" is never repeated twice in a row)
    checks = [f"{n} of 9 replicas ready" for n in range(1, 10)]
    names = ["check", "wait"] * 8
    result, ran, provider, mw, ctx = await _run_names(names, {"check": checks, "wait": ["waited 5s"]})
    assert ran == names and mw.detections(ctx) == []
    assert result.stop.reason is StopReason.COMPLETED


async def test_alternation_stops_after_the_third_repetition_through_its_own_denial() -> None:
    # a, b, a, b, a, b, a(denied), b: the denied a stays in the history (issue 8: it once fell out
    # and the loop went on for two more repetitions)
    result, ran, provider, mw, ctx = await _run_names(["a", "b"] * 8)
    assert ran == ["a", "b"] * 3
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block", "stop"]
    assert len(provider.requests) == 8 and result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error == {"kind": "loop_detected", "pattern": ["a {}", "b {}"], "blocked": 1,
                                 "executed_in_loop": 6}


class DenyNamed(Middleware):
    """A policy that denies every call to the named tools."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def on_tool_call(self, call: ToolUseBlock, ctx: Any) -> Any:
        from fsm_agent import Deny
        return Deny(f"{call.name} is not allowed here") if call.name in self.names else None


async def test_alternation_with_a_policy_denying_every_other_call_stops_after_the_third_repetition() -> None:
    # a runs, b is denied by a policy before loop detection sees it: a, b(denied) x3 is the loop; the
    # 4th a is denied, the policy denies b again, and the 5th a ends the run
    result, ran, provider, mw, ctx = await _run_names(["a", "b"] * 8, extra=(DenyNamed("b"),))
    assert ran == ["a", "a", "a"]
    assert len(provider.requests) == 9
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block", "stop"]
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.detail.startswith("loop detected: a {} -> b {} was proposed 4 times in a row (as a sequence)")
    assert "2 repeat(s) were denied or answered without running" in result.stop.detail


async def test_alternation_with_both_calls_denied_by_a_policy_stops_in_pre_turn() -> None:
    # loop detection never gets to block: after 3 repetitions of denied a, b the model is warned; the policy
    # denies its next a too, and the run stops before the next call
    result, ran, provider, mw, ctx = await _run_names(["a", "b"] * 8, extra=(DenyNamed("a", "b"),))
    assert ran == [] and len(provider.requests) == 7
    assert [bool(notices(r.messages)) for r in provider.requests] == [False] * 6 + [True]
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "stop"]
    assert result.stop.detail.startswith("loop detected: a {} -> b {} was proposed 3 times in a row")


async def test_a_cycle_of_three_calls() -> None:
    results = {"read": ["def f(): ..."], "edit": ["1 line changed"], "test": ["FAILED test_f"]}
    result, ran, provider, mw, ctx = await _run_names(["read", "edit", "test"] * 5, results)
    assert ran == ["read", "edit", "test"] * 3  # the 4th "read" is denied, then "edit" stops the run
    assert [bool(notices(r.messages)) for r in provider.requests] == [False] * 9 + [True, False]
    (notice,) = notices(provider.requests[9].messages)
    assert "repeated the sequence read {} -> edit {} -> test {} 3 times in a row" in notice
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block", "stop"]
    assert len(provider.requests) == 11 and result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["pattern"] == ["read {}", "edit {}", "test {}"]  # type: ignore[index]


async def test_a_cycle_of_three_calls_that_makes_progress_is_not_a_loop() -> None:
    results = {"read": ["def f(): ..."], "edit": ["1 line changed"],
               "test": [f"{n} of 5 tests pass" for n in range(1, 6)]}
    result, ran, _, mw, ctx = await _run_names(["read", "edit", "test"] * 5, results)
    assert len(ran) == 15 and mw.detections(ctx) == [] and result.stop.reason is StopReason.COMPLETED


async def test_denials_of_one_turn_count_once_for_a_cycle_too() -> None:
    # a, b | a, b | a, b | a(denied), b(denied) in parallel pairs: the model had not seen the denial of a
    # when it proposed b
    tools, ran = _alternating(["a", "b"], {})
    pairs = [tool_call_response(("a", {}), ("b", {})) for _ in range(4)]
    provider = ScriptedProvider([*pairs, tool_call_response(("a", {})), "never"])
    mw = LoopDetection()
    agent = Agent(provider, tools=tools, middleware=[mw])
    ctx = agent.new_context([UserMessage("go")])
    result = await agent.driver(ctx).run()
    assert ran == ["a", "b"] * 3 and len(denials(result)) == 2
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block", "block", "stop"]
    assert len(provider.requests) == 5


# -- resume: the history is rebuilt from the transcript ----------------------------------------------
async def test_a_resumed_run_remembers_the_repeats_before_it() -> None:
    steps = B22["tp_same_call_same_result"]["steps"]
    tools = Recorded(steps)
    provider = ScriptedProvider([tool_call_response((s["tool"], s["args"])) for s in steps] + ["done"])
    agent = Agent(provider, tools=tools.tools, middleware=[LoopDetection()], config=RunConfig(max_iterations=3))
    paused = await agent.run("report", session_id="loop-resume")
    assert paused.stop.reason is StopReason.PAUSED_BUDGET and len(tools.executed) == 3
    resumed = await agent.resume("loop-resume", max_iterations=10)
    # the first proposal after the resume is the 4th in a row: denied, not run; the next one stops the run
    assert len(tools.executed) == 3 and len(denials(resumed)) == 1
    assert resumed.stop.reason is StopReason.FAILED_TERMINAL
    assert "after a warning, 1 repeat(s) were denied" in resumed.stop.detail
    assert notices(provider.requests[3].messages)  # warned in the resumed run's first model call


async def test_a_fresh_run_over_the_same_transcript_continues_the_count() -> None:
    steps = [{"tool": "fetch", "args": {"q": "x"}, "result": "same"}] * 3
    first, tools, _, _, _ = await run_steps(steps, final="stopping here")
    # the same transcript minus the final answer, driven by a new context (what a resume does)
    transcript = [m for m in first.messages if not (m.role == "assistant" and m.text == "stopping here")]
    provider = ScriptedProvider([tool_call_response(("fetch", {"q": "x"})), "gave up"])
    mw = LoopDetection()
    agent = Agent(provider, tools=tools.tools, middleware=[mw])
    ctx = agent.new_context(list(transcript))
    result = await agent.driver(ctx).run()
    assert len(tools.executed) == 3 and len(denials(result)) == 1  # not run a 4th time
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block"]


async def test_a_new_user_message_starts_a_fresh_history() -> None:
    steps = [{"tool": "fetch", "args": {"q": "x"}, "result": "same"}] * 4
    first, tools, _, _, _ = await run_steps(steps[:3], final="the server is down")
    provider = ScriptedProvider([tool_call_response(("fetch", {"q": "x"})), "up now"])
    mw = LoopDetection()
    agent = Agent(provider, tools=tools.tools, middleware=[mw])
    ctx = agent.new_context([*first.messages, UserMessage("It is back up, try once more.")])
    result = await agent.driver(ctx).run()
    assert len(tools.executed) == 4 and denials(result) == [] and mw.detections(ctx) == []
    assert result.stop.reason is StopReason.COMPLETED
