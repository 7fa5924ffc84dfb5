"""Issue 19, item 10: a tool-call fragment never corrupts a finished call.

OpenAI-compatible streams whose ``tool_calls`` fragments come with ``index: null`` or no ``id`` at all
(Qwen, several local servers), written by hand in the style of cases B07-B11 and read through the
real HTTP path, cut at arbitrary byte boundaries. A fragment continues the one call whose arguments
are still open; a call whose JSON is complete is never appended to; text the stream does not
attribute (several calls open, or none) ends the calls concerned with a typed error, so they are
answered with an error result and never run with arguments that may be wrong.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from fsm_agent import Agent, StopReason, tool
from fsm_agent.providers import ProviderConfig, create_provider
from fsm_agent.providers.openai_chat import OpenAIChatStreamParser
from fsm_agent.providers.sse import SSEDecoder
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import MessageComplete, MessageRequest, PartialMessageResponse, UserMessage

SSE = "text/event-stream"


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> bytes:
    data = {"id": "chatcmpl-frag", "object": "chat.completion.chunk", "created": 0, "model": "qwen3-32b",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(data) + b"\n\n"


def frag(args: str | None = None, *, name: str | None = None, cid: str | None = None,
         index: int | None = None) -> dict[str, Any]:
    """One ``tool_calls`` fragment; ``index: null`` unless given, ``id`` absent unless given."""
    out: dict[str, Any] = {"index": index, "type": "function", "function": {"arguments": args}}
    if name is not None:
        out["function"]["name"] = name
    if cid is not None:
        out["id"] = cid
    return out


def body(*fragments: dict[str, Any]) -> bytes:
    return (chunk({"role": "assistant", "content": None})
            + b"".join(chunk({"tool_calls": [f]}) for f in fragments)
            + chunk({}, "tool_calls") + b"data: [DONE]\n\n")


# the calls: (id, name, input, whether it is refused) as the stream should give them
STREAMS: dict[str, tuple[bytes, list[tuple[str, str, dict[str, Any], bool]]]] = {
    "a named fragment after a complete call starts the next call": (
        body(frag('{"city": ', name="weather", cid="call_1"), frag('"Paris"}'),
             frag('{"city": "Oslo"}', name="time")),
        [("call_1", "weather", {"city": "Paris"}, False), ("", "time", {"city": "Oslo"}, False)]),
    "the one open call is continued although a later call is complete": (
        body(frag('{"a": ', name="f", cid="c1"), frag('{"b": 2}', name="g", cid="c2"), frag("1}")),
        [("c1", "f", {"a": 1}, False), ("c2", "g", {"b": 2}, False)]),
    "two calls open and a fragment with neither index nor id: both refused": (
        body(frag('{"city": "Par', name="weather", cid="c1"), frag('{"city": "Lon', name="weather", cid="c2"),
             frag('is"}')),
        [("c1", "weather", {}, True), ("c2", "weather", {}, True)]),
    "argument text after the only call is complete: refused, never glued on": (
        body(frag('{"path": "a.md"}', name="read", cid="c1"), frag('{"path": "b.md"}')),
        [("c1", "read", {}, True)]),
    "whole calls without ids at the same index are two calls": (
        body(frag('{"q": "x"}', name="search", index=0), frag('{"q": "y"}', name="search", index=0)),
        [("", "search", {"q": "x"}, False), ("", "search", {"q": "y"}, False)]),
    "more text at an index whose call is complete: refused": (
        body(frag('{"n": 1}', name="f", cid="c1", index=0), frag(', "m": 2}', index=0)),
        [("c1", "f", {}, True)]),
    "more text at an index and the same id whose call is complete: refused": (
        body(frag('{"n": 1}', name="f", cid="c1", index=0), frag('{"n": 2}', cid="c1", index=0)),
        [("c1", "f", {}, True)]),
    "more text for an id whose call is complete: refused": (
        body(frag('{"n": 1}', name="f", cid="c1"), frag('{"n": 2}', cid="c1")),
        [("c1", "f", {}, True)]),
    "sequential calls with the id in the first fragment only (Qwen)": (
        body(frag("", name="f", cid="c1"), frag('{"a"'), frag(": 1}"), frag("", name="g", cid="c2"),
             frag('{"b": 2'), frag("}"), frag("  \n")),
        [("c1", "f", {"a": 1}, False), ("c2", "g", {"b": 2}, False)]),
    "a parameterless call, then a call whose text has no id": (
        body(frag(None, name="now", cid="c1"), frag("", name="g", cid="c2"), frag('{"b": 2}')),
        [("c1", "now", {}, False), ("c2", "g", {"b": 2}, False)]),
    "the name again with no text after the call is complete starts nothing": (
        body(frag('{"a": 1}', name="f"), frag("", name="f")),
        [("", "f", {"a": 1}, False)]),
}


def decode(raw: bytes, cuts: list[int]) -> list[Any]:
    d, p = SSEDecoder(), OpenAIChatStreamParser("qwen", "qwen@x")
    events: list[Any] = []
    pos = 0
    for cut in [*cuts, len(raw)]:
        for ev in d.feed(raw[pos:cut]):
            events += p.feed(ev)
        pos = cut
    for ev in d.flush():
        events += p.feed(ev)
    return events + p.finish()


def check(resp: Any, want: list[tuple[str, str, dict[str, Any], bool]]) -> None:
    got = [(c.id, c.name, c.input, c.raw_input is not None) for c in resp.tool_calls]
    assert got == want
    for c, (_, _, _, refused) in zip(resp.tool_calls, want, strict=True):
        note = (c.provider_data or {}).get("arguments_error")
        assert (note is not None) is refused, (c, note)
        if refused:
            assert "the stream" in note


@pytest.mark.parametrize("name", list(STREAMS))
@pytest.mark.parametrize("seed", [1, 7, 23])
async def test_fragments_without_index_or_id_over_http(name: str, seed: int) -> None:
    raw, want = STREAMS[name]
    server = ReplayServer([RecordedResponse(200, raw, SSE)], seed=seed)
    base = await server.start()
    p = create_provider("openai-compatible", ProviderConfig(base_url=base, model="qwen3-32b", api_key="k"))
    try:
        events = [ev async for ev in p.chat_stream(MessageRequest("qwen3-32b", (UserMessage("go"),)))]
    finally:
        await p.aclose()
        await server.close()
    final = events[-1]
    assert isinstance(final, MessageComplete)
    check(final.full_response, want)
    fold = PartialMessageResponse(provider=final.full_response.provider, source="openai-chat")
    for ev in events:
        fold.apply(ev)
    assert fold.finalize().message == final.full_response.message  # the events say the same
    ends = [ev.call for ev in events if type(ev).__name__ == "ToolCallEnd"]
    assert [(c.id, c.name, c.input, c.raw_input is not None) for c in ends] == [w[:3] + (w[3],) for w in want]


@pytest.mark.parametrize("name", list(STREAMS))
def test_every_byte_boundary_gives_the_same_calls(name: str) -> None:
    raw, want = STREAMS[name]
    whole = decode(raw, [])[-1].full_response
    check(whole, want)
    for cut in range(1, len(raw)):
        assert decode(raw, [cut])[-1].full_response.message == whole.message, cut
    for a in range(1, len(raw), 7):
        assert decode(raw, [a, min(len(raw), a + 5)])[-1].full_response.message == whole.message


async def test_an_unattributable_fragment_never_runs_a_call_and_the_run_goes_on() -> None:
    """The ambiguous stream of two calls into a plain Agent: neither call runs, the model is told
    each call's arguments did not arrive intact, and the run goes on to the answer."""
    ran: list[str] = []

    @tool
    def weather(city: str) -> str:
        """Weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    raw, _ = STREAMS["two calls open and a fragment with neither index nor id: both refused"]
    answer = chunk({"role": "assistant", "content": "I could not look it up."}) + chunk({}, "stop") + b"data: [DONE]\n\n"
    server = ReplayServer([RecordedResponse(200, raw, SSE), RecordedResponse(200, answer, SSE)], seed=5)
    base = await server.start()
    p = create_provider("openai-compatible", ProviderConfig(base_url=base, model="qwen3-32b", api_key="k"))
    try:
        result = await Agent(p, tools=[weather]).run("Weather in Paris and London?")
    finally:
        await p.aclose()
        await server.close()
    assert ran == []  # never run with "Lonis" or any other guess
    assert result.stop.reason is StopReason.COMPLETED and result.output == "I could not look it up."
    sent = server.requests[1].json()["messages"]
    tools = [m for m in sent if m["role"] == "tool"]
    assert len(tools) == 2 and all("not a valid JSON object" in m["content"] for m in tools)
    calls = next(m for m in sent if m.get("tool_calls"))["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Par', '{"city": "Lon']
