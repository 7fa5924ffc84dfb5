"""The curated public surface: __all__ sorted and complete, every public name documented."""

from __future__ import annotations

import importlib
import inspect

import pytest

import fsm_agent

MODULES = [
    "fsm_agent", "fsm_agent.types", "fsm_agent.providers", "fsm_agent.machine", "fsm_agent.tools",
    "fsm_agent.errors", "fsm_agent.middleware", "fsm_agent.hooks", "fsm_agent.chain", "fsm_agent.testing",
    "fsm_agent.prompt", "fsm_agent.loops",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_is_sorted_unique_and_importable(name: str) -> None:
    mod = importlib.import_module(name)
    assert mod.__all__ == sorted(mod.__all__), f"{name}.__all__ is not sorted"
    assert len(set(mod.__all__)) == len(mod.__all__)
    for n in mod.__all__:
        assert hasattr(mod, n), f"{name}.{n} is in __all__ but missing"


PACKAGES = ["fsm_agent", "fsm_agent.types", "fsm_agent.providers", "fsm_agent.machine", "fsm_agent.tools",
            "fsm_agent.store", "fsm_agent.testing"]


@pytest.mark.parametrize("name", PACKAGES)
def test_packages_export_every_public_name_they_import(name: str) -> None:
    mod = importlib.import_module(name)
    exported = set(mod.__all__)
    public = {n for n in dir(mod) if not n.startswith("_") and not inspect.ismodule(getattr(mod, n))}
    assert public - exported == set(), f"{name}: importable but not in __all__"
    assert fsm_agent.__version__


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_is_documented(name: str) -> None:
    mod = importlib.import_module(name)
    assert mod.__doc__ and mod.__doc__.strip()
    for n in mod.__all__:
        obj = getattr(mod, n)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"{name}.{n} has no docstring"
