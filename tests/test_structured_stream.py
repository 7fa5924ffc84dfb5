"""Streamed structured output (issue 23 item 12): while an answer with an output schema streams,
the observers (``on_output_partial``) and ``Agent.stream_output`` get the answer's JSON value as far
as it goes, checked as far as it goes, then the value the final check accepted. The partial values
never enter the session log. Underneath: the incremental parser (``PartialJSON``) and the partial
check (``validate_partial``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import corpus
from fsm_agent import Agent, OutputSchema, ScriptedProvider
from fsm_agent.errors import ConfigurationError
from fsm_agent.hooks import Observer
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider
from fsm_agent.structured import validate_partial
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import OutputPartial, StopReason
from fsm_agent.types.partial_json import PartialJSON

CITY = OutputSchema("city", {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "population"],
})
ANSWER = '{"name": "Paris", "population": 2102650, "tags": ["a\\u00e9", "b"]}'
FINAL = {"name": "Paris", "population": 2102650, "tags": ["aé", "b"]}


def snapshots(pieces: list[str], **kw: Any) -> list[Any]:
    """The snapshot after each piece that changed it."""
    p = PartialJSON(**kw)
    return [p.snapshot() for piece in pieces if p.feed(piece)]


# -- the parser --------------------------------------------------------------------------------------

def test_each_character_in_turn_gives_the_value_as_far_as_it_goes() -> None:
    text = '{"a": [1, "xy"], "b": {"c": true}}'
    assert snapshots(list(text)) == [
        {},
        {"a": []},
        {"a": [1]},
        {"a": [1, ""]}, {"a": [1, "x"]}, {"a": [1, "xy"]}, {"a": [1, "xy"]},  # the string, then its end
        {"a": [1, "xy"]},  # the array closed
        {"a": [1, "xy"], "b": {}},
        {"a": [1, "xy"], "b": {"c": True}},
        {"a": [1, "xy"], "b": {"c": True}},
        {"a": [1, "xy"], "b": {"c": True}},
    ]


def test_a_number_appears_once_it_ends() -> None:
    p = PartialJSON()
    assert p.feed("{") is True
    assert p.feed('"n": 12') is False and p.snapshot() == {}
    assert p.feed("3") is False and p.snapshot() == {}
    assert p.feed(".5e1,") is True and p.snapshot() == {"n": 123.5e1}
    assert p.feed(' "m": -') is False and p.snapshot() == {"n": 1235.0}
    assert p.feed("0}") is True and p.snapshot() == {"n": 1235.0, "m": 0} and p.done


def test_a_literal_appears_once_complete() -> None:
    p = PartialJSON()
    p.feed('[tr')
    assert p.snapshot() == []
    p.feed("ue, nul")
    assert p.snapshot() == [True]
    p.feed("l, false]")
    assert p.snapshot() == [True, None, False] and p.done


def test_an_escape_cut_anywhere_waits_for_its_end() -> None:
    text = '"x\\u00e9\\n\\ud83d\\ude00\\"y"'
    seen = snapshots(list(text))
    assert seen == ["", "x", "xé", "xé\n", "xé\n😀", 'xé\n😀"', 'xé\n😀"y', 'xé\n😀"y']
    assert seen[-1] == json.loads(text)


def test_a_surrogate_half_alone_is_a_replacement_character() -> None:
    assert snapshots(['"\\ud83d', "a", '"'])[-1] == "\ufffda"
    assert snapshots(['"\\ude00"'])[-1] == "\ufffd"


def test_prose_and_a_code_fence_before_the_value_are_skipped() -> None:
    assert snapshots(["Here it is:\n```js", 'on\n{"a": [1, ', "2]}\n```"])[-1] == {"a": [1, 2]}
    assert snapshots(["Sure! ", '{"a": 1}', " and a {}"])[-1] == {"a": 1}
    assert snapshots(['  "top', ' level"'])[-1] == "top level"


def test_the_rest_after_the_value_is_not_read() -> None:
    p = PartialJSON()
    p.feed('{"a": 1} {"b"')
    assert p.done and p.snapshot() == {"a": 1} and p.error is None
    assert p.feed("]]]") is False


@pytest.mark.parametrize(("text", "error"), [
    ('{"a" 1}', "not JSON at character 5: expected ':' after the key, got '1'"),
    ("[1,]", "not JSON at character 3: expected a value, got ']'"),
    ('{"a": 01}', "not JSON at character 8: '01' is not a number"),
    ('{"a": 1]', "not JSON at character 7: ']' does not close the object"),
    ('{"a": "x\ny"}', "not JSON at character 8: a control character ('\\n') inside a string must be escaped"),
    ('["\\x"]', "not JSON at character 3: invalid escape '\\\\x'"),
    ('{"a": trie}', "not JSON at character 8: expected 'true', got 'tri'"),
    ("{1: 2}", "not JSON at character 1: expected a key (a string) or }, got '1'"),
])
def test_a_syntax_error_stops_the_parser_saying_where(text: str, error: str) -> None:
    p = PartialJSON()
    for ch in text:  # cut anywhere: the same error at the same place
        p.feed(ch)
    assert p.error == error
    whole = PartialJSON()
    whole.feed(text)
    assert whole.error == error
    assert p.feed('"more"') is False


def test_nesting_deeper_than_the_limit_is_an_error() -> None:
    p = PartialJSON(max_depth=3)
    p.feed("[[[")
    assert p.error is None and p.snapshot() == [[[]]]
    p.feed("[")
    assert p.error == "not JSON at character 3: arrays and objects nest more than 3 levels deep"


def test_open_paths_name_what_is_still_being_written() -> None:
    p = PartialJSON()
    p.feed('{"a": [1, {"b": "x')
    assert p.open_paths() == ((), ("a",), ("a", 1), ("a", 1, "b"))
    assert p.string_path() == ("a", 1, "b")
    p.feed('"')
    assert p.open_paths() == ((), ("a",), ("a", 1)) and p.string_path() is None


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


def _within(part: Any, whole: Any) -> bool:
    """``part`` is a value on the way to ``whole``: strings are prefixes, containers hold members on the way."""
    if isinstance(part, str):
        return isinstance(whole, str) and whole.startswith(part)
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and _within(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and len(part) <= len(whole) and all(map(_within, part, whole))
    return bool(part == whole and type(part) is type(whole))


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(st.lists(JSON_VALUES), st.dictionaries(st.text(max_size=5), JSON_VALUES)),
       ascii_only=st.booleans(), indent=st.sampled_from([None, 0, 2]), cuts=st.lists(st.integers(0, 400)))
def test_any_json_cut_anywhere_reads_back_whole_and_never_shows_what_it_does_not_hold(
        value: Any, ascii_only: bool, indent: int | None, cuts: list[int]) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    expected = json.loads(text)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    p = PartialJSON()
    previous: Any = None
    for a, b in zip(bounds, bounds[1:]):
        p.feed(text[a:b])
        now = p.snapshot()
        assert p.error is None
        assert _within(now, expected)
        if previous is not None:
            assert _within(previous, now)
        previous = now
    assert p.done and p.snapshot() == expected


# -- checking a partial value ---------------------------------------------------------------------

ORDER = OutputSchema("order", {
    "type": "object",
    "properties": {
        "status": {"enum": ["shipped", "pending"]},
        "code": {"type": "string", "minLength": 4, "maxLength": 6},
        "lines": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "pay": {"anyOf": [{"type": "object", "properties": {"card": {"type": "string"}}, "required": ["card"],
                           "additionalProperties": False},
                          {"type": "object", "properties": {"iban": {"type": "string"}}, "required": ["iban"],
                           "additionalProperties": False}]},
    },
    "required": ["status", "code", "lines"],
})


def check(text: str) -> str | None:
    p = PartialJSON()
    p.feed(text)
    assert p.error is None
    return validate_partial(p.snapshot(), ORDER, p.open_paths(), p.string_path())


@pytest.mark.parametrize("text", [
    "{",
    '{"status": "pen',  # a prefix of an allowed value
    '{"code": "ab',  # too short so far
    '{"lines": [{"sku": "a"',  # an open item missing qty
    '{"lines": [{"sku": "a", "qty": 1}, {',
    '{"pay": {',  # either branch may still be met
    '{"pay": {"iban": "DE',
])
def test_what_the_rest_may_still_make_right_is_forgiven(text: str) -> None:
    assert check(text) is None


@pytest.mark.parametrize(("text", "error"), [
    ('{"status": "lost', "$.status: 'lost' is not one of ['shipped', 'pending'] (failed: enum)"),
    ('{"code": "abcdefg', "$.code: 'abcdefg' is too long (failed: maxLength)"),
    ('{"code": "ab", ', "$.code: 'ab' is too short (failed: minLength)"),  # the string is complete
    ('{"lines": [{"sku": "a"}, ', "$.lines[0]: 'qty' is a required property (failed: required)"),
    ('{"lines": [{"sku": 5,', "$.lines[0].sku: 5 is not of type 'string' (failed: type)"),
    ('{"lines": [{"sku": "a", "qty": 1, "x": 2,', "$.lines[0]: Additional properties are not allowed ('x' was "
                                                 "unexpected) (failed: additionalProperties)"),
    ('{"lines": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 2}, {',
     "$.lines: [{'sku': 'a', 'qty': 1}, {'sku': 'b', 'qty': 2}, {}] is too long (failed: maxItems)"),
    ('{"status": 3', None),  # a number still being read is not shown, so not checked yet
    ('{"status": 3,', "$.status: 3 is not one of ['shipped', 'pending'] (failed: enum)"),
    ('{"pay": {"iban": 7, ', "$.pay: {'iban': 7} is not valid under any of the given schemas (failed: anyOf)"),
])
def test_what_is_already_wrong_is_reported(text: str, error: str | None) -> None:
    assert check(text) == error


# -- through the Agent ---------------------------------------------------------------------------

class Partials(Observer):
    def __init__(self) -> None:
        self.seen: list[OutputPartial] = []

    def on_output_partial(self, event: OutputPartial) -> None:
        self.seen.append(event)


EXPECTED = [  # ANSWER in deltas of 7 characters; a delta that changes nothing gives no event
    ({}, 7), ({"name": "Pari"}, 14), ({"name": "Paris"}, 21), ({"name": "Paris", "population": 2102650}, 42),
    ({"name": "Paris", "population": 2102650, "tags": ["a"]}, 56), (FINAL, 63), (FINAL, 66),
]


async def test_stream_output_gives_the_partial_values_in_order_then_the_validated_one() -> None:
    watcher = Partials()
    agent = Agent(ScriptedProvider([ANSWER], chunk_chars=7), observers=[watcher])
    async with agent.stream_output("Largest city of France?", output_schema=CITY) as stream:
        got = [part async for part in stream]
    assert [(p.value, p.chars) for p in got[:-1]] == EXPECTED
    assert all(p.error is None and not p.validated and p.turn == 1 and p.schema == "city" for p in got[:-1])
    last = got[-1]
    assert last.validated and last.error is None and last.value == FINAL
    assert stream.result.stop.reason is StopReason.COMPLETED
    assert stream.result.output_data == last.value
    assert all(p.session_id == stream.session_id == stream.result.session_id for p in got)
    assert watcher.seen == got  # the observers got the same events


async def test_the_partial_values_stay_out_of_the_session_log_and_history() -> None:
    plain = Agent(ScriptedProvider([ANSWER], chunk_chars=7))
    result = await plain.run("Largest city of France?", output_schema=CITY, session_id="plain")
    streamed = Agent(ScriptedProvider([ANSWER], chunk_chars=7), observers=[Partials()])
    async with streamed.stream_output("Largest city of France?", output_schema=CITY, session_id="streamed") as s:
        assert len([p async for p in s]) == len(EXPECTED) + 1
    plain_log = [e.type for e in await plain.store.read_events("plain")]
    streamed_log = [e.type for e in await streamed.store.read_events("streamed")]
    assert streamed_log == plain_log and "output_partial" not in streamed_log
    assert s.result.messages == result.messages and s.result.output_data == result.output_data == FINAL


async def test_a_partial_value_wrong_so_far_is_reported_and_the_repaired_answer_is_the_validated_one() -> None:
    bad = '{"name": "Paris", "population": "many"}'
    agent = Agent(ScriptedProvider([bad, ANSWER], chunk_chars=35))
    stream = agent.stream_output("Largest city of France?", output_schema=CITY)
    got = [part async for part in stream]
    first = [p for p in got if p.turn == 1]
    assert [(p.value, p.error) for p in first] == [
        ({"name": "Paris", "population": "ma"},  # the string still being written, and wrong already
         "$.population: 'ma' is not of type 'integer' (failed: type)"),
        ({"name": "Paris", "population": "many"}, "$.population: 'many' is not of type 'integer' (failed: type)"),
    ]
    second = [p for p in got if p.turn == 2]
    assert all(p.error is None for p in second) and second[-1].validated and second[-1].value == FINAL
    assert not any(p.validated for p in first)
    assert stream.result.output_data == FINAL and stream.result.turns == 2


async def test_an_answer_that_stops_being_json_says_so_once() -> None:
    agent = Agent(ScriptedProvider(['{"name": "Paris" "population": 1}', '{"name": "Paris", "population": 1}'],
                                   chunk_chars=4))
    got = [p async for p in agent.stream_output("x", output_schema=CITY)]
    first = [p for p in got if p.turn == 1]
    assert first[-1].error == "not JSON at character 17: expected ',' or }, got '\"'"
    assert first[-1].value == {"name": "Paris"} and sum(p.error is not None for p in first) == 1
    assert got[-1].validated and got[-1].value == {"name": "Paris", "population": 1}


async def test_without_streaming_only_the_validated_value_comes() -> None:
    agent = Agent(ScriptedProvider([ANSWER], chunk_chars=7))
    got = [p async for p in agent.stream_output("x", output_schema=CITY, stream=False)]
    assert [(p.value, p.validated) for p in got] == [(FINAL, True)]


async def test_a_run_without_a_valid_answer_ends_with_no_validated_value() -> None:
    agent = Agent(ScriptedProvider(['{"name": 1}', '{"name": 2}'], chunk_chars=5))
    stream = agent.stream_output("x", output_schema=CITY)
    got = [p async for p in stream]
    assert got and not any(p.validated for p in got)
    assert stream.result.stop.reason is StopReason.FAILED_TERMINAL
    assert stream.result.stop.error is not None and stream.result.stop.error["kind"] == "structured_output_invalid"


async def test_leaving_the_block_early_interrupts_the_run() -> None:
    agent = Agent(ScriptedProvider([ANSWER], chunk_chars=7, stream_delay=0.01))
    async with agent.stream_output("x", output_schema=CITY, session_id="early") as stream:
        async for part in stream:
            assert part.value == {}
            break
    record = await agent.store.get_session("early")
    assert record is not None and record.state == StopReason.INTERRUPTED.value
    with pytest.raises(RuntimeError, match="read the output stream to its end"):
        stream.result  # noqa: B018 - the run did not end with a result


def test_stream_output_needs_an_output_schema() -> None:
    agent = Agent(ScriptedProvider(["{}"]))
    with pytest.raises(ConfigurationError, match="needs an output schema"):
        agent.stream_output("x")


async def test_a_sub_agents_answer_is_not_the_callers() -> None:
    inner = Agent(ScriptedProvider(['{"name": "Lyon", "population": 5}'], chunk_chars=8))

    outer = Agent(ScriptedProvider([ANSWER], chunk_chars=7))
    stream = outer.stream_output("x", output_schema=CITY)
    parts = []
    async for part in stream:
        if not parts:  # while the caller's run goes on, another run in its context streams its own answer
            inner_parts = [p async for p in inner.stream_output("y", output_schema=CITY)]
            assert inner_parts[-1].value == {"name": "Lyon", "population": 5}
        parts.append(part)
    assert all(p.session_id == stream.session_id for p in parts) and parts[-1].value == FINAL


# -- recorded traffic ------------------------------------------------------------------------------

PROFILES = {"openai-chat": "openai-compatible", "anthropic": "anthropic"}
RECORDED = [  # the recorded bodies of the corpus whose answer is JSON (none of the Responses API's is)
    ("anthropic/anthropic-sdk-python__429_twice_then_stream.json.2.body",
     OutputSchema("numbers", {"type": "array", "items": {"type": "integer"}}),
     [[], [12345], [12345, 67890]], [12345, 67890]),
    ("openai_chat/openai-python__stream_n3_multiple_choices.sse.0.body",
     OutputSchema("weather", {"type": "object", "required": ["city", "temperature", "units"],
                              "properties": {"city": {"type": "string"}, "temperature": {"type": "integer"},
                                             "units": {"enum": ["c", "f"]}}}),
     [{}, {"city": ""}, {"city": "San"}, {"city": "San Francisco"}, {"city": "San Francisco"},
      {"city": "San Francisco", "temperature": 65}, {"city": "San Francisco", "temperature": 65, "units": ""},
      {"city": "San Francisco", "temperature": 65, "units": "f"},
      {"city": "San Francisco", "temperature": 65, "units": "f"}],
     {"city": "San Francisco", "temperature": 65, "units": "f"}),
]


@pytest.mark.parametrize(("path", "schema", "partials", "final"), RECORDED, ids=[r[0].split("/")[0] for r in RECORDED])
async def test_recorded_streams_give_their_partial_values_then_the_validated_one(
        path: str, schema: OutputSchema, partials: list[Any], final: Any) -> None:
    body = next(b for b in corpus.bodies() if b.path == path)
    server = ReplayServer([RecordedResponse(200, body.data, "text/event-stream")])
    base = await server.start()
    provider = create_provider(PROFILES[body.protocol], ProviderConfig(base_url=base, model="m", api_key="k",
                                                                       retry=RetryPolicy(max_attempts=1)))
    try:
        stream = Agent(provider).stream_output("hi", output_schema=schema)
        got = [p async for p in stream]
    finally:
        await provider.aclose()
        await server.close()
    assert [p.value for p in got[:-1]] == partials
    assert all(p.error is None and not p.validated for p in got[:-1])
    assert got[-1].validated and got[-1].value == final == stream.result.output_data


async def test_an_observer_alone_gets_the_partial_values_of_a_plain_run() -> None:
    watcher = Partials()
    agent = Agent(ScriptedProvider([ANSWER], chunk_chars=7), observers=[watcher])
    result = await agent.run("Largest city of France?", output_schema=CITY)
    assert [(p.value, p.chars) for p in watcher.seen[:-1]] == EXPECTED
    assert watcher.seen[-1].validated and watcher.seen[-1].value == result.output_data == FINAL


def test_the_docs_example_prints_what_the_docs_say(capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "structured-output.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)  # type: ignore[union-attr]
    scope: dict[str, Any] = {}
    exec(compile(code, "structured-output.md", "exec"), scope)  # noqa: S102 - the docs' own example
    asyncio.run(scope["main"]())
    assert capsys.readouterr().out.splitlines() == [
        "{} None False", "{'name': 'Pari'} None False", "{'name': 'Paris'} None False",
        "{'name': 'Paris', 'population': 2102650} None False",
        "{'name': 'Paris', 'population': 2102650} None True", "{'name': 'Paris', 'population': 2102650}"]
