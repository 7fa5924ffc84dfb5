"""Task mode (seed 000: ``run_task`` beside ``process_message``): a task definition in, a task result out.

A :class:`Task` holds what a serious batch job needs to say: the goal, its inputs, constraints, the
tools it may use (its session's permissions: :mod:`fsm_agent.permissions`), a budget, an output
schema and acceptance checks. :meth:`fsm_agent.Agent.run_task` runs it as one session of the state
machine and returns a :class:`TaskResult`: the outcome, the validated output, the checks' results
and other evidence, usage, cost and the stop. Conversation mode (:meth:`~fsm_agent.Agent.run`) is
unchanged.

Where each part is enforced:

* the **output schema** by the engine at PostTurn (one repair turn, then FAILED_TERMINAL with
  ``structured_output_invalid``), as for any run with ``RunConfig.output_schema``;
* the **acceptance checks** by the built-in ``verifier`` plugin at PostTurn, loaded by its entry
  point and given the task's checks (``Verifier.for_task``): a failed check is sent back to the
  model as feedback, up to :attr:`Task.max_repairs` times; then the run stops FAILED_TERMINAL
  (``verification_failed``), or WAITING_HUMAN with ``on_check_failure="human"``. Every check's
  result is in the stop's ``evidence_refs`` (``check[<name>] passed: …``);
* the **allowed tools** and **permissions** by the engine (the session's permissions);
* the **budget** by the engine's budgets (a run out of budget pauses, resumable).

The definition is stored with the session (``metadata["task_definition"]``), so a task session
resumed later, by any worker, a server or a durable host, is still run as that task: its checks
are rebuilt from the definition (give Python checks as ``python = "module:function"`` for that; a
check given as a callable runs only in the process that holds the :class:`Task`).

File format (TOML, or JSON with the same structure; ``fsm-agent task FILE`` runs one)::

    name = "largest-city"
    goal = "Find the largest city of the country given and its population."
    constraints = ["Use the lookup tool; do not answer from memory."]
    allowed_tools = ["lookup_city"]     # absent: every tool of the agent

    [inputs]
    country = "France"

    [budget]
    max_iterations = 8
    max_wall_clock = 120
    max_cost_usd = 0.05

    [output_schema]
    name = "city"
    schema = { type = "object", properties = { name = { type = "string" }, population = { type = "integer" } }, required = ["name", "population"], additionalProperties = false }

    [[check]]
    name = "a real population"
    value = "output.population"         # "answer" (the text), "output" or "output.<path>"
    gt = 1000000

    [[check]]
    name = "states its source"
    grader = "The answer names where the population figure comes from."

    [[check]]
    name = "recent figure"
    python = "mychecks:population_is_recent"   # (TaskAnswer) -> bool | (bool, reason)

    [permissions]                       # finer limits: argument scopes (docs/permissions.md)
    [[permissions.scope]]
    tool = "lookup_city"
    arg = "country"
    in = ["France"]
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import re
import tomllib
from collections.abc import Callable, Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import orjson
from attrs import evolve, field, frozen

from .conditions import ArgumentCondition, parse_condition
from .config import RunConfig
from .errors import PermissionsError, TaskDefinitionError
from .permissions import Permissions, allowed_tools_permissions
from .types.messages import Message, Usage, UserMessage
from .types.run import RunResult, RunStop, StopReason
from .types.structured import OutputSchema

__all__ = ["TASK_DEFINITION_KEY", "AcceptanceCheck", "CheckResult", "Task", "TaskAnswer", "TaskBudget", "TaskOutcome",
           "TaskResult", "stored_task"]

TASK_DEFINITION_KEY = "task_definition"
"""The session metadata key that holds a task session's definition (:meth:`Task.to_dict`)."""

_TOP = ("name", "goal", "inputs", "constraints", "allowed_tools", "permissions", "budget", "output_schema", "check",
        "max_repairs", "on_check_failure", "version")
_CHECK_KINDS = ("value", "grader", "python")
_NAME = re.compile(r"[^\]\n\r]{1,80}")
_EVIDENCE = re.compile(r"check\[([^\]\n\r]{1,80})\] (passed|failed)(?:: (.*))?", re.S)
_PY_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


