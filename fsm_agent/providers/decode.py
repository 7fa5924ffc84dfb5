"""``fsm-agent decode``: a recorded response body (streamed or not) through a protocol's real parser.

Users reach for it when a provider stream looks wrong: it prints the final ``MessageResponse``
as JSON, or (``--events``) each ``StreamEvent`` as one JSON line. On malformed input it prints
what was decoded so far (marked ``"incomplete": true``, ``"stop_reason": null``), then the error
(for an event that is not JSON, the JSON decoder's message), and exits 1. Given a body of another protocol
(an Anthropic stream under ``--protocol openai-chat``, say) it prints nothing on stdout, which
is data, says on stderr which protocol the body looks like, and exits 1.

With ``--status N`` (N >= 400) the body is an error response: it is classified by
:func:`~fsm_agent.providers.errors.classify_error`, the function the HTTP path raises from, and
the typed error (class, kind, retryable, the server's retry-after, message ...) is printed as JSON
with exit code 0 (:func:`classify_body`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TextIO

import orjson

from ..errors import ConfigurationError, ProviderError, ProviderProtocolError
from ..types.codec import unstructure
from ..types.stream import MessageComplete
from .base import HttpProvider, ProviderConfig, server_retry_after
from .errors import classify_error
from .sse import SSEDecoder

__all__ = ["PROTOCOLS", "classify_body", "decode_body", "decoder_for", "error_info", "looks_like_sse",
           "sniff_protocol"]

_PROFILES = {"openai-chat": "openai-compatible", "openai-responses": "openai-responses", "anthropic": "anthropic"}
PROTOCOLS: tuple[str, ...] = tuple(_PROFILES)
"""The wire protocols ``decode`` knows (the values of ``--protocol``)."""
_ANTHROPIC_EVENTS = frozenset({"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                               "message_delta", "message_stop", "ping"})


def decoder_for(protocol: str) -> HttpProvider:
    """A provider instance of ``protocol`` used only to parse (it never connects)."""
    from .profiles import create_provider

    provider = create_provider(_PROFILES[protocol], ProviderConfig(base_url="http://127.0.0.1:9", api_key="decode",
                                                                    model="decode"))
    assert isinstance(provider, HttpProvider)
    return provider


def looks_like_sse(raw: bytes) -> bool:
    head = raw.lstrip()[:16]
    return head.startswith((b"data:", b"event:", b":", b"id:", b"retry:"))


def _kind(obj: object, event: str = "message") -> str | None:
    """The protocol one JSON body or stream event belongs to, or ``None`` when it cannot tell."""
    if event.startswith("response."):
        return "openai-responses"
    if event in _ANTHROPIC_EVENTS:
        return "anthropic"
    if not isinstance(obj, dict):
        return None
    kind, obj_type = obj.get("type"), obj.get("object")
    if isinstance(kind, str) and kind.startswith("response."):
        return "openai-responses"
    if kind in _ANTHROPIC_EVENTS or kind == "message":
        return "anthropic"
    if obj_type in ("chat.completion", "chat.completion.chunk") or isinstance(obj.get("choices"), list):
        return "openai-chat"
    if obj_type == "response" or isinstance(obj.get("output"), list):
        return "openai-responses"
    return None  # an error body or event: Anthropic and OpenAI Responses both send {"type": "error", ...}


def sniff_protocol(raw: bytes) -> str | None:
    """The wire protocol ``raw`` (a whole response body, streamed or not) looks like.

    Judged from the body's JSON (or its first stream event that names one): ``"openai-chat"``
    (``choices``, ``chat.completion[.chunk]``), ``"openai-responses"`` (``response.*`` events, an
    ``output`` list) or ``"anthropic"`` (``message_start`` ... events, ``"type": "message"``).
    ``None`` when it cannot tell: an error body or error event (the protocols share their
    shapes), a stream with no JSON event, bytes that are not JSON. Never raises.
    """
    try:
        if not looks_like_sse(raw):
            return _kind(orjson.loads(raw))
        decoder = SSEDecoder()
        for sse in decoder.feed(raw) + decoder.flush():
            try:
                data = orjson.loads(sse.data)
            except orjson.JSONDecodeError:
                data = None
            kind = _kind(data, sse.event)
            if kind is not None:
                return kind
    except (orjson.JSONDecodeError, ProviderError, ValueError):
        return None
    return None


def _dump_info(info: dict[str, Any], out: TextIO) -> None:
    out.write(orjson.dumps(info, option=orjson.OPT_INDENT_2).decode() + "\n")


def _dump(obj: object, out: TextIO, indent: bool) -> None:
    opt = orjson.OPT_INDENT_2 if indent else 0
    out.write(orjson.dumps(unstructure(obj), option=opt).decode() + "\n")


def classify_body(protocol: str, status: int, raw: bytes, headers: Mapping[str, str] | None = None) -> ProviderError:
    """The error the HTTP path raises for an error response (``status`` >= 400, body ``raw``, ``headers``)
    of ``protocol``'s provider: the same call to :func:`classify_error` that
    :meth:`~fsm_agent.providers.http.HttpClient.post` makes."""
    return classify_error(status, raw, dict(headers or {}), provider=decoder_for(protocol).name)


def error_info(exc: ProviderError) -> dict[str, Any]:
    """What ``decode --status`` prints of a classified error: ``error`` (the class), ``kind``,
    ``retryable``, ``retry_after`` (seconds the server asked for, as the retry policy reads it, or
    ``None``), ``message``, ``status``, ``code``, ``provider``, and the context-window numbers of a
    :class:`~fsm_agent.errors.ContextLengthExceededError`."""
    info: dict[str, Any] = {
        "error": type(exc).__name__,
        "kind": exc.kind,
        "retryable": exc.retryable,
        "retry_after": server_retry_after(exc),
        "message": exc.message,
        "status": exc.status,
        "code": exc.code,
        "provider": exc.provider,
    }
    for name in ("limit", "requested", "input_tokens", "max_tokens_requested"):
        if hasattr(exc, name):
            info[name] = getattr(exc, name)
    return info


def decode_body(protocol: str, raw: bytes, *, out: TextIO, err: TextIO, events: bool = False,
                status: int | None = None, headers: Mapping[str, str] | None = None) -> int:
    """Decode ``raw`` with ``protocol``'s parser, writing JSON to ``out`` and problems to ``err``.

    Args:
        protocol: one of :data:`PROTOCOLS`.
        raw: the body as received: an SSE stream or one JSON document.
        events: write each stream event as one JSON line instead of the final response.
        status: the HTTP status the body came with. From 400 up the body is an error response: the
            typed error the HTTP path raises for it (:func:`classify_body`) is written to ``out``
            as JSON (:func:`error_info`). Below 400 (or ``None``) the body is decoded.
        headers: response headers (``Retry-After`` ...) given with ``status``.

    Returns:
        The exit code: 0 decoded, or an error response classified (``status`` >= 400); 1 an
        error body without ``status``, a malformed body (what was decoded before the fault is
        written to ``out`` when there is any), or a body of another protocol (``out`` stays
        empty; ``err`` names the protocol the body looks like).

    Raises:
        ConfigurationError: ``protocol`` is not one of :data:`PROTOCOLS`.
    """
    if protocol not in _PROFILES:
        raise ConfigurationError(f"unknown protocol {protocol!r}; use one of: {', '.join(PROTOCOLS)}")
    if status is not None and status >= 400:
        _dump_info(error_info(classify_body(protocol, status, raw, headers)), out)
        return 0
    found = sniff_protocol(raw)
    if found is not None and found != protocol:
        err.write(f"fsm-agent decode: this body is {found}, not {protocol}; try --protocol {found}\n")
        return 1
    provider = decoder_for(protocol)
    if not looks_like_sse(raw):
        try:
            response = provider.decode_body(raw, status or 200, headers)
        except ProviderError as exc:
            err.write(f"fsm-agent decode: {exc}\n")
            return 1
        if events:
            from .costs import events_for

            for ev in events_for(response):
                _dump(ev, out, False)
        else:
            _dump(response, out, True)
        return 0
    decoder = SSEDecoder()
    parser = provider.stream_parser()
    seen = 0
    frames = 0
    current: Any = None
    try:
        for sse in decoder.feed(raw) + decoder.flush():
            current = sse
            frames += 1
            for ev in parser.feed(sse):
                seen += 1
                if events:
                    _dump(ev, out, False)
        current = None
        for ev in parser.finish():
            seen += 1
            if events:
                _dump(ev, out, False)
            elif isinstance(ev, MessageComplete):
                _dump(ev.full_response, out, True)
    except ProviderError as exc:
        partial = getattr(parser, "partial", None)
        if not events and partial is not None and seen:
            err.write("fsm-agent decode: decoded so far (incomplete: the stream did not finish):\n")
            _dump_partial(partial.snapshot(), out)
        # an event that is not JSON at all, which a parser reported as some other fault ("not a JSON object")
        bad = _not_json(current) if isinstance(exc, ProviderProtocolError) and "not JSON" not in str(exc) else None
        what = f"stream frame {frames} is not valid JSON ({bad}): {current.data[:200]!r}" if bad else str(exc)
        err.write(f"fsm-agent decode: {type(exc).__name__} after {seen} event(s): {what}\n")
        return 1
    return 0


def _not_json(sse: Any) -> str | None:
    """The JSON decoder's message for a stream event whose data is not JSON, else ``None``
    (no event, an empty or ``[DONE]`` event, or data that parses)."""
    data = getattr(sse, "data", "").strip()
    if not data or data == "[DONE]" or getattr(sse, "event", "") == "error":
        return None
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        return str(exc)
    return None


def _dump_partial(response: object, out: TextIO) -> None:
    """What a cut stream decoded before its fault: the response so far, marked ``"incomplete": true``
    with ``"stop_reason": null`` (the stream never said why it stopped)."""
    doc = unstructure(response)
    if isinstance(doc, dict):
        doc = {"incomplete": True, **doc, "stop_reason": None}
    out.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
