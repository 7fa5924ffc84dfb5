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
    ([("A", "1"), ("A", "1"), ("A", None)], 1),
    ([("A", "1"), ("A", "1"), ("A", "1")], 1),
    ([("A", "1"), ("A", "2"), ("A", None)], None),  # same call, new result: progress, not a loop
    ([("A", "1"), ("A", "1")], None),  # too few
    ([("X", "0"), ("A", "1"), ("B", "2"), ("A", "1"), ("B", "2"), ("A", "1"), ("B", None)], 2),
    ([("A", "1"), ("B", "2"), ("A", "1"), ("B", "3"), ("A", "1"), ("B", None)], None),
    ([("A", "1"), ("B", "2"), ("C", "3")] * 2 + [("A", "1"), ("B", "2"), ("C", None)], 3),
    ([("A", "1"), ("B", "2"), ("C", "3")] * 2 + [("A", "1"), ("C", "2"), ("C", None)], None),
    # a call that did not run matches any result, but does not join two different results
    ([("A", "1"), ("A", None), ("A", "2")], None),
    ([("A", "1"), ("A", None), ("A", "1")], 1),
])
def test_find_repetition(steps: list[tuple[str, str | None]], want: int | None) -> None:
    assert find_repetition(steps, repeats=3) == want


def test_find_repetition_options() -> None:
    polling = [("A", "10%"), ("A", "45%"), ("A", None)]
    assert find_repetition(polling, repeats=3, same_results=False) == 1
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
    name = "tp_same_call_same_result"
    want = B22_WANT[name]
    steps = B22[name]["steps"]
    result, tools, provider, mw, ctx = await run_steps(steps)
    assert len(tools.executed) == want["executed"] == 2
    assert list(tools.executed[0][1]) == ["report", "quarter"] and list(tools.executed[1][1]) == ["quarter", "report"]
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.reason is not StopReason.COMPLETED
    assert result.stop.detail.startswith('loop detected: fetch_report {"quarter":"Q3","report":"sales"} already ran '
                                         "2 times in a row with the same result each time ('ERROR: upstream timeout')")
    assert "after a warning, 1 repeat(s) were denied" in result.stop.detail
    assert result.stop.error == {"kind": "loop_detected", "pattern": ['fetch_report {"quarter":"Q3","report":"sales"}'],
                                 "executed_in_loop": 2, "blocked": 1}
    # the proposal at index 2 was intercepted: answered with a denial, never executed
    proposals = [c for m in result.messages if m.role == "assistant" for c in m.tool_calls]  # type: ignore[union-attr]
    (denied,) = denials(result)
    assert denied.tool_call_id == proposals[want["intercepted_step_index"]].id and denied.is_error
    assert "it was not run again" in denied.text and "give your final answer" in denied.text
    assert len(provider.requests) == 4  # the 4th proposal stopped the run; the 5th was never asked for
    # the warning reached the 3rd model call only, and never the transcript
    assert [bool(notices(r.messages)) for r in provider.requests] == [False, False, True, False]
    assert notices(provider.requests[2].messages)[0].startswith(
        f'{NOTICE_PREFIX} You called fetch_report {{"quarter":"Q3","report":"sales"}} 2 times in a row')
    assert notices(result.messages) == []
    assert [(d["action"], d["turn"]) for d in mw.detections(ctx)] == [("warn", 3), ("block", 3), ("stop", 4)]


async def test_a_model_that_listens_after_the_denial_can_still_finish() -> None:
    step = {"tool": "ping", "args": {"host": "a"}, "result": "timeout"}
    result, tools, _, _, _ = await run_steps([step] * 3, final="The host does not answer.")
    assert len(tools.executed) == 2 and len(denials(result)) == 1
    assert result.stop.reason is StopReason.COMPLETED and result.output == "The host does not answer."


