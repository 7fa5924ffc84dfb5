"""Typed reading of provider JSON: wrong types become a :class:`ProviderProtocolError` naming the path.

A provider that sends ``"choices": "oops"``, ``null`` where an object belongs or a number where a
string belongs gets a typed error such as::

    stream chunk: choices[0].delta.tool_calls[1].function.arguments: expected string, got number

never a ``TypeError``, ``KeyError`` or ``AttributeError`` from deep inside a parser. Each protocol
module declares the shapes it reads (:func:`obj`, :func:`list_of`, :func:`one_of`, :func:`tagged`
over the leaf types :data:`STR`, :data:`INT`, :data:`COUNT` ...) and checks every frame with
:func:`check` before reading it, so that the parser's own code may rely on the types. A shape names
only the keys the parser reads; other keys are not looked at. ``null`` stands for an absent key
wherever the parsers treat it so (the default), but not as an element of an array.

:func:`guard` is the last line of defence at each protocol boundary: a ``TypeError``,
``KeyError``, ``AttributeError``, ``IndexError``, ``ValueError`` or ``RecursionError`` that still
escapes a parser (a shape that misses a key the parser reads) becomes a
:class:`ProviderProtocolError` that names the frame, with the original chained as its cause.

The other direction, what fsm_agent sends: every protocol module puts the history into the shape its
wire accepts with :func:`fsm_agent.types.normalize_pairing`, and refuses what that cannot fix
without losing content with :func:`orphan_error` (an :class:`InvalidHistoryError`, raised before
anything is sent).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import InvalidHistoryError, ProviderError, ProviderProtocolError

__all__ = ["ANY", "ARRAY", "BOOL", "COUNT", "INT", "MAX_DEPTH", "NUM", "OBJECT", "STR", "STRAY", "Shape", "check",
           "guard", "json_type", "list_of", "obj", "one_of", "orphan_error", "stray_error", "tagged"]

MAX_DEPTH = 128
"""Deepest nesting of arrays and objects accepted in one frame. Real frames stay below 20; deeper
ones would break whatever stores or prints the response (orjson writes at most 254 levels)."""

_NAMES = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string",
          list: "array", dict: "object"}


def json_type(v: Any) -> str:
    """The JSON type name of a decoded value (``number`` for integers and floats alike)."""
    return _NAMES.get(type(v), type(v).__name__)


class _Mismatch(Exception):
    """Raised inside :meth:`Shape.check`; the path is collected (reversed) as it propagates out."""

    def __init__(self, expected: str, value: Any) -> None:
        super().__init__(expected)
        self.expected = expected
        self.value = value
        self.path: list[str | int] = []


class Shape:
    """What one JSON value must be. ``types`` are the Python types of its accepted non-null values."""

    name: str = "any value"
    types: frozenset[type] = frozenset()
    nullable: bool = True

    def check(self, v: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def not_null(self) -> Shape:
        """This shape, with ``null`` not accepted."""
        other = copy.copy(self)
        other.nullable = False
        return other


class _Leaf(Shape):
    def __init__(self, name: str, types: tuple[type, ...], nullable: bool = True) -> None:
        self.name = name
        self.types = frozenset(types)
        self.nullable = nullable

    def check(self, v: Any) -> None:
        if type(v) not in self.types and not (v is None and self.nullable):
            raise _Mismatch(self.name, v)


class _Any(Shape):
    name = "any value"
    types = frozenset(_NAMES)

    def check(self, v: Any) -> None:
        return None


class _Count(_Leaf):
    """A token count: a number from 0 to 2**53 (a negative or astronomic one would make costs nonsense)."""

    def check(self, v: Any) -> None:
        if v is None and self.nullable:
            return
        if type(v) not in self.types or not 0 <= v <= 2**53:
            raise _Mismatch(self.name, v)


STR: Shape = _Leaf("string", (str,))
INT: Shape = _Leaf("integer", (int,))
NUM: Shape = _Leaf("number", (int, float))
COUNT: Shape = _Count("a token count (a number from 0 to 2^53)", (int, float))
BOOL: Shape = _Leaf("boolean", (bool,))
OBJECT: Shape = _Leaf("object", (dict,))
"""An object whose contents are not looked at (kept as received)."""
ARRAY: Shape = _Leaf("array", (list,))
"""An array whose elements are not looked at (kept as received)."""
ANY: Shape = _Any()


_ABSENT = object()


class _Obj(Shape):
    types = frozenset((dict,))

    def __init__(self, fields: Mapping[str, Shape], nullable: bool, name: str = "object") -> None:
        self.fields = dict(fields)
        self.nullable = nullable
        self.name = name
        # (key, shape, the accepted types when the shape is a plain leaf, else None); a leaf whose
        # value has one of its types is accepted without a call: the common case, and fast
        self._plan = tuple((k, f, f.types | ({type(None)} if f.nullable else set())
                            if type(f) is _Leaf else None) for k, f in self.fields.items())
        self._by_key = {k: (f, leaf) for k, f, leaf in self._plan}

    def check(self, v: Any) -> None:
        if type(v) is not dict:
            if v is None and self.nullable:
                return
            raise _Mismatch(self.name, v)
        if len(v) < len(self._plan):  # walk the shorter of the value's keys and the shape's
            by_key = self._by_key
            for k, x in v.items():
                e = by_key.get(k)
                if e is None or (e[1] is not None and type(x) in e[1]):
                    continue
                try:
                    e[0].check(x)
                except _Mismatch as m:
                    m.path.append(k)
                    raise
            return
        get = v.get
        for k, s, leaf in self._plan:
            x = get(k, _ABSENT)
            if x is _ABSENT or (leaf is not None and type(x) in leaf):
                continue
            try:
                s.check(x)
            except _Mismatch as m:
                m.path.append(k)
                raise


class _List(Shape):
    types = frozenset((list,))
    name = "array"

    def __init__(self, item: Shape, nullable: bool) -> None:
        self.item = item
        self.nullable = nullable

    def check(self, v: Any) -> None:
        if type(v) is not list:
            if v is None and self.nullable:
                return
            raise _Mismatch("array", v)
        item = self.item
        for i, x in enumerate(v):
            if x is None:
                m = _Mismatch(item.name, x)  # null is no element
                m.path.append(i)
                raise m
            try:
                item.check(x)
            except _Mismatch as m:
                m.path.append(i)
                raise


class _OneOf(Shape):
    def __init__(self, shapes: tuple[Shape, ...], nullable: bool) -> None:
        self.shapes = shapes
        self.nullable = nullable
        self.name = " or ".join(s.name for s in shapes)
        self.types = frozenset().union(*(s.types for s in shapes))

    def check(self, v: Any) -> None:
        if v is None and self.nullable:
            return
        for s in self.shapes:
            if type(v) in s.types:
                s.check(v)
                return
        raise _Mismatch(self.name, v)


class _Tagged(Shape):
    types = frozenset((dict,))

    def __init__(self, key: str, cases: Mapping[str, Shape], default: Shape, missing: str | None,
                 nullable: bool) -> None:
        self.key = key
        self.cases = dict(cases)
        self.default = default
        self.missing = missing
        self.nullable = nullable
        self.name = "object"

    def check(self, v: Any) -> None:
        if type(v) is not dict:
            if v is None and self.nullable:
                return
            raise _Mismatch("object", v)
        tag = v.get(self.key)
        if tag is None and self.missing is not None:
            tag = self.missing
        if type(tag) is not str:
            m = _Mismatch("string", tag)
            m.path.append(self.key)
            raise m
        self.cases.get(tag, self.default).check(v)


def obj(**fields: Shape) -> Shape:
    """An object (or ``null``: :meth:`Shape.not_null` refuses it); the keys named are checked when
    present, others are not looked at."""
    return _Obj(fields, True)


def list_of(item: Shape, nullable: bool = True) -> Shape:
    """An array whose every element is ``item`` (never ``null``)."""
    return _List(item, nullable)


def one_of(*shapes: Shape, nullable: bool = True) -> Shape:
    """Any of ``shapes``, chosen by the value's JSON type (so their types must not overlap)."""
    return _OneOf(shapes, nullable)


