"""Issue 19, item 4: vendor rules follow the model as well as the host.

A profile's model rules (Mistral's 9-character tool-call ids, the reasoning echo of DeepSeek, Kimi and
Qwen thinking models) apply when the model name says so, through a gateway, a proxy or a local server
on any host; a rule the endpoint's own profile sets wins, the longest matching pattern wins, and
``ProviderConfig(profile=...)`` overrides everything. On real HTTP: a local server answers Mistral's
own 400 when an id breaks Mistral's rule, as vLLM's Mistral tokenizer and La Plateforme do.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from aiohttp import web
from attrs import define

from fsm_agent.errors import ConfigurationError
from fsm_agent.providers import PROFILES, ProviderConfig, create_provider
from fsm_agent.providers.profiles import model_family, with_model_rules
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.testing.replay import ReceivedRequest
from fsm_agent.types import (
    AssistantMessage,
    MessageRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
)

MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
ANSWER = orjson.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}]})


@define
class MistralRuleServer(ReplayServer):
    """Answers Mistral's 400 for a tool-call id that is not 9 alphanumeric characters."""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        for m in body.get("messages", []):
            ids = [c["id"] for c in m.get("tool_calls") or ()] + ([m["tool_call_id"]] if m.get("tool_call_id") else [])
            for i in ids:
                if not MISTRAL_ID.fullmatch(i):
                    self.requests.append(ReceivedRequest(request.method, request.path_qs, dict(request.headers), raw))
                    return web.json_response({"object": "error", "message": f"Tool call id was {i} but must be "
                                              "a-z, A-Z, 0-9, with a length of 9.", "type": "invalid_request_message",
                                              "code": "3280"}, status=400)
        return await super()._handle(request)


HISTORY = (UserMessage("Weather?"), AssistantMessage((ToolUseBlock("call_8f2a1c_weather", "weather", {"c": "Oslo"}),)),
           ToolResultMessage("call_8f2a1c_weather", "sunny"))


async def send(kind: str, model: str, history: tuple[Any, ...] = HISTORY, *, path: str = "/v1",
               request_model: str | None = None, mistral: bool = False, **config: Any) -> dict[str, Any]:
    """The body of one request (``mistral``: to a server that enforces Mistral's id rule)."""
    server = (MistralRuleServer if mistral else ReplayServer)([RecordedResponse(200, ANSWER)])
    base = await server.start()
    p = create_provider(kind, ProviderConfig(base_url=base + path, model=model, api_key="k", **config))
    try:
        resp = await p.chat(MessageRequest(request_model or model, history))
    finally:
        await p.aclose()
        await server.close()
    assert resp.text == "done"
    return server.requests[-1].json()


@pytest.mark.parametrize("kind,model", [
    ("openai-compatible", "mistral-large-latest"),         # a LiteLLM proxy on another host
    ("openai-compatible", "magistral-medium-2506"),
    ("openai-compatible", "codestral-2508"),
    ("openai", "devstral-small-2507"),                     # "openai" at a gateway's URL
    ("vllm", "mistralai/Mistral-Small-3.1-24B-Instruct-2503"),
    ("ollama", "mistral:7b"),
    ("sglang", "Mixtral-8x7B-Instruct-v0.1"),
    ("openai-compatible", "mistral.mistral-large-2402-v1:0"),  # a Bedrock id behind a gateway
    ("openrouter", "mistralai/ministral-8b"),
])
async def test_mistral_models_get_mistral_ids_on_any_host(kind: str, model: str) -> None:
    sent = await send(kind, model, mistral=True)
    call_id = sent["messages"][1]["tool_calls"][0]["id"]
    assert MISTRAL_ID.fullmatch(call_id) and sent["messages"][2]["tool_call_id"] == call_id


@pytest.mark.parametrize("model", ["gpt-4o-mini", "llama-3.3-70b", "nous-hermes-2-mixtral-8x7b"])
async def test_other_models_keep_their_ids(model: str) -> None:
    server = ReplayServer([RecordedResponse(200, ANSWER)])
    base = await server.start()
    p = create_provider("openai-compatible", ProviderConfig(base_url=base, model=model, api_key="k"))
    try:
        await p.chat(MessageRequest(model, HISTORY))
    finally:
        await p.aclose()
        await server.close()
    assert server.requests[0].json()["messages"][1]["tool_calls"][0]["id"] == "call_8f2a1c_weather"


