"""`fsm-agent serve` as a user starts it: a real process on a free port, an approval round trip over
HTTP, a clean stop on SIGTERM; it refuses a non-loopback address without tokens."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import json
import urllib.error
import urllib.request
import pytest

ROOT = Path(__file__).resolve().parents[2]


def call(url: str, method: str = "GET", body: object = None, headers: dict[str, str] | None = None
         ) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "fsm_agent.cli", "serve", "--agent", "tests.server.serve_agent:make",
           "--port", "0", "--store", str(tmp_path / "s.db"), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "FSM_TEST_SENT": str(tmp_path / "sent.txt"), **(env or {})})
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        m = re.search(r"serving on (http://\S+) ", line)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    rest = proc.stderr.read()
    proc.stderr.close()
    raise AssertionError(f"serve did not start: {line}{rest}")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(15) == 0
    finally:
        if proc.stderr is not None:
            proc.stderr.close()


def test_serve_runs_an_approval_round_trip_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc, url = start(tmp_path)
    try:
        assert call(url + "/healthz") == (200, b'{"status":"ok"}')
        assert json.loads(call(url + "/openapi.json")[1])["openapi"].startswith("3.1")
        assert call(url + "/sessions", "POST", {"task": "mail a", "session_id": "s1"})[0] == 201
        snap = wait_snapshot(url, "s1", lambda s: s["state"] == "WAITING_HUMAN" and not s["running"])
        assert snap["pending_approvals"][0]["call"]["id"] == "c0"
        assert call(url + "/sessions/s1/approvals/c0", "POST", {"decision": "approve"})[0] == 202
        status, body = call(url + f"/sessions/s1/events?after={snap['last_seq']}")  # closes after the stop
        assert status == 200 and b"event: run_stopped" in body and b'"reason":"COMPLETED"' in body
        assert (tmp_path / "sent.txt").read_text() == "a@x\n"
    finally:
        stop(proc)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1"])
def test_serve_refuses_a_non_loopback_address_without_tokens(tmp_path: Path, host: str) -> None:
    r = subprocess.run([sys.executable, "-m", "fsm_agent.cli", "serve", "--agent", "tests.server.serve_agent:make",
                        "--host", host, "--store", str(tmp_path / "s.db")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("FSM_AGENT_TOK")})
    assert r.returncode == 2 and f"refusing to listen on {host} without tokens" in r.stderr


def test_serve_with_tokens_needs_a_bearer_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# tenant:token\nacme:tok-acme-0123456789abcdef\n")
    proc, url = start(tmp_path, "--tokens", str(tokens))
    try:
        assert call(url + "/sessions")[0] == 401
        assert call(url + "/sessions", headers={"Authorization": "Bearer tok-acme-0123456789abcdef"}) == \
            (200, b'{"sessions":[]}')
    finally:
        stop(proc)


def wait_snapshot(url: str, sid: str, check, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    snap: dict = {}
    while time.monotonic() < deadline:
        status, body = call(url + f"/sessions/{sid}")
        if status == 200:
            snap = json.loads(body)
            if check(snap):
                return snap
        time.sleep(0.05)
    raise AssertionError(f"{sid}: condition not reached; last snapshot {snap}")


def test_a_server_killed_mid_tool_does_not_run_the_approved_side_effect_again(tmp_path: Path) -> None:
    """SIGKILL of `serve` while an approved side-effect tool runs; the restarted server recovers the
    session once the lease expires. The old approval is not replayed onto the new question ("the
    outcome is unknown: run it again?"): the tool ran once, a person is asked, and answers it."""
    env = {"FSM_TEST_TOOL_SLEEP": "30", "FSM_TEST_LEASE_TTL": "1.5"}
    sent = tmp_path / "sent.txt"
    proc, url = start(tmp_path, env=env)
    try:
        assert call(url + "/sessions", "POST", {"task": "mail a", "session_id": "k"})[0] == 201
        wait_snapshot(url, "k", lambda s: s["state"] == "WAITING_HUMAN" and not s["running"])
        assert call(url + "/sessions/k/approvals/c0", "POST", {"decision": "approve"})[0] == 202
        deadline = time.monotonic() + 60
        while not (sent.exists() and sent.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sent.read_text() == "a@x\n"  # the tool is running now
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    proc, url = start(tmp_path, env={"FSM_TEST_TOOL_SLEEP": "0", "FSM_TEST_LEASE_TTL": "1.5"})
    try:
        snap = wait_snapshot(url, "k", lambda s: s["state"] == "WAITING_HUMAN" and not s["running"]
                             and s["pending_approvals"] and s["pending_approvals"][0]["reason"] == "unknown_outcome")
        assert snap["pending_approvals"][0]["allowed_decisions"] == ["approve", "reject", "respond"]
        assert sent.read_text() == "a@x\n"  # not run again on recovery
        # the old approval, sent again, is a decision on the new question: the person must choose
        # deliberately; here a person answers that the mail went out
        status, body = call(url + "/sessions/k/approvals/c0", "POST", {"decision": "respond", "message": "it was sent"})
        assert status == 202, body
        assert json.loads(body)["round"] == 1
        done = wait_snapshot(url, "k", lambda s: s["state"] == "COMPLETED" and not s["running"])
        assert done["stop"]["reason"] == "COMPLETED"
        assert sent.read_text() == "a@x\n"  # exactly one execution in all
    finally:
        stop(proc)


def test_a_server_stopped_with_sigterm_resumes_its_interrupted_runs_when_it_starts_again(tmp_path: Path) -> None:
    sent = tmp_path / "sent.txt"
    proc, url = start(tmp_path, env={"FSM_TEST_TOOL_SLEEP": "30"})
    try:
        assert call(url + "/sessions", "POST", {"task": "mail a", "session_id": "t"})[0] == 201
        wait_snapshot(url, "t", lambda s: s["state"] == "WAITING_HUMAN" and not s["running"])
        assert call(url + "/sessions/t/approvals/c0", "POST", {"decision": "approve"})[0] == 202
        deadline = time.monotonic() + 60
        while not (sent.exists() and sent.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop(proc)  # SIGTERM mid-tool: exit 0
    proc, url = start(tmp_path, env={"FSM_TEST_TOOL_SLEEP": "0"})
    try:
        done = wait_snapshot(url, "t", lambda s: s["state"] == "COMPLETED" and not s["running"])
        assert done["stop"]["reason"] == "COMPLETED"
        status, body = call(url + "/sessions/t/events")
        assert b"server stopping" in body and b'"resume"' in body
        assert sent.read_text() == "a@x\n"  # the interrupted call's outcome is unknown: never run again silently
    finally:
        stop(proc)


def test_serve_with_a2a_serves_the_card_and_the_json_rpc_endpoint(tmp_path: Path) -> None:
    proc, url = start(tmp_path, "--a2a", "mailer", "--a2a-description", "Sends mail after approval.")
    try:
        status, body = call(url + "/.well-known/agent-card.json")
        card = json.loads(body)
        assert status == 200 and card["name"] == "mailer" and card["description"] == "Sends mail after approval."
        assert card["supportedInterfaces"][0]["url"] == url + "/a2a"
        status, body = call(url + "/a2a", "POST", {
            "jsonrpc": "2.0", "id": 7, "method": "SendMessage",
            "params": {"message": {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "mail a"}]},
                       "configuration": {"returnImmediately": True}}}, headers={"A2A-Version": "1.0"})
        reply = json.loads(body)
        assert status == 200 and reply["id"] == 7, reply
        task_id = reply["result"]["task"]["id"]
        # the task is an ordinary session: the REST routes see it wait for the same approval
        snap = wait_snapshot(url, task_id, lambda s: s["state"] == "WAITING_HUMAN" and not s["running"])
        assert snap["pending_approvals"][0]["call"]["name"] == "send_mail"
        status, body = call(url + "/a2a", "POST", {"jsonrpc": "2.0", "id": 8, "method": "GetTask",
                                                   "params": {"id": task_id}}, headers={"A2A-Version": "1.0"})
        assert json.loads(body)["result"]["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
    finally:
        stop(proc)
