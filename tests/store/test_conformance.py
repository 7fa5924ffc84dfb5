"""One suite, every backend (memory, SQLite, PostgreSQL on a throwaway cluster)."""

from __future__ import annotations

import asyncio
import time

import pytest

from fsm_agent import Agent, ScriptedProvider, tool
from fsm_agent.errors import LeaseLost, SessionConflictError, SessionExistsError
from fsm_agent.providers import tool_call_response
from fsm_agent.store.sessions import load_session
from fsm_agent.store import (
    SCHEMA_VERSION,
    Checkpoint,
    ControlKind,
    ControlRecord,
    EventRecord,
    LedgerEntry,
    LedgerStatus,
    SessionRecord,
    WriteBatch,
)


async def test_sessions_create_get_list_update(store) -> None:
    await store.create_session(SessionRecord("s1", "Idle", goal="first", metadata={"a": 1}))
    await asyncio.sleep(0.01)
    await store.create_session(SessionRecord("s2", "Idle", goal="second"))
    with pytest.raises(SessionExistsError):
        await store.create_session(SessionRecord("s1", "Idle"))
    s1 = await store.get_session("s1")
    assert (s1.goal, s1.metadata, s1.last_seq, s1.goal_version) == ("first", {"a": 1}, 0, 1)
    assert await store.get_session("nope") is None
    await store.write(WriteBatch("s1", state="PreTurn"))
    assert [s.session_id for s in await store.list_sessions()] == ["s1", "s2"]
    assert [s.session_id for s in await store.list_sessions(limit=1)] == ["s1"]
    await store.update_metadata("s1", {"b": 2}, goal_version=3)
    s1 = await store.get_session("s1")
    assert s1.metadata == {"a": 1, "b": 2} and s1.goal_version == 3


async def test_events_are_an_append_only_log_without_gaps(store) -> None:
    await store.create_session(SessionRecord("s", "Idle"))
    evs = tuple(EventRecord("s", i, "message", {"i": i, "text": "é✅"}, "s:1") for i in (1, 2, 3))
    await store.write(WriteBatch("s", evs, state="PreTurn"))
    with pytest.raises(SessionConflictError, match="another writer appended"):
        await store.write(WriteBatch("s", (EventRecord("s", 5, "x", {}),)))
    with pytest.raises(SessionConflictError, match="another writer appended"):
        await store.write(WriteBatch("s", (EventRecord("s", 3, "x", {}),)))
    await store.write(WriteBatch("s", (EventRecord("s", 4, "transition", {"to": "Model"}),)))
    got = await store.read_events("s")
    assert [(e.seq, e.type, e.payload) for e in got] == [
        (1, "message", {"i": 1, "text": "é✅"}), (2, "message", {"i": 2, "text": "é✅"}),
        (3, "message", {"i": 3, "text": "é✅"}), (4, "transition", {"to": "Model"})]
    assert got[0].event_id == evs[0].event_id and got[0].turn_id == "s:1" and got[0].schema_version == SCHEMA_VERSION
    assert [e.seq for e in await store.read_events("s", after_seq=1, until_seq=3)] == [2, 3]
    rec = await store.get_session("s")
    assert rec.last_seq == 4 and rec.state == "PreTurn"
    with pytest.raises(KeyError):
        await store.write(WriteBatch("missing", (EventRecord("missing", 1, "x", {}),)))


async def test_checkpoints_reference_a_seq(store) -> None:
    await store.create_session(SessionRecord("s", "Idle"))
    await store.write(WriteBatch("s", (EventRecord("s", 1, "x", {}),), Checkpoint("c1", "s", 1, "PreTurn", {"turn": 0})))
    await store.write(WriteBatch("s", (EventRecord("s", 2, "x", {}),), Checkpoint("c2", "s", 2, "MidTurn", {"turn": 1})))
    latest = await store.latest_checkpoint("s")
    assert (latest.checkpoint_id, latest.seq, latest.safe_point, latest.data) == ("c2", 2, "MidTurn", {"turn": 1})
    assert (await store.get_checkpoint("c1")).data == {"turn": 0}
    assert await store.latest_checkpoint("other") is None


async def test_ledger_entries_are_upserted_per_call(store) -> None:
    await store.create_session(SessionRecord("s", "Idle"))
    e = LedgerEntry("s", "call_1", "send", {"to": "a"}, "key", "side_effect", LedgerStatus.STARTED, 1)
    await store.write(WriteBatch("s", ledger=(e,)))
    done = LedgerEntry("s", "call_1", "send", {"to": "a"}, "key", "side_effect", LedgerStatus.COMPLETED, 1,
                       {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}]})
    await store.write(WriteBatch("s", ledger=(done, LedgerEntry("s", "call_2", "f", {}, "k2", "pure",
                                                                  LedgerStatus.PROPOSED, 1))))
    ledger = await store.ledger("s")
    assert set(ledger) == {"call_1", "call_2"}
    assert ledger["call_1"].status is LedgerStatus.COMPLETED and ledger["call_1"].result["tool_call_id"] == "call_1"
    assert ledger["call_2"].result is None and ledger["call_2"].effect == "pure"


