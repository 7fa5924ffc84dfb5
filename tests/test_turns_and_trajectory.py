"""Turn records (seed 004 §2) through the API and `fsm-agent sessions show --turns`, and the offline
replay of a recorded trajectory (fsm_agent.testing.replay_trajectory)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
from typing import Any

import orjson
import pytest

from fsm_agent import AskApproval, Middleware, ScriptedProvider, StopReason, tool
from fsm_agent.agent import Agent
from fsm_agent.cli import main
from fsm_agent.control import Decision
from fsm_agent.errors import ProviderError
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore, SQLiteStore, read_turns
from fsm_agent.testing import replay_trajectory
from fsm_agent.types import ToolUseBlock, UserMessage
from fsm_agent.types.codec import unstructure
from fsm_agent_middleware.verifier import Verdict, Verifier


def make_tools(ran: list[str]) -> list[Any]:
    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        ran.append(f"lookup {q}")
        return f"found {q}"

    @tool(effect="side_effect")
    def send(to: str) -> str:
        """Send a message."""
        ran.append(f"send {to}")
        return f"sent to {to}"

    return [lookup, send]


class AskForSend(Middleware):
    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        return AskApproval("sending needs a person") if call.name == "send" else None


def says_done(ctx: Any) -> Verdict:
    """Accepts an answer that says 'done' (decided from the answer alone, so a replay judges alike)."""
    text = ctx.last_response.text if ctx.last_response else ""
    return Verdict("done" in text, "say done when it is done", evidence=(f"checked:{text}",))


def script() -> list[Any]:
    return [tool_call_response(ToolUseBlock("c1", "lookup", {"q": "ann"})),
            "first answer",  # rejected by the verifier: one feedback turn
            tool_call_response(ToolUseBlock("c2", "send", {"to": "ann"})),  # waits for approval
            "all done"]


def make_agent(store: Any, ran: list[str], *, middleware: tuple[Any, ...] = (), provider: Any = None) -> Agent:
    return Agent(provider or ScriptedProvider(script()), tools=make_tools(ran),
                 middleware=[AskForSend(), Verifier(says_done), *middleware], store=store)


async def recorded(store: Any, decision: Decision | None = None) -> tuple[Agent, list[str]]:
    """The scenario: tool call, verifier feedback, approval stop, resume with a decision, COMPLETED."""
    ran: list[str] = []
    agent = make_agent(store, ran)
    first = await agent.run("mail ann what you find", session_id="s1")
    assert first.stop.reason is StopReason.WAITING_HUMAN
    done = await agent.resume("s1", decisions={"c2": decision or Decision.approve()})
    assert done.stop.reason is StopReason.COMPLETED, done.stop
    return agent, ran


def sha(request: Any) -> str:
    return hashlib.sha256(orjson.dumps(unstructure(request))).hexdigest()


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path):
    return MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "s.db")


# -- turn records ------------------------------------------------------------------------------

async def test_turn_records_of_tools_a_verifier_an_approval_stop_and_a_resume(store) -> None:
    agent, ran = await recorded(store)
    assert ran == ["lookup ann", "send ann"]
    turns = await read_turns(store, "s1")
    events = {e.seq: e for e in await store.read_events("s1")}
    assert [(t.turn, t.resumed) for t in turns] == [(1, False), (2, False), (3, False), (3, True), (4, False)]
    t1, t2, t3, t3b, t4 = turns

    # the context hash is the hash of exactly what the provider received, call by call
    requests = agent.provider.requests
    assert len(requests) == 4
    with_context = [t for t in turns if t.context is not None]
    assert [t.context.hash for t in with_context] == [sha(r) for r in requests]
    assert [t.context.messages for t in with_context] == [len(r.messages) for r in requests]
    for t in with_context:  # the snapshot's seq is an event of the log, at or after the turn's input
        assert t.context.seq in events and t.input_seq is not None and t.input_seq <= t.context.seq

    # input events: the user's message, the tool result, the verifier's feedback, the resumed call's result
    def message_at(seq: int) -> dict[str, Any]:
        assert events[seq].type == "message"
        return events[seq].payload["message"]

    assert message_at(t1.input_seq)["content"][0]["text"] == "mail ann what you find"
    assert message_at(t2.input_seq)["tool_call_id"] == "c1"
    assert message_at(t3.input_seq)["content"][0]["text"].startswith("Your answer did not pass verification")
    assert message_at(t4.input_seq)["tool_call_id"] == "c2"

    assert t1.tool_calls == ("c1",) and t1.model_call["stop_reason"] == "tool_use"
    assert [(o["call_id"], o["status"]) for o in t1.observations][-1] == ("c1", "completed")
    assert "cost_usd" in t1.model_call and t1.stop_reason is None
    assert t2.tool_calls == () and t2.verification.startswith("continue: verifier rejected the answer")
    assert t3.tool_calls == ("c2",) and t3.observations == () and t3.stop_reason == "WAITING_HUMAN"
    # the part of turn 3 run after the resume: its input is the resume, its observations the approved call
    assert events[t3b.input_seq].type == "transition" and events[t3b.input_seq].payload["trigger"] == "resume_tools"
    assert t3b.context is None and t3b.model_call is None and t3b.tool_calls == ("c2",)
    assert [(o["call_id"], o["status"]) for o in t3b.observations] == [
        ("c2", "approved"), ("c2", "started"), ("c2", "completed")]
    assert t4.verification == "verified: say done when it is done (decided by verifier)"
    assert t4.stop_reason == "COMPLETED" and t4.model_call["stop_reason"] == "end_turn"

    # the model_call events carry the same context reference
    refs = [e.payload["context"] for e in events.values() if e.type == "model_call"]
    assert refs == [unstructure(t.context) for t in with_context]


async def test_a_resumed_budget_pause_starts_its_next_turn_from_the_last_message() -> None:
    store = MemoryStore()
    ran: list[str] = []
    agent = make_agent(store, ran)
    paused = await agent.run("mail ann what you find", session_id="s1", max_iterations=1)
    assert paused.stop.reason is StopReason.PAUSED_BUDGET
    await agent.resume("s1", max_iterations=2)
    turns = await read_turns(store, "s1")
    events = {e.seq: e for e in await store.read_events("s1")}
    assert [t.turn for t in turns] == [1, 2]
    # turn 2 ran in another run: its input is the tool result written by the first run
    assert events[turns[1].input_seq].payload["message"]["tool_call_id"] == "c1"


async def test_a_turn_whose_model_call_failed_has_a_record() -> None:
    store = MemoryStore()
    provider = ScriptedProvider([ProviderError("bad request", status=400, retryable=False)])
    agent = Agent(provider, store=store)
    result = await agent.run("hi", session_id="s1")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    (turn,) = await read_turns(store, "s1")
    assert turn.context.hash == sha(provider.requests[0])
    assert turn.model_call is None and turn.stop_reason == "FAILED_TERMINAL"


def test_sessions_show_turns_prints_a_line_or_a_json_object_per_turn(tmp_path) -> None:
    path = tmp_path / "cli.db"

    async def record() -> list[Any]:
        store = SQLiteStore(path)
        await recorded(store)
        try:
            return await read_turns(store, "s1")
        finally:
            await store.close()

    turns = asyncio.run(record())

    out, err = io.StringIO(), io.StringIO()
    assert main(["sessions", "show", "s1", "--turns", "--store", str(path)], out=out, err=err) == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert len(lines) == 5
    assert lines[0].startswith(f"turn 1: input #{turns[0].input_seq}; context {turns[0].context.hash[:12]} ")
    assert "tools: c1 lookup completed" in lines[0]
    assert "verification: continue: verifier rejected the answer" in lines[1]
    assert lines[2].endswith("stop: WAITING_HUMAN")
    assert lines[3].startswith("turn 3 (resumed): input #") and "tools: c2 send completed" in lines[3]
    assert lines[4].startswith("turn 4:") and lines[4].endswith("stop: COMPLETED")

    out = io.StringIO()
    assert main(["sessions", "show", "s1", "--turns", "--json", "--store", str(path)], out=out, err=err) == 0
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert docs == [unstructure(t) for t in turns]

    err = io.StringIO()
    assert main(["sessions", "show", "nope", "--turns", "--store", str(path)], out=io.StringIO(), err=err) == 2
    assert "unknown session 'nope'" in err.getvalue()


# -- trajectory replay -------------------------------------------------------------------------

async def test_a_recorded_run_replays_with_no_difference_and_runs_no_tool(store) -> None:
    await recorded(store)
    ran: list[str] = []
    report = await replay_trajectory(store, "s1", make_agent(MemoryStore(), ran))
    assert report.ok, report.summary()
    assert report.differences == () and report.notes == ()
    assert (report.recorded_calls, report.replayed_calls) == (4, 4)
    assert report.recorded_stops == report.replayed_stops == (StopReason.WAITING_HUMAN, StopReason.COMPLETED)
    assert report.result is not None and report.result.output == "all done"
    assert ran == []  # tool results came from the log


class RewriteTask(Middleware):
    """Rewrites the user's task in the context of every turn."""

    def pre_turn(self, ctx: Any) -> None:
        for i, m in enumerate(ctx.messages):
            if isinstance(m, UserMessage) and m.text == "mail ann what you find":
                ctx.messages[i] = UserMessage("mail ann what you found")


