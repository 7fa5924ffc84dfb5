"""The built-in plugins in ``middleware/`` import only fsm_agent's public API.

They are written as any third-party plugin would be: from the public surfaces below (and only
names in each one's ``__all__``), the standard library, and the distribution's declared
third-party dependencies. A plugin that reaches into a private module (``fsm_agent.types.tokens``,
``fsm_agent.machine.driver`` ...) breaks as soon as the core moves a line; this test fails first.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[2] / "middleware"

PUBLIC = ("fsm_agent", "fsm_agent.errors", "fsm_agent.loops", "fsm_agent.providers", "fsm_agent.store",
          "fsm_agent.tools", "fsm_agent.types")
"""The public surfaces a plugin may import from: the package and the subpackages (or modules) whose
``__all__`` is the curated, documented surface. ``fsm_agent.machine`` (the engine), ``chain``,
``hooks``, ``plugins`` and ``testing`` are not for plugins: what a plugin needs of them is
re-exported from ``fsm_agent``."""

THIRD_PARTY = frozenset({"attrs", "orjson", "regex"})
"""Declared dependencies (setup.cfg ``install_requires``) the plugins may use."""

MODULES = sorted(PLUGINS.rglob("*.py"))
"""Every module of the plugins, those of their subpackages (``compaction/``) too."""


def _imports(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """Every import anywhere in the module (function-local and TYPE_CHECKING ones included):
    (line, absolute module, names imported from it)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside the plugin package itself
                out.append((node.lineno, "." * node.level + (node.module or ""), [a.name for a in node.names]))
            else:
                out.append((node.lineno, node.module or "", [a.name for a in node.names]))
    return out


def test_there_are_plugins_to_check() -> None:
    assert len(MODULES) >= 9, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PLUGINS).as_posix())
def test_plugin_imports_only_the_public_api(path: Path) -> None:
    problems = []
    for line, module, names in _imports(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(PLUGINS).as_posix()}:{line}"
        top = module.split(".")[0]
        if module.startswith("."):
            continue  # a sibling plugin module: checked on its own
        if module == "__future__" or top in sys.stdlib_module_names or top in THIRD_PARTY:
            continue
        if top != "fsm_agent":
            problems.append(f"{where}: imports {module!r}, neither the standard library, a declared "
                            f"dependency ({', '.join(sorted(THIRD_PARTY))}) nor fsm_agent")
            continue
        if module not in PUBLIC:
            problems.append(f"{where}: imports the private module {module!r}; import from one of "
                            f"{', '.join(PUBLIC)} (export the name there if it is missing)")
            continue
        exported = set(importlib.import_module(module).__all__)
        for name in names:
            if name not in exported:
                problems.append(f"{where}: {name!r} is not in {module}.__all__")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_surface_declares_all(module: str) -> None:
    mod = importlib.import_module(module)
    assert isinstance(getattr(mod, "__all__", None), list) and mod.__all__, f"{module} has no __all__"
