"""Verifier: callable and model-graded checks decide COMPLETED or another try, record evidence in the
stop, and stop the run after too many rejections; runs against scripted models and the real llama.cpp."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from conftest import Recorder
from fsm_agent import (
    Agent,
    RunConfig,
    ScriptedProvider,
    StopReason,
    SystemMessage,
    UserMessage,
    tool,
)
from fsm_agent.errors import AuthenticationError, ServerError
from fsm_agent.providers import tool_call_response
from fsm_agent.types import ModelStreamEvent, TextDelta, Usage
from fsm_agent_middleware.redaction import Redaction
from fsm_agent_middleware.verifier import GRADER_INSTRUCTIONS, VERDICT_FORMAT, ModelGrader, Verdict, Verifier, parse_verdict

FEEDBACK = "Your answer did not pass verification: {}\nFix it and answer again."


def must_be_42(ctx: Any) -> Verdict:
    text = ctx.last_response.text.strip()
    if text == "42":
        return Verdict(True, "exact match", ("check:answer==42",))
    return Verdict(False, f"expected 42, got {text!r}", (f"check:rejected:{text}",))


async def run(provider: Any, *middleware: Any, task: str = "What is 6 x 7?", recorder: Recorder | None = None,
              tools: tuple[Any, ...] | None = None, **cfg: Any) -> tuple[Any, Any]:
    agent = Agent(provider, tools=[echo] if tools is None else tools, middleware=list(middleware),
                  observers=[recorder] if recorder else [], config=RunConfig(**cfg))
    ctx = agent.new_context([UserMessage(task)])
    result = await agent.driver(ctx).run()
    return result, ctx


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


async def test_callable_check_rejects_with_feedback_then_completes_with_evidence() -> None:
    provider = ScriptedProvider(["forty-two", "42"])
    rec = Recorder()
    result, ctx = await run(provider, Verifier(must_be_42), recorder=rec)
    assert result.stop.reason is StopReason.COMPLETED and result.turns == 2
    assert result.stop.evidence_refs == ("check:answer==42",)
    assert result.stop.detail == "verified: exact match (decided by verifier)"
    assert result.messages[2] == UserMessage(FEEDBACK.format("expected 42, got 'forty-two'"))
    assert provider.requests[1].messages[-1] == result.messages[2]  # the model saw the feedback
    assert ("PostTurn", "next_turn", "PreTurn") in rec.transitions()
    assert rec.transitions()[-1] == ("PostTurn", "complete", "COMPLETED")
    assert ctx.state("verifier")["rejections"] == 1


async def test_async_checks_and_only_turns_without_tool_calls_are_judged() -> None:
    seen: list[str] = []

    async def check(ctx: Any) -> Verdict:
        seen.append(ctx.last_response.text)
        return Verdict(True, evidence=("async-check",))

    provider = ScriptedProvider([tool_call_response(("echo", {"text": "x"}), text="let me echo"), "done"])
    result, _ = await run(provider, Verifier(check))
    assert seen == ["done"]  # the tool turn was not judged
    assert result.stop.reason is StopReason.COMPLETED and result.stop.evidence_refs == ("async-check",)


async def test_too_many_rejections_wait_for_a_human_with_all_evidence() -> None:
    provider = ScriptedProvider(["a", "b", "c", "never asked"])
    rec = Recorder()
    result, _ = await run(provider, Verifier(must_be_42, max_rejections=2), recorder=rec)
    assert len(provider.requests) == 3
    assert result.stop.reason is StopReason.WAITING_HUMAN and result.stop.resumable
    assert result.stop.detail == "the verifier rejected 3 answer(s); last reason: expected 42, got 'c'"
    assert result.stop.evidence_refs == ("check:rejected:a", "check:rejected:b", "check:rejected:c")
    assert result.stop.required_decision == "accept the last answer, or resume with guidance for the model"
    assert rec.transitions()[-1] == ("PostTurn", "wait_human", "WAITING_HUMAN")


async def test_on_exhausted_fail_ends_failed_terminal_with_the_reasons() -> None:
    result, _ = await run(ScriptedProvider(["41"]), Verifier(must_be_42, max_rejections=0, on_exhausted="fail"))
    assert result.stop.reason is StopReason.FAILED_TERMINAL and not result.stop.resumable
    assert result.stop.error == {"kind": "verification_failed",
                                 "message": "the verifier rejected 1 answer(s); last reason: expected 42, got '41'",
                                 "reasons": ["expected 42, got '41'"]}
    assert result.stop.evidence_refs == ("check:rejected:41",)


async def test_a_check_that_returns_garbage_fails_closed() -> None:
    result, _ = await run(ScriptedProvider(["42"]), Verifier(lambda ctx: True))
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.detail == ("middleware 'verifier' failed in post_turn: TypeError: the verifier's check "
                                  "returned bool, not a Verdict")


@pytest.mark.parametrize("text,expected", [
    ('{"ok": true, "reason": "fine"}', (True, "fine")),
    ('```json\n{"ok": false, "reason": "no units"}\n```', (False, "no units")),
    ('Verdict: {"ok": "TRUE", "reason": "ok"} -- done', (True, "ok")),
    ('{"ok": " false ", "reason": "wrong"}', (False, "wrong")),
    ('{"ok": false}', (False, "")),
    ('{"ok": 1, "reason": "x"}', None),
    ("yes", None),
    ("[true]", None),
])
def test_parse_verdict_is_tolerant_but_never_guesses(text: str, expected: Any) -> None:
    assert parse_verdict(text) == expected


async def test_model_graded_check_with_a_separate_grader() -> None:
    grader = ScriptedProvider(['{"ok": false, "reason": "no units given"}',
                               '```json\n{"ok": true, "reason": "states 42 km"}\n```'], model="grader-model")
    main = ScriptedProvider(["42", "42 km"])
    rec = Recorder()
    mg = ModelGrader(grader)
    result, ctx = await run(main, Verifier(mg), task="How far is it?", recorder=rec)
    assert result.stop.reason is StopReason.COMPLETED and result.output == "42 km"
    first = grader.requests[0]
    assert first.response_format == VERDICT_FORMAT and first.model == "grader-model"
    assert first.temperature == 0.0 and first.max_tokens == 200
    assert first.messages == (SystemMessage(GRADER_INSTRUCTIONS), UserMessage("TASK:\nHow far is it?\n\nANSWER:\n42"))
    assert grader.requests[1].messages[1] == UserMessage("TASK:\nHow far is it?\n\nANSWER:\n42 km")
    assert main.requests[1].messages[-1] == UserMessage(FEEDBACK.format("no units given"))
    calls = ctx.state(mg)["calls"]
    assert [c["verdict"] for c in calls] == [(False, "no units given"), (True, "states 42 km")]
    assert result.stop.evidence_refs == (f"grader:scripted/scripted:{calls[1]['response_id']}",
                                         "grader verdict ok=true: states 42 km")
    assert result.usage == Usage(40, 20)  # 2 answers + 2 gradings of (10 in, 5 out): budgets see the grader
    grader_deltas = [e.event.text for e in rec.of(ModelStreamEvent) if isinstance(e.event, TextDelta)]
    assert '{"ok": false, "reason": "no units given"}' in grader_deltas  # streamed through the runtime


async def test_model_graded_check_with_the_runs_own_provider() -> None:
    provider = ScriptedProvider(["Paris", '{"ok": true, "reason": "correct capital"}'])
    result, _ = await run(provider, Verifier(ModelGrader()), task="Capital of France?")
    assert result.stop.reason is StopReason.COMPLETED
    assert provider.requests[1].response_format == VERDICT_FORMAT and provider.requests[1].tools == ()
    assert result.stop.detail == "verified: correct capital (decided by verifier)"


async def test_unreadable_grader_replies_are_asked_again_then_fail_closed() -> None:
    grader = ScriptedProvider(["I think so", '{"ok": true, "reason": "fine"}'])
    result, _ = await run(ScriptedProvider(["42"]), Verifier(ModelGrader(grader)))
    assert result.stop.reason is StopReason.COMPLETED and len(grader.requests) == 2
    grader = ScriptedProvider(["I think so"], repeat_last=True)
    result, _ = await run(ScriptedProvider(["42"]), Verifier(ModelGrader(grader, attempts=2)))
    assert result.stop.reason is StopReason.FAILED_TERMINAL and len(grader.requests) == 2
    assert result.stop.detail == "verifier: the grader gave no readable verdict in 2 attempt(s); last reply: 'I think so'"
    assert result.stop.error == {"kind": "verifier_unreadable", "message": "I think so"}


async def test_grader_call_failures_stop_the_run_by_retryability() -> None:
    bad_key = ScriptedProvider([AuthenticationError("bad key", provider="grader", status=401)])
    result, _ = await run(ScriptedProvider(["42"]), Verifier(ModelGrader(bad_key)))
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.error["kind"] == "authentication"
    busy = ScriptedProvider([ServerError("busy", provider="grader", status=503)])
    result, _ = await run(ScriptedProvider(["42"]), Verifier(ModelGrader(busy)))
    assert result.stop.reason is StopReason.WAITING_HUMAN and result.stop.error["kind"] == "server_error"
    assert result.stop.required_decision == "the answer could not be verified: accept it, or resume to verify again"


async def test_the_grader_sees_what_the_model_saw_under_redaction() -> None:
    grader = ScriptedProvider(['{"ok": true, "reason": "greeting sent"}'])
    await run(ScriptedProvider(["Hello [REDACTED:email:1]!"]), Verifier(ModelGrader(grader)), Redaction(),
              task="Greet alice@example.com")
    assert grader.requests[0].messages[1] == UserMessage(
        "TASK:\nGreet [REDACTED:email:1]\n\nANSWER:\nHello [REDACTED:email:1]!")


def test_repr_and_validation() -> None:
    v = Verifier(ModelGrader(ScriptedProvider([], model="judge")), max_rejections=1, on_exhausted="fail", name="judge")
    assert repr(v) == ("Verifier(check=ModelGrader(provider='scripted:judge', max_tokens=200, temperature=0.0, "
                       "attempts=2), max_rejections=1, on_exhausted='fail')")
    assert v.middleware_name == "judge" and Verifier(must_be_42).middleware_name == "verifier"
    with pytest.raises(ValueError, match="on_exhausted must be 'human' or 'fail'"):
        Verifier(must_be_42, on_exhausted="retry")




@pytest.mark.llama
async def test_callable_check_on_the_real_local_model(local_provider: Any) -> None:
    answers: list[str] = []

    def second_answer_passes(ctx: Any) -> Verdict:
        answers.append(ctx.last_response.text)
        if len(answers) == 1:
            return Verdict(False, "answer in one short sentence", ("check:first-rejected",))
        return Verdict(True, "second answer accepted", ("check:second-accepted",))

    # no tools: the tiny model, offered one, keeps calling it and never ends a turn to be judged
    result, _ = await run(local_provider, Verifier(second_answer_passes), task="What is the capital of France?",
                          tools=(), max_output_tokens=40, temperature=0.0, max_wall_clock=200.0)
    assert result.stop.reason is StopReason.COMPLETED and result.turns == 2
    assert len(answers) == 2 and all(a.strip() for a in answers)
    assert result.messages[2] == UserMessage(FEEDBACK.format("answer in one short sentence"))
    assert result.stop.evidence_refs == ("check:second-accepted",)
    assert result.output == answers[1]


@pytest.mark.llama
async def test_model_graded_verdict_from_the_real_local_model(local_provider: Any) -> None:
    mg = ModelGrader(local_provider)
    result, ctx = await run(ScriptedProvider(["Paris is the capital of France."]),
                            Verifier(mg, max_rejections=0, on_exhausted="fail"), task="What is the capital of France?",
                            tools=())
    (call,) = ctx.state(mg)["calls"]
    wire = orjson.loads(call["raw"])  # the schema is enforced by grammar: the reply is the JSON object itself
    assert set(wire) == {"ok", "reason"} and isinstance(wire["ok"], bool)
    assert call["verdict"] == (wire["ok"], wire["reason"])
    if wire["ok"]:
        assert result.stop.reason is StopReason.COMPLETED
        assert result.stop.evidence_refs[1] == f"grader verdict ok=true: {wire['reason']}"
    else:
        assert result.stop.reason is StopReason.FAILED_TERMINAL
        assert result.stop.error["reasons"] == [wire["reason"]]