class AddNoteAfterTurnTwo(Middleware):
    """Adds a note to the context from turn 3 on."""

    def pre_turn(self, ctx: Any) -> None:
        if ctx.turn >= 2:
            ctx.messages.append(UserMessage("be brief"))


async def test_a_changed_middleware_is_reported_at_the_turn_and_message_it_changes() -> None:
    store = MemoryStore()
    await recorded(store)
    recorded_turns = await read_turns(store, "s1")
    report = await replay_trajectory(store, "s1", make_agent(MemoryStore(), [], middleware=(RewriteTask(),)))
    assert not report.ok
    assert [d.turn for d in report.differences] == [1, 2, 3, 4]
    first = report.differences[0]
    assert first.message_index == 0 and first.recorded_hash == recorded_turns[0].context.hash
    assert first.replayed_hash is not None and first.replayed_hash != first.recorded_hash
    assert "mail ann what you find" in first.description and "mail ann what you found" in first.description

    report = await replay_trajectory(store, "s1", make_agent(MemoryStore(), [], middleware=(AddNoteAfterTurnTwo(),)))
    assert [(d.turn, d.message_index) for d in report.differences] == [(3, 5), (4, 7)]
    assert report.differences[0].description.startswith("message 5 was added: user 'be brief'")
    assert report.recorded_stops == report.replayed_stops


