"""Cassettes: record the provider exchanges of a test once, replay them in every later run.

A :class:`Cassette` is installed for every provider of the process (nothing to configure on the
providers): each HTTP request a provider sends is looked up among the cassette's recorded requests
**by its normalised request, not by its position**, and answered with the recorded response, body
and stream alike, through the provider's real SSE reader and protocol parser. A request that
matches nothing fails with :class:`CassetteMismatch`, which names the closest recorded request and
every place where the two differ::

    from fsm_agent.testing import use_cassette

    async def test_weather(tmp_path):
        with use_cassette("tests/cassettes/weather.json"):       # records on the first run
            result = await agent.run("Weather in Paris?")
        assert result.stop.reason is StopReason.COMPLETED

Or, with the pytest plugin (``pytest_plugins = ["fsm_agent.testing.pytest_plugin"]``), the
``cassette`` fixture (see :mod:`fsm_agent.testing.pytest_plugin`).

**Record modes** (vcrpy's):

- ``"once"``: replay when the file exists (a request it does not have fails); record every
  exchange when it does not (the default of :func:`use_cassette`);
- ``"new_episodes"``: replay what is recorded, send what is not and add it to the file;
- ``"none"``: replay only, never send (a missing file fails; the pytest plugin's default);
- ``"all"``: send everything and write the file anew (re-record).

**Matching.** Two requests match when their method, URL and JSON body are equal after
normalisation: the body is parsed (key order and whitespace do not count); ids that change from
run to run (the values of ``id``, ``tool_call_id``, ``call_id``, ``tool_use_id`` ... keys, e.g. the
call ids fsm_agent makes in the constrained tool mode) are renamed ``<id1>``, ``<id2>`` ... in order
of first appearance, wherever they appear, so the pairing of a result with its call still counts
but not the random value; timestamps (``created``, ``created_at``, ``timestamp``) become
``<time>``; the port of a loopback host (``127.0.0.1``, ``localhost``, ``[::1]``) is dropped; credential
query parameters are ``REDACTED``. Headers are not compared (they carry the API key and client
versions) unless named in ``match_headers``. ``ignore=`` removes more fields (dotted paths, ``*``
for any key or index: ``"body.metadata"``, ``"body.messages.*.cache_control"``) and
``normalize=`` takes a function of the normalised request for anything else. Among equal
recorded requests the first one not yet played answers; a request sent more often than it was
recorded fails unless ``allow_repeats=True``.

**What is kept.** The file (JSON, the :mod:`fsm_agent.providers.record` format: a list of
``{"request", "response"}``, readable and diffable) holds each response's body as it came, byte for
byte (text, or ``body_base64`` when it is not UTF-8), its network reads (``reads``: their sizes,
and ``times``: seconds after the request was sent), its status and headers, and whether the body
ended (``complete``: ``false`` for a connection that dropped mid-stream, replayed as the same
drop). Credentials never reach the file: credential headers and query parameters become
``REDACTED``, and so does the provider's API key wherever it appears in a body.
:meth:`fsm_agent.testing.ReplayServer.from_recording` serves the same file over HTTP.

**Replay.** A replayed body is handed to the provider in the recorded reads, one read at a time,
so the SSE reader meets the same boundaries (an event split across reads, a UTF-8 character cut in
two). ``realtime=True`` also waits the recorded time before each read (first-token and
between-chunk timeouts then fire as they did); by default no time passes. A stream that stalled
while recording (the provider gave up waiting) replays as a dropped connection unless
``realtime=True``.

Why not vcrpy: its aiohttp support reads the whole body before the response is returned while
recording (a stream is not streamed: the first-token and chunk timeouts cannot fire, a dropped
stream raises from the request and is not recorded) and replays the body as one read (the SSE
reader never meets a split event); it records credential headers unless told not to, and matches
by URL, not by the normalised body. Measured with vcrpy 9.4.2 and aiohttp 3.14 against a loopback
server streaming five 10-byte pieces 0.3 s apart: the client got the response headers after 1.5 s
and one 51-byte read, recording and replaying.
"""

from __future__ import annotations

import asyncio
import base64
import difflib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson

from ..errors import ConfigurationError, ReplayDivergence
from ..providers.record import SCRUBBED_HEADERS, load_recording, scrub_headers

__all__ = ["RECORD_MODES", "Cassette", "CassetteMismatch", "normalize_request", "use_cassette"]