@frozen
class TaskBudget:
    """A task's budget; a field left ``None`` keeps the agent's own (:class:`~fsm_agent.RunConfig`)."""

    max_iterations: int | None = None
    """Model calls."""
    max_wall_clock: float | None = None
    """Seconds."""
    max_tokens: int | None = None
    """Input + output tokens."""
    max_cost_usd: float | None = None
    """USD."""

    def apply(self, config: RunConfig) -> RunConfig:
        """``config`` with this budget's limits.

        Raises:
            ConfigurationError: a limit :class:`~fsm_agent.RunConfig` refuses (not positive ...).
        """
        limits = {k: v for k, v in ((n, getattr(self, n)) for n in _BUDGET_KEYS) if v is not None}
        return evolve(config, **limits) if limits else config

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _BUDGET_KEYS if getattr(self, k) is not None}


_BUDGET_KEYS = ("max_iterations", "max_wall_clock", "max_tokens", "max_cost_usd")


@frozen
class TaskAnswer:
    """What a Python acceptance check is given."""

    text: str
    """The final answer's text."""
    output: Any
    """The validated output (the output schema's value), or ``None`` when the task has no schema."""
    context: Any = None
    """The run's :class:`~fsm_agent.RunContext` (the transcript, tool counts, ``ctx.call_provider`` ...)."""


@frozen
class CheckResult:
    """One acceptance check's result."""

    name: str
    ok: bool
    reason: str = ""

    def to_evidence(self) -> str:
        """The evidence reference it is recorded as: ``check[<name>] passed: <reason>``."""
        return f"check[{self.name}] {'passed' if self.ok else 'failed'}" + (f": {self.reason}" if self.reason else "")

    @classmethod
    def from_evidence(cls, ref: str) -> CheckResult | None:
        """The result an evidence reference records, or ``None`` for another kind of reference."""
        m = _EVIDENCE.fullmatch(ref)
        return None if m is None else cls(m.group(1), m.group(2) == "passed", m.group(3) or "")


CheckFunction = Callable[[TaskAnswer], Any]
"""``(answer) -> bool | (bool, reason) | object with .ok and .feedback/.reason``, plain or async."""


