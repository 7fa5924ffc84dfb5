"""Redaction of the answer of record (issue 23 item 4): a configured secret the model writes itself,
split over several deltas, is masked not only in the live stream but in what the run records: the
transcript, ``RunResult.output``, the session log (every event of it), the server's SSE stream (its
``message`` and ``run_stopped`` frames as well as its live deltas), a failed stream's ``stop.partial``
and an interrupted answer kept in the transcript. Tools listed in ``restore_in_tool_args`` still get the
original; others get the placeholder. A run with the plugin replays byte for byte."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp.test_utils import TestClient, TestServer
from attrs import evolve

from fsm_agent import Agent, MemoryStore, RunConfig, StopReason, tool
from fsm_agent.control import Interrupt
from fsm_agent.errors import ProviderError
from fsm_agent.server import create_app
from fsm_agent.types import (AssistantMessage, MessageComplete, MessageRequest, ModelStreamEvent, StreamEvent,
                             TextDelta, ThinkingBlock, ToolResultMessage)
from fsm_agent_middleware.redaction import Redaction
from machine.replay_kit import Outcome, outcome_of, roundtrip

from .test_redaction_stream import PH, PIECES, SECRET, SplitProvider, frames_of

SID = "s-record"


def _tools(calls: list[tuple[str, str]]) -> list[Any]:
    @tool
    def lookup(token: str) -> str:
        """Look a token up (allowed the original).

        Args:
            token: the token.
        """
        calls.append(("lookup", token))
        return "owned by Ada"

    @tool
    def note(text: str) -> str:
        """Write a note (not allowed the original).

        Args:
            text: what to note.
        """
        calls.append(("note", text))
        return "noted"

    return [lookup, note]


def _answers() -> list[Any]:
    """Turn 1: thinking (unsigned), text and two tool calls, each with the secret cut in three; turn 2:
    the secret at the very end of the stream."""
    return [
        [("thinking", ["The user wants the key ", *PIECES, " read back."]),
         ("text", ["Your key is ", *PIECES, " — keep it safe."]),
         ("tool:lookup", ['{"token": "', *PIECES, '"}']),
         ("tool:note", ['{"text": "key ', *PIECES, '"}'])],
        [("text", ["Done: ", "sk-live-", "ABCDEF", "123456"])],
    ]


def _redaction() -> Redaction:
    return Redaction(literals=[SECRET], restore_in_tool_args={"lookup"})


def _payloads(events: list[Any]) -> list[str]:
    return [orjson.dumps({"type": e.type, "payload": e.payload}, default=repr).decode() for e in events]


async def test_a_secret_the_model_writes_split_over_deltas_is_in_no_event_of_the_log_and_not_in_the_output() -> None:
    calls: list[tuple[str, str]] = []
    store = MemoryStore()
    agent = Agent(SplitProvider(*_answers()), tools=_tools(calls), middleware=[_redaction()], store=store)
    result = await agent.run("Read my key back.", session_id=SID)
    assert result.stop.reason is StopReason.COMPLETED
    assert result.output == f"Done: {PH}"
    # the tool allowed the originals got the secret back; the other one got the placeholder
    assert calls == [("lookup", SECRET), ("note", f"key {PH}")]
    events = await store.read_events(SID)
    texts = _payloads(events)
    assert texts and all(SECRET not in t for t in texts), [t for t in texts if SECRET in t]
    # the model's answers are recorded, masked: text, unsigned thinking and tool-call arguments
    said = [e.payload["message"] for e in events if e.type == "message" and e.payload["message"]["role"] == "assistant"]
    assert [[b.get("text") or b.get("thinking") or b.get("input") for b in m["content"]] for m in said] == [
        [f"The user wants the key {PH} read back.", f"Your key is {PH} — keep it safe.", {"token": PH},
         {"text": f"key {PH}"}],
        [f"Done: {PH}"],
    ]
    assert SECRET not in repr(result.messages)
    results = [m.text for m in result.messages if isinstance(m, ToolResultMessage)]
    assert results == ["owned by Ada", "noted"]


async def test_the_servers_sse_stream_carries_the_secret_in_no_frame() -> None:
    def factory(store: Any) -> Agent:
        return Agent(SplitProvider(*_answers(), pace=0.01), tools=_tools([]), middleware=[_redaction()], store=store)

    client = TestClient(TestServer(create_app(factory, MemoryStore()), host="127.0.0.1"))
    await client.start_server()
    try:
        r = await client.post("/sessions/s/runs/stream", json={"task": "Read my key back."})
        assert r.status == 200
        raw = await asyncio.wait_for(r.read(), 20)
    finally:
        await client.close()
    assert SECRET.encode() not in raw
    frames = frames_of(raw)
    kinds = {f["event"] for f in frames}
    assert {b"delta", b"message", b"run_stopped"} <= kinds
    messages = [orjson.loads(f["data"]) for f in frames if f["event"] == b"message"]
    assistant = [m for m in messages if m["payload"]["message"]["role"] == "assistant"]
    assert len(assistant) == 2 and assistant[-1]["payload"]["message"]["content"][0]["text"] == f"Done: {PH}"
    assert PH in orjson.dumps(assistant[0]).decode()
    joined = "".join(orjson.loads(f["data"])["text"] for f in frames if f["event"] == b"delta")
    assert SECRET not in joined and PH in joined


async def test_a_failed_streams_partial_is_masked_in_the_result_and_in_the_log() -> None:
    """The secret ends the text when the provider raises: held, it is released masked at the failure,
    and the stop's ``partial`` is the text as it was shown."""
    store = MemoryStore()
    fail = ProviderError("connection reset by peer", provider="split", retryable=True)
    agent = Agent(SplitProvider([("text", ["Key: ", *PIECES])], fail=fail), middleware=[_redaction()], store=store)
    result = await agent.run("go", session_id=SID)
    assert result.stop.reason is StopReason.FAILED_RETRYABLE
    assert result.stop.partial == f"Key: {PH}"
    events = await store.read_events(SID)
    [stopped] = [e for e in events if e.type == "run_stopped"]
    assert orjson.dumps(stopped.payload, default=repr).decode().count(PH) >= 1
    assert all(SECRET not in t for t in _payloads(events))


