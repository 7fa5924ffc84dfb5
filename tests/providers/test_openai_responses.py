"""OpenAI Responses protocol: every recorded Responses body over real HTTP, the request mapping,
follow-up requests rebuilt from neutral messages, case B05 and B20's Responses case.

Expected values come from a deliberately naive reading of the recorded events written here
(split frames on blank lines, join ``data:`` lines, concatenate deltas by item), plus literals
copied from the recordings; never from the module under test.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from attrs import evolve

import corpus
from fsm_agent.errors import (ContextLengthExceededError, InvalidRequestError, ProviderConnectionError,
                              ProviderError, ProviderProtocolError)
from fsm_agent.providers import ProviderConfig, ProviderType, RetryPolicy, create_provider
from fsm_agent.providers.openai_responses import (OpenAIResponsesProvider, keep_reasoning_items,
                                                  messages_to_input)
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import (AssistantMessage, AudioBlock, ErrorEvent, ExtensionBlock, FileBlock, ImageBlock,
                             MessageComplete, MessageRequest, MessageResponse, MessageStart, ModelStopReason,
                             PartialMessageResponse, RefusalDelta, SystemMessage, TextBlock, ThinkingBlock,
                             ThinkingConfig, ToolDefinition, ToolResultMessage, ToolUseBlock, Usage,
                             UserImageMessage, UserMessage)

SRC = "openai-responses"
BODIES = [b for b in corpus.bodies() if b.protocol == SRC]
REQUEST = MessageRequest(model="m", messages=(UserMessage("hi"),))

# Exact error kind of every failing body (HTTP error or failure inside a 200 stream).
ERROR_KINDS = {
    "deepseek/pydantic-ai__responses_api_400.yaml.0.body": "invalid_history",
    "openai_responses/dd-trace-py__response_401_invalid_api_key.yaml.0.body": "authentication",
    "openai_responses/observed__error_payloads.jsonl.0.body": "server_error",
    "openai_responses/observed__error_payloads.jsonl.1.body": "server_error",
    "openai_responses/pydantic-ai__model_not_found_400_responses.yaml.0.body": "not_found",
    "openai_responses/pydantic-ai__responses_stream_request_400.yaml.0.body": "invalid_request",
    "openai_responses/vercel-ai__error_insufficient_quota.json.0.body": "quota_exceeded",
    "openai_responses/vercel-ai__stream_error_insufficient_quota.chunks.jsonl.0.body": "quota_exceeded",
}
SUCCESS = [b for b in BODIES if b.path not in ERROR_KINDS]
FAILURES = [b for b in BODIES if b.path in ERROR_KINDS]


# ---------------------------------------------------------------------------- naive reading
def sse_payloads(data: bytes) -> list[dict[str, Any]]:
    """Every event payload: frames split on blank lines, ``data:`` lines joined."""
    text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    out = []
    for frame in text.split("\n\n"):
        lines = [ln[5:].lstrip(" ") for ln in frame.split("\n") if ln.startswith("data:")]
        if lines:
            out.append(json.loads("\n".join(lines)))
    return out


def naive_stream(data: bytes) -> dict[str, Any]:
    """Reference reading of a Responses stream: deltas concatenated per item, ids from ``added``."""
    events = sse_payloads(data)
    text: list[str] = []
    calls: dict[str, dict[str, Any]] = {}
    reasoning: dict[str, dict[tuple[str, int], str]] = {}
    order: list[tuple[str, str]] = []
    encrypted: dict[str, bool] = {}
    cites = 0
    terminal: dict[str, Any] = {}
    for ev in events:
        t = ev["type"]
        if t == "response.output_item.added":
            item = ev["item"]
            order.append((item["type"], item["id"]))
            if item["type"] == "function_call":
                calls[item["id"]] = {"id": item["call_id"], "name": item["name"], "args": ""}
            if item["type"] == "reasoning":
                reasoning[item["id"]] = {}
        elif t == "response.output_item.done" and ev["item"]["type"] == "reasoning":
            encrypted[ev["item"]["id"]] = bool(ev["item"].get("encrypted_content"))
        elif t == "response.output_text.delta":
            text.append(ev["delta"])
        elif t == "response.output_text.annotation.added":
            cites += 1
        elif t == "response.function_call_arguments.delta":
            calls[ev["item_id"]]["args"] += ev["delta"]
        elif t == "response.reasoning_summary_text.delta":
            seg = reasoning[ev["item_id"]].setdefault(("s", ev["summary_index"]), "")
            reasoning[ev["item_id"]][("s", ev["summary_index"])] = seg + ev["delta"]
        elif t == "response.reasoning_text.delta":
            seg = reasoning[ev["item_id"]].setdefault(("c", ev["content_index"]), "")
            reasoning[ev["item_id"]][("c", ev["content_index"])] = seg + ev["delta"]
        elif t in ("response.completed", "response.incomplete"):
            terminal = ev["response"]
    out_calls = [{"id": c["id"], "name": c["name"], "input": json.loads(c["args"] or "{}"), "fc": fc}
                 for fc, c in calls.items()]
    thinking = ["\n\n".join(v for _, v in sorted(reasoning[i].items())) for k, i in order if k == "reasoning"]
    enc = [encrypted.get(i, False) for k, i in order if k == "reasoning"]
    return {"text": "".join(text), "calls": out_calls, "thinking": thinking, "encrypted": enc,
            "kinds": [k for k, _ in order], "citations": cites, "terminal": terminal}


def naive_json(resp: dict[str, Any]) -> dict[str, Any]:
    """Reference reading of a non-streamed response object."""
    text, calls, thinking, enc, kinds, cites = [], [], [], [], [], 0
    for item in resp["output"]:
        kinds.append(item["type"])
        if item["type"] == "message":
            for part in item["content"]:
                text.append(part.get("text", ""))
                cites += len(part.get("annotations") or [])
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "name": item["name"], "input": json.loads(item["arguments"]),
                          "fc": item["id"]})
        elif item["type"] == "reasoning":
            thinking.append("\n\n".join(s["text"] for s in item.get("summary") or []))
            enc.append(bool(item.get("encrypted_content")))
    return {"text": "".join(text), "calls": calls, "thinking": thinking, "encrypted": enc, "kinds": kinds,
            "citations": cites, "terminal": resp}


def naive_stop(terminal: dict[str, Any], has_calls: bool) -> ModelStopReason:
    if terminal["status"] == "incomplete":
        reason = terminal["incomplete_details"]["reason"]
        return ModelStopReason.MAX_TOKENS if reason == "max_output_tokens" else ModelStopReason.CONTENT_FILTERED
    return ModelStopReason.TOOL_USE if has_calls else ModelStopReason.END_TURN


def check_against(resp: MessageResponse, ref: dict[str, Any]) -> None:
    term = ref["terminal"]
    assert resp.text == ref["text"]
    assert [{"id": c.id, "name": c.name, "input": c.input, "fc": (c.provider_data or {}).get("id")}
            for c in resp.tool_calls] == ref["calls"]
    thinking = [b for b in resp.content if isinstance(b, ThinkingBlock)]
    assert [b.thinking for b in thinking] == ref["thinking"]
    assert [bool((b.provider_data or {}).get("encrypted_content")) for b in thinking] == ref["encrypted"]
    assert all(b.source == SRC for b in thinking)
    kinds: dict[type, str] = {ToolUseBlock: "function_call", ThinkingBlock: "reasoning"}
    seen = [b.kind if isinstance(b, ExtensionBlock) else kinds[type(b)] for b in resp.content
            if not isinstance(b, TextBlock)]
    assert seen == [k for k in ref["kinds"] if k != "message"]
    assert sum(len(b.citations) for b in resp.content if isinstance(b, TextBlock)) == ref["citations"]
    assert resp.stop_reason is naive_stop(term, bool(ref["calls"]))
    assert resp.id == term["id"] and resp.model == term["model"]
    u = term["usage"]
    assert resp.usage == Usage(u["input_tokens"], u["output_tokens"], u["input_tokens_details"]["cached_tokens"],
                               0, u["output_tokens_details"]["reasoning_tokens"])


# ---------------------------------------------------------------------------- replay helpers
def provider_for(base: str) -> OpenAIResponsesProvider:
    p = create_provider(ProviderType.OPENAI_RESPONSES, ProviderConfig(
        base_url=base, api_key="test", model="m", retry=RetryPolicy(max_attempts=1)))
    assert isinstance(p, OpenAIResponsesProvider)
    return p


async def run(responses: list[RecordedResponse], request: MessageRequest, stream: bool,
              seed: int | None = 1) -> tuple[list[Any], ReplayServer]:
    """One call through a ReplayServer; returns (events or [response], server)."""
    server = ReplayServer(responses, seed=seed)
    provider = provider_for(await server.start())
    try:
        if stream:
            return [ev async for ev in provider.chat_stream(request)], server
        return [await provider.chat(request)], server
    finally:
        await provider.aclose()
        await server.close()


def final_payload(data: bytes) -> dict[str, Any]:
    terminal = ("response.completed", "response.incomplete")
    return next(e["response"] for e in sse_payloads(data) if e["type"] in terminal)


def test_every_recorded_body_is_classified() -> None:
    assert len(BODIES) == 32
    assert {b.path for b in FAILURES} == set(ERROR_KINDS)
    assert len(SUCCESS) == 24


# ---------------------------------------------------------------------------- recorded successes
@pytest.mark.parametrize("body", [b for b in SUCCESS if b.streaming], ids=lambda b: b.path)
@pytest.mark.parametrize("seed", [1, 2])
async def test_streamed_recording_decodes(body: corpus.Body, seed: int) -> None:
    events, server = await run([RecordedResponse(body.status, body.data, body.content_type)], REQUEST, True, seed)
    assert server.requests[0].path == "/responses"
    final = events[-1]
    assert isinstance(final, MessageComplete)
    assert sum(isinstance(e, MessageComplete) for e in events) == 1
    resp = final.full_response
    check_against(resp, naive_stream(body.data))
    # the events folded again give the same blocks, reasoning data and annotations included (they
    # ride in ContentBlockEnd; a block the final payload revises gets one more ContentBlockEnd)
    again = PartialMessageResponse(provider=resp.provider, source=SRC)
    for ev in events:
        again.apply(ev)
    assert again.finalize().message.content == resp.content
    # and the stream equals the non-streamed reading of its final payload
    assert provider_for("http://127.0.0.1:9").parse_response(final_payload(body.data)) == resp


@pytest.mark.parametrize("body", [b for b in SUCCESS if not b.streaming], ids=lambda b: b.path)
async def test_non_streamed_recording_decodes(body: corpus.Body) -> None:
    (resp,), _ = await run([RecordedResponse(body.status, body.data, body.content_type)], REQUEST, False)
    check_against(resp, naive_json(json.loads(body.data)))


LITERALS: dict[str, dict[str, Any]] = {
    "openai_responses/simonw-llm__responses_basic_streaming.yaml.0.body": {
        "text": "pong", "stop": ModelStopReason.END_TURN, "raw": "completed", "usage": Usage(11, 5),
        "id": "resp_00592e63e61b66660169fab1b9f8e481a2b321356198d7ac1b", "model": "gpt-5.5-2026-04-23",
        "message_data": {"text_item_ids": ["msg_00592e63e61b66660169fab1bada8481a28ef92eb62c168ead"],
                         "item_phases": {"msg_00592e63e61b66660169fab1bada8481a28ef92eb62c168ead": "final_answer"}}},
    "openai_responses/dd-trace-py__response_stream_incomplete.yaml.0.body": {
        "text": "In the bustling city of Detroit, a sleek, metallic blue sedan rolled off the",
        "stop": ModelStopReason.MAX_TOKENS, "raw": "max_output_tokens", "usage": Usage(0, 0)},
    "openai_responses/simonw-llm__responses_tool_use_streaming.yaml.0.body": {
        "calls": [("call_sVidsfFJ6zlzRpelrPkTPlpd", "multiply", {"a": 1231, "b": 2331},
                   "fc_00d64fa806f333310169fab1bf324481a0852cda3180856290")],
        "stop": ModelStopReason.TOOL_USE, "raw": "completed", "usage": Usage(58, 23)},
    "openai_responses/fantasy__gpt5_parallel_function_calls_streaming.yaml.0.body": {
        "calls": [("call_inViAUr9eV0GDtyOywkCxp59", "add", {"a": 2, "b": 3},
                   "fc_0a7836d50cf181dd016a3c12307fa481a1a06adb8b03345a43"),
                  ("call_Op66UUnzuOoKmgGeFJQJFTUY", "multiply", {"a": 2, "b": 3},
                   "fc_0a7836d50cf181dd016a3c12307fc081a1affc9e4960f41492")],
        "reasoning": [({"id": "rs_0a7836d50cf181dd016a3c122e5e1881a1b60647835c2c9ab0", "summary": []}, "")],
        "usage": Usage(109, 223, 0, 0, 128), "stop": ModelStopReason.TOOL_USE},
    "deepseek/pydantic-ai__responses_api_function_tool_stream.yaml.0.body": {
        "calls": [("call_00_xjY8Z2BvSlzgEmmw0DtH0464", "get_temperature", {"city": "Tokyo"},
                   "62bf2bb7-56af-4e3a-883b-83d4aad54da1")],
        "reasoning": [({"id": "fa6f3a83-5d25-46e8-9d03-1a89ce5cf2ba", "summary": [], "content": [
            {"type": "reasoning_text", "text": "The user asks about temperature in Tokyo. I'll call the tool."}]},
            "The user asks about temperature in Tokyo. I'll call the tool.")],
        "usage": Usage(366, 59, 256, 0, 14)},
    "openai_responses/simonw-llm__responses_encrypted_reasoning_roundtrip.yaml.0.body": {
        "encrypted_prefix": ["gAAAAABp-rIaNe6WknTM"], "stop": ModelStopReason.TOOL_USE},
    # encrypted_content differs between output_item.added (gAAAAABpPDIUph8c...), output_item.done
    # (gAAAAABpPDIVOKrs...) and response.completed: the final payload's is the one kept
    "openai_responses/vercel-ai__reasoning_encrypted_content.chunks.jsonl.0.body": {
        "thinking_prefix": ["**Calculating step-by-step using calculator**\n\nI'll compute 12 plus 7"],
        "encrypted_prefix": ["gAAAAABpPDIVYBwu2ljd"]},
    "openai_responses/vercel-ai__web_search_builtin_tool.chunks.jsonl.0.body": {
        "extensions": 6, "first_query": "tech news today December 5 2025", "citations": 12,
        "usage": Usage(31073, 4416, 3712, 0, 3712)},
}


@pytest.mark.parametrize("path", sorted(LITERALS))
async def test_recorded_literals(path: str) -> None:
    body = next(b for b in BODIES if b.path == path)
    want = LITERALS[path]
    rec = RecordedResponse(body.status, body.data, body.content_type)
    out, _ = await run([rec], REQUEST, body.streaming, seed=5)
    resp: Any = out[-1].full_response if body.streaming else out[0]
    checks: dict[str, Any] = {
        "text": lambda v: resp.text == v, "stop": lambda v: resp.stop_reason is v,
        "raw": lambda v: resp.raw_stop_reason == v, "usage": lambda v: resp.usage == v,
        "id": lambda v: resp.id == v, "model": lambda v: resp.model == v,
        "message_data": lambda v: resp.message.provider_data == v,
        "calls": lambda v: [(c.id, c.name, c.input, (c.provider_data or {})["id"]) for c in resp.tool_calls] == v,
        "reasoning": lambda v: [(b.provider_data, b.thinking) for b in resp.content
                                if isinstance(b, ThinkingBlock)] == v,
        "encrypted_prefix": lambda v: [(b.provider_data or {})["encrypted_content"][:20] for b in resp.content
                                       if isinstance(b, ThinkingBlock)] == v,
        "thinking_prefix": lambda v: [b.thinking[:len(p)] for b, p in zip(
            [b for b in resp.content if isinstance(b, ThinkingBlock)], v)] == v,
        "extensions": lambda v: [b.kind for b in resp.content
                                 if isinstance(b, ExtensionBlock)] == ["web_search_call"] * v,
        "first_query": lambda v: next(b for b in resp.content
                                      if isinstance(b, ExtensionBlock)).data["action"]["query"] == v,
        "citations": lambda v: len(next(b for b in resp.content if isinstance(b, TextBlock)).citations) == v,
    }
    for key, check in checks.items():
        if key in want:
            assert check(want[key]), (key, want[key])


# ---------------------------------------------------------------------------- recorded failures
@pytest.mark.parametrize("body", FAILURES, ids=lambda b: b.path)
async def test_recorded_failure_raises_typed_error(body: corpus.Body) -> None:
    rec = RecordedResponse(body.status, body.data, body.content_type)
    events: list[Any] = []
    # HTTP error bodies are written whole: HttpClient.post reads them with one
    # ``content.read(limit)``, which returns only the first piece of a body sent in pieces
    server = ReplayServer([rec], seed=7 if body.status == 200 else None)
    provider = provider_for(await server.start())
    try:
        with pytest.raises(ProviderError) as info:
            if body.streaming:
                async for ev in provider.chat_stream(REQUEST):
                    events.append(ev)
            else:
                await provider.chat(REQUEST)
    finally:
        await provider.aclose()
        await server.close()
    err = info.value
    assert err.kind == ERROR_KINDS[body.path]
    assert not any(isinstance(e, MessageComplete) for e in events)
    if body.streaming:
        assert isinstance(events[-1], ErrorEvent) and events[-1].kind == err.kind
    if body.status >= 400:
        assert err.status == body.status
    if err.kind == "quota_exceeded":
        assert err.retryable is False and err.code == "insufficient_quota"
    if body.path.startswith("deepseek/"):  # DeepSeek answers 400 as application/octet-stream
        assert isinstance(err, InvalidRequestError) and "No tool output found for tool call call-a" in str(err)


def _frames(data: bytes) -> list[bytes]:
    return [f + b"\n\n" for f in data.replace(b"\r\n", b"\n").split(b"\n\n") if f.strip()]


async def test_stream_cut_after_content_is_a_connection_error_with_partial() -> None:
    body = next(b for b in BODIES if b.path.endswith("simonw-llm__responses_basic_streaming.yaml.0.body"))
    cut = b"".join(f for f in _frames(body.data) if b"response.completed" not in f)
    events: list[Any] = []
    server = ReplayServer([RecordedResponse(200, cut, "text/event-stream")], seed=3)
    provider = provider_for(await server.start())
    try:
        with pytest.raises(ProviderConnectionError) as info:
            async for ev in provider.chat_stream(REQUEST):
                events.append(ev)
    finally:
        await provider.aclose()
        await server.close()
    assert info.value.partial is not None and info.value.partial.text == "pong"
    assert isinstance(events[-1], ErrorEvent) and events[-1].kind == "connection"


async def test_stream_with_no_output_and_no_terminal_is_a_protocol_error() -> None:
    body = next(b for b in BODIES if b.path.endswith("simonw-llm__responses_basic_streaming.yaml.0.body"))
    head = b"".join(_frames(body.data)[:2])  # response.created, response.in_progress
    with pytest.raises(ProviderProtocolError):
        await run([RecordedResponse(200, head, "text/event-stream")], REQUEST, True)


async def test_response_failed_alone_raises_its_error() -> None:
    body = next(b for b in BODIES if b.path.endswith("stream_error_insufficient_quota.chunks.jsonl.0.body"))
    without_error_event = b"".join(f for f in _frames(body.data) if b'"type":"error"' not in f)
    with pytest.raises(ProviderError) as info:
        await run([RecordedResponse(200, without_error_event, "text/event-stream")], REQUEST, True)
    assert info.value.kind == "quota_exceeded"


@pytest.mark.parametrize("dropped", [(b"_arguments.delta",), (b"_arguments.",), (b"_arguments.", b"output_item.done"),
                                     (b"output_text.delta",), (b"output_text.", b"content_part.", b"output_item.")])
async def test_done_events_and_final_payload_fill_what_deltas_missed(dropped: tuple[bytes, ...]) -> None:
    tool = next(b for b in BODIES if b.path.endswith("simonw-llm__responses_tool_use_streaming.yaml.0.body"))
    text = next(b for b in BODIES if b.path.endswith("fantasy__gpt5_parallel_function_calls_streaming.yaml.1.body"))
    body = tool if b"_arguments." in dropped[0] else text
    kept = b"".join(f for f in _frames(body.data) if not any(d in f for d in dropped))
    events, _ = await run([RecordedResponse(200, kept, "text/event-stream")], REQUEST, True)
    full = events[-1].full_response
    if body is tool:
        want = [("call_sVidsfFJ6zlzRpelrPkTPlpd", {"a": 1231, "b": 2331})]
        assert [(c.id, c.input) for c in full.tool_calls] == want
    else:
        assert full.text == "Results:\n- Addition (2 + 3) = 5\n- Multiplication (2 \u00d7 3) = 6"
    assert full == provider_for("http://127.0.0.1:9").parse_response(final_payload(body.data))


async def test_stream_without_created_still_starts_with_message_start() -> None:
    body = next(b for b in BODIES if b.path.endswith("simonw-llm__responses_tool_use_streaming.yaml.1.body"))
    headless = b"".join(f for f in _frames(body.data)
                        if b"response.created" not in f and b"response.in_progress" not in f)
    events, _ = await run([RecordedResponse(200, headless, "text/event-stream")], REQUEST, True)
    assert isinstance(events[0], MessageStart) and sum(isinstance(e, MessageStart) for e in events) == 1
    full = events[-1].full_response
    assert (full.id, full.text) == ("resp_0dacb603de1c9e6b0169fab1c2314081a3b1df3cc5c09e0c60",
                                    "1231 × 2331 = **2,869,461**")


async def test_refusal_stream_matches_final_payload() -> None:
    resp: dict[str, Any] = {"id": "resp_r", "model": "gpt-4o", "status": "completed", "output": [
        {"id": "msg_r", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "refusal", "refusal": "I can't help with that."}]}],
        "usage": {"input_tokens": 3, "output_tokens": 6}}
    frames = [
        {"type": "response.created", "response": {**resp, "status": "in_progress", "output": []}},
        {"type": "response.output_item.added", "output_index": 0, "item": {**resp["output"][0], "content": []}},
        {"type": "response.content_part.added", "output_index": 0, "content_index": 0, "item_id": "msg_r",
         "part": {"type": "refusal", "refusal": ""}},
        {"type": "response.refusal.delta", "output_index": 0, "content_index": 0, "item_id": "msg_r",
         "delta": "I can't "},
        {"type": "response.refusal.done", "output_index": 0, "content_index": 0, "item_id": "msg_r",
         "refusal": "I can't help with that."},
        {"type": "response.completed", "response": resp}]
    data = b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames)
    events, _ = await run([RecordedResponse(200, data, "text/event-stream")], REQUEST, True)
    assert [e.text for e in events if isinstance(e, RefusalDelta)] == ["I can't ", "help with that."]
    full = events[-1].full_response
    assert (full.refusal, full.stop_reason, full.usage) == ("I can't help with that.", ModelStopReason.REFUSAL,
                                                            Usage(3, 6))
    assert provider_for("http://127.0.0.1:9").parse_response(resp) == full


def test_status_mapping() -> None:
    parse = provider_for("http://127.0.0.1:9").parse_response
    base = {"id": "resp_s", "model": "gpt-4o", "output": [{"type": "message", "id": "msg_s", "role": "assistant",
                                                           "content": [{"type": "output_text", "text": "Par"}]}]}
    cut = parse({**base, "status": "incomplete", "incomplete_details": {"reason": "content_filter"}})
    assert (cut.stop_reason, cut.raw_stop_reason, cut.text) == (ModelStopReason.CONTENT_FILTERED, "content_filter", "Par")
    with pytest.raises(ProviderError) as info:
        parse({**base, "status": "failed", "error": {"code": "server_error", "message": "boom"}})
    assert info.value.kind == "server_error"


async def test_non_json_error_event_is_a_provider_error() -> None:
    data = b'event: error\ndata: upstream overloaded, try later\n\n'
    with pytest.raises(ProviderError) as info:
        await run([RecordedResponse(200, data, "text/event-stream")], REQUEST, True)
    assert info.value.kind == "overloaded" and "upstream overloaded" in str(info.value)


@pytest.mark.parametrize("where", ["http", "stream"])
async def test_b20_azure_style_context_error(where: str) -> None:
    case = next(c for c in json.loads(corpus.case("B20.json").read_text())["cases"]
                if c["name"] == "azure_style_no_code")
    want = json.loads(corpus.case("B20.expected.json").read_text())["per_case"]["azure_style_no_code"]
    if where == "http":
        rec = RecordedResponse(case["status"], json.dumps(case["body"]).encode())
    else:
        failed = {"type": "response.failed", "response": {"id": "resp_x", "status": "failed", "output": [],
                                                          "error": case["body"]["error"]}}
        rec = RecordedResponse(200, b"data: " + json.dumps(failed).encode() + b"\n\n", "text/event-stream")
    with pytest.raises(ContextLengthExceededError) as info:
        await run([rec], REQUEST, where == "stream")
    assert (info.value.kind, info.value.limit, info.value.requested) == (want["kind"], want["limit"],
                                                                         want["requested"])


# ---------------------------------------------------------------------------- follow-up requests
def _text(content: Any) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def request_from_recording(req: dict[str, Any]) -> MessageRequest:
    """The recorded first request as a neutral request (messages, tools, options)."""
    inp = req["input"]
    msgs: list[Any] = []
    for item in [{"role": "user", "content": inp}] if isinstance(inp, str) else inp:
        cls = UserMessage if item["role"] == "user" else SystemMessage
        msgs.append(cls(_text(item["content"])))
    tools = [ToolDefinition(t["name"], t["description"], t["parameters"], t.get("strict"))
             for t in req.get("tools", [])]
    r = req.get("reasoning")
    extra: dict[str, Any] = {k: req[k] for k in ("store", "include") if k in req}
    return MessageRequest(model=req["model"], messages=msgs, tools=tools, tool_choice=req.get("tool_choice"),
                          max_tokens=req.get("max_output_tokens"), temperature=req.get("temperature"),
                          thinking=ThinkingConfig(effort=r.get("effort"), summary=r.get("summary")) if r else None,
                          extra=extra)


def norm(item: dict[str, Any]) -> tuple[Any, ...]:
    """An input item reduced to the protocol fields compared with the recording."""
    kind = item.get("type", "message")
    if kind == "message":
        role = "system" if item["role"] in ("developer", "system") else item["role"]
        return ("message", role, _text(item["content"]))
    if kind == "function_call":
        return (kind, item["call_id"], item["name"], json.loads(item["arguments"]))
    if kind == "function_call_output":
        return (kind, item["call_id"], item["output"])
    assert kind == "reasoning", item
    return (kind, item["id"], item.get("encrypted_content"), tuple(p["text"] for p in item.get("content") or ()),
            tuple(p["text"] for p in item["summary"]))


FOLLOW_UPS = {
    "openai_responses/simonw-llm__responses_encrypted_reasoning_roundtrip.yaml": "",
    "openai_responses/simonw-llm__responses_interleaved_reasoning_tool_calls.yaml": "",
    "openai_responses/simonw-llm__responses_tool_use_streaming.yaml": "",
    "openai_responses/fantasy__gpt5_parallel_function_calls_streaming.yaml": "",
    "openai_responses/fantasy__gpt5_reasoning_summary_streaming.yaml": "client_drops_reasoning",
    "openai_responses/pydantic-ai__responses_stream_tool_loop.yaml": "client_sends_item_id_as_call_id",
    "deepseek/pydantic-ai__responses_api_function_tool_stream.yaml": "",
}


@pytest.mark.parametrize("recording", sorted(FOLLOW_UPS))
async def test_follow_up_requests_match_the_recording(recording: str) -> None:
    quirk = FOLLOW_UPS[recording]
    exchanges = corpus.exchanges(recording)
    stream = bool(exchanges[0].request.get("stream"))
    ctype = "text/event-stream" if stream else "application/json"
    server = ReplayServer([RecordedResponse(e.status, e.body, ctype) for e in exchanges], seed=11)
    provider = provider_for(await server.start())
    request = request_from_recording(exchanges[0].request)
    history = list(request.messages)
    answers: list[MessageResponse] = []
    try:
        for i, ex in enumerate(exchanges):
            call = evolve(request, messages=history)
            if stream:
                last = [ev async for ev in provider.chat_stream(call)][-1]
                assert isinstance(last, MessageComplete)
                resp = last.full_response
            else:
                resp = await provider.chat(call)
            answers.append(resp)
            sent, recorded = server.requests[i].json(), ex.request
            for key, value in recorded.items():
                if key not in ("input", "instructions", "stream"):
                    assert sent[key] == value, key
            assert sent.get("stream", False) == recorded.get("stream", False)
            ours: list[tuple[Any, ...]] = []
            if "instructions" in sent:
                ours.append(("message", "system", sent["instructions"]))
            ours += [norm(it) for it in sent["input"]]
            theirs = [norm(it) for it in recorded["input"]]
            if quirk == "client_drops_reasoning":  # fantasy does not replay reasoning; we do
                ours = [it for it in ours if it[0] != "reasoning"]
                sent_rs = [it for it in sent["input"] if it["type"] == "reasoning"]
                assert [it["encrypted_content"] for it in sent_rs] == [
                    (b.provider_data or {})["encrypted_content"] for a in answers[:i] for b in a.content
                    if isinstance(b, ThinkingBlock)]
            if quirk == "client_sends_item_id_as_call_id":  # pydantic-ai sent fc_ ids as call_id
                ours = [(*it[:1], *it[2:]) if it[0].startswith("function_call") else it for it in ours]
                theirs = [(*it[:1], *it[2:]) if it[0].startswith("function_call") else it for it in theirs]
            assert ours == theirs
            if i + 1 == len(exchanges):
                break
            known = {it["call_id"] for it in recorded["input"] if it.get("type") == "function_call_output"}
            outputs = [it["output"] for it in exchanges[i + 1].request["input"]
                       if it.get("type") == "function_call_output" and it["call_id"] not in known]
            assert len(outputs) == len(resp.tool_calls)
            history.append(resp.message)
            history += [ToolResultMessage(c.id, out) for c, out in zip(resp.tool_calls, outputs)]
    finally:
        await provider.aclose()
        await server.close()
    if recording.startswith("openai_responses/fantasy__gpt5_parallel"):
        # store: false and a reasoning item without encrypted_content: it cannot be replayed,
        # so the calls go without their fc_ ids, exactly as the recorded client sent them
        assert server.requests[1].json()["input"][1:3] == exchanges[1].request["input"][2:4]


# ---------------------------------------------------------------------------- case B05
def b05_messages(items: list[dict[str, Any]]) -> list[Any]:
    """The case's input array as neutral messages: consecutive output items form one turn."""
    msgs: list[Any] = []
    turn: list[Any] = []
    text_ids: list[str] = []

    def flush() -> None:
        if turn:
            msgs.append(AssistantMessage(tuple(turn), {"text_item_ids": list(text_ids)} if text_ids else None))
            turn.clear()
            text_ids.clear()

    for it in items:
        kind = it.get("type")
        if it.get("role") == "user":
            flush()
            msgs.append(UserMessage(it["content"]))
        elif kind == "function_call_output":
            flush()
            msgs.append(ToolResultMessage(it["call_id"], it["output"]))
        elif kind == "reasoning":
            turn.append(ThinkingBlock("", source=SRC, provider_data={"id": it["id"], "summary": it["summary"]}))
        elif kind == "function_call":
            turn.append(ToolUseBlock(it["call_id"], it["name"], json.loads(it["arguments"]),
                                     provider_data={"id": it["id"]}))
        else:
            turn.append(TextBlock(_text(it["content"])))
            text_ids.append(it["id"])
    flush()
    return msgs


