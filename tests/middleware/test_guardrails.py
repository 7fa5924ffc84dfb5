"""Guardrails beside the model and the tools: input guardrails run beside the model call that first
sees a user input (a tripwire cancels it), output guardrails withhold an answer, tool guardrails reject or stop per call,
failures follow fail_closed / fail_open, a model-asking guardrail goes through the run's effects
(replayed without calling its model), and every guardrail run is an event in the log."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from attrs import evolve

from conftest import Recorder
from fsm_agent import (
    Agent,
    ConfigurationError,
    Followup,
    MemoryStore,
    Middleware,
    Observer,
    PolicyDecision,
    RunConfig,
    ScriptedProvider,
    StopReason,
    ToolResultMessage,
    tool,
)
from fsm_agent.errors import GuardrailTripwireTriggered, StopRun
from fsm_agent.providers import tool_call_response
from fsm_agent.testing import EffectRecording
from fsm_agent.types import ModelStreamEvent, TextDelta
from fsm_agent_middleware.guardrails import (
    GuardrailChecked,
    GuardrailResult,
    Guardrails,
    input_guardrail,
    llm_guardrail,
    output_guardrail,
    parse_tripwire,
    tool_input_guardrail,
    tool_output_guardrail,
)

GUARD_WAIT = 60.0
"""A guardrail that waits for the model call to start gives up after this many seconds (so that an
engine that ran guardrails before the call fails the test instead of hanging); never reached."""


class Gated(ScriptedProvider):
    """A slow model: each call starts, then waits for ``release`` before it answers. Counts the calls
    that completed and those that were cancelled while waiting."""

    def __init__(self, script: list[Any]) -> None:
        super().__init__(script)
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.finished = asyncio.Event()
        self.completed = 0
        self.cancelled = 0

    async def _gate(self) -> None:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def chat(self, request):
        await self._gate()
        response = await super().chat(request)
        self.completed += 1
        self.finished.set()
        return response

    async def chat_stream(self, request):
        await self._gate()
        async for event in super().chat_stream(request):
            yield event
        self.completed += 1
        self.finished.set()


class Guarded(Observer):
    """Keeps the guardrail events the observers get (as plugin events)."""

    def __init__(self) -> None:
        self.checked: list[GuardrailChecked] = []

    def on_plugin_event(self, event: Any) -> None:
        if isinstance(event, GuardrailChecked):
            self.checked.append(event)


tool_runs: list[str] = []


@tool
def read_file(path: str) -> str:
    """Read a file."""
    tool_runs.append(path)
    return f"contents of {path}: password=hunter2"


@pytest.fixture(autouse=True)
def _fresh_tool_runs() -> None:
    tool_runs.clear()


async def logged(store: MemoryStore, session_id: str, type: str) -> list[dict]:
    return [e.payload for e in await store.read_events(session_id) if e.type == type]


def agent_with(provider: Any, *guardrails: Any, observers: tuple[Any, ...] = (), **kw: Any) -> Agent:
    return Agent(provider, tools=[read_file], middleware=[Guardrails(*guardrails)], observers=list(observers),
                 store=kw.pop("store", MemoryStore()), **kw)


# -- input ----------------------------------------------------------------------------------------------
@input_guardrail
def no_homework(ctx, text: str) -> GuardrailResult:
    if "homework" in text:
        return GuardrailResult.tripped("asks for homework help", {"matched": "homework"})
    return GuardrailResult.passed()


async def test_an_input_tripwire_stops_the_run_with_a_typed_stop_naming_the_guardrail() -> None:
    store, recorder = MemoryStore(), Recorder()
    provider = ScriptedProvider(["Here is your homework answer."])
    result = await agent_with(provider, no_homework, store=store, observers=(recorder,)).run(
        "Do my homework", session_id="s")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error == {"kind": "guardrail_tripwire", "guardrail": "no_homework", "guardrail_kind": "input",
                                 "message": "asks for homework help", "info": {"matched": "homework"}}
    assert "input guardrail 'no_homework' tripped: asks for homework help" in result.stop.detail
    assert result.output == "" and [m.role for m in result.messages] == ["user"]  # the answer is discarded
    assert [(d.middleware, d.decision, d.stop_reason) for d in recorder.of(PolicyDecision)] == \
        [("guardrails", "stop", "FAILED_TERMINAL")]
    [ev] = await logged(store, "s", "guardrail")
    assert (ev["guardrail"], ev["kind"], ev["outcome"], ev["tripped"], ev["action"], ev["parallel"]) == \
        ("no_homework", "input", "tripped", True, "stop", True)
    assert ev["duration_s"] >= 0


async def test_an_input_guardrail_runs_beside_the_model_call_and_its_tripwire_cancels_the_call() -> None:
    provider = Gated(["too late"])  # never released: only a guardrail running beside it can end the run

    @input_guardrail(timeout=GUARD_WAIT)
    async def trips_while_the_model_runs(ctx, text):
        await provider.started.wait()  # the model call is in flight
        return GuardrailResult.tripped("blocked")

    store, seen = MemoryStore(), Guarded()
    result = await agent_with(provider, trips_while_the_model_runs, store=store, observers=(seen,)).run(
        "hi", session_id="s")
    assert result.stop.error["kind"] == "guardrail_tripwire"
    assert result.stop.error["guardrail"] == "trips_while_the_model_runs"
    assert (provider.completed, provider.cancelled) == (0, 1)  # the model call was cut, not awaited
    assert result.output == "" and result.turns == 1
    types = [e.type for e in await store.read_events("s")]
    assert "guardrail" in types and "model_call" not in types  # the tripwire came first; no answer recorded
    assert [(c.outcome, c.parallel) for c in seen.checked] == [("tripped", True)]


async def test_a_passing_input_guardrail_runs_while_the_model_call_is_in_flight() -> None:
    provider = Gated(["Paris."])
    order: list[str] = []

    @input_guardrail(timeout=GUARD_WAIT)
    async def passes_while_the_model_runs(ctx, text):
        await provider.started.wait()
        order.append(f"guardrail passed, model calls completed: {provider.completed}")
        provider.release.set()  # only now may the model answer
        return GuardrailResult.passed()

    result = await agent_with(provider, passes_while_the_model_runs).run("Capital of France?")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "Paris."
    assert order == ["guardrail passed, model calls completed: 0"]
    assert (provider.completed, provider.cancelled) == (1, 0)


async def test_an_answer_that_comes_first_waits_for_the_input_guardrail_and_is_discarded_on_a_trip() -> None:
    provider = Gated(["an answer"])
    provider.release.set()

    @input_guardrail(timeout=GUARD_WAIT)
    async def slow_check(ctx, text):
        await provider.finished.wait()  # the model has answered already
        return GuardrailResult.tripped("found late")

    result = await agent_with(provider, slow_check).run("hi")
    assert provider.completed == 1
    assert result.stop.error["guardrail"] == "slow_check"
    assert result.output == "" and all(m.role != "assistant" for m in result.messages)


async def test_a_blocking_input_guardrail_runs_before_the_model_is_called() -> None:
    provider = ScriptedProvider(["never asked"])
    blocking = input_guardrail(no_homework.fn, name="blocking_homework", run_in_parallel=False)
    result = await agent_with(provider, blocking).run("my homework please")
    assert result.stop.error["guardrail"] == "blocking_homework"
    assert provider.requests == []  # no token spent


async def test_with_guardrails_that_pass_the_run_is_what_it_is_without_them() -> None:
    script = [tool_call_response(("read_file", {"path": "a.txt"})), "The file is read."]
    calls: list[str] = []

    @input_guardrail
    def fine(ctx, text):
        calls.append(f"input:{text}")
        return GuardrailResult.passed()

    @output_guardrail
    async def fine_out(ctx, text):
        calls.append(f"output:{text}")
        return GuardrailResult.passed()

    @tool_input_guardrail
    def fine_call(ctx, call):
        calls.append(f"tool_input:{call.name}")
        return GuardrailResult.passed()

    @tool_output_guardrail
    def fine_result(ctx, out):
        calls.append(f"tool_output:{out.call.name}")
        return GuardrailResult.passed()

    plain_provider, guarded_provider = ScriptedProvider(list(script)), ScriptedProvider(list(script))
    plain = await Agent(plain_provider, tools=[read_file]).run("read a.txt", session_id="s")
    guarded = await agent_with(guarded_provider, fine, fine_out, fine_call, fine_result).run("read a.txt",
                                                                                               session_id="s")
    assert evolve(guarded.stop, checkpoint_id=None) == evolve(plain.stop, checkpoint_id=None)
    assert guarded.messages == plain.messages and guarded.output == plain.output
    assert (guarded.turns, guarded.tool_calls, guarded.usage) == (plain.turns, plain.tool_calls, plain.usage)
    assert guarded_provider.requests == plain_provider.requests
    # input once (first call), each tool guardrail once per call, output on the final answer only
    assert calls == ["input:read a.txt", "tool_input:read_file", "tool_output:read_file",
                     "output:The file is read."]


async def test_a_followup_sent_while_the_run_goes_on_is_checked_and_can_trip() -> None:
    seen: list[str] = []

    @input_guardrail
    def no_passwords_asked(ctx, text):
        seen.append(text)
        return GuardrailResult("password" in text, message="asks for a password")

    provider = ScriptedProvider([tool_call_response(("read_file", {"path": "a"})), "Read it.", "never sent"])
    agent = agent_with(provider, no_passwords_asked)

    class QueueFollowup(Middleware):
        async def wrap_model_call(self, request, call_next, ctx):
            if ctx.turn == 1:
                await agent.control(ctx.session_id, Followup("Now tell me the admin password"))
            return await call_next(request)

    agent.add_middleware(QueueFollowup())
    result = await agent.run("read a", session_id="f")
    # checked: the input (turn 1), not the turn that goes on from tool results, then the followup
    assert seen == ["read a", "Now tell me the admin password"]
    assert result.stop.error["guardrail"] == "no_passwords_asked" and result.output == "Read it."
    assert all(m.text != "never sent" for m in result.messages)  # the followup's answer is discarded


async def test_a_resume_that_goes_on_from_tool_results_does_not_check_the_input_again() -> None:
    seen: list[str] = []

    @input_guardrail
    def counted(ctx, text):
        seen.append(text)
        return GuardrailResult.passed()

    store = MemoryStore()
    agent = agent_with(ScriptedProvider([tool_call_response(("read_file", {"path": "a"})), "done"]), counted,
                       store=store)
    first = await agent.run("read a", session_id="s", max_iterations=1)
    assert first.stop.reason is StopReason.PAUSED_BUDGET
    again = await agent.resume("s", max_iterations=5)
    assert again.stop.reason is StopReason.COMPLETED
    assert seen == ["read a"]


# -- output ---------------------------------------------------------------------------------------------
@output_guardrail
def no_secrets(ctx, text: str) -> GuardrailResult:
    return GuardrailResult("hunter2" in text, {"length": len(text)}, "the answer leaks a password")


async def test_an_output_tripwire_withholds_the_answer_and_stops_the_run() -> None:
    store = MemoryStore()
    provider = ScriptedProvider([tool_call_response(("read_file", {"path": "pw.txt"})), "The password is hunter2."])
    result = await agent_with(provider, no_secrets, store=store).run("What is in pw.txt?", session_id="s")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["kind"] == "guardrail_tripwire" and result.stop.error["guardrail_kind"] == "output"
    assert result.stop.error["guardrail"] == "no_secrets"
    assert result.output != "The password is hunter2."
    assert not any(m.role == "assistant" and "hunter2" in m.text for m in result.messages)
    events = await logged(store, "s", "guardrail")
    assert [(e["kind"], e["outcome"]) for e in events] == [("output", "tripped")]  # not on the tool-call turn
    assert events[0]["info"] == {"length": len("The password is hunter2.")}


async def test_a_guardrail_may_raise_the_typed_tripwire_instead_of_returning_it() -> None:
    @output_guardrail(name="raiser")
    def raiser(ctx, text):
        raise GuardrailTripwireTriggered("not allowed", info=["x"])

    result = await agent_with(ScriptedProvider(["an answer"]), raiser).run("hi")
    assert result.stop.error == {"kind": "guardrail_tripwire", "guardrail": "raiser", "guardrail_kind": "output",
                                 "message": "not allowed", "info": ["x"]}
    assert isinstance(GuardrailTripwireTriggered("m"), StopRun)


# -- tools ----------------------------------------------------------------------------------------------
@tool_input_guardrail(tools=["read_file"])
def no_etc(ctx, call) -> GuardrailResult:
    if call.input.get("path", "").startswith("/etc/"):
        return GuardrailResult.tripped("system files are off limits", {"path": call.input["path"]})
    return GuardrailResult.passed()


async def test_a_tool_input_guardrail_rejects_the_call_with_a_reason_the_model_reads() -> None:
    provider = ScriptedProvider([tool_call_response(("read_file", {"path": "/etc/shadow"})), "I may not read it."])
    result = await agent_with(provider, no_etc).run("read /etc/shadow")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "I may not read it."
    assert tool_runs == []  # the tool did not run
    [denied] = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert denied.is_error
    assert "guardrail 'no_etc' rejected this call: system files are off limits" in denied.text
    assert denied in provider.requests[1].messages  # the model read why


async def test_a_tool_input_guardrail_with_on_trip_stop_ends_the_run() -> None:
    stopper = tool_input_guardrail(no_etc.fn, name="no_etc_stop", on_trip="stop")
    provider = ScriptedProvider([tool_call_response(("read_file", {"path": "/etc/shadow"})), "unused"])
    result = await agent_with(provider, stopper).run("read /etc/shadow")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    call = result.messages[1].tool_calls[0]
    assert result.stop.error == {"kind": "guardrail_tripwire", "guardrail": "no_etc_stop",
                                 "guardrail_kind": "tool_input", "message": "system files are off limits",
                                 "info": {"path": "/etc/shadow"}, "tool": "read_file", "call_id": call.id}
    assert tool_runs == [] and len(provider.requests) == 1


async def test_a_tool_guardrail_checks_only_the_tools_it_names() -> None:
    other = tool_input_guardrail(no_etc.fn, name="other_tools_only", tools="write_file")
    provider = ScriptedProvider([tool_call_response(("read_file", {"path": "/etc/hosts"})), "ok"])
    result = await agent_with(provider, other).run("read /etc/hosts")
    assert tool_runs == ["/etc/hosts"] and result.stop.reason is StopReason.COMPLETED


@tool_output_guardrail
def redact_passwords(ctx, out) -> GuardrailResult:
    return GuardrailResult(tripwire="password=" in out.text, message="the output holds a password")


async def test_a_tool_output_guardrail_replaces_the_result_the_model_would_see() -> None:
    store = MemoryStore()
    provider = ScriptedProvider([tool_call_response(("read_file", {"path": "a.txt"})), "It holds a password."])
    result = await agent_with(provider, redact_passwords, store=store).run("read a.txt", session_id="s")
    assert result.stop.reason is StopReason.COMPLETED
    assert tool_runs == ["a.txt"]  # the tool ran
    [withheld] = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert withheld.is_error and "hunter2" not in withheld.text
    assert "withheld by guardrail 'redact_passwords': the output holds a password" in withheld.text
    assert all("hunter2" not in m.text for m in provider.requests[1].messages)
    [ev] = await logged(store, "s", "guardrail")
    assert (ev["kind"], ev["outcome"], ev["action"], ev["tool"]) == ("tool_output", "tripped", "reject", "read_file")


async def test_a_tool_output_guardrail_with_on_trip_stop_ends_the_run_without_the_output() -> None:
    stopper = tool_output_guardrail(redact_passwords.fn, name="stop_on_password", on_trip="stop")
    provider = ScriptedProvider([tool_call_response(("read_file", {"path": "a.txt"})), "unused"])
    result = await agent_with(provider, stopper).run("read a.txt")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["guardrail"] == "stop_on_password" and result.stop.error["tool"] == "read_file"
    assert all("hunter2" not in m.text for m in result.messages)
    assert len(provider.requests) == 1


# -- failures -------------------------------------------------------------------------------------------
def broken(ctx, data):
    raise RuntimeError("classifier offline")


async def test_a_guardrail_that_raises_fails_closed_by_default() -> None:
    store = MemoryStore()
    provider = ScriptedProvider(["an answer"])
    result = await agent_with(provider, input_guardrail(broken, name="classifier"), store=store).run(
        "hi", session_id="s")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error == {"kind": "guardrail_failed", "guardrail": "classifier", "guardrail_kind": "input",
                                 "message": "RuntimeError: classifier offline"}
    assert "input guardrail 'classifier' failed (RuntimeError: classifier offline)" in result.stop.detail
    assert result.output == ""
    [ev] = await logged(store, "s", "guardrail")
    assert (ev["outcome"], ev["tripped"], ev["action"]) == ("failed", False, "stop")


async def test_a_guardrail_that_fails_open_lets_the_run_go_on() -> None:
    store = MemoryStore()
    guardrails = (input_guardrail(broken, name="in", on_error="fail_open"),
                  output_guardrail(broken, name="out", on_error="fail_open"),
                  tool_input_guardrail(broken, name="tin", on_error="fail_open"))
    provider = ScriptedProvider([tool_call_response(("read_file", {"path": "a"})), "an answer"])
    result = await agent_with(provider, *guardrails, store=store).run("hi", session_id="s")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "an answer"
    assert tool_runs == ["a"]
    events = await logged(store, "s", "guardrail")
    assert [(e["guardrail"], e["outcome"], e["action"]) for e in events] == \
        [("in", "failed", "ignored"), ("tin", "failed", "ignored"), ("out", "failed", "ignored")]


async def test_a_failing_reject_type_tool_guardrail_fails_closed_by_rejecting_the_call() -> None:
    provider = ScriptedProvider([tool_call_response(("read_file", {"path": "a"})), "ok"])
    result = await agent_with(provider, tool_input_guardrail(broken, name="checker")).run("read a")
    assert tool_runs == [] and result.stop.reason is StopReason.COMPLETED
    [denied] = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert denied.is_error and "guardrail 'checker' could not check this call" in denied.text


async def test_a_guardrail_that_times_out_or_returns_no_result_follows_its_policy() -> None:
    async def hangs(ctx, text):
        await asyncio.Event().wait()

    store = MemoryStore()
    result = await agent_with(ScriptedProvider(["an answer"]), output_guardrail(hangs, timeout=0.05), store=store
                              ).run("hi", session_id="s")
    assert result.stop.error["kind"] == "guardrail_failed" and result.stop.error["guardrail"] == "hangs"
    assert result.stop.error["message"] == "no result within 0.05 s"
    assert [e["outcome"] for e in await logged(store, "s", "guardrail")] == ["timed_out"]

    result = await agent_with(ScriptedProvider(["an answer"]), output_guardrail(lambda c, t: True, name="bool")
                              ).run("hi")
    assert result.stop.error["kind"] == "guardrail_failed"
    assert "returned bool, not a GuardrailResult" in result.stop.error["message"]


async def test_the_first_guardrail_to_trip_cancels_the_others_of_its_kind() -> None:
    @input_guardrail
    async def forever(ctx, text):
        await asyncio.Event().wait()

    store = MemoryStore()
    result = await agent_with(ScriptedProvider(["x"]), forever, no_homework, store=store).run("homework",
                                                                                               session_id="s")
    assert result.stop.error["guardrail"] == "no_homework"
    events = await logged(store, "s", "guardrail")
    assert sorted((e["guardrail"], e["outcome"]) for e in events) == [("forever", "cancelled"),
                                                                      ("no_homework", "tripped")]


# -- a guardrail that asks a model --------------------------------------------------------------------------
def verdict(trip: bool, reason: str) -> str:
    return f'{{"tripwire": {"true" if trip else "false"}, "reason": "{reason}"}}'


async def test_an_llm_guardrail_asks_its_model_through_the_run_and_can_trip() -> None:
    judge = ScriptedProvider([verdict(True, "homework request")], model="cheap")
    guard = input_guardrail(llm_guardrail(judge, "Trip when the user asks for help with homework."), name="homework")
    result = await agent_with(Gated(["never released"]), guard).run("Solve my homework")
    assert result.stop.error["kind"] == "guardrail_tripwire" and result.stop.error["guardrail"] == "homework"
    assert result.stop.error["message"] == "homework request"
    assert result.stop.error["info"]["reason"] == "homework request"
    [asked] = judge.requests
    assert asked.model == "cheap" and asked.response_format["json_schema"]["name"] == "guardrail"
    assert "Trip when the user asks for help with homework." in asked.messages[0].text
    assert asked.messages[1].text == "CONTENT:\nSolve my homework"


async def test_an_llm_guardrail_beside_the_model_is_not_streamed_as_the_answer_and_is_accounted() -> None:
    judge = ScriptedProvider([verdict(False, "fine")], model="cheap")
    recorder = Recorder()
    guard = input_guardrail(llm_guardrail(judge, "Trip on homework."), name="homework")
    result = await agent_with(ScriptedProvider(["Paris is the capital."]), guard, observers=(recorder,)).run(
        "Capital of France?")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "Paris is the capital."
    answer = "".join(e.event.text for e in recorder.of(ModelStreamEvent)
                     if e.phase == "Model" and isinstance(e.event, TextDelta))
    assert answer == "Paris is the capital."  # the guardrail's JSON is not part of the streamed answer
    assert result.usage.input_tokens == 20 and result.usage.output_tokens == 10  # both calls counted


async def test_an_unreadable_llm_verdict_follows_the_failure_policy() -> None:
    judge = ScriptedProvider(["I think it is fine?"])
    guard = output_guardrail(llm_guardrail(judge, "Trip on secrets."), name="secrets")
    result = await agent_with(ScriptedProvider(["an answer"]), guard).run("hi")
    assert result.stop.error["kind"] == "guardrail_failed"
    assert "holds no verdict" in result.stop.error["message"]
    assert parse_tripwire('```json\n{"tripwire": "true", "reason": "x"}\n```') == (True, "x")
    assert parse_tripwire('{"tripwire": 1}') is None


async def test_a_recorded_run_replays_without_calling_the_guardrail_model_again() -> None:
    def build(judge_script: list[Any], main_script: list[Any]) -> tuple[Agent, ScriptedProvider]:
        judge = ScriptedProvider(judge_script, model="cheap")
        guards = (input_guardrail(llm_guardrail(judge, "Trip on homework."), name="homework"),
                  output_guardrail(llm_guardrail(judge, "Trip on secrets."), name="secrets"),
                  tool_output_guardrail(llm_guardrail(judge, "Trip on passwords."), name="passwords"))
        return agent_with(ScriptedProvider(main_script), *guards), judge

    live, live_judge = build([verdict(False, "ok"), verdict(True, "a password"), verdict(False, "ok")],
                             [tool_call_response(("read_file", {"path": "a"})), "Done."])
    recording = EffectRecording()
    result = await live.run("read a", session_id="r", port=recording.record)
    assert result.stop.reason is StopReason.COMPLETED and len(live_judge.requests) == 3
    assert "withheld by guardrail 'passwords'" in result.messages[2].text

    def boom(request):
        raise AssertionError("a replay called a model")

    replay, replay_judge = build([boom], [boom])
    again = await replay.run("read a", session_id="r", port=recording.replay)
    recording.check()
    assert again == result
    assert replay_judge.requests == []  # every guardrail answer came from the recording
    assert len(tool_runs) == 1


async def test_a_recorded_tripwire_that_cut_the_model_call_replays_the_same_stop() -> None:
    live_main = Gated(["never released"])
    live_judge = ScriptedProvider([verdict(True, "homework request")], model="cheap")
    guard = input_guardrail(llm_guardrail(live_judge, "Trip on homework."), name="homework")
    recording = EffectRecording()
    result = await agent_with(live_main, guard).run("Solve my homework", session_id="r", port=recording.record)
    assert result.stop.error["guardrail"] == "homework" and (live_main.completed, live_main.cancelled) == (0, 1)

    replay_main, replay_judge = Gated(["unused"]), ScriptedProvider([], model="cheap")
    guard = input_guardrail(llm_guardrail(replay_judge, "Trip on homework."), name="homework")
    again = await agent_with(replay_main, guard).run("Solve my homework", session_id="r", port=recording.replay)
    recording.check()
    assert again == result
    assert replay_judge.requests == [] and not replay_main.started.is_set()


# -- construction -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda: input_guardrail(broken, on_trip="reject"), "unexpected keyword"),
    (lambda: tool_input_guardrail(broken, on_trip="ignore"), "on_trip of a tool_input guardrail must be"),
    (lambda: output_guardrail(broken, on_error="maybe"), "on_error must be 'fail_closed' or 'fail_open'"),
    (lambda: output_guardrail(broken, timeout=0), "timeout must be positive"),
    (lambda: input_guardrail(lambda c, t: None), "needs a name"),
    (lambda: Guardrails(broken), "Guardrails takes guardrails made by"),
    (lambda: Guardrails(input_guardrail(broken), output_guardrail(broken)), "two guardrails are named 'broken'"),
    (lambda: llm_guardrail(None, " "), "needs instructions"),
])
def test_bad_guardrails_are_clear_errors(make: Any, message: str) -> None:
    with pytest.raises((ConfigurationError, TypeError), match=message):
        make()


def test_the_plugin_has_its_entry_point_name_and_sits_outside_retry() -> None:
    from fsm_agent_middleware.retry import RetryFallback

    agent = Agent(ScriptedProvider(["x"]), middleware=[RetryFallback(), Guardrails(no_homework)],
                  config=RunConfig())
    assert [m.name for m in agent.middleware][:2] == ["guardrails", "retry"]


def test_the_guide_s_python_blocks_run_in_order(capsys) -> None:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "guardrails.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) >= 8
    namespace: dict[str, Any] = {"__name__": "guardrails_md"}
    for block in blocks:
        exec(compile(block, "docs/guardrails.md", "exec"), namespace)  # noqa: S102 - the guide's own code
    out = capsys.readouterr().out
    assert "input guardrail 'no_homework' tripped: the user asks for homework help" in out
    assert "withheld by guardrail 'withhold_secrets'" in out and "a math homework exercise" in out


async def test_a_guardrail_result_with_a_non_boolean_tripwire_is_a_failure_of_the_guardrail() -> None:
    @output_guardrail
    def says_yes(ctx, text):
        return GuardrailResult("yes")  # type: ignore[arg-type]

    result = await agent_with(ScriptedProvider(["an answer"]), says_yes).run("hi")
    assert result.stop.error["kind"] == "guardrail_failed" and "'tripwire' must be <class 'bool'>" in \
        result.stop.error["message"]
