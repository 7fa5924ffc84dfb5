"""fsm-agent sessions / resume / control, each in its own process against a real HTTP server."""

from __future__ import annotations

import asyncio
import json
import os
import sys


from fsm_agent.testing import RecordedResponse, ReplayServer
from test_cli import ANSWER, TOOL_TURN, chunk


async def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fsm_agent.cli", *args,
                                                env={**os.environ, **(env or {})},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_paused_session_is_listed_shown_and_resumed_with_a_budget() -> None:
    server = ReplayServer([RecordedResponse(200, r, "text/event-stream") for r in (TOOL_TURN, ANSWER)])
    base = await server.start()
    try:
        code, _, err = await cli("run", "What is 17*23?", "--tool", "calculator", "--base-url", base, "--model", "m",
                                 "--api-key", "k", "--max-iterations", "1", "--session-id", "sess-1")
        assert code == 4, err
        assert "session: sess-1 (continue with: fsm-agent resume sess-1 --budget iterations=N)" in err
        code, out, _ = await cli("sessions", "list")
        assert code == 0
        row = next(line for line in out.splitlines() if line.startswith("sess-1"))
        assert "PAUSED_BUDGET" in row and "What is 17*23?" in row
        code, out, _ = await cli("sessions", "show", "sess-1")
        assert "stop: PAUSED_BUDGET — iterations budget exhausted: 1 of 1 model calls used" in out
        assert "tool call call_1 calculator: completed (pure)" in out
        code, out, err = await cli("resume", "sess-1", "--budget", "iterations=5", "--api-key", "k")
        assert code == 0, err
        assert out == "17 * 23 = 391.\n"
        assert "stop: COMPLETED" in err
        code, out, _ = await cli("sessions", "show", "sess-1", "--events")
        types = [json.loads(line)["type"] for line in out.splitlines()]
        assert types[0] == "session_started" and types.count("run_stopped") == 2
        code, _, err = await cli("resume", "sess-1")
        assert code == 2 and "ended COMPLETED" in err
    finally:
        await server.close()


async def test_control_interrupt_from_another_process_stops_a_stream() -> None:
    slow = b"".join(chunk({"content": "word "}) for _ in range(400)) + chunk({}, "stop") + b"data: [DONE]\n\n"
    server = ReplayServer([RecordedResponse(200, slow, "text/event-stream", chunk_delay=0.02)], chunk_sizes=[64])
    base = await server.start()
    try:
        run = asyncio.ensure_future(cli("run", "talk", "--base-url", base, "--model", "m", "--api-key", "k",
                                        "--session-id", "sess-int", "--no-default-middleware"))
        for _ in range(300):  # wait until the other process's model call is streaming
            if server.requests:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        code, _, err = await cli("control", "sess-int", "interrupt", "stop now")
        assert code == 0 and "queued interrupt for session sess-int" in err
        code, out, err = await run
        assert code == 5, err
        assert "stop: INTERRUPTED — stop now (during Model; the " in err
        assert "characters that had streamed are kept in the transcript" in err
        assert 0 < out.count("word") < 400
        code, show, _ = await cli("sessions", "show", "sess-int", "--json")
        kept = json.loads(show)
        assert kept["messages"] == 2  # the user's message and the part of the answer that had streamed
        code, _, err = await cli("control", "sess-int", "interrupt")
        assert code == 2 and "is not running (INTERRUPTED): there is nothing to interrupt" in err
    finally:
        await server.close()


