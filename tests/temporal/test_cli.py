"""The command line on Temporal: a worker process serves the agent; `run`, `resume`, `control` and
`sessions show` reach the session's workflow and print the same lines as a local run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENT = "tests.temporal.cli_agent:agent"


def cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsm_agent.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def test_worker_run_resume_and_show_through_the_cli(temporal_target, tmp_path) -> None:
    queue = "cli-" + uuid.uuid4().hex[:6]
    env = {**os.environ, "FSM_TEST_STORE": str(tmp_path / "s.db"), "PYTHONPATH": str(ROOT)}
    env.pop("FSM_AGENT_TEMPORAL", None)
    flags = ["--temporal", temporal_target, "--task-queue", queue, "--agent", AGENT]
    worker = subprocess.Popen([sys.executable, "-m", "fsm_agent.cli", "worker", *flags], stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT)
    try:
        assert worker.stderr is not None
        line = worker.stderr.readline()
        assert f"worker serving {AGENT}" in line, line
        started = cli("run", *flags, "--session-id", "inv17", "Pay invoice 17", env=env)
        assert started.returncode == 3, started.stderr  # WAITING_HUMAN
        assert "session inv17" in started.stderr and "WAITING_HUMAN" in started.stderr
        assert "call_pay" in started.stderr
        shown = cli("sessions", "show", "inv17", "--store", env["FSM_TEST_STORE"], *flags[:4], env=env)
        assert shown.returncode == 0, shown.stderr
        assert "WAITING_HUMAN" in shown.stdout and "workflow: RUNNING" in shown.stdout
        done = cli("resume", "inv17", "--approve", "call_pay", *flags, env=env)
        assert done.returncode == 0, done.stderr
        assert "Invoice 17 is paid." in done.stdout and "COMPLETED" in done.stderr
    finally:
        worker.terminate()
        try:
            assert worker.wait(20) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
            if worker.stderr is not None:
                worker.stderr.close()