async def test_a_session_resumed_with_a_decision_replays_through_the_decision(store) -> None:
    await recorded(store, Decision.reject("not to ann"))
    ran: list[str] = []
    report = await replay_trajectory(store, "s1", make_agent(MemoryStore(), ran))
    assert report.ok, report.summary()
    assert report.replayed_stops == (StopReason.WAITING_HUMAN, StopReason.COMPLETED)
    tool_results = [m for m in report.result.messages if m.role == "tool"]
    assert [m.text for m in tool_results] == ["found ann", "A person rejected this tool call: not to ann"]
    assert ran == []


async def test_a_replay_that_stops_early_reports_the_calls_it_did_not_make() -> None:
    store = MemoryStore()
    await recorded(store)
    # without the verifier the first answer completes the run: turns 3 and 4 are never asked for
    agent = Agent(ScriptedProvider([]), tools=make_tools([]), middleware=[AskForSend()], store=MemoryStore())
    report = await replay_trajectory(store, "s1", agent)
    assert report.replayed_stops == (StopReason.COMPLETED,)
    assert report.recorded_stop is StopReason.COMPLETED and report.replayed_stop is StopReason.COMPLETED
    assert [(d.turn, d.replayed_hash) for d in report.differences] == [(3, None), (4, None)]
    assert report.notes and "not replayed" in report.notes[0]
    assert not report.ok