async def test_the_request_model_decides_not_only_the_configured_one() -> None:
    sent = await send("openai-compatible", "gpt-4o-mini", request_model="mistral-small-latest", mistral=True)
    assert MISTRAL_ID.fullmatch(sent["messages"][1]["tool_calls"][0]["id"])


REASONING = (UserMessage("Plan it."),
             AssistantMessage((ThinkingBlock("R1: look up the calendar."), TextBlock(""),
                               ToolUseBlock("c1", "calendar", {}))),
             ToolResultMessage("c1", "free"))


@pytest.mark.parametrize("kind,model", [
    ("openai-compatible", "deepseek-reasoner"),
    ("vllm", "deepseek-ai/DeepSeek-V3.1"),
    ("openai-compatible", "kimi-k2-thinking"),
    ("sglang", "Qwen/Qwen3-32B"),
])
async def test_thinking_models_get_their_reasoning_echoed_on_any_host(kind: str, model: str) -> None:
    """Case B06's rule, through any server: the reasoning of a tool-call turn goes back verbatim."""
    sent = await send(kind, model, REASONING)
    assert sent["messages"][1]["reasoning_content"] == "R1: look up the calendar."


async def test_the_endpoints_own_rule_wins_and_the_model_fills_the_gap() -> None:
    """OpenRouter sends reasoning under its own field; a DeepSeek model adds only the echo."""
    sent = await send("openrouter", "deepseek/deepseek-r1", REASONING)
    assert sent["messages"][1].get("reasoning") == "R1: look up the calendar."
    assert "reasoning_content" not in sent["messages"][1]
    assert with_model_rules(PROFILES["openrouter"], "deepseek/deepseek-r1").reasoning_field == "reasoning"


async def test_the_profile_given_in_the_config_overrides_host_and_model() -> None:
    plain = await send("openai-compatible", "mistral-large-latest", profile="openai-compatible", path="")
    assert plain["messages"][1]["tool_calls"][0]["id"] == "call_8f2a1c_weather"  # as the user chose
    forced = await send("openai-compatible", "gpt-4o-mini", profile="mistral", mistral=True)
    assert MISTRAL_ID.fullmatch(forced["messages"][1]["tool_calls"][0]["id"])
    p = create_provider("openai", ProviderConfig(base_url="https://api.mistral.ai/v1", model="m", api_key="k",
                                                 profile=PROFILES["openai-compatible"]))
    assert p.name == "openai-compatible" and p.wire_profile("mistral-large").option("tool_ids") is None
    await p.aclose()


def test_a_profile_of_another_protocol_or_an_unknown_one_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match="speaks anthropic, but provider 'openai' speaks openai-chat"):
        create_provider("openai", ProviderConfig(model="m", api_key="k", profile="anthropic"))
    with pytest.raises(ConfigurationError, match="unknown provider 'mistrall'"):
        create_provider("openai", ProviderConfig(model="m", api_key="k", profile="mistrall"))


@pytest.mark.parametrize("model,family", [
    ("mistral-large-latest", "mistral"), ("Magistral-Small-2509", "mistral"), ("codestral-latest", "mistral"),
    ("mistralai/Devstral-Small-2505", "mistral"), ("open-mixtral-8x22b", "mistral"), ("pixtral-12b", "mistral"),
    ("deepseek-chat", "deepseek"), ("deepseek-r1-distill-qwen-32b", "deepseek"), ("moonshotai/Kimi-K2-Instruct", "moonshot"),
    ("moonshot.kimi-k2-thinking", "moonshot"), ("qwen3-235b-a22b", "qwen"), ("QwQ-32B", "qwen"),
    ("gpt-4o", None), ("claude-sonnet-4-5", None), ("dolphin-mixtral", None), ("", None), (None, None),
])
def test_the_model_family_is_the_longest_matching_pattern(model: str | None, family: str | None) -> None:
    assert model_family(model) == family
