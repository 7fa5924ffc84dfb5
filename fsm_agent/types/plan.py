"""A typed plan (issue 12, PlanAct): nodes with goals, dependencies and acceptance checks.

A :class:`Plan` is a frozen value. It lives in the run state (``RunState.plan``), so every
checkpoint carries it, and a plugin replaces it whole through ``ctx.update_plan(plan, reason)``,
which logs a ``plan_updated`` event with the plan and the reason. Every change makes a new value:
:meth:`Plan.with_node` (a node's status, attempts, verdict), :meth:`Plan.start` (a node begins),
:meth:`Plan.replan` (the remaining plan rewritten: the version goes up by one and the change is
kept in :attr:`Plan.history`).

The rules (:meth:`Plan.problems`, :meth:`Plan.validate`):

* at least one node and at most :data:`MAX_NODES`;
* node ids are unique, 1 to :data:`MAX_ID_CHARS` characters of :data:`ID_CHARS` (letters, digits,
  ``_``, ``.``, ``-``: an id is printed in notes, terminals and diagrams, so it can carry no line
  break, escape sequence or markup);
* every goal is non-empty; a goal or an acceptance text has at most :data:`MAX_TEXT_CHARS` characters;
* every dependency names a node of the plan, not the node itself, and once;
* the dependencies have no cycle;
* an open node (pending or running) depends on no skipped node (it could never run; an open
  node may wait on a failed one: the plan is then stuck until a replan, or a person, settles it);
* at most one node is running.

:func:`plan_output_schema` is the JSON Schema a planner's (or replanner's) answer must match;
:func:`nodes_from_output` turns a matching answer into nodes.

    >>> plan = Plan("Write a report", (PlanNode("a", "Collect the data"),
    ...                                PlanNode("b", "Write the report", depends_on=("a",))))
    >>> [n.id for n in plan.validate().ready()]
    ['a']
    >>> plan = plan.start("a", turn=1).with_node("a", status=NodeStatus.PASSED, attempts=1)
    >>> [n.id for n in plan.ready()]
    ['b']
"""

from __future__ import annotations

import enum
import functools
import heapq
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from attrs import evolve, field, frozen

from ..errors import InvalidPlanError
from .structured import OutputSchema

__all__ = [
    "ID_CHARS",
    "MAX_ID_CHARS",
    "MAX_NODES",
    "MAX_TEXT_CHARS",
    "NodeStatus",
    "Plan",
    "PlanNode",
    "Replan",
    "ReplanTrigger",
    "nodes_from_output",
    "one_line",
    "plan_output_schema",
]

MAX_ID_CHARS = 32
"""The longest node id (characters)."""

ID_CHARS = "A-Za-z0-9_.-"
"""The characters a node id may use (a regular-expression class body): ASCII letters and digits,
``_``, ``.`` and ``-``."""

MAX_NODES = 200
"""The most nodes a plan may hold (every version's nodes: passed and skipped ones count)."""

MAX_TEXT_CHARS = 1000
"""The longest goal or acceptance text of a node (characters)."""

_ID = re.compile(f"[{ID_CHARS}]+")


class NodeStatus(str, enum.Enum):
    """Where a node of a plan stands."""

    PENDING = "pending"
    """Not started; it runs once every node it depends on has passed."""
    RUNNING = "running"
    """The node the model is working on (at most one at a time)."""
    PASSED = "passed"
    """Its acceptance check passed; a replan keeps it, with its result."""
    FAILED = "failed"
    """Its check failed and the plan could not be repaired (the replan budget was spent)."""
    SKIPPED = "skipped"
    """A replan dropped it (superseded); it never runs."""

    @property
    def open(self) -> bool:
        """Pending or running: the node still has to pass."""
        return self in (NodeStatus.PENDING, NodeStatus.RUNNING)