async def test_a_pattern_of_two_calls() -> None:
    a = {"tool": "read", "args": {"path": "x"}, "result": "same"}
    b = {"tool": "build", "args": {}, "result": "error: x"}
    result, tools, provider, mw, ctx = await run_steps([a, b, a, b, a, b])
    assert [n for n, _ in tools.executed] == ["read", "build", "read", "build", "read"]
    assert [bool(notices(r.messages)) for r in provider.requests] == [False] * 4 + [True, False, False]
    (notice,) = notices(provider.requests[4].messages)
    assert 'repeated the sequence read {"path":"x"} -> build {} 2 times' in notice
    (denied,) = denials(result)
    assert "read {\"path\":\"x\"} -> build {} already ran 2 times in a row (as a sequence)" in denied.text
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block"]
    assert result.stop.reason is StopReason.COMPLETED  # the scripted model gave up after the denial


async def test_max_blocks_zero_stops_at_the_first_repeat() -> None:
    steps = B22["tp_same_call_same_result"]["steps"]
    result, tools, _, _, _ = await run_steps(steps, LoopDetection(max_blocks=0))
    assert len(tools.executed) == 2 and denials(result) == []
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.error["blocked"] == 0  # type: ignore[index]


async def test_parallel_repeats_in_one_turn_are_denied_and_only_a_later_turn_stops() -> None:
    call = ("fetch", {"q": "1"})
    tools = Recorded([{"tool": "fetch", "args": {"q": "1"}, "result": "same"}] * 2)
    script = [tool_call_response(call), tool_call_response(call), tool_call_response(call, call),
              tool_call_response(call), "never"]
    provider = ScriptedProvider(script)
    result = await Agent(provider, tools=tools.tools, middleware=[LoopDetection()]).run("go")
    assert len(tools.executed) == 2
    assert len(denials(result)) == 2  # both calls of the 3rd turn; the model had not seen a denial yet
    assert result.stop.reason is StopReason.FAILED_TERMINAL and len(provider.requests) == 4


async def test_parallel_calls_are_recorded_in_proposal_order() -> None:
    finished: list[str] = []
    slow_first = {0: "a", 1: "b"}  # turn 1: "a" finishes last; turn 2: "b" finishes last

    async def step(name: str) -> str:
        turn = sum(1 for f in finished if f == name)
        await asyncio.sleep(0.05 if slow_first[turn] == name else 0)
        finished.append(name)
        return f"{name}: same"

    tools = [Tool(step, name="step", parameters={"type": "object", "properties": {"name": {"type": "string"}}})]
    pair = tool_call_response(("step", {"name": "a"}), ("step", {"name": "b"}))
    provider = ScriptedProvider([pair, tool_call_response(("step", {"name": "a"}), ("step", {"name": "b"})), "ok"])
    await Agent(provider, tools=tools, middleware=[LoopDetection()]).run("go")
    assert finished == ["b", "a", "a", "b"]
    # proposal order a, b, a, b is two repetitions of one pattern, whatever order they finished in
    assert notices(provider.requests[2].messages)


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
    notice = [m for m in provider.requests[2].messages if m.text.startswith(NOTICE_PREFIX)]
    assert len(notice) == 1  # the model was warned first


# -- progress versus no progress, alternation through denials, resume (issue 8 item 4) ---------------
# Seed 000 §5.4.2: a window of 12 call signatures, patterns of length 1-3, "the same pattern 3 times in
# a row". Defaults here: warned after 2 repetitions, the proposal that makes the 3rd is denied, the next
# one in the loop (after the model saw that denial) stops the run.

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
    result, ran, provider, mw, ctx = await _run_names(["job"] * 6, {"job": ["10%", "20%", "20%"]})
    assert ran == ["job"] * 3  # 10%, 20%, 20%; the 4th proposal is denied, the 5th stops the run
    assert [(d["action"], d["turn"]) for d in mw.detections(ctx)] == [("warn", 4), ("block", 4), ("stop", 5)]
    assert [bool(notices(r.messages)) for r in provider.requests] == [False, False, False, True, False]
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error == {"kind": "loop_detected", "pattern": ["job {}"], "blocked": 1, "executed_in_loop": 2}