async def test_with_mask_record_off_the_record_keeps_what_the_model_wrote() -> None:
    calls: list[tuple[str, str]] = []
    agent = Agent(SplitProvider(*_answers()), tools=_tools(calls),
                  middleware=[Redaction(literals=[SECRET], mask_record=False)])
    result = await agent.run("go")
    assert result.output == f"Done: {SECRET}"
    assert calls == [("lookup", SECRET), ("note", f"key {SECRET}")]


async def test_signed_thinking_is_kept_as_the_provider_signed_it() -> None:
    class Signed(SplitProvider):
        """Its thinking comes signed (as Anthropic's does)."""

        async def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
            async for ev in super().chat_stream(request):
                if isinstance(ev, MessageComplete):
                    blocks = tuple(evolve(b, signature="sig") if isinstance(b, ThinkingBlock) else b
                                   for b in ev.full_response.message.content)
                    ev = MessageComplete(evolve(ev.full_response, message=AssistantMessage(blocks)))
                yield ev

    agent = Agent(Signed([("thinking", ["Think ", *PIECES]), ("text", ["Say ", *PIECES])]),
                  middleware=[_redaction()])
    result = await agent.run("go")
    [answer] = [m for m in result.messages if isinstance(m, AssistantMessage)]
    thinking, text = answer.content
    assert isinstance(thinking, ThinkingBlock) and thinking.thinking == f"Think {SECRET}" and thinking.signature == "sig"
    assert result.output == f"Say {PH}"


class _InterruptOnPlaceholder:
    """An observer of the live agent: interrupts the run once the masked secret has streamed."""

    def __init__(self, ref: list[Agent]) -> None:
        self.ref, self.sent = ref, False

    def on_model_event(self, event: ModelStreamEvent) -> None:
        if not self.sent and isinstance(event.event, TextDelta) and PH in event.event.text:
            self.sent = True
            asyncio.ensure_future(self.ref[0].control(SID, Interrupt("stop there")))


async def test_an_interrupted_answer_is_kept_in_the_transcript_as_it_was_shown_and_replays() -> None:
    """The cut answer kept in the transcript is the stream as the filters showed it (masked); the run,
    recorded live and replayed from its effects, writes the same log byte for byte."""
    ref: list[Agent] = []
    words = ["Key: ", *PIECES, *[" word"] * 60]

    def build(live: bool) -> Agent:
        provider = SplitProvider([("text", words)], pace=0.01) if live else SplitProvider()  # never called
        agent = Agent(provider, middleware=[_redaction()], store=MemoryStore(), config=RunConfig(stream=True),
                      control_poll=0.01, observers=[_InterruptOnPlaceholder(ref)] if live else [])
        ref[:] = [agent]
        return agent

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("talk", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    [result] = rt.results
    assert result.stop.reason is StopReason.INTERRUPTED
    [kept] = [m for m in result.messages if isinstance(m, AssistantMessage)]
    full = f"Key: {PH}" + " word" * 60
    assert kept.text.startswith(f"Key: {PH}") and full.startswith(kept.text)
    assert SECRET not in repr(result.messages)


async def test_a_run_with_a_secret_written_by_the_model_replays_byte_for_byte() -> None:
    def build(live: bool) -> Agent:
        provider = SplitProvider(*_answers()) if live else SplitProvider()  # a call would fail: nothing scripted
        return Agent(provider, tools=_tools([]), middleware=[_redaction()], store=MemoryStore(),
                     config=RunConfig(stream=True))

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("Read my key back.", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    assert rt.results[0].output == f"Done: {PH}"