class ReplanTrigger(str, enum.Enum):
    """Why the remaining plan was rewritten."""

    FAILED = "failed"
    """A node failed its acceptance check."""
    STALE = "stale"
    """A node ran for too many turns without an answer to check."""
    STEER = "steer"
    """The user changed the goal (a Steer: the goal version went up)."""
    RESUMED = "resumed"
    """A person resumed a run that had stopped because the plan could not be repaired."""
    FOLLOWUP = "followup"
    """The user followed up after every node had passed (a Followup): nodes for it are planned."""


def _strings(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@frozen
class PlanNode:
    """One step of a plan."""

    id: str
    """Unique within the plan, 1 to :data:`MAX_ID_CHARS` characters of :data:`ID_CHARS`, e.g. ``"s2"``."""
    goal: str
    """What this step must achieve, as the instruction given to the model."""
    depends_on: tuple[str, ...] = field(default=(), converter=_strings)
    """Ids of the nodes that must pass before this one starts."""
    acceptance: str = ""
    """The acceptance check in words: what a correct result of this step looks like (what a model
    grader judges against)."""
    check: str | None = None
    """The name of a programmatic check registered with the plugin (``PlanAct(checks={name: ...})``),
    or ``None``: the acceptance text is judged (by a model grader, by default)."""
    status: NodeStatus = NodeStatus.PENDING
    """Where the node stands."""
    attempts: int = 0
    """How many times its result was checked (passing included): 2 means one failed check, then
    one more."""
    result: str | None = None
    """A summary of the answer last checked (PlanAct: its text with runs of whitespace made one
    space, cut to 500 characters), or ``None`` before any check."""
    verdict: str | None = None
    """The reason the last check gave (why it passed or failed), or ``None`` before any check."""
    evidence: tuple[str, ...] = field(default=(), converter=_strings)
    """References the last check rests on (a grader's response id, a test id)."""
    started_turn: int | None = None
    """The run's turn count (model calls) when the node last started running; ``None`` before."""


@frozen
class Replan:
    """One rewrite of a plan's remaining nodes, kept in :attr:`Plan.history`."""

    version: int
    """The plan version this replan produced."""
    trigger: ReplanTrigger
    """What caused it."""
    reason: str
    """Why, in words (the failed check's reason, the new direction ...)."""
    turn: int
    """The run's turn count (model calls) when it happened."""
    node: str | None = None
    """The node whose failure (or staleness) caused it; ``None`` for a steer or a followup."""
    dropped: tuple[str, ...] = field(default=(), converter=_strings)
    """Ids of open (or failed) nodes the replan left out: they are now ``skipped``."""
    added: tuple[str, ...] = field(default=(), converter=_strings)
    """Ids of the nodes the replan wrote (new, or rewritten with an existing id)."""


def _nodes(value: Iterable[PlanNode]) -> tuple[PlanNode, ...]:
    return tuple(value)


def _replans(value: Iterable[Replan]) -> tuple[Replan, ...]:
    return tuple(value)


@frozen
class Plan:
    """A goal broken into nodes with dependencies (see the module doc for the rules)."""

    goal: str
    """The task the plan serves."""
    nodes: tuple[PlanNode, ...] = field(converter=_nodes)
    """Every node, in the order written (passed and skipped ones included)."""
    version: int = 1
    """1 for the first plan; each :meth:`replan` adds one."""
    goal_version: int = 1
    """The run's goal version the plan was made for (a Steer raises the run's: the plan is then stale)."""
    history: tuple[Replan, ...] = field(default=(), converter=_replans)
    """Every replan, oldest first."""

    # -- reading ---------------------------------------------------------------------------
    @property
    def replans(self) -> int:
        """How many times the remaining plan was rewritten (``len(history)``)."""
        return len(self.history)

    def node(self, node_id: str) -> PlanNode:
        """The node ``node_id``.

        Raises:
            KeyError: no such node.
        """
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    @property
    def current(self) -> PlanNode | None:
        """The running node, or ``None``."""
        return next((n for n in self.nodes if n.status is NodeStatus.RUNNING), None)

    def order(self) -> tuple[PlanNode, ...]:
        """Every node in dependency order (a node after the nodes it depends on; ties keep the
        written order). Nodes in a cycle, or after an unknown dependency, come last as written.

        Linear in nodes and dependencies (times a log for the tie order)."""
        index = {n.id: i for i, n in enumerate(self.nodes)}
        waiting = [0] * len(self.nodes)
        after: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for d in set(n.depends_on):
                j = index.get(d)
                if j is None or d == n.id:  # unknown or itself: no constraint here (problems() says so)
                    continue
                waiting[i] += 1
                after[j].append(i)
        ready = [i for i, w in enumerate(waiting) if w == 0]
        heapq.heapify(ready)
        out: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            out.append(i)
            for k in after[i]:
                waiting[k] -= 1
                if waiting[k] == 0:
                    heapq.heappush(ready, k)
        placed = set(out)
        out.extend(i for i in range(len(self.nodes)) if i not in placed)
        return tuple(self.nodes[i] for i in out)

    def ready(self) -> tuple[PlanNode, ...]:
        """The pending nodes whose dependencies have all passed, in dependency order: the first is
        the next to run."""
        passed = {n.id for n in self.nodes if n.status is NodeStatus.PASSED}
        return tuple(n for n in self.order()
                     if n.status is NodeStatus.PENDING and all(d in passed for d in n.depends_on))

    @property
    def done(self) -> bool:
        """Every node passed or was skipped, and at least one passed."""
        return (all(n.status in (NodeStatus.PASSED, NodeStatus.SKIPPED) for n in self.nodes)
                and any(n.status is NodeStatus.PASSED for n in self.nodes))

    def problems(self) -> list[str]:
        """Every rule the plan breaks, one sentence each (empty: the plan is valid). Texts a model
        wrote are quoted with :func:`repr`, so a problem is one printable line."""
        out: list[str] = []
        if not self.nodes:
            return ["the plan has no nodes"]
        if len(self.nodes) > MAX_NODES:
            return [f"the plan has {len(self.nodes)} nodes; at most {MAX_NODES} are allowed"]
        seen: set[str] = set()
        for n in self.nodes:
            if not n.id.strip():
                out.append(f"a node has an empty id (goal {n.goal[:60]!r})")
            elif len(n.id) > MAX_ID_CHARS:
                out.append(f"node id {n.id[:40]!r}… is longer than {MAX_ID_CHARS} characters")
            elif not _ID.fullmatch(n.id):
                out.append(f"node id {n.id!r} may use only letters, digits, '_', '.' and '-'")
            if n.id in seen:
                out.append(f"node id {n.id[:40]!r} is used by more than one node")
            seen.add(n.id)
            if not n.goal.strip():
                out.append(f"node {n.id[:40]!r} has an empty goal")
            for what, text in (("goal", n.goal), ("acceptance", n.acceptance)):
                if len(text) > MAX_TEXT_CHARS:
                    out.append(f"node {n.id[:40]!r}: its {what} has {len(text)} characters; at most "
                               f"{MAX_TEXT_CHARS} are allowed")
        by_id = {n.id: n for n in self.nodes}
        for n in self.nodes:
            listed: set[str] = set()
            for d in n.depends_on:
                if d in listed:
                    out.append(f"node {n.id[:40]!r} lists the dependency {d[:40]!r} more than once")
                    continue
                listed.add(d)
                if d == n.id:
                    out.append(f"node {n.id[:40]!r} depends on itself")
                elif d not in by_id:
                    out.append(f"node {n.id[:40]!r} depends on unknown node {d[:40]!r}")
                elif n.status.open and by_id[d].status is NodeStatus.SKIPPED:
                    out.append(f"open node {n.id!r} depends on skipped node {d!r}, so it can never run")
        cycle = self._cycle(by_id)
        if cycle:
            out.append("dependency cycle: " + " -> ".join(c[:40] for c in cycle))
        running = [n.id for n in self.nodes if n.status is NodeStatus.RUNNING]
        if len(running) > 1:
            out.append(f"{len(running)} nodes are running ({', '.join(running)}); at most one may run")
        if self.version < 1:
            out.append(f"version {self.version} is below 1")
        return out

    def _cycle(self, by_id: Mapping[str, PlanNode]) -> list[str]:
        """One dependency cycle as ``[a, b, a]``, or ``[]`` (an iterative depth-first search: a
        chain of any length is walked without recursion)."""
        state: dict[str, int] = {}  # 1: on the path, 2: done
        for root in by_id:
            if root in state:
                continue
            path: list[str] = [root]
            state[root] = 1
            stack = [iter(by_id[root].depends_on)]
            while stack:
                d = next(stack[-1], None)
                if d is None:
                    stack.pop()
                    state[path.pop()] = 2
                    continue
                if d == path[-1] or d not in by_id:
                    continue
                if state.get(d) == 1:
                    return path[path.index(d):] + [d]
                if d not in state:
                    state[d] = 1
                    path.append(d)
                    stack.append(iter(by_id[d].depends_on))
        return []

    def validate(self) -> Plan:
        """The plan itself when it keeps every rule.

        Raises:
            InvalidPlanError: with every problem found (:meth:`problems`).
        """
        problems = self.problems()
        if problems:
            raise InvalidPlanError(problems)
        return self

    # -- changing (new values) -------------------------------------------------------------
    def with_node(self, node_id: str, **changes: Any) -> Plan:
        """The plan with node ``node_id``'s fields changed (``status=``, ``attempts=`` ...); the
        version stays (only a replan changes it).

        Raises:
            KeyError: no such node.
        """
        self.node(node_id)
        return evolve(self, nodes=tuple(evolve(n, **changes) if n.id == node_id else n for n in self.nodes))

    def start(self, node_id: str, *, turn: int) -> Plan:
        """The plan with ``node_id`` running since ``turn`` (a node that was running is set back
        to pending).

        Raises:
            KeyError: no such node.
        """
        self.node(node_id)
        nodes = []
        for n in self.nodes:
            if n.id == node_id:
                n = evolve(n, status=NodeStatus.RUNNING, started_turn=turn)
            elif n.status is NodeStatus.RUNNING:
                n = evolve(n, status=NodeStatus.PENDING)
            nodes.append(n)
        return evolve(self, nodes=tuple(nodes))

    def replan(self, nodes: Sequence[PlanNode], *, trigger: ReplanTrigger, reason: str, turn: int,
               node: str | None = None, goal_version: int | None = None) -> Plan:
        """The plan with its remaining nodes rewritten: the next version.

        Passed nodes stay as they are, with their results. ``nodes`` are the new remaining nodes
        (status pending); one with the id of an earlier open or failed node replaces it and keeps
        its ``attempts``. Earlier open or failed nodes left out become ``skipped``. The change is
        appended to :attr:`history`. The result is not validated (call :meth:`validate`).

        Raises:
            InvalidPlanError: a new node reuses the id of a passed node (a passed node is never
                rewritten).
        """
        passed = {n.id for n in self.nodes if n.status is NodeStatus.PASSED}
        clash = [n.id for n in nodes if n.id in passed]
        if clash:
            raise InvalidPlanError([f"node {i!r} already passed and cannot be rewritten; give the new node "
                                    "another id" for i in clash])
        new_ids = {n.id for n in nodes}
        earlier = {n.id: n for n in self.nodes}
        kept: list[PlanNode] = []
        dropped: list[str] = []
        for n in self.nodes:
            if n.status is NodeStatus.PASSED or n.status is NodeStatus.SKIPPED and n.id not in new_ids:
                kept.append(n)
            elif n.id not in new_ids:
                kept.append(evolve(n, status=NodeStatus.SKIPPED))
                dropped.append(n.id)
        written = [evolve(n, status=NodeStatus.PENDING, started_turn=None,
                          attempts=earlier[n.id].attempts if n.id in earlier else n.attempts)
                   for n in nodes]
        version = self.version + 1
        record = Replan(version, trigger, reason, turn, node, tuple(dropped), tuple(n.id for n in nodes))
        return evolve(self, nodes=(*kept, *written), version=version, history=(*self.history, record),
                      goal_version=self.goal_version if goal_version is None else goal_version)

    # -- presenting ------------------------------------------------------------------------
    def describe(self) -> list[str]:
        """Human-readable lines: a header, one line per node (dependency order), one per replan.
        Every text is made one printable line (:func:`one_line`), whatever a model wrote in it."""
        passed = sum(n.status is NodeStatus.PASSED for n in self.nodes)
        live = sum(n.status is not NodeStatus.SKIPPED for n in self.nodes)
        replans = f"{self.replans} replan" + ("" if self.replans == 1 else "s")
        lines = [f"plan v{self.version} ({replans}): {passed} of {live} nodes passed — {_line(self.goal, 100)}"]
        for n in self.order():
            after = f" (after {_line(', '.join(n.depends_on), 120)})" if n.depends_on else ""
            tries = f", {n.attempts} attempt" + ("" if n.attempts == 1 else "s") if n.attempts else ""
            lines.append(f"  [{n.status.value:<7}] {_line(n.id, MAX_ID_CHARS)}: {_line(n.goal, 80)}{after}{tries}")
            if n.verdict:
                lines.append(f"            check: {_line(n.verdict, 100)}")
        for r in self.history:
            on = f" {_line(r.node, MAX_ID_CHARS)}" if r.node else ""
            lines.append(f"  replan -> v{r.version} at turn {r.turn} ({r.trigger.value}{on}): {_line(r.reason, 100)}")
        return lines


def one_line(text: str, limit: int | None = None) -> str:
    """``text`` as one printable line, for a terminal, a log line or a diagram: every run of
    whitespace becomes one space, control characters (escape sequences among them) and
    invisible format characters (bidirectional overrides, zero-width spaces) are dropped, and the
    result is cut to ``limit`` characters (the last one then ``…``; ``None``: no cut)."""
    text = "".join(ch for ch in text if ch.isspace() or unicodedata.category(ch) not in _HIDDEN)
    text = " ".join(text.split())
    return text if limit is None or len(text) <= limit else text[:limit - 1] + "…"


_HIDDEN = frozenset(("Cc", "Cf", "Co", "Cs", "Cn"))
"""Unicode categories never shown: control, format, private use, surrogate, unassigned."""


def _line(text: str, limit: int) -> str:
    return one_line(text, limit)


def plan_output_schema(*, name: str = "plan", min_nodes: int = 1, max_nodes: int = 8,
                       checks: Sequence[str] = (), max_chars: int | None = None,
                       ids: Sequence[str] | None = None, done: Sequence[str] = ()) -> OutputSchema:
    """The JSON Schema of a planner's answer: ``{"nodes": [{"id", "goal", "depends_on",
    "acceptance"[, "check"]}]}``.

    Args:
        name: the schema's name (``plan`` for a planner, ``replan`` for a replanner).
        min_nodes: fewest nodes (``minItems``).
        max_nodes: most nodes (``maxItems``).
        checks: names of the programmatic checks a node may name; with none, nodes have no
            ``check`` key. The key is then required, one of the names or ``null``.
        max_chars: ``maxLength`` on every string (and ``maxItems`` on ``depends_on``): a
            grammar-constrained server (llama.cpp) then cannot let a small model run on until the
            output limit cuts the JSON. ``None``: no bound.
        ids: the numbered form, for grammar-constrained small models: node ``k`` must have the id
            ``ids[k]`` and may depend only on ``done`` and on ``ids[:k]``, so that no answer the
            grammar allows has an unknown dependency, a cycle or a clashing id. The node list is
            then one fixed-length array per allowed length (``prefixItems``), as llama.cpp's
            grammar does not bound a tuple by ``minItems``. ``None``: free ids, checked afterwards.
        done: ids of nodes that already passed, which new nodes may depend on (numbered form).

    The result is cached by its arguments (building an :class:`OutputSchema` checks it against
    the JSON Schema meta-schema: measured here 6 ms for the free form, 18 ms for the numbered form
    of 4 nodes): share it, do not change its dict.

    Raises:
        ConfigurationError: ``min_nodes`` < 1, ``max_nodes`` < ``min_nodes``, or fewer ``ids``
            than ``max_nodes``.
    """
    return _plan_output_schema(name, min_nodes, max_nodes, tuple(checks), max_chars,
                               None if ids is None else tuple(ids), tuple(done))


@functools.lru_cache(maxsize=64)
def _plan_output_schema(name: str, min_nodes: int, max_nodes: int, checks: tuple[str, ...], max_chars: int | None,
                        ids: tuple[str, ...] | None, done: tuple[str, ...]) -> OutputSchema:
    from ..errors import ConfigurationError

    if min_nodes < 1 or max_nodes < min_nodes:
        raise ConfigurationError(f"a plan needs 1 <= min_nodes <= max_nodes (got {min_nodes}, {max_nodes})")
    if ids is not None and len(ids) < max_nodes:
        raise ConfigurationError(f"the numbered form needs {max_nodes} ids, got {len(ids)}")

    def text(limit: int | None = max_chars) -> dict[str, Any]:
        s: dict[str, Any] = {"type": "string", "minLength": 1}
        if limit is not None:
            s["maxLength"] = limit
        return s

    def node(node_id: dict[str, Any], deps: dict[str, Any]) -> dict[str, Any]:
        props: dict[str, Any] = {"id": node_id, "goal": text(), "depends_on": deps, "acceptance": text()}
        if checks:
            props["check"] = {"enum": [*checks, None]}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    nodes: dict[str, Any]
    if ids is None:
        deps: dict[str, Any] = {"type": "array", "items": text(MAX_ID_CHARS)}
        if max_chars is not None:
            deps["maxItems"] = max_nodes
        nodes = {"type": "array", "items": node(text(MAX_ID_CHARS), deps), "minItems": min_nodes,
                 "maxItems": max_nodes}
    else:
        items = []
        for k in range(max_nodes):
            allowed = [*done, *ids[:k]]
            deps = ({"type": "array", "items": {"enum": allowed}, "maxItems": len(allowed)} if allowed
                    else {"type": "array", "maxItems": 0})
            items.append(node({"const": ids[k]}, deps))
        nodes = {"anyOf": [{"type": "array", "prefixItems": items[:n], "minItems": n, "maxItems": n}
                           for n in range(min_nodes, max_nodes + 1)]}
    schema = {"type": "object", "properties": {"nodes": nodes}, "required": ["nodes"], "additionalProperties": False}
    return OutputSchema(name, schema, "the plan's steps: ids, goals, dependencies, acceptance checks")


def nodes_from_output(value: Any) -> tuple[PlanNode, ...]:
    """Pending nodes from a planner's answer (a value matching :func:`plan_output_schema`).

    Ids, goals and dependencies are stripped of surrounding spaces; a repeated dependency is kept once.

    Raises:
        InvalidPlanError: the value does not have the answer's shape (no ``nodes`` list, a node
            that is not an object, a field of the wrong type).
    """
    if not isinstance(value, Mapping) or not isinstance(value.get("nodes"), list):
        raise InvalidPlanError(['the answer must be an object with a "nodes" list'])
    out: list[PlanNode] = []
    problems: list[str] = []
    for i, raw in enumerate(value["nodes"]):
        if not isinstance(raw, Mapping):
            problems.append(f"nodes[{i}] is not an object")
            continue
        node_id, goal, acceptance = raw.get("id"), raw.get("goal"), raw.get("acceptance", "")
        deps, check = raw.get("depends_on", []), raw.get("check")
        if not isinstance(node_id, str) or not isinstance(goal, str) or not isinstance(acceptance, str):
            problems.append(f"nodes[{i}]: id, goal and acceptance must be strings")
            continue
        if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
            problems.append(f"nodes[{i}]: depends_on must be a list of node ids")
            continue
        if check is not None and not isinstance(check, str):
            problems.append(f"nodes[{i}]: check must be a check name or null")
            continue
        unique = tuple(dict.fromkeys(d.strip() for d in deps))
        out.append(PlanNode(node_id.strip(), goal.strip(), unique, acceptance.strip(), check))
    if problems:
        raise InvalidPlanError(problems)
    return tuple(out)
