"""Hostile frames: the JSON of every corpus body with the types of its fields mutated.

Shared by the property test (``tests/providers/test_hostile_frames.py``, hypothesis) and
``bench/fuzz_frames.py`` (100,000 frames from a seeded ``random.Random``).

* :func:`corpus_frames` — the frames: the JSON object of each ``data:`` event of every recorded
  stream (with its position in the stream) and the JSON of every non-stream body (successes and
  error bodies), per protocol.
* :func:`mutate` — one type mutation at a path of a frame: the value replaced by one of another
  JSON type (deeply nested containers included), a key deleted, an object nulled out.
* :func:`run_stream` / :func:`run_body` — feed a frame through the protocol's real parser (the
  stream parser, in its stream, then ``finish``; or ``HttpProvider.decode_body`` for a body, and
  ``classify_error`` for an error body) and say what came out: ``"ok"``, a ``ProviderError``
  subclass name, or ``"UNTYPED <exception>"``. A normal result must also serialize (what a session
  store and ``fsm-agent decode`` do with it).
* :func:`time_limit` — bounds one case (SIGALRM; a hang raises :class:`Hang`).
"""

from __future__ import annotations

import contextlib
import random
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

import corpus
from fsm_agent.errors import ProviderError
from fsm_agent.providers.base import HttpProvider
from fsm_agent.providers.decode import decoder_for, looks_like_sse
from fsm_agent.providers.errors import classify_error
from fsm_agent.providers.sse import SSEDecoder, ServerSentEvent
from fsm_agent.types.codec import unstructure
from fsm_agent.types.stream import MessageComplete

PROTOCOLS = ("openai-chat", "openai-responses", "anthropic")


@dataclass
class StreamBody:
    protocol: str
    id: str
    events: list[ServerSentEvent]
    frames: list[int] = field(default_factory=list)
    """Positions in ``events`` whose data is a JSON object."""


@dataclass
class JsonBody:
    protocol: str
    id: str
    status: int
    obj: Any


@dataclass
class Frames:
    streams: list[StreamBody]
    bodies: list[JsonBody]

    def count(self, protocol: str) -> tuple[int, int]:
        return (sum(len(s.frames) for s in self.streams if s.protocol == protocol),
                sum(1 for b in self.bodies if b.protocol == protocol))


def corpus_frames() -> Frames:
    streams: list[StreamBody] = []
    bodies: list[JsonBody] = []
    for b in corpus.bodies():
        if b.status == 200 and looks_like_sse(b.data):
            dec = SSEDecoder()
            events = dec.feed(b.data) + dec.flush()
            s = StreamBody(b.protocol, b.id, events)
            for i, ev in enumerate(events):
                try:
                    obj = orjson.loads(ev.data)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    s.frames.append(i)
            if s.frames:
                streams.append(s)
        else:
            try:
                obj = orjson.loads(b.data)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, (dict, list)):
                bodies.append(JsonBody(b.protocol, b.id, b.status, obj))
    return Frames(streams, bodies)


# ------------------------------------------------------------------------------ mutation
def _deep(kind: str, depth: int) -> str:
    return '[' * depth + '"x"' + ']' * depth if kind == "list" else '{"a":' * depth + '"x"' + '}' * depth


DEEP = {f"@@deep{i}@@": _deep(kind, n) for i, (kind, n) in
        enumerate([("list", 300), ("object", 300), ("list", 1000), ("object", 1000), ("object", 40)])}
"""Containers nested deeper than orjson writes (254) and Python recurses (1000), as JSON text: the
mutated frame holds the marker string, replaced by the text in :func:`dumps`."""


VALUES: dict[str, list[Any]] = {
    "null": [None],
    "bool": [True, False],
    "int": [0, 1, -1, 7, 2**31, 2**63 - 1, -(2**63)],
    "float": [0.5, -1.5, 1e308, 3.0],
    "string": ["", "oops", "0", "{}", "x" * 5000, "\u0000\ud7ff\U0001f600"],
    "list": [[], [1], ["a"], [{}], [None], [[]], [{"type": "oops"}]],
    "object": [{}, {"a": 1}, {"type": "oops"}, {"index": "0"}, {"text": 5}],
    "deep": list(DEEP),
}


def json_type(v: Any) -> str:
    if isinstance(v, str) and v in DEEP:
        return "deep nesting"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "list"
    return "object"


def paths(obj: Any, limit: int = 4000) -> list[tuple[Any, ...]]:
    """Every path into ``obj`` (keys and list indexes), the root ``()`` included."""
    out: list[tuple[Any, ...]] = [()]
    stack: list[tuple[tuple[Any, ...], Any]] = [((), obj)]
    while stack and len(out) < limit:
        p, v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, child in items:
            q = (*p, k)
            out.append(q)
            if isinstance(child, (dict, list)):
                stack.append((q, child))
    return out


