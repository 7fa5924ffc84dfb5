"""Issue 19 item 1: a partial answer cut by a provider error is not history.

On every protocol, whatever cut it (an error event after some text, an ``{"error": ...}`` chunk,
``response.failed``, a dropped connection), nothing that streamed stays in the conversation and
nothing of the failed call counts as an answer's usage; the stop carries the streamed text as
``partial``. A resume, or an in-run retry (the ``retry`` plugin, or the provider's own replay of a
stream), asks again from the same history, and the final history holds exactly one answer, also
when an Interrupt lands while the retry waits. Everything runs over real HTTP (``ReplayServer``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from fsm_agent import Agent, Interrupt, RetryPolicy, StopReason
from fsm_agent.providers import ProviderConfig, create_provider
from fsm_agent.store import MemoryStore
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import AssistantMessage, Usage
from fsm_agent_middleware.retry import RetryFallback

SSE = "text/event-stream"
STREAMED = "The capital of France"
ANSWER = "The capital of France is Paris."


# ------------------------------------------------------------------------------ wire bodies
def _sse(*events: tuple[str | None, Any]) -> bytes:
    out = b""
    for name, data in events:
        out += (f"event: {name}\n".encode() if name else b"") + b"data: " + (
            data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"
    return out


def _chat(pieces: list[str], tail: list[tuple[str | None, Any]]) -> bytes:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> tuple[None, dict[str, Any]]:
        return None, {"id": "c1", "object": "chat.completion.chunk", "model": "m",
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return _sse(chunk({"role": "assistant", "content": ""}), *(chunk({"content": p}) for p in pieces), *tail)


def _chat_ok(text: str) -> bytes:
    usage = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [],
             "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}}
    done = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    return _chat([text], [(None, done), (None, usage), (None, b"[DONE]")])


def _responses(pieces: list[str], tail: list[tuple[str | None, Any]]) -> bytes:
    resp = {"id": "resp_1", "object": "response", "model": "m", "status": "in_progress", "output": []}
    head = [("response.created", {"type": "response.created", "response": resp}),
            ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0, "item": {
                "id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}}),
            ("response.content_part.added", {"type": "response.content_part.added", "item_id": "msg_1",
                                             "output_index": 0, "content_index": 0,
                                             "part": {"type": "output_text", "text": "", "annotations": []}})]
    deltas = [("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1",
                                              "output_index": 0, "content_index": 0, "delta": p}) for p in pieces]
    return _sse(*head, *deltas, *tail)


def _responses_ok(text: str) -> bytes:
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    done = {"id": "resp_1", "object": "response", "model": "m", "status": "completed", "output": [item],
            "usage": {"input_tokens": 12, "output_tokens": 7, "total_tokens": 19}}
    return _responses([text], [("response.output_item.done", {"type": "response.output_item.done",
                                                              "output_index": 0, "item": item}),
                               ("response.completed", {"type": "response.completed", "response": done})])


def _anthropic(pieces: list[str], tail: list[tuple[str | None, Any]]) -> bytes:
    start = {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                  "model": "claude-x", "content": [], "stop_reason": None,
                                                  "usage": {"input_tokens": 12, "output_tokens": 1}}}
    head = [("message_start", start),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}})]
    deltas = [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": p}}) for p in pieces]
    return _sse(*head, *deltas, *tail)


def _anthropic_ok(text: str) -> bytes:
    return _anthropic([text], [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                               ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                                  "usage": {"output_tokens": 7}}),
                               ("message_stop", {"type": "message_stop"})])


PIECES = ["The capital ", "of France"]
FAILURES: dict[str, dict[str, RecordedResponse]] = {
    "openai": {
        "error chunk": RecordedResponse(200, _chat(PIECES, [(None, {"error": {
            "message": "The server had an error while processing your request.", "type": "server_error"}})]), SSE),
        "error event": RecordedResponse(200, _chat(PIECES, [("error", {"error": {
            "message": "Overloaded", "type": "overloaded_error"}})]), SSE),
        "dropped": RecordedResponse(200, _chat(PIECES, []) + b"data: {\"id\": \"c1\", \"choi", SSE),
    },
    "openai-responses": {
        "error event": RecordedResponse(200, _responses(PIECES, [("error", {
            "type": "error", "code": "server_error", "message": "The server had an error.", "param": None})]), SSE),
        "response.failed": RecordedResponse(200, _responses(PIECES, [("response.failed", {
            "type": "response.failed", "response": {"id": "resp_1", "object": "response", "status": "failed",
                                                    "output": [], "error": {"code": "server_error",
                                                                            "message": "The server had an error."}}})]),
            SSE),
        "dropped": RecordedResponse(200, _responses(PIECES, []) + b"event: response.output_text.delta\ndata: {\"ty",
                                    SSE),
    },
    "anthropic": {
        "error event": RecordedResponse(200, _anthropic(PIECES, [("error", {
            "type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})]), SSE),
        "dropped": RecordedResponse(200, _anthropic(PIECES, []) + b"event: content_block_delta\ndata: {\"ty", SSE),
    },
}
OK = {"openai": _chat_ok, "openai-responses": _responses_ok, "anthropic": _anthropic_ok}
CASES = [(kind, shape) for kind, shapes in FAILURES.items() for shape in shapes]


def _provider(kind: str, base: str, **kw: Any) -> Any:
    kw.setdefault("retry", RetryPolicy(max_attempts=1))
    return create_provider(kind, ProviderConfig(base_url=base, api_key="k", model="m", **kw))


def _history(kind: str, body: dict[str, Any]) -> Any:
    return body["input"] if kind == "openai-responses" else body["messages"]


def _answers(result: Any) -> list[str]:
    return [m.text for m in result.messages if isinstance(m, AssistantMessage)]


# ------------------------------------------------------------------------------ the stop, then a resume
@pytest.mark.parametrize(("kind", "shape"), CASES)
async def test_a_failed_answer_is_not_history_and_a_resume_asks_again(kind: str, shape: str) -> None:
    server = ReplayServer([FAILURES[kind][shape], RecordedResponse(200, OK[kind](ANSWER), SSE)], seed=3)
    base = await server.start()
    p = _provider(kind, base)
    agent = Agent(p, store=MemoryStore())
    try:
        first = await agent.run("What is the capital of France?")
        assert first.stop.reason is StopReason.FAILED_RETRYABLE, first.stop.detail
        assert _answers(first) == [] and first.output == ""  # not in the conversation
        assert first.usage == Usage()  # the failed call is not counted as an answer
        assert first.stop.partial == STREAMED  # for the user
        second = await agent.resume(first.session_id)
    finally:
        await p.aclose()
        await server.close()
    assert second.stop.reason is StopReason.COMPLETED, second.stop.detail
    assert _answers(second) == [ANSWER]  # exactly one answer
    assert second.usage == Usage(12, 7)  # the answer's reported usage, nothing estimated
    bodies = [r.json() for r in server.requests]
    assert _history(kind, bodies[1]) == _history(kind, bodies[0])  # asked again from the same history
    assert "The capital" not in json.dumps(_history(kind, bodies[1]))


async def test_a_non_streamed_failure_is_not_history_either() -> None:
    server = ReplayServer([RecordedResponse(503, b'{"error": {"message": "busy", "type": "server_error"}}'),
                           RecordedResponse(200, json.dumps({
                               "id": "c", "object": "chat.completion", "model": "m",
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER},
                                            "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 12, "completion_tokens": 7}}).encode())])
    base = await server.start()
    p = _provider("openai", base)
    agent = Agent(p, store=MemoryStore())
    try:
        first = await agent.run("q", stream=False)
        assert first.stop.reason is StopReason.FAILED_RETRYABLE and first.stop.partial is None
        second = await agent.resume(first.session_id)
    finally:
        await p.aclose()
        await server.close()
    assert _answers(second) == [ANSWER] and second.usage == Usage(12, 7)


# ------------------------------------------------------------------------------ in-run retries
@pytest.mark.parametrize("kind", list(OK))
async def test_the_retry_plugin_asks_again_and_the_history_holds_one_answer(kind: str) -> None:
    shape = next(iter(FAILURES[kind]))
    server = ReplayServer([FAILURES[kind][shape], RecordedResponse(200, OK[kind](ANSWER), SSE)], seed=4)
    base = await server.start()
    p = _provider(kind, base)

    async def no_wait(_: float) -> None:
        return None

    try:
        result = await Agent(p, middleware=[RetryFallback(max_attempts=2, sleep=no_wait)]).run("q")
    finally:
        await p.aclose()
        await server.close()
    assert result.stop.reason is StopReason.COMPLETED and _answers(result) == [ANSWER]
    bodies = [r.json() for r in server.requests]
    assert _history(kind, bodies[1]) == _history(kind, bodies[0])


@pytest.mark.parametrize("layer", ["retry plugin", "provider replay"])
async def test_an_interrupt_while_a_retry_waits_keeps_nothing_of_the_failed_answer(layer: str) -> None:
    """The failed attempt streamed some text, and an Interrupt lands during the wait before the next
    attempt: the run ends INTERRUPTED with nothing of the failed answer in the conversation, and a
    resume asks again from the same history."""
    server = ReplayServer([FAILURES["openai"]["error chunk"], RecordedResponse(200, _chat_ok(ANSWER), SSE)])
    base = await server.start()
    holder: list[Agent] = []

    async def interrupt_while_waiting(_: float) -> None:
        holder[0].interrupt_all("stop while the retry waits")
        await asyncio.sleep(30)  # cut by the interrupt

    if layer == "retry plugin":
        p = _provider("openai", base)
        agent = Agent(p, store=MemoryStore(),
                      middleware=[RetryFallback(max_attempts=2, sleep=interrupt_while_waiting)])
    else:
        p = _provider("openai", base, allow_stream_replay=True,
                      retry=RetryPolicy(max_attempts=2, sleep=interrupt_while_waiting))
        agent = Agent(p, store=MemoryStore())
    holder.append(agent)
    try:
        first = await agent.run("What is the capital of France?")
        assert first.stop.reason is StopReason.INTERRUPTED, first.stop.detail
        assert _answers(first) == [], first.messages
        assert len(server.requests) == 1
        second = await agent.resume(first.session_id)
    finally:
        await p.aclose()
        await server.close()
    assert second.stop.reason is StopReason.COMPLETED and _answers(second) == [ANSWER]
    bodies = [r.json() for r in server.requests]
    assert bodies[1]["messages"] == bodies[0]["messages"]


async def test_an_interrupt_mid_answer_still_keeps_what_streamed() -> None:
    """The other side of the rule: an Interrupt is the user's choice, so the streamed part of an
    interrupted answer stays (marked interrupted) and a resume continues from it."""
    slow = _chat(["word "] * 300, [(None, {"id": "c1", "object": "chat.completion.chunk", "model": "m",
                                           "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})])
    server = ReplayServer([RecordedResponse(200, slow, SSE, chunk_delay=0.01), RecordedResponse(200, _chat_ok("end."),
                                                                                              SSE)], chunk_sizes=[64])
    base = await server.start()
    p = _provider("openai", base)
    agent = Agent(p, store=MemoryStore(), control_poll=0.05)
    try:
        run = asyncio.ensure_future(agent.run("talk", session_id="i"))
        while not server.requests:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        await agent.control("i", Interrupt("enough"))
        first = await run
    finally:
        await p.aclose()
        await server.close()
    assert first.stop.reason is StopReason.INTERRUPTED and first.stop.partial is None
    kept = [m for m in first.messages if isinstance(m, AssistantMessage)]
    assert len(kept) == 1 and kept[0].text.startswith("word ") and kept[0].provider_data == {"interrupted": True}
