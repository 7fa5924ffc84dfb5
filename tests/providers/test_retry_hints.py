"""Retry hints, honoured exactly (issue 9, item 7).

* A ``Retry-After`` HTTP-date is measured against the response's own ``Date`` header, so the skew
  between the server's clock and ours does not count (the local clock only without a ``Date``).
* Every retry is announced with a :class:`~fsm_agent.ModelRetry` event (status, kind, reason, the
  chosen delay) to the observers and into the session log, for the provider's own HTTP retries and
  for the ``retry`` plugin's.
* A stop because the server's wait is longer than what is left of the budget (or than
  ``max_retry_after``) carries the wait in seconds (``stop.error["retry_after_s"]``) and says so.

Through the real HTTP path on the Chat and Anthropic protocols, and with scripted providers for the
plugin.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from pathlib import Path
from typing import Any

import pytest

from fsm_agent import Agent, ModelRetry, Observer, RunConfig, ScriptedProvider, StopReason
from fsm_agent.errors import AuthenticationError, RateLimitError, ServerError
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider, parse_retry_after
from fsm_agent.store import SQLiteStore
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent_middleware.retry import RetryFallback


def http_date(t: float) -> str:
    return email.utils.formatdate(t, usegmt=True)


def chat_ok(text: str = "hello") -> RecordedResponse:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"
    return RecordedResponse(200, chunk({"role": "assistant", "content": text}) + chunk({}, "stop")
                            + b"data: [DONE]\n\n", "text/event-stream")


def anthropic_ok(text: str = "hello") -> RecordedResponse:
    def ev(p: dict[str, Any]) -> bytes:
        return f"event: {p['type']}\ndata: {json.dumps(p)}\n\n".encode()
    body = (ev({"type": "message_start", "message": {"id": "msg", "type": "message", "role": "assistant", "model": "m",
                                                     "content": [], "stop_reason": None,
                                                     "usage": {"input_tokens": 3, "output_tokens": 1}}})
            + ev({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
            + ev({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})
            + ev({"type": "content_block_stop", "index": 0})
            + ev({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}})
            + ev({"type": "message_stop"}))
    return RecordedResponse(200, body, "text/event-stream")


RATE_BODY = {
    "chat": b'{"error":{"message":"Rate limit reached for requests","type":"requests","code":"rate_limit_exceeded"}}',
    "anthropic": b'{"type":"error","error":{"type":"rate_limit_error","message":"Number of requests has exceeded '
                 b'your rate limit"}}',
}
BUSY = {
    "chat": RecordedResponse(503, b'{"error":{"message":"upstream unavailable","type":"server_error"}}'),
    "anthropic": RecordedResponse(529, b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}'),
}
OK = {"chat": chat_ok, "anthropic": anthropic_ok}
PROTOCOLS = ["chat", "anthropic"]


def rate_limited(protocol: str, headers: dict[str, str]) -> RecordedResponse:
    return RecordedResponse(429, RATE_BODY[protocol], headers=headers)


def provider(protocol: str, base: str, **cfg: Any) -> Any:
    if protocol == "anthropic":
        return create_provider("anthropic", ProviderConfig(base_url=base + "/v1", model="m", api_key="k", **cfg))
    return create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k", **cfg))


class Sleeps:
    """A policy ``sleep`` that records each wait and the order of things around it."""

    def __init__(self, log: list[Any] | None = None) -> None:
        self.waits: list[float] = []
        self.log = log if log is not None else []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.log.append(("sleep", seconds))
        await asyncio.sleep(0)


# -- Retry-After as an HTTP-date ------------------------------------------------------------------------
@pytest.mark.parametrize("skew", [-7200.0, -3.0, 0.0, 45.0, 86400.0])
def test_an_http_date_is_measured_against_the_response_date(skew: float) -> None:
    server_now = float(int(time.time() + skew))  # the server's clock, off ours by `skew`
    for fmt in (http_date,
                lambda t: time.strftime("%A, %d-%b-%y %H:%M:%S GMT", time.gmtime(t)),  # RFC 850
                lambda t: time.strftime("%a %b %d %H:%M:%S %Y", time.gmtime(t))):      # asctime
        headers = {"date": fmt(server_now), "retry-after": fmt(server_now + 12)}
        assert parse_retry_after(headers) == 12.0
    # a date in the server's past is no wait at all, whatever our clock says
    assert parse_retry_after({"date": http_date(server_now), "retry-after": http_date(server_now - 5)}) == 0.0


def test_without_a_date_header_the_local_clock_is_used() -> None:
    now = 1_767_225_600.0
    assert parse_retry_after({"retry-after": http_date(now + 7)}, now=now) == 7.0
    # an unparsable Date is as good as none
    assert parse_retry_after({"retry-after": http_date(now + 7), "date": "yesterday"}, now=now) == 7.0
    # seconds and milliseconds do not depend on any clock
    assert parse_retry_after({"retry-after": "4", "date": http_date(now - 999)}) == 4.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("skew", [-3600.0, 3600.0])
async def test_the_real_http_path_waits_exactly_the_servers_wait_despite_clock_skew(protocol: str,
                                                                                  skew: float) -> None:
    server_now = float(int(time.time() + skew))
    hint = {"Date": http_date(server_now), "Retry-After": http_date(server_now + 2)}
    server = ReplayServer([rate_limited(protocol, hint), OK[protocol]()])
    sleeps = Sleeps()
    p = provider(protocol, await server.start(), retry=RetryPolicy(sleep=sleeps))
    try:
        events = [ev async for ev in p.chat_stream(_request())]
    finally:
        await p.aclose()
        await server.close()
    assert events[-1].full_response.text == "hello"
    assert sleeps.waits == [2.0]  # not 3602 s (server ahead: given up) nor 0 (server behind)


async def test_a_503_with_an_http_date_is_waited_for_exactly() -> None:
    server_now = float(int(time.time() - 600))
    busy = RecordedResponse(503, b'{"error":{"message":"down for a moment","type":"server_error"}}',
                            headers={"Date": http_date(server_now), "Retry-After": http_date(server_now + 3)})
    server = ReplayServer([busy, chat_ok()])
    sleeps = Sleeps()
    p = provider("chat", await server.start(), retry=RetryPolicy(sleep=sleeps))
    try:
        assert (await p.chat(_request())).text == "hello"
    finally:
        await p.aclose()
        await server.close()
    assert sleeps.waits == [3.0]


def _request() -> Any:
    from fsm_agent.types import MessageRequest, UserMessage

    return MessageRequest(model="m", messages=(UserMessage("hi"),))


# -- one event per retry, to observers and the session log -----------------------------------------------
class Retries(Observer):
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def on_model_retry(self, event: ModelRetry) -> None:
        self.log.append(event)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_every_provider_retry_is_an_event_before_its_wait_and_in_the_session_log(protocol: str,
                                                                                     tmp_path: Path) -> None:
    order: list[Any] = []
    seen_by_callable: list[Any] = []
    server = ReplayServer([rate_limited(protocol, {"Retry-After": "0.25"}), BUSY[protocol], OK[protocol]("done")])
    sleeps = Sleeps(order)
    p = provider(protocol, await server.start(),
                 retry=RetryPolicy(max_attempts=3, initial_delay=0.25, rng=lambda: 0.5, sleep=sleeps))
    store = SQLiteStore(str(tmp_path / "s.db"))
    agent = Agent(p, store=store, observers=[Retries(order), seen_by_callable.append])
    try:
        result = await agent.run("hi")
    finally:
        await p.aclose()
        await server.close()
    assert result.stop.reason is StopReason.COMPLETED and result.output == "done"
    busy_status, busy_kind = (503, "server_error") if protocol == "chat" else (529, "overloaded")
    retries = [e for e in order if isinstance(e, ModelRetry)]
    assert [(e.attempt, e.status, e.kind, e.delay_s, e.server_hint, e.layer) for e in retries] == [
        (1, 429, "rate_limited", 0.25, True, "provider"),
        (2, busy_status, busy_kind, 0.75, False, "provider"),  # base 0.5, jitter: half of 0.5 on top
    ]
    # announced before the wait it announces
    assert [type(e).__name__ if not isinstance(e, tuple) else e[0] for e in order] == [
        "ModelRetry", "sleep", "ModelRetry", "sleep"]
    assert "rate" in retries[0].reason.lower() and retries[0].turn == 1
    assert retries[0].session_id == result.session_id and retries[0].provider == p.name
    assert [e for e in seen_by_callable if isinstance(e, ModelRetry)] == retries
    logged = await store.read_events(result.session_id, types=["model_retry"])
    assert [(r.payload["attempt"], r.payload["status"], r.payload["kind"], r.payload["delay_s"],
             r.payload["server_hint"]) for r in logged] == [(1, 429, "rate_limited", 0.25, True),
                                                           (2, busy_status, busy_kind, 0.75, False)]
    assert all(r.turn_id == f"{result.session_id}:1" for r in logged)
    # logged before the model call they belong to
    calls = await store.read_events(result.session_id, types=["model_call"])
    assert max(r.seq for r in logged) < calls[0].seq


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_never_retried_statuses_announce_no_retry(status: str, tmp_path: Path) -> None:
    body = b'{"error":{"message":"no","type":"server_error"}}'
    server = ReplayServer([RecordedResponse(status, body, headers={"Retry-After": "0", "x-should-retry": "true"}),
                           chat_ok()])
    log: list[Any] = []
    p = provider("chat", await server.start(), retry=RetryPolicy(sleep=Sleeps()))
    try:
        result = await Agent(p, observers=[Retries(log)]).run("hi")
    finally:
        await p.aclose()
        await server.close()
    assert result.stop.reason in (StopReason.FAILED_TERMINAL, StopReason.FAILED_RETRYABLE)
    assert log == [] and len(server.requests) == 1


async def test_the_retry_plugin_announces_its_retries_too() -> None:
    provider_ = ScriptedProvider([ServerError("upstream 500", provider="scripted", status=500),
                                  RateLimitError("slow down", provider="scripted", status=429, retry_after=0.5),
                                  "ok"])
    sleeps = Sleeps()
    log: list[Any] = []
    mw = RetryFallback(max_attempts=3, initial_delay=0.1, rng=lambda: 0.0, sleep=sleeps)
    agent = Agent(provider_, middleware=[mw], observers=[Retries(log)])
    result = await agent.run("hi")
    assert result.stop.reason is StopReason.COMPLETED
    assert [(e.attempt, e.status, e.kind, e.delay_s, e.server_hint, e.layer, e.provider) for e in log] == [
        (1, 500, "server_error", 0.1, False, "retry", "scripted"),
        (2, 429, "rate_limited", 0.5, True, "retry", "scripted"),
    ]
    assert sleeps.waits == [0.1, 0.5]
    logged = await agent.store.read_events(result.session_id, types=["model_retry"])
    assert [(r.payload["attempt"], r.payload["layer"], r.payload["delay_s"]) for r in logged] == [
        (1, "retry", 0.1), (2, "retry", 0.5)]


# -- a wait longer than the budget -------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_wait_longer_than_the_budget_left_stops_with_the_wait_in_seconds(protocol: str,
                                                                               tmp_path: Path) -> None:
    server_now = float(int(time.time() + 3600))  # a skewed server clock: the Date header decides
    hint = {"Date": http_date(server_now), "Retry-After": http_date(server_now + 40)}
    server = ReplayServer([rate_limited(protocol, hint), OK[protocol]()])
    log: list[Any] = []
    p = provider(protocol, await server.start(), retry=RetryPolicy(sleep=Sleeps()))
    store = SQLiteStore(str(tmp_path / "s.db"))
    try:
        result = await Agent(p, store=store, observers=[Retries(log)]).run("hi", max_wall_clock=20)
    finally:
        await p.aclose()
        await server.close()
    stop = result.stop
    assert stop.reason is StopReason.FAILED_RETRYABLE and stop.resumable
    assert stop.error is not None and stop.error["retry_after_s"] == 40.0 and stop.error["kind"] == "rate_limited"
    assert "the server asked to wait 40 s before retrying" in stop.detail
    assert "left of the run's wall-clock budget" in stop.detail
    assert log == [] and len(server.requests) == 1  # no retry announced, none made
    (logged,) = await store.read_events(result.session_id, types=["run_stopped"])
    assert logged.payload["stop"]["error"]["retry_after_s"] == 40.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_wait_longer_than_max_retry_after_stops_with_the_wait_in_seconds(protocol: str) -> None:
    server = ReplayServer([rate_limited(protocol, {"Retry-After": "120"}), OK[protocol]()])
    p = provider(protocol, await server.start(), retry=RetryPolicy(sleep=Sleeps()))
    try:
        result = await Agent(p).run("hi")
    finally:
        await p.aclose()
        await server.close()
    assert result.stop.reason is StopReason.FAILED_RETRYABLE
    assert result.stop.error is not None and result.stop.error["retry_after_s"] == 120.0
    assert "the server asked to wait 120 s before retrying, longer than max_retry_after (60 s)" in result.stop.detail
    assert result.stop.detail.count("not retried") == 1


async def test_the_plugin_stops_on_a_wait_past_the_budget_with_the_wait_in_seconds() -> None:
    provider_ = ScriptedProvider([RateLimitError("slow down", provider="scripted", status=429, retry_after=30.0),
                                  "ok"])
    mw = RetryFallback(max_attempts=3, sleep=Sleeps())
    result = await Agent(provider_, middleware=[mw]).run("hi", config=RunConfig(max_wall_clock=10))
    assert result.stop.reason is StopReason.FAILED_RETRYABLE
    assert result.stop.error is not None and result.stop.error["retry_after_s"] == 30.0
    assert "the server asked to wait 30 s before retrying" in result.stop.detail


def test_no_hint_no_retry_after_in_the_stop() -> None:
    assert "retry_after_s" not in ServerError("x", status=500).to_info()
    assert "retry_after_s" not in AuthenticationError("x", status=401).to_info()
    assert RateLimitError("x", retry_after=2.5).to_info()["retry_after_s"] == 2.5
