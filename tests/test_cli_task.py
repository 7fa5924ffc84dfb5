"""The command line's task mode and session permissions (issue 23 items 1 and 8): ``fsm-agent task
FILE``, ``run --permissions/--allow-tools``, ``control ID restrict|request_permissions``, and a task
session resumed by ``fsm-agent resume``; against a real HTTP server (``ReplayServer``), in a
subprocess, as a user runs them."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import orjson

from fsm_agent.testing import RecordedResponse, ReplayServer


def chunk(delta: dict, finish: str | None = None) -> bytes:
    c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "test-model",
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if finish:
        c["usage"] = {"prompt_tokens": 50, "completion_tokens": 10}
    return b"data: " + orjson.dumps(c) + b"\n\n"


def answer(text: str) -> bytes:
    return chunk({"role": "assistant", "content": text}) + chunk({}, "stop") + b"data: [DONE]\n\n"


def tool_turn(name: str, arguments: dict[str, Any], cid: str = "call_1") -> bytes:
    return (chunk({"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]})
        + chunk({}, "tool_calls") + b"data: [DONE]\n\n")


CITY = {"name": "Paris", "population": 2102650}
TASK = textwrap.dedent('''
    name = "largest-city"
    goal = "Find the largest city of France and its population."
    constraints = ["Answer with the JSON only."]

    [budget]
    max_iterations = 4

    [output_schema]
    name = "city"
    schema = { type = "object", properties = { name = { type = "string" }, population = { type = "integer" } }, required = ["name", "population"], additionalProperties = false }

    [[check]]
    name = "a real population"
    value = "output.population"
    gt = 1000000
''')


async def cli(*args: str, responses: list[bytes] = (), store: Path | None = None,
              server: ReplayServer | None = None) -> tuple[int, str, str, Any]:
    """Run ``fsm-agent ARGS`` in a subprocess against ``server`` (default: a new one answering ``responses``)."""
    own = server is None
    if server is None:
        server = ReplayServer([RecordedResponse(200, r, "text/event-stream") for r in responses], seed=4)
    base = await server.start() if own else server.base_url
    env = {**os.environ, "FSM_AGENT_BASE_URL": base}
    env.pop("FSM_AGENT_PROVIDER", None)
    if store is not None:
        env["FSM_AGENT_STORE"] = str(store)
    model = ("--model", "test-model", "--api-key", "k") if args[0] in ("run", "task") else (
        ("--api-key", "k") if args[0] == "resume" else ())
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fsm_agent.cli", *args, *model, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if own:
        await server.close()
    return proc.returncode or 0, out.decode(), err.decode(), server


async def shared_server(*responses: bytes) -> ReplayServer:
    """One scripted server for a session's run and its resumes (a resume keeps the run's base URL)."""
    server = ReplayServer([RecordedResponse(200, r, "text/event-stream") for r in responses], seed=4)
    await server.start()  # sets base_url
    return server


async def test_task_prints_the_validated_output_and_reports_the_checks(tmp_path: Path) -> None:
    (tmp_path / "city.toml").write_text(TASK)
    code, out, err, server = await cli("task", str(tmp_path / "city.toml"), responses=[answer(json.dumps(CITY))],
                                       store=tmp_path / "s.db")
    assert code == 0, err
    assert json.loads(out) == CITY  # stdout: the output only
    assert "task: succeeded" in err and "check passed: a real population ('output.population' gt 1000000)" in err
    assert "stop: COMPLETED" in err
    first = server.requests[0].json()
    assert first["messages"][-1]["content"].startswith("TASK: Find the largest city of France")
    assert first["response_format"]["json_schema"]["name"] == "city"


async def test_task_that_fails_its_checks_exits_with_the_failure_and_prints_no_output(tmp_path: Path) -> None:
    (tmp_path / "city.toml").write_text("max_repairs = 1\n" + TASK)
    small = answer(json.dumps({"name": "Paris", "population": 5}))
    code, out, err, server = await cli("task", str(tmp_path / "city.toml"), responses=[small, small],
                                       store=tmp_path / "s.db")
    assert code == 7 and out == ""
    assert "task: failed" in err and "check FAILED: a real population ('output.population' is 5: not gt 1000000)" in err
    assert len(server.requests) == 2  # the answer and one repair


async def test_task_json_is_the_task_result(tmp_path: Path) -> None:
    (tmp_path / "city.json").write_text(json.dumps({"goal": "Name the largest city of France.",
                                                    "check": [{"name": "paris", "value": "answer",
                                                               "contains": "Paris"}]}))
    code, out, err, _ = await cli("task", str(tmp_path / "city.json"), "--json", responses=[answer("It is Paris.")],
                                  store=tmp_path / "s.db")
    assert code == 0, err
    result = json.loads(out)
    assert result["outcome"] == "succeeded" and result["output"] == "It is Paris."
    assert result["checks"] == [{"name": "paris", "ok": True, "reason": "'answer' contains 'Paris'"}]
    assert result["stop"]["reason"] == "COMPLETED" and result["usage"]["input_tokens"] == 50


async def test_a_bad_task_file_is_a_usage_error_naming_every_problem(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text('goal = ""\n[budget]\nmax_iterations = -1\n[[check]]\nname = "x"\n')
    code, out, err, server = await cli("task", str(tmp_path / "bad.toml"))
    assert code == 2 and out == "" and server.requests == []
    assert "'goal' must say what to do" in err and "'max_iterations' must be a whole number above 0" in err
    assert "check 1: check 'x': give exactly one of" in err


async def test_run_allow_tools_limits_the_session_and_a_call_outside_is_denied(tmp_path: Path) -> None:
    code, out, err, server = await cli("run", "What is 17*23?", "--tool", "calculator", "--tool", "clock",
                                       "--allow-tools", "clock",
                                       responses=[tool_turn("calculator", {"expression": "17*23"}), answer("391")],
                                       store=tmp_path / "s.db")
    assert code == 0, err
    first, second = (r.json() for r in server.requests)
    assert [t["function"]["name"] for t in first["tools"]] == ["clock"]
    denied = second["messages"][-1]
    assert denied["role"] == "tool" and denied["content"].startswith(
        "Tool call denied: outside this session's permissions (tools)")


async def test_run_permissions_file_scopes_arguments(tmp_path: Path) -> None:
    (tmp_path / "perms.toml").write_text('tools = ["calculator"]\n[[scope]]\ntool = "calculator"\narg = "expression"\n'
                                         'matches = "[0-9+ ]+"\n')
    code, _, err, server = await cli("run", "What is 17*23?", "--tool", "calculator",
                                     "--permissions", str(tmp_path / "perms.toml"),
                                     responses=[tool_turn("calculator", {"expression": "17*23"}), answer("?")],
                                     store=tmp_path / "s.db")
    assert code == 0, err
    assert "(scope 1 calculator: 'expression' matches '[0-9+ ]+')" in server.requests[1].json()["messages"][-1]["content"]
    (tmp_path / "bad.toml").write_text('tools = 3\n')
    code, _, err, _ = await cli("run", "x", "--permissions", str(tmp_path / "bad.toml"))
    assert code == 2 and "'tools' must be a tool name or glob pattern" in err


async def test_control_restrict_narrows_a_waiting_session_before_its_call_runs(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    server = await shared_server(tool_turn("calculator", {"expression": "17*23"}), answer("no tools"))
    try:
        code, _, err, _ = await cli("run", "What is 17*23?", "--tool", "calculator", "--approve-tools", "calculator",
                                    "--session-id", "w1", store=db, server=server)
        assert code == 3, err
        code, _, err, _ = await cli("control", "w1", "restrict", '{"tools": []}', "--reason", "frozen", store=db)
        assert code == 0 and "queued restrict for session w1" in err
        code, _, err, _ = await cli("resume", "w1", "--approve", "call_1", store=db, server=server)
        assert code == 0, err
        sent = server.requests[1].json()["messages"]
        assert sent[-1]["content"].startswith("Tool call denied: outside this session's permissions (restriction 1: "
                                              "tools)") and "frozen" in sent[-1]["content"]
        assert "tools" not in server.requests[1].json()  # nothing is offered any more
        code, _, err, _ = await cli("control", "w1", "request_permissions", "{not json", store=db)
        assert code == 2 and "not valid JSON" in err
    finally:
        await server.close()


async def test_control_request_permissions_waits_for_a_persons_approval(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    server = await shared_server(tool_turn("calculator", {"expression": "1+1"}),
                                 tool_turn("clock", {"timezone": "UTC"}, "call_2"), answer("done"))
    try:
        code, _, err, _ = await cli("run", "hi", "--tool", "calculator", "--tool", "clock", "--allow-tools", "calculator",
                                    "--approve-tools", "calculator", "--session-id", "r1", store=db, server=server)
        assert code == 3, err
        (tmp_path / "wide.toml").write_text('tools = ["calculator", "clock"]\n')
        code, _, err, _ = await cli("control", "r1", "request_permissions", str(tmp_path / "wide.toml"),
                                    "--reason", "the task needs the time", store=db)
        assert code == 0, err
        code, _, err, _ = await cli("resume", "r1", "--approve", "call_1", store=db, server=server)
        assert code == 3, err  # the calculator ran; then the request waits for a person
        pending = [line for line in err.splitlines() if line.startswith("pending: ")]
        assert len(pending) == 1 and " request_permissions(" in pending[0] and "the task needs the time" in pending[0]
        request_id = pending[0].split()[1]
        code, _, err, _ = await cli("resume", "r1", "--approve", request_id, store=db, server=server)
        assert code == 0, err
        assert "← clock:" in err  # allowed now
        assert [t["function"]["name"] for t in server.requests[1].json()["tools"]] == ["calculator", "clock"]
    finally:
        await server.close()


async def test_a_paused_task_session_resumes_as_its_task(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    (tmp_path / "city.toml").write_text(TASK.replace("max_iterations = 4", "max_iterations = 1"))
    server = await shared_server(answer(json.dumps({"name": "Paris", "population": 5})), answer(json.dumps(CITY)))
    try:
        code, _, err, _ = await cli("task", str(tmp_path / "city.toml"), "--session-id", "t1", store=db, server=server)
        assert code == 4 and "task: incomplete" in err, err
        code, out, err, _ = await cli("resume", "t1", "--budget", "iterations=3", store=db, server=server)
        assert code == 0, err
        assert json.loads(out) == CITY and "task: succeeded" in err
        feedback = server.requests[1].json()["messages"][-1]["content"]
        assert feedback.startswith("Your answer did not pass the task's acceptance checks")
    finally:
        await server.close()
