"""Tools: typed Python functions the model can call.

``@tool`` turns a function (sync or async) into a :class:`Tool` whose JSON
Schema (draft 2020-12) comes from the signature and whose descriptions come
from the docstring (Google ``Args:`` or reST ``:param x:`` style). Arguments are
validated against that schema (``jsonschema``) before every call.

Supported annotations: ``str``, ``int``, ``float``, ``bool``, ``None``,
``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, ``X | None`` / ``Optional``,
``Union``, ``Literal[...]``, ``Enum`` subclasses, ``Any``, and ``TypedDict`` /
attrs classes (as nested objects). Anything else is a
:class:`~fsm_agent.errors.ToolDefinitionError` at decoration time.

A parameter annotated with :class:`ToolContext` is not shown to the model; the
runtime passes the call's context (idempotency key, session id) there.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, Protocol, Union, get_args, get_origin

import attrs
from attrs import field, frozen

from ..control import Decision
from ..errors import ConfigurationError, ToolArgumentsError, ToolDefinitionError
from ..types._schema import UnresolvedRef, check_refs, offline_validator
from ..types.messages import Usage
from ..types.requests import ToolDefinition

__all__ = ["RUN_AGAIN", "Tool", "ToolContext", "ToolEffect", "ToolRegistry", "ToolSink", "tool"]

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
DEFAULT_TOOL_TIMEOUT = 600.0
"""Seconds; seed 000 §5.1.2 ``tool_timeout_secs``."""


class _RunAgain:
    """Returned by a reconcile hook: the interrupted call did not take effect; run it again."""

    def __repr__(self) -> str:
        return "RUN_AGAIN"


RUN_AGAIN = _RunAgain()
"""What a reconcile hook returns when the call it was asked about did not happen."""


class ToolEffect(str, enum.Enum):
    """What running a tool does to the world; decides what a resume may repeat.

    ``pure``: no effect, safe to repeat. ``idempotent``: repeating with the same
    idempotency key has no further effect. ``side_effect``: repeating may do it
    twice; never re-run silently.
    """

    PURE = "pure"
    IDEMPOTENT = "idempotent"
    SIDE_EFFECT = "side_effect"


class ToolSink(Protocol):
    """Where a running tool's reports go (the driver gives one; see :class:`ToolContext`).
    ``progress`` and ``usage`` may be called from any thread; ``budget_left`` from the run's event
    loop. None of them raises."""

    def progress(self, ctx: ToolContext, progress: float, total: float | None, message: str | None) -> None: ...

    def usage(self, ctx: ToolContext, usage: Usage, cost_usd: float | None, child_session_id: str | None) -> None: ...

    def budget_left(self) -> dict[str, float]: ...


@frozen
class ToolContext:
    """Passed to a tool parameter annotated ``ToolContext``; hidden from the model."""

    call_id: str
    """The model's tool-call id."""
    idempotency_key: str
    """Stable across resumes of the same call: use it to make side effects happen once."""
    session_id: str
    turn: int
    tool_name: str
    sink: ToolSink | None = field(default=None, eq=False, repr=False)
    """Where :meth:`report_progress` and :meth:`add_usage` go (the run's driver); ``None``: nowhere."""
    decision: Decision | None = None
    """The person's decision on this call given at a resume, or ``None`` when no person decided it:
    ``approve`` or ``edit`` for a call that waited for approval; any kind (``approve``, ``reject``
    and ``respond`` with their message, ``edit``) for a call whose tool raised
    :class:`~fsm_agent.errors.WaitForHuman`: the person's answer to the tool's question."""

    def report_progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        """Tell observers and the session log how far the call is (a
        :class:`~fsm_agent.types.events.ToolProgress` event). Thread-safe; never raises."""
        if self.sink is not None:
            self.sink.progress(self, float(progress), None if total is None else float(total), message)

    def add_usage(self, usage: Usage, cost_usd: float | None, *, child_session_id: str | None = None) -> None:
        """Add model usage this call caused elsewhere (a sub-agent's session) to the run's usage and cost
        (a :class:`~fsm_agent.types.events.UsageRolledUp` event); the run's token and cost budgets
        count it from then on. ``cost_usd`` ``None``: unknown, which makes the run's cost unknown.
        Thread-safe; never raises."""
        if self.sink is not None:
            self.sink.usage(self, usage, cost_usd, child_session_id)

    def budget_left(self) -> dict[str, float]:
        """What is left of the run's token and cost budgets now, as :class:`~fsm_agent.RunConfig`
        fields: ``{"max_tokens": tokens, "max_cost_usd": USD}``, each only when the run has that
        budget (and, for cost, when its cost so far is known); may be zero or negative when the
        budget is used up. Empty outside a run. Call it from the run's event loop (an async tool)."""
        return self.sink.budget_left() if self.sink is not None else {}


