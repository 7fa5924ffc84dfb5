"""The sandbox package's public surface: sorted, documented, typed errors under fsm_agent.errors, and
the runner program that every sandboxed interpreter runs first (standard library only)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from fsm_agent import errors
from fsm_agent.sandbox import (
    CodeExecutionError,
    ExecutionResult,
    GuaranteeNotHeldError,
    Guarantees,
    RemoteSandboxError,
    Sandbox,
    SandboxError,
    SandboxInputError,
    SandboxUnavailableError,
)

MODULES = ["fsm_agent.sandbox", "fsm_agent.sandbox.base", "fsm_agent.sandbox.bubblewrap",
           "fsm_agent.sandbox.subprocess", "fsm_agent.sandbox.remote", "fsm_agent.sandbox.codeact"]


@pytest.mark.parametrize("name", MODULES)
def test_all_is_sorted_importable_and_documented(name: str) -> None:
    mod = importlib.import_module(name)
    assert mod.__doc__ and mod.__doc__.strip()
    assert mod.__all__ == sorted(mod.__all__) and len(set(mod.__all__)) == len(mod.__all__)
    for n in mod.__all__:
        obj = getattr(mod, n)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"{name}.{n} has no docstring"


def test_the_package_exports_every_public_name_it_imports() -> None:
    mod = importlib.import_module("fsm_agent.sandbox")
    public = {n for n in dir(mod) if not n.startswith("_") and not inspect.ismodule(getattr(mod, n))}
    assert public - set(mod.__all__) == set()


def test_errors_sit_in_the_fsm_agent_tree() -> None:
    assert issubclass(SandboxUnavailableError, errors.ConfigurationError)
    assert issubclass(GuaranteeNotHeldError, SandboxUnavailableError)
    assert issubclass(SandboxInputError, errors.UserError) and issubclass(SandboxInputError, ValueError)
    assert issubclass(SandboxError, errors.RunError) and issubclass(RemoteSandboxError, SandboxError)
    assert issubclass(CodeExecutionError, errors.ToolError)


def test_the_shipped_sandboxes_implement_the_protocol() -> None:
    from fsm_agent.sandbox import BubblewrapSandbox, HttpRemoteExecutor, RemoteSandbox, SubprocessSandbox

    assert isinstance(BubblewrapSandbox(), Sandbox) and isinstance(SubprocessSandbox(), Sandbox)
    assert isinstance(RemoteSandbox(HttpRemoteExecutor("http://127.0.0.1:1")), Sandbox)


def test_guarantees_round_trip_through_json() -> None:
    g = Guarantees("x", network_isolated=True, reasons={"disk_quota": "no"}, mechanisms={"network_isolated": "ns"},
                   details={"uid": 5, "self_test": {"big": 1}})
    doc = g.to_json()
    assert "self_test" not in doc["details"]
    assert Guarantees.from_json(doc) == Guarantees("x", network_isolated=True, reasons={"disk_quota": "no"},
                                                   mechanisms={"network_isolated": "ns"}, details={"uid": 5})
    assert g.summary().startswith("x: holds network_isolated; does not hold: filesystem_readonly")


def test_for_model_leaves_out_empty_fields_and_keeps_the_end_of_long_text() -> None:
    r = ExecutionResult("s", "x" * 100 + "END", "", 0, return_value=None, return_repr="{1}")
    doc = r.for_model(max_chars=10)
    assert doc == {"ok": True, "stdout": "[93 characters cut]…xxxxxxxEND", "return_repr": "{1}"}


def test_the_runner_uses_the_standard_library_only() -> None:
    """It runs under the sandbox's own python3 -I, where fsm_agent and its dependencies do not exist."""
    import sys

    source = (Path(__file__).parents[2] / "fsm_agent" / "sandbox" / "_runner.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    assert names - {"__future__"} <= set(sys.stdlib_module_names), names
