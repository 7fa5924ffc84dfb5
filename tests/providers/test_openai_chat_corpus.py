"""Every recorded Chat Completions response (OpenAI, DeepSeek, Qwen, OpenAI-compatible servers)
replayed through ``OpenAIChatProvider``'s real HTTP path, in irregular reads.

The expected message comes from an independent, deliberately naive reading of
the recorded chunks written here (split frames on blank lines, join ``data:``
lines, concatenate deltas, group tool-call fragments by index and id), not
from the module under test.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import corpus
from fsm_agent.errors import ProviderError
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import MessageComplete, MessageRequest, PartialMessageResponse, UserMessage

BODIES = [b for b in corpus.bodies() if b.protocol == "openai-chat"]


def _has_stream_error(data: bytes) -> bool:
    return b"event: error" in data or b'data: {"error"' in data


SUCCESS_STREAMS = [b for b in BODIES if b.streaming and b.status == 200 and not _has_stream_error(b.data)]
STREAM_ERRORS = [b for b in BODIES if b.streaming and b.status == 200 and _has_stream_error(b.data)]
SUCCESS_JSON = [b for b in BODIES if not b.streaming and b.status == 200]
ERRORS = [b for b in BODIES if b.status >= 400]
REQUEST = MessageRequest(model="m", messages=(UserMessage("hi"),))


def naive_stream(data: bytes) -> dict[str, Any]:
    """Reference reading of a Chat Completions stream (choice 0)."""
    text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    content, refusal, reasoning = [], [], []
    calls: list[dict[str, Any]] = []
    slot: dict[int, dict[str, Any]] = {}
    finish = None
    usage = None
    model = ""
    for frame in text.split("\n\n"):
        lines = [ln for ln in frame.split("\n") if ln.startswith("data:")]
        if not lines:
            continue
        payload = "\n".join(ln[6:] if ln.startswith("data: ") else ln[5:] for ln in lines)
        if payload.strip() == "[DONE]":
            break
        chunk = json.loads(payload)
        if chunk.get("model"):
            model = model or chunk["model"]
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices") or []:
            if (ch.get("index") or 0) != 0:
                continue
            d = ch.get("delta") or {}
            if isinstance(d.get("content"), str):
                content.append(d["content"])
            if isinstance(d.get("refusal"), str):
                refusal.append(d["refusal"])
            r = d.get("reasoning_content") or d.get("reasoning")
            if isinstance(r, str):
                reasoning.append(r)
            for pos, tc in enumerate(d.get("tool_calls") or []):
                idx = tc.get("index", pos)
                fn = tc.get("function") or {}
                cur = slot.get(idx)
                if cur is None or (tc.get("id") and cur["id"] and tc["id"] != cur["id"]):
                    cur = {"id": tc.get("id") or "", "name": fn.get("name") or "", "args": ""}
                    slot[idx] = cur
                    calls.append(cur)
                if tc.get("id") and not cur["id"]:
                    cur["id"] = tc["id"]
                if fn.get("name") and not cur["name"]:
                    cur["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    cur["args"] += fn["arguments"]
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
    parsed = []
    for c in calls:
        args = c["args"].strip()
        parsed.append({"id": c["id"], "name": c["name"], "input": json.loads(args) if args and args != "null" else {}})
    return {"text": "".join(content), "refusal": "".join(refusal) or None, "reasoning": "".join(reasoning),
            "calls": parsed, "finish": finish, "usage": usage, "model": model}


async def _serve(body: corpus.Body, **kw: Any) -> tuple[ReplayServer, Any]:
    server = ReplayServer([RecordedResponse(body.status, body.data, body.content_type)], **kw)
    base = await server.start()
    provider = create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k",
                                                                   retry=RetryPolicy(max_attempts=1)))
    return server, provider


def _usage_matches(resp_usage: Any, ref: dict[str, Any] | None) -> None:
    if ref is None or ref.get("prompt_tokens") is None:
        assert resp_usage is None or resp_usage.input_tokens >= 0
        return
    assert resp_usage.input_tokens == ref["prompt_tokens"]
    assert resp_usage.output_tokens == ref["completion_tokens"]
    cached = (ref.get("prompt_tokens_details") or {}).get("cached_tokens") or ref.get("prompt_cache_hit_tokens") or 0
    assert resp_usage.cache_read_tokens == cached
    reasoning = (ref.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    assert resp_usage.reasoning_tokens == reasoning


@pytest.mark.parametrize("body", SUCCESS_STREAMS, ids=lambda b: b.path)
@pytest.mark.parametrize("seed", [1, 2])
async def test_streamed_recording_decodes_to_the_recorded_message(body: corpus.Body, seed: int) -> None:
    ref = naive_stream(body.data)
    server, provider = await _serve(body, seed=seed)
    events = []
    try:
        async for ev in provider.chat_stream(REQUEST):
            events.append(ev)
    finally:
        await provider.aclose()
        await server.close()
    final = events[-1]
    assert isinstance(final, MessageComplete)
    resp = final.full_response
    assert resp.text == ref["text"]
    assert resp.refusal == ref["refusal"]
    assert resp.thinking == ref["reasoning"]
    assert [{"id": c.id, "name": c.name, "input": c.input} for c in resp.tool_calls] == ref["calls"]
    assert resp.raw_stop_reason == ref["finish"]
    assert resp.model == ref["model"]
    _usage_matches(resp.usage, ref["usage"])
    # the streamed aggregate equals the events folded again
    partial = PartialMessageResponse(provider=resp.provider, source="openai-chat")
    for ev in events:
        partial.apply(ev)
    assert partial.finalize().message == resp.message


@pytest.mark.parametrize("body", SUCCESS_JSON, ids=lambda b: b.path)
async def test_non_streamed_recording_decodes(body: corpus.Body) -> None:
    data = json.loads(body.data)
    msg = data["choices"][0].get("message") or {}
    server, provider = await _serve(body, seed=3)
    try:
        resp = await provider.chat(REQUEST)
    finally:
        await provider.aclose()
        await server.close()
    assert resp.text == (msg.get("content") or "")
    assert resp.refusal == msg.get("refusal")
    assert resp.thinking == (msg.get("reasoning_content") or msg.get("reasoning") or "")
    want = [{"id": t["id"], "name": t["function"]["name"], "input": json.loads(t["function"]["arguments"] or "{}")}
            for t in msg.get("tool_calls") or []]
    assert [{"id": c.id, "name": c.name, "input": c.input} for c in resp.tool_calls] == want
    assert resp.raw_stop_reason == data["choices"][0]["finish_reason"]
    assert resp.id == data["id"]
    _usage_matches(resp.usage, data.get("usage"))


# Expected class for each recorded error body (read from the body's error type/code by hand).
ERROR_KINDS = {
    "openai_chat/crewai__llm_call_with_error_404.yaml.0.body": "not_found",
    "openai_chat/crewai__stop_unsupported_400_then_retry.yaml.0.body": "invalid_request",
    "openai_chat/otel-contrib__chat_completion_404.yaml.0.body": "not_found",
    "openai_chat/pydantic-ai__model_not_found_404_chat.yaml.0.body": "not_found",
    "openai_chat/pydantic-ai__o1_mini_developer_role_400.yaml.0.body": "invalid_request",
    "openai_chat/vercel-ai__reasoning_model_max_tokens_error.json.0.body": "invalid_request",
    "other_openai_compatible/crewai__openrouter_401.yaml.0.body": "authentication",
    "other_openai_compatible/crewai__openrouter_401.yaml.1.body": "authentication",
    "other_openai_compatible/pydantic-ai__groq_tool_use_failed_400.yaml.0.body": "invalid_request",
    "other_openai_compatible/pydantic-ai__openrouter_429_upstream.yaml.0.body": "rate_limited",
    "other_openai_compatible/pydantic-ai__openrouter_429_upstream.yaml.1.body": "rate_limited",
    "other_openai_compatible/pydantic-ai__openrouter_429_upstream.yaml.2.body": "rate_limited",
    "other_openai_compatible/langchaingo__openrouter_streaming.httprr.1.body": "rate_limited",
    "openai_chat/observed__error_payloads.jsonl.0.body": "rate_limited",
    "openai_chat/observed__error_payloads.jsonl.1.body": "authentication",
    "deepseek/observed__error_payloads.jsonl.0.body": "quota_exceeded",
    "qwen/observed__error_payloads.jsonl.0.body": "content_filtered",
}


@pytest.mark.parametrize("body", ERRORS, ids=lambda b: b.path)
async def test_error_recording_raises_a_typed_error(body: corpus.Body) -> None:
    server, provider = await _serve(body)
    try:
        with pytest.raises(ProviderError) as info:
            await provider.chat(REQUEST)
    finally:
        await provider.aclose()
        await server.close()
    err = info.value
    assert err.status == body.status
    assert err.body and err.body.strip()
    expected = ERROR_KINDS.get(body.path)
    if expected is None:
        pytest.fail(f"no expected error kind written down for {body.path}: got {err.kind} ({err})")
    assert err.kind == expected, str(err)


STREAM_ERROR_KINDS = {
    "other_openai_compatible/pydantic-ai__groq_stream_error_event.yaml.0.body": "invalid_request",
}


@pytest.mark.parametrize("body", STREAM_ERRORS, ids=lambda b: b.path)
async def test_error_inside_a_200_stream_is_never_a_success(body: corpus.Body) -> None:
    server, provider = await _serve(body, seed=5)
    events = []
    try:
        with pytest.raises(ProviderError) as info:
            async for ev in provider.chat_stream(REQUEST):
                events.append(ev)
    finally:
        await provider.aclose()
        await server.close()
    assert not any(isinstance(e, MessageComplete) for e in events)
    assert info.value.kind == STREAM_ERROR_KINDS[body.path], str(info.value)
    assert events[-1].TAG == "error"
