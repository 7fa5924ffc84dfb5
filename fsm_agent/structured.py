"""Structured output: check a model's answer against an :class:`~fsm_agent.types.OutputSchema`.

Seed 004 §6, "call the model → validate the structured output". A request that declares
``output_schema`` is sent in the provider's own JSON-Schema format where it has one, and
through the constrained mode or JSON mode where it does not (see
:mod:`fsm_agent.providers.structured_output`). Whatever came back is checked here:

* :func:`parse_output` finds the one JSON value in the answer and validates it. The error
  text says exactly what was wrong (``$.items[1].price: 'ten' is not of type 'number'
  (failed: type)``, or ``not JSON: ...``), written to be sent back to the model;
* :func:`repair_message` is the user message of the one repair turn;
* :func:`structured_call` does a single call, validates, repairs once, and raises
  :class:`~fsm_agent.errors.StructuredOutputError` when the answer is still wrong;
* while an answer streams, :class:`PartialOutput` reads it as far as it goes
  (:class:`~fsm_agent.types.partial_json.PartialJSON`) and :func:`validate_partial` checks the
  partial value as far as it goes; the runtime hands each one to the observers
  (:class:`~fsm_agent.types.OutputPartial`, ``on_output_partial``) and to
  :meth:`fsm_agent.Agent.stream_output` (:class:`OutputStream`).

    >>> from fsm_agent.providers.scripted import text_response
    >>> schema = OutputSchema("n", {"type": "object", "properties": {"n": {"type": "integer"}},
    ...                             "required": ["n"]})
    >>> parse_output(text_response('```json\\n{"n": 3}\\n```'), schema).value
    {'n': 3}
    >>> parse_output(text_response('{"n": "3"}'), schema).error
    "$.n: '3' is not of type 'integer' (failed: type)"
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import orjson
from attrs import evolve, frozen

from .errors import ConfigurationError, StructuredOutputError
from .types.content import TextBlock, ToolUseBlock
from .types.events import OutputPartial
from .types.messages import AssistantMessage, ModelStopReason, UserMessage
from .types.partial_json import PartialJSON
from .types.requests import MessageRequest, MessageResponse
from .types.stream import StreamEvent, TextDelta
from .types.structured import OutputSchema

if TYPE_CHECKING:
    from types import TracebackType

    from .providers.base import Provider
    from .types.run import RunResult

__all__ = ["OutputStream", "PartialOutput", "StructuredResult", "deliver_output", "output_listener", "parse_output",
           "repair_message", "structured_call", "validate_partial", "validate_value"]

MAX_ERRORS = 5
"""Validation errors listed in one error text; the rest are counted."""

MAX_DEPTH = 512
"""The deepest nesting of arrays and objects an answer may have; a deeper one is an error (a
model's answer never needs it, and decoding or checking it would exhaust the interpreter's stack)."""

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\r?\n(.*?)\r?\n?[ \t]*```", re.S)
_DECODER = json.JSONDecoder()
_VALIDATORS: dict[bytes, Any] = {}


@frozen
class StructuredResult:
    """The outcome of checking one answer.

    ``error is None`` means the answer matched and ``value`` is the decoded JSON value (which may
    itself be ``null``); otherwise ``value`` is ``None`` and ``error`` says what was wrong.
    """

    value: Any | None
    """The answer's JSON value, or ``None`` when it did not match."""
    error: str | None
    """What was wrong (the JSON path and the failed constraint, or ``not JSON: ...``), or ``None``."""
    raw: str
    """The answer as the model gave it (the text, or the answer tool's arguments)."""

    @property
    def ok(self) -> bool:
        """True when the answer matched the schema."""
        return self.error is None


def _validator(schema: dict[str, Any]) -> Any:
    key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    found = _VALIDATORS.get(key)
    if found is None:
        import jsonschema  # imported with the first structured answer, not with fsm_agent

        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ConfigurationError(f"invalid output JSON Schema: {exc.message}") from exc
        found = cls(schema)
        if len(_VALIDATORS) > 256:
            _VALIDATORS.clear()
        _VALIDATORS[key] = found
    return found


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _describe(error: Any) -> str:
    path = error.json_path
    return f"{path}: {_short(error.message)} (failed: {error.validator})"