@frozen
class AcceptanceCheck:
    """One acceptance check of a task; build it with :meth:`on_value`, :meth:`graded`,
    :meth:`python_ref` or :meth:`function`.

    Exactly one of: ``value`` with ``checks`` (operators of :mod:`fsm_agent.conditions` on
    ``"answer"``, ``"output"`` or ``"output.<path>"``), ``grader`` (a criterion a model judges,
    through the ``verifier`` plugin's grader), ``python`` (``"module:function"``) or ``fn`` (a
    callable, not stored).

    Raises:
        TaskDefinitionError: none or several kinds, a bad name, operator or reference.
    """

    name: str
    value: str | None = None
    checks: dict[str, Any] = field(factory=dict, converter=dict)
    grader: str | None = None
    python: str | None = None
    fn: CheckFunction | None = field(default=None, eq=False)
    _condition: ArgumentCondition | None = field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        problems: list[str] = []
        where = f"check {self.name!r}"
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            problems.append(f"{where}: 'name' must be 1 to 80 characters, without ']' or line breaks")
        kinds = [k for k, v in (("value", self.value), ("grader", self.grader), ("python", self.python),
                                ("fn", self.fn)) if v is not None]
        if len(kinds) != 1:
            problems.append(f"{where}: give exactly one of value (with operators), grader, python; "
                            f"got {', '.join(kinds) or 'none'}")
        cond = None
        if self.value is not None:
            if not (self.value in ("answer", "output") or self.value.startswith("output.")):
                problems.append(f"{where}: 'value' must be \"answer\", \"output\" or \"output.<path>\", "
                                f"not {self.value!r}")
            cond = parse_condition({"value": self.value, **self.checks}, where, problems, arg_key="value")
        elif self.checks:
            problems.append(f"{where}: operators ({', '.join(self.checks)}) need 'value' (what they check)")
        if self.grader is not None and (not isinstance(self.grader, str) or not self.grader.strip()):
            problems.append(f"{where}: 'grader' must be the criterion a grader model judges (text)")
        if self.python is not None and (not isinstance(self.python, str) or not _PY_REF.fullmatch(self.python)):
            problems.append(f"{where}: 'python' must be \"module:function\", not {self.python!r}")
        if self.fn is not None and not callable(self.fn):
            problems.append(f"{where}: 'fn' must be callable")
        if problems:
            raise TaskDefinitionError(problems)
        object.__setattr__(self, "_condition", cond)

    @classmethod
    def on_value(cls, name: str, value: str, **checks: Any) -> AcceptanceCheck:
        """``on_value("real", "output.population", gt=1_000_000)``; ``value`` is ``"answer"`` (the
        text), ``"output"`` (the validated output) or ``"output.<dotted path>"``."""
        return cls(name, value=value, checks=checks)

    @classmethod
    def graded(cls, name: str, criterion: str) -> AcceptanceCheck:
        """A criterion a grader model judges (the ``verifier`` plugin's ``ModelGrader``; its tokens
        count toward the run's budgets)."""
        return cls(name, grader=criterion)

    @classmethod
    def python_ref(cls, name: str, ref: str) -> AcceptanceCheck:
        """A function named ``"module:function"``: ``(TaskAnswer) -> bool | (bool, reason)``."""
        return cls(name, python=ref)

    @classmethod
    def function(cls, name: str, fn: CheckFunction) -> AcceptanceCheck:
        """A callable ``(TaskAnswer) -> bool | (bool, reason)``, plain or async. Stored by name only: it
        runs only in the process that holds the task (use :meth:`python_ref` for a task a server or
        another worker may resume)."""
        return cls(name, fn=fn)

    @property
    def kind(self) -> str:
        """``value``, ``grader``, ``python`` or ``function``."""
        return ("value" if self.value is not None else "grader" if self.grader is not None
                else "python" if self.python is not None else "function")

    def evaluate(self, answer: TaskAnswer) -> CheckResult:
        """The result of a ``value`` check on ``answer`` (pure).

        Raises:
            TypeError: this is not a ``value`` check.
        """
        if self._condition is None:
            raise TypeError(f"check {self.name!r} is a {self.kind} check, not a value check")
        data = {"answer": answer.text, "output": answer.output}
        why = self._condition.failure(data)
        if why is None:
            return CheckResult(self.name, True, self._condition.describe())
        return CheckResult(self.name, False, why)

    def resolve(self) -> CheckFunction:
        """The function of a ``python`` or ``function`` check.

        Raises:
            TaskDefinitionError: the module or function cannot be found, or is not callable.
        """
        if self.fn is not None:
            return self.fn
        if self.python is None:
            raise TaskDefinitionError([f"check {self.name!r} is a {self.kind} check: it has no function"])
        module, _, attr = self.python.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise TaskDefinitionError([f"check {self.name!r}: cannot load {self.python!r}: {exc}"]) from exc
        if not callable(obj):
            raise TaskDefinitionError([f"check {self.name!r}: {self.python!r} is not callable"])
        return obj  # type: ignore[no-any-return]

    async def call(self, answer: TaskAnswer) -> CheckResult:
        """Run a ``python`` or ``function`` check: its answer as a :class:`CheckResult` (a bool, a
        ``(bool, reason)`` pair, or an object with ``ok`` and ``feedback`` / ``reason``).

        Raises:
            TaskDefinitionError: the function cannot be loaded.
            TypeError: it returned something else.
        """
        out = self.resolve()(answer)
        if inspect.isawaitable(out):
            out = await out
        if isinstance(out, bool):
            return CheckResult(self.name, out, "")
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], bool):
            return CheckResult(self.name, out[0], str(out[1]))
        if isinstance(getattr(out, "ok", None), bool):
            return CheckResult(self.name, out.ok, str(getattr(out, "feedback", None) or getattr(out, "reason", "")))
        raise TypeError(f"check {self.name!r} returned {type(out).__name__}; return a bool or (bool, reason)")

    def to_dict(self) -> dict[str, Any]:
        """The check as a ``[[check]]`` table (a callable is named, not stored: ``{"function": qualname}``)."""
        out: dict[str, Any] = {"name": self.name}
        if self.value is not None:
            out.update(value=self.value, **self.checks)
        elif self.grader is not None:
            out["grader"] = self.grader
        elif self.python is not None:
            out["python"] = self.python
        else:
            out["function"] = getattr(self.fn, "__qualname__", repr(self.fn))
        return out


