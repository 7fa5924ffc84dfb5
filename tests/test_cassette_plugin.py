"""The pytest plugin of cassettes, as a user meets it: a project whose conftest.py enables
``fsm_agent.testing.pytest_plugin`` and whose test uses the ``cassette`` fixture, run by pytest in a
subprocess (record once, replay without the network, a changed prompt failing with what changed,
re-recording with the mode option or the environment, a marker's file, a mismatch the code under
test swallowed still failing the test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CONFTEST = 'pytest_plugins = ["fsm_agent.testing.pytest_plugin"]\n'

TEST = '''
import asyncio, os

import orjson
import pytest

from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider
from fsm_agent.testing import CassetteMismatch, RecordedResponse, ReplayServer
from fsm_agent.types import MessageRequest, TextDelta, UserMessage


def body(text):
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    end = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    return b"data: " + orjson.dumps(chunk) + b"\\n\\ndata: " + orjson.dumps(end) + b"\\n\\ndata: [DONE]\\n\\n"


async def ask(prompt):
    """The code under test: one streamed call to a provider (a loopback server stands in for it)."""
    async with ReplayServer([RecordedResponse(200, body(os.environ["ANSWER"]), "text/event-stream")],
                            chunk_sizes=[9]) as server:
        p = create_provider("openai-compatible", ProviderConfig(
            base_url=server.base_url + "/v1", model="m", api_key="sk-user-secret-000",
            retry=RetryPolicy(max_attempts=1)))
        try:
            text = "".join([e.text async for e in p.chat_stream(MessageRequest("m", [UserMessage(prompt)]))
                            if isinstance(e, TextDelta)])
        finally:
            await p.aclose()
        with open(os.environ["SENT_LOG"], "a") as f:
            f.write(f"{len(server.requests)}\\n")
        return text


def test_capital(cassette):
    assert asyncio.run(ask(os.environ["PROMPT"])) == "Paris"


@pytest.mark.cassette("shared/swallowed.json")
def test_swallowed(cassette):
    async def main():
        try:
            return await ask(os.environ["PROMPT"])
        except CassetteMismatch:
            return "Paris"   # code that catches every error
    assert asyncio.run(main()) == "Paris"
'''


def pytest_run(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "FSM_AGENT_CASSETTE_MODE"}
    full.update({"ANSWER": "Paris", "PROMPT": "Capital of France?", "SENT_LOG": str(project / "sent.log"), **env})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=project,
                          env=full, capture_output=True, text=True, timeout=120)


def sent(project: Path) -> list[int]:
    log = project / "sent.log"
    out = [int(n) for n in log.read_text().split()] if log.exists() else []
    log.unlink(missing_ok=True)
    return out


def test_the_cassette_fixture_records_replays_reports_changes_and_re_records(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_geo.py").write_text(TEST)
    capital = tmp_path / "cassettes" / "test_geo" / "test_capital.json"
    swallowed = tmp_path / "shared" / "swallowed.json"

    # the default mode replays only: with no cassette yet, the test says how to record it
    run = pytest_run(tmp_path, "test_geo.py::test_capital")
    assert run.returncode == 1 and "no cassette at" in run.stdout and "--cassette-mode=once" in run.stdout, run.stdout
    assert sent(tmp_path) == []

    run = pytest_run(tmp_path, "--cassette-mode=once")
    assert run.returncode == 0, run.stdout + run.stderr
    assert sent(tmp_path) == [1, 1] and capital.is_file() and swallowed.is_file()
    assert "sk-user-secret-000" not in capital.read_text()
    assert json.loads(capital.read_text())[0]["request"]["body"]["messages"][0]["content"] == "Capital of France?"

    # replayed: the loopback server answers nothing
    run = pytest_run(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sent(tmp_path) == [0, 0]

    # a changed prompt fails, naming what changed (once per test), and how to re-record
    run = pytest_run(tmp_path, PROMPT="Capital of Italy?")
    assert run.returncode == 1
    out = run.stdout
    assert "FAILED test_geo.py::test_capital" in out
    assert 'body.messages[0].content: "Capital of France?" -> "Capital of Italy?"' in out
    assert "--cassette-mode=all" in out
    # the test that swallowed the error fails too, at teardown, with the same account
    # (counted in the reports above the short summary, whose lines are cut to the terminal's width)
    reports = out.split("short test summary info", 1)[0]
    assert "ERROR test_geo.py::test_swallowed" in out and reports.count("no recorded request matches") == 2, out
    assert sent(tmp_path) == []

    # re-record, by the environment variable as CI would set it
    run = pytest_run(tmp_path, PROMPT="Capital of Italy?", FSM_AGENT_CASSETTE_MODE="all")
    assert run.returncode == 0, run.stdout + run.stderr
    assert sent(tmp_path) == [1, 1]
    assert json.loads(capital.read_text())[0]["request"]["body"]["messages"][0]["content"] == "Capital of Italy?"
    run = pytest_run(tmp_path, PROMPT="Capital of Italy?")
    assert run.returncode == 0 and sent(tmp_path) == [0, 0], run.stdout

    run = pytest_run(tmp_path, "--cassette-mode=sometimes")
    assert run.returncode == 4 and "invalid choice: 'sometimes'" in run.stderr