RECORD_MODES = ("once", "new_episodes", "none", "all")
"""The record modes, as vcrpy names them (see the module docstring)."""

VOLATILE_ID_KEYS = frozenset({"id", "tool_call_id", "call_id", "tool_use_id", "previous_response_id",
                              "response_id", "item_id", "idempotency_key"})
"""Keys whose string values are renamed ``<idN>`` before requests are compared."""

VOLATILE_TIME_KEYS = frozenset({"created", "created_at", "timestamp"})
"""Keys whose values become ``<time>`` before requests are compared."""

_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_QUERY_SECRETS = frozenset({"key", "api_key", "apikey", "access_token", "token"})
_MIN_ID_IN_TEXT = 6  # an id shorter than this is not searched for inside other strings


class CassetteMismatch(ReplayDivergence):
    """A request the cassette has no recorded answer for: it differs from every recorded request,
    or was sent more often than recorded. Raised where the provider sends it; the engine lets it
    through, so ``agent.run`` raises it too.

    Attributes:
        request: the sent request, normalised (``{"method", "url", "body"}``).
        closest: the closest recorded request, normalised, or ``None`` when the cassette is empty.
        closest_index: its position in the cassette (0-based), or ``-1``.
        differences: ``(path, recorded, sent)`` for each differing field (``path`` like
            ``body.messages[1].content``); empty when the request matched one that was already played.
    """

    def __init__(self, message: str, request: dict[str, Any], closest: dict[str, Any] | None,
                 closest_index: int, differences: list[tuple[str, Any, Any]]) -> None:
        Exception.__init__(self, message)
        self.index = closest_index
        self.expected = None if closest is None else _short(closest)
        self.actual = _short(request)
        self.difference = differences[0][0] if differences else ""
        self.request = request
        self.closest = closest
        self.closest_index = closest_index
        self.differences = differences

    def __str__(self) -> str:
        return str(self.args[0])


def _short(req: Mapping[str, Any]) -> str:
    return f"{req.get('method', 'POST')} {req.get('url', '')}"


# -- normalisation ---------------------------------------------------------------------------------
def _scrub(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        if s:
            text = text.replace(s, "REDACTED")
    return text


def _url(url: str) -> str:
    """The URL with credential query parameters ``REDACTED`` (as it is stored)."""
    parts = urlsplit(url)
    if not parts.query:
        return url
    query = [(k, "REDACTED" if k.lower() in _QUERY_SECRETS else v) for k, v in parse_qsl(parts.query, True)]
    return urlunsplit(parts._replace(query=urlencode(query)))


def _match_url(url: str) -> str:
    """The URL as compared: no port on a loopback host, query parameters sorted, no fragment."""
    parts = urlsplit(_url(url))
    netloc = parts.netloc
    if parts.hostname in _LOOPBACK:
        netloc = "localhost"
    query = urlencode(sorted(parse_qsl(parts.query, True)))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _body_value(raw: bytes, secrets: Iterable[str]) -> Any:
    """A request body as stored: parsed JSON, else text (secrets ``REDACTED`` either way)."""
    text = _scrub(raw.decode("utf-8", "replace"), secrets)
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _rename_volatile(body: Any, id_keys: frozenset[str], time_keys: frozenset[str]) -> Any:
    names: dict[str, str] = {}

    def collect(o: Any) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                if k in id_keys and isinstance(v, str) and v and v not in names:
                    names[v] = f"<id{len(names) + 1}>"
                collect(v)
        elif isinstance(o, list):
            for v in o:
                collect(v)

    collect(body)
    inner = sorted((n for n in names if len(n) >= _MIN_ID_IN_TEXT), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, inner))) if inner else None

    def rewrite(o: Any, key: str | None = None) -> Any:
        if key in time_keys and o is not None:
            return "<time>"
        if isinstance(o, dict):
            return {k: rewrite(v, k) for k, v in o.items()}
        if isinstance(o, list):
            return [rewrite(v) for v in o]
        if isinstance(o, str):
            if o in names:
                return names[o]
            if pattern is not None:
                return pattern.sub(lambda m: names[m.group(0)], o)
        return o

    return rewrite(body)


