"""Plugins: an example plugin package is installed, discovered through its entry point, and enforced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_agent import Agent, ChainError, Middleware, Ordering, ScriptedProvider
from fsm_agent.chain import MiddlewareChain
from fsm_agent.errors import ConfigurationError
from fsm_agent.plugins import discover, load_plugin

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fsm-agent-example-plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example plugin installed (for real, with pip) into a private directory."""
    target = tmp_path_factory.mktemp("plugins")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(EXAMPLE)], check=True, capture_output=True, text=True)
    return target


def run_py(code: str, target: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(target), **env})


def test_installed_plugin_is_listed(installed) -> None:
    out = subprocess.run([sys.executable, "-m", "fsm_agent.cli", "middleware", "list"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(installed)}).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("block_tools "))
    assert "fsm_agent_example_plugin:BlockTools" in line and "[fsm-agent-example-plugin]" in line
    assert "order=outermost" in line


def test_installed_plugin_is_enforced(installed) -> None:
    code = """
import asyncio
from fsm_agent import Agent, ScriptedProvider
from fsm_agent.plugins import load_plugin
from fsm_agent.providers import tool_call_response
from fsm_agent.tools.demo import calculator
BlockTools = load_plugin("block_tools")
agent = Agent(ScriptedProvider([tool_call_response(("calculator", {"expression": "2+2"})), "ok"]),
              tools=[calculator], middleware=[BlockTools()])
r = asyncio.run(agent.run("2+2?"))
tool = [m for m in r.messages if m.role == "tool"][0]
print(tool.is_error, r.tool_calls, tool.text)
"""
    res = run_py(code, installed, BLOCKED_TOOLS="calculator")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ("True 0 Tool call denied by policy (block_tools): the tool 'calculator' is blocked "
                                  "by the operator's policy")


def test_builtin_plugins_are_registered() -> None:
    names = {p.name for p in discover()}
    assert {"approval", "budget", "loop_detection", "redaction", "repair", "retry", "tool_activation", "tool_policy",
            "verifier"} <= names
    assert load_plugin("repair").__name__ == "MessageRepair"
    with pytest.raises(ConfigurationError, match="unknown middleware plugin 'nope'"):
        load_plugin("nope")


class A(Middleware):
    pass


class B(Middleware):
    ordering = Ordering(requires=("Missing",))


class C(Middleware):
    ordering = Ordering(wraps=("D",))


class D(Middleware):
    ordering = Ordering(wraps=("C",))


class SyncWrap(Middleware):
    def wrap_model_call(self, request, call_next, ctx):  # type: ignore[override]
        return call_next(request)


def test_chain_errors_are_found_at_construction() -> None:
    with pytest.raises(ChainError, match="requires 'Missing'"):
        MiddlewareChain([A(), B()])
    with pytest.raises(ChainError, match="cycle"):
        MiddlewareChain([C(), D()])
    with pytest.raises(ChainError, match="'SyncWrap': wrap_model_call must be 'async def'"):
        MiddlewareChain([SyncWrap()])
    with pytest.raises(ChainError, match="two middleware are named 'A'"):
        MiddlewareChain([A(), A()])


async def test_chain_is_frozen_after_the_first_run() -> None:
    agent = Agent(ScriptedProvider(["hi", "again"]), middleware=[A()])
    agent.add_middleware(C())  # fine before the first run
    await agent.run("x")
    with pytest.raises(ChainError, match="frozen"):
        agent.add_middleware(D())