def test_b05_reasoning_without_a_following_item_is_dropped() -> None:
    case = json.loads(corpus.case("B05.json").read_text())["responses_input"]
    want = json.loads(corpus.case("B05.expected.json").read_text())
    request = MessageRequest(model="m", messages=b05_messages(case))
    body = provider_for("http://127.0.0.1:9").build_body(request, stream=False)
    items = body["input"]
    assert [it["id"] for it in items if "id" in it] == want["kept_ids_in_order"] == [
        "rs_PH_1", "fc_PH_1", "rs_PH_2", "msg_PH_2"]
    assert "rs_PH_3" in want["dropped_ids"] and all(it.get("id") != "rs_PH_3" for it in items)
    assert [_text(it["content"]) for it in items if it.get("role") == "user"] == [
        "Where is my order ORD-PH-1?", "Transfer me to billing."]
    assert [it["type"] for it in items] == ["message", "reasoning", "function_call", "function_call_output",
                                           "reasoning", "message", "message"]
    assert items[2] == {"type": "function_call", "id": "fc_PH_1", "call_id": "call_PH_1", "name": "lookup_order",
                        "arguments": '{"order_id":"ORD-PH-1"}'}


def test_keep_reasoning_items_on_raw_wire_items() -> None:
    case = json.loads(corpus.case("B05.json").read_text())["responses_input"]
    kept = keep_reasoning_items(case)
    assert [it.get("id") for it in kept if it.get("id")] == ["rs_PH_1", "fc_PH_1", "rs_PH_2", "msg_PH_2"]
    assert len(kept) == len(case) - 1 and case[-1]["id"] == "rs_PH_3"


