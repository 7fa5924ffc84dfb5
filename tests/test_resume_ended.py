"""Issue 19 item 11: resuming a session that has already ended.

After a crash a caller cannot know whether the run finished. ``agent.resume(id)`` on a session that
ended for good (COMPLETED, FAILED_TERMINAL, CANCELLED) raises ``SessionEndedError`` (a
``ResumeError``) whose ``result`` is the stored ``RunResult``; it never runs anything again: no
model call, no tool call. ``check_resume`` raises the same; the CLI says so with the stored stop.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import pytest

from fsm_agent import (Agent, Cancel, Middleware, ResumeError, ScriptedProvider, SessionEndedError, SQLiteStore,
                       StopReason, tool)
from fsm_agent.errors import ServerError
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore
from fsm_agent.testing import RecordedResponse, ReplayServer

RAN: list[str] = []


@tool
def lookup(q: str) -> str:
    """Look something up."""
    RAN.append(q)
    return f"found {q}"


@pytest.fixture(params=["memory", "sqlite"])
def store(request: Any, tmp_path: Any) -> Any:
    return MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "s.db")


@pytest.fixture(autouse=True)
def _reset() -> None:
    RAN.clear()


def _same(stored: Any, original: Any) -> None:
    """The stored result is the result the run returned (but its duration: nothing ran now)."""
    assert stored.session_id == original.session_id
    assert stored.stop.reason is original.stop.reason and stored.stop.detail == original.stop.detail
    assert stored.stop.error == original.stop.error
    assert stored.output == original.output and stored.messages == original.messages
    assert stored.usage == original.usage and stored.turns == original.turns
    assert stored.tool_calls == original.tool_calls and stored.cost_usd == original.cost_usd
    assert stored.model_stop_reason is original.model_stop_reason
    assert stored.duration_s == 0.0


async def test_a_completed_session_gives_back_its_stored_result_and_runs_nothing(store: Any) -> None:
    provider = ScriptedProvider([tool_call_response(("lookup", {"q": "ann"})), "Ann lives in Oslo."])
    agent = Agent(provider, tools=[lookup], store=store)
    done = await agent.run("Where does Ann live?", session_id="s1")
    assert done.stop.reason is StopReason.COMPLETED and RAN == ["ann"]
    for attempt in (agent.resume, agent.check_resume):
        with pytest.raises(SessionEndedError) as info:
            await attempt("s1")
        ended = info.value
        assert isinstance(ended, ResumeError)  # callers that catch ResumeError keep working
        assert ended.session_id == "s1" and ended.reason is StopReason.COMPLETED
        assert "ended COMPLETED" in str(ended)
        _same(ended.result, done)
    assert len(provider.requests) == 2 and RAN == ["ann"]  # nothing ran again


async def test_after_a_crash_another_process_finds_the_run_had_finished(tmp_path: Any) -> None:
    """The process that ran the session died after the run finished, before its caller saw the
    result: a new agent on the same store resumes, gets the result, and its provider is never called."""
    first = Agent(ScriptedProvider(["Paris."]), store=SQLiteStore(tmp_path / "s.db"))
    done = await first.run("Capital of France?", session_id="crash")
    later = ScriptedProvider(["must not be asked"])
    with pytest.raises(SessionEndedError) as info:
        await Agent(later, store=SQLiteStore(tmp_path / "s.db")).resume("crash")
    _same(info.value.result, done)
    assert info.value.result.output == "Paris." and later.requests == []


async def test_a_failed_terminal_session_gives_back_its_error(store: Any) -> None:
    agent = Agent(ScriptedProvider([ServerError("bad request", status=400, retryable=False)]), store=store)
    failed = await agent.run("hi", session_id="t")
    assert failed.stop.reason is StopReason.FAILED_TERMINAL
    with pytest.raises(SessionEndedError) as info:
        await agent.resume("t")
    assert info.value.reason is StopReason.FAILED_TERMINAL
    _same(info.value.result, failed)
    assert info.value.result.stop.error["status"] == 400


async def test_a_cancelled_session_gives_back_its_stop(store: Any) -> None:
    provider = ScriptedProvider([tool_call_response(("lookup", {"q": "x"})), "never"])
    agent = Agent(provider, tools=[lookup], store=store)

    class CancelAfterTools(Middleware):
        """Queues a Cancel once the tool ran: the run ends CANCELLED at the next safe point."""

        async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
            out = await call_next(call)
            await agent.control(ctx.session_id, Cancel("changed my mind"))
            return out

    agent.add_middleware(CancelAfterTools())
    cancelled = await agent.run("look", session_id="c")
    assert cancelled.stop.reason is StopReason.CANCELLED
    with pytest.raises(SessionEndedError) as info:
        await agent.resume("c")
    _same(info.value.result, cancelled)
    assert len(provider.requests) == 1 and RAN == ["x"]


async def test_resumable_sessions_still_resume(store: Any) -> None:
    agent = Agent(ScriptedProvider([ServerError("busy", status=503), "recovered"]), store=store)
    failed = await agent.run("hi", session_id="r")
    assert failed.stop.reason is StopReason.FAILED_RETRYABLE
    assert (await agent.resume("r")).output == "recovered"
    with pytest.raises(SessionEndedError):  # and now it has ended
        await agent.resume("r")


async def test_the_cli_says_the_session_had_ended_with_its_stored_stop(tmp_path: Any) -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"

    body = chunk({"role": "assistant", "content": "Paris."}) + chunk({}, "stop") + b"data: [DONE]\n\n"
    server = ReplayServer([RecordedResponse(200, body, "text/event-stream")])
    base = await server.start()
    env = {**os.environ, "FSM_AGENT_STORE": str(tmp_path / "s.db")}

    async def cli(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fsm_agent.cli", *args, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        return proc.returncode or 0, out.decode(), err.decode()

    try:
        code, _, err = await cli("run", "Capital of France?", "--base-url", base, "--model", "m", "--api-key", "k",
                                 "--session-id", "done-1")
        assert code == 0, err
        code, out, err = await cli("resume", "done-1")
    finally:
        await server.close()
    assert code == 2 and out == ""
    assert "session done-1 already ended COMPLETED; nothing was run again" in err
    assert "stop: COMPLETED — the model ended its turn" in err
    assert len(server.requests) == 1


async def test_a_session_written_by_schema_version_1_gives_back_its_result_too(tmp_path: Any) -> None:
    import shutil
    from pathlib import Path

    path = tmp_path / "v1.sqlite"
    shutil.copy(Path(__file__).parent / "data" / "sessions_v1.sqlite", path)
    provider = ScriptedProvider(["must not be asked"])
    with pytest.raises(SessionEndedError) as info:
        await Agent(provider, store=SQLiteStore(path)).resume("v1-completed")
    result = info.value.result
    assert result.stop.reason is StopReason.COMPLETED and result.stop.partial is None
    assert result.output and result.messages[-1].role == "assistant" and provider.requests == []
