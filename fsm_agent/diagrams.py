"""Mermaid state diagrams rendered from the transition table (never hand-drawn).

* :func:`render_machine` — the machine itself (``diagrams/agent_loop.mmd``);
* ``chains=`` — each phase's middleware chain of a configured agent, as notes;
* ``trace=`` — the path one run took (from its transition events): a flowchart of the same table
  whose taken edges are drawn heavier and coloured, labelled with their steps in order (the review
  page draws the same);
* :func:`render_plan` — a run's PlanAct plan as a Mermaid flowchart (nodes by status, dependency
  edges); :func:`latest_plan` reads it from a session's events (the last ``plan_updated``, which
  holds what the latest checkpoint carries). The CLI (``sessions show``, ``diagram --plan``) and the
  server (``GET /sessions/{sid}/diagram?view=plan``, and ``plan`` in ``?format=json``) all use these.

Output is deterministic (table order), so ``fsm-agent diagram --check`` and the
test can compare it byte for byte with the committed file.

The committed file is ``diagrams/agent_loop.mmd`` of the repository, found from where this
package lives (:func:`repository_root`), never from the current directory: ``fsm-agent
diagram`` run anywhere in (or outside) a checkout writes and checks the same file. An
installed copy has no repository; there, pass a path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .machine.phases import PHASES, TRANSITIONS, Phase
from .types.codec import structure
from .types.plan import NodeStatus, Plan, one_line
from .types.run import StopReason

__all__ = ["DEFAULT_PATH", "OTHER_EDGE_STYLE", "PATH_STYLE", "chains_of", "check_diagram", "default_diagram_path",
           "latest_plan", "render_machine", "render_plan", "repository_root", "stop_class", "trace_of", "write_diagram"]

DEFAULT_PATH = Path("diagrams") / "agent_loop.mmd"
"""Where the machine's diagram lives, relative to the repository root (:func:`repository_root`)."""


def repository_root() -> Path | None:
    """The fsm_agent checkout this package was imported from, or ``None`` for an installed copy.

    It is the directory holding the ``fsm_agent`` package when that directory also holds
    ``diagrams/`` and ``pyproject.toml`` or ``setup.cfg`` (a source checkout, or an editable
    install of one); ``site-packages`` holds neither.
    """
    root = Path(__file__).resolve().parent.parent
    if (root / "diagrams").is_dir() and ((root / "pyproject.toml").is_file() or (root / "setup.cfg").is_file()):
        return root
    return None


def default_diagram_path() -> Path:
    """The absolute path of the repository's ``diagrams/agent_loop.mmd``.

    Raises:
        ConfigurationError: fsm_agent runs from an installed copy, not a checkout, so there is
            no repository file; the message says to give a path.
    """
    from .errors import ConfigurationError

    root = repository_root()
    if root is None:
        raise ConfigurationError(
            f"fsm_agent is installed at {Path(__file__).resolve().parent}, not run from a checkout, so there is no "
            f"repository {DEFAULT_PATH} to write or check; give --output PATH (e.g. --output {DEFAULT_PATH}) "
            "or use --stdout")
    return root / DEFAULT_PATH

_PHASE_HOOKS = {
    Phase.PRE_TURN: ("pre_turn",),
    Phase.MODEL: ("wrap_model_call", "on_model_event"),
    Phase.MID_TURN: ("on_tool_call", "wrap_tool_call"),
    Phase.POST_TURN: ("post_turn",),
}


_CLASS_STYLES = {
    "done": "fill:#dcfce7,stroke:#15803d",
    "resumable": "fill:#fef3c7,stroke:#b45309,stroke-dasharray:5 3",
    "terminal": "fill:#fde2e2,stroke:#b91c1c",
}
"""How each kind of stop is drawn: ``done`` (COMPLETED), ``resumable`` (a stop a resume continues:
WAITING_HUMAN, PAUSED_BUDGET, INTERRUPTED, FAILED_RETRYABLE; amber, a dashed border) and ``terminal``
(ended for good without completing: FAILED_TERMINAL, CANCELLED; red)."""

PATH_STYLE = "stroke:#1d4ed8,stroke-width:4px,color:#1d4ed8"
"""The style of an edge a run took (a ``linkStyle``): heavier and coloured."""

OTHER_EDGE_STYLE = "stroke:#9ca3af,stroke-width:1px,color:#6b7280"
"""The style of the edges a run did not take, so that the path stands out."""