def test_keep_reasoning_items_rules() -> None:
    def rs(i: int) -> dict[str, Any]:
        return {"type": "reasoning", "id": f"rs_{i}", "summary": []}

    def ids(items: list[dict[str, Any]]) -> list[str]:
        return [it.get("id") or it["type"] for it in items]

    fc = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"}
    ws = {"type": "web_search_call", "id": "ws_1", "status": "completed"}
    out = {"type": "function_call_output", "call_id": "c1", "output": "x"}
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}
    # a run of reasoning items before an output item is kept whole; a server-tool call counts as output
    assert ids(keep_reasoning_items([rs(1), rs(2), fc])) == ["rs_1", "rs_2", "fc_1"]
    assert ids(keep_reasoning_items([rs(1), ws])) == ["rs_1", "ws_1"]
    # followed by an input item, or by the next response's output: dropped
    assert ids(keep_reasoning_items([rs(1), out, user])) == ["function_call_output", "message"]
    assert ids(keep_reasoning_items([rs(1), fc], groups=[0, 1])) == ["fc_1"]
    assert ids(keep_reasoning_items([rs(1), rs(2), fc], groups=[0, 1, 1])) == ["rs_2", "fc_1"]
    assert keep_reasoning_items([]) == []


# ---------------------------------------------------------------------------- request mapping
def body_of(request: MessageRequest, stream: bool = False) -> dict[str, Any]:
    return provider_for("http://127.0.0.1:9").build_body(request, stream)


