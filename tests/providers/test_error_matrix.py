"""400/401/403/404/413/429/500/503/529 bodies, in each provider's own error shape, served over real
HTTP to each protocol module, map to the right class; retryable ones are retried, others not."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import MessageRequest, UserMessage


def openai_body(status: int, etype: str, code: str | None, message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}})


def anthropic_body(status: int, etype: str, code: str | None, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": etype, "message": message}})


def dashscope_body(status: int, etype: str, code: str | None, message: str) -> bytes:
    return orjson.dumps({"code": code or etype, "message": message, "request_id": "r-1"})


# status -> (OpenAI type/code, Anthropic type, DashScope code, message, expected kind, retryable)
MATRIX: dict[int, tuple[str, str | None, str, str, str, str, bool]] = {
    400: ("invalid_request_error", None, "invalid_request_error", "InvalidParameter", "bad field 'x'", "invalid_request", False),
    401: ("invalid_request_error", "invalid_api_key", "authentication_error", "InvalidApiKey", "bad key", "authentication", False),
    403: ("permission_error", None, "permission_error", "AccessDenied", "not allowed", "permission_denied", False),
    404: ("invalid_request_error", "model_not_found", "not_found_error", "ModelNotFound", "no such model", "not_found", False),
    413: ("invalid_request_error", None, "request_too_large", "RequestTooLarge", "payload too big", "request_too_large", False),
    429: ("requests", "rate_limit_exceeded", "rate_limit_error", "Throttling", "slow down", "rate_limited", True),
    500: ("server_error", None, "api_error", "InternalError", "oops", "server_error", True),
    503: ("server_error", None, "api_error", "ServiceUnavailable", "unavailable", "server_error", True),
    529: ("overloaded_error", None, "overloaded_error", "Overloaded", "Overloaded", "overloaded", True),
}
PROVIDERS = [("openai", openai_body, "openai-compatible"), ("openai-responses", openai_body, "openai-responses"),
             ("anthropic", anthropic_body, "anthropic"), ("deepseek", openai_body, "deepseek"),
             ("qwen", dashscope_body, "qwen")]


@pytest.mark.parametrize("status", sorted(MATRIX))
@pytest.mark.parametrize("name,shape,kind", PROVIDERS, ids=[p[0] for p in PROVIDERS])
async def test_error_status_maps_to_its_class(status: int, name: str, shape: Any, kind: str) -> None:
    otype, ocode, atype, dcode, message, want, retryable = MATRIX[status]
    etype = atype if shape is anthropic_body else otype
    body = shape(status, etype, dcode if shape is dashscope_body else ocode, message)
    server = ReplayServer([RecordedResponse(status, body, headers={"retry-after": "0"})], repeat_last=True,
                          chunk_sizes=[7])
    base = await server.start()
    p = create_provider(kind, ProviderConfig(base_url=base, model="m", api_key="k",
                                             retry=RetryPolicy(max_attempts=2, initial_delay=0)))
    try:
        with pytest.raises(Exception) as info:
            await p.chat(MessageRequest("m", (UserMessage("hi"),)))
    finally:
        await p.aclose()
        await server.close()
    err = info.value
    assert err.kind == want, f"{name} {status}: {err}"
    assert err.retryable is retryable
    assert err.status == status and message in str(err)
    assert len(server.requests) == (2 if retryable else 1)


def test_x_should_retry_overrides_the_default() -> None:
    from fsm_agent.providers import classify_error

    body = {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    assert classify_error(500, body).retryable is True
    assert classify_error(500, body, {"X-Should-Retry": "false"}).retryable is False
    assert classify_error(400, {"error": {"message": "x", "type": "invalid_request_error"}},
                          {"x-should-retry": "true"}).retryable is True
