"""The fsm-agent command: run against a real HTTP server, exit codes, JSON output, diagram check."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from pathlib import Path

import orjson

from fsm_agent.cli import main
from fsm_agent.diagrams import render_machine
from fsm_agent.testing import RecordedResponse, ReplayServer

ROOT = Path(__file__).resolve().parents[1]


def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "test-model",
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        c["usage"] = usage
    return b"data: " + orjson.dumps(c) + b"\n\n"


TOOL_TURN = (chunk({"role": "assistant", "content": None, "tool_calls": [
    {"index": 0, "id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": ""}}]})
    + chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"expression": "17 * 23"}'}}]})
    + chunk({}, "tool_calls", {"prompt_tokens": 50, "completion_tokens": 10}) + b"data: [DONE]\n\n")
ANSWER = (chunk({"role": "assistant", "content": "17 * 23 = "}) + chunk({"content": "391."})
          + chunk({}, "stop", {"prompt_tokens": 70, "completion_tokens": 6}) + b"data: [DONE]\n\n")


async def run_cli(*args: str, responses: list[bytes]) -> tuple[int, str, str, ReplayServer]:
    server = ReplayServer([RecordedResponse(200, r, "text/event-stream") for r in responses], seed=4)
    base = await server.start()
    env = {**os.environ, "FSM_AGENT_BASE_URL": base}
    env.pop("FSM_AGENT_PROVIDER", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fsm_agent.cli", "run", *args, "--model", "test-model", "--api-key", "k",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    await server.close()
    return proc.returncode or 0, out.decode(), err.decode(), server


async def test_run_streams_the_answer_and_shows_tool_calls() -> None:
    code, out, err, server = await run_cli("What is 17*23?", "--tool", "calculator", responses=[TOOL_TURN, ANSWER])
    assert code == 0, err
    assert out == "17 * 23 = 391.\n"
    assert '→ tool calculator({"expression":"17 * 23"})' in err
    assert "← calculator: 391" in err
    assert "stop: COMPLETED" in err and "usage: 120 input + 16 output tokens" in err
    first, second = (r.json() for r in server.requests)
    assert first["stream"] is True and first["tools"][0]["function"]["name"] == "calculator"
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "391"}


async def test_json_output_is_the_run_result() -> None:
    code, out, err, _ = await run_cli("What is 17*23?", "--tool", "calculator", "--json", responses=[TOOL_TURN, ANSWER])
    assert code == 0, err
    result = json.loads(out)
    assert result["stop"]["reason"] == "COMPLETED"
    assert result["output"] == "17 * 23 = 391."
    assert result["turns"] == 2 and result["tool_calls"] == 1
    assert [m["role"] for m in result["messages"]] == ["user", "assistant", "tool", "assistant"]


async def test_budget_stop_has_its_own_exit_code() -> None:
    code, out, err, _ = await run_cli("loop", "--tool", "calculator", "--max-iterations", "1", responses=[TOOL_TURN])
    assert code == 4
    assert "stop: PAUSED_BUDGET — iterations budget exhausted: 1 of 1 model calls used" in err


async def test_provider_error_is_a_clear_message_and_exit_code() -> None:
    server = ReplayServer([RecordedResponse(401, b'{"error":{"message":"Incorrect API key provided","type":"invalid_request_error","code":"invalid_api_key"}}')])
    base = await server.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fsm_agent.cli", "run", "hi", "--base-url", base, "--model", "m", "--api-key", "bad",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    await server.close()
    assert proc.returncode == 7
    assert "FAILED_TERMINAL" in err.decode() and "authentication failed: Incorrect API key provided" in err.decode()
    assert "Traceback" not in err.decode()


def test_missing_api_key_is_a_configuration_error(monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("FSM_AGENT_API_KEY", raising=False)
    err = io.StringIO()
    assert main(["run", "hi", "--provider", "openai"], out=io.StringIO(), err=err) == 2
    assert "needs an API key: set OPENAI_API_KEY (or ProviderConfig(api_key=...); CLI: --api-key)" in err.getvalue()


def test_unknown_tool_and_provider() -> None:
    err = io.StringIO()
    assert main(["run", "hi", "--provider", "nope"], out=io.StringIO(), err=err) == 2
    assert "unknown provider 'nope'" in err.getvalue()
    err = io.StringIO()
    assert main(["run", "hi", "--provider", "openai", "--api-key", "k", "--tool", "rm"], out=io.StringIO(), err=err) == 2
    assert "unknown tool 'rm'; demo tools: calculator, clock" in err.getvalue()


def test_committed_diagram_matches_the_table() -> None:
    assert (ROOT / "diagrams" / "agent_loop.mmd").read_text() == render_machine()
    err = io.StringIO()
    assert main(["diagram", "--check", "--output", str(ROOT / "diagrams" / "agent_loop.mmd")], out=io.StringIO(), err=err) == 0


def test_diagram_check_fails_on_drift(tmp_path: Path) -> None:
    stale = tmp_path / "agent_loop.mmd"
    stale.write_text(render_machine().replace("tool_use", "tool_call"))
    err = io.StringIO()
    assert main(["diagram", "--check", "--output", str(stale)], out=io.StringIO(), err=err) == 1
    assert "differs from the transition table" in err.getvalue()
    assert main(["diagram", "--output", str(stale)], out=io.StringIO(), err=io.StringIO()) == 0
    assert stale.read_text() == render_machine()


def test_diagram_has_every_row() -> None:
    from fsm_agent.machine import TRANSITIONS

    text = render_machine()
    for t in TRANSITIONS:
        assert f"{t.source.value} --> {t.dest.value}: {t.trigger.value}" in text