def stop_class(reason: StopReason) -> str:
    """``"done"``, ``"resumable"`` or ``"terminal"``: how a stop is drawn (:data:`_CLASS_STYLES`)."""
    if reason is StopReason.COMPLETED:
        return "done"
    return "resumable" if reason.resumable else "terminal"


def _stop_classes() -> list[str]:
    lines = []
    for cls, style in _CLASS_STYLES.items():
        members = [s.value for s in StopReason if stop_class(s) == cls]
        lines.append(f"    classDef {cls} {style}")
        lines.append(f"    class {','.join(members)} {cls}")
    return lines


def _known(state: str | None) -> bool:
    return state is not None and state in {p.value for p in Phase} | {r.value for r in StopReason}


def render_machine(
    *,
    chains: Mapping[str, Sequence[str]] | None = None,
    trace: Iterable[tuple[str, str, str]] | None = None,
    title: str | None = None,
    active: str | None = None,
) -> str:
    """The Mermaid source of the machine: a ``stateDiagram-v2``, or with ``trace`` a ``flowchart``
    that draws the run's path (a state diagram cannot style its edges: Mermaid has no
    ``linkStyle`` for it).

    Stops are drawn by kind: ``done`` (COMPLETED), ``resumable`` (dashed amber: a resume continues
    them) and ``terminal`` (red: ended for good without completing).

    Args:
        chains: hook name -> middleware names in execution order (``MiddlewareChain.describe()``).
        trace: ``(from, trigger, to)`` moves of one run, in order (possibly none yet). Each edge
            taken is drawn heavier and coloured (:data:`PATH_STYLE`), labelled with the steps it
            was taken at (``call_model #2, #5``), the others grey; visited states are outlined; a
            resume edge is dotted.
        title: the diagram's title.
        active: the current state (a Phase or StopReason value), highlighted with the class
            ``s_active`` (the class ``transitions``' own Mermaid output uses).
    """
    if trace is not None:
        return _render_path(list(trace), chains=chains, title=title, active=active)
    lines = ["---", f"title: {title or 'fsm_agent loop'}", "---", "stateDiagram-v2", "    direction TB"]
    lines.append(f"    [*] --> {Phase.IDLE.value}")
    for tr in TRANSITIONS:
        lines.append(f"    {tr.source.value} --> {tr.dest.value}: {tr.trigger.value}")
    for s in StopReason:
        lines.append(f"    {s.value} --> [*]")
    lines += _chain_notes(chains)
    lines += _stop_classes()
    if _known(active):
        lines.append("    classDef s_active fill:#fde68a,stroke:#b45309,stroke-width:4px")
        lines.append(f"    class {active} s_active")
    return "\n".join(lines) + "\n"


def _chain_notes(chains: Mapping[str, Sequence[str]] | None) -> list[str]:
    lines: list[str] = []
    for phase, entries in _chain_entries(chains):
        lines.append(f"    note right of {phase.value}")
        lines.extend(f"        {e}" for e in entries)
        lines.append("    end note")
    return lines


def _chain_entries(chains: Mapping[str, Sequence[str]] | None) -> list[tuple[Phase, list[str]]]:
    out = []
    for phase in PHASES if chains else ():
        entries = []
        for hook in _PHASE_HOOKS[phase]:
            names = list((chains or {}).get(hook, ()))
            if names:
                entries.append(f"{hook}: {' > '.join(names)}")
        if entries:
            out.append((phase, entries))
    return out