@pytest.mark.parametrize(("max_blocks", "executed", "proposals", "actions"), [
    (1, 2, 4, ["warn", "block", "stop"]),          # the defaults: 3rd proposal denied, 4th stops
    (2, 2, 5, ["warn", "block", "block", "stop"]),  # one more denial seen before the stop
    (0, 2, 3, ["warn", "stop"]),                    # no denial: the 3rd proposal stops
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
    assert ran == ["toggle"] * 5  # on, off, on, off, on; the 6th is denied, the 7th stops
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block", "stop"]
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.detail.startswith("loop detected: toggle {} -> toggle {} already ran 2 times in a row "
                                         "(as a sequence) with the same result each time ('off'; 'on')")


async def test_a_pattern_counts_only_when_its_results_repeat_too() -> None:
    # check, wait, check, wait ...: "wait" always says the same, but "check" makes progress, so the
    # length-2 pattern is not a loop (and "wait" is never repeated twice in a row)
    checks = [f"{n} of 9 replicas ready" for n in range(1, 10)]
    names = ["check", "wait"] * 8
    result, ran, provider, mw, ctx = await _run_names(names, {"check": checks, "wait": ["waited 5s"]})
    assert ran == names and mw.detections(ctx) == []
    assert result.stop.reason is StopReason.COMPLETED


async def test_alternation_stops_by_the_third_repetition_through_its_own_denial() -> None:
    # a, b, a, b, a, b(denied), a: before this fix the denied b fell out of the history and the loop
    # went on for two more repetitions
    result, ran, provider, mw, ctx = await _run_names(["a", "b"] * 8)
    assert ran == ["a", "b", "a", "b", "a"]
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block", "stop"]
    assert len(provider.requests) == 7 and result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error == {"kind": "loop_detected", "pattern": ["b {}", "a {}"], "blocked": 1,
                                 "executed_in_loop": 5}


class DenyNamed(Middleware):
    """A policy that denies every call to the named tools."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def on_tool_call(self, call: ToolUseBlock, ctx: Any) -> Any:
        from fsm_agent import Deny
        return Deny(f"{call.name} is not allowed here") if call.name in self.names else None


async def test_alternation_with_a_policy_denying_every_other_call_stops_by_the_third_repetition() -> None:
    # a runs, b is denied by a policy before loop detection sees it: a, b(denied) x3, then a stops the run
    result, ran, provider, mw, ctx = await _run_names(["a", "b"] * 8, extra=(DenyNamed("b"),))
    assert ran == ["a", "a", "a"]
    assert len(provider.requests) == 7  # the 4th repetition's first call ended the run
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "stop"]
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.detail.startswith("loop detected: b {} -> a {} was proposed 3 times in a row (as a sequence)")
    assert "1 repeat(s) were denied or answered without running" in result.stop.detail


async def test_alternation_with_both_calls_denied_by_a_policy_stops_in_pre_turn() -> None:
    # loop detection never gets to block: after 4 repetitions of denied a, b the run stops before the next call
    result, ran, provider, mw, ctx = await _run_names(["a", "b"] * 8, extra=(DenyNamed("a", "b"),))
    assert ran == [] and len(provider.requests) == 8
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "stop"]
    assert result.stop.detail.startswith("loop detected: a {} -> b {} was proposed 4 times in a row")


async def test_a_cycle_of_three_calls() -> None:
    results = {"read": ["def f(): ..."], "edit": ["1 line changed"], "test": ["FAILED test_f"]}
    result, ran, provider, mw, ctx = await _run_names(["read", "edit", "test"] * 5, results)
    assert ran == ["read", "edit", "test"] * 2 + ["read", "edit"]  # the 3rd "test" is denied, then "read" stops
    assert [bool(notices(r.messages)) for r in provider.requests] == [False] * 6 + [True] + [False] * 3
    (notice,) = notices(provider.requests[6].messages)
    assert "repeated the sequence read {} -> edit {} -> test {} 2 times in a row" in notice
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block", "stop"]
    assert len(provider.requests) == 10 and result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["pattern"] == ["edit {}", "test {}", "read {}"]  # type: ignore[index]


async def test_a_cycle_of_three_calls_that_makes_progress_is_not_a_loop() -> None:
    results = {"read": ["def f(): ..."], "edit": ["1 line changed"],
               "test": [f"{n} of 5 tests pass" for n in range(1, 6)]}
    result, ran, _, mw, ctx = await _run_names(["read", "edit", "test"] * 5, results)
    assert len(ran) == 15 and mw.detections(ctx) == [] and result.stop.reason is StopReason.COMPLETED


async def test_denials_of_one_turn_count_once_for_a_cycle_too() -> None:
    # a, b | a, b | a, b(denied) in parallel pairs: the model had not seen the denial when it proposed b
    tools, ran = _alternating(["a", "b"], {})
    pair = tool_call_response(("a", {}), ("b", {}))
    provider = ScriptedProvider([pair, tool_call_response(("a", {}), ("b", {})), tool_call_response(("a", {}), ("b", {})),
                                 tool_call_response(("a", {})), "never"])
    mw = LoopDetection()
    agent = Agent(provider, tools=tools, middleware=[mw])
    ctx = agent.new_context([UserMessage("go")])
    result = await agent.driver(ctx).run()
    assert ran == ["a", "b", "a", "b", "a"] and len(denials(result)) == 1
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block", "stop"]
    assert len(provider.requests) == 4


# -- resume: the history is rebuilt from the transcript ----------------------------------------------
async def test_a_resumed_run_remembers_the_repeats_before_it() -> None:
    steps = B22["tp_same_call_same_result"]["steps"]
    tools = Recorded(steps)
    provider = ScriptedProvider([tool_call_response((s["tool"], s["args"])) for s in steps] + ["done"])
    agent = Agent(provider, tools=tools.tools, middleware=[LoopDetection()], config=RunConfig(max_iterations=2))
    paused = await agent.run("report", session_id="loop-resume")
    assert paused.stop.reason is StopReason.PAUSED_BUDGET and len(tools.executed) == 2
    resumed = await agent.resume("loop-resume", max_iterations=10)
    # the first proposal after the resume is the 3rd in a row: denied, not run; the next one stops the run
    assert len(tools.executed) == 2 and len(denials(resumed)) == 1
    assert resumed.stop.reason is StopReason.FAILED_TERMINAL
    assert "after a warning, 1 repeat(s) were denied" in resumed.stop.detail
    assert notices(provider.requests[2].messages)  # warned again in the resumed run's first model call


async def test_a_fresh_run_over_the_same_transcript_continues_the_count() -> None:
    steps = [{"tool": "fetch", "args": {"q": "x"}, "result": "same"}] * 2
    first, tools, _, _, _ = await run_steps(steps, final="stopping here")
    # the same transcript minus the final answer, driven by a new context (what a resume does)
    transcript = [m for m in first.messages if not (m.role == "assistant" and m.text == "stopping here")]
    provider = ScriptedProvider([tool_call_response(("fetch", {"q": "x"})), "gave up"])
    mw = LoopDetection()
    agent = Agent(provider, tools=tools.tools, middleware=[mw])
    ctx = agent.new_context(list(transcript))
    result = await agent.driver(ctx).run()
    assert len(tools.executed) == 2 and len(denials(result)) == 1  # not run a 3rd time
    assert [d["action"] for d in mw.detections(ctx)] == ["warn", "block"]


async def test_a_new_user_message_starts_a_fresh_history() -> None:
    steps = [{"tool": "fetch", "args": {"q": "x"}, "result": "same"}] * 4
    first, tools, _, _, _ = await run_steps(steps[:2], final="the server is down")
    provider = ScriptedProvider([tool_call_response(("fetch", {"q": "x"})), "up now"])
    mw = LoopDetection()
    agent = Agent(provider, tools=tools.tools, middleware=[mw])
    ctx = agent.new_context([*first.messages, UserMessage("It is back up, try once more.")])
    result = await agent.driver(ctx).run()
    assert len(tools.executed) == 3 and denials(result) == [] and mw.detections(ctx) == []
    assert result.stop.reason is StopReason.COMPLETED