_DOC_ARGS = re.compile(r"^\s*(Args|Arguments|Parameters|Params)\s*:\s*$", re.I)
_DOC_SECTION = re.compile(r"^\s*(Returns?|Raises|Yields|Examples?|Notes?|See Also)\s*:?\s*$", re.I)
_DOC_PARAM_GOOGLE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_DOC_PARAM_REST = re.compile(r"^\s*:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(summary, {param: description}) from a Google- or reST-style docstring."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    params: dict[str, str] = {}
    mode = "summary"
    current: str | None = None
    for line in lines:
        m = _DOC_PARAM_REST.match(line)
        if m:
            current = m.group(1)
            params[current] = m.group(2).strip()
            mode = "rest"
            continue
        if _DOC_ARGS.match(line):
            mode, current = "args", None
            continue
        if _DOC_SECTION.match(line) or line.strip().startswith(":return") or line.strip().startswith(":raises"):
            mode, current = "other", None
            continue
        if mode == "summary":
            summary.append(line)
        elif mode in ("args", "rest"):
            m = _DOC_PARAM_GOOGLE.match(line) if mode == "args" else None
            indent = len(line) - len(line.lstrip())
            if m and indent <= 4 and mode == "args":
                current = m.group(1).lstrip("*")
                params[current] = m.group(2).strip()
            elif current and line.strip():
                params[current] = (params[current] + " " + line.strip()).strip()
    text = "\n".join(summary).strip()
    return text, params


def _schema(tp: Any, where: str) -> dict[str, Any]:
    if tp is inspect.Parameter.empty or tp is Any:
        return {}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is None or tp is type(None):
        return {"type": "null"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    origin = get_origin(tp)
    args = get_args(tp)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (Union, types.UnionType):
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) == 1 and len(args) == 2:
            inner = _schema(non_null[0], where)
            if "type" in inner and isinstance(inner["type"], str):
                return {**inner, "type": [inner["type"], "null"]}
            return {"anyOf": [inner, {"type": "null"}]}
        return {"anyOf": [_schema(a, where) for a in args]}
    if origin in (list, tuple, set, frozenset, Iterable) or tp in (list, tuple, set):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return {"type": "array", "prefixItems": [_schema(a, where) for a in args],
                    "minItems": len(args), "maxItems": len(args)}
        item = args[0] if args else Any
        s: dict[str, Any] = {"type": "array"}
        inner = _schema(item, where)
        if inner:
            s["items"] = inner
        return s
    if origin in (dict, Mapping) or tp is dict:
        s = {"type": "object"}
        if len(args) == 2 and args[1] is not Any:
            s["additionalProperties"] = _schema(args[1], where)
        return s
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        required = sorted(getattr(tp, "__required_keys__", hints.keys()))
        return {"type": "object", "properties": {k: _schema(v, where) for k, v in hints.items()},
                "required": required, "additionalProperties": False}
    if attrs.has(tp):
        hints = typing.get_type_hints(tp)
        props = {a.name: _schema(hints.get(a.name, Any), where) for a in attrs.fields(tp)}
        req = [a.name for a in attrs.fields(tp) if a.default is attrs.NOTHING]
        return {"type": "object", "properties": props, "required": req, "additionalProperties": False}
    raise ToolDefinitionError(f"{where}: unsupported annotation {tp!r} (use str, int, float, bool, list, dict, "
                              "Literal, Enum, Optional, TypedDict or an attrs class)")


def _validator(parameters: dict[str, Any], where: str) -> Any:
    """A jsonschema validator of ``parameters`` (its ``$schema`` dialect, else draft 2020-12) that
    never fetches a document: references resolve within the schema and the dialects' own
    meta-schemas only, and each one is resolved here, so a bad reference is a definition error,
    never a failure at call time.

    Raises:
        ToolDefinitionError: not a valid JSON Schema; a reference that does not resolve.
    """
    import jsonschema  # imported with the first tool, not with fsm_agent

    try:
        cls = jsonschema.validators.validator_for(parameters, default=jsonschema.Draft202012Validator)
        cls.check_schema(parameters)
        check_refs(parameters)
    except jsonschema.SchemaError as exc:
        raise ToolDefinitionError(f"{where}: invalid JSON Schema: {exc.message}") from exc
    except UnresolvedRef as exc:
        raise ToolDefinitionError(f"{where}: {exc}") from exc
    except RecursionError as exc:
        raise ToolDefinitionError(f"{where}: the JSON Schema is nested too deeply to be checked") from exc
    return offline_validator(cls, parameters)


_PLAIN_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "deprecated", "readOnly", "writeOnly",
                          "$comment"})