def _render_path(trace: list[tuple[str, str, str]], *, chains: Mapping[str, Sequence[str]] | None,
                 title: str | None, active: str | None) -> str:
    """The ``flowchart`` of the machine with a run's path drawn (see :func:`render_machine`)."""
    taken: dict[tuple[str, str, str], list[int]] = {}
    visited: set[str] = set()
    for i, (a, t, b) in enumerate(trace, 1):
        taken.setdefault((a, t, b), []).append(i)
        visited.update((a, b))
    lines = ["---", f"title: {title or 'fsm_agent run'}", "---", "flowchart TB"]
    lines.append("    start@{ shape: sm-circ, label: \"start\" }")
    for p in Phase:
        lines.append(f"    {p.value}({p.value})")
    for r in StopReason:
        lines.append(f"    {r.value}([{r.value}])")
    path_edges: list[int] = []
    other_edges: list[int] = []
    lines.append(f"    start --> {Phase.IDLE.value}")
    (path_edges if trace else other_edges).append(0)
    for n, tr in enumerate(TRANSITIONS, 1):
        a, b, t = tr.source.value, tr.dest.value, tr.trigger.value
        steps = taken.get((a, t, b))
        label = f"{t} {', '.join(f'#{i}' for i in steps)}" if steps else t
        arrow = "-.->" if a in {r.value for r in StopReason} else "-->"
        lines.append(f'    {a} {arrow}|"{label}"| {b}')
        (path_edges if steps else other_edges).append(n)
    for k, (phase, entries) in enumerate(_chain_entries(chains), 1):
        text = "<br/>".join(_label(e, 200) for e in entries)
        lines.append(f'    chain{k}["{text}"] -.- {phase.value}')
    for cls, style in _CLASS_STYLES.items():
        lines.append(f"    classDef {cls} {style}")
        lines.append(f"    class {','.join(s.value for s in StopReason if stop_class(s) == cls)} {cls}")
    if visited:
        lines.append("    classDef visited stroke-width:3px,stroke:#1d4ed8")
        lines.append(f"    class {','.join(sorted(visited))} visited")
    if _known(active):
        lines.append("    classDef s_active fill:#fde68a,stroke:#b45309,stroke-width:4px")
        lines.append(f"    class {active} s_active")
    # each edge gets one style by its index (a `linkStyle default` would be applied after them)
    if other_edges:
        lines.append(f"    linkStyle {','.join(map(str, other_edges))} {OTHER_EDGE_STYLE}")
    if path_edges:
        lines.append(f"    linkStyle {','.join(map(str, path_edges))} {PATH_STYLE}")
    return "\n".join(lines) + "\n"


_PLAN_STYLES = {
    NodeStatus.PENDING: "fill:#ffffff,stroke:#6b7280",
    NodeStatus.RUNNING: "fill:#fde68a,stroke:#b45309,stroke-width:3px",
    NodeStatus.PASSED: "fill:#dcfce7,stroke:#15803d",
    NodeStatus.FAILED: "fill:#fde2e2,stroke:#b91c1c",
    NodeStatus.SKIPPED: "fill:#f3f4f6,stroke:#9ca3af,stroke-dasharray:4 3,color:#6b7280",
}


def _label(text: str, limit: int = 60) -> str:
    """Text safe inside a quoted Mermaid label: one printable line (no control or invisible format
    characters), cut to ``limit``, entity-escaped (``%`` too: Mermaid reads a ``%%{...}%%`` directive
    anywhere in the source, labels included)."""
    text = one_line(text, limit)
    return (text.replace("#", "#35;").replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")
            .replace("%", "#37;"))


def _comment(text: str) -> str:
    """Text safe in a ``%%`` comment: one printable line (no control or invisible format characters),
    no braces (``%%{`` opens a Mermaid directive)."""
    return one_line(text, 200).replace("{", "(").replace("}", ")").replace("%", " percent")


def render_plan(plan: Plan) -> str:
    """The Mermaid ``flowchart`` source of a plan (deterministic: dependency order).

    Each node is a box ``id · status``, its goal, and its attempts, with the class of its status
    (``pending``, ``running``, ``passed``, ``failed``, ``skipped``); each dependency is an edge from
    the node depended on (dotted when either end is skipped). The title gives the version, the
    replans and how many nodes passed; the goal and each replan are ``%%`` comments. Mermaid
    node names are ``n1``, ``n2`` ... so that no id a model wrote can break the syntax.
    """
    ordered = plan.order()
    names = {n.id: f"n{i}" for i, n in enumerate(ordered, 1)}
    passed = sum(n.status is NodeStatus.PASSED for n in plan.nodes)
    live = sum(n.status is not NodeStatus.SKIPPED for n in plan.nodes)
    replans = f"{plan.replans} replan" + ("" if plan.replans == 1 else "s")
    lines = ["---", f"title: plan v{plan.version}, {replans}, {passed} of {live} nodes passed", "---",
             "flowchart TD", f"    %% goal: {_comment(plan.goal)}"]
    for r in plan.history:
        lines.append(f"    %% replan to v{r.version} ({r.trigger.value}{' ' + _comment(r.node) if r.node else ''}): "
                     f"{_comment(r.reason)}")
    for n in ordered:
        tries = f"<br/>{n.attempts} attempt" + ("" if n.attempts == 1 else "s") if n.attempts else ""
        lines.append(f'    {names[n.id]}["{_label(n.id, 32)} · {n.status.value}<br/>{_label(n.goal)}{tries}"]')
    for n in ordered:
        for d in n.depends_on:
            if d in names:
                dotted = NodeStatus.SKIPPED in (n.status, plan.node(d).status)
                lines.append(f"    {names[d]} {'-.->' if dotted else '-->'} {names[n.id]}")
    for status, style in _PLAN_STYLES.items():
        members = [names[n.id] for n in ordered if n.status is status]
        if members:
            lines.append(f"    classDef {status.value} {style}")
            lines.append(f"    class {','.join(members)} {status.value}")
    return "\n".join(lines) + "\n"


