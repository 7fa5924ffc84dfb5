"""Issue 23 item 10: an empty response may switch provider (seed 000 §5.2.6: "empty response: retry
once; the router may switch to another provider").

With a fallback chain, the one retry after an empty response (no text, no tool call) goes to the next
provider: the primary does not retry it itself. Both chains: :class:`FallbackProvider` (below the
middleware, inside one model call of the port) and the ``retry`` plugin (each provider's call a model
call of the port). The session log says which provider came up empty (``model_retry``) and which one
answered (``model_call``). Everything runs through ``Agent.run``, over HTTP where a provider's own
retry is at stake.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fsm_agent import Agent, RetryPolicy, StopReason
from fsm_agent.errors import EmptyResponseError, ServerError
from fsm_agent.providers import FallbackProvider, ProviderConfig, ScriptedProvider, create_provider
from fsm_agent.store import MemoryStore
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import AssistantMessage, MessageResponse, ModelStopReason, TextBlock, Usage
from fsm_agent_middleware.retry import RetryFallback

from machine.replay_kit import Outcome, outcome_of, roundtrip

SSE = "text/event-stream"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "model": "primary-model",
                                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"


EMPTY = RecordedResponse(200, _chunk({"role": "assistant", "content": ""}) + _chunk({}, "stop") + b"data: [DONE]\n\n", SSE)


def _anthropic_ok(text: str) -> RecordedResponse:
    def ev(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
    return RecordedResponse(200, b"".join([
        ev("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "backup-model", "content": [],
            "stop_reason": None, "usage": {"input_tokens": 12, "output_tokens": 1}}}),
        ev("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ev("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
        ev("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 4}}),
        ev("message_stop", {"type": "message_stop"})]), SSE)


ANTHROPIC_EMPTY = RecordedResponse(200, b"".join(
    f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_0", "type": "message", "role": "assistant", "model": "backup-model", "content": [],
            "stop_reason": None, "usage": {"input_tokens": 12, "output_tokens": 1}}}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}}),
        ("message_stop", {"type": "message_stop"})]), SSE)


def _empty_answer(provider: str) -> MessageResponse:
    return MessageResponse("r0", "m", AssistantMessage((TextBlock(""),)), ModelStopReason.END_TURN, "stop",
                           Usage(10, 0), provider)


def _answer(text: str, provider: str) -> MessageResponse:
    return MessageResponse("r1", "m", AssistantMessage((TextBlock(text),)), ModelStopReason.END_TURN, "stop",
                           Usage(10, 3), provider)


async def _events(store: MemoryStore, session_id: str, type_: str) -> list[dict[str, Any]]:
    return [e.payload for e in await store.read_events(session_id) if e.type == type_]


class _Http:
    """An HTTP primary (OpenAI Chat, serving ``primary``) and backup (Anthropic, serving ``backup``)."""

    def __init__(self, primary: list[RecordedResponse], backup: list[RecordedResponse]) -> None:
        self.s1, self.s2 = ReplayServer(primary, repeat_last=True), ReplayServer(backup, repeat_last=True)

    async def __aenter__(self) -> _Http:
        b1, b2 = await self.s1.start(), await self.s2.start()
        retry = RetryPolicy(initial_delay=0.01)
        self.primary = create_provider("openai", ProviderConfig(base_url=b1, api_key="k", model="primary-model",
                                                                retry=retry))
        self.backup = create_provider("anthropic", ProviderConfig(base_url=b2, api_key="k", model="backup-model",
                                                                  retry=retry))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.primary.aclose()
        await self.backup.aclose()
        await self.s1.close()
        await self.s2.close()


# ------------------------------------------------------------------------------ FallbackProvider
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
async def test_the_one_retry_after_an_empty_response_goes_to_the_next_provider(stream: bool) -> None:
    async with _Http([EMPTY], [_anthropic_ok("Paris.")]) as http:
        store = MemoryStore()
        chain = FallbackProvider([http.primary, http.backup])
        result = await Agent(chain, store=store).run("Capital of France?", stream=stream)
    assert result.stop.reason is StopReason.COMPLETED and result.output == "Paris."
    assert len(http.s1.requests) == 1  # the primary did not retry its empty answer itself
    assert len(http.s2.requests) == 1 and http.s2.requests[0].json()["model"] == "backup-model"
    (retry,) = await _events(store, result.session_id, "model_retry")
    assert (retry["provider"], retry["kind"], retry["attempt"], retry["delay_s"], retry["layer"]) == (
        "openai", "empty_response", 1, 0.0, "provider")
    (call,) = await _events(store, result.session_id, "model_call")
    assert (call["provider"], call["model"]) == ("anthropic", "backup-model")  # who answered
    assert [m.text for m in result.messages if isinstance(m, AssistantMessage)] == ["Paris."]


async def test_without_a_chain_the_provider_retries_its_empty_answer_itself() -> None:
    async with _Http([EMPTY, RecordedResponse(200, _chunk({"role": "assistant", "content": "Paris."})
                                              + _chunk({}, "stop") + b"data: [DONE]\n\n", SSE)], []) as http:
        store = MemoryStore()
        result = await Agent(http.primary, store=store).run("Capital of France?")
    assert result.output == "Paris." and len(http.s1.requests) == 2
    (retry,) = await _events(store, result.session_id, "model_retry")
    assert (retry["provider"], retry["kind"]) == ("openai", "empty_response") and retry["delay_s"] > 0


async def test_when_every_provider_comes_up_empty_the_last_keeps_its_own_retry_and_the_run_stops() -> None:
    async with _Http([EMPTY], [ANTHROPIC_EMPTY]) as http:
        result = await Agent(FallbackProvider([http.primary, http.backup])).run("Capital of France?")
    assert (len(http.s1.requests), len(http.s2.requests)) == (1, 2)
    assert result.stop.reason is StopReason.FAILED_RETRYABLE and result.stop.error["kind"] == "empty_response"


async def test_a_rule_that_does_not_move_empty_answers_on_keeps_the_primarys_own_retry() -> None:
    async with _Http([EMPTY], [_anthropic_ok("Paris.")]) as http:
        result = await Agent(FallbackProvider([http.primary, http.backup], on=(ServerError,))).run("Capital?")
    assert (len(http.s1.requests), len(http.s2.requests)) == (2, 0)
    assert result.stop.error["kind"] == "empty_response"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
async def test_an_empty_answer_a_provider_returns_moves_on_too(stream: bool) -> None:
    primary = ScriptedProvider([_empty_answer("primary")])
    backup = ScriptedProvider([_answer("Paris.", "backup")])
    store = MemoryStore()
    result = await Agent(FallbackProvider([primary, backup]), store=store).run("Capital?", stream=stream)
    assert result.output == "Paris." and (len(primary.requests), len(backup.requests)) == (1, 1)
    (retry,) = await _events(store, result.session_id, "model_retry")
    assert (retry["provider"], retry["kind"]) == ("primary", "empty_response")
    assert [c["provider"] for c in await _events(store, result.session_id, "model_call")] == ["backup"]


async def test_an_empty_answer_of_the_last_provider_is_the_answer() -> None:
    only = ScriptedProvider([_empty_answer("primary")])
    result = await Agent(FallbackProvider([only])).run("Capital?")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "" and len(only.requests) == 1


async def test_a_fallback_after_an_empty_response_replays() -> None:
    s1, s2 = ReplayServer([EMPTY], repeat_last=True), ReplayServer([_anthropic_ok("Paris.")], repeat_last=True)
    b1, b2 = await s1.start(), await s2.start()

    def build(live: bool) -> Agent:
        dead = "http://127.0.0.1:9"
        chain = FallbackProvider([
            create_provider("openai", ProviderConfig(base_url=b1 if live else dead, api_key="k", model="primary-model")),
            create_provider("anthropic", ProviderConfig(base_url=b2 if live else dead, api_key="k", model="backup-model"))])
        return Agent(chain, store=MemoryStore())

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        try:
            return [await outcome_of(agent.run("Capital of France?", session_id="s-empty", port=port))]
        finally:
            await agent.provider.aclose()

    try:
        rt = await roundtrip(build, drive, "s-empty")
    finally:
        await s1.close()
        await s2.close()
    assert rt.results[0].output == "Paris." and (len(s1.requests), len(s2.requests)) == (1, 1)
    assert [e["payload"]["kind"] for e in rt.recording.events if e["type"] == "model_retry"] == ["empty_response"]


# ------------------------------------------------------------------------------ the retry plugin
@pytest.mark.parametrize("empty", ["raised", "returned"])
async def test_the_retry_plugin_sends_an_empty_response_to_the_next_provider_at_once(empty: str) -> None:
    first: Any = EmptyResponseError("the model returned an empty response", provider="primary") \
        if empty == "raised" else _empty_answer("primary")
    primary = ScriptedProvider([first, _answer("Lyon?", "primary")])
    backup = ScriptedProvider([_answer("Paris.", "backup")])
    store = MemoryStore()
    agent = Agent(primary, store=store, middleware=[RetryFallback(max_attempts=3, fallbacks=[backup],
                                                                  sleep=_no_wait)])
    result = await agent.run("Capital of France?")
    assert result.output == "Paris."
    assert (len(primary.requests), len(backup.requests)) == (1, 1)  # not 3 attempts on the primary
    assert [c["provider"] for c in await _events(store, result.session_id, "model_call")] == ["backup"]


async def test_the_retry_plugin_still_retries_other_errors_on_the_same_provider() -> None:
    primary = ScriptedProvider([ServerError("boom", status=503), _answer("Paris.", "primary")])
    backup = ScriptedProvider([_answer("Lyon.", "backup")])
    agent = Agent(primary, middleware=[RetryFallback(max_attempts=3, fallbacks=[backup], sleep=_no_wait)])
    result = await agent.run("Capital of France?")
    assert result.output == "Paris." and (len(primary.requests), len(backup.requests)) == (2, 0)


async def _no_wait(seconds: float) -> None:
    return None
