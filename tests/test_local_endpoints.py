"""The real llama.cpp server's three endpoints, each through its own protocol module:
/v1/chat/completions (openai_chat), /v1/responses (openai_responses), /v1/messages (anthropic),
streaming and not."""

from __future__ import annotations

import pytest

from fsm_agent import create_provider
from fsm_agent.providers import ProviderConfig
from fsm_agent.types import MessageComplete, MessageRequest, ModelStopReason, SystemMessage, TextDelta, UserMessage

pytestmark = pytest.mark.llama

REQ = MessageRequest("SmolLM2-135M-Instruct", (SystemMessage("You are brief."), UserMessage("Name a colour.")),
                     max_tokens=24)


@pytest.mark.parametrize("kind", ["llamacpp", "openai-responses", "anthropic"])
async def test_endpoint_non_streaming(llama_server, kind: str) -> None:
    base = llama_server.base_url if kind != "anthropic" else llama_server.base_url  # all under /v1
    p = create_provider(kind, ProviderConfig(base_url=base, model="SmolLM2-135M-Instruct", api_key="local"))
    try:
        resp = await p.chat(REQ)
    finally:
        await p.aclose()
    assert resp.text.strip()
    assert resp.stop_reason in (ModelStopReason.END_TURN, ModelStopReason.MAX_TOKENS)
    assert resp.usage is not None and resp.usage.input_tokens > 0 and resp.usage.output_tokens > 0
    assert resp.provider == kind


@pytest.mark.parametrize("kind", ["llamacpp", "openai-responses", "anthropic"])
async def test_endpoint_streaming(llama_server, kind: str) -> None:
    p = create_provider(kind, ProviderConfig(base_url=llama_server.base_url, model="SmolLM2-135M-Instruct",
                                             api_key="local"))
    try:
        events = [ev async for ev in p.chat_stream(REQ)]
    finally:
        await p.aclose()
    final = events[-1]
    assert isinstance(final, MessageComplete)
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert len(deltas) >= 2
    assert "".join(deltas) == final.full_response.text
    assert final.full_response.usage is not None and final.full_response.usage.output_tokens > 0