def _fast_checker(schema: Any) -> Callable[[Mapping[str, Any]], bool] | None:
    """A quick sufficient check for the common tool schema (an object of named properties of plain
    types, some required, no others allowed): ``True`` means valid; ``False`` means "ask jsonschema"
    (which also words the errors). ``None`` when the schema uses anything else."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return None
    if set(schema) - {"type", "properties", "required", "additionalProperties"} - _ANNOTATIONS:
        return None
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    extra = schema.get("additionalProperties", True)
    if not isinstance(props, dict) or not isinstance(required, list) or not isinstance(extra, bool):
        return None
    checks: dict[str, Callable[[Any], bool] | None] = {}
    for name, sub in props.items():
        if not isinstance(sub, dict) or set(sub) - {"type", "enum"} - _ANNOTATIONS:
            return None
        t = sub.get("type")
        types = [t] if isinstance(t, str) else t if isinstance(t, list) and t else None
        if types is None and t is not None or types is not None and not all(x in _PLAIN_TYPES for x in types):
            return None
        if "enum" in sub:
            return None
        tests = [_PLAIN_TYPES[x] for x in types] if types is not None else None
        checks[name] = None if tests is None else (tests[0] if len(tests) == 1 else
                                                   lambda v, tests=tests: any(f(v) for f in tests))
    req = tuple(str(r) for r in required)

    def check(arguments: Mapping[str, Any]) -> bool:
        if not isinstance(arguments, dict):
            return False
        for r in req:
            if r not in arguments:
                return False
        for k, v in arguments.items():
            test = checks.get(k, _MISSING)
            if test is _MISSING:
                if not extra:
                    return False
            elif test is not None and not test(v):
                return False
        return True

    return check


_MISSING: Any = object()


class Tool:
    """A callable tool: definition (name, description, schema), the function, timeout and effect.

    Calling is done by the runtime (:mod:`fsm_agent.tools.execution`); :meth:`validate`
    checks arguments against the schema first.
    """

    __slots__ = ("name", "description", "parameters", "fn", "is_async", "timeout", "effect", "blocking",
                 "_validator", "_fast_check", "_definition", "_context_param", "_param_names", "reconcile", "compensate",
                 "strict", "resumable")

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        parameters: dict[str, Any] | None = None,
        timeout: float | None = DEFAULT_TOOL_TIMEOUT,
        effect: ToolEffect | str = ToolEffect.PURE,
        strict: bool | None = None,
        blocking: bool = True,
        resumable: bool = False,
    ) -> None:
        self.fn = fn
        self.blocking = blocking
        self.resumable = resumable
        """An Interrupt that cuts a call of this tool in flight leaves the call open (ledger
        ``started``) instead of closing it "outcome unknown": the resumed run runs it again with the
        same idempotency key, and the tool carries on with the work it had begun (a sub-agent resumes
        its session). For tools whose second run continues the first, never repeats it: ``idempotent``
        ones, or ``side_effect`` ones with an ``on_reconcile`` hook. A Cancel still closes the call."""
        self.name = fn.__name__ if name is None else name
        if not _NAME.match(self.name):
            raise ToolDefinitionError(f"tool name {self.name!r} must match {_NAME.pattern}")
        summary, param_docs = parse_docstring(fn.__doc__)
        self.description = description if description is not None else summary
        self.is_async = inspect.iscoroutinefunction(fn)
        self.timeout = timeout
        self.effect = ToolEffect(effect)
        self.strict = strict
        self.reconcile: Callable[..., Any] | None = None
        self.compensate: Callable[..., Any] | None = None
        self._context_param: str | None = None
        if parameters is None:
            parameters = self._schema_from_signature(fn, param_docs)
        else:
            self._param_names = tuple((parameters.get("properties") or {}).keys())
            sig = inspect.signature(fn)
            for p in sig.parameters.values():
                if p.annotation is ToolContext or p.annotation == "ToolContext":
                    self._context_param = p.name
        self.parameters = parameters
        self._validator = _validator(parameters, f"tool {self.name!r}")
        self._fast_check = _fast_checker(parameters)
        self._definition: tuple[tuple[Any, ...], ToolDefinition] | None = None

    def _schema_from_signature(self, fn: Callable[..., Any], docs: dict[str, str]) -> dict[str, Any]:
        sig = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception as exc:  # noqa: BLE001 - name the tool in the error
            raise ToolDefinitionError(f"tool {self.name!r}: cannot resolve annotations: {exc}") from exc
        props: dict[str, Any] = {}
        required: list[str] = []
        names = []
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ToolDefinitionError(f"tool {self.name!r}: *args/**kwargs cannot be described to a model")
            tp = hints.get(p.name, p.annotation)
            if tp is ToolContext:
                self._context_param = p.name
                continue
            s = _schema(tp, f"tool {self.name!r} parameter {p.name!r}")
            if p.name in docs:
                s = {**s, "description": docs[p.name]}
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
            elif p.default is not None and isinstance(p.default, (str, int, float, bool)):
                s = {**s, "default": p.default.value if isinstance(p.default, enum.Enum) else p.default}
            props[p.name] = s
            names.append(p.name)
        self._param_names = tuple(names)
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    @property
    def definition(self) -> ToolDefinition:
        """What the model sees (one frozen value while the tool's fields stay as they are: the
        runtime converts it once per run, not once per turn)."""
        key = (self.name, self.description, id(self.parameters), self.strict)
        cached = self._definition
        if cached is None or cached[0] != key:
            cached = self._definition = (key, ToolDefinition(self.name, self.description, self.parameters, self.strict))
        return cached[1]

    def validate(self, arguments: Mapping[str, Any]) -> None:
        """Check ``arguments`` against the schema.

        Raises:
            ToolArgumentsError: every violation, with its JSON path, in one message; or the schema
                cannot be evaluated for these arguments (a ``$ref`` cycle that never ends).
        """
        fast = self._fast_check
        if fast is not None and fast(arguments):
            return  # a flat schema of plain types, and these arguments meet it: no need for jsonschema
        try:
            errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.path))
        except Exception as exc:  # noqa: BLE001 - a schema that cannot be evaluated (a $ref cycle ...)
            raise ToolArgumentsError(f"the arguments of tool {self.name!r} could not be checked: its JSON Schema "
                                     f"cannot be evaluated ({type(exc).__name__}: {str(exc)[:200]}); the tool "
                                     "cannot be called") from exc
        if errors:
            parts = []
            for e in errors[:5]:
                path = "/".join(str(x) for x in e.absolute_path) or "(root)"
                parts.append(f"{path}: {e.message}")
            raise ToolArgumentsError(f"invalid arguments for tool {self.name!r}: " + "; ".join(parts))

    def bind(self, arguments: Mapping[str, Any], context: ToolContext | None) -> dict[str, Any]:
        kwargs = dict(arguments)
        if self._context_param is not None and context is not None:
            kwargs[self._context_param] = context
        return kwargs

    def on_reconcile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: ``fn(arguments, context)`` decides the outcome of a side-effect call found started
        but unfinished after a crash. Return the call's result if it took effect, :data:`RUN_AGAIN` if
        it did not (it then runs once more), or ``None`` if it cannot tell (a person is asked).
        ``context.idempotency_key`` is the key the interrupted attempt was given. May be async."""
        self.reconcile = fn
        return fn

    def on_compensate(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: ``fn(arguments, result, context)`` undoes a call when the run is cancelled: a
        completed call, or one cut in flight (``result`` is then the "outcome unknown" result, or
        ``None``). Called for ``side_effect`` tools, and for any other tool that has a hook. Return
        ``False`` when nothing could be undone (the ledger entry stays as it was; for a
        ``side_effect`` call a person is then asked to confirm the cancel); anything else means it
        was undone (the ledger says ``rejected``). May be async."""
        self.compensate = fn
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool(name={self.name!r}, effect={self.effect.value!r}, timeout={self.timeout!r})"


@typing.overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@typing.overload
def tool(
    *, name: str | None = None, description: str | None = None, timeout: float | None = DEFAULT_TOOL_TIMEOUT,
    effect: ToolEffect | str = ToolEffect.PURE, strict: bool | None = None, blocking: bool = True,
    resumable: bool = False,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = DEFAULT_TOOL_TIMEOUT,
    effect: ToolEffect | str = ToolEffect.PURE,
    strict: bool | None = None,
    blocking: bool = True,
    resumable: bool = False,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a tool of a typed function; usable bare (``@tool``) or with options.

    Args:
        name: tool name (default: the function's name).
        description: what the model reads (default: the docstring's summary).
        timeout: seconds one call may take (default 600, seed 000); ``None``: no limit.
        effect: ``pure`` (default), ``idempotent`` or ``side_effect``.
        blocking: for a plain ``def`` tool, run it in a worker thread (default) so it cannot stall the
            event loop; ``False`` runs it inline, for quick CPU-only tools (no thread hop, ~0.1 ms less).
        resumable: an Interrupt mid-call leaves the call open, to run again (same idempotency key)
            when the run is resumed (:attr:`Tool.resumable`).

    Raises:
        ToolDefinitionError: an annotation has no JSON Schema, or the name is invalid.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, description=description, timeout=timeout, effect=effect, strict=strict,
                    blocking=blocking, resumable=resumable)

    return wrap(fn) if fn is not None else wrap


class ToolRegistry:
    """Tools by unique name, in registration order."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, t: Tool | Callable[..., Any]) -> Tool:
        """Register ``t`` (a plain function is wrapped with :func:`tool`).

        Raises:
            ConfigurationError: another tool has the same name.
        """
        if not isinstance(t, Tool):
            t = tool(t)
        if t.name in self._tools:
            raise ConfigurationError(f"two tools are named {t.name!r}; tool names must be unique")
        self._tools[t.name] = t
        return t

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> typing.Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def definitions(self, names: Iterable[str] | None = None) -> tuple[ToolDefinition, ...]:
        """Definitions of all tools, or of ``names`` only (in registration order)."""
        if names is None:
            return tuple(t.definition for t in self._tools.values())
        wanted = set(names)
        return tuple(t.definition for t in self._tools.values() if t.name in wanted)
