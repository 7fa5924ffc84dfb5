"""Hostile input gets a typed error: values of the wrong type in any frame, in every parser.

* Named cases: a wrong type at a known place raises ``ProviderProtocolError`` whose message names
  the JSON path (``choices[0].delta.tool_calls[1].function.arguments: expected string or object, got
  number``), in the stream and the non-stream parser of all three protocols.
* The property test (hypothesis, derandomized: the same examples on every run): frames of every
  corpus body (``tests/providers/hostile.py``), one field's type mutated, fed through the
  protocol's parser; only a ``ProviderError`` or a normal (serializable) result may come out,
  never another exception, and no case may pass its time limit. ``bench/fuzz_frames.py`` runs the
  same over 100,000 frames.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsm_agent.errors import ProviderError, ProviderProtocolError
from fsm_agent.providers import wire
from fsm_agent.providers.openai_chat import OpenAIChatStreamParser
from fsm_agent.providers.sse import ServerSentEvent
from providers.hostile import (
    DEEP,
    GUARD_MARK,
    OPS,
    PROTOCOLS,
    VALUES,
    corpus_frames,
    dumps,
    mutate,
    paths,
    provider,
    run_body,
    run_stream,
    time_limit,
)


def _stream_error(protocol: str, frames: list[tuple[str, str]]) -> ProviderError | None:
    parser = provider(protocol).stream_parser()
    try:
        for event, data in frames:
            parser.feed(ServerSentEvent(data, event))
        parser.finish()
    except ProviderError as exc:
        return exc
    return None


def _body_error(protocol: str, body: str) -> ProviderError | None:
    try:
        provider(protocol).decode_body(body.encode())
    except ProviderError as exc:
        return exc
    return None


CHUNK = '{"id":"c","model":"m","choices":[{"index":0,"delta":%s}]}'
STREAM_CASES = [
    ("openai-chat", [("message", CHUNK % '{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":"{}"}},'
                                          '{"index":1,"id":"b","function":{"name":"g","arguments":5}}]}')],
     "stream event 1: choices[0].delta.tool_calls[1].function.arguments: expected string or object, got number"),
    ("openai-chat", [("message", '{"id":"c","choices":"oops"}')], "stream event 1: choices: expected array, got string"),
    ("openai-chat", [("message", '{"id":"c","choices":[null]}')], "choices[0]: expected object, got null"),
    ("openai-chat", [("message", CHUNK % '{"content":"a"}'), ("message", CHUNK % '["content"]')],
     "stream event 2: choices[0].delta: expected object, got array"),
    ("openai-chat", [("message", CHUNK % '{"reasoning_content":{"text":"x"}}')],
     "choices[0].delta.reasoning_content: expected string, got object"),
    ("openai-chat", [("message", '{"id":"c","choices":[],"usage":{"prompt_tokens":"12"}}')],
     "usage.prompt_tokens: expected a token count"),
    ("openai-chat", [("message", '{"id":"c","choices":[],"usage":{"prompt_tokens":-3}}')],
     "usage.prompt_tokens: expected a token count (a number from 0 to 2^53), got number"),
    ("openai-chat", [("message", '{"id":7,"choices":[]}')], "id: expected string, got number"),
    ("openai-chat", [("message", CHUNK % '{"tool_calls":[{"index":"0","function":{"name":"f"}}]}')],
     "choices[0].delta.tool_calls[0].index: expected integer, got string"),
    ("anthropic", [("content_block_start", '{"type":"content_block_start","index":0,"content_block":null}')],
     "stream event 1 (content_block_start): content_block: expected object, got null"),
    ("anthropic", [("content_block_start",
                    '{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'),
                   ("content_block_delta",
                    '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":7}}')],
     "stream event 2 (content_block_delta): delta.text: expected string, got number"),
    ("anthropic", [("message_start", '{"type":"message_start","message":[]}')],
     "message: expected object, got array"),
    ("anthropic", [("content_block_stop", '{"type":"content_block_stop","index":{"a":1}}')],
     "index: expected integer, got object"),
    ("anthropic", [("message_delta", '{"type":"message_delta","delta":{"stop_reason":1},"usage":{}}')],
     "delta.stop_reason: expected string, got number"),
    ("anthropic", [("content_block_start",
                    '{"type":"content_block_start","index":0,"content_block":{"type":5}}')],
     "content_block.type: expected string, got number"),
    ("openai-responses", [("response.output_item.added",
                           '{"type":"response.output_item.added","output_index":0,'
                           '"item":{"type":"message","id":"m","content":[{"type":"output_text","text":5}]}}')],
     "item.content[0].text: expected string, got number"),
    ("openai-responses", [("response.completed",
                           '{"type":"response.completed","response":{"id":"r","output":"oops"}}')],
     "response.output: expected array, got string"),
    ("openai-responses", [("response.output_text.delta",
                           '{"type":"response.output_text.delta","output_index":0,"delta":["x"]}')],
     "delta: expected string, got array"),
    ("openai-responses", [("response.output_item.done",
                           '{"type":"response.output_item.done","output_index":0,'
                           '"item":{"type":"reasoning","id":"rs","summary":[null]}}')],
     "item.summary[0]: expected object, got null"),
    ("openai-responses", [("message", '{"type":["response.completed"]}')], "type: expected string, got array"),
    ("openai-responses", [("response.failed", '{"type":"response.failed","response":{"error":"boom"}}')],
     "response.error: expected object, got string"),
]


@pytest.mark.parametrize(("protocol", "frames", "message"), STREAM_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(STREAM_CASES)])
def test_a_wrong_type_in_a_stream_names_its_path(protocol: str, frames: list[tuple[str, str]], message: str) -> None:
    err = _stream_error(protocol, frames)
    assert isinstance(err, ProviderProtocolError), err
    assert message in str(err)
    assert err.__cause__ is None  # found by the shapes, not by the guard


BODY_CASES = [
    ("openai-chat", '{"choices":[{"message":{"content":5}}]}',
     "response body: choices[0].message.content: expected string or array, got number"),
    ("openai-chat", '{"choices":[{"message":{"tool_calls":[{"id":"a","function":[]}]}}]}',
     "choices[0].message.tool_calls[0].function: expected object, got array"),
    ("openai-chat", '{"choices":[{"message":{"content":[{"type":"text","text":null},5]}}]}',
     "choices[0].message.content[1]: expected object, got number"),
    ("openai-chat", '{"choices":[{"message":null,"finish_reason":["stop"]}]}',
     "choices[0].finish_reason: expected string, got array"),
    ("anthropic", '{"type":"message","content":"oops"}', "response body: content: expected array, got string"),
    ("anthropic", '{"type":"message","content":[{"type":"tool_use","id":"t","name":"f","input":5}]}',
     "content[0].input: expected object or string, got number"),
    ("anthropic", '{"type":"message","content":[{"type":"text","text":"a","citations":"x"}]}',
     "content[0].citations: expected array, got string"),
    ("anthropic", '{"type":"message","content":[],"usage":{"output_tokens":true}}',
     "usage.output_tokens: expected a token count (a number from 0 to 2^53), got boolean"),
    ("openai-responses", '{"output":[{"type":"message","content":[{"type":"output_text","text":1}]}]}',
     "response body: output[0].content[0].text: expected string, got number"),
    ("openai-responses", '{"output":[null]}', "output[0]: expected object, got null"),
    ("openai-responses", '{"output":[],"incomplete_details":"max"}', "incomplete_details: expected object, got string"),
    ("openai-responses", '{"output":[{"type":"function_call","name":"f","arguments":[1]}]}',
     "output[0].arguments: expected string or object, got array"),
]


@pytest.mark.parametrize(("protocol", "body", "message"), BODY_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BODY_CASES)])
def test_a_wrong_type_in_a_body_names_its_path(protocol: str, body: str, message: str) -> None:
    err = _body_error(protocol, body)
    assert isinstance(err, ProviderProtocolError), err
    assert message in str(err)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("deep", list(DEEP.values())[:2], ids=["array", "object"])
def test_nesting_deeper_than_the_limit_is_a_protocol_error(protocol: str, deep: str) -> None:
    """Nesting orjson cannot write back (over 254 levels) never reaches a response."""
    frame = {"openai-chat": '{"id":"c","choices":[],"x":%s}',
             "anthropic": '{"type":"message_start","message":{"id":"m","x":%s}}',
             "openai-responses": '{"type":"response.created","response":{"id":"r","x":%s}}'}[protocol] % deep
    event = {"anthropic": "message_start", "openai-responses": "response.created"}.get(protocol, "message")
    err = _stream_error(protocol, [(event, frame)])
    assert isinstance(err, ProviderProtocolError) and f"nested deeper than {wire.MAX_DEPTH} levels" in str(err)
    body = {"openai-chat": '{"choices":[],"x":%s}', "anthropic": '{"type":"message","content":[],"x":%s}',
            "openai-responses": '{"output":[],"x":%s}'}[protocol] % deep
    err = _body_error(protocol, body)
    assert isinstance(err, ProviderProtocolError) and "nested deeper" in str(err)


def test_the_guard_types_a_stray_exception_and_keeps_its_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line of defence: a shape that missed a key the parser reads still gives a typed error."""
    def broken(self: object, choice: object, out: object) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(OpenAIChatStreamParser, "_delta", broken)
    parser = OpenAIChatStreamParser("p")
    with pytest.raises(ProviderProtocolError) as info:
        parser.feed(ServerSentEvent(CHUNK % '{"content":"a"}'))
    assert "stream event 1: cannot be decoded (KeyError" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)


