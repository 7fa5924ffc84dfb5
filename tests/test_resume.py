"""Stop and resume: approvals, budgets, failures, controls (steer, followup, interrupt, cancel),
Hang-Wait, exactly-once tools, races between workers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conftest import Recorder
from fsm_agent import AskApproval, Middleware, RunConfig, ScriptedProvider, StopReason, ToolContext, tool
from fsm_agent.agent import Agent
from fsm_agent.control import Cancel, Decision, Followup, Interrupt, Steer
from fsm_agent.errors import ResumeError, ServerError, SessionEndedError
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.store import LedgerStatus, SQLiteStore
from fsm_agent.types import ToolUseBlock, UserMessage

SENT: list[tuple[str, str]] = []
COMPENSATED: list[str] = []
"""Module-level records of side effects; the autouse ``_reset`` fixture empties them before every test."""


@tool(effect="side_effect")
def send_email(to: str, body: str, ctx: ToolContext) -> str:
    """Send an e-mail."""
    SENT.append((to, body))
    return f"sent to {to}"


@tool
def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q}"


class ApproveEmails(Middleware):
    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        if call.name == "send_email":
            return AskApproval("e-mails need a person's approval")
        return None


@pytest.fixture(params=["memory", "sqlite"])
def store_kind(request, tmp_path):
    from fsm_agent.store import MemoryStore

    return MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "s.db")


@pytest.fixture(autouse=True)
def _reset():
    SENT.clear()
    COMPENSATED.clear()


def email_call(cid: str = "call_mail") -> Any:
    return tool_call_response(ToolUseBlock(cid, "send_email", {"to": "ann@example.com", "body": "hi"}),
                              ToolUseBlock("call_look", "lookup", {"q": "ann"}))


def make(store: Any, script: list[Any], **kw: Any) -> Agent:
    return Agent(ScriptedProvider(script), tools=[send_email, lookup], middleware=[ApproveEmails()], store=store, **kw)


async def waiting(store: Any) -> tuple[Agent, Any]:
    agent = make(store, [email_call(), "All done."])
    result = await agent.run("mail ann", session_id="s1")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    return agent, result


async def test_waiting_human_names_the_pending_call_and_nothing_ran(store_kind) -> None:
    from fsm_agent.types import ApprovalRequested

    asked: list[ApprovalRequested] = []
    agent = make(store_kind, [email_call(), "All done."])
    agent.hooks = type(agent.hooks)([type("Obs", (), {"on_approval_requested": lambda self, e: asked.append(e)})()])
    result = await agent.run("mail ann", session_id="s1")
    assert [p.call.id for e in asked for p in e.pending] == ["call_mail"]
    (p,) = result.stop.pending_actions
    assert p.call.id == "call_mail" and p.reason == "e-mails need a person's approval"
    assert result.stop.last_safe_point == "MidTurn" and result.stop.resumable and result.stop.checkpoint_id
    assert SENT == []
    assert result.tool_calls == 0


@pytest.mark.parametrize("decision,sent,result_text", [
    (Decision.approve(), [("ann@example.com", "hi")], "sent to ann@example.com"),
    (Decision.edit({"to": "bob@example.com", "body": "hello"}), [("bob@example.com", "hello")], "sent to bob@example.com"),
    (Decision.reject("not today"), [], "A person rejected this tool call: not today"),
    (Decision.respond("the mail server is down; do not retry"), [], "the mail server is down; do not retry"),
])
async def test_resume_with_each_decision(store_kind, decision: Decision, sent: list, result_text: str) -> None:
    agent, _ = await waiting(store_kind)
    result = await agent.resume("s1", decisions={"call_mail": decision})
    assert result.stop.reason is StopReason.COMPLETED and result.output == "All done."
    assert SENT == sent
    tool_results = {m.tool_call_id: m for m in result.messages if m.role == "tool"}
    assert tool_results["call_mail"].text == result_text
    assert tool_results["call_mail"].is_error is (decision.kind == "reject")
    assert tool_results["call_look"].text == "found ann"  # the allowed call ran once, after the decision
    # the resumed model call saw both results
    provider = agent.provider
    assert [m.role for m in provider.requests[-1].messages][-3:] == ["assistant", "tool", "tool"]


async def test_invalid_edit_is_reported_not_run(store_kind) -> None:
    agent, _ = await waiting(store_kind)
    result = await agent.resume("s1", decisions={"call_mail": Decision.edit({"to": 42})})
    res = next(m for m in result.messages if m.role == "tool" and m.tool_call_id == "call_mail")
    assert res.is_error and "The edited arguments were invalid" in res.text and "42 is not of type 'string'" in res.text
    assert SENT == []


async def test_a_second_identical_resume_does_nothing(store_kind) -> None:
    agent, _ = await waiting(store_kind)
    first = await agent.resume("s1", decisions={"call_mail": Decision.approve()})
    assert first.stop.reason is StopReason.COMPLETED and len(SENT) == 1
    with pytest.raises(ResumeError, match="ended COMPLETED"):
        await agent.resume("s1", decisions={"call_mail": Decision.approve()})
    assert len(SENT) == 1


async def test_resume_without_a_decision_waits_again(store_kind) -> None:
    agent, _ = await waiting(store_kind)
    again = await agent.resume("s1")
    assert again.stop.reason is StopReason.WAITING_HUMAN
    assert [p.call.id for p in again.stop.pending_actions] == ["call_mail"]
    assert SENT == []


async def test_concurrent_duplicate_approvals_run_the_tool_once(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    agent, _ = await waiting(store)
    other = make(SQLiteStore(tmp_path / "s.db"), ["All done."])
    outcomes = await asyncio.gather(agent.resume("s1", decisions={"call_mail": Decision.approve()}),
                                    other.resume("s1", decisions={"call_mail": Decision.approve()}),
                                    return_exceptions=True)
    ok = [o for o in outcomes if not isinstance(o, Exception)]
    errors = [o for o in outcomes if isinstance(o, Exception)]
    assert len(SENT) == 1
    assert len(ok) == 1 and ok[0].stop.reason is StopReason.COMPLETED
    assert len(errors) == 1 and isinstance(errors[0], ResumeError)


async def test_paused_budget_resumes_with_a_raised_budget(store_kind) -> None:
    script = [tool_call_response(("lookup", {"q": str(i)})) for i in range(5)] + ["done"]
    agent = Agent(ScriptedProvider(script), tools=[lookup], store=store_kind, config=RunConfig(max_iterations=2))
    paused = await agent.run("look", session_id="b")
    assert paused.stop.reason is StopReason.PAUSED_BUDGET and paused.turns == 2
    again = await agent.resume("b")  # not raised: pauses at once, nothing runs
    assert again.stop.reason is StopReason.PAUSED_BUDGET and again.tool_calls == 2
    done = await agent.resume("b", max_iterations=10)
    assert done.stop.reason is StopReason.COMPLETED
    assert done.turns == 6 and done.tool_calls == 5
    assert [m.text for m in done.messages if m.role == "tool"] == [f"found {i}" for i in range(5)]


async def test_failed_retryable_resumes_as_it_stands(store_kind) -> None:
    agent = Agent(ScriptedProvider([ServerError("503", status=503), "recovered"]), store=store_kind)
    failed = await agent.run("hi", session_id="f")
    assert failed.stop.reason is StopReason.FAILED_RETRYABLE
    assert (await agent.resume("f")).output == "recovered"


@pytest.mark.parametrize("script,reason", [
    (["ok"], "COMPLETED"),
    ([ServerError("bad", status=400, retryable=False)], "FAILED_TERMINAL"),
])
async def test_final_sessions_cannot_be_resumed(store_kind, script: list, reason: str) -> None:
    agent = Agent(ScriptedProvider(script), store=store_kind)
    await agent.run("hi", session_id="x")
    with pytest.raises(ResumeError, match=f"ended {reason}; only WAITING_HUMAN"):
        await agent.resume("x")
    with pytest.raises(ResumeError, match="unknown session"):
        await agent.resume("nope")


async def test_steer_changes_direction_at_the_next_safe_point(store_kind) -> None:
    provider = ScriptedProvider([tool_call_response(("lookup", {"q": "paris"})), "Rome it is."])
    agent = Agent(provider, tools=[lookup], store=store_kind)

    class SteerOnce(Middleware):
        async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
            await agent.control(ctx.session_id, Steer("look at Rome instead of Paris"))
            return await call_next(call)

    agent.add_middleware(SteerOnce())
    result = await agent.run("plan a trip", session_id="st")
    assert result.stop.reason is StopReason.COMPLETED
    second = provider.requests[1].messages
    assert isinstance(second[-1], UserMessage) and "New direction from the user: look at Rome instead of Paris" in second[-1].text
    events = await store_kind.read_events("st")
    assert any(e.type == "control" and e.payload["kind"] == "steer" for e in events)


async def test_followup_runs_after_the_task_would_complete(store_kind) -> None:
    provider = ScriptedProvider(["Paris.", "About 2.1 million people."])
    agent = Agent(provider, store=store_kind)

    class QueueFollowup(Middleware):
        """Queues a followup while the first answer is being produced."""

        async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
            if ctx.turn == 1:
                await agent.control(ctx.session_id, Followup("And its population?"))
            return await call_next(request)

    agent.add_middleware(QueueFollowup())
    result = await agent.run("Capital of France?", session_id="fu")
    assert result.stop.reason is StopReason.COMPLETED
    assert [m.text for m in result.messages if m.role in ("user", "assistant")] == [
        "Capital of France?", "Paris.", "And its population?", "About 2.1 million people."]


async def test_interrupt_mid_stream_from_another_task(store_kind) -> None:
    provider = ScriptedProvider([text_response("word " * 200), "resumed answer"], stream_delay=0.01, chunk_chars=5)
    rec = Recorder()
    agent = Agent(provider, store=store_kind, observers=[rec], control_poll=0.05)
    run = asyncio.ensure_future(agent.run("talk", session_id="int"))
    await asyncio.sleep(0.3)
    await agent.control("int", Interrupt("user pressed stop"))
    result = await run
    assert result.stop.reason is StopReason.INTERRUPTED and result.stop.resumable
    assert "user pressed stop" in result.stop.detail
    assert rec.transitions()[-1] == ("Model", "interrupt", "INTERRUPTED")
    deltas = [e for e in rec.events if getattr(e, "event", None) is not None and e.event.TAG == "text_delta"]
    assert 0 < len(deltas) < 200  # stopped mid-stream
    resumed = await agent.resume("int")
    assert resumed.stop.reason is StopReason.COMPLETED and resumed.output == "resumed answer"


@tool
async def slow_job(n: int) -> str:
    """A slow job."""
    await asyncio.sleep(5)
    return "finished"


async def test_interrupt_mid_tool_leaves_a_synthetic_result_and_a_valid_history(store_kind) -> None:
    provider = ScriptedProvider([tool_call_response(("slow_job", {"n": 1})), "ok after interrupt"])
    agent = Agent(provider, tools=[slow_job], store=store_kind, control_poll=0.05)
    run = asyncio.ensure_future(agent.run("work", session_id="mt"))
    await asyncio.sleep(0.4)
    await agent.control("mt", Interrupt())
    result = await run
    assert result.stop.reason is StopReason.INTERRUPTED
    last = result.messages[-1]
    assert last.role == "tool" and last.is_error and last.metadata == {"synthetic": "interrupted"}
    ledger = await store_kind.ledger("mt")
    assert ledger[last.tool_call_id].status is LedgerStatus.INTERRUPTED  # closed: never run again silently
    assert ledger[last.tool_call_id].result["content"][0]["text"].startswith("The run stopped while")
    resumed = await agent.resume("mt")
    assert resumed.stop.reason is StopReason.COMPLETED
    roles = [m.role for m in provider.requests[-1].messages]
    assert roles == ["user", "assistant", "tool"]  # every call has its result


@tool(effect="side_effect")
def book(room: str) -> str:
    """Book a room."""
    return f"booked {room}"


@book.on_compensate
def _unbook(arguments: dict, result: Any, ctx: ToolContext) -> None:
    COMPENSATED.append(arguments["room"])


async def test_cancel_runs_compensation_for_completed_side_effects(store_kind) -> None:
    provider = ScriptedProvider([tool_call_response(("book", {"room": "A1"})), "booked"])
    agent = Agent(provider, tools=[book], store=store_kind)

    class CancelAfterBooking(Middleware):
        async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
            res = await call_next(call)
            await agent.control(ctx.session_id, Cancel("changed my mind"))
            return res

    agent.add_middleware(CancelAfterBooking())
    result = await agent.run("book a room", session_id="c")
    assert result.stop.reason is StopReason.CANCELLED and result.stop.detail == "changed my mind"
    assert COMPENSATED == ["A1"]
    with pytest.raises(ResumeError, match="ended CANCELLED"):
        await agent.resume("c")


async def test_cancel_without_compensation_asks_a_person_to_confirm(store_kind) -> None:
    provider = ScriptedProvider([email_call("m1"), "done"])
    agent = Agent(provider, tools=[send_email, lookup], store=store_kind)

    class CancelAfterMail(Middleware):
        async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
            res = await call_next(call)
            if call.name == "send_email":
                await agent.control(ctx.session_id, Cancel("stop everything"))
            return res

    agent.add_middleware(CancelAfterMail())
    result = await agent.run("mail", session_id="cc")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    assert result.stop.required_decision == "confirm_cancel"
    assert "send_email(m1)" in result.stop.detail
    confirmed = await agent.resume("cc", confirm_cancel=True)
    assert confirmed.stop.reason is StopReason.CANCELLED
    assert len(SENT) == 1


async def test_hang_wait_gets_a_decision_in_process(store_kind) -> None:
    agent = make(store_kind, [email_call(), "All done."], config=RunConfig(approval_timeout=5))
    agent.control_poll = 0.05
    run = asyncio.ensure_future(agent.run("mail ann", session_id="hw"))
    await asyncio.sleep(0.3)
    await agent.decide("hw", "call_mail", Decision.approve())
    result = await run
    assert result.stop.reason is StopReason.COMPLETED and SENT == [("ann@example.com", "hi")]


async def test_hang_wait_times_out_into_stop_resume(store_kind) -> None:
    agent = make(store_kind, [email_call(), "All done."], config=RunConfig(approval_timeout=0.3))
    agent.control_poll = 0.05
    result = await agent.run("mail ann", session_id="hw2")
    assert result.stop.reason is StopReason.WAITING_HUMAN and SENT == []
    done = await agent.resume("hw2", decisions={"call_mail": Decision.approve()})
    assert done.stop.reason is StopReason.COMPLETED and len(SENT) == 1


async def test_two_workers_race_for_one_session_over_postgres(postgres_dsn) -> None:
    from fsm_agent.store import PostgresStore

    store_a, store_b = PostgresStore(postgres_dsn), PostgresStore(postgres_dsn)
    agent_a = make(store_a, [email_call(), "All done."], worker_id="worker-a")
    await agent_a.run("mail ann", session_id="race")
    agent_b = make(store_b, ["All done."], worker_id="worker-b")
    outcomes = await asyncio.gather(agent_a.resume("race", decisions={"call_mail": Decision.approve()}),
                                    agent_b.resume("race", decisions={"call_mail": Decision.approve()}),
                                    return_exceptions=True)
    drove = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(drove) == 1 and drove[0].stop.reason is StopReason.COMPLETED
    assert len(refused) == 1 and isinstance(refused[0], ResumeError)
    # which check refuses depends on timing: the lease seen before (being driven), taken during (just
    # taken), or the winner's run already ended (the session ended: its stored result, nothing run again)
    winner = "worker-a" if outcomes[1] is refused[0] else "worker-b"
    assert (f"being driven by worker {winner}" in str(refused[0])
            or f"was just taken by worker {winner}" in str(refused[0])
            or isinstance(refused[0], SessionEndedError) and refused[0].result.stop.reason is StopReason.COMPLETED), \
        refused[0]
    assert len(SENT) == 1
    ledger = await store_a.ledger("race")
    assert ledger["call_mail"].status is LedgerStatus.COMPLETED
    await store_a.close()
    await store_b.close()