def test_messages_map_to_items() -> None:
    call = ToolUseBlock("call_1", "now", {}, provider_data={"id": "fc_1"})
    messages = [
        SystemMessage("Be brief."), SystemMessage("Use tools."),
        UserMessage([TextBlock("look"), ImageBlock(data="AAAA", media_type="image/png", detail="low"),
                     FileBlock(file_id="file-1"), FileBlock(data="JVBE", media_type="application/pdf",
                                                            filename="a.pdf")]),
        UserImageMessage("https://x/y.png", "image/png"),
        AssistantMessage((ThinkingBlock("r", source=SRC, provider_data={"id": "rs_1", "summary": [
            {"type": "summary_text", "text": "r"}], "encrypted_content": "enc"}),
                          TextBlock("checking", citations=({"type": "url_citation", "url": "u"},)), call,
                          ThinkingBlock("other", signature="sig", source="anthropic"),
                          ExtensionBlock("server_tool_use", {"id": "x"}, "anthropic"),
                          ExtensionBlock("web_search_call", {"type": "web_search_call", "id": "ws_1"}, SRC)),
                         {"text_item_ids": ["msg_1"], "item_phases": {"msg_1": "commentary"}}),
        ToolResultMessage("call_1", "12:00"),
        SystemMessage("Wrap up now."),
    ]
    body = body_of(MessageRequest(model="gpt-5", messages=messages))
    assert body["instructions"] == "Be brief.\n\nUse tools."
    assert body["input"] == [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
            {"type": "input_file", "file_id": "file-1"},
            {"type": "input_file", "file_data": "data:application/pdf;base64,JVBE", "filename": "a.pdf"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "r"}],
         "encrypted_content": "enc"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "phase": "commentary",
         "content": [{"type": "output_text", "text": "checking",
                      "annotations": [{"type": "url_citation", "url": "u"}]}]},
        {"type": "function_call", "call_id": "call_1", "name": "now", "arguments": "{}", "id": "fc_1"},
        {"type": "web_search_call", "id": "ws_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Wrap up now."}]},
    ]


