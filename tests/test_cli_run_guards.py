"""Mistakes the CLI catches before it starts anything: a reused ``run --session-id``, resume
decisions that do not fit the session, ``--approve-tools`` naming no enabled tool.

Each check runs before the local llama.cpp server would start (these runs have no provider
configured, so they would otherwise start it) and before any lease is taken.
"""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

import pytest

from fsm_agent import SessionExistsError
from fsm_agent.cli import main
from fsm_agent.store import SQLiteStore
from fsm_agent.store.base import SessionRecord

LOCAL = {"provider": "local", "base_url": None, "model": None, "tool_mode": None, "tools": ["calculator"],
         "system": None, "middleware": [], "default_middleware": True, "policy": None,
         "approve_tools": ["calculator"]}
PENDING = {"reason": "WAITING_HUMAN", "detail": "1 tool call(s) need approval: calculator", "pending_actions": [
    {"call": {"id": "call_1", "name": "calculator", "input": {"expression": "17 * 23"}},
     "reason": "tool 'calculator' needs human approval", "allowed_decisions": ["approve", "reject"]}]}


@pytest.fixture(autouse=True)
def _no_provider(monkeypatch) -> None:
    for name in ("FSM_AGENT_PROVIDER", "FSM_AGENT_BASE_URL", "FSM_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)


def store_path() -> Path:
    return Path(os.environ["FSM_AGENT_HOME"]) / "sessions.db"


def add_session(session_id: str, state: str, stop: dict | None = None) -> None:
    async def go() -> None:
        store = SQLiteStore(store_path())
        try:
            await store.create_session(SessionRecord(session_id, state, goal="What is 17*23?", stop=stop,
                                                     metadata={"cli": LOCAL}))
        finally:
            await store.close()

    asyncio.run(go())


def lease_owner(session_id: str) -> str | None:
    async def go() -> str | None:
        store = SQLiteStore(store_path())
        try:
            rec = await store.get_session(session_id)
            assert rec is not None
            return rec.lease_owner
        finally:
            await store.close()

    return asyncio.run(go())


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_run_with_an_existing_session_id_is_refused_before_the_local_server_starts() -> None:
    add_session("taken", "WAITING_HUMAN", PENDING)
    code, out, err = cli("run", "hi", "--session-id", "taken")
    assert (code, out) == (2, "")
    assert err == ("fsm-agent: session 'taken' already exists (WAITING_HUMAN); continue it with "
                   "`fsm-agent resume taken`, or choose another --session-id\n")


def test_run_with_the_id_of_a_finished_session_says_to_choose_another() -> None:
    add_session("done", "COMPLETED")
    code, _, err = cli("run", "hi", "--session-id", "done")
    assert code == 2
    assert err == ("fsm-agent: session 'done' already exists and ended COMPLETED; choose another --session-id "
                   "(or leave it out for a new random id)\n")


def test_session_exists_error_from_agent_run_is_exit_2(monkeypatch) -> None:
    async def taken(self, task, *, session_id=None, **kw):  # another process created it after the CLI looked
        raise SessionExistsError(session_id)

    monkeypatch.setattr("fsm_agent.agent.Agent.run", taken)
    code, _, err = cli("run", "hi", "--provider", "openai", "--api-key", "k", "--model", "m", "--session-id", "raced")
    assert code == 2
    assert err.endswith("fsm-agent: session 'raced' already exists; continue it with `fsm-agent resume raced`, "
                   "or choose another --session-id\n")


def test_a_mistyped_call_id_is_refused_before_the_server_and_without_a_lease() -> None:
    add_session("wait-1", "WAITING_HUMAN", PENDING)
    code, out, err = cli("resume", "wait-1", "--approve", "call_l")
    assert (code, out) == (2, "")
    assert "no pending tool call 'call_l' (pending: call_1)" in err
    assert "embedded local model" not in err and "llama" not in err
    assert lease_owner("wait-1") is None


def test_a_decision_the_call_does_not_allow_is_refused_before_the_server() -> None:
    add_session("wait-2", "WAITING_HUMAN", PENDING)
    code, _, err = cli("resume", "wait-2", "--respond", "call_1=391")
    assert code == 2
    assert "tool call 'call_1' allows approve, reject, not 'respond'" in err
    assert "embedded local model" not in err and lease_owner("wait-2") is None


@pytest.mark.parametrize(("argv", "problem"), [
    (["--approve", "call_1", "--reject", "call_1"], "tool call 'call_1' has two decisions (--approve and --reject)"),
    (["--reject", "call_1", "--message", "no", "--message", "never"], "got 2 --message for 1 --reject"),
])
def test_contradicting_decisions_are_usage_errors(argv: list[str], problem: str) -> None:
    add_session("wait-3", "WAITING_HUMAN", PENDING)
    code, _, err = cli("resume", "wait-3", *argv)
    assert code == 2 and problem in err
    assert "embedded local model" not in err


def test_approve_tools_must_name_an_enabled_tool() -> None:
    code, _, err = cli("run", "hi", "--tool", "calculator", "--approve-tools", "calculater")
    assert code == 2
    assert "--approve-tools 'calculater': no enabled tool matches it (enabled: calculator)" in err
    code, _, err = cli("run", "hi", "--approve-tools", "calculator")
    assert code == 2 and "enable one with --tool NAME" in err


def test_the_policy_format_is_documented_and_linked(capsys) -> None:
    root = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "docs/policy.md" in help_text and "--approve-tools" in help_text
    readme = (root / "README.md").read_text()
    assert "[docs/policy.md](docs/policy.md)" in readme and "--approve-tools" in readme
    assert (root / "docs" / "policy.md").is_file()