def latest_plan(events: Iterable[Any]) -> Plan | None:
    """The plan of the last ``plan_updated`` event among ``events`` (``EventRecord`` objects, or
    dicts with ``type`` and ``payload`` as ``sessions show --events`` prints them), or ``None``
    when there is none (the session ran without PlanAct).

    The last ``plan_updated`` holds the plan that any later checkpoint carries: events and
    checkpoints are committed together, so the two never disagree.
    """
    found: Any = None
    for ev in events:
        kind = ev.get("type") if isinstance(ev, Mapping) else getattr(ev, "type", None)
        if kind == "plan_updated":
            payload = ev.get("payload") if isinstance(ev, Mapping) else getattr(ev, "payload", None)
            if isinstance(payload, Mapping) and "plan" in payload:
                found = payload["plan"]
    return structure(found, Plan) if found is not None else None


def write_diagram(path: Path | None = None) -> Path:
    """Write the machine's diagram to ``path`` (default: :func:`default_diagram_path`); returns the
    absolute path written.

    Raises:
        ConfigurationError: no ``path`` and no repository (see :func:`default_diagram_path`).
        OSError: the file cannot be written.
    """
    path = (path or default_diagram_path()).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_machine(), encoding="utf-8")
    return path


def check_diagram(path: Path | None = None) -> str | None:
    """``None`` when ``path`` (default: :func:`default_diagram_path`) holds exactly what the table
    renders, else a message saying what differs.

    Raises:
        ConfigurationError: no ``path`` and no repository (see :func:`default_diagram_path`).
    """
    path = path or default_diagram_path()
    expected = render_machine()
    try:
        actual = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return f"{path} does not exist; run `fsm-agent diagram` to write it"
    if actual == expected:
        return None
    import difflib

    diff = "".join(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), str(path), "rendered"))
    return f"{path} differs from the transition table; run `fsm-agent diagram` to regenerate:\n{diff}"


def chains_of(spec: str) -> dict[str, list[str]]:
    """The middleware chains of the Agent at ``module:attribute`` (an Agent, or a callable returning one).

    Raises:
        ConfigurationError: the module or attribute is missing, or it is not an Agent.
    """
    import importlib

    from .errors import ConfigurationError

    import sys

    if "" not in sys.path and "." not in sys.path:  # like `python -m`: modules in the working directory
        sys.path.insert(0, "")
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ConfigurationError(f"--agent {spec!r}: use MODULE:ATTRIBUTE, e.g. myapp.agents:support_agent")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"--agent {spec!r}: {exc}") from exc
    if callable(obj) and not hasattr(obj, "chain"):
        obj = obj()
    chain = getattr(obj, "chain", None)
    if chain is None or not hasattr(chain, "describe"):
        raise ConfigurationError(f"--agent {spec!r} is not an fsm_agent Agent")
    return dict(chain.describe())


def trace_of(path: Path) -> list[tuple[str, str, str]]:
    """``(from, trigger, to)`` moves from a JSON-lines event file: the session log
    (``fsm-agent sessions show ID --events``) or recorded observer TransitionEvents."""
    import orjson

    from .errors import ConfigurationError

    moves = []
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"cannot read the trace {path}: {exc.strerror or exc}") from exc
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            ev = orjson.loads(line)
            if not isinstance(ev, dict) or ev.get("type") != "transition":
                continue
            p = ev.get("payload", ev)
            moves.append((p.get("from") or p["from_state"], p["trigger"], p.get("to") or p["to_state"]))
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigurationError(f"{path}:{n}: not a transition event line ({exc}); produce the file with "
                                     "`fsm-agent sessions show ID --events`") from exc
    return moves