def _tool_globs(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


@frozen
class Task:
    """A task definition (see the module doc for each part and the file format).

    Raises:
        TaskDefinitionError: an empty goal, inputs that are not JSON, two checks of one name, a bad
            ``on_check_failure`` or ``max_repairs`` (every problem listed).
    """

    goal: str
    inputs: dict[str, Any] = field(factory=dict, converter=dict)
    """Named inputs (JSON values), given to the model as a JSON object."""
    constraints: tuple[str, ...] = field(default=(), converter=tuple)
    """Rules the work must keep to, given to the model."""
    allowed_tools: tuple[str, ...] | None = field(default=None, converter=_tool_globs)
    """Glob patterns of the tools the task may call (its session's permissions); ``None``: the agent's."""
    permissions: Permissions | None = None
    """Finer permissions (argument scopes); narrowed by :attr:`allowed_tools`."""
    budget: TaskBudget = TaskBudget()
    output_schema: OutputSchema | None = None
    """The answer must match it (checked by the engine; the value is :attr:`TaskResult.output`)."""
    checks: tuple[AcceptanceCheck, ...] = field(default=(), converter=tuple)
    max_repairs: int = 2
    """Feedback rounds after failed checks before the task fails."""
    on_check_failure: str = "fail"
    """``"fail"``: FAILED_TERMINAL once the repairs are spent; ``"human"``: WAITING_HUMAN."""
    name: str = ""

    def __attrs_post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.goal, str) or not self.goal.strip():
            problems.append("task: 'goal' must say what to do (non-empty text)")
        try:
            orjson.dumps(self.inputs)
        except TypeError as exc:
            problems.append(f"task: 'inputs' must be JSON values: {exc}")
        if not all(isinstance(c, str) and c.strip() for c in self.constraints):
            problems.append("task: 'constraints' must be non-empty strings")
        if self.allowed_tools is not None and not all(isinstance(t, str) and t for t in self.allowed_tools):
            problems.append("task: 'allowed_tools' must be tool names or glob patterns")
        names = [c.name for c in self.checks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            problems.append(f"task: check names must differ; given twice: {', '.join(twice)}")
        if not isinstance(self.max_repairs, int) or isinstance(self.max_repairs, bool) or self.max_repairs < 0:
            problems.append(f"task: 'max_repairs' must be a whole number >= 0, not {self.max_repairs!r}")
        if self.on_check_failure not in ("fail", "human"):
            problems.append(f"task: 'on_check_failure' must be \"fail\" or \"human\", not {self.on_check_failure!r}")
        if problems:
            raise TaskDefinitionError(problems)

    # -- what the run is given ------------------------------------------------------------------
    def prompt(self) -> str:
        """The user message the task's run starts with: goal, inputs, constraints, the output
        expected and the acceptance criteria."""
        parts = [f"TASK: {self.goal.strip()}"]
        if self.inputs:
            parts.append("INPUTS (JSON):\n" + orjson.dumps(self.inputs, option=orjson.OPT_INDENT_2).decode())
        if self.constraints:
            parts.append("CONSTRAINTS:\n" + "\n".join(f"- {c}" for c in self.constraints))
        if self.output_schema is not None:
            parts.append(f"OUTPUT: answer with one JSON value that matches the schema {self.output_schema.name!r}:\n"
                         + orjson.dumps(self.output_schema.schema).decode())
        if self.checks:
            parts.append("ACCEPTANCE (the answer is checked against these):\n" + "\n".join(
                f"- {c.name}" + (f": {c.grader}" if c.grader else f": {c._condition.describe()}" if c._condition
                                 else "") for c in self.checks))
        return "\n\n".join(parts)

    def messages(self) -> list[Message]:
        """The messages the task's run starts with (the agent adds its system prompt)."""
        return [UserMessage(self.prompt())]

    def config(self, base: RunConfig) -> RunConfig:
        """``base`` with the task's budget and output schema.

        Raises:
            ConfigurationError: a budget :class:`~fsm_agent.RunConfig` refuses.
        """
        cfg = self.budget.apply(base)
        if self.output_schema is not None:
            cfg = evolve(cfg, output_schema=self.output_schema)
        return cfg

    def session_permissions(self, base: Permissions | None = None) -> Permissions | None:
        """The task session's permissions: ``base`` (the caller's, the tenant's) narrowed by the
        task's :attr:`permissions` and :attr:`allowed_tools`; ``None`` when none of them limits anything."""
        perms = base
        if self.permissions is not None:
            perms = self.permissions if perms is None else perms.narrow(self.permissions, "the task's permissions")
        return allowed_tools_permissions(self.allowed_tools, perms)

    # -- the file format ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The task in the file format, JSON-ready (what a task session stores)."""
        out: dict[str, Any] = {"goal": self.goal}
        if self.name:
            out["name"] = self.name
        if self.inputs:
            out["inputs"] = dict(self.inputs)
        if self.constraints:
            out["constraints"] = list(self.constraints)
        if self.allowed_tools is not None:
            out["allowed_tools"] = list(self.allowed_tools)
        if self.permissions is not None:
            out["permissions"] = self.permissions.to_dict()
        if self.budget.to_dict():
            out["budget"] = self.budget.to_dict()
        if self.output_schema is not None:
            s = self.output_schema
            out["output_schema"] = {"name": s.name, "schema": s.schema,
                                    **({"description": s.description} if s.description else {}),
                                    **({"strict": False} if not s.strict else {})}
        if self.checks:
            out["check"] = [c.to_dict() for c in self.checks]
        if self.max_repairs != 2:
            out["max_repairs"] = self.max_repairs
        if self.on_check_failure != "fail":
            out["on_check_failure"] = self.on_check_failure
        return out

    @property
    def rebuildable(self) -> bool:
        """Whether :meth:`from_dict` of :meth:`to_dict` gives this task back whole (no callable check)."""
        return all(c.fn is None for c in self.checks)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<task>") -> Task:
        """A task from the file format (see the module doc).

        Raises:
            TaskDefinitionError: anything invalid, every problem listed as ``"<source>: <problem>"``.
        """
        if not isinstance(data, Mapping):
            raise TaskDefinitionError([f"{source}: a task must be a table / JSON object"])
        problems: list[str] = []
        for key in data:
            if key not in _TOP:
                problems.append(f"{source}: unknown key {key!r} (task keys: {', '.join(_TOP[:-1])})")
        if data.get("version", 1) != 1:
            problems.append(f"{source}: unsupported version {data.get('version')!r} (this reader knows version 1)")
        raw_list = data.get("check")
        if isinstance(raw_list, list) and any(isinstance(c, Mapping) and "function" in c for c in raw_list):
            problems.append(f"{source}: a check given as a Python callable cannot be rebuilt from a file or a "
                            "stored task; give it as python = \"module:function\"")
        kw: dict[str, Any] = {}
        goal = data.get("goal")
        kw["goal"] = goal if isinstance(goal, str) else ""
        for key, types in (("name", str), ("inputs", dict), ("constraints", list), ("allowed_tools", (list, str)),
                           ("max_repairs", int), ("on_check_failure", str)):
            if key in data:
                if not isinstance(data[key], types) or (key == "max_repairs" and isinstance(data[key], bool)):
                    problems.append(f"{source}: {key!r} has the wrong type ({type(data[key]).__name__})")
                else:
                    kw[key] = data[key]
        if "permissions" in data:
            try:
                kw["permissions"] = Permissions.from_dict(data["permissions"], source=f"{source}: permissions")
            except PermissionsError as exc:
                problems.extend(exc.problems)
        if "budget" in data:
            b = data["budget"]
            if not isinstance(b, Mapping):
                problems.append(f"{source}: 'budget' must be a table of {', '.join(_BUDGET_KEYS)}")
            else:
                for k, v in b.items():
                    if k not in _BUDGET_KEYS:
                        problems.append(f"{source}: budget: unknown key {k!r} (use {', '.join(_BUDGET_KEYS)})")
                    elif isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (
                            k in ("max_iterations", "max_tokens") and not isinstance(v, int)):
                        what = "a whole number" if k in ("max_iterations", "max_tokens") else "a number"
                        problems.append(f"{source}: budget: {k!r} must be {what} above 0, not {v!r}")
                if not any(p.startswith(f"{source}: budget") for p in problems):
                    kw["budget"] = TaskBudget(**dict(b))
        if "output_schema" in data:
            o = data["output_schema"]
            if not isinstance(o, Mapping) or not isinstance(o.get("schema"), Mapping):
                problems.append(f"{source}: 'output_schema' must be a table with 'schema' (a JSON schema) and "
                                "'name'")
            else:
                extra = sorted(set(o) - {"name", "schema", "description", "strict"})
                if extra:
                    problems.append(f"{source}: output_schema: unknown key(s) {', '.join(extra)} (use name, schema, "
                                    "description, strict)")
                try:
                    kw["output_schema"] = OutputSchema(str(o.get("name") or "output"), dict(o["schema"]),
                                                       str(o.get("description", "")), bool(o.get("strict", True)))
                except Exception as exc:  # noqa: BLE001 - the schema's own check names the problem
                    problems.append(f"{source}: output_schema: {exc}")
        checks: list[AcceptanceCheck] = []
        raw_checks = data.get("check", [])
        if not isinstance(raw_checks, list):
            problems.append(f"{source}: 'check' must be an array of tables ([[check]])")
            raw_checks = []
        for i, c in enumerate(raw_checks, 1):
            where = f"{source}: check {i}"
            if not isinstance(c, Mapping):
                problems.append(f"{where}: a check must be a table")
                continue
            if "function" in c:
                continue  # reported above
            try:
                if "value" in c:
                    ops = {k: v for k, v in c.items() if k not in ("name", "value")}
                    checks.append(AcceptanceCheck(str(c.get("name", "")), value=c["value"], checks=ops))
                else:
                    extra = sorted(set(c) - {"name", *_CHECK_KINDS})
                    if extra:
                        problems.append(f"{where}: unknown key(s) {', '.join(extra)} (a check has name and one of "
                                        "value (with operators), grader, python)")
                        continue
                    checks.append(AcceptanceCheck(str(c.get("name", "")), grader=c.get("grader"),
                                                  python=c.get("python")))
            except TaskDefinitionError as exc:
                problems.extend(f"{where}: {p}" for p in exc.problems)
        kw["checks"] = checks
        try:
            task = cls(**kw)
        except TaskDefinitionError as exc:
            problems.extend(f"{source}: {p.removeprefix('task: ')}" for p in exc.problems)
        except (TypeError, ValueError) as exc:
            problems.append(f"{source}: {exc}")
        if problems:
            raise TaskDefinitionError(problems)
        return task

    @classmethod
    def from_file(cls, path: str | PathLike[str]) -> Task:
        """Load a TOML task file (JSON when the name ends in ``.json``).

        Raises:
            TaskDefinitionError: the file cannot be read or parsed, or anything in it is invalid.
        """
        source = str(path)
        try:
            text = Path(path).read_bytes()
            data = json.loads(text) if source.endswith(".json") else tomllib.loads(text.decode("utf-8"))
        except OSError as exc:
            raise TaskDefinitionError([f"{source}: cannot read the task file: {exc.strerror or exc}"]) from exc
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            kind = "JSON" if source.endswith(".json") else "TOML"
            raise TaskDefinitionError([f"{source}: invalid {kind}: {exc}"]) from exc
        return cls.from_dict(data, source=source)


class TaskOutcome(str, enum.Enum):
    """How a task ended."""

    SUCCEEDED = "succeeded"
    """COMPLETED: the output matched its schema and every acceptance check passed."""
    FAILED = "failed"
    """FAILED_TERMINAL (a check still failed after the repairs, an output that never matched, a
    provider's terminal error ...), or a run that completed without its checks passing."""
    INCOMPLETE = "incomplete"
    """A resumable stop (WAITING_HUMAN, PAUSED_BUDGET, INTERRUPTED, FAILED_RETRYABLE): resume it."""
    CANCELLED = "cancelled"


@frozen
class TaskResult:
    """What :meth:`fsm_agent.Agent.run_task` returns."""

    session_id: str
    outcome: TaskOutcome
    output: Any
    """The validated output once the task succeeded: the output schema's value, else the answer's
    text; ``None`` when it did not succeed."""
    answer: str
    """The final answer's text (also when the task did not succeed)."""
    checks: tuple[CheckResult, ...]
    """Each acceptance check's last result (from the stop's evidence)."""
    evidence: tuple[str, ...]
    """The stop's evidence references (the checks', a grader's response ids, ...)."""
    usage: Usage
    cost_usd: float | None
    """USD over the session; ``None`` when a call had no known price."""
    stop: RunStop
    detail: str
    """Why it ended so, in words."""
    run: RunResult
    """The whole run result (transcript, turns, tool calls ...)."""

    @property
    def ok(self) -> bool:
        """Whether the task succeeded."""
        return self.outcome is TaskOutcome.SUCCEEDED

    @classmethod
    def from_run(cls, result: RunResult, task: Task) -> TaskResult:
        """The task result of ``result``, a run of ``task``."""
        stop = result.stop
        last: dict[str, CheckResult] = {}
        for ref in stop.evidence_refs:
            c = CheckResult.from_evidence(ref)
            if c is not None:
                last[c.name] = c
        checks = tuple(last[c.name] for c in task.checks if c.name in last)
        detail = stop.detail
        if stop.reason is StopReason.COMPLETED:
            missing = [c.name for c in task.checks if c.name not in last or not last[c.name].ok]
            if missing:
                outcome = TaskOutcome.FAILED
                detail = (f"the run completed, but these acceptance checks did not pass: {', '.join(missing)} "
                          f"({stop.detail})")
            elif task.output_schema is not None and result.output_data is None:
                outcome, detail = TaskOutcome.FAILED, f"the run completed without a valid output ({stop.detail})"
            else:
                outcome = TaskOutcome.SUCCEEDED
        elif stop.reason is StopReason.CANCELLED:
            outcome = TaskOutcome.CANCELLED
        elif stop.reason is StopReason.FAILED_TERMINAL:
            outcome = TaskOutcome.FAILED
        else:
            outcome = TaskOutcome.INCOMPLETE
        output: Any = None
        if outcome is TaskOutcome.SUCCEEDED:
            output = result.output_data if task.output_schema is not None else result.output
        return cls(result.session_id, outcome, output, result.output, checks, tuple(stop.evidence_refs),
                   result.usage, result.cost_usd, stop, detail, result)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary: outcome, output, answer, checks, evidence, usage, cost, stop, detail."""
        from .types.codec import unstructure

        return {"session_id": self.session_id, "outcome": self.outcome.value, "output": self.output,
                "answer": self.answer, "checks": [{"name": c.name, "ok": c.ok, "reason": c.reason} for c in self.checks],
                "evidence": list(self.evidence), "usage": unstructure(self.usage), "cost_usd": self.cost_usd,
                "stop": unstructure(self.stop), "detail": self.detail, "turns": self.run.turns,
                "tool_calls": self.run.tool_calls}


def stored_task(metadata: Mapping[str, Any] | None) -> Task | None:
    """The task a session's metadata holds (:data:`TASK_DEFINITION_KEY`), or ``None``.

    Raises:
        TaskDefinitionError: the stored definition is no longer valid (or names a Python callable).
    """
    data = (metadata or {}).get(TASK_DEFINITION_KEY)
    if data is None:
        return None
    return Task.from_dict(data, source="the session's task")