def test_a_well_typed_corpus_needs_no_guard() -> None:
    """Every recorded frame passes its protocol's shapes: the corpus decodes as before (the other
    corpus tests check the values)."""
    frames = corpus_frames()
    for s in frames.streams:
        result = run_stream(s, s.frames[0], s.events[s.frames[0]].data)
        assert not result.startswith(("UNTYPED", "GUARD")), (s.id, result)
        assert result != "ProviderProtocolError", (s.id, result)
    for b in frames.bodies:
        for result in run_body(b, orjson.dumps(b.obj).decode()):
            assert not result.startswith(("UNTYPED", "GUARD")) and result != "ProviderProtocolError", (b.id, result)


# ------------------------------------------------------------------------------ property test
FRAMES = corpus_frames()
ALL_VALUES = [v for vs in VALUES.values() for v in vs]


@st.composite
def hostile_case(draw: st.DrawFn, protocol: str) -> tuple[str, object, int | None, str, str]:
    cases = [("stream", s, pos) for s in FRAMES.streams if s.protocol == protocol for pos in s.frames]
    cases += [("body", b, None) for b in FRAMES.bodies if b.protocol == protocol]
    kind, src, pos = draw(st.sampled_from(cases))
    obj = orjson.loads(src.events[pos].data) if kind == "stream" else src.obj
    path = draw(st.sampled_from(paths(obj)))
    op = draw(st.sampled_from(OPS))
    value = draw(st.sampled_from(ALL_VALUES if op == "retype" else VALUES["deep"] if op == "deep"
                                 else ["", [], {}, 0] if op == "empty" else [None]))
    mutated, what = mutate(obj, None, path, op, value)
    return kind, src, pos, dumps(mutated), what


def _check(case: tuple[str, object, int | None, str, str]) -> None:
    kind, src, pos, data, what = case
    with time_limit(10):  # a hang fails the example
        results = [run_stream(src, pos, data)] if kind == "stream" else run_body(src, data)  # type: ignore[arg-type]
    for r in results:
        assert not r.startswith("UNTYPED"), f"{src.id} #{pos}: {what}: {r}"  # type: ignore[attr-defined]
        assert not r.startswith("GUARD"), f"a gap in the shapes: {src.id} #{pos}: {what}: {r}"  # type: ignore[attr-defined]
        assert GUARD_MARK not in r


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_type_mutated_corpus_frames_give_typed_errors_only(protocol: str) -> None:
    @settings(derandomize=True, max_examples=1500, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(hostile_case(protocol))
    def run(case: tuple[str, object, int | None, str, str]) -> None:
        _check(case)

    run()
