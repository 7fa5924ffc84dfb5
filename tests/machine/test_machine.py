"""The machine: the table is the single source, every row is exercised by a real run, budgets stop
at the right point, observers cannot change a run."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conftest import Recorder
from fsm_agent import (
    Agent,
    AskApproval,
    Middleware,
    RunConfig,
    ScriptedProvider,
    StopReason,
    StopRun,
    tool,
)
from attrs import evolve

from fsm_agent.errors import ContextLengthExceededError, InvalidRequestError, ServerError
from fsm_agent.machine.state import RunState
from fsm_agent.machine import TRANSITIONS, IllegalTransition, MachineState, Phase, Trigger
from fsm_agent.machine.definition import machine
from fsm_agent.pricing import Price, register_price
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.types import AssistantMessage, MessageResponse, ModelStopReason, TextBlock, Usage

@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


def agent(script: list[Any], *, middleware: tuple[Middleware, ...] = (), recorder: Recorder | None = None,
          **cfg: Any) -> Agent:
    observers = [recorder] if recorder is not None else []
    return Agent(ScriptedProvider(script), tools=[echo], middleware=middleware, observers=observers,
                 config=RunConfig(**cfg))


async def run(script: list[Any], **kw: Any) -> tuple[Any, Recorder]:
    rec = Recorder()
    result = await agent(script, recorder=rec, **kw).run("go")
    return result, rec


def test_table_rows_are_all_legal_in_the_transitions_machine() -> None:
    m = machine()
    for t in TRANSITIONS:
        s = MachineState(t.source)
        assert s.fire(t.trigger) == t.dest
    with pytest.raises(IllegalTransition, match="no transition 'complete' from 'PreTurn'"):
        MachineState(Phase.PRE_TURN).fire(Trigger.COMPLETE)
    # terminals are final states; no automatic to_* transitions exist
    assert all(m.get_state(s).final for s in StopReason)
    assert not hasattr(MachineState(), "to_PreTurn")


def test_every_trigger_is_used_and_every_state_reachable() -> None:
    assert {t.trigger for t in TRANSITIONS} == set(Trigger)
    reachable = {Phase.IDLE} | {t.dest for t in TRANSITIONS}
    assert reachable == {*Phase, *StopReason}


async def test_complete_without_tools() -> None:
    result, rec = await run(["hello"])
    assert result.stop.reason is StopReason.COMPLETED
    assert result.output == "hello"
    assert rec.transitions() == [
        ("Idle", "start", "PreTurn"),
        ("PreTurn", "call_model", "Model"),
        ("Model", "model_done", "PostTurn"),
        ("PostTurn", "complete", "COMPLETED"),
    ]


async def test_tool_turn_then_answer() -> None:
    result, rec = await run([tool_call_response(("echo", {"text": "x"})), "done"])
    assert result.stop.reason is StopReason.COMPLETED
    assert ("Model", "tool_use", "MidTurn") in rec.transitions()
    assert ("MidTurn", "tools_done", "PostTurn") in rec.transitions()
    assert ("PostTurn", "next_turn", "PreTurn") in rec.transitions()
    assert result.tool_calls == 1 and result.turns == 2


async def test_iterations_budget_pauses_at_the_limit() -> None:
    result, rec = await run([tool_call_response(("echo", {"text": "x"}))] * 10, max_iterations=3)
    assert result.stop.reason is StopReason.PAUSED_BUDGET
    assert result.stop.budget == "iterations"
    assert result.turns == 3
    assert result.stop.detail == "iterations budget exhausted: 3 of 3 model calls used"
    assert result.stop.resumable and result.stop.last_safe_point == "PreTurn"
    assert rec.transitions()[-1] == ("PreTurn", "pause_budget", "PAUSED_BUDGET")


async def test_wall_clock_budget_pauses_after_the_time() -> None:
    script = [tool_call_response(("echo", {"text": "x"}))] * 20
    rec = Recorder()
    provider = ScriptedProvider(script, delay=0.3)
    result = await Agent(provider, tools=[echo], observers=[rec],
                         config=RunConfig(max_wall_clock=0.75)).run("go")
    assert result.stop.reason is StopReason.PAUSED_BUDGET
    assert result.stop.budget == "wall_clock"
    # 0.3 s per call: 0.6 s after two calls (under 0.75 s, with 0.15 s to spare for the runtime),
    # 0.9 s after the third: exactly 3 calls were made
    assert result.turns == 3
    assert result.duration_s >= 0.75
    assert "wall-clock budget exhausted" in result.stop.detail


async def test_wall_clock_running_out_during_the_model_call_pauses_in_model() -> None:
    rec = Recorder()
    result = await Agent(ScriptedProvider(["too late"], delay=5.0), observers=[rec],
                         config=RunConfig(max_wall_clock=0.2)).run("go")
    assert result.stop.reason is StopReason.PAUSED_BUDGET and result.stop.budget == "wall_clock"
    assert rec.transitions()[-1] == ("Model", "pause_budget", "PAUSED_BUDGET")
    assert "during the model call" in result.stop.detail and result.duration_s < 2.0


async def test_token_budget_counts_input_and_output() -> None:
    r = tool_call_response(("echo", {"text": "x"}), usage=Usage(10, 5))
    result, _ = await run([r] * 10, max_tokens=40)
    assert result.stop.reason is StopReason.PAUSED_BUDGET
    assert result.stop.budget == "tokens"
    assert result.turns == 3  # 15, 30, 45 >= 40
    assert result.usage.total_tokens == 45


async def test_cost_budget_uses_the_price_table() -> None:
    register_price("priced-model", Price(1_000_000.0, 0.0, date="2026-11-30", source="test"))  # $1 per input token
    r = tool_call_response(("echo", {"text": "x"}), usage=Usage(2, 0), model="priced-model")
    result, _ = await run([r] * 10, max_cost_usd=5.0)
    assert result.stop.reason is StopReason.PAUSED_BUDGET
    assert result.stop.budget == "cost"
    assert result.cost_usd == pytest.approx(6.0)
    assert result.turns == 3


async def test_budget_order_follows_seed_000() -> None:
    # iterations and tokens both exhausted: iterations is checked first
    r = tool_call_response(("echo", {"text": "x"}), usage=Usage(100, 100))
    result, _ = await run([r] * 5, max_iterations=1, max_tokens=10)
    assert result.stop.budget == "iterations"


class _PreTurnStop(Middleware):
    def __init__(self, reason: StopReason) -> None:
        self.reason = reason

    def pre_turn(self, ctx: Any) -> None:
        raise StopRun(self.reason, f"pre_turn asked for {self.reason.value}")


class _Broken(Middleware):
    def __init__(self, hook: str) -> None:
        self.hook = hook

    def pre_turn(self, ctx: Any) -> None:
        if self.hook == "pre_turn":
            raise RuntimeError("boom")

    def on_tool_call(self, call: Any, ctx: Any) -> None:
        if self.hook == "on_tool_call":
            raise RuntimeError("boom")

    def post_turn(self, ctx: Any) -> None:
        if self.hook == "post_turn":
            raise RuntimeError("boom")


async def test_pre_turn_can_wait_for_a_human() -> None:
    result, rec = await run(["x"], middleware=(_PreTurnStop(StopReason.WAITING_HUMAN),))
    assert result.stop.reason is StopReason.WAITING_HUMAN
    assert rec.transitions()[-1] == ("PreTurn", "wait_human", "WAITING_HUMAN")


@pytest.mark.parametrize("hook,phase", [("pre_turn", "PreTurn"), ("on_tool_call", "MidTurn"), ("post_turn", "PostTurn")])
async def test_fail_closed_middleware_fails_the_run(hook: str, phase: str) -> None:
    result, rec = await run([tool_call_response(("echo", {"text": "x"})), "done"], middleware=(_Broken(hook),))
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert rec.transitions()[-1] == (phase, "fail_terminal", "FAILED_TERMINAL")
    assert f"middleware '_Broken' failed in {hook}: RuntimeError: boom" in result.stop.detail


async def test_context_length_error_retries_once_via_pre_turn() -> None:
    err = ContextLengthExceededError("too long", provider="scripted", limit=100, requested=120)
    result, rec = await run([err, "fits now"])
    assert result.stop.reason is StopReason.COMPLETED
    assert ("Model", "retry_context", "PreTurn") in rec.transitions()
    # twice in a row: FAILED_TERMINAL with the error kind
    err2 = ContextLengthExceededError("still too long", provider="scripted")
    result, _ = await run([err, err2])
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["kind"] == "context_length_exceeded"


async def test_input_plus_max_tokens_error_lowers_max_tokens_first() -> None:
    err = ContextLengthExceededError("x", limit=200000, input_tokens=179413, max_tokens_requested=32768)
    provider = ScriptedProvider([err, "ok"])
    result = await Agent(provider, config=RunConfig(max_output_tokens=32768)).run("go")
    assert result.stop.reason is StopReason.COMPLETED
    assert provider.requests[1].max_tokens == 20587
    assert provider.requests[1].messages == provider.requests[0].messages


async def test_provider_errors_map_to_retryable_or_terminal() -> None:
    result, rec = await run([ServerError("upstream 500", provider="scripted", status=500)])
    assert result.stop.reason is StopReason.FAILED_RETRYABLE and result.stop.resumable
    assert rec.transitions()[-1] == ("Model", "fail_retryable", "FAILED_RETRYABLE")
    assert result.stop.error["kind"] == "server_error"
    result, rec = await run([InvalidRequestError("bad temperature", provider="scripted", status=400)])
    assert result.stop.reason is StopReason.FAILED_TERMINAL and not result.stop.resumable
    assert rec.transitions()[-1] == ("Model", "fail_terminal", "FAILED_TERMINAL")


async def test_content_filtered_and_refusal_fail_terminal() -> None:
    filtered = MessageResponse("r", "m", AssistantMessage(()), ModelStopReason.CONTENT_FILTERED, "content_filter")
    result, _ = await run([filtered])
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["kind"] == "content_filtered"
    refused = MessageResponse("r", "m", AssistantMessage(()), ModelStopReason.REFUSAL, "stop", refusal="I can't help")
    result, _ = await run([refused])
    assert result.stop.detail == "the model refused: I can't help"


async def test_max_tokens_completes_with_a_partial_answer_noted() -> None:
    cut = MessageResponse("r", "m", AssistantMessage((TextBlock("The answer is"),)), ModelStopReason.MAX_TOKENS, "length")
    result, _ = await run([cut])
    assert result.stop.reason is StopReason.COMPLETED
    assert result.model_stop_reason is ModelStopReason.MAX_TOKENS
    assert "max_tokens" in result.stop.detail and result.output == "The answer is"


class _Approve(Middleware):
    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        return AskApproval("needs a human")


async def test_mid_turn_waits_for_approval_with_pending_actions() -> None:
    result, rec = await run([tool_call_response(("echo", {"text": "x"}))], middleware=(_Approve(),))
    assert result.stop.reason is StopReason.WAITING_HUMAN
    assert rec.transitions()[-1] == ("MidTurn", "wait_human", "WAITING_HUMAN")
    (pending,) = result.stop.pending_actions
    assert pending.call.name == "echo" and pending.call.input == {"text": "x"}
    assert result.stop.last_safe_point == "MidTurn"
    assert result.tool_calls == 0  # nothing ran


class _PostTurnHuman(Middleware):
    def post_turn(self, ctx: Any) -> None:
        raise StopRun(StopReason.WAITING_HUMAN, "verifier wants a person to look")


async def test_post_turn_can_wait_for_a_human() -> None:
    result, rec = await run(["x"], middleware=(_PostTurnHuman(),))
    assert rec.transitions()[-1] == ("PostTurn", "wait_human", "WAITING_HUMAN")
    assert result.stop.detail == "verifier wants a person to look"


class _StopIn(Middleware):
    """Raises StopRun(reason) in the given phase's hook."""

    def __init__(self, phase: str, reason: StopReason) -> None:
        self.phase, self.reason = phase, reason

    def pre_turn(self, ctx: Any) -> None:
        if self.phase == "PreTurn":
            raise StopRun(self.reason, "control")

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        if self.phase == "Model":
            raise StopRun(self.reason, "control")
        return await call_next(request)

    def on_tool_call(self, call: Any, ctx: Any) -> None:
        if self.phase == "MidTurn":
            raise StopRun(self.reason, "control")

    def post_turn(self, ctx: Any) -> None:
        if self.phase == "PostTurn":
            raise StopRun(self.reason, "control")


