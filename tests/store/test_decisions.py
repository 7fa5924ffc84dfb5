"""Decisions have one writer and one reader (``fsm_agent.store.decisions``).

* The writer's check is a pure function (``check_decision``): an unknown call, a kind the call does
  not allow, bad edited arguments and a second, different decision are refused; the same decision
  again gets the first outcome.
* Two writers on two connections of one database racing with the same decision: one stores it,
  the other gets its outcome; racing with different decisions: exactly one wins.
* What the writer stores reaches a run waiting in process (Hang-Wait, on another connection: as
  from another process) and a resume on another worker, and a decision answers one round only.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fsm_agent import AskApproval, Middleware, RunConfig, ScriptedProvider, StopReason, tool
from fsm_agent.agent import Agent
from fsm_agent.control import Decision
from fsm_agent.errors import DecisionRefused, ResumeError
from fsm_agent.providers import tool_call_response
from fsm_agent.store import ControlKind, MemoryStore, SQLiteStore
from fsm_agent.store.decisions import (DECISIONS_AWAITED, DECISIONS_TAKEN, Question, check_decision, decision_key,
                                       read_decisions, read_question, write_decision, write_decisions)
from fsm_agent.types import ToolUseBlock

SENT: list[str] = []


@tool(effect="side_effect")
def send(to: str) -> str:
    """Send a mail."""
    SENT.append(to)
    return f"sent to {to}"


class AskForSend(Middleware):
    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        return AskApproval("mails need a person", ("approve", "edit", "reject")) if call.name == "send" else None


@pytest.fixture(autouse=True)
def _reset() -> None:
    SENT.clear()


def agent(store: Any, *, wait: float | None = None, script: list[Any] | None = None) -> Agent:
    script = script or [tool_call_response(ToolUseBlock("c0", "send", {"to": "ann"})), "done"]
    return Agent(ScriptedProvider(script), tools=[send], middleware=[AskForSend()], store=store,
                 config=RunConfig(approval_timeout=wait), control_poll=0.02)


PENDING = {"c0": {"call": {"type": "tool_use", "id": "c0", "name": "send", "input": {"to": "ann"}},
                  "reason": "mails need a person", "allowed_decisions": ["approve", "edit", "reject"]}}


# -- the pure check ---------------------------------------------------------------------------------
def test_the_check_refuses_what_the_question_does_not_ask() -> None:
    q = Question("s", "WAITING_HUMAN", PENDING)
    with pytest.raises(DecisionRefused) as e:
        check_decision(q, "c9", Decision.approve())
    assert e.value.kind == "not_pending" and "pending: c0" in str(e.value)
    with pytest.raises(DecisionRefused) as e:
        check_decision(q, "c0", Decision.respond("done"))
    assert e.value.kind == "not_allowed" and "allows approve, edit, reject" in str(e.value)
    with pytest.raises(DecisionRefused) as e:
        check_decision(q, "c0", Decision.edit({"to": 5}), tools=agent(MemoryStore()).tools)
    assert e.value.kind == "bad_arguments" and "to" in str(e.value)
    with pytest.raises(DecisionRefused) as e:
        check_decision(Question("s", "COMPLETED", PENDING), "c0", Decision.approve())
    assert e.value.kind == "not_waiting" and "COMPLETED, not WAITING_HUMAN" in str(e.value)
    assert isinstance(e.value, ResumeError)


def test_the_check_answers_a_repeat_with_the_first_outcome_and_refuses_a_different_one() -> None:
    q = Question("s", "WAITING_HUMAN", PENDING)
    first = check_decision(q, "c0", Decision.approve())
    assert (first.replayed, first.round, first.reason) == (False, 0, "mails need a person")
    stored = {first.key: first.record()}
    again = check_decision(q, "c0", Decision.approve(), stored=stored)
    assert again.replayed and again.to_json() == {**first.to_json(), "replayed": True}
    with pytest.raises(DecisionRefused) as e:
        check_decision(q, "c0", Decision.reject("no"), stored=stored)
    assert e.value.kind == "conflict" and e.value.prior == Decision.approve()
    # once used (round 1) and no longer pending: a repeat still gets the first outcome, nothing else
    used = Question("s", "COMPLETED", {}, {"c0": 1})
    assert check_decision(used, "c0", Decision.approve(), stored=stored).replayed
    with pytest.raises(DecisionRefused) as e:
        check_decision(used, "c0", Decision.reject("no"), stored=stored)
    assert e.value.kind == "conflict"
    # asked again (round 1): the old decision does not answer the new question
    asked_again = Question("s", "WAITING_HUMAN", PENDING, {"c0": 1})
    fresh = check_decision(asked_again, "c0", Decision.reject("no"), stored=stored)
    assert (fresh.replayed, fresh.round, fresh.key) == (False, 1, decision_key("c0", 1))


# -- the writer and the reader on a store ---------------------------------------------------------------
async def test_two_writers_racing_with_one_decision_store_it_once(tmp_path: Any) -> None:
    db = tmp_path / "s.db"
    a, b = SQLiteStore(db), SQLiteStore(db)
    assert (await agent(a).run("mail ann", session_id="s")).stop.reason is StopReason.WAITING_HUMAN
    outs = await asyncio.gather(write_decision(a, "s", "c0", Decision.approve()),
                                write_decision(b, "s", "c0", Decision.approve()))
    assert sorted(o.replayed for o in outs) == [False, True]
    assert outs[0].to_json() | {"replayed": True} == outs[1].to_json() | {"replayed": True}
    assert list(await a.idempotency_records("s", "decision:")) == ["decision:c0#0"]
    assert await read_decisions(b, "s") == {"c0": Decision.approve()}
    await a.close()
    await b.close()


async def test_two_writers_racing_with_different_decisions_one_wins(tmp_path: Any) -> None:
    db = tmp_path / "s.db"
    a, b = SQLiteStore(db), SQLiteStore(db)
    await agent(a).run("mail ann", session_id="s")
    outs = await asyncio.gather(write_decision(a, "s", "c0", Decision.approve()),
                                write_decision(b, "s", "c0", Decision.reject("no")), return_exceptions=True)
    won = [o for o in outs if not isinstance(o, BaseException)]
    lost = [o for o in outs if isinstance(o, BaseException)]
    assert len(won) == 1 and not won[0].replayed
    assert len(lost) == 1 and isinstance(lost[0], DecisionRefused) and lost[0].kind == "conflict"
    assert lost[0].prior == won[0].decision
    assert await read_decisions(a, "s") == {"c0": won[0].decision}
    await a.close()
    await b.close()


async def test_a_batch_with_one_refused_decision_stores_nothing() -> None:
    store = MemoryStore()
    await agent(store, script=[tool_call_response(ToolUseBlock("c0", "send", {"to": "ann"}),
                                                  ToolUseBlock("c1", "send", {"to": "bob"})), "done"]
                ).run("mail", session_id="s")
    with pytest.raises(DecisionRefused) as e:
        await write_decisions(store, "s", {"c0": Decision.approve(), "c1": Decision.respond("x")})
    assert e.value.call_id == "c1" and e.value.kind == "not_allowed"
    assert await store.idempotency_records("s", "decision:") == {}


async def test_a_resume_on_another_worker_reads_the_decision_the_writer_stored(tmp_path: Any) -> None:
    db = tmp_path / "s.db"
    a, b = SQLiteStore(db), SQLiteStore(db)
    await agent(a).run("mail ann", session_id="s")
    outcome = await agent(a).decide("s", "c0", Decision.edit({"to": "bob"}))
    assert (outcome.decision, outcome.replayed, outcome.live) == (Decision.edit({"to": "bob"}), False, False)
    done = await agent(b, script=["done"]).resume("s")  # another worker, no decision given to it
    assert done.stop.reason is StopReason.COMPLETED and SENT == ["bob"]
    resumes = await b.read_events("s", types=("resume",))
    assert resumes[-1].payload["decisions"]["c0"]["kind"] == "edit"
    # used: the question is gone; the same decision again is the first outcome, a new one is refused
    assert (await agent(b).decide("s", "c0", Decision.edit({"to": "bob"}))).replayed
    with pytest.raises(DecisionRefused) as e:
        await agent(b).decide("s", "c0", Decision.approve())
    assert e.value.kind == "conflict"
    await a.close()
    await b.close()


async def test_a_resume_given_a_decision_that_conflicts_with_the_stored_one_is_refused() -> None:
    store = MemoryStore()
    await agent(store).run("mail ann", session_id="s")
    await agent(store).decide("s", "c0", Decision.reject("not now"))
    with pytest.raises(DecisionRefused) as e:
        await agent(store).resume("s", decisions={"c0": Decision.approve()})
    assert e.value.kind == "conflict" and SENT == []
    done = await agent(store, script=["done"]).resume("s", decisions={"c0": Decision.reject("not now")})
    assert done.stop.reason is StopReason.COMPLETED and SENT == []


async def test_a_decision_for_a_run_that_waits_for_none_is_refused() -> None:
    store = MemoryStore()
    await agent(store, script=["no tools"]).run("hi", session_id="s")
    with pytest.raises(DecisionRefused) as e:
        await agent(store).decide("s", "c0", Decision.approve())
    assert e.value.kind == "not_waiting"
    with pytest.raises(DecisionRefused) as e:
        await agent(store).decide("nope", "c0", Decision.approve())
    assert e.value.kind == "unknown_session"


async def _awaiting(store: Any, sid: str) -> None:
    """Until the run waits in process (its question is in the log)."""
    for _ in range(2000):
        rec = await store.get_session(sid)
        if rec is not None and (await read_question(store, rec)).live:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"session {sid} never started to wait for a decision")


async def test_hang_wait_takes_a_decision_written_from_another_connection(tmp_path: Any) -> None:
    db = tmp_path / "s.db"
    a, b = SQLiteStore(db), SQLiteStore(db)
    run = asyncio.ensure_future(agent(a, wait=60).run("mail ann", session_id="s"))
    await _awaiting(b, "s")
    q = await read_question(b, (await b.get_session("s")))  # type: ignore[arg-type]
    assert list(q.pending) == ["c0"] and q.state != "WAITING_HUMAN"
    with pytest.raises(DecisionRefused):  # the question is checked for a waiting run too
        await write_decision(b, "s", "c0", Decision.respond("x"))
    outcome = await write_decision(b, "s", "c0", Decision.edit({"to": "cy"}))  # as from another process
    assert outcome.live and not outcome.replayed
    result = await asyncio.wait_for(run, 30)
    assert result.stop.reason is StopReason.COMPLETED and SENT == ["cy"]
    types = [e.type for e in await a.read_events("s")]
    assert DECISIONS_AWAITED in types and DECISIONS_TAKEN in types
    taken = (await a.read_events("s", types=(DECISIONS_TAKEN,)))[0].payload["decisions"]
    assert taken == {"c0": {"kind": "edit", "arguments": {"to": "cy"}, "message": "", "is_error": False}}
    # the round is used: a repeat gets the first outcome, a different decision is refused
    assert (await write_decision(a, "s", "c0", Decision.edit({"to": "cy"}))).replayed
    with pytest.raises(DecisionRefused) as e:
        await write_decision(a, "s", "c0", Decision.approve())
    assert e.value.kind == "conflict"
    await a.close()
    await b.close()


async def test_hang_wait_two_decisions_posted_at_once_give_one_outcome() -> None:
    store = MemoryStore()
    a = agent(store, wait=60)
    run = asyncio.ensure_future(a.run("mail ann", session_id="s"))
    await _awaiting(store, "s")
    outs = await asyncio.gather(*(a.decide("s", "c0", Decision.approve()) for _ in range(4)))
    assert sorted(o.replayed for o in outs) == [False, True, True, True]
    assert len({str(o.to_json() | {"replayed": True}) for o in outs}) == 1
    assert (await asyncio.wait_for(run, 30)).stop.reason is StopReason.COMPLETED and SENT == ["ann"]


async def test_a_decision_written_after_the_hang_wait_timed_out_is_applied_by_the_resume() -> None:
    store = MemoryStore()
    result = await agent(store, wait=0.05).run("mail ann", session_id="s")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    q = await read_question(store, (await store.get_session("s")))  # type: ignore[arg-type]
    assert not q.live and list(q.pending) == ["c0"]  # the stop asks now, not the wait
    outcome = await agent(store).decide("s", "c0", Decision.approve())
    assert not outcome.live
    assert await store.take_controls("s", list(ControlKind)) == []  # no wake-up: nothing waits in process
    done = await agent(store, script=["done"]).resume("s")
    assert done.stop.reason is StopReason.COMPLETED and SENT == ["ann"]