def tagged(key: str, cases: Mapping[str, Shape], default: Shape | None = None, *, missing: str | None = None,
           nullable: bool = True) -> Shape:
    """An object whose shape depends on its string ``key`` (``type``): ``cases[tag]``, else ``default``.

    ``missing``: the tag assumed when the key is absent or ``null`` (otherwise that is an error)."""
    return _Tagged(key, cases, default or obj(), missing, nullable)


def _fmt(path: list[str | int]) -> str:
    out = ""
    for k in reversed(path):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out


def _too_deep(v: Any, limit: int) -> bool:
    stack = [(v, 1)]
    while stack:
        x, d = stack.pop()
        if d > limit:
            return True
        if type(x) is dict:
            stack.extend((c, d + 1) for c in x.values() if type(c) in (dict, list))
        else:
            stack.extend((c, d + 1) for c in x if type(c) in (dict, list))
    return False


def check(value: Any, shape: Shape, *, what: str, provider: str | None, raw: str | bytes | None = None) -> None:
    """Raise a :class:`ProviderProtocolError` when ``value`` (one decoded frame or body) is not ``shape``.

    The message names the frame (``what``: "stream chunk", "content_block_delta event" ...) and the
    path inside it: ``choices[0].delta.content: expected string, got number``.

    Args:
        raw: the frame's JSON text; frames with many brackets in it are also checked for nesting
            deeper than :data:`MAX_DEPTH`.
    """
    try:
        shape.check(value)
    except _Mismatch as m:
        path = _fmt(m.path)
        got = json_type(m.value)
        raise ProviderProtocolError(f"{what}: {path + ': ' if path else ''}expected {m.expected}, got {got}",
                                    provider=provider) from None
    if raw is not None and len(raw) > 2 * MAX_DEPTH and type(value) in (dict, list):
        brackets = raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes) else raw.count("[") + raw.count("{")
        if brackets > MAX_DEPTH and _too_deep(value, MAX_DEPTH):
            raise ProviderProtocolError(f"{what}: nested deeper than {MAX_DEPTH} levels", provider=provider)


