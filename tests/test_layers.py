"""Imports point one way: down a declared list of layers, with no import circle.

Every module of ``fsm_agent`` belongs to one layer of :data:`LAYERS` (bottom first). Each import
(at module level, inside a function, or under ``TYPE_CHECKING``) may go to a module of the same
layer or of a lower one, never to a higher one. Importing ``pkg.mod`` also runs ``pkg/__init__``,
so a runtime import is checked against the packages it passes through too. Among the imports that
run, there is no circle: not at module level, and not through a function-local import either (a
local import used to break an import-time circle would only hide one; none is declared in
:data:`LOCAL_IMPORTS_BREAKING_CYCLES`). Nothing in ``fsm_agent`` imports the built-in plugins
(``fsm_agent_middleware``): they are found through their entry points.

The test reads the source with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsm_agent"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation: errors, value types, pricing, control requests",
     ("fsm_agent._version", "fsm_agent.errors", "fsm_agent.control", "fsm_agent.pricing", "fsm_agent.types.*",
      "fsm_agent.config", "fsm_agent.conditions", "fsm_agent.permissions", "fsm_agent.loops")),
    ("services the engine uses: providers, stores, tools, structured-output checks, the system prompt source",
     ("fsm_agent.providers.*", "fsm_agent.store.*", "fsm_agent.tools.*", "fsm_agent.structured",
      "fsm_agent.sandbox.*", "fsm_agent.prompt")),
    ("the run's data and the plugin's contract view of it",
     ("fsm_agent.machine.phases", "fsm_agent.machine.definition", "fsm_agent.machine.state", "fsm_agent.context")),
    ("the contracts: middleware, its chain, observers",
     ("fsm_agent.middleware", "fsm_agent.chain", "fsm_agent.hooks")),
    ("the engine's services: the effect port and its live form, timers, journal, turn records, ledger, "
     "accounting, the plugin view, the host the phases see",
     ("fsm_agent.machine.port", "fsm_agent.machine.live", "fsm_agent.machine.timing", "fsm_agent.machine.outcome",
      "fsm_agent.machine.journal", "fsm_agent.machine.turns", "fsm_agent.machine.ledger",
      "fsm_agent.machine.accounting", "fsm_agent.machine.view", "fsm_agent.machine.host")),
    ("the phases on their host",
     ("fsm_agent.machine.controls", "fsm_agent.machine.pre_turn", "fsm_agent.machine.model",
      "fsm_agent.machine.midturn", "fsm_agent.machine.post_turn", "fsm_agent.machine.gate",
      "fsm_agent.machine.loops")),
    ("the loop",
     ("fsm_agent.machine.driver", "fsm_agent.machine")),
    ("observability: OpenTelemetry spans and metrics of a run (its port decorator and observer)",
     ("fsm_agent.otel.*",)),
    ("assembly: plugin discovery, the Agent",
     ("fsm_agent.plugins", "fsm_agent.task", "fsm_agent.agent")),
    ("around the agent: test helpers, the local model server, diagrams, multi-agent patterns",
     ("fsm_agent.testing.*", "fsm_agent.local", "fsm_agent.diagrams", "fsm_agent.diagram_files", "fsm_agent.orchestration.*",
      "fsm_agent.temporal.*")),
    ("entry points: the command line and the package's public face",
     ("fsm_agent.cli.*", "fsm_agent.server.*", "fsm_agent")),
)
"""Bottom first. ``pkg.*`` is the package ``pkg`` and every module in it; other entries are one
module (a package's name alone is its ``__init__``). The machine package is split: its data
(run state, the table) sits below the middleware contract, beside the plugin's view
(:class:`fsm_agent.context.RunContext`, a protocol); its services, its phases and its loop sit
above the chain they run, each layer using only those below (no phase imports the driver)."""

LOCAL_IMPORTS_BREAKING_CYCLES: dict[tuple[str, str], str] = {}
"""(importer, imported) -> why a function-local import is used to break an import-time circle.
Empty: there is none, and a new one has to be declared here with its reason."""

FORBIDDEN = ("fsm_agent_middleware", "middleware")
"""The built-in plugins' package (and its folder's name): loaded by entry point, never imported."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


FILES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}


