"""Vendor profiles (data) and the provider factory (seed 003 Decision-05: an enum, matched exhaustively)."""

from __future__ import annotations

import enum
from fnmatch import fnmatchcase
from typing import Any
from urllib.parse import urlsplit

from attrs import evolve

from ..errors import ConfigurationError
from .base import HttpProvider, Profile, Provider, ProviderCapabilities, ProviderConfig, ToolMode

__all__ = ["MODEL_FAMILIES", "PROFILES", "ProviderType", "create_provider", "detect_profile", "get_profile",
           "model_family", "resolve_profile", "with_model_rules"]


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
    GEMINI = "gemini"
    """Google Gemini's OpenAI-compatible endpoint (tool-call ``thought_signature`` round trip)."""
    OPENROUTER = "openrouter"
    """OpenRouter (``reasoning_details`` round trip)."""
    MOONSHOT = "moonshot"
    """Moonshot Kimi (``reasoning_content`` echoed on tool-call turns)."""
    MISTRAL = "mistral"
    """Mistral La Plateforme (9-character alphanumeric tool-call ids)."""
    VLLM = "vllm"
    """A vLLM server (``--base-url``; default ``http://localhost:8000/v1``)."""
    SGLANG = "sglang"
    """An SGLang server (``--base-url``; default ``http://localhost:30000/v1``)."""
    OLLAMA = "ollama"
    """Ollama's OpenAI-compatible endpoint (default ``http://localhost:11434/v1``)."""


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
        # DashScope allows thinking only on streamed calls (C09): a non-streamed call sends
        # enable_thinking: false, or streams when thinking was asked for
        options=(("thinking_param", "enable_thinking"), ("thinking_streamed_only", True)),
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
    "gemini": Profile(
        name="gemini",
        protocol="openai-chat",
        base_url="https://generativelanguage.googleapis.com/v1beta/openai",
        api_key_env=("GEMINI_API_KEY", "GOOGLE_API_KEY"),
        default_model="gemini-2.5-flash",
        # tool calls carry extra_content.google.thought_signature, kept on the block and sent back (C03);
        # a call another vendor made gets the placeholder Google documents for calls it did not sign
        options=(("foreign_call_signature", "skip_thought_signature_validator"),),
        capabilities=ProviderCapabilities(thinking=True, images=True, context_window=1_048_576),
    ),
    "openrouter": Profile(
        name="openrouter",
        protocol="openai-chat",
        base_url="https://openrouter.ai/api/v1",
        api_key_env=("OPENROUTER_API_KEY",),
        reasoning_field="reasoning",
        default_model="openrouter/auto",
        # reasoning_details (text, summary and encrypted entries) go back unchanged on the assistant turn (C04)
        options=(("thinking_param", "reasoning"),),
        capabilities=ProviderCapabilities(thinking=True, images=True),
    ),
    "moonshot": Profile(
        name="moonshot",
        protocol="openai-chat",
        base_url="https://api.moonshot.ai/v1",
        api_key_env=("MOONSHOT_API_KEY", "KIMI_API_KEY"),
        reasoning_field="reasoning_content",
        echo_reasoning=True,  # Kimi thinking mode rejects a tool-call turn without its reasoning_content (C05)
        default_model="kimi-k2.5",
        options=(("thinking_param", "thinking"),),
        capabilities=ProviderCapabilities(thinking=True, images=True, context_window=262_144),
    ),
    "mistral": Profile(
        name="mistral",
        protocol="openai-chat",
        base_url="https://api.mistral.ai/v1",
        api_key_env=("MISTRAL_API_KEY",),
        default_model="mistral-small-latest",
        # Mistral sends usage in the last chunk unasked and refuses parameters it does not define
        stream_usage=False,
        options=(("tool_ids", "mistral"),),
        capabilities=ProviderCapabilities(images=True, context_window=128_000),
    ),
    "vllm": Profile(
        name="vllm",
        protocol="openai-chat",
        base_url="http://localhost:8000/v1",
        api_key_env=("VLLM_API_KEY",),
        reasoning_field="reasoning_content",
        options=(("thinking_param", "chat_template_kwargs"),),
        capabilities=ProviderCapabilities(thinking=True),
    ),
    "sglang": Profile(
        name="sglang",
        protocol="openai-chat",
        base_url="http://localhost:30000/v1",
        api_key_env=("SGLANG_API_KEY",),
        reasoning_field="reasoning_content",
        options=(("thinking_param", "chat_template_kwargs"),),
        capabilities=ProviderCapabilities(thinking=True),
    ),
    "ollama": Profile(
        name="ollama",
        protocol="openai-chat",
        base_url="http://localhost:11434/v1",
        api_key_env=("OLLAMA_API_KEY",),
        reasoning_field="reasoning",
        capabilities=ProviderCapabilities(thinking=True),
    ),
}
"""Built-in profiles by name.

Finish-reason habits need no profile of their own: for every Chat server the calls in the message
decide the stop reason (vLLM's ``tool_calls`` with no call, C01; a trailing ``stop`` after
``tool_calls`` or Ollama's ``stop`` with calls, C02)."""