async def test_leases_are_exclusive_until_they_expire(store) -> None:
    await store.create_session(SessionRecord("s", "Idle"))
    assert await store.acquire_lease("s", "w1", 0.5)
    assert await store.acquire_lease("s", "w1", 0.5)  # renew
    assert not await store.acquire_lease("s", "w2", 0.5)
    with pytest.raises(LeaseLost):
        await store.write(WriteBatch("s", state="PreTurn", expected_owner="w2"))
    await store.write(WriteBatch("s", state="PreTurn", expected_owner="w1"))
    await asyncio.sleep(0.6)
    assert await store.acquire_lease("s", "w2", 10)  # expired: taken over
    with pytest.raises(LeaseLost):
        await store.write(WriteBatch("s", state="Model", expected_owner="w1"))  # fenced
    await store.release_lease("s", "w1")  # not the owner: no effect
    assert not await store.acquire_lease("s", "w1", 10)
    await store.release_lease("s", "w2")
    assert await store.acquire_lease("s", "w1", 10)


async def test_racing_workers_get_the_lease_exactly_once(store) -> None:
    await store.create_session(SessionRecord("s", "Idle"))
    results = await asyncio.gather(*(store.acquire_lease("s", f"w{i}", 30) for i in range(8)))
    assert sum(results) == 1


async def test_controls_are_taken_once_in_order(store) -> None:
    await store.create_session(SessionRecord("s", "Idle"))
    with pytest.raises(KeyError):
        await store.push_control(ControlRecord("missing", ControlKind.INTERRUPT))
    t = time.time()
    await store.push_control(ControlRecord("s", ControlKind.STEER, "left", ts=t))
    await store.push_control(ControlRecord("s", ControlKind.FOLLOWUP, "then this", ts=t + 1))
    await store.push_control(ControlRecord("s", ControlKind.STEER, "right", ts=t + 2))
    assert await store.peek_controls("s", [ControlKind.STEER])
    assert not await store.peek_controls("s", [ControlKind.INTERRUPT])
    steer = await store.take_controls("s", [ControlKind.STEER])
    assert [c.text for c in steer] == ["left", "right"]
    assert await store.take_controls("s", [ControlKind.STEER]) == []
    assert [c.text for c in await store.take_controls("s", [ControlKind.FOLLOWUP, ControlKind.CANCEL])] == ["then this"]


@tool
def note(text: str) -> str:
    """Write a note."""
    return f"noted {text}"


async def test_an_agent_run_is_persisted_and_loads_back(store) -> None:
    script = [tool_call_response(("note", {"text": str(i)})) for i in range(3)] + ["done"]
    agent = Agent(ScriptedProvider(script), tools=[note], store=store, system_prompt="be brief")
    result = await agent.run("take notes", session_id="run1")
    loaded = await load_session(store, "run1")
    assert loaded.record.state == "COMPLETED"
    assert loaded.record.stop["reason"] == "COMPLETED"
    assert loaded.record.stop["checkpoint_id"] == result.stop.checkpoint_id
    assert loaded.transcript == list(result.messages)
    assert loaded.checkpoint.checkpoint_id == result.stop.checkpoint_id
    events = await store.read_events("run1")
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    types = [e.type for e in events]
    assert types[0] == "session_started" and types[-1] == "run_stopped"
    assert types.count("message") == len(result.messages) == 2 + 3 * 2 + 1
    assert types.count("model_call") == 4
    transitions = [(e.payload["from"], e.payload["to"]) for e in events if e.type == "transition"]
    assert transitions[0] == ("Idle", "PreTurn") and transitions[-1] == ("PostTurn", "COMPLETED")
    ledger = await store.ledger("run1")
    assert {e.status for e in ledger.values()} == {LedgerStatus.COMPLETED}
    assert sorted(e.result["content"][0]["text"] for e in ledger.values()) == ["noted 0", "noted 1", "noted 2"]
    assert (await store.get_session("run1")).lease_owner is None  # released at the end


async def test_storage_grows_linearly_with_turns(store) -> None:
    async def size_after(turns: int, sid: str) -> int:
        script = [tool_call_response(("note", {"text": "x" * 50})) for _ in range(turns)] + ["done"]
        await Agent(ScriptedProvider(script), tools=[note], store=store).run("go", session_id=sid)
        events = await store.read_events(sid)
        return sum(len(str(e.payload)) for e in events) + len(events) * 100

    small, big = await size_after(10, "a"), await size_after(40, "b")
    # 4x the turns costs about 4x the storage (not 16x, as a full copy per checkpoint would)
    assert 3.0 < big / small < 5.0
