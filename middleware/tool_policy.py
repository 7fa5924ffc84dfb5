r"""ToolPolicy: allow, deny or ask for each tool call, from a policy file a reviewer can read.

The policy is a list of rules, tried in order on every proposed tool call
(MidTurn, ``on_tool_call``); **the first rule that matches decides**. When no
rule matches, ``default`` decides. Decisions:

* ``allow`` → :class:`~fsm_agent.Allow` (later middleware, e.g. approval, still run);
* ``deny``  → :class:`~fsm_agent.Deny` with the rule's reason: the tool does not
  run and the model gets an error tool result
  ``"Tool call denied by policy (ToolPolicy): <reason> (rule <n>)"``;
* ``ask``   → :class:`~fsm_agent.AskApproval`: the run stops WAITING_HUMAN with
  the call pending.

A rule matches when the tool name matches one of its ``tool`` glob patterns
(:func:`fnmatch.fnmatchcase`: case-sensitive, ``*``, ``?``, ``[abc]``) and
every condition in ``when`` holds (AND; no ``when`` = always). A condition
names an argument (``arg``, a dotted path into the arguments: ``"options.mode"``,
``"paths.0"``) and one or more operators, all of which must hold:

==============  =====================================================================
``equals``      equal to the value (any JSON value); ``not_equals``: different
``in``          one of a list of values; ``not_in``: none of them
``lt`` ``le``   number (not bool) less than / at most the value (also ``gt``, ``ge``)
``starts_with`` string starts with the value (or one of a list); ``ends_with`` likewise
``contains``    string contains the substring, or list contains the element
``matches``     string matches the regular expression *as a whole* (``re.fullmatch``)
``under``       string is an absolute POSIX path inside the directory once normalized
                (``/srv/../etc`` is *not* under ``/srv``; ``starts_with`` would say yes)
``host``        string is a URL or a bare ``host[:port]`` whose host is one of the patterns:
                ``example.com``, ``*.example.com`` (its subdomains), ``*`` (any host)
``exists``      ``true``: the argument is present; ``false``: it is absent
==============  =====================================================================

Every operator but ``exists`` is false when the argument is missing or has the
wrong type. So write **allow rules narrowly and deny by default**: arguments
a rule did not foresee then fall through to the default.

File format: TOML (stdlib ``tomllib``), or JSON with the same structure when
the file name ends in ``.json``. A complete example (``tests/middleware/data/
policy.toml`` holds the same text)::

    # policy-example
    version = 1             # optional; must be 1
    default = "deny"        # allow | deny | ask; optional, "deny" when absent

    [[rule]]
    name = "no shell"       # optional label, shown in reasons
    tool = ["shell", "exec_*"]
    action = "deny"
    reason = "shell commands are not allowed"

    [[rule]]
    tool = "read_file"
    action = "allow"
    when = [{ arg = "path", under = "/srv" }]

    [[rule]]
    tool = "write_file"
    action = "allow"
    when = [{ arg = "path", under = "/srv/out", ends_with = [".txt", ".md"] }]

    [[rule]]
    tool = "pay"
    action = "allow"
    when = [{ arg = "amount", gt = 0, le = 100 }, { arg = "currency", in = ["EUR", "USD"] }]

    [[rule]]
    tool = "pay"
    action = "ask"
    when = [{ arg = "amount", gt = 100 }, { arg = "currency", in = ["EUR", "USD"] }]
    reason = "payments over 100 need a person's approval"
    allowed_decisions = ["approve", "reject"]

    [[rule]]
    tool = "search"
    action = "allow"
    when = [{ arg = "query", matches = '[\w ]{1,80}' }]

    [[rule]]
    tool = "calculator"
    action = "allow"
    # end-policy-example

Rule keys: ``tool`` (string or list of globs, required), ``action`` (required),
``when`` (list of conditions), ``reason`` (string), ``name`` (string),
``allowed_decisions`` (``ask`` only: a subset of approve, edit, reject, respond).

Loading validates everything (unknown keys and operators, wrong value types, bad
regular expressions, relative ``under`` paths) and raises :class:`PolicyError`
listing every problem as ``"<file>: rule <n>: <problem>"`` (from 1), before any run.
"""