_HOSTS: tuple[tuple[str, str], ...] = (
    ("generativelanguage.googleapis.com", "gemini"),
    ("openrouter.ai", "openrouter"),
    ("api.moonshot.ai", "moonshot"),
    ("api.moonshot.cn", "moonshot"),
    ("api.mistral.ai", "mistral"),
    ("api.deepseek.com", "deepseek"),
    ("dashscope.aliyuncs.com", "qwen"),
    ("dashscope-intl.aliyuncs.com", "qwen"),
)
_LOCAL_PORTS = {11434: "ollama"}
_GENERIC = frozenset({ProviderType.OPENAI_CHAT, ProviderType.OPENAI_COMPATIBLE})


def detect_profile(base_url: str | None) -> str | None:
    """The vendor profile a base URL belongs to, or ``None`` when it does not tell.

    Known hosts (and their subdomains): Gemini, OpenRouter, Moonshot (``.ai`` and ``.cn``), Mistral,
    DeepSeek, DashScope; Ollama by its default port 11434. vLLM and SGLang have no telling URL:
    choose them by name (``--provider vllm``)."""
    if not base_url:
        return None
    try:
        parts = urlsplit(base_url)
        host, port = (parts.hostname or "").lower(), parts.port
    except ValueError:
        return None
    for known, name in _HOSTS:
        if host == known or host.endswith("." + known):
            return name
    if port is not None and port in _LOCAL_PORTS:
        return _LOCAL_PORTS[port]
    return None



MODEL_FAMILIES: tuple[tuple[str, str], ...] = (
    # Mistral AI: La Plateforme names, Hugging Face ids, Ollama tags, Bedrock and Vertex ids
    ("mistral*", "mistral"), ("magistral*", "mistral"), ("codestral*", "mistral"), ("devstral*", "mistral"),
    ("ministral*", "mistral"), ("pixtral*", "mistral"), ("mixtral*", "mistral"), ("voxtral*", "mistral"),
    ("open-mistral*", "mistral"), ("open-mixtral*", "mistral"), ("open-codestral*", "mistral"),
    ("deepseek*", "deepseek"),
    ("kimi*", "moonshot"), ("moonshot.kimi*", "moonshot"),
    ("qwen*", "qwen"), ("qwq*", "qwen"),
)
"""Model-name patterns and the profile whose *model rules* such a model follows on any host.

A pattern (``fnmatch``, case-insensitive) is matched against the model name after its last ``/``
(``mistralai/Mistral-Small-3.1-24B`` is matched as ``mistral-small-3.1-24b``). When several match, the
longest pattern wins. The model rules are the parts of a profile that the model itself requires,
whoever serves it: the tool-call id shape (Mistral's 9 alphanumeric characters: its chat template and
tokenizer refuse others, on La Plateforme, vLLM or behind a gateway alike) and the reasoning echo
(``reasoning_field`` and ``echo_reasoning``: DeepSeek, Kimi and Qwen thinking models read their
reasoning back on tool-call turns). Endpoint rules (base URL, auth, ``stream_options``, the
thinking switch, Gemini's signature placeholder, OpenRouter's ``reasoning_details``) stay with the
endpoint's profile."""

_MODEL_RULE_OPTIONS = ("tool_ids",)


def model_family(model: str | None) -> str | None:
    """The profile whose model rules apply to ``model`` (:data:`MODEL_FAMILIES`: the longest matching
    pattern), or ``None``."""
    if not model:
        return None
    name = model.rsplit("/", 1)[-1].lower()
    best: tuple[int, str] | None = None
    for pattern, family in MODEL_FAMILIES:
        if fnmatchcase(name, pattern) and (best is None or len(pattern) > best[0]):
            best = (len(pattern), family)
    return best[1] if best else None


def with_model_rules(profile: Profile, model: str | None) -> Profile:
    """``profile`` with the model rules of ``model``'s family (:data:`MODEL_FAMILIES`) filling what
    ``profile`` leaves unset: a rule the endpoint's profile sets itself (its own ``reasoning_field``,
    ``tool_ids``) stays. ``profile`` itself when no family matches, or the protocol is not Chat
    Completions."""
    family = model_family(model)
    if family is None or family == profile.name or profile.protocol != "openai-chat":
        return profile
    rules = PROFILES[family]
    changes: dict[str, Any] = {}
    if rules.reasoning_field and profile.reasoning_field is None:
        changes["reasoning_field"] = rules.reasoning_field
    if rules.echo_reasoning and not profile.echo_reasoning:
        changes["echo_reasoning"] = True
    options = dict(profile.options)
    for key in _MODEL_RULE_OPTIONS:
        if rules.option(key) is not None and key not in options:
            options[key] = rules.option(key)
    if len(options) != len(profile.options):
        changes["options"] = tuple(options.items())
    return evolve(profile, **changes) if changes else profile


