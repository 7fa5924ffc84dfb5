"""Vendor profiles: the factory covers every ProviderType, and per-vendor field differences reach the wire."""

from __future__ import annotations

import pytest

from fsm_agent.errors import ConfigurationError
from fsm_agent.providers import PROFILES, ProviderConfig, ProviderType, ToolMode, create_provider
from fsm_agent.types import MessageRequest, ThinkingConfig, ToolDefinition, UserMessage

REQ = MessageRequest("m", (UserMessage("hi"),), max_tokens=77, thinking=ThinkingConfig(True, 512, "low"),
                     tools=(ToolDefinition("f", "d", {"type": "object", "properties": {}}),))


@pytest.mark.parametrize("kind", list(ProviderType))
def test_every_provider_type_builds(kind: ProviderType) -> None:
    p = create_provider(kind, ProviderConfig(base_url="http://127.0.0.1:1/v1", api_key="k", model="m"))
    assert p.name == kind.value
    assert p.profile is PROFILES[kind.value] or p.profile.name == kind.value
    assert p.capabilities.streaming


def test_field_differences_per_vendor() -> None:
    def body(kind: str) -> dict:
        p = create_provider(kind, ProviderConfig(base_url="http://127.0.0.1:1/v1", api_key="k", model="m"))
        return p.build_body(p.prepare(REQ), stream=True)

    openai, compat, deepseek, qwen, local = (body(k) for k in ("openai", "openai-compatible", "deepseek", "qwen",
                                                                 "llamacpp"))
    assert openai["max_completion_tokens"] == 77 and "max_tokens" not in openai
    assert openai["reasoning_effort"] == "low" and openai["stream_options"] == {"include_usage": True}
    assert compat["max_tokens"] == 77
    assert deepseek["thinking"] == {"type": "enabled"}
    assert qwen["enable_thinking"] is True and qwen["thinking_budget"] == 512
    # the local model has no native tool calls: the constrained mode sends a schema instead of tools
    assert "tools" not in local and local["response_format"]["type"] == "json_schema"
    assert create_provider("llamacpp", ProviderConfig(base_url="http://127.0.0.1:1/v1")).tool_mode is ToolMode.CONSTRAINED
    forced = create_provider("openai-compatible", ProviderConfig(base_url="http://127.0.0.1:1/v1", model="m",
                                                                 api_key="k", tool_mode=ToolMode.CONSTRAINED))
    assert "response_format" in forced.build_body(forced.prepare(REQ), stream=False)


def test_local_model_answers_are_capped_by_default() -> None:
    p = create_provider("llamacpp", ProviderConfig(base_url="http://127.0.0.1:1/v1"))
    assert p.build_body(p.prepare(MessageRequest("", (UserMessage("hi"),))), False)["max_tokens"] == 1024


@pytest.mark.parametrize("url", ["localhost:8000/v1", "not a url", "ftp://x/v1"])
def test_base_url_must_be_http(url: str) -> None:
    with pytest.raises(ConfigurationError, match="must start with http:// or https://"):
        create_provider("openai-compatible", ProviderConfig(base_url=url, model="m", api_key="k"))


def test_unknown_provider_lists_the_known_ones() -> None:
    with pytest.raises(ConfigurationError, match="known: openai, openai-responses, anthropic"):
        create_provider("nope")