STRAY = (TypeError, KeyError, AttributeError, IndexError, ValueError, RecursionError, OverflowError)
"""What a wrong-typed value makes Python code raise: the exceptions :func:`guard` types."""


def stray_error(exc: BaseException, what: str, provider: str | None) -> ProviderProtocolError:
    """The :class:`ProviderProtocolError` for a stray exception ``exc`` (one of :data:`STRAY`) raised
    while decoding the frame ``what``; raise it ``from exc``. For hot paths that inline
    :func:`guard` as ``try``/``except``."""
    return ProviderProtocolError(f"{what}: cannot be decoded ({type(exc).__name__}: {str(exc)[:200]})",
                                 provider=provider)


@contextlib.contextmanager
def guard(what: str, provider: str | None) -> Iterator[None]:
    """The last line of defence around one frame's decoding: an exception a wrong-typed value caused
    that the shapes did not catch becomes a :class:`ProviderProtocolError` naming ``what`` (the frame),
    chained to the original. :class:`ProviderError` passes unchanged."""
    try:
        yield
    except ProviderError:
        raise
    except STRAY as exc:
        raise stray_error(exc, what, provider) from exc


def orphan_error(messages: Any, orphans: list[int], provider: str | None) -> InvalidHistoryError:
    """The error for tool results that answer no earlier call (``orphans``: their indexes in
    ``messages``, as :func:`fsm_agent.types.normalize_pairing` returns them), raised before the
    request is sent: the protocol refuses them, and dropping them would lose what they say."""
    where = ", ".join(f"message {i} (tool_call_id {getattr(messages[i], 'tool_call_id', '?')!r})"
                      for i in orphans[:5])
    more = f" and {len(orphans) - 5} more" if len(orphans) > 5 else ""
    return InvalidHistoryError(
        f"invalid message history: the tool result at {where}{more} answers no earlier tool call, and "
        "the protocol refuses a result without its call. Give the assistant message with that call "
        "before it, or leave the result out (the repair middleware drops such results)",
        provider=provider)