def _drop(obj: Any, path: Sequence[str]) -> Any:
    """``obj`` without the field at ``path`` (``*``: every key or index at that level)."""
    if not path:
        return obj
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        keys = list(obj) if head == "*" else [head]
        out = dict(obj)
        for k in keys:
            if k in out:
                if rest:
                    out[k] = _drop(out[k], rest)
                else:
                    del out[k]
        return out
    if isinstance(obj, list):
        if head == "*":
            return [_drop(v, rest) for v in obj] if rest else []
        if head.isdigit() and int(head) < len(obj):
            out_l = list(obj)
            if rest:
                out_l[int(head)] = _drop(out_l[int(head)], rest)
            else:
                del out_l[int(head)]
            return out_l
    return obj


def normalize_request(method: str, url: str, body: Any, headers: Mapping[str, str] | None = None, *,
                      ignore: Sequence[str] = (), match_headers: Sequence[str] = (),
                      id_keys: frozenset[str] = VOLATILE_ID_KEYS,
                      time_keys: frozenset[str] = VOLATILE_TIME_KEYS,
                      normalize: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The form two requests are compared in (see the module docstring): ``{"method", "url",
    "body"}`` plus ``"headers"`` when ``match_headers`` names some (lower-cased; a credential
    header is never compared).

    Args:
        body: the body as stored (parsed JSON or text; ``bytes`` are parsed here).
        ignore: dotted paths removed (``"body.metadata"``, ``"body.messages.*.cache_control"``).
        normalize: applied last, to the whole normalised request; returns the value to compare.
    """
    if isinstance(body, (bytes, bytearray)):
        body = _body_value(bytes(body), ())
    out: dict[str, Any] = {"method": method.upper(), "url": _match_url(url),
                           "body": _rename_volatile(body, id_keys, time_keys)}
    if match_headers:
        low = {k.lower(): v for k, v in (headers or {}).items()}
        out["headers"] = {h.lower(): low.get(h.lower()) for h in match_headers if h.lower() not in SCRUBBED_HEADERS}
    for p in ignore:
        out = _drop(out, p.split("."))
    if normalize is not None:
        out = normalize(out)
    return out


# -- differences ------------------------------------------------------------------------------------
def _differences(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """``(path, a's value, b's value)`` for each leaf where ``a`` and ``b`` differ (``_MISSING``
    for a side that lacks it)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{k}" if path else str(k)
            out += _differences(a.get(k, _MISSING), b.get(k, _MISSING), sub)
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = []
        for i in range(max(len(a), len(b))):
            out += _differences(a[i] if i < len(a) else _MISSING, b[i] if i < len(b) else _MISSING, f"{path}[{i}]")
        return out
    return [] if a == b else [(path, a, b)]


class _Missing:
    def __repr__(self) -> str:
        return "(missing)"


_MISSING: Any = _Missing()


def _show(v: Any, limit: int = 160) -> str:
    text = repr(v) if isinstance(v, _Missing) else orjson.dumps(v).decode()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _pretty(v: Any) -> list[str]:
    return orjson.dumps(v, option=orjson.OPT_INDENT_2).decode().splitlines(keepends=True)


# -- the replayed response ------------------------------------------------------------------------
class _ReplayedContent:
    """The body of a replayed response, read by the provider layer like ``aiohttp.StreamReader``:
    each ``readany()`` returns the next recorded read."""

    def __init__(self, chunks: list[bytes], times: list[float], complete: bool, realtime: bool,
                 reason: str) -> None:
        self._chunks = chunks
        self._times = times
        self._complete = complete
        self._realtime = realtime
        self._reason = reason
        self._pos = 0
        self._closed = asyncio.Event()
        self._t0 = asyncio.get_running_loop().time()
        self._error: BaseException | None = None

    def close(self) -> None:
        self._closed.set()

    def at_eof(self) -> bool:
        return self._pos >= len(self._chunks) and self._complete

    def exception(self) -> BaseException | None:
        return self._error

    async def _wait_until(self, offset: float) -> bool:
        """Sleep to ``offset`` seconds after the request; ``False`` when the response was closed first."""
        delay = self._t0 + offset - asyncio.get_running_loop().time()
        if delay <= 0:
            return not self._closed.is_set()
        try:
            await asyncio.wait_for(self._closed.wait(), delay)
            return False
        except TimeoutError:
            return True

    async def readany(self) -> bytes:
        import aiohttp

        if self._closed.is_set():
            return b""
        if self._pos < len(self._chunks):
            if self._realtime and not await self._wait_until(self._times[self._pos]):
                return b""
            chunk = self._chunks[self._pos]
            self._pos += 1
            return chunk
        if self._complete:
            return b""
        if self._realtime:  # it stalled while recording: wait as it did, until the reader gives up
            await self._closed.wait()
            return b""
        self._error = aiohttp.ClientPayloadError(
            f"the recorded response ended here without its end ({self._reason}: the connection dropped, or the "
            "reader stopped while recording)")
        raise self._error

    async def read(self, n: int = -1) -> bytes:
        if n < 0:
            out: list[bytes] = []
            while True:
                chunk = await self.readany()
                if not chunk:
                    return b"".join(out)
                out.append(chunk)
        return await self.readany()


class _ReplayedResponse:
    """The ``aiohttp.ClientResponse`` surface the provider layer reads, for a recorded response."""

    def __init__(self, url: str, status: int, headers: Mapping[str, str], content: _ReplayedContent) -> None:
        from multidict import CIMultiDict, CIMultiDictProxy
        from yarl import URL

        self.url = URL(url)
        self.status = status
        self.reason = "replayed"
        self.headers = CIMultiDictProxy(CIMultiDict(headers))
        self.content = content
        self.closed = False

    async def read(self) -> bytes:
        return await self.content.read()

    def release(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True
        self.content.close()


# -- the cassette -----------------------------------------------------------------------------------
def _chunk_fields(chunks: list[bytes]) -> dict[str, Any]:
    raw = b"".join(chunks)
    try:
        return {"body": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"body": None, "body_base64": base64.b64encode(raw).decode()}


class Cassette:
    """Recorded provider exchanges for one test, replayed by normalised request (see the module
    docstring for the modes, the matching and the file).

    Use as a context manager (``with`` or ``async with``): entering installs it for every provider
    of the process (one cassette at a time) and, in the modes that read it, loads the file;
    leaving removes it and writes the file when something was recorded.

    Args:
        path: the cassette file (JSON). Its folder is created when it is written.
        record_mode: ``"once"`` (default), ``"new_episodes"``, ``"none"`` or ``"all"``.
        ignore: dotted paths left out of the comparison (``"body.temperature"``; ``*`` for any key or index).
        match_headers: request headers compared too (never credential headers).
        normalize: ``(normalised request) -> value to compare``, applied after the built-in rules.
        allow_repeats: a request sent more often than recorded gets the last matching answer again
            instead of failing.
        realtime: wait the recorded times between the reads of a replayed body.

    Raises:
        ConfigurationError: an unknown record mode (at construction); on entering, a ``"none"``
            cassette whose file is missing, a file that is not a cassette, or another cassette
            already in use.
    """

    def __init__(self, path: str | Path, *, record_mode: str = "once", ignore: Sequence[str] = (),
                 match_headers: Sequence[str] = (), normalize: Callable[[dict[str, Any]], Any] | None = None,
                 allow_repeats: bool = False, realtime: bool = False) -> None:
        if record_mode not in RECORD_MODES:
            raise ConfigurationError(f"record_mode {record_mode!r}: use one of {', '.join(RECORD_MODES)}")
        self.path = Path(path)
        self.record_mode = record_mode
        self.ignore = tuple(ignore)
        self.match_headers = tuple(match_headers)
        self.normalize = normalize
        self.allow_repeats = allow_repeats
        self.realtime = realtime
        self.interactions: list[dict[str, Any]] = []
        """The exchanges: those loaded from the file, then those recorded by this use."""
        self.played: list[int] = []
        """Positions (in :attr:`interactions`) of the exchanges replayed, in the order they were."""
        self.recorded = 0
        """How many exchanges this use recorded."""
        self._keys: list[Any] = []
        self._active = False
        self._previous: Any = None

    # -- the modes --------------------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        """Whether requests the cassette does not answer go to the network and are recorded."""
        if self.record_mode == "once":
            return self._fresh
        return self.record_mode in ("new_episodes", "all")

    @property
    def replaying(self) -> bool:
        """Whether recorded exchanges answer matching requests."""
        return self.record_mode != "all" and not (self.record_mode == "once" and self._fresh)

    _fresh = False  # "once" with no file yet: record everything

    # -- entering and leaving ---------------------------------------------------------------------
    def __enter__(self) -> Cassette:
        from ..providers import http

        if self._active:
            raise ConfigurationError(f"cassette {self.path} is already in use")
        self.interactions, self.played, self.recorded, self._keys = [], [], 0, []
        exists = self.path.is_file()
        if self.record_mode == "none" and not exists:
            raise ConfigurationError(f"no cassette at {self.path} (record_mode 'none' only replays); record it "
                                     "once with record_mode 'once' (pytest: --cassette-mode=once)")
        self._fresh = self.record_mode == "once" and not exists
        if exists and self.record_mode != "all":
            try:
                loaded = load_recording(self.path)
            except (ValueError, OSError) as exc:
                raise ConfigurationError(f"{self.path} is not a cassette ({exc}); delete it or re-record it "
                                         "(record_mode 'all', pytest: --cassette-mode=all)") from exc
            for ex in loaded:
                self._add(ex)
        previous = http.set_interceptor(self)
        if previous is not None:
            http.set_interceptor(previous)
            raise ConfigurationError(f"another cassette ({getattr(previous, 'path', previous)}) is in use; "
                                     "use one cassette at a time")
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        from ..providers import http

        if self._active:
            http.set_interceptor(None)
            self._active = False
        if self.recorded or (self.record_mode == "all"):
            self.save()

    async def __aenter__(self) -> Cassette:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    def save(self) -> Path:
        """Write the exchanges to :attr:`path` (indented JSON); returns the path."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(orjson.dumps(self.interactions, option=orjson.OPT_INDENT_2) + b"\n")
        return self.path

    # -- what was played --------------------------------------------------------------------------
    @property
    def unplayed(self) -> list[int]:
        """Positions of the recorded exchanges no request has asked for (yet)."""
        seen = set(self.played)
        return [i for i in range(len(self.interactions)) if i not in seen and not self._is_new(i)]

    @property
    def all_played(self) -> bool:
        """Every exchange loaded from the file was replayed at least once."""
        return not self.unplayed

    def assert_all_played(self) -> None:
        """Raise ``AssertionError`` naming the recorded requests no request asked for."""
        missing = self.unplayed
        if missing:
            listed = "; ".join(f"#{i} {_short(self.interactions[i]['request'])}" for i in missing)
            raise AssertionError(f"cassette {self.path}: {len(missing)} recorded request(s) never sent: {listed}")

    def _is_new(self, i: int) -> bool:
        return i >= len(self.interactions) - self.recorded

    # -- the interceptor protocol (fsm_agent.providers.http) ---------------------------------------
    def _key(self, request: Mapping[str, Any]) -> Any:
        return normalize_request(request.get("method", "POST"), request.get("url", ""), request.get("body"),
                                 request.get("headers"), ignore=self.ignore, match_headers=self.match_headers,
                                 normalize=self.normalize)

    def _add(self, exchange: dict[str, Any]) -> None:
        self.interactions.append(exchange)
        self._keys.append(self._key(exchange.get("request") or {}))

    def replay(self, url: str, headers: Mapping[str, str], body: bytes, secrets: tuple[str, ...]) -> Any:
        """The recorded response for this request, ``None`` to send it (recording), or raise.

        Raises:
            CassetteMismatch: nothing recorded matches and the mode does not record.
        """
        if not self.replaying:
            return None
        sent = {"method": "POST", "url": _url(_scrub(url, secrets)), "headers": scrub_headers(headers),
                "body": _body_value(body, secrets)}
        key = self._key(sent)
        matches = [i for i, k in enumerate(self._keys) if k == key]
        played = set(self.played)
        fresh = [i for i in matches if i not in played]
        if fresh or (matches and self.allow_repeats):
            i = fresh[0] if fresh else matches[-1]
            self.played.append(i)
            return self._response(i)
        if self.recording:
            return None
        raise self._mismatch(key, matches)

    def _response(self, i: int) -> _ReplayedResponse:
        ex = self.interactions[i]
        req, resp = ex["request"], ex["response"]
        raw = _response_bytes(resp)
        reads = resp.get("reads") or [len(raw)]
        chunks, pos = [], 0
        for n in reads:
            chunks.append(raw[pos: pos + n])
            pos += n
        if pos < len(raw):
            chunks.append(raw[pos:])
        times = list(resp.get("times") or [0.0] * len(chunks))
        times += [times[-1] if times else 0.0] * (len(chunks) - len(times))
        headers = {k: v for k, v in (resp.get("headers") or {}).items() if k.lower() != "content-length"}
        if "content-type" not in {k.lower() for k in headers}:
            headers["content-type"] = "application/json"
        content = _ReplayedContent(chunks, times, bool(resp.get("complete", True)), self.realtime,
                                   f"cassette {self.path} #{i}")
        return _ReplayedResponse(req.get("url", ""), int(resp.get("status_code", 200)), headers, content)

    def record(self, exchange: Any) -> None:
        """Add one exchange from the network (``fsm_agent.providers.http.Exchange``)."""
        secrets = exchange.secrets
        request = {"method": "POST", "url": _url(_scrub(exchange.url, secrets)),
                   "headers": scrub_headers(exchange.request_headers),
                   "body": _body_value(exchange.request_body, secrets)}
        chunks = [_scrub_bytes(c, secrets) for c in exchange.chunks]
        response: dict[str, Any] = {"status_code": exchange.status,
                                    "headers": scrub_headers(exchange.response_headers),
                                    **_chunk_fields(chunks)}
        if len(chunks) > 1:
            response["reads"] = [len(c) for c in chunks]
        response["times"] = [round(t, 4) for t in exchange.times]
        response["complete"] = exchange.complete
        self._add({"request": request, "response": response})
        self.recorded += 1

    # -- a request nothing answers ------------------------------------------------------------------
    def _mismatch(self, key: dict[str, Any], matches: list[int]) -> CassetteMismatch:
        how = (f"pytest --cassette-mode=all (or FSM_AGENT_CASSETTE_MODE=all) re-records the cassette; "
               f"--cassette-mode=new_episodes keeps it and records what is new (Cassette(record_mode=...))")
        where = f"cassette {self.path} (record_mode {self.record_mode!r}, {len(self.interactions)} recorded)"
        if matches:
            i = matches[-1]
            msg = (f"{where}: {_short(key)} matches recorded request #{i}, which was already played: the request "
                   f"was sent {len([p for p in self.played if p in matches]) + 1} times, recorded "
                   f"{len(matches)} time(s). Pass allow_repeats=True to answer it again, or {how}")
            return CassetteMismatch(msg, key, self._keys[i], i, [])
        if not self._keys:
            return CassetteMismatch(f"{where}: it has no recorded request; {_short(key)} was sent. {how}",
                                    key, None, -1, [])
        same = [i for i, k in enumerate(self._keys) if k.get("method") == key["method"] and k.get("url") == key["url"]]
        pool = same or list(range(len(self._keys)))
        played = set(self.played)
        scored = [(len(_differences(self._keys[i], key)), i in played, i) for i in pool]
        _, _, best = min(scored)
        closest = self._keys[best]
        diffs = _differences(closest, key)
        lines = [f"{where}: no recorded request matches {_short(key)}.",
                 f"The closest is #{best}{' (already played)' if best in played else ''}; "
                 f"it differs in {len(diffs)} place(s) (recorded -> sent):"]
        for path, a, b in diffs[:20]:
            lines.append(f"  {path}: {_show(a)} -> {_show(b)}")
        if len(diffs) > 20:
            lines.append(f"  ... and {len(diffs) - 20} more")
        udiff = list(difflib.unified_diff(_pretty(closest), _pretty(key), f"recorded #{best}", "sent", n=2))
        if udiff:
            lines.append("".join(udiff[:80]).rstrip("\n") + ("\n..." if len(udiff) > 80 else ""))
        lines.append(how)
        return CassetteMismatch("\n".join(lines), key, closest, best, diffs)


def _scrub_bytes(chunk: bytes, secrets: Iterable[str]) -> bytes:
    for s in secrets:
        if s:
            chunk = chunk.replace(s.encode(), b"REDACTED")
    return chunk


def _response_bytes(resp: Mapping[str, Any]) -> bytes:
    if resp.get("body_base64") is not None:
        return base64.b64decode(resp["body_base64"])
    body = resp.get("body")
    if body is None:
        return b""
    if isinstance(body, str):
        return body.encode("utf-8")
    return orjson.dumps(body)  # a recording of ProviderConfig(record_to=...) keeps JSON bodies parsed


def use_cassette(path: str | Path, **options: Any) -> Cassette:
    """A :class:`Cassette` for ``with`` / ``async with`` (the same arguments)."""
    return Cassette(path, **options)