def test_store_false_reasoning_without_encrypted_content_is_not_replayed() -> None:
    turn = AssistantMessage((ThinkingBlock("", source=SRC, provider_data={"id": "rs_1", "summary": []}),
                             TextBlock("hi"), ToolUseBlock("c1", "f", {"a": 1}, provider_data={"id": "fc_1"})),
                            {"text_item_ids": ["msg_1"]})
    _, stored = messages_to_input([UserMessage("q"), turn, ToolResultMessage("c1", "r")], store=None)
    assert [it.get("id") for it in stored[1:]] == ["rs_1", "msg_1", "fc_1", None]
    _, again = messages_to_input([UserMessage("q"), turn, ToolResultMessage("c1", "r")], store=None)  # building never edits the history
    assert again == stored and turn.provider_data == {"text_item_ids": ["msg_1"]}
    _, stateless = messages_to_input([UserMessage("q"), turn, ToolResultMessage("c1", "r")], store=False)
    assert stateless[1:] == [
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "hi", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "r"}]


def test_options_map_to_the_wire() -> None:
    request = MessageRequest(
        model="gpt-5", messages=[UserMessage("q")],
        tools=[ToolDefinition("f", "does f", {"type": "object", "properties": {}}, strict=True),
               ToolDefinition("g")],
        tool_choice={"name": "f"}, max_tokens=300, temperature=0.2, top_p=0.9, stop=("END",),
        thinking=ThinkingConfig(effort="high", summary="auto"), parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"},
                                                                 "strict": True}},
        extra={"builtin_tools": [{"type": "web_search"}], "previous_response_id": "resp_1", "store": False,
               "include": ["reasoning.encrypted_content"], "truncation": "auto",
               "body": {"temperature": 0.5, "user": "u1"}})
    body = body_of(request, stream=True)
    assert body == {
        "model": "gpt-5",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}],
        "tools": [{"type": "function", "name": "f", "description": "does f",
                   "parameters": {"type": "object", "properties": {}}, "strict": True},
                  {"type": "function", "name": "g", "description": "",
                   "parameters": {"type": "object", "properties": {}}},
                  {"type": "web_search"}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "max_output_tokens": 300, "temperature": 0.5, "top_p": 0.9,
        "reasoning": {"effort": "high", "summary": "auto"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        "previous_response_id": "resp_1", "store": False, "include": ["reasoning.encrypted_content"],
        "truncation": "auto", "stream": True, "user": "u1"}
    chat_choice = body_of(evolve(request, tool_choice={"type": "function", "function": {"name": "g"}}, extra={}))
    assert chat_choice["tool_choice"] == {"type": "function", "name": "g"}
    assert "stream" not in chat_choice and "reasoning" in chat_choice
    off = body_of(evolve(request, thinking=ThinkingConfig(enabled=False, summary="auto"), tools=(), extra={}))
    assert "reasoning" not in off and "tools" not in off and "tool_choice" not in off
    minimal = body_of(evolve(request, thinking=ThinkingConfig(enabled=False, effort="minimal", summary="auto")))
    assert minimal["reasoning"] == {"effort": "minimal"}


def test_audio_input_is_rejected() -> None:
    with pytest.raises(InvalidRequestError):
        body_of(MessageRequest(model="m", messages=[UserMessage([AudioBlock("AAAA", "wav")])]))


async def test_http_path_and_auth() -> None:
    body = next(b for b in BODIES if b.path.endswith("simonw-llm__responses_basic_streaming.yaml.0.body"))
    _, server = await run([RecordedResponse(200, body.data, body.content_type)], REQUEST, True)
    (req,) = server.requests
    assert (req.method, req.path, req.headers["Authorization"]) == ("POST", "/responses", "Bearer test")
    assert req.json()["input"] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