async def test_control_steer_needs_text_and_unknown_sessions_are_reported(tmp_path) -> None:
    code, _, err = await cli("control", "nope", "steer")
    assert code == 2 and "needs a TEXT" in err
    code, _, err = await cli("control", "nope", "interrupt")
    assert code == 2 and "no session store at" in err  # nothing stored yet: a mistyped --store is caught
    code, _, err = await cli("sessions", "list", "--store", str(tmp_path / "missing" / "x.db"))
    assert code == 2 and not (tmp_path / "missing").exists()
    server = ReplayServer([RecordedResponse(200, ANSWER, "text/event-stream")])
    base = await server.start()
    try:
        code, _, err = await cli("run", "hi", "--base-url", base, "--model", "m", "--api-key", "k",
                                 "--session-id", "done-1")
    finally:
        await server.close()
    assert code == 0 and "session: done-1\n" in err
    code, _, err = await cli("control", "nope", "interrupt")
    assert code == 2 and "unknown session 'nope'" in err
    code, _, err = await cli("control", "done-1", "cancel")
    assert code == 2 and "ended COMPLETED; it takes no more control events" in err
    code, _, err = await cli("sessions", "show", "nope")
    assert code == 2


async def test_decode_prints_the_final_response_and_the_events(tmp_path) -> None:
    body = tmp_path / "body.sse"
    body.write_bytes(TOOL_TURN)
    code, out, err = await cli("decode", "--protocol", "openai-chat", str(body))
    assert code == 0, err
    resp = json.loads(out)
    assert resp["stop_reason"] == "tool_use"
    assert resp["message"]["content"][0] == {"id": "call_1", "name": "calculator", "input": {"expression": "17 * 23"},
                                             "raw_input": None, "provider_data": None, "type": "tool_use"}
    code, out, _ = await cli("decode", "--protocol", "openai-chat", "--events", str(body))
    events = [json.loads(line)["type"] for line in out.splitlines()]
    assert events[0] == "message_start" and events[-1] == "message_complete"
    assert events.count("tool_call_arguments_delta") == 1


async def test_decode_malformed_input_prints_what_it_got_and_fails(tmp_path) -> None:
    body = tmp_path / "broken.sse"
    body.write_bytes(ANSWER[: ANSWER.index(b"391")] + b'391."}}]}\n\ndata: {"choices": [oops\n\n')
    code, out, err = await cli("decode", "--protocol", "openai-chat", str(body))
    assert code == 1
    assert json.loads(out)["message"]["content"][0]["text"] == "17 * 23 = 391."
    assert "decoded so far" in err and "ProviderProtocolError" in err and "not JSON" in err
    code, out, err = await cli("decode", "--protocol", "anthropic", str(tmp_path / "broken.sse"))
    assert code == 1


async def test_middleware_list_shows_installed_plugins() -> None:
    code, out, _ = await cli("middleware", "list")
    assert code == 0
    for name in ("approval", "budget", "loop_detection", "redaction", "repair", "retry", "tool_activation",
                 "tool_policy", "verifier"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert "fsm_agent_middleware.loop_detection:LoopDetection" in out and "order=innermost" in out


async def test_approve_tools_stops_waiting_human_and_a_typo_does_not_block_the_right_resume() -> None:
    server = ReplayServer([RecordedResponse(200, r, "text/event-stream") for r in (TOOL_TURN, ANSWER)])
    base = await server.start()
    try:
        code, out, err = await cli("run", "What is 17*23?", "--tool", "calculator", "--approve-tools", "calculator",
                                   "--base-url", base, "--model", "m", "--api-key", "k", "--session-id", "wait-1")
        assert code == 3, err
        assert "stop: WAITING_HUMAN — 1 tool call(s) need approval: calculator" in err
        assert 'pending: call_1 calculator({"expression":"17 * 23"})' in err
        assert "(continue with: fsm-agent resume wait-1 --approve call_1; or, per call, --reject CALL" in err
        assert "← calculator" not in err  # nothing ran
        code, _, err = await cli("resume", "wait-1", "--approve", "call_l")
        assert code == 2 and "no pending tool call 'call_l' (pending: call_1)" in err
        code, out, err = await cli("resume", "wait-1", "--approve", "call_1")  # at once: no lease was left behind
        assert code == 0, err
        assert "← calculator: 391" in err and out == "17 * 23 = 391.\n"
        assert len(server.requests) == 2
    finally:
        await server.close()
