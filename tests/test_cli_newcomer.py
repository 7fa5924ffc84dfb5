"""What a newcomer tripped on at the command line (issue 23 item 13): ``--model`` with no provider,
``resume`` and the run's budget flags, a bad flag after a subcommand, ``serve`` with ``run``'s agent
flags. Runs are in process (``main``), against a ReplayServer on its own thread's loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_agent.cli import main
from test_cli import ANSWER, TOOL_TURN
from test_cli_first_user import cli, no_local_server, remote, served  # noqa: F401 - no_local_server: a fixture

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FSM_AGENT_PROVIDER", "FSM_AGENT_BASE_URL", "FSM_AGENT_STORE", "FSM_AGENT_MODEL"):
        monkeypatch.delenv(name, raising=False)


# -- run --model with no provider ----------------------------------------------------------------
@pytest.mark.parametrize("argv", [["--model", "gpt-4o-mini"], ["--provider", "local", "--model", "gpt-4o-mini"]])
def test_a_model_with_no_provider_is_refused_before_anything_starts(no_local_server: None, argv: list[str]) -> None:
    code, out, err = cli("run", "What is 17*23?", *argv)
    assert (code, out) == (2, "")
    assert err.startswith("fsm-agent: --model gpt-4o-mini names a provider's model, but no provider is configured: "
                          "the embedded local model (SmolLM2-135M) would run instead"), err
    assert "--provider" in err and "--base-url" in err and "--local-model PATH.gguf" in err


def test_a_model_from_the_environment_with_no_provider_is_named_as_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsm_agent.local import MODEL_FILE

    monkeypatch.setenv("FSM_AGENT_MODEL", "gpt-4o-mini")
    with served(ANSWER) as (base, server):
        class Embedded:  # the embedded server, already running at ``base``
            def __init__(self, path: Any = None, log: Any = None) -> None:
                self.model_path, self.base_url = f"/models/{MODEL_FILE}", base + "/v1"

            def start(self) -> None: ...

            def stop(self) -> None: ...

        monkeypatch.setattr("fsm_agent.local.LocalLlamaServer", Embedded)
        code, out, err = cli("run", "What is 17*23?", "--no-default-middleware")
    assert code == 0 and out.strip() == "17 * 23 = 391."
    assert ("fsm-agent: note: the model name 'gpt-4o-mini' ($FSM_AGENT_MODEL) is not used: it names a provider's "
            "model, and no provider is configured; SmolLM2-135M runs") in err


# -- resume takes the run's budget flags ---------------------------------------------------------
def session_of(err: str) -> str:
    found = re.search(r"session ([0-9a-f]{32})", err)
    assert found, err
    return found.group(1)


def test_resume_takes_the_budget_flags_run_takes() -> None:
    with served(TOOL_TURN, ANSWER) as (base, server):
        code, _, err = cli("run", "What is 17*23?", *remote(base), "--tool", "calculator", "--max-iterations", "1")
        assert code == 4 and "iterations budget exhausted" in err
        sid = session_of(err)
        code, _, err = cli("resume", sid, "--max-iterations", "1")        # not above what is used
        assert code == 2 and "--budget iterations=1 is not above what session" in err, err
        code, _, err = cli("resume", sid, "--max-iterations", "3", "--budget", "iterations=4")
        assert code == 2 and "--max-iterations 3 and --budget iterations=4 disagree; give one" in err
        code, _, err = cli("resume", sid, "--timeout", "0")
        assert code == 2 and "--timeout must be a positive number" in err
        code, out, err = cli("resume", sid, "--max-iterations", "3", "--timeout", "900", "--max-tokens", "100000")
        assert code == 0, err
        assert out.strip().endswith("17 * 23 = 391.")
    code, out, err = cli("sessions", "show", sid, "--json")
    assert code == 0 and "COMPLETED" in out, out


def test_a_bad_flag_after_a_subcommand_prints_that_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["resume", "abc", "--max-cost", "3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fsm-agent resume ")
    assert "fsm-agent resume: error: unrecognized arguments: --max-cost 3; a resume raises a budget with --budget " \
           "NAME=VALUE (iterations, wall_clock, tokens, cost)" in err
    for argv, usage in ((["sessions", "show", "x", "--bogus"], "usage: fsm-agent sessions show "),
                        (["run", "hi", "--retries", "3"], "usage: fsm-agent run "),
                        (["diagram", "--bogus"], "usage: fsm-agent diagram ")):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert err.startswith(usage) and "error: unrecognized arguments: " in err, err


# -- serve takes run's agent flags ----------------------------------------------------------------
def test_serve_refuses_agent_flags_with_agent_and_checks_them_before_anything_starts(no_local_server: None) -> None:
    code, _, err = cli("serve", "--agent", "tests.server.serve_agent:make", "--tool", "calculator",
                       "--approve-tools", "calculator")
    assert code == 2
    assert err == ("fsm-agent: --agent tests.server.serve_agent:make serves your Agent as it is built, and --tool, "
                   "--approve-tools configure the agent the command line builds: give --agent or these, not both\n")
    code, _, err = cli("serve", "--tool", "calculator", "--approve-tools", "clock")
    assert code == 2 and "--approve-tools 'clock': no enabled tool matches it (enabled: calculator)" in err
    code, _, err = cli("serve", "--middleware", "no_such_plugin")
    assert code == 2 and "no_such_plugin" in err


@contextlib.contextmanager
def serving(argv: list[str]) -> Iterator[str]:
    """``fsm-agent serve ARGV --port 0`` as a user starts it (a process); yields its URL; SIGTERM stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "fsm_agent.cli", "serve", *argv, "--port", "0"], cwd=ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    url, lines = "", []
    try:
        for line in proc.stderr:
            lines.append(line)
            found = re.search(r"serving on (http://\S+) ", line)
            if found:
                url = found.group(1)
                break
        assert url, "".join(lines)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0
        finally:
            proc.stderr.close()


def call(url: str, method: str = "GET", body: object = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, json.loads(r.read() or b"null")


def wait_for(url: str, sid: str, state: str) -> dict[str, Any]:
    for _ in range(400):
        _, snap = call(f"{url}/sessions/{sid}")
        if snap["state"] == state and not snap["running"]:
            return snap
        time.sleep(0.05)
    raise AssertionError(f"{sid} did not reach {state}: {snap}")


def test_serve_with_tool_and_approve_tools_waits_for_a_person_and_runs_the_approved_call(tmp_path: Path) -> None:
    with served(TOOL_TURN, ANSWER) as (base, server):
        argv = [*remote(base), "--tool", "calculator", "--approve-tools", "calculator", "--store",
                str(tmp_path / "s.db")]
        with serving(argv) as url:
            assert call(f"{url}/sessions", "POST", {"task": "What is 17*23?", "session_id": "s1"})[0] == 201
            snap = wait_for(url, "s1", "WAITING_HUMAN")
            (pending,) = snap["pending_approvals"]
            assert pending["call"]["name"] == "calculator" and pending["call"]["id"] == "call_1"
            assert call(f"{url}/sessions/s1/approvals/call_1", "POST", {"decision": "approve"})[0] == 202
            snap = wait_for(url, "s1", "COMPLETED")
        assert len(server.requests) == 2
        tool_result = json.loads(server.requests[1].body)["messages"][-1]
        assert tool_result["role"] == "tool" and "391" in tool_result["content"]