def layer_of(module: str) -> int:
    """The index of ``module``'s layer (the most specific entry wins)."""
    best: tuple[int, int] | None = None
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if entry.endswith(".*"):
                base = entry[:-2]
                hit = module == base or module.startswith(base + ".")
                weight = len(base)
            else:
                hit, weight = module == entry, len(entry) + 1
            if hit and (best is None or weight > best[0]):
                best = (weight, i)
    if best is None:
        raise LookupError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best[1]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if module not in PACKAGES:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def imports(module: str) -> Iterator[tuple[str, str, int]]:
    """(imported module, kind, line) for every import of ``module``; kind is ``module`` (runs at
    import time), ``local`` (inside a function: runs when called) or ``typing`` (never runs)."""
    tree = ast.parse(FILES[module].read_text(), str(FILES[module]))

    def targets(node: ast.stmt) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        assert isinstance(node, ast.ImportFrom)
        base = _resolve(module, node)
        # ``from pkg import mod`` imports the module pkg.mod
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in FILES else base for a in node.names]

    def visit(node: ast.AST, kind: str) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in targets(child):
                    yield t, kind, child.lineno
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module([stmt], []), "typing")
                for stmt in child.orelse:
                    yield from visit(ast.Module([stmt], []), kind)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from visit(child, "typing" if kind == "typing" else "local")
            else:
                yield from visit(child, kind)

    seen = set()
    for item in visit(tree, "module"):
        if item not in seen:
            seen.add(item)
            yield item


def _ancestors(module: str) -> list[str]:
    """Packages below ``fsm_agent`` whose ``__init__`` runs when ``module`` is imported."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _runtime_targets(src: str, target: str) -> list[str]:
    """What importing ``target`` from ``src`` runs: the module and the packages it passes through
    (those ``src`` itself lives in are already imported)."""
    mine = set(_ancestors(src)) | ({src} if src in PACKAGES else set())
    return [p for p in _ancestors(target) if p not in mine and p in PACKAGES] + [target]


EDGES = [(src, t, kind, line) for src in FILES for t, kind, line in imports(src)]
INTERNAL = [(s, t, k, n) for s, t, k, n in EDGES if t == "fsm_agent" or t.startswith("fsm_agent.")]


def test_every_module_has_a_layer() -> None:
    for module in FILES:
        layer_of(module)


def test_layer_entries_name_real_modules() -> None:
    for _, entries in LAYERS:
        for entry in entries:
            name = entry[:-2] if entry.endswith(".*") else entry
            assert name in FILES, f"LAYERS names {entry!r}, which is not a module of fsm_agent"


def test_imports_go_only_to_the_same_or_a_lower_layer() -> None:
    upward = []
    for src, target, kind, line in INTERNAL:
        runs = _runtime_targets(src, target) if kind != "typing" else [target]
        for t in runs:
            if t not in FILES:
                upward.append(f"{FILES[src].relative_to(ROOT)}:{line}: imports {t}, which is not a module")
            elif layer_of(t) > layer_of(src):
                via = "" if t == target else f" (its package, run when importing {target})"
                upward.append(f"{FILES[src].relative_to(ROOT)}:{line}: {src} [{LAYERS[layer_of(src)][0]}] imports "
                              f"{t}{via} [{LAYERS[layer_of(t)][0]}] ({kind} import)")
    assert not upward, "imports that run back up the layers:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def strong(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _graph(kinds: set[str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in FILES}
    for src, target, kind, _ in INTERNAL:
        if kind in kinds and (src, target) not in LOCAL_IMPORTS_BREAKING_CYCLES:
            graph[src].update(t for t in _runtime_targets(src, target) if t in FILES and t != src)
    return graph


def test_no_import_circle_at_module_level() -> None:
    assert _cycles(_graph({"module"})) == []


def test_no_import_circle_hidden_by_a_function_local_import() -> None:
    circles = _cycles(_graph({"module", "local"}))
    assert circles == [], ("function-local imports close these circles; remove the circle, or declare the "
                           f"local import in LOCAL_IMPORTS_BREAKING_CYCLES with its reason: {circles}")


def test_no_import_circle_even_through_annotations() -> None:
    """Not even an import made only for type annotations closes a circle: every module can be read
    bottom-up (``errors`` imports nothing of ours; no phase names the driver)."""
    assert _cycles(_graph({"module", "local", "typing"})) == []


def test_declared_cycle_breaks_are_local_imports() -> None:
    local = {(s, t) for s, t, k, _ in INTERNAL if k == "local"}
    for edge in LOCAL_IMPORTS_BREAKING_CYCLES:
        assert edge in local, f"{edge} is declared as a cycle-breaking local import but is not one"


def test_nothing_in_fsm_agent_imports_the_builtin_plugins() -> None:
    bad = [f"{FILES[s].relative_to(ROOT)}:{n}: imports {t}" for s, t, _, n in EDGES
           if t.split(".")[0] in FORBIDDEN]
    assert not bad, "\n".join(bad)


def test_errors_import_nothing_of_fsm_agent() -> None:
    assert [t for s, t, _, _ in INTERNAL if s == "fsm_agent.errors"] == []


@pytest.mark.parametrize("module", ["fsm_agent.machine.driver", "fsm_agent.middleware", "fsm_agent.chain"])
def test_the_walker_sees_every_kind_of_import(module: str) -> None:
    kinds = {k for s, _, k, _ in INTERNAL if s == module}
    assert "module" in kinds
    if module != "fsm_agent.machine.driver":
        assert "typing" in kinds  # RunContext, named for annotations only
