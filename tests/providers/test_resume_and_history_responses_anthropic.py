"""Issue 9 on the Responses and Anthropic protocols, in shapes no case file shows: a truthful stop
reason, an interrupted partial answer resumed, a repeated tool call, a call never answered,
redacted thinking between two calls, and an annotation-bearing Responses stream cut part-way.
Requests and streams go through the real HTTP path (``ReplayServer``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import corpus
from fsm_agent.errors import ProviderConnectionError
from fsm_agent.providers import ProviderConfig, ProviderType, RetryPolicy, create_provider
from fsm_agent.providers.anthropic import CONTINUE, CONTINUE_CUT, MISSING_RESULT, messages_to_wire
from fsm_agent.providers.openai_responses import MISSING_OUTPUT, messages_to_input
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import (AssistantMessage, ExtensionBlock, MessageComplete, MessageRequest, ModelStopReason,
                             PartialMessageResponse, TextBlock, ThinkingBlock, ToolResultMessage, ToolUseBlock,
                             UserMessage)

ANT, RSP = ProviderType.ANTHROPIC, ProviderType.OPENAI_RESPONSES


def provider(kind: ProviderType, base: str) -> Any:
    return create_provider(kind, ProviderConfig(base_url=base + ("/v1" if kind is ANT else ""), api_key="k",
                                                model="m", retry=RetryPolicy(max_attempts=1)))


async def roundtrip(kind: ProviderType, responses: list[RecordedResponse], *requests: MessageRequest,
                    stream: bool = True) -> tuple[list[Any], list[dict[str, Any]]]:
    server = ReplayServer(responses, seed=5)
    p = provider(kind, await server.start())
    out: list[Any] = []
    try:
        for r in requests:
            out.append([e async for e in p.chat_stream(r)] if stream else await p.chat(r))
    finally:
        await p.aclose()
        await server.close()
    return out, [r.json() for r in server.requests]


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def ant_message(content: list[dict[str, Any]], stop: str) -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": content,
            "stop_reason": stop, "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 3}}


def ant_stream(content: list[dict[str, Any]], stop: str) -> bytes:
    evs: list[dict[str, Any]] = [{"type": "message_start", "message": {**ant_message([], None), "stop_reason": None}}]
    for i, b in enumerate(content):
        start = {**b, "input": {}} if b["type"] == "tool_use" else b
        evs.append({"type": "content_block_start", "index": i, "content_block": start})
        if b["type"] == "tool_use":
            evs.append({"type": "content_block_delta", "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}})
        evs.append({"type": "content_block_stop", "index": i})
    evs += [{"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {"output_tokens": 7}},
            {"type": "message_stop"}]
    return sse(*evs)


REQ = MessageRequest(model="m", messages=(UserMessage("hi"),))


# ---------------------------------------------------------------------------- 2. truthful stop
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("content", "wire", "want"), [
    ([{"type": "text", "text": "Hello there."}], "tool_use", ModelStopReason.END_TURN),
    ([{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "No tool needed."}],
     "tool_use", ModelStopReason.END_TURN),
    ([{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}], "end_turn", ModelStopReason.TOOL_USE),
    ([{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}], "max_tokens",
     ModelStopReason.MAX_TOKENS),
    ([{"type": "text", "text": "Searching."}], "pause_turn", ModelStopReason.PAUSE_TURN),
])
async def test_anthropic_stop_reason_follows_the_calls(content: list[dict[str, Any]], wire: str,
                                                       want: ModelStopReason, stream: bool) -> None:
    body = ant_stream(content, wire) if stream else json.dumps(ant_message(content, wire)).encode()
    ctype = "text/event-stream" if stream else "application/json"
    (out,), _ = await roundtrip(ANT, [RecordedResponse(200, body, ctype)], REQ, stream=stream)
    resp = out[-1].full_response if stream else out
    assert resp.stop_reason is want and resp.raw_stop_reason == wire


@pytest.mark.parametrize(("status", "with_call", "want"), [
    ("completed", False, ModelStopReason.END_TURN), ("completed", True, ModelStopReason.TOOL_USE),
    ("incomplete", True, ModelStopReason.MAX_TOKENS)])
async def test_responses_stop_reason_follows_the_calls(status: str, with_call: bool, want: ModelStopReason) -> None:
    output: list[dict[str, Any]] = [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                                     "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]}]
    if with_call:
        output.append({"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}",
                       "status": "completed"})
    resp = {"id": "resp_1", "model": "m", "status": status, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": {"input_tokens": 3, "output_tokens": 2}}
    (out,), _ = await roundtrip(RSP, [RecordedResponse(200, json.dumps(resp).encode())], REQ, stream=False)
    assert out.stop_reason is want


# ---------------------------------------------------------------------------- 3. interrupted, then resumed
WEB = next(b for b in corpus.bodies() if b.path.endswith("vercel-ai__web_search_builtin_tool.chunks.jsonl.0.body"))
TEXT_AT = WEB.data.index(b"response.output_text.delta")


@pytest.mark.parametrize("cut", [0.55, 0.7, 0.85, 0.97])
async def test_responses_annotated_answer_cut_then_resumed(cut: float) -> None:
    """A web-search answer whose stream drops part-way: the partial keeps the text and the annotations
    that had arrived; kept as an interrupted answer, the resumed request is valid and marker-free."""
    drop = TEXT_AT + int((len(WEB.data) - TEXT_AT) * cut)
    full = RecordedResponse(200, WEB.data, "text/event-stream")
    server = ReplayServer([RecordedResponse(200, WEB.data, "text/event-stream", drop_after=drop), full], seed=9)
    p = provider(RSP, await server.start())
    events: list[Any] = []
    try:
        with pytest.raises(ProviderConnectionError) as info:
            async for ev in p.chat_stream(REQ):
                events.append(ev)
        partial = info.value.partial
        assert partial is not None and partial.text
        history = (UserMessage("tech news?"), AssistantMessage(
            partial.content, {**(partial.message.provider_data or {}), "interrupted": True}),
            UserMessage(CONTINUE_CUT))
        resumed = [e async for e in p.chat_stream(MessageRequest(model="m", messages=history))]
    finally:
        await p.aclose()
        await server.close()
    final = resumed[-1].full_response
    assert final.text.startswith(partial.text)  # the cut text is a prefix of the whole answer
    cites = [c for b in partial.content if isinstance(b, TextBlock) for c in b.citations]
    whole = [c for b in final.content if isinstance(b, TextBlock) for c in b.citations]
    assert cites == whole[:len(cites)] and all(c["end_index"] <= len(partial.text) for c in cites)
    # what the events carried so far is what the partial holds, annotations aside (they ride in
    # the text block's ContentBlockEnd, which a cut block never got)
    again = PartialMessageResponse(provider=partial.provider, source="openai-responses")
    for ev in events[:-1]:
        again.apply(ev)
    assert again.snapshot().text == partial.text
    sent = server.requests[1].json()
    assert b'"interrupted"' not in server.requests[1].body
    answer = [it for it in sent["input"] if it.get("role") == "assistant"]
    assert answer and all("id" not in it and "status" not in it for it in answer)
    assert not any(it.get("type") == "reasoning" for it in sent["input"])  # a cut turn's reasoning is not replayed
    assert all(a["type"] == "url_citation" for it in answer for part in it["content"] for a in part["annotations"])
    assert sent["input"][-1] == {"type": "message", "role": "user",
                                 "content": [{"type": "input_text", "text": CONTINUE_CUT}]}


@pytest.mark.parametrize("with_continuation", [True, False])
async def test_anthropic_interrupted_answer_resumed(with_continuation: bool) -> None:
    """A thinking answer cut mid-text: the partial (signed thinking, unsigned thinking, text ending in a
    space) is kept as interrupted. The resumed request ends in a user turn, carries no empty message,
    no reasoning of the cut turn and no marker."""
    stream = sse(
        {"type": "message_start", "message": {**ant_message([], None), "stop_reason": None}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Plan."}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "SIG"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "The answer is "}})
    ok = ant_stream([{"type": "text", "text": "42."}], "end_turn")
    server = ReplayServer([RecordedResponse(200, stream, "text/event-stream"),
                           RecordedResponse(200, ok, "text/event-stream")], seed=2)
    p = provider(ANT, await server.start())
    try:
        with pytest.raises(ProviderConnectionError) as info:
            async for _ in p.chat_stream(REQ):
                pass
        partial = info.value.partial
        assert partial is not None and partial.text == "The answer is "
        cut = AssistantMessage(partial.content + (ThinkingBlock("half a tho", source="anthropic"),),
                               {"interrupted": True})
        history = [UserMessage("q"), cut] + ([UserMessage(CONTINUE_CUT)] if with_continuation else [])
        out = [e async for e in p.chat_stream(MessageRequest(model="m", messages=tuple(history)))]
    finally:
        await p.aclose()
        await server.close()
    assert isinstance(out[-1], MessageComplete)
    sent = server.requests[1].json()["messages"]
    assert b'"interrupted"' not in server.requests[1].body
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"] == [{"type": "text", "text": "The answer is "}]
    assert sent[2]["content"] == [{"type": "text", "text": CONTINUE_CUT}]
    assert all(m["content"] for m in sent)


def test_anthropic_never_ends_in_an_assistant_turn_but_a_paused_one() -> None:
    _, wire = messages_to_wire([UserMessage("q"), AssistantMessage((TextBlock("Partial"),))])
    assert wire[-1] == {"role": "user", "content": [{"type": "text", "text": CONTINUE}]}
    # only thinking left in a cut turn: the turn is dropped, no empty assistant message
    _, wire = messages_to_wire([UserMessage("q"), AssistantMessage((ThinkingBlock("x", "S", source="anthropic"),),
                                                                   {"interrupted": True}), UserMessage("go on")])
    assert [m["role"] for m in wire] == ["user"] and all(m["content"] for m in wire)
    paused = AssistantMessage((ExtensionBlock("server_tool_use", {"id": "srvtoolu_1", "name": "web_search",
                                                                  "input": {"query": "x"}}, "anthropic"),))
    _, wire = messages_to_wire([UserMessage("q"), paused])
    assert wire[-1]["role"] == "assistant"  # pause_turn: sent back as it is, to be continued


# ---------------------------------------------------------------------------- 5. a repeated call
def repeated_history() -> list[Any]:
    call = ToolUseBlock("call_R", "lookup", {"q": "x"})
    return [UserMessage("q"), AssistantMessage((TextBlock("Looking."), call, call)),
            AssistantMessage((call,)),  # "once more", as a second assistant entry
            ToolResultMessage("call_R", "found"), ToolResultMessage("call_R", "found"), UserMessage("thanks")]


def test_responses_sends_a_repeated_call_once_with_its_one_output() -> None:
    _, items = messages_to_input(repeated_history())
    assert [it["type"] for it in items] == ["message", "message", "function_call", "function_call_output", "message"]
    # a later turn reusing the id (call_0 every turn) is a new call with its own output
    again = [*repeated_history(), AssistantMessage((ToolUseBlock("call_R", "lookup", {"q": "y"}),)),
             ToolResultMessage("call_R", "second")]
    _, items = messages_to_input(again)
    outs = [it["output"] for it in items if it["type"] == "function_call_output"]
    assert outs == ["found", "second"]


def test_anthropic_sends_a_repeated_call_once_with_its_one_result() -> None:
    _, wire = messages_to_wire(repeated_history())
    assert [m["role"] for m in wire] == ["user", "assistant", "user"]
    assert [b["type"] for b in wire[1]["content"]] == ["text", "tool_use"]
    assert [b["type"] for b in wire[2]["content"]] == ["tool_result", "text"]


async def test_repeated_call_over_http_on_both_protocols() -> None:
    rsp_ok = json.dumps({"id": "r", "model": "m", "status": "completed", "output": [
        {"id": "msg", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
        "usage": {"input_tokens": 1, "output_tokens": 1}}).encode()
    req = MessageRequest(model="m", messages=tuple(repeated_history()))
    _, (body,) = await roundtrip(RSP, [RecordedResponse(200, rsp_ok)], req, stream=False)
    assert sum(it.get("call_id") == "call_R" for it in body["input"]) == 2  # the call and its output
    ant_ok = json.dumps(ant_message([{"type": "text", "text": "ok"}], "end_turn")).encode()
    _, (body,) = await roundtrip(ANT, [RecordedResponse(200, ant_ok)], req, stream=False)
    flat = [b for m in body["messages"] for b in m["content"]]
    assert sum(b.get("id") == "call_R" or b.get("tool_use_id") == "call_R" for b in flat) == 2


# ---------------------------------------------------------------------------- a call never answered
def test_a_call_never_answered_gets_an_error_result_on_both() -> None:
    history = [UserMessage("q"), AssistantMessage((ToolUseBlock("c1", "f", {}), ToolUseBlock("c2", "g", {}))),
               ToolResultMessage("c2", "done"), UserMessage("and?")]
    _, items = messages_to_input(history)
    assert [(it["type"], it.get("call_id")) for it in items[1:4]] == [
        ("function_call", "c1"), ("function_call", "c2"), ("function_call_output", "c1")]
    assert items[3]["output"] == MISSING_OUTPUT and items[4]["call_id"] == "c2"
    _, wire = messages_to_wire(history)
    results = [b for b in wire[2]["content"] if b["type"] == "tool_result"]
    assert [r["tool_use_id"] for r in results] == ["c1", "c2"]
    assert results[0]["is_error"] is True and results[0]["content"] == MISSING_RESULT
    # a history that ends in the call: the result follows (no prefill, no unpaired call)
    _, wire = messages_to_wire(history[:2])
    assert wire[-1]["role"] == "user" and [b["tool_use_id"] for b in wire[-1]["content"]] == ["c1", "c2"]


# ---------------------------------------------------------------------------- redacted thinking between calls
async def test_anthropic_redacted_thinking_between_two_calls_round_trips() -> None:
    content = [{"type": "thinking", "thinking": "", "signature": "SIG_A"},
               {"type": "tool_use", "id": "toolu_A", "name": "f", "input": {"n": 1}},
               {"type": "redacted_thinking", "data": "OPAQUE_B"},
               {"type": "tool_use", "id": "toolu_B", "name": "f", "input": {"n": 2}}]
    ok = ant_stream([{"type": "text", "text": "done"}], "end_turn")
    server = ReplayServer([RecordedResponse(200, ant_stream(content, "tool_use"), "text/event-stream"),
                           RecordedResponse(200, ok, "text/event-stream")], seed=4)
    p = provider(ANT, await server.start())
    try:
        first = [e async for e in p.chat_stream(REQ)]
        msg = first[-1].full_response.message
        again = PartialMessageResponse(provider="anthropic", source="anthropic")
        for ev in first:
            again.apply(ev)
        assert again.finalize().message == msg
        assert first[-1].full_response.stop_reason is ModelStopReason.TOOL_USE
        history = (UserMessage("hi"), msg, ToolResultMessage("toolu_B", "2"), ToolResultMessage("toolu_A", "1"))
        [e async for e in p.chat_stream(MessageRequest(model="m", messages=history))]
    finally:
        await p.aclose()
        await server.close()
    sent = server.requests[1].json()["messages"]
    assert sent[1]["content"] == content
    assert [b["tool_use_id"] for b in sent[2]["content"]] == ["toolu_A", "toolu_B"]