def get_profile(name: str) -> Profile:
    """The profile called ``name``.

    Raises:
        ConfigurationError: unknown name (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigurationError(f"unknown provider {name!r}; known: {', '.join(sorted(PROFILES))}") from None


def resolve_profile(value: str | Profile) -> Profile:
    """A :attr:`ProviderConfig.profile` value as a profile: a :class:`Profile` as it is, a name looked up.

    Raises:
        ConfigurationError: an unknown name, or a value that is neither.
    """
    if isinstance(value, Profile):
        return value
    if isinstance(value, str):
        return get_profile(value)
    raise ConfigurationError(f"ProviderConfig.profile must be a profile name or a Profile, got {type(value).__name__}")


def create_provider(kind: ProviderType | str, config: ProviderConfig | None = None) -> Provider:
    """Build the provider for ``kind`` with ``config`` (model, base URL, key, timeouts, retries).

    The profile, most specific first:

    1. ``config.profile`` (a name or a :class:`Profile`): used as it is; nothing is detected. It must
       speak the protocol of ``kind`` (any Chat Completions profile for ``openai`` and
       ``openai-compatible``).
    2. ``kind``, when it names a vendor (``mistral``, ``deepseek``, ``vllm`` ...).
    3. For ``openai`` and ``openai-compatible``: the vendor whose API the base URL's host is
       (:func:`detect_profile`), else ``kind``'s own profile.
    4. On top of 2 or 3, for every request: the model rules of the request's model
       (:func:`with_model_rules`, :data:`MODEL_FAMILIES`), so that ``mistral-large-latest`` through a
       gateway, a proxy or a local server on any host gets Mistral's tool-call ids. A rule the
       profile sets itself wins over the model's.

    Raises:
        ConfigurationError: unknown kind or profile, a profile of another protocol than ``kind``, or
            a missing model, base URL or API key.
    """
    try:
        kind = ProviderType(kind)
    except ValueError:
        raise ConfigurationError(
            f"unknown provider {kind!r}; known: {', '.join(p.value for p in ProviderType)}"
        ) from None
    config = config or ProviderConfig()
    if config.profile is not None:
        return _with_profile(kind, resolve_profile(config.profile), config)
    provider = _for_kind(kind, config)
    if isinstance(provider, HttpProvider):
        provider.model_rules = with_model_rules
    return provider


def _for_kind(kind: ProviderType, config: ProviderConfig) -> Provider:
    """The provider of ``kind``'s profile, or of the vendor whose API the base URL is (steps 2-3)."""
    if kind in _GENERIC:  # "openai" or "openai-compatible" at a vendor's URL: that vendor's profile
        detected = detect_profile(config.base_url)
        if detected is not None:
            kind = ProviderType(detected)
    match kind:
        case (ProviderType.OPENAI_CHAT | ProviderType.DEEPSEEK | ProviderType.QWEN | ProviderType.LLAMACPP
              | ProviderType.GEMINI | ProviderType.OPENROUTER | ProviderType.MOONSHOT | ProviderType.MISTRAL):
            from .openai_chat import OpenAIChatProvider

            return OpenAIChatProvider(PROFILES[kind.value], config)
        case ProviderType.OPENAI_COMPATIBLE | ProviderType.VLLM | ProviderType.SGLANG | ProviderType.OLLAMA:
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


def _with_profile(kind: ProviderType, profile: Profile, config: ProviderConfig) -> Provider:
    """The provider of ``profile``'s protocol (``ProviderConfig.profile``), checked against ``kind``."""
    protocol = PROFILES[kind.value].protocol
    if profile.protocol != protocol:
        raise ConfigurationError(
            f"profile {profile.name!r} speaks {profile.protocol}, but provider {kind.value!r} speaks {protocol}; "
            f"pass a provider of that protocol, or another profile")
    if profile.protocol == "openai-chat":
        from .openai_chat import OpenAIChatProvider

        if config.model is None and profile.default_model is None:
            profile = evolve(profile, default_model="default")
        return OpenAIChatProvider(profile, config)
    if profile.protocol == "openai-responses":
        from .openai_responses import OpenAIResponsesProvider

        return OpenAIResponsesProvider(profile, config)
    from .anthropic import AnthropicProvider

    return AnthropicProvider(profile, config)
