"""RetryFallback: backoff and Retry-After per logical call, the wall-clock budget, the error taxonomy,
fallback providers (scripted and over real HTTP with recorded bodies), and the layering with the
provider's own per-HTTP-attempt retries."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conftest import Recorder
from corpus import CORPUS
from fsm_agent import Agent, RunConfig, ScriptedProvider, StopReason, UserMessage, create_provider
from fsm_agent.errors import (
    AuthenticationError,
    ContextLengthExceededError,
    InvalidRequestError,
    OverloadedError,
    RateLimitError,
    RateLimitRequestTooLargeError,
    ServerError,
)
from fsm_agent.providers import ProviderConfig, RetryPolicy
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import ModelStreamEvent, TextDelta
from fsm_agent_middleware.retry import RetryFallback

BODIES = CORPUS / "bodies"
RATE_LIMITED = (BODIES / "openai_chat/observed__error_payloads.jsonl.0.body").read_bytes()  # "try again in 6ms"
SERVER_ERROR = (BODIES / "openai_responses/observed__error_payloads.jsonl.0.body").read_bytes()
STREAM = (BODIES / "openai_chat/langchaingo__create_chat_completion_stream.httprr.0.body").read_bytes()


class Waits:
    """A ``sleep`` that records each wait (seconds); ``real`` also waits for it."""

    def __init__(self, real: bool = False) -> None:
        self.waits: list[float] = []
        self.real = real

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        await asyncio.sleep(seconds if self.real else 0)


def server_error() -> ServerError:
    return ServerError("upstream 500", provider="scripted", status=500)


async def run(provider: Any, mw: RetryFallback, recorder: Recorder | None = None, **cfg: Any) -> tuple[Any, Any]:
    agent = Agent(provider, middleware=[mw], observers=[recorder] if recorder else [], config=RunConfig(**cfg))
    ctx = agent.new_context([UserMessage("go")])
    result = await agent.driver(ctx).run()
    return result, ctx.state(mw)


async def test_retries_retryable_errors_with_backoff_never_below_its_base() -> None:
    provider = ScriptedProvider([server_error(), OverloadedError("busy", provider="scripted", status=529), "ok"])
    waits = Waits()
    mw = RetryFallback(max_attempts=3, initial_delay=1.0, rng=lambda: 0.5, sleep=waits)
    result, state = await run(provider, mw)
    assert result.stop.reason is StopReason.COMPLETED and result.output == "ok"
    assert waits.waits == [1.5, 3.0]  # base 1 s then 2 s, plus 0.5 x the base (RetryPolicy.backoff)
    assert len(provider.requests) == 3
    assert state["calls"] == [{"turn": 1, "answered_by": {"provider": "scripted", "model": "scripted", "index": 0},
                               "attempts": [
                                   {"provider": "scripted", "index": 0, "kind": "server_error", "status": 500, "waited": 0.0},
                                   {"provider": "scripted", "index": 0, "kind": "overloaded", "status": 529, "waited": 1.5},
                               ]}]


async def test_gives_up_after_max_attempts_with_the_last_error() -> None:
    provider = ScriptedProvider([server_error()], repeat_last=True)
    waits = Waits()
    result, state = await run(provider, RetryFallback(rng=lambda: 0.0, sleep=waits))
    assert result.stop.reason is StopReason.FAILED_RETRYABLE
    assert result.stop.error["kind"] == "server_error"
    assert len(provider.requests) == 2 and waits.waits == [1.0]  # default: 2 logical attempts, base 1 s
    assert state["calls"][0]["answered_by"] is None and "answered_by" not in state


@pytest.mark.parametrize("error", [
    AuthenticationError("bad key", provider="scripted", status=401),
    InvalidRequestError("bad temperature", provider="scripted", status=400),
    RateLimitRequestTooLargeError("request too large for TPM", provider="scripted", status=429),
])
async def test_never_retries_or_falls_back_on_non_retryable_errors(error: Exception) -> None:
    provider, backup = ScriptedProvider([error, "never"]), ScriptedProvider(["never"])
    waits = Waits()
    result, _ = await run(provider, RetryFallback(max_attempts=5, fallbacks=[backup], sleep=waits))
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert len(provider.requests) == 1 and backup.requests == [] and waits.waits == []


async def test_context_length_is_left_to_the_driver() -> None:
    err = ContextLengthExceededError("too long", provider="scripted", limit=10)
    provider, backup = ScriptedProvider([err, "fits now"]), ScriptedProvider(["never"])
    rec = Recorder()
    waits = Waits()
    result, state = await run(provider, RetryFallback(max_attempts=3, fallbacks=[backup], sleep=waits), rec)
    assert result.stop.reason is StopReason.COMPLETED and result.output == "fits now"
    assert ("Model", "retry_context", "PreTurn") in rec.transitions()
    assert waits.waits == [] and backup.requests == []
    assert [c["attempts"] for c in state["calls"]] == [
        [{"provider": "scripted", "index": 0, "kind": "context_length_exceeded", "status": None, "waited": 0.0}], []]


async def test_honours_retry_after_from_the_error_and_from_headers() -> None:
    provider = ScriptedProvider([RateLimitError("slow down", retry_after=2.5, provider="scripted", status=429),
                                 ServerError("busy", provider="scripted", status=503, headers={"Retry-After": "1.25"}),
                                 "ok"])
    waits = Waits()
    result, _ = await run(provider, RetryFallback(max_attempts=3, rng=lambda: 0.0, sleep=waits))
    assert result.output == "ok" and waits.waits == [2.5, 1.25]


async def test_a_retry_after_above_the_limit_goes_straight_to_the_fallback() -> None:
    provider = ScriptedProvider([RateLimitError("come back in 2 min", retry_after=120, provider="scripted", status=429)])
    backup = ScriptedProvider(["from backup"], model="backup")
    rec, waits = Recorder(), Waits()
    mw = RetryFallback(max_attempts=3, max_retry_after=60, fallbacks=[backup], sleep=waits)
    result, state = await run(provider, mw, rec)
    assert result.stop.reason is StopReason.COMPLETED and result.output == "from backup"
    assert waits.waits == [] and len(provider.requests) == 1
    assert backup.requests[0].model == "backup"  # the fallback's own model, same messages
    assert backup.requests[0].messages == provider.requests[0].messages
    assert state["answered_by"] == {"provider": "scripted", "model": "scripted", "index": 1}
    # the fallback streamed through the runtime: observers saw its deltas
    assert [e.event.text for e in rec.of(ModelStreamEvent) if isinstance(e.event, TextDelta)] == ["from backup"]


async def test_never_sleeps_past_the_wall_clock_budget() -> None:
    provider = ScriptedProvider([RateLimitError("wait 5 s", retry_after=5.0, provider="scripted", status=429), "ok"])
    waits = Waits()
    result, _ = await run(provider, RetryFallback(max_attempts=3, sleep=waits), max_wall_clock=1.0)
    assert result.stop.reason is StopReason.FAILED_RETRYABLE and result.stop.resumable
    assert waits.waits == [] and len(provider.requests) == 1
    # a computed backoff (0.75 s) longer than what is left (< 0.5 s) is not slept either
    provider = ScriptedProvider([server_error(), "ok"])
    result, _ = await run(provider, RetryFallback(rng=lambda: 0.5, sleep=waits), max_wall_clock=0.5)
    assert result.stop.reason is StopReason.FAILED_RETRYABLE and waits.waits == []


async def test_no_fallback_starts_once_the_budget_is_spent() -> None:
    provider = ScriptedProvider([server_error()], delay=0.25)
    backup = ScriptedProvider(["too late"])
    result, _ = await run(provider, RetryFallback(fallbacks=[backup], sleep=Waits()), max_wall_clock=0.2)
    # the wall clock is a real limit: the call in flight is cut when it runs out (issue 8)
    assert result.stop.reason is StopReason.PAUSED_BUDGET and result.stop.budget == "wall_clock"
    assert backup.requests == []


async def test_fallback_on_extra_kinds_and_the_chain_order() -> None:
    def auth() -> AuthenticationError:
        return AuthenticationError("key revoked", provider="scripted", status=401)

    # not retryable and not listed: no fallback
    result, _ = await run(ScriptedProvider([auth()]), RetryFallback(fallbacks=[ScriptedProvider(["x"])]))
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    # listed: straight to the chain (no retry of the primary); the first fallback fails, the second answers
    primary, first, second = ScriptedProvider([auth()]), ScriptedProvider([server_error()]), ScriptedProvider(["third"])
    waits = Waits()
    mw = RetryFallback(max_attempts=3, fallbacks=[first, second], fallback_on={"authentication"}, sleep=waits)
    result, state = await run(primary, mw)
    assert result.output == "third" and waits.waits == []
    assert [(a["index"], a["kind"]) for a in state["calls"][0]["attempts"]] == [(0, "authentication"), (1, "server_error")]
    assert state["answered_by"]["index"] == 2


async def test_the_last_providers_error_decides_the_stop() -> None:
    backup = ScriptedProvider([AuthenticationError("backup key wrong", provider="backup", status=401)])
    result, _ = await run(ScriptedProvider([server_error()]), RetryFallback(max_attempts=1, fallbacks=[backup]))
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["kind"] == "authentication" and result.stop.error["provider"] == "backup"


def test_repr_and_validation() -> None:
    mw = RetryFallback(fallbacks=[ScriptedProvider([], model="backup")], fallback_on=["quota_exceeded"])
    assert repr(mw) == ("RetryFallback(max_attempts=2, initial_delay=1, max_delay=30, max_retry_after=60, "
                        "fallbacks=['scripted:backup'], fallback_on=['quota_exceeded'], fallback_attempts=1)")
    with pytest.raises(ValueError, match="at least 1"):
        RetryFallback(max_attempts=0)
    with pytest.raises(ValueError, match="must not be negative"):
        RetryFallback(initial_delay=-1)


def http(base_url: str, retry: RetryPolicy, model: str = "m") -> Any:
    return create_provider("openai-compatible", ProviderConfig(base_url=base_url, model=model, api_key="k", retry=retry))


async def test_recorded_429_then_stream_is_retried_by_the_middleware_over_http() -> None:
    responses = [RecordedResponse(429, RATE_LIMITED), RecordedResponse(200, STREAM, "text/event-stream")]
    waits = Waits(real=True)
    async with ReplayServer(responses) as server, http(server.base_url, RetryPolicy(max_attempts=1)) as provider:
        result, state = await run(provider, RetryFallback(sleep=waits))
    assert result.stop.reason is StopReason.COMPLETED and result.output == "1, 2, 3, 4, 5"
    assert len(server.requests) == 2
    assert waits.waits == [0.006]  # "Please try again in 6ms" from the recorded body
    assert state["calls"][0]["attempts"][0]["kind"] == "rate_limited"
    assert state["answered_by"] == {"provider": "openai-compatible", "model": "gpt-3.5-turbo-0125", "index": 0}


async def test_provider_retries_run_inside_and_the_middleware_sees_one_logical_call() -> None:
    responses = [RecordedResponse(429, RATE_LIMITED, headers={"retry-after-ms": "10"})] * 2
    responses.append(RecordedResponse(200, STREAM, "text/event-stream"))
    waits = Waits()
    async with ReplayServer(responses) as server, http(server.base_url, RetryPolicy(max_attempts=3)) as provider:
        result, state = await run(provider, RetryFallback(sleep=waits))
    assert result.output == "1, 2, 3, 4, 5"
    assert len(server.requests) == 3  # three HTTP attempts inside one provider call
    assert state["calls"][0]["attempts"] == [] and waits.waits == []


async def test_fallback_from_a_server_returning_500s_to_a_second_server() -> None:
    rec = Recorder()
    broken = ReplayServer([RecordedResponse(500, SERVER_ERROR)], repeat_last=True)
    healthy = ReplayServer([RecordedResponse(200, STREAM, "text/event-stream")])
    async with (
        broken,
        healthy,
        http(broken.base_url, RetryPolicy(max_attempts=2, initial_delay=0.01)) as primary,
        http(healthy.base_url, RetryPolicy(max_attempts=1), model="backup-model") as backup,
    ):
        mw = RetryFallback(max_attempts=2, initial_delay=0.02, fallbacks=[backup])
        result, state = await run(primary, mw, rec)
    assert result.stop.reason is StopReason.COMPLETED and result.output == "1, 2, 3, 4, 5"
    assert len(broken.requests) == 4  # 2 logical attempts x 2 HTTP attempts: the documented product
    assert [r.json()["model"] for r in healthy.requests] == ["backup-model"]
    assert healthy.requests[0].json()["messages"] == broken.requests[0].json()["messages"]
    assert [a["kind"] for a in state["calls"][0]["attempts"]] == ["server_error", "server_error"]
    assert state["answered_by"] == {"provider": "openai-compatible", "model": "gpt-3.5-turbo-0125", "index": 1}
    deltas = "".join(e.event.text for e in rec.of(ModelStreamEvent) if isinstance(e.event, TextDelta))
    assert deltas == "1, 2, 3, 4, 5"


# -- one backoff policy for both layers (fsm_agent.providers.RetryPolicy) ----------------------------
def test_the_plugin_uses_the_provider_layer_s_policy() -> None:
    shared = RetryPolicy(max_attempts=4, initial_delay=0.1, max_delay=1.0)
    mw = RetryFallback(policy=shared)
    assert mw.policy is shared and mw.max_attempts == 4 and mw.initial_delay == 0.1
    assert RetryFallback(max_attempts=3, initial_delay=2.0, max_delay=9.0, max_retry_after=5.0).policy == \
        RetryPolicy(max_attempts=3, initial_delay=2.0, max_delay=9.0, max_retry_after=5.0)


async def test_the_plugin_s_backoff_never_falls_below_its_base() -> None:
    import random

    attempts = 9
    provider = ScriptedProvider([server_error() for _ in range(attempts - 1)] + ["ok"])
    waits = Waits()
    mw = RetryFallback(max_attempts=attempts, initial_delay=0.5, max_delay=6.0, rng=random.Random(11).random,
                       sleep=waits)
    result, _ = await run(provider, mw)
    assert result.output == "ok" and len(waits.waits) == attempts - 1
    for n, wait in enumerate(waits.waits, 1):
        floor = min(6.0, 0.5 * 2 ** (n - 1))
        assert floor <= wait <= min(6.0, 2 * floor), (n, wait)


NEVER_RETRIED = (400, 401, 403, 404, 422)


@pytest.mark.parametrize("status", NEVER_RETRIED)
async def test_400_401_403_404_422_are_never_retried_by_the_plugin(status: int) -> None:
    from fsm_agent.providers import classify_error

    # a body and header that would otherwise be retried: the status wins
    error = classify_error(status, b'{"error":{"message":"Rate limit reached","type":"requests"}}',
                           {"x-should-retry": "true", "retry-after": "1"}, provider="scripted")
    assert error.retryable
    provider, backup = ScriptedProvider([error, "never"]), ScriptedProvider(["never"])
    waits = Waits()
    result, state = await run(provider, RetryFallback(max_attempts=5, fallbacks=[backup], sleep=waits))
    assert result.stop.reason is not StopReason.COMPLETED
    assert len(provider.requests) == 1 and backup.requests == [] and waits.waits == []
    assert [a["status"] for a in state["calls"][0]["attempts"]] == [status]


@pytest.mark.parametrize("status", NEVER_RETRIED)
async def test_400_401_403_404_422_are_never_retried_by_either_layer_over_http(status: int) -> None:
    body = b'{"error":{"message":"upstream hiccup","type":"server_error"}}'
    responses = [RecordedResponse(status, body, headers={"x-should-retry": "true"}),
                 RecordedResponse(200, STREAM, "text/event-stream")]
    waits = Waits()
    async with ReplayServer(responses) as server, \
            http(server.base_url, RetryPolicy(max_attempts=4, initial_delay=0, sleep=waits)) as provider:
        result, _ = await run(provider, RetryFallback(max_attempts=4, sleep=waits))
    assert result.stop.reason is not StopReason.COMPLETED and result.stop.error["status"] == status
    assert len(server.requests) == 1 and waits.waits == []


@pytest.mark.parametrize(("status", "body", "headers"), [
    (503, SERVER_ERROR, {}),
    (529, b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}', {}),
    (429, RATE_LIMITED, {}),  # "try again in 6ms" in the body
    (429, b'{"error":{"message":"Rate limit reached","type":"requests"}}', {"retry-after-ms": "40"}),
    (500, b'{"error":{"message":"boom","type":"server_error"}}', {"retry-after": "0.3"}),
], ids=["server_error", "overloaded", "hint_in_body", "retry_after_ms", "retry_after"])
async def test_the_plugin_and_the_provider_choose_the_same_delays(status: int, body: bytes,
                                                                   headers: dict[str, str]) -> None:
    import random

    from fsm_agent.providers import classify_error

    def policy(waits: Waits) -> RetryPolicy:
        return RetryPolicy(max_attempts=4, initial_delay=0.05, max_delay=0.3, rng=random.Random(42).random,
                           sleep=waits)

    # the provider layer: three failed HTTP attempts, then an answer
    provider_waits = Waits()
    responses = [RecordedResponse(status, body, headers=headers)] * 3
    responses.append(RecordedResponse(200, STREAM, "text/event-stream"))
    async with ReplayServer(responses) as server, http(server.base_url, policy(provider_waits)) as provider:
        result, _ = await run(provider, RetryFallback(max_attempts=1))
    assert result.output == "1, 2, 3, 4, 5" and len(server.requests) == 4
    # the plugin: the same errors, classified the same way, from a provider without retries
    plugin_waits = Waits()
    errors = [classify_error(status, body, headers, provider="scripted") for _ in range(3)]
    result, _ = await run(ScriptedProvider([*errors, "ok"]), RetryFallback(policy=policy(plugin_waits)))
    assert result.output == "ok"
    assert len(plugin_waits.waits) == 3 and plugin_waits.waits == provider_waits.waits