def _copy_along(obj: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    """A copy of ``obj`` whose containers along ``path`` are new (the rest shared), and the parent
    container of the last step in the copy."""
    root = obj.copy() if isinstance(obj, (dict, list)) else obj
    cur = root
    for k in path[:-1]:
        nxt = cur[k]
        nxt = nxt.copy()
        cur[k] = nxt
        cur = nxt
    return root, cur


OPS = ("retype", "retype", "retype", "delete", "null", "deep", "empty")


def mutate(obj: Any, rng: random.Random | None, path: tuple[Any, ...] | None = None,
           op: str | None = None, value: Any = ...) -> tuple[Any, str]:
    """``obj`` with one mutation, and a description of it (``"retype choices[0].delta: object -> number"``).

    ``path``, ``op`` (one of :data:`OPS`) and ``value`` (for ``retype``, ``deep`` and ``empty``) are
    drawn from ``rng`` when not given. At the root (``()``) every op replaces the whole frame."""
    if path is None:
        assert rng is not None
        ps = paths(obj)
        path = ps[0] if len(ps) == 1 else rng.choice(ps[1:]) if rng.random() > 0.02 else ()
    if op is None:
        assert rng is not None
        op = rng.choice(OPS)
    old = _at(obj, path)
    if op in ("null", "delete"):
        value = None
    elif value is ...:
        assert rng is not None
        if op == "deep":
            value = rng.choice(VALUES["deep"])
        elif op == "empty":
            value = rng.choice(["", [], {}, 0])
        else:
            types = [t for t in VALUES if t not in ("deep", json_type(old))]
            value = rng.choice(VALUES[rng.choice(types)])
    where = _fmt(path)
    if not path:
        return value, f"{op} root: {json_type(old)} -> {json_type(value)}"
    root, parent = _copy_along(obj, path)
    key = path[-1]
    if op == "delete":
        del parent[key]
        return root, f"delete {where}"
    parent[key] = value
    return root, f"{op} {where}: {json_type(old)} -> {json_type(value)}"


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _fmt(path: tuple[Any, ...]) -> str:
    s = ""
    for k in path:
        s += f"[{k}]" if isinstance(k, int) else (f".{k}" if s else str(k))
    return s or "$"


def dumps(obj: Any) -> str:
    """JSON text of a mutated frame, the deep markers replaced by their nesting."""
    text = orjson.dumps(obj).decode()
    if "@@deep" in text:
        for mark, deep in DEEP.items():
            text = text.replace(f'"{mark}"', deep)
    return text


# ------------------------------------------------------------------------------ running
class Hang(BaseException):
    """One case ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"no result within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


_PROVIDERS: dict[str, HttpProvider] = {}


def provider(protocol: str) -> HttpProvider:
    p = _PROVIDERS.get(protocol)
    if p is None:
        p = _PROVIDERS[protocol] = decoder_for(protocol)
    return p


def _usable(obj: Any) -> None:
    orjson.dumps(unstructure(obj))


GUARD_MARK = ": cannot be decoded ("
"""In the message of an error made by ``fsm_agent.providers.wire.guard`` (a stray exception the
shapes did not prevent: typed, but a gap in a protocol's shapes)."""


def outcome(fn: Any, *args: Any) -> str:
    """``"ok"``, the ``ProviderError`` class name, ``"GUARD message"`` (a ``ProviderProtocolError``
    made by the last-line guard), or ``"UNTYPED Type: message"``."""
    try:
        fn(*args)
    except ProviderError as exc:
        if GUARD_MARK in exc.message:
            return f"GUARD {exc.message[:300]}"
        return type(exc).__name__
    except Hang:
        raise
    except Exception as exc:  # noqa: BLE001 - what the fuzzer counts
        return f"UNTYPED {type(exc).__name__}: {str(exc)[:300]}"
    return "ok"


def feed_stream(protocol: str, events: list[ServerSentEvent]) -> None:
    parser = provider(protocol).stream_parser()
    final = None
    for ev in events:
        parser.feed(ev)
    for ev in parser.finish():
        if isinstance(ev, MessageComplete):
            final = ev.full_response
    assert final is not None, "finish() returned no MessageComplete"
    _usable(final)


def run_stream(s: StreamBody, pos: int, data: str, tail: int | None = None) -> str:
    """The stream ``s`` with event ``pos``'s data replaced by ``data`` (events after it: all, or ``tail``)."""
    old = s.events[pos]
    end = len(s.events) if tail is None else min(len(s.events), pos + 1 + tail)
    events = [*s.events[:pos], ServerSentEvent(data, old.event, old.id, old.retry), *s.events[pos + 1:end]]
    return outcome(feed_stream, s.protocol, events)


def decode_json(protocol: str, raw: bytes, status: int) -> None:
    _usable(provider(protocol).decode_body(raw, status))


def run_body(b: JsonBody, data: str) -> list[str]:
    """A mutated body through ``decode_body`` (as a 200 body) and, for an error body, ``classify_error``."""
    raw = data.encode("utf-8", "surrogatepass")
    out = [outcome(decode_json, b.protocol, raw, 200)]
    if b.status >= 400:
        out.append(outcome(lambda: _usable(classify_error(b.status, raw, {}, provider="fuzz").to_info())))
    return out