def validate_value(value: Any, schema: OutputSchema) -> str | None:
    """``None`` when ``value`` matches ``schema``, else the error text: one line per failed
    constraint, in path order, at most :data:`MAX_ERRORS` lines (a value nested too deeply for the
    checker's stack is an error text too, not an exception).

    Raises:
        ConfigurationError: the schema itself is not valid JSON Schema.
    """
    return _error_text(value, schema)


def _error_text(value: Any, schema: OutputSchema, keep: Callable[[Any], bool] | None = None) -> str | None:
    """The schema's errors on ``value`` (those ``keep`` keeps, when given) as text, ``None`` for none:
    one line per failed constraint, in path order, at most :data:`MAX_ERRORS` lines."""
    try:
        errors = sorted((e for e in _validator(schema.schema).iter_errors(value) if keep is None or keep(e)),
                        key=lambda e: ([str(p) for p in e.absolute_path], str(e.validator)))
    except RecursionError:
        return "$: the value nests arrays or objects too deeply to be checked; give a flatter value"
    if not errors:
        return None
    lines = [_describe(e) for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        lines.append(f"... and {len(errors) - MAX_ERRORS} more")
    return "\n".join(lines)


def _top_level_values(text: str) -> list[tuple[int, int, Any]]:
    """Every complete JSON object or array in ``text`` that is not inside another, with its span."""
    found: list[tuple[int, int, Any]] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "{[":
            try:
                value, end = _DECODER.raw_decode(text, i)
            except ValueError:
                i += 1
                continue
            except RecursionError:
                raise _TooDeep() from None
            found.append((i, end, value))
            i = end
        else:
            i += 1
    return found


class _TooDeep(Exception):
    """The answer nests arrays or objects deeper than :data:`MAX_DEPTH` (or than the stack allows)."""


def _too_deep(text: str) -> bool:
    """More than :data:`MAX_DEPTH` brackets open at once (strings skipped): checked before any
    decoding, so that no decoder recurses that deep."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:  # the common case, at C speed
        return False
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif ch in "]}":
            depth = max(0, depth - 1)
    return False


def _extract(raw: str) -> tuple[Any, str | None]:
    """(value, None) for the one JSON value in ``raw``, or (None, why not)."""
    text = raw.strip()
    if _too_deep(text):
        return None, _DEEP
    try:
        return _extract_value(raw, text)
    except (_TooDeep, RecursionError):
        return None, _DEEP


_DEEP = (f"not JSON: the answer nests arrays or objects more than {MAX_DEPTH} levels deep; "
         "give a flatter JSON value")


def _extract_value(raw: str, text: str) -> tuple[Any, str | None]:
    try:
        return orjson.loads(text), None
    except orjson.JSONDecodeError as exc:
        first_error = str(exc)
    fenced = []
    for m in _FENCE.finditer(raw):
        if m.group(1).lower() not in ("", "json", "jsonc", "json5"):
            continue
        try:
            fenced.append(orjson.loads(m.group(2).strip()))
        except orjson.JSONDecodeError:
            continue
    if len(fenced) == 1:
        return fenced[0], None
    if len(fenced) > 1:
        return None, (f"ambiguous: the answer holds {len(fenced)} JSON code blocks; "
                      "give exactly one JSON value and nothing else")
    values = _top_level_values(text)
    if len(values) == 1:
        start, end, value = values[0]
        if not text[end:].strip():  # prose before the JSON only
            return value, None
        return None, (f"not JSON: there is text after the JSON value (from character {end}: "
                      f"{_short(text[end:].strip(), 60)!r}); give the JSON value and nothing else")
    if len(values) > 1:
        return None, (f"ambiguous: the answer holds {len(values)} separate JSON values; "
                      "give exactly one JSON value and nothing else")
    return None, f"not JSON: {first_error} (the answer begins {_short(text, 80)!r})"


def parse_output(response: MessageResponse, schema: OutputSchema) -> StructuredResult:
    """Find the answer's JSON value and check it against ``schema``.

    The answer is, in order: the input of a call to a tool named ``schema.name`` (the forced-tool
    form, when it was not already mapped back to text), or the response text. The text may be
    bare JSON, one JSON code block (```` ```json ````), or prose followed by exactly one JSON
    object or array. Anything else (no JSON, several values, text after the value, arrays and
    objects nested more than :data:`MAX_DEPTH` levels deep) is an error in the result, never an
    exception.

    Raises:
        ConfigurationError: ``schema.schema`` is not valid JSON Schema.
    """
    answer = next((b for b in response.message.content
                   if isinstance(b, ToolUseBlock) and b.name == schema.name), None)
    if answer is not None:
        if answer.raw_input is not None:
            return StructuredResult(None, f"not JSON: the arguments of {schema.name!r} are not a JSON object "
                                          f"({_short(answer.raw_input, 80)!r})", answer.raw_input)
        try:
            raw = orjson.dumps(answer.input).decode()
        except (orjson.JSONEncodeError, RecursionError):  # orjson refuses more than 255 levels
            return StructuredResult(None, _DEEP, "")  # not even repr() can show it
        if _too_deep(raw):
            return StructuredResult(None, _DEEP, raw)
        return StructuredResult(*_checked(answer.input, schema), raw)
    raw = response.text
    cut = response.stop_reason is ModelStopReason.MAX_TOKENS
    if not raw.strip():
        if response.refusal:
            why = f"the model refused: {_short(response.refusal, 200)}"
        elif response.tool_calls:
            names = ", ".join(sorted({c.name for c in response.tool_calls}))
            why = f"empty answer: the model called {names} instead of answering with JSON"
        else:
            why = "empty answer: expected one JSON value"
        if cut:
            why += " (the output token limit was reached)"
        return StructuredResult(None, why, raw)
    value, error = _extract(raw)
    if error is not None:
        if cut:
            error += " (the answer was cut off at the output token limit)"
        return StructuredResult(None, error, raw)
    return StructuredResult(*_checked(value, schema), raw)


def _checked(value: Any, schema: OutputSchema) -> tuple[Any, str | None]:
    error = validate_value(value, schema)
    return (value, None) if error is None else (None, error)


def repair_message(result: StructuredResult, schema: OutputSchema | None = None) -> str:
    """The text of the user message that asks the model to fix its answer.

    ``schema``, when given, is repeated in the message (useful when the server does not enforce it).
    """
    lines = ["Your previous answer does not match the required output format.",
             f"What is wrong: {result.error or 'nothing'}"]
    if schema is not None:
        lines.append(f"The required JSON Schema ({schema.name}): {orjson.dumps(schema.schema).decode()}")
    lines.append("Reply again with only the corrected JSON value: no prose, no code fences.")
    return "\n".join(lines)


async def structured_call(provider: Provider, request: MessageRequest, schema: OutputSchema, *,
                          repair: bool = True) -> StructuredResult:
    """One model call whose answer must match ``schema``; at most one repair call.

    The request is sent with ``output_schema=schema``. When the answer does not match and ``repair``
    is set, the model gets its answer back with :func:`repair_message` and answers once more.

    Returns:
        the matching result (``result.ok`` is always true).

    Raises:
        StructuredOutputError: the answer (after the repair call, when allowed) still does not match.
        ProviderError: a call failed (after the provider's own retries).
        ConfigurationError: ``schema.schema`` is not valid JSON Schema.
    """
    request = evolve(request, output_schema=schema)
    response = await provider.chat(request)
    result = parse_output(response, schema)
    if result.ok:
        return result
    if not repair:
        raise StructuredOutputError(schema.name, result.error or "", result.raw, 1, result=result, response=response)
    messages = list(request.messages)
    if result.raw.strip():
        messages.append(AssistantMessage((TextBlock(result.raw),)))
    messages.append(UserMessage(repair_message(result, schema)))
    response = await provider.chat(evolve(request, messages=tuple(messages)))
    result = parse_output(response, schema)
    if not result.ok:
        raise StructuredOutputError(schema.name, result.error or "", result.raw, 2, result=result, response=response)
    return result


# -- streamed structured output ----------------------------------------------------------------------

_OPEN_OK = frozenset({"required", "minItems", "minProperties", "contains", "minContains", "dependentRequired",
                      "dependencies", "const", "enum", "not", "uniqueItems"})
"""Constraints an open array or object may fail now and still meet once the rest of it has come
(members and items are only ever added)."""
_STRING_BAD = frozenset({"type", "maxLength"})
"""Constraints a string still being written fails for good (it only grows)."""


def validate_partial(value: Any, schema: OutputSchema, open_paths: Iterable[tuple[str | int, ...]] = (),
                     string_path: tuple[str | int, ...] | None = None) -> str | None:
    """Check a partial answer as far as it goes: ``None`` when ``value`` violates nothing the rest of
    the answer may still make right, else the error text (as :func:`validate_value` writes it).

    ``open_paths`` are the JSON paths (keys and indexes) of the arrays and objects still open, and
    ``string_path`` the path of the string still being written (both from
    :class:`~fsm_agent.types.partial_json.PartialJSON`); every other value in ``value`` is complete.
    Forgiven: on an open array or object, missing required members, too few items or members,
    ``contains``, ``enum``/``const``/``not``/``uniqueItems`` (more content may settle them), and an
    ``anyOf``/``oneOf`` one of whose branches is met that way; on the open string, every constraint
    but ``type`` and ``maxLength``, except that ``enum``/``const`` must still be reachable (the text
    is a prefix of an allowed value). A complete value is checked in full.

        >>> s = OutputSchema("c", {"type": "object", "required": ["name", "size"],
        ...     "properties": {"name": {"enum": ["Paris", "Lyon"]}, "size": {"type": "integer"}}})
        >>> validate_partial({"name": "Pa"}, s, [()], ("name",)) is None
        True
        >>> validate_partial({"name": "Pe"}, s, [()], ("name",))
        "$.name: 'Pe' is not one of ['Paris', 'Lyon'] (failed: enum)"
        >>> validate_partial({"name": "Paris", "size": "big"}, s, [()])
        "$.size: 'big' is not of type 'integer' (failed: type)"

    Raises:
        ConfigurationError: the schema itself is not valid JSON Schema.
    """
    opened = set(map(tuple, open_paths))
    if string_path is not None:
        string_path = tuple(string_path)
        opened.add(string_path)
    return _error_text(value, schema, lambda e: not _forgiven(e, opened, string_path))


def _forgiven(error: Any, opened: set[tuple[Any, ...]], string_path: tuple[Any, ...] | None) -> bool:
    """Whether the rest of the answer may still make ``error`` right."""
    path = tuple(error.absolute_path)
    if path not in opened:
        return False  # a complete value: checked in full
    kind = error.validator
    if kind in ("anyOf", "oneOf"):
        if not error.context:
            return True  # oneOf: more than one branch fits so far
        branches: dict[Any, list[Any]] = {}
        for sub in error.context:
            branches.setdefault(sub.relative_schema_path[0], []).append(sub)
        return any(all(_forgiven(sub, opened, string_path) for sub in subs) for subs in branches.values())
    if path == string_path and isinstance(error.instance, str):
        if kind in _STRING_BAD:
            return False
        if kind == "enum":
            return any(isinstance(v, str) and v.startswith(error.instance) for v in error.validator_value)
        if kind == "const":
            return isinstance(error.validator_value, str) and error.validator_value.startswith(error.instance)
        return True  # minLength, pattern, format ...: the rest of the string may meet them
    return kind in _OPEN_OK


class PartialOutput:
    """One model call's structured answer as it streams: fed the call's stream events
    (:meth:`feed`), it gives an :class:`~fsm_agent.types.OutputPartial` each time the answer's JSON
    value grows, checked by :func:`validate_partial`.

    The answer is the text of the call's text deltas (an answer tool or the constrained mode hands
    over the whole answer as one text delta at the end). Once the text stops being JSON, one event
    says so (``error`` ``not JSON ...``, ``value`` the last value read) and no more follow; the
    final check (:func:`parse_output`, at PostTurn) decides in any case.
    """

    __slots__ = ("schema", "session_id", "turn", "_parser", "_chars", "_failed")

    def __init__(self, schema: OutputSchema, session_id: str, turn: int) -> None:
        self.schema = schema
        self.session_id = session_id
        self.turn = turn
        self._parser = PartialJSON(max_depth=MAX_DEPTH)
        self._chars = 0
        self._failed = False

    def reset(self) -> None:
        """The answer starts over (the provider retried the call after part of it had streamed)."""
        self._parser = PartialJSON(max_depth=MAX_DEPTH)
        self._chars = 0
        self._failed = False

    def feed(self, event: StreamEvent) -> OutputPartial | None:
        """Read one stream event; the partial answer when it grew, else ``None``."""
        if not isinstance(event, TextDelta) or self._failed:
            return None
        self._chars += len(event.text)
        parser = self._parser
        if not parser.feed(event.text):
            if parser.error is None:
                return None
            self._failed = True
            return OutputPartial(self.session_id, self.turn, self.schema.name, parser.snapshot(), parser.error,
                                 chars=self._chars)
        value = parser.snapshot()
        error = validate_partial(value, self.schema, parser.open_paths(), parser.string_path())
        return OutputPartial(self.session_id, self.turn, self.schema.name, value, error, chars=self._chars)


_LISTENERS: contextvars.ContextVar[tuple[tuple[str, Callable[[OutputPartial], None]], ...]] = \
    contextvars.ContextVar("fsm_agent_output_listeners", default=())
"""(session id, callback) of the :class:`OutputStream` s listening in this context."""


def output_listener(session_id: str) -> Callable[[OutputPartial], None] | None:
    """The callback of the :class:`OutputStream` listening to ``session_id`` in this context (the
    run's task inherits it from the one that started it), or ``None``."""
    for sid, callback in _LISTENERS.get():
        if sid == session_id:
            return callback
    return None


_END: Any = object()


class OutputStream:
    """What :meth:`fsm_agent.Agent.stream_output` returns: the run's structured answer as it streams.

    An async iterator of :class:`~fsm_agent.types.OutputPartial`: the partial values of each
    answer as it streams (``error`` set on one that is already wrong), then the answer the final
    check accepted (``validated=True``, the value ``result.output_data`` holds). The run starts at
    the first ``__anext__`` (or ``__aenter__``) and goes on while you read; :attr:`result` is its
    :class:`~fsm_agent.RunResult` once the iteration ended. A run that ends without a valid answer
    (``structured_output_invalid``, a budget, a failure) ends the iteration with no validated event:
    read ``result.stop``. Use it as ``async with`` (leaving the block early cancels the run: it
    stops INTERRUPTED) or read it to the end.

    Raises (from ``__anext__``): what :meth:`fsm_agent.Agent.run` raises (a bad limit, a session
    that exists ...).
    """

    def __init__(self, session_id: str, start: Callable[[], Awaitable[RunResult]]) -> None:
        self.session_id = session_id
        """The run's session."""
        self._start = start
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task[RunResult] | None = None
        self._result: RunResult | None = None

    @property
    def result(self) -> RunResult:
        """The run's result.

        Raises:
            RuntimeError: the run has not ended yet (read the stream to its end first)."""
        if self._result is None:
            raise RuntimeError("the run has not ended yet: read the output stream to its end first")
        return self._result

    def _begin(self) -> None:
        token = _LISTENERS.set((*_LISTENERS.get(), (self.session_id, self._queue.put_nowait)))
        try:
            self._task = asyncio.ensure_future(self._start())
        finally:
            _LISTENERS.reset(token)
        self._task.add_done_callback(lambda _: self._queue.put_nowait(_END))

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> OutputPartial:
        if self._task is None:
            self._begin()
        if self._result is not None:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            assert self._task is not None
            self._result = self._task.result()  # raises what the run raised
            raise StopAsyncIteration
        return item  # type: ignore[no-any-return]

    async def __aenter__(self) -> OutputStream:
        if self._task is None:
            self._begin()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel the run if it is still going (it stops INTERRUPTED) and wait for it to end."""
        task = self._task
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task})  # the run records INTERRUPTED; our own cancellation still raises here
        if not task.cancelled() and task.exception() is None:  # a failure after the cancel is not news
            self._result = task.result()


async def deliver_output(bus: Any, event: OutputPartial | None) -> None:
    """Hand ``event`` (none: nothing) to the observers that want it (``bus``: the run's
    :class:`~fsm_agent.hooks.HookBus`) and to the :class:`OutputStream` of its session."""
    if event is None:
        return
    if bus.wants(OutputPartial):
        await bus.emit(event)
    listener = output_listener(event.session_id)
    if listener is not None:
        listener(event)
