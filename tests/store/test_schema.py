"""Data written by schema version 1 (tests/data/sessions_v1.sqlite, never regenerated) loads and resumes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fsm_agent import Agent, ScriptedProvider, StopReason, tool
from fsm_agent.control import Decision
from fsm_agent.errors import ResumeError
from fsm_agent.store.sessions import load_session, upgrade_event
from fsm_agent.store import SCHEMA_VERSION, EventRecord, SQLiteStore
from fsm_agent.store.sqlite import MIGRATIONS

FIXTURE = Path(__file__).parents[1] / "data" / "sessions_v1.sqlite"


@tool(effect="side_effect")
def send_email(to: str, body: str) -> str:
    """Send an e-mail."""
    return f"sent to {to}"


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "v1.sqlite"
    shutil.copy(FIXTURE, path)
    s = SQLiteStore(path)
    yield s


async def test_v1_records_load(store) -> None:
    assert store.schema_version() == len(MIGRATIONS)
    sessions = {s.session_id: s for s in await store.list_sessions()}
    assert {k: v.state for k, v in sessions.items()} == {
        "v1-waiting": "WAITING_HUMAN", "v1-completed": "COMPLETED", "v1-paused": "PAUSED_BUDGET"}
    loaded = await load_session(store, "v1-waiting")
    assert [m.role for m in loaded.transcript] == ["system", "user", "assistant"]
    assert loaded.record.stop["pending_actions"][0]["call"]["id"] == "call_v1"
    events = await store.read_events("v1-waiting")
    assert {e.schema_version for e in events} == {1}
    assert events[0].type == "session_started"


async def test_v1_waiting_session_resumes_with_a_decision(store) -> None:
    agent = Agent(ScriptedProvider(["Mail sent."]), tools=[send_email], store=store)
    result = await agent.resume("v1-waiting", decisions={"call_v1": Decision.approve()})
    assert result.stop.reason is StopReason.COMPLETED
    assert [m.text for m in result.messages if m.role == "tool"] == ["sent to ann@example.com"]


async def test_v1_paused_session_resumes_with_a_budget(store) -> None:
    agent = Agent(ScriptedProvider(["ok"]), tools=[send_email], store=store)
    result = await agent.resume("v1-paused", max_iterations=5)
    assert result.stop.reason is StopReason.COMPLETED and result.turns == 2


async def test_v1_completed_session_is_final(store) -> None:
    with pytest.raises(ResumeError, match="ended COMPLETED"):
        await Agent(ScriptedProvider([]), store=store).resume("v1-completed")


def test_newer_records_are_refused_clearly() -> None:
    future = EventRecord("s", 1, "message", {}, schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(ValueError, match="newer than this fsm_agent"):
        upgrade_event(future)
    assert upgrade_event(EventRecord("s", 1, "message", {}, schema_version=1)).seq == 1