from __future__ import annotations

import fnmatch
import json
import tomllib
from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

from attrs import frozen

from fsm_agent import (
    CONDITION_OPERATORS,
    Allow,
    ArgumentCondition,
    AskApproval,
    ConfigurationError,
    Deny,
    Middleware,
    Ordering,
    RunContext,
    ToolUseBlock,
    parse_condition,
)

__all__ = ["ACTIONS", "OPERATORS", "Condition", "PolicyError", "Rule", "ToolPolicy"]

ACTIONS = ("allow", "deny", "ask")
"""What a rule (or the default) can decide."""
DECISIONS = ("approve", "edit", "reject", "respond")
OPERATORS = CONDITION_OPERATORS
"""Condition operators, in the order of the table above (the vocabulary of
:mod:`fsm_agent.conditions`, shared with permission scopes and task checks)."""
Condition = ArgumentCondition
"""One ``when`` entry: every ``(operator, value)`` in ``checks`` must hold for argument ``arg``
(:class:`fsm_agent.ArgumentCondition`)."""


class PolicyError(ConfigurationError, ValueError):
    """A policy file or rule list is invalid. ``problems`` holds one line per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def _strs(v: Any) -> tuple[str, ...] | None:
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return tuple(v)
    return None


@frozen
class Rule:
    """One rule of a policy (see the module docstring for the keys)."""

    number: int
    """Position in the policy, from 1."""
    tools: tuple[str, ...]
    """Glob patterns on the tool name."""
    action: str
    """``allow``, ``deny`` or ``ask``."""
    when: tuple[Condition, ...] = ()
    reason: str = ""
    name: str = ""
    allowed_decisions: tuple[str, ...] = DECISIONS

    def matches(self, tool: str, arguments: Mapping[str, Any]) -> bool:
        return any(fnmatch.fnmatchcase(tool, p) for p in self.tools) and all(c.holds(arguments) for c in self.when)

    @property
    def label(self) -> str:
        return f"rule {self.number} {self.name!r}" if self.name else f"rule {self.number}"


_RULE_KEYS = ("tool", "action", "when", "reason", "name", "allowed_decisions")


def _rule(raw: Any, number: int, source: str, problems: list[str]) -> Rule | None:
    where = f"{source}: rule {number}"
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: a rule must be a table ([[rule]])")
        return None
    before = len(problems)
    for key in raw:
        if key not in _RULE_KEYS:
            problems.append(f"{where}: unknown key {key!r} (rule keys: {', '.join(_RULE_KEYS)})")
    tools = _strs(raw.get("tool"))
    if tools is None or not all(tools):
        problems.append(f"{where}: 'tool' must be a glob pattern or a list of them")
    action = raw.get("action")
    if action not in ACTIONS:
        problems.append(f"{where}: 'action' must be one of allow, deny, ask, not {action!r}")
    when_raw = raw.get("when", [])
    if not isinstance(when_raw, list):
        problems.append(f"{where}: 'when' must be a list of conditions")
        when_raw = []
    when = [parse_condition(c, f"{where}: condition {i}", problems) for i, c in enumerate(when_raw, 1)]
    for key in ("reason", "name"):
        if not isinstance(raw.get(key, ""), str):
            problems.append(f"{where}: {key!r} must be a string")
    decisions = raw.get("allowed_decisions", list(DECISIONS))
    if "allowed_decisions" in raw and action != "ask":
        problems.append(f"{where}: 'allowed_decisions' only applies to action = \"ask\"")
    elif not (isinstance(decisions, list) and decisions and all(d in DECISIONS for d in decisions)):
        problems.append(f"{where}: 'allowed_decisions' must be a non-empty list from {', '.join(DECISIONS)}")
    if len(problems) > before:
        return None
    return Rule(number, tools or (), str(action), tuple(c for c in when if c is not None),
                raw.get("reason", ""), raw.get("name", ""), tuple(decisions))


class ToolPolicy(Middleware):
    """Allow / deny / ask per tool call by name globs and argument rules; first match wins.

    Args:
        rules: rule tables (mappings with the keys of the file format) or :class:`Rule` objects.
        default: ``"allow"``, ``"deny"`` (the default: fail closed) or ``"ask"``.
        source: where the rules came from (file name), used in messages and the repr.

    Raises:
        PolicyError: any rule is invalid (every problem is listed, with its rule number).
    """

    name = "tool_policy"

    ordering = Ordering(wraps=("approval", "budget"))

    def __init__(self, rules: Sequence[Mapping[str, Any] | Rule] = (), *, default: str = "deny",
                 source: str = "<rules>") -> None:
        problems: list[str] = []
        if default not in ACTIONS:
            problems.append(f"{source}: 'default' must be one of allow, deny, ask, not {default!r}")
        parsed = [r if isinstance(r, Rule) else _rule(r, i, source, problems) for i, r in enumerate(rules, 1)]
        if problems:
            raise PolicyError(problems)
        self.rules: tuple[Rule, ...] = tuple(r for r in parsed if r is not None)
        self.default = default
        self.source = source

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> ToolPolicy:
        """A policy from the parsed file structure (``default``, ``version``, ``rule``)."""
        problems: list[str] = []
        if not isinstance(data, Mapping):
            raise PolicyError([f"{source}: the policy must be a table / JSON object"])
        for key in data:
            if key not in ("version", "default", "rule"):
                problems.append(f"{source}: unknown top-level key {key!r} (use version, default, rule)")
        if data.get("version", 1) != 1:
            problems.append(f"{source}: unsupported version {data.get('version')!r} (this reader knows version 1)")
        rules = data.get("rule", [])
        if not isinstance(rules, list):
            problems.append(f"{source}: 'rule' must be an array of tables ([[rule]])")
            rules = []
        try:
            policy = cls(rules, default=data.get("default", "deny"), source=source)
        except PolicyError as exc:
            problems.extend(exc.problems)
        if problems:
            raise PolicyError(problems)
        return policy

    @classmethod
    def from_file(cls, path: str | PathLike[str]) -> ToolPolicy:
        """Load a TOML policy (JSON when the name ends in ``.json``).

        Raises:
            PolicyError: the file cannot be read or parsed, or a rule is invalid.
        """
        source = str(path)
        try:
            text = Path(path).read_bytes()
            data = json.loads(text) if source.endswith(".json") else tomllib.loads(text.decode("utf-8"))
        except OSError as exc:
            raise PolicyError([f"{source}: cannot read the policy file: {exc.strerror or exc}"]) from exc
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            kind = "JSON" if source.endswith(".json") else "TOML"
            raise PolicyError([f"{source}: invalid {kind}: {exc}"]) from exc
        return cls.from_dict(data, source=source)

    def decide(self, tool: str, arguments: Mapping[str, Any]) -> Allow | Deny | AskApproval:
        """The decision for a call of ``tool`` with ``arguments`` (pure: no run needed)."""
        for rule in self.rules:
            if rule.matches(tool, arguments):
                return self._decision(rule.action, tool, rule)
        return self._decision(self.default, tool, None)

    def _decision(self, action: str, tool: str, rule: Rule | None) -> Allow | Deny | AskApproval:
        if action == "allow":
            return Allow()
        if rule is None:
            reason = f"no rule of the tool policy allows tool {tool!r} (default: {action})"
        else:
            text = rule.reason or (f"tool {tool!r} is not allowed" if action == "deny"
                                   else f"tool {tool!r} needs approval")
            reason = f"{text} ({rule.label})"
        if action == "deny":
            return Deny(reason)
        return AskApproval(reason, rule.allowed_decisions if rule else DECISIONS)

    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Allow | Deny | AskApproval:
        return self.decide(call.name, call.input)

    def __repr__(self) -> str:
        return f"ToolPolicy(source={self.source!r}, rules={len(self.rules)}, default={self.default!r})"
