"""Vendor profiles (data) and the provider factory (seed 003 Decision-05: an enum, matched exhaustively)."""

from __future__ import annotations

import enum

from attrs import evolve

from ..errors import ConfigurationError
from .base import Profile, Provider, ProviderCapabilities, ProviderConfig, ToolMode

__all__ = ["PROFILES", "ProviderType", "create_provider", "get_profile"]


class ProviderType(str, enum.Enum):
    """Every provider fsm_agent speaks to. ``create_provider`` matches it exhaustively."""

    OPENAI_CHAT = "openai"
    OPENAI_RESPONSES = "openai-responses"
    ANTHROPIC = "anthropic"
    DEEPSEEK = "deepseek"
    QWEN = "qwen"
    OPENAI_COMPATIBLE = "openai-compatible"
    """Any other server speaking Chat Completions (vLLM, Ollama, OpenRouter, Groq ...); needs ``base_url``."""
    LLAMACPP = "llamacpp"
    """A llama.cpp ``llama-server`` (the embedded default); constrained tool calling."""


PROFILES: dict[str, Profile] = {
    "openai": Profile(
        name="openai",
        protocol="openai-chat",
        base_url="https://api.openai.com/v1",
        api_key_env=("OPENAI_API_KEY",),
        max_tokens_field="max_completion_tokens",
        default_model="gpt-4o-mini",
        capabilities=ProviderCapabilities(thinking=True, images=True, context_window=128_000),
    ),
    "openai-responses": Profile(
        name="openai-responses",
        protocol="openai-responses",
        base_url="https://api.openai.com/v1",
        api_key_env=("OPENAI_API_KEY",),
        max_tokens_field="max_output_tokens",
        default_model="gpt-4o-mini",
        capabilities=ProviderCapabilities(thinking=True, images=True, context_window=128_000),
    ),
    "anthropic": Profile(
        name="anthropic",
        protocol="anthropic",
        base_url="https://api.anthropic.com/v1",
        api_key_env=("ANTHROPIC_API_KEY",),
        auth="x-api-key",
        headers=(("anthropic-version", "2023-06-01"),),
        default_model="claude-sonnet-4-5",
        # max_output_tokens is also the default max_tokens (the API requires one): 8192 is accepted by
        # every current Claude model; claude-3-opus/haiku-3 need max_tokens <= 4096 set explicitly.
        capabilities=ProviderCapabilities(thinking=True, images=True, constrained_output=False,
                                          context_window=200_000, max_output_tokens=8192),
    ),
    "deepseek": Profile(
        name="deepseek",
        protocol="openai-chat",
        base_url="https://api.deepseek.com",
        api_key_env=("DEEPSEEK_API_KEY",),
        reasoning_field="reasoning_content",
        echo_reasoning=True,
        default_model="deepseek-chat",
        options=(("thinking_param", "thinking"),),
        # DeepSeek has JSON mode (response_format json_object) but no json_schema: an output schema
        # is sent as json_object plus the schema in the system prompt
        capabilities=ProviderCapabilities(thinking=True, structured_output=False, context_window=128_000),
    ),
    "qwen": Profile(
        name="qwen",
        protocol="openai-chat",
        base_url="https://dashscope.aliyuncs.com/compatible-mode/v1",
        api_key_env=("DASHSCOPE_API_KEY", "QWEN_API_KEY"),
        reasoning_field="reasoning_content",
        echo_reasoning=True,
        default_model="qwen-plus",
        options=(("thinking_param", "enable_thinking"),),
        capabilities=ProviderCapabilities(thinking=True, images=True, context_window=131_072),
    ),
    "openai-compatible": Profile(
        name="openai-compatible",
        protocol="openai-chat",
        api_key_env=("OPENAI_API_KEY",),
        reasoning_field="reasoning_content",
        capabilities=ProviderCapabilities(),
    ),
    "llamacpp": Profile(
        name="llamacpp",
        protocol="openai-chat",
        auth="none",
        tool_mode=ToolMode.CONSTRAINED,
        reasoning_field="reasoning_content",
        default_model="SmolLM2-135M-Instruct",
        # a tiny model can repeat itself for thousands of tokens: cap answers unless asked otherwise
        default_max_tokens=1024,
        capabilities=ProviderCapabilities(parallel_tools=False, context_window=8192),
    ),
}
"""Built-in profiles by name."""


def get_profile(name: str) -> Profile:
    """The profile called ``name``.

    Raises:
        ConfigurationError: unknown name (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigurationError(f"unknown provider {name!r}; known: {', '.join(sorted(PROFILES))}") from None


def create_provider(kind: ProviderType | str, config: ProviderConfig | None = None) -> Provider:
    """Build the provider for ``kind`` with ``config`` (model, base URL, key, timeouts, retries).

    Raises:
        ConfigurationError: unknown kind, or a missing model, base URL or API key.
    """
    try:
        kind = ProviderType(kind)
    except ValueError:
        raise ConfigurationError(
            f"unknown provider {kind!r}; known: {', '.join(p.value for p in ProviderType)}"
        ) from None
    config = config or ProviderConfig()
    match kind:
        case ProviderType.OPENAI_CHAT | ProviderType.DEEPSEEK | ProviderType.QWEN | ProviderType.LLAMACPP:
            from .openai_chat import OpenAIChatProvider

            return OpenAIChatProvider(PROFILES[kind.value], config)
        case ProviderType.OPENAI_COMPATIBLE:
            from .openai_chat import OpenAIChatProvider

            profile = PROFILES[kind.value]
            if config.model is None:
                profile = evolve(profile, default_model="default")
            return OpenAIChatProvider(profile, config)
        case ProviderType.OPENAI_RESPONSES:
            from .openai_responses import OpenAIResponsesProvider

            return OpenAIResponsesProvider(PROFILES[kind.value], config)
        case ProviderType.ANTHROPIC:
            from .anthropic import AnthropicProvider

            return AnthropicProvider(PROFILES[kind.value], config)
