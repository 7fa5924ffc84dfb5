"""``--local-model PATH.gguf`` / ``LocalLlamaServer(model_path=...)`` and the server's thread count.

The checks here need no llama.cpp: a bad model path is refused before any server could start
(``subprocess.Popen`` is made to fail the test if it is reached), and the thread count is read
from the command line :class:`LocalLlamaServer` builds. The end-to-end run of ``--local-model`` on
a real GGUF file is in ``test_local_model_llama.py``.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from fsm_agent import ConfigurationError
from fsm_agent.cli import main
from fsm_agent.local import LocalLlamaServer, check_gguf, default_threads, server_threads


@pytest.fixture
def no_process(monkeypatch) -> None:
    """Starting any process (the llama.cpp server included) fails the test."""
    def refuse(*a: object, **kw: object) -> None:
        raise AssertionError(f"a process was started: {a!r}")

    monkeypatch.setattr("fsm_agent.local.subprocess.Popen", refuse)
    monkeypatch.delenv("FSM_AGENT_PROVIDER", raising=False)
    monkeypatch.delenv("FSM_AGENT_BASE_URL", raising=False)


@pytest.fixture
def fake_binary(monkeypatch, tmp_path) -> Path:
    """A stand-in ``llama-server`` so that LocalLlamaServer can be built without llama.cpp."""
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FSM_AGENT_LLAMA_SERVER", str(binary))
    return binary


@pytest.fixture
def gguf(tmp_path) -> Path:
    """A file that passes the GGUF check (magic + version); llama.cpp itself never sees it here."""
    path = tmp_path / "Tiny-Model Q4.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\0" * 64)
    return path


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


# -- the model path, checked before anything starts -----------------------------------------
@pytest.mark.parametrize("command", [["run", "hi"], ["run", "hi", "--tool", "calculator", "--json"]])
def test_a_missing_model_file_is_exit_2_before_any_server(no_process, tmp_path, command) -> None:
    missing = tmp_path / "models" / "qwen2.5-0.5b-instruct-q4_k_m.gguf"
    code, out, err = run_cli(*command, "--local-model", str(missing))
    assert code == 2
    assert err == f"fsm-agent: --local-model is {missing}, which is not a file (it does not exist)\n"
    assert out == "" and "starting local llama.cpp server" not in err


@pytest.mark.parametrize("content, why", [
    (b"", "an empty file"),
    (b"PK\x03\x04 a zip, perhaps safetensors", "its first bytes are b'PK\\x03\\x04', not b'GGUF'"),
    (b"ggufGGUF", "its first bytes are b'gguf', not b'GGUF'"),   # the magic is case-sensitive
    (b"GGU", "its first bytes are b'GGU', not b'GGUF'"),          # cut short
])
def test_a_file_that_is_not_gguf_is_exit_2_before_any_server(no_process, tmp_path, content, why) -> None:
    bad = tmp_path / "model.gguf"   # the name says gguf; the bytes decide
    bad.write_bytes(content)
    code, out, err = run_cli("run", "What is 2 + 2?", "--local-model", str(bad))
    assert code == 2
    assert err.startswith(f"fsm-agent: --local-model is {bad}, which is not a GGUF model file ({why})"), err
    assert "Traceback" not in err and out == ""


def test_a_directory_or_an_unreadable_file_is_exit_2(no_process, tmp_path) -> None:
    code, _, err = run_cli("run", "hi", "--local-model", str(tmp_path))
    assert code == 2 and f"--local-model is {tmp_path}, which is not a file" in err
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.gguf"
        locked.write_bytes(b"GGUF")
        locked.chmod(0)
        code, _, err = run_cli("run", "hi", "--local-model", str(locked))
        assert code == 2 and "cannot be read" in err


def test_the_environment_variable_is_checked_the_same_way(no_process, fake_binary, tmp_path, monkeypatch) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a model")
    monkeypatch.setenv("FSM_AGENT_LOCAL_MODEL", str(bad))
    code, _, err = run_cli("run", "hi")
    assert code == 2
    assert f"fsm-agent: $FSM_AGENT_LOCAL_MODEL is {bad}, which is not a GGUF model file" in err
    assert "starting local llama.cpp server" not in err


def test_local_model_does_not_combine_with_another_provider(no_process, gguf) -> None:
    for extra in (["--provider", "openai"], ["--base-url", "http://127.0.0.1:9/v1"]):
        code, _, err = run_cli("run", "hi", "--local-model", str(gguf), *extra)
        assert code == 2 and "--local-model runs a GGUF file on the embedded llama.cpp server" in err, err


def test_python_api_checks_the_model_before_the_binary_is_started(no_process, fake_binary, tmp_path, gguf) -> None:
    with pytest.raises(ConfigurationError, match=r"which is not a GGUF model file \(an empty file\)"):
        empty = tmp_path / "empty.gguf"
        empty.touch()
        LocalLlamaServer(model_path=empty)
    with pytest.raises(ConfigurationError, match="which is not a file"):
        LocalLlamaServer(model_path=str(tmp_path / "absent.gguf"))
    server = LocalLlamaServer(model_path=gguf)   # a PathLike is fine; nothing starts until start()
    assert server.model_path == str(gguf.resolve())
    assert server.command[server.command.index("-m") + 1] == str(gguf.resolve())


def test_check_gguf_expands_the_home_directory(monkeypatch, tmp_path, gguf) -> None:
    monkeypatch.setenv("HOME", str(gguf.parent))
    assert check_gguf("~/" + gguf.name) == str(gguf.resolve())


# -- threads --------------------------------------------------------------------------------
def test_default_threads_is_the_usable_cpus_minus_one(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert default_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_threads() == 1        # never 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert default_threads() == 7


def test_threads_reach_the_server_command_line(fake_binary, gguf, monkeypatch) -> None:
    monkeypatch.delenv("LLAMA_ARG_THREADS", raising=False)

    def threads_of(server: LocalLlamaServer) -> list[str]:
        cmd = server.command
        assert cmd[0] == str(fake_binary)
        return [cmd[i + 1] for i, a in enumerate(cmd) if a in ("-t", "--threads")]

    assert threads_of(LocalLlamaServer(gguf)) == [str(default_threads())]
    assert threads_of(LocalLlamaServer(gguf, threads=3)) == ["3"]
    # $LLAMA_ARG_THREADS wins over the default ...
    monkeypatch.setenv("LLAMA_ARG_THREADS", "2")
    assert threads_of(LocalLlamaServer(gguf)) == ["2"]
    monkeypatch.setenv("LLAMA_ARG_THREADS", " 5 ")
    assert server_threads() == 5
    # ... an explicit argument wins over both, and extra_args' own -t replaces ours
    assert threads_of(LocalLlamaServer(gguf, threads=1)) == ["1"]
    assert threads_of(LocalLlamaServer(gguf, extra_args=("-t", "4"))) == ["4"]
    monkeypatch.setenv("LLAMA_ARG_THREADS", "two")
    with pytest.raises(ConfigurationError, match=r"\$LLAMA_ARG_THREADS is 'two', which is not a whole number"):
        LocalLlamaServer(gguf)


def test_a_bad_llama_arg_threads_is_exit_2_in_the_cli(no_process, fake_binary, gguf, monkeypatch) -> None:
    monkeypatch.setenv("LLAMA_ARG_THREADS", "many")
    code, _, err = run_cli("run", "hi", "--local-model", str(gguf))
    assert code == 2 and "$LLAMA_ARG_THREADS is 'many'" in err



@pytest.mark.parametrize("value", ["0", "-1", "-2"])
def test_llama_arg_threads_must_be_positive(fake_binary, gguf, monkeypatch, value) -> None:
    monkeypatch.setenv("LLAMA_ARG_THREADS", value)   # llama.cpp would read it as "every core"
    with pytest.raises(ConfigurationError, match=rf"\$LLAMA_ARG_THREADS is '{value}'; give at least 1 thread"):
        LocalLlamaServer(gguf)


@pytest.mark.parametrize("threads", [0, -2, "2", 2.0, True])
def test_the_threads_argument_must_be_a_positive_int(fake_binary, gguf, monkeypatch, threads) -> None:
    monkeypatch.delenv("LLAMA_ARG_THREADS", raising=False)
    with pytest.raises(ConfigurationError, match=r"threads is "):
        LocalLlamaServer(gguf, threads=threads)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_non_positive_llama_arg_threads_is_exit_2_in_the_cli(no_process, fake_binary, gguf, monkeypatch,
                                                               value) -> None:
    monkeypatch.setenv("LLAMA_ARG_THREADS", value)
    code, out, err = run_cli("run", "hi", "--local-model", str(gguf))
    assert (code, out) == (2, "")
    assert f"$LLAMA_ARG_THREADS is '{value}'; give at least 1 thread" in err
    assert "starting local llama.cpp server" not in err
