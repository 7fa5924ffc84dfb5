"""Budget: finer budgets stop PAUSED_BUDGET at a PreTurn, warnings come once per budget, tool limits
deny in MidTurn, the wrap-up turn answers or pauses; the core's own checks are not repeated."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from conftest import Recorder
from fsm_agent import (
    Agent,
    ConfigurationError,
    Middleware,
    RunConfig,
    ScriptedProvider,
    StopReason,
    ToolResultMessage,
    UserMessage,
    tool,
)
from fsm_agent.pricing import Price, register_price
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.tools.demo import calculator
from fsm_agent.types import BudgetWarning, Usage
from fsm_agent_middleware.budget import DEFAULT_WRAP_UP_MESSAGE, Budget


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@tool
def ping() -> str:
    """Answer pong."""
    return "pong"


def call(name: str = "echo", **args: Any) -> Any:
    return tool_call_response((name, args or ({"text": "x"} if name == "echo" else {})))


def calls(n: int) -> list[Any]:
    """``n`` tool-call turns, each with its own call id (the ledger never runs one id twice)."""
    return [call() for _ in range(n)]


async def run(script: list[Any], budget: Budget, **cfg: Any) -> tuple[Any, Recorder, ScriptedProvider]:
    rec = Recorder()
    provider = ScriptedProvider(script)
    result = await Agent(provider, tools=[echo, ping], middleware=[budget], observers=[rec],
                         config=RunConfig(**cfg)).run("go")
    return result, rec, provider


def warnings(rec: Recorder) -> list[tuple[str, float, float, int]]:
    return [(w.budget, w.used, w.limit, w.turn) for w in rec.of(BudgetWarning)]


def tool_texts(result: Any) -> list[tuple[str, bool]]:
    return [(m.text, m.is_error) for m in result.messages if isinstance(m, ToolResultMessage)]


async def test_model_call_limit_pauses_at_pre_turn_with_the_detail() -> None:
    result, rec, _ = await run(calls(5), Budget(max_model_calls=2))
    assert result.stop.reason is StopReason.PAUSED_BUDGET
    assert result.stop.budget == "model_calls"
    assert result.stop.detail == "model_calls budget exhausted: 2 of 2 model calls used"
    assert result.stop.resumable and result.stop.last_safe_point == "PreTurn"
    assert result.turns == 2 and result.tool_calls == 2
    assert rec.transitions()[-1] == ("PreTurn", "pause_budget", "PAUSED_BUDGET")
    # 0.8 * 2 = 1.6: the one warning comes at 2 calls, in the PreTurn that stops
    assert warnings(rec) == [("model_calls", 2, 2, 2)]


async def test_warning_is_emitted_once_per_budget_at_the_soft_threshold() -> None:
    result, rec, _ = await run(calls(9), Budget(max_model_calls=5, max_output_tokens=100, soft_threshold=0.6))
    assert result.stop.detail == "model_calls budget exhausted: 5 of 5 model calls used"
    # model calls: 3 >= 0.6 * 5 at the 4th PreTurn; output tokens: 25 of 100 never reach 60
    assert warnings(rec) == [("model_calls", 3, 5, 3)]


async def test_soft_threshold_none_emits_no_warnings() -> None:
    result, rec, _ = await run(calls(5), Budget(max_model_calls=2, soft_threshold=None))
    assert result.stop.budget == "model_calls" and rec.of(BudgetWarning) == []


async def test_core_budgets_get_warnings_but_the_core_does_the_stop() -> None:
    result, rec, _ = await run(calls(9), Budget(soft_threshold=0.6), max_iterations=5, max_tokens=1000)
    # the stop is the core's own (detail and budget name from the driver), not a second check
    assert result.stop.detail == "iterations budget exhausted: 5 of 5 model calls used"
    assert warnings(rec) == [("iterations", 3, 5, 3)]  # tokens: 75 of 1000, far from 600
    result, rec, _ = await run(calls(9), Budget(soft_threshold=0.6, warn_core=False), max_iterations=5)
    assert result.stop.budget == "iterations" and rec.of(BudgetWarning) == []


async def test_limit_shadowed_by_the_core_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fsm_agent.middleware.budget"):
        result, _, _ = await run(calls(9), Budget(max_iterations=3, wrap_up=True), max_iterations=3)
    assert [r.getMessage() for r in caplog.records] == [
        "Budget max_iterations=3 is not below RunConfig.max_iterations=3: the core stops the run first, "
        "without this middleware's wrap-up"]
    assert result.stop.detail == "iterations budget exhausted: 3 of 3 model calls used"  # core, no wrap-up


async def test_own_iteration_limit_below_the_core() -> None:
    result, _, _ = await run(calls(9), Budget(max_iterations=2), max_iterations=10)
    assert (result.stop.budget, result.turns) == ("iterations", 2)
    assert result.stop.detail == "iterations budget exhausted: 2 of 2 model calls used"


async def test_per_tool_limit_denies_the_call_and_the_model_sees_why() -> None:
    script = [call(), call(), call(), call("ping"), "done"]
    result, rec, _ = await run(script, Budget(max_calls_per_tool={"echo": 2}))
    assert result.stop.reason is StopReason.COMPLETED  # a per-tool limit denies, it does not pause
    assert result.tool_calls == 3
    assert tool_texts(result) == [
        ("x", False), ("x", False),
        ("Tool call denied by policy (budget): tool_calls:echo budget exhausted: 2 of 2 echo calls used; "
         "do not call echo again in this run", True),
        ("pong", False)]
    assert warnings(rec) == [("tool_calls:echo", 2, 2, 2)]


async def test_parallel_calls_of_one_turn_cannot_overshoot_a_tool_limit() -> None:
    three = tool_call_response(("echo", {"text": "a"}), ("echo", {"text": "b"}), ("echo", {"text": "c"}))
    result, _, _ = await run([three, "done"], Budget(max_calls_per_tool={"echo": 2}))
    assert result.tool_calls == 2
    assert [e for _, e in tool_texts(result)] == [False, False, True]


async def test_total_tool_limit_denies_in_mid_turn_then_pauses() -> None:
    two = [tool_call_response(("echo", {"text": "a"}), ("ping", {})) for _ in range(2)]
    result, rec, _ = await run([*two, "never"], Budget(max_tool_calls=3))
    assert result.stop.reason is StopReason.PAUSED_BUDGET
    assert result.stop.detail == "tool_calls budget exhausted: 3 of 3 tool calls used"
    assert result.tool_calls == 3 and result.turns == 2
    assert tool_texts(result)[-1] == (
        "Tool call denied by policy (budget): tool_calls budget exhausted: 3 of 3 tool calls used; "
        "no more tool calls in this run", True)
    assert warnings(rec) == [("tool_calls", 3, 3, 2)]


@pytest.mark.parametrize("option,budget,stop_turn,detail", [
    ("max_input_tokens", "input_tokens", 3, "input_tokens budget exhausted: 30 of 25 input tokens used"),
    ("max_output_tokens", "output_tokens", 2, "output_tokens budget exhausted: 10 of 10 output tokens used"),
    ("max_total_tokens", "tokens", 2, "tokens budget exhausted: 30 of 20 tokens used"),
])
async def test_token_budgets(option: str, budget: str, stop_turn: int, detail: str) -> None:
    result, _, _ = await run(calls(9), Budget(**{option: {"input_tokens": 25, "output_tokens": 10,
                                                               "tokens": 20}[budget]}))
    assert (result.stop.budget, result.turns, result.stop.detail) == (budget, stop_turn, detail)


async def test_estimated_token_counts_are_flagged_in_the_detail() -> None:
    no_usage = [tool_call_response(("echo", {"text": "x"}), usage=None) for _ in range(3)]
    result, _, _ = await run(no_usage, Budget(max_total_tokens=1))
    assert result.stop.detail.endswith(" tokens used (partly estimated)")


async def test_cost_budget_in_usd() -> None:
    register_price("budget-test-model", Price(1_000_000.0, 0.0, date="2026-11-30", source="test"))  # $1 per token
    priced = [tool_call_response(("echo", {"text": "x"}), usage=Usage(2, 0), model="budget-test-model")
              for _ in range(9)]
    result, _, _ = await run(priced, Budget(max_cost_usd=3.0))
    assert (result.stop.budget, result.turns) == ("cost", 2)
    assert result.stop.detail == "cost budget exhausted: 4.0000 of 3.0000 USD used"


async def test_cost_budget_with_an_unpriced_model_is_logged_not_enforced(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fsm_agent.middleware.budget"):
        result, _, _ = await run([call(), call(), "done"], Budget(max_cost_usd=0.5))
    assert result.stop.reason is StopReason.COMPLETED
    assert [r.getMessage() for r in caplog.records] == [
        "cost budget of 0.5 USD cannot be enforced: a model of this run has no known price"]


async def test_wall_clock_budget_in_seconds() -> None:
    rec = Recorder()
    provider = ScriptedProvider(calls(9), delay=0.2)
    result = await Agent(provider, tools=[echo], middleware=[Budget(max_wall_clock=0.1)],
                         observers=[rec]).run("go")
    assert (result.stop.budget, result.turns) == ("wall_clock", 1)  # one call of 0.2 s outlasts 0.1 s
    assert result.stop.detail.startswith("wall_clock budget exhausted: 0.")
    assert result.stop.detail.endswith(" of 0.1 s used")


async def test_wrap_up_turn_answers_without_tools_and_completes() -> None:
    budget = Budget(max_model_calls=1, wrap_up=True)
    result, rec, provider = await run([call(), text_response("best answer so far")], budget)
    assert result.stop.reason is StopReason.COMPLETED
    assert result.stop.detail == ("answered in the wrap-up turn (model_calls budget exhausted: 1 of 1 model "
                                  "calls used) (decided by budget)")
    assert result.output == "best answer so far" and result.turns == 2
    first, last = provider.requests
    assert [t.name for t in first.tools] == ["echo", "ping"] and last.tools == ()
    assert last.messages[-1] == UserMessage(DEFAULT_WRAP_UP_MESSAGE.format(
        budget="model_calls", detail="model_calls budget exhausted: 1 of 1 model calls used"))
    # the instruction was context for that call only, not part of the transcript
    assert not any(isinstance(m, UserMessage) and "Tools are now disabled" in m.text for m in result.messages)


async def test_wrap_up_turn_that_still_wants_tools_pauses() -> None:
    result, rec, _ = await run([call(), call(), "never"], Budget(max_model_calls=1, wrap_up=True))
    assert result.stop.reason is StopReason.PAUSED_BUDGET and result.stop.budget == "model_calls"
    assert result.stop.detail == ("model_calls budget exhausted: 1 of 1 model calls used; after the wrap-up turn "
                                  "(tools disabled) the model still wanted to continue")
    assert result.tool_calls == 1  # the wrap-up turn's call was denied, not run
    assert tool_texts(result)[-1] == (
        "Tool call denied by policy (budget): tools are disabled in the wrap-up turn (model_calls budget "
        "exhausted: 1 of 1 model calls used); answer with what you have", True)
    assert rec.transitions()[-1] == ("PreTurn", "pause_budget", "PAUSED_BUDGET")


class _Attempts(Middleware):
    """An outer layer that calls the rest of the chain twice (like a retry)."""

    name = "retry"

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        await call_next(request)
        return await call_next(request)


async def test_model_calls_count_attempts_of_an_outer_retry_layer() -> None:
    provider = ScriptedProvider(calls(9))
    # listed after Budget, but Budget declares it sits inside RetryFallback
    agent = Agent(provider, tools=[echo], middleware=[Budget(max_model_calls=4), _Attempts()])
    assert [m.middleware_name for m in agent.middleware] == ["retry", "budget"]
    result = await agent.run("go")
    assert (result.stop.detail, result.turns, len(provider.requests)) == (
        "model_calls budget exhausted: 4 of 4 model calls used", 2, 4)


@pytest.mark.parametrize("kw,message", [
    ({"max_model_calls": -1}, "Budget: max_model_calls must be an integer >= 0 or None, not -1"),
    ({"max_tool_calls": 1.5}, "Budget: max_tool_calls must be an integer >= 0 or None, not 1.5"),
    ({"max_cost_usd": "1"}, "Budget: max_cost_usd must be a number >= 0 or None, not '1'"),
    ({"max_calls_per_tool": {"echo": True}}, "Budget: max_calls_per_tool['echo'] must be an integer >= 0 or None"),
    ({"soft_threshold": 1.5}, "Budget: soft_threshold must be in (0, 1] or None, not 1.5"),
    ({"soft_threshold": 0}, "Budget: soft_threshold must be in (0, 1] or None, not 0"),
])
def test_invalid_options_fail_at_construction(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as exc:
        Budget(**kw)
    assert str(exc.value).startswith(message)


def test_repr_shows_the_options() -> None:
    assert repr(Budget(max_model_calls=2, max_calls_per_tool={"echo": 1}, max_cost_usd=0.5, wrap_up=True)) == (
        "Budget(max_model_calls=2, max_cost_usd=0.5, max_calls_per_tool={'echo': 1}, soft_threshold=0.8, "
        "warn_core=True, wrap_up=True)")


# -- the real local model ----------------------------------------------------------------------




@pytest.mark.llama
async def test_llama_two_model_calls_then_paused(local_provider: Any) -> None:
    rec = Recorder()
    # tool_choice "required": the constrained schema only admits tool calls, so the tiny model loops on them
    cfg = RunConfig(tool_choice="required", temperature=0.0, max_output_tokens=100, max_iterations=10)
    result = await Agent(local_provider, tools=[calculator], middleware=[Budget(max_model_calls=2)],
                         observers=[rec], config=cfg).run("Use the calculator to compute 17 * 23.")
    assert result.stop.reason is StopReason.PAUSED_BUDGET
    assert result.stop.budget == "model_calls"
    assert result.stop.detail == "model_calls budget exhausted: 2 of 2 model calls used"
    assert result.turns == 2 and result.tool_calls == 2
    assert warnings(rec) == [("model_calls", 2, 2, 2)]
    assert rec.transitions()[-1] == ("PreTurn", "pause_budget", "PAUSED_BUDGET")


@pytest.mark.llama
async def test_llama_wrap_up_turn_has_no_tools_and_answers(local_provider: Any) -> None:
    seen: list[Any] = []

    class Spy(Middleware):
        async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
            seen.append(request)
            return await call_next(request)

    cfg = RunConfig(tool_choice="required", temperature=0.0, max_output_tokens=100, max_iterations=10)
    budget = Budget(max_model_calls=1, wrap_up=True)
    result = await Agent(local_provider, tools=[calculator], middleware=[Spy(), budget], config=cfg).run(
        "Use the calculator to compute 17 * 23.")
    assert [len(r.tools) for r in seen] == [1, 0]
    assert result.turns == 2 and result.tool_calls == 1
    # without tools the constrained mode is off: the model can only answer in text
    assert result.stop.reason is StopReason.COMPLETED
    assert result.stop.detail == ("answered in the wrap-up turn (model_calls budget exhausted: 1 of 1 model "
                                  "calls used) (decided by budget)")


async def test_budget_warnings_are_kept_in_the_session_log() -> None:
    from fsm_agent import MemoryStore

    store = MemoryStore()
    agent = Agent(ScriptedProvider(calls(5)), tools=[echo, ping], middleware=[Budget(max_tool_calls=4)], store=store)
    result = await agent.run("go", session_id="warned")
    logged = [e.payload for e in await store.read_events("warned") if e.type == "budget_warning"]
    assert [(w["budget"], w["used"], w["limit"]) for w in logged] == [("tool_calls", 4, 4)]
    assert result.stop.reason is StopReason.PAUSED_BUDGET and result.stop.budget == "tool_calls"
