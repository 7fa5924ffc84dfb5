"""Ctrl-C (SIGINT) and SIGTERM during `fsm-agent run` drain the run: it ends INTERRUPTED with the
streamed text kept, prints the stop line and the resume hint, exits 5, and can be resumed at once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest

from fsm_agent.testing import RecordedResponse, ReplayServer
from test_cli import ANSWER, chunk
from test_cli_sessions import cli

SLOW = b"".join(chunk({"content": "word "}) for _ in range(400)) + chunk({}, "stop") + b"data: [DONE]\n\n"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_drains_the_run_and_it_resumes_at_once(sig: signal.Signals) -> None:
    server = ReplayServer([RecordedResponse(200, SLOW, "text/event-stream", chunk_delay=0.02),
                           RecordedResponse(200, ANSWER, "text/event-stream")], chunk_sizes=[64])
    base = await server.start()
    sid = f"sess-{sig.name}"
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fsm_agent.cli", "run", "talk", "--base-url", base, "--model", "m",
            "--api-key", "k", "--session-id", sid, "--no-default-middleware",
            env=dict(os.environ), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        for _ in range(300):  # wait until the model call is streaming
            if server.requests:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        proc.send_signal(sig)
        out_b, err_b = await asyncio.wait_for(proc.communicate(), 60)
        out, err = out_b.decode(), err_b.decode()
        assert proc.returncode == 5, err
        assert f"stop: INTERRUPTED — received {sig.name} (during Model; the " in err
        assert "characters that had streamed are kept in the transcript" in err
        assert f"session: {sid} (continue with: fsm-agent resume {sid})" in err
        assert "Traceback" not in err
        assert 0 < out.count("word") < 400 and out.endswith("\n")
        code, show, _ = await cli("sessions", "show", sid, "--json")
        assert json.loads(show)["session"]["lease_owner"] is None
        code, out, err = await cli("resume", sid)  # at once: the lease was released
        assert code == 0, err
        assert "being driven by worker" not in err and "stop: COMPLETED" in err
    finally:
        await server.close()
