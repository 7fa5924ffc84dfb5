"""Providers: one module per wire protocol, vendors as profiles, one SSE decoder, one error boundary."""

from .base import (
    NEVER_RETRIED_STATUSES,
    HttpProvider,
    Profile,
    Provider,
    ProviderCapabilities,
    ProviderConfig,
    RetryListener,
    RetryPolicy,
    ToolMode,
    call_deadline,
    first_token_timeout_for,
    may_retry,
    retry_listener,
)
from .errors import classify_error, parse_retry_after, scrub_error, scrub_secrets
from .fallback import FallbackProvider, FallbackRule
from .profiles import PROFILES, ProviderType, create_provider, detect_profile, get_profile
from .scripted import ScriptedProvider, text_response, tool_call_response
from .sse import SSEDecoder, ServerSentEvent

__all__ = [
    "FallbackProvider",
    "FallbackRule",
    "HttpProvider",
    "NEVER_RETRIED_STATUSES",
    "PROFILES",
    "Profile",
    "Provider",
    "ProviderCapabilities",
    "ProviderConfig",
    "ProviderType",
    "RetryListener",
    "RetryPolicy",
    "SSEDecoder",
    "ScriptedProvider",
    "ServerSentEvent",
    "ToolMode",
    "call_deadline",
    "classify_error",
    "create_provider",
    "detect_profile",
    "first_token_timeout_for",
    "get_profile",
    "may_retry",
    "parse_retry_after",
    "retry_listener",
    "scrub_error",
    "scrub_secrets",
    "text_response",
    "tool_call_response",
]
