"""``fsm-agent decode``: a recorded response body (streamed or not) through a protocol's real parser.

Users reach for it when a provider stream looks wrong: it prints the final ``MessageResponse``
as JSON, or (``--events``) each ``StreamEvent`` as one JSON line. On malformed input it prints
what was decoded so far, then the error, and exits 1.
"""

from __future__ import annotations

from typing import TextIO

import orjson

from ..errors import ProviderError
from ..types.codec import unstructure
from ..types.stream import MessageComplete
from .base import HttpProvider, ProviderConfig
from .sse import SSEDecoder

__all__ = ["decode_body", "decoder_for", "looks_like_sse"]

_PROFILES = {"openai-chat": "openai-compatible", "openai-responses": "openai-responses", "anthropic": "anthropic"}


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


def _dump(obj: object, out: TextIO, indent: bool) -> None:
    opt = orjson.OPT_INDENT_2 if indent else 0
    out.write(orjson.dumps(unstructure(obj), option=opt).decode() + "\n")


def decode_body(protocol: str, raw: bytes, *, out: TextIO, err: TextIO, events: bool = False) -> int:
    """Decode ``raw`` with ``protocol``'s parser; returns the exit code (0 ok, 1 malformed or an error body)."""
    provider = decoder_for(protocol)
    if not looks_like_sse(raw):
        try:
            response = provider.decode_body(raw)
        except ProviderError as exc:
            err.write(f"fsm-agent decode: {exc}\n")
            return 1
        if events:
            from ..types.stream import events_for_response

            for ev in events_for_response(response):
                _dump(ev, out, False)
        else:
            _dump(response, out, True)
        return 0
    decoder = SSEDecoder()
    parser = provider.stream_parser()
    seen = 0
    try:
        for sse in decoder.feed(raw) + decoder.flush():
            for ev in parser.feed(sse):
                seen += 1
                if events:
                    _dump(ev, out, False)
        for ev in parser.finish():
            seen += 1
            if events:
                _dump(ev, out, False)
            elif isinstance(ev, MessageComplete):
                _dump(ev.full_response, out, True)
    except ProviderError as exc:
        partial = getattr(parser, "partial", None)
        if not events and partial is not None:
            err.write("fsm-agent decode: decoded so far:\n")
            _dump(partial.snapshot(), out, True)
        err.write(f"fsm-agent decode: {type(exc).__name__} after {seen} event(s): {exc}\n")
        return 1
    return 0
