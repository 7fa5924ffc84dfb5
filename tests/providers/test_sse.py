"""The SSE decoder against the WHATWG rules: any byte split, every line ending, comments, fields."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_agent.errors import ProviderProtocolError
from fsm_agent.providers.sse import ServerSentEvent, SSEDecoder


def decode(data: bytes, cuts: list[int] | None = None, max_event_bytes: int | None = None) -> list[ServerSentEvent]:
    d = SSEDecoder(max_event_bytes) if max_event_bytes else SSEDecoder()
    out: list[ServerSentEvent] = []
    pos = 0
    for c in sorted(set(cuts or [])):
        out += d.feed(data[pos:c])
        pos = c
    out += d.feed(data[pos:])
    out += d.flush()
    return out


STREAM = (
    b": hello\n"
    b"event: message_start\n"
    b"data: {\"a\": 1}\n"
    b"\n"
    b"data: line one\n"
    b"data:line two\n"
    b"id: 42\n"
    b"\n"
    b": keep-alive\n"
    b"\n"
    b"event: ping\n"
    b"data: \n"
    b"\n"
    b"data: [DONE]\n"
    b"\n"
)
EXPECTED = [
    ServerSentEvent('{"a": 1}', "message_start", None, None),
    ServerSentEvent("line one\nline two", "message", "42", None),
    ServerSentEvent("", "ping", "42", None),
    ServerSentEvent("[DONE]", "message", "42", None),
]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending_gives_the_same_events(eol: bytes) -> None:
    assert decode(STREAM.replace(b"\n", eol)) == EXPECTED


def test_mixed_line_endings() -> None:
    mixed = b"data: a\r\n\r\ndata: b\r\rdata: c\n\r\n"
    assert [e.data for e in decode(mixed)] == ["a", "b", "c"]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_single_cut_point(eol: bytes) -> None:
    data = STREAM.replace(b"\n", eol)
    for cut in range(len(data) + 1):
        assert decode(data, [cut]) == EXPECTED, cut


def test_byte_by_byte() -> None:
    data = STREAM.replace(b"\n", b"\r\n")
    assert decode(data, list(range(len(data)))) == EXPECTED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM) * 2), max_size=30), st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_random_splits(cuts: list[int], eol: bytes) -> None:
    data = STREAM.replace(b"\n", eol)
    assert decode(data, [c % (len(data) + 1) for c in cuts]) == EXPECTED


def test_crlf_split_between_reads_is_one_line_ending() -> None:
    d = SSEDecoder()
    assert d.feed(b"data: x\r") == []
    # the LF that completes CRLF must not count as an empty line (which would dispatch)
    assert d.feed(b"\n") == []
    assert d.feed(b"data: y\r\n\r\n") == [ServerSentEvent("x\ny")]


def test_comment_only_frames_and_id_alone_dispatch_nothing() -> None:
    # the openai SDK bug of case B16: an id line plus a comment must not dispatch empty data
    assert decode(b":\n\n: ping\n\nid: 7\n: c\n\nretry: 10\n\n") == []


def test_one_leading_space_stripped_only() -> None:
    assert [e.data for e in decode(b"data:  two spaces\n\ndata:none\n\n")] == [" two spaces", "none"]


def test_field_without_colon_and_unknown_fields() -> None:
    # "data" with no colon is a data line with an empty value; unknown fields are ignored
    assert decode(b"data\ndata\nfoo: bar\n\n") == [ServerSentEvent("\n")]


def test_retry_and_id_fields() -> None:
    events = decode(b"retry: 3000\nid: 5\ndata: x\n\nretry: abc\ndata: y\n\nid: a\x00b\ndata: z\n\n")
    assert [(e.retry, e.id) for e in events] == [(3000, "5"), (None, "5"), (None, "5")]


def test_utf8_split_inside_characters() -> None:
    text = "数据 ✅ é 🎉 北京 Ü 👍"
    data = f"data: {text}\n\n".encode()
    for cut in range(len(data) + 1):
        assert decode(data, [cut]) == [ServerSentEvent(text)]


def test_invalid_utf8_is_a_clear_error_not_a_replacement_char() -> None:
    with pytest.raises(ProviderProtocolError, match="invalid UTF-8"):
        decode(b"data: \xff\xfe\n\n")


def test_long_line_beyond_transport_limits() -> None:
    big = "x" * (1024 * 1024)
    data = f"data: {big}\n\n".encode()
    events = decode(data, list(range(0, len(data), 65536)))
    assert len(events) == 1 and len(events[0].data) == len(big)


def test_event_above_ceiling_names_the_limit() -> None:
    data = b"data: " + b"y" * 5000 + b"\n\n"
    with pytest.raises(ProviderProtocolError, match="4096 byte limit"):
        decode(data, list(range(0, len(data), 100)), max_event_bytes=4096)
    # many data lines count too, not only one long line
    many = b"".join(b"data: " + b"z" * 100 + b"\n" for _ in range(100)) + b"\n"
    with pytest.raises(ProviderProtocolError, match="limit"):
        decode(many, max_event_bytes=4096)


def test_flush_dispatches_an_unterminated_last_event() -> None:
    assert decode(b"data: a\n\ndata: b") == [ServerSentEvent("a"), ServerSentEvent("b")]
    assert decode(b"data: a\n\ndata: b\n") == [ServerSentEvent("a"), ServerSentEvent("b")]


def test_last_event_id_is_tracked_for_reconnects() -> None:
    d = SSEDecoder()
    d.feed(b"id: 1\ndata: a\n\nid: 2\ndata: b\n\n")
    assert d.last_event_id == "2"
    assert d.comments == 0
    d.feed(b": x\n")
    assert d.comments == 1