@pytest.mark.parametrize("reason", [StopReason.INTERRUPTED, StopReason.CANCELLED])
@pytest.mark.parametrize("phase", ["PreTurn", "Model", "MidTurn", "PostTurn"])
async def test_control_stops_from_every_phase(phase: str, reason: StopReason) -> None:
    result, rec = await run([tool_call_response(("echo", {"text": "x"})), "done"], middleware=(_StopIn(phase, reason),))
    assert result.stop.reason is reason
    trigger = "interrupt" if reason is StopReason.INTERRUPTED else "cancel"
    assert rec.transitions()[-1] == (phase, trigger, reason.value)
    assert result.stop.resumable is (reason is StopReason.INTERRUPTED)


async def test_a_stop_the_table_forbids_fails_closed() -> None:
    result, _ = await run(["x"], middleware=(_StopIn("PostTurn", StopReason.PAUSED_BUDGET),))
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert "does not allow it" in result.stop.detail


async def test_cancelling_the_task_records_interrupted() -> None:
    rec = Recorder()
    provider = ScriptedProvider(["never"], delay=5)
    task = asyncio.ensure_future(Agent(provider, observers=[rec]).run("go"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rec.transitions()[-1] == ("Model", "interrupt", "INTERRUPTED")


@pytest.mark.parametrize("terminal", [StopReason.WAITING_HUMAN, StopReason.PAUSED_BUDGET,
                                      StopReason.INTERRUPTED, StopReason.FAILED_RETRYABLE])
async def test_resume_rows_from_resumable_terminals(terminal: StopReason) -> None:
    rec = Recorder()
    a = agent(["resumed answer"], recorder=rec)
    ctx = a.new_context([])
    ctx._set_machine(MachineState(terminal))
    result = await a.driver(ctx).run(Trigger.RESUME, "resume")
    assert rec.transitions()[0] == (terminal.value, "resume", "PreTurn")
    assert result.stop.reason is StopReason.COMPLETED


@pytest.mark.parametrize("terminal", [StopReason.WAITING_HUMAN, StopReason.INTERRUPTED])
async def test_resume_tools_rows(terminal: StopReason) -> None:
    rec = Recorder()
    a = agent(["after tools"], recorder=rec)
    pending = tool_call_response(("echo", {"text": "resumed"}))
    ctx = a.new_context([pending.message], state=RunState(pending_calls=list(pending.tool_calls)))
    ctx._set_machine(MachineState(terminal))
    result = await a.driver(ctx).run(Trigger.RESUME_TOOLS, "resume tools")
    assert rec.transitions()[:2] == [(terminal.value, "resume_tools", "MidTurn"), ("MidTurn", "tools_done", "PostTurn")]
    assert result.messages[-2].text == "resumed"  # the tool ran
    assert result.stop.reason is StopReason.COMPLETED


async def _resumed(terminal: StopReason, trigger: Trigger) -> list[tuple[str, str, str]]:
    """A context left in ``terminal`` driven on with ``trigger`` (a pending tool call for RESUME_TOOLS)."""
    rec = Recorder()
    a = agent(["resumed answer"], recorder=rec)
    pending = tool_call_response(("echo", {"text": "resumed"}))
    if trigger is Trigger.RESUME_TOOLS:
        ctx = a.new_context([pending.message], state=RunState(pending_calls=list(pending.tool_calls)))
    else:
        ctx = a.new_context([])
    ctx._set_machine(MachineState(terminal))
    await a.driver(ctx).run(trigger, "resume")
    return rec.transitions()


async def _scenario_transitions() -> set[tuple[str, str, str]]:
    """Drive one real run per kind of path and collect every transition they take."""
    echo_call = lambda: tool_call_response(("echo", {"text": "x"}))  # noqa: E731
    runs: list[tuple[list[Any], dict[str, Any]]] = [
        (["hello"], {}),                                            # start, call_model, model_done, complete
        ([echo_call(), "done"], {}),                                # tool_use, tools_done, next_turn
        ([echo_call()] * 3, {"max_iterations": 1}),                 # PreTurn pause_budget
        (["x"], {"middleware": (_PreTurnStop(StopReason.WAITING_HUMAN),)}),
        ([ContextLengthExceededError("too long", provider="scripted"), "fits now"], {}),
        ([evolve(echo_call(), stop_reason=ModelStopReason.MAX_TOKENS), "done"], {}),   # retry_output
        ([InvalidRequestError("bad", provider="scripted", status=400)], {}),
        ([ServerError("upstream 500", provider="scripted", status=500)], {}),
        ([echo_call()], {"middleware": (_Approve(),)}),
        (["x"], {"middleware": (_PostTurnHuman(),)}),
        *(([echo_call(), "done"], {"middleware": (_Broken(hook),)}) for hook in ("pre_turn", "on_tool_call", "post_turn")),
        *(([echo_call(), "done"], {"middleware": (_StopIn(phase, reason),)})
          for phase in ("PreTurn", "Model", "MidTurn", "PostTurn")
          for reason in (StopReason.INTERRUPTED, StopReason.CANCELLED)),
    ]
    seen: set[tuple[str, str, str]] = set()
    for script, kw in runs:
        _, rec = await run(script, **kw)
        seen.update(rec.transitions())
    rec = Recorder()  # the wall clock runs out while the model call is in flight
    await Agent(ScriptedProvider(["too late"], delay=5.0), observers=[rec], config=RunConfig(max_wall_clock=0.1)).run("go")
    seen.update(rec.transitions())
    for terminal in (StopReason.WAITING_HUMAN, StopReason.PAUSED_BUDGET, StopReason.INTERRUPTED,
                     StopReason.FAILED_RETRYABLE):
        seen.update(await _resumed(terminal, Trigger.RESUME))
    for terminal in (StopReason.WAITING_HUMAN, StopReason.INTERRUPTED):
        seen.update(await _resumed(terminal, Trigger.RESUME_TOOLS))
    return seen


async def test_every_row_of_the_table_is_exercised_by_a_real_run() -> None:
    """Self-contained: drives its own scenarios (no state left by other tests), fails for a row none takes."""
    rows = {(t.source.value, t.trigger.value, t.dest.value) for t in TRANSITIONS}
    seen = await _scenario_transitions()
    assert not seen - rows, f"transitions outside the table: {sorted(seen - rows)}"
    missing = rows - seen
    assert not missing, f"rows no scenario exercised: {sorted(missing)}"


class _Boom:
    def on_transition(self, ev: Any) -> None:
        raise RuntimeError("observer bug")

    def on_model_event(self, ev: Any) -> None:
        raise ValueError("observer bug")


async def test_an_observer_that_raises_never_changes_the_run(caplog: pytest.LogCaptureFixture) -> None:
    script = lambda: [tool_call_response(("echo", {"text": "x"}), usage=Usage(3, 4)), text_response("ok", usage=Usage(3, 4))]  # noqa: E731
    clean = await Agent(ScriptedProvider(script()), tools=[echo]).run("go", session_id="s1")
    noisy = await Agent(ScriptedProvider(script()), tools=[echo], observers=[_Boom()]).run("go", session_id="s1")
    from attrs import evolve

    assert clean.stop.checkpoint_id and noisy.stop.checkpoint_id
    assert evolve(noisy.stop, checkpoint_id=None) == evolve(clean.stop, checkpoint_id=None)
    assert noisy.output == clean.output and noisy.usage == clean.usage and noisy.turns == clean.turns
    assert "observer bug" in caplog.text


async def test_transition_events_are_typed_and_ordered() -> None:
    rec = Recorder()
    await Agent(ScriptedProvider(["hi"]), observers=[rec]).run("go", session_id="abc")
    from fsm_agent.types import TransitionEvent

    evs = rec.of(TransitionEvent)
    assert [e.session_id for e in evs] == ["abc"] * 4
    assert [e.turn for e in evs] == [0, 0, 1, 1]
    assert all(b.ts >= a.ts for a, b in zip(evs, evs[1:]))
    assert evs[2].reason == "model stop reason end_turn"
