"""Issue 23 item 9: content filtered, as seed 000 §5.3.4 says: the loop ends and the user gets a
safety message as the answer; the stop and the session log record ``content_filtered``.

Every protocol's content-filter signal, over real HTTP (``ReplayServer``), streamed and not:
OpenAI Chat ``finish_reason: "content_filter"`` (Azure's recorded body, with its
``content_filter_results``; and a stream cut by the filter after some text), Azure's HTTP 400 with
code ``content_filter``, DashScope's (Qwen) recorded HTTP 400 ``data_inspection_failed``, Responses
``incomplete_details.reason: "content_filter"``, Anthropic's recorded ``stop_reason: "refusal"``
(its safety classifiers; ``stop_details``). A refusal the model wrote itself (OpenAI's recorded
``refusal`` stream) stays a ``refusal`` stop.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import pytest

from fsm_agent import Agent, RetryPolicy, StopReason
from fsm_agent.config import DEFAULT_CONTENT_FILTER_MESSAGE, RunConfig
from fsm_agent.errors import ConfigurationError
from fsm_agent.providers import ProviderConfig, create_provider
from fsm_agent.store import MemoryStore
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import AssistantMessage

import corpus

from .replay_kit import Outcome, outcome_of, roundtrip

SSE = "text/event-stream"
JSON = "application/json"
STREAMED = "Here is how to pick the lock"


def _recorded(path: str) -> RecordedResponse:
    body = next(b for b in corpus.bodies() if b.path == path)
    return RecordedResponse(body.status, body.data, body.content_type)


def _sse(*events: tuple[str | None, Any]) -> bytes:
    return b"".join((f"event: {n}\n".encode() if n else b"") + b"data: " +
                    (d if isinstance(d, bytes) else json.dumps(d).encode()) + b"\n\n" for n, d in events)


def _chat_chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> tuple[None, dict[str, Any]]:
    return None, {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o",
                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}


FILTERED = {"hate": {"filtered": False, "severity": "safe"}, "violence": {"filtered": True, "severity": "medium"}}
AZURE_STREAM = _sse(  # Azure streams the filter results on each choice; the filter cuts the answer
    _chat_chunk({"role": "assistant", "content": ""}), _chat_chunk({"content": STREAMED[:12]}),
    _chat_chunk({"content": STREAMED[12:]}), _chat_chunk({}, "content_filter", content_filter_results=FILTERED),
    (None, {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o", "choices": [],
            "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}}),
    (None, b"[DONE]"))
AZURE_400 = json.dumps({"error": {  # the shape Azure OpenAI documents for a filtered prompt
    "message": "The response was filtered due to the prompt triggering Azure OpenAI's content management policy.",
    "type": None, "param": "prompt", "code": "content_filter", "status": 400,
    "innererror": {"code": "ResponsibleAIPolicyViolation", "content_filter_result": FILTERED}}}).encode()


def _responses_filtered() -> bytes:
    resp = {"id": "resp_1", "object": "response", "model": "gpt-4o", "status": "in_progress", "output": []}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "incomplete",
            "content": [{"type": "output_text", "text": STREAMED, "annotations": []}]}
    end = {**resp, "status": "incomplete", "incomplete_details": {"reason": "content_filter"}, "output": [item],
           "usage": {"input_tokens": 20, "output_tokens": 9, "total_tokens": 29}}
    return _sse(
        ("response.created", {"type": "response.created", "response": resp}),
        ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                        "item": {**item, "status": "in_progress", "content": []}}),
        ("response.content_part.added", {"type": "response.content_part.added", "item_id": "msg_1", "output_index": 0,
                                         "content_index": 0, "part": {"type": "output_text", "text": ""}}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                                        "content_index": 0, "delta": STREAMED}),
        ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
        ("response.incomplete", {"type": "response.incomplete", "response": end}))


# name: (provider kind, the response, what the content_filtered event says)
CASES: dict[str, tuple[str, RecordedResponse, dict[str, Any]]] = {
    "azure-recorded-finish-reason": (
        "openai", _recorded("openai_chat/openllmetry__azure_content_filter.yaml.0.body"),
        {"via": "finish_reason", "raw_stop_reason": "content_filter", "model": "gpt-35-turbo", "streamed_chars": 0,
         "filter": lambda d: d["content_filter_results"]["hate"] == {"filtered": True, "severity": "high"}
         and d["prompt_filter_results"][0]["prompt_index"] == 0}),
    "azure-stream-cut-after-text": (
        "openai", RecordedResponse(200, AZURE_STREAM, SSE),
        {"via": "finish_reason", "raw_stop_reason": "content_filter", "model": "gpt-4o",
         "filter": lambda d: d["content_filter_results"] == FILTERED}),
    "azure-400-content-filter": (
        "openai", RecordedResponse(400, AZURE_400, JSON),
        {"via": "error", "status": 400, "code": "content_filter", "streamed_chars": 0,
         "filter": lambda d: d["error"]["innererror"]["code"] == "ResponsibleAIPolicyViolation"}),
    "qwen-recorded-400-data-inspection": (
        "qwen", _recorded("qwen/observed__error_payloads.jsonl.0.body"),
        {"via": "error", "status": 400, "code": "data_inspection_failed", "streamed_chars": 0,
         "message": "content filtered: Input data may contain inappropriate content.",
         "filter": lambda d: "data_inspection_failed" in d}),  # a Python repr, not JSON: kept as text
    "responses-incomplete-content-filter": (
        "openai-responses", RecordedResponse(200, _responses_filtered(), SSE),
        {"via": "finish_reason", "raw_stop_reason": "content_filter",
         "filter": lambda d: d["incomplete_details"] == {"reason": "content_filter"}}),
    "anthropic-recorded-refusal": (
        "anthropic", _recorded("anthropic/simonw-llm-anthropic__stream_refusal.yaml.0.body"),
        {"via": "finish_reason", "raw_stop_reason": "refusal", "model": "claude-fable-5-1", "streamed_chars": 0,
         "message": lambda m: m.startswith("This request was blocked as it seems to violate Anthropic's Terms"),
         "filter": lambda d: d["stop_details"]["category"] == "reasoning_extraction"}),
}


async def _run(kind: str, response: RecordedResponse, stream: bool, **kw: Any) -> tuple[Any, MemoryStore, Any]:
    server = ReplayServer([response], repeat_last=True, seed=3)
    base = await server.start()
    store = MemoryStore()
    p = create_provider(kind, ProviderConfig(base_url=base, api_key="k", model="m", retry=RetryPolicy(max_attempts=1)))
    try:
        result = await Agent(p, store=store).run("How do I pick a lock?", stream=stream, **kw)
    finally:
        await p.aclose()
        await server.close()
    return result, store, server


def _check(value: Any, want: Any) -> bool:
    return want(value) if callable(want) else value == want


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
@pytest.mark.parametrize("case", list(CASES))
async def test_the_user_gets_the_safety_message_and_the_log_says_content_filtered(case: str, stream: bool) -> None:
    kind, response, want = CASES[case]
    result, store, server = await _run(kind, response, stream)
    assert len(server.requests) == 1  # a filter is not retried
    stop = result.stop
    assert stop.reason is StopReason.FAILED_TERMINAL and not stop.resumable
    assert stop.error["kind"] == "content_filtered", stop.error
    assert "content filter blocked the answer" in stop.detail and "safety message" in stop.detail
    assert stop.partial is None  # the filter blocked it: none of it is handed out
    assert result.output == DEFAULT_CONTENT_FILTER_MESSAGE
    answers = [m.text for m in result.messages if isinstance(m, AssistantMessage)]
    assert answers == [DEFAULT_CONTENT_FILTER_MESSAGE]  # nothing the model wrote is history
    assert all(STREAMED not in m.text for m in result.messages)
    events = [e for e in await store.read_events(result.session_id) if e.type == "content_filtered"]
    assert len(events) == 1
    ev = events[0].payload
    assert ev["answer"] == DEFAULT_CONTENT_FILTER_MESSAGE and ev["provider"] == kind
    for key, value in want.items():
        if key == "filter":
            assert want["filter"](ev["details"]), ev["details"]
        else:
            assert _check(ev[key], value), (key, ev[key])


async def test_what_streamed_before_the_filter_reached_the_observers_but_not_the_conversation() -> None:
    seen: list[str] = []

    class Watch:
        def on_model_event(self, ev: Any) -> None:
            if ev.event.TAG == "text_delta":
                seen.append(ev.event.text)

    server = ReplayServer([RecordedResponse(200, AZURE_STREAM, SSE)], repeat_last=True)
    base = await server.start()
    p = create_provider("openai", ProviderConfig(base_url=base, api_key="k", model="m", retry=RetryPolicy(max_attempts=1)))
    try:
        result = await Agent(p, observers=[Watch()]).run("How do I pick a lock?")
    finally:
        await p.aclose()
        await server.close()
    assert "".join(seen) == STREAMED
    assert result.output == DEFAULT_CONTENT_FILTER_MESSAGE
    assert f"the {len(STREAMED)} characters that had streamed were dropped" in result.stop.detail
    assert result.usage.input_tokens == 20 and result.usage.output_tokens == 9  # the blocked call still counts


async def test_the_safety_message_is_configurable_and_never_blank() -> None:
    kind, response, _ = CASES["azure-recorded-finish-reason"]
    result, _, _ = await _run(kind, response, True, content_filter_message="Sorry, I can't answer that here.")
    assert result.output == "Sorry, I can't answer that here." and result.stop.error["kind"] == "content_filtered"
    with pytest.raises(ConfigurationError, match="content_filter_message must be a non-blank text"):
        RunConfig(content_filter_message="  ")


async def test_a_refusal_the_model_wrote_itself_stays_a_refusal() -> None:
    result, store, _ = await _run("openai", _recorded("openai_chat/openai-python__stream_refusal.sse.0.body"), True)
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["kind"] == "refusal"
    assert result.output != DEFAULT_CONTENT_FILTER_MESSAGE
    assert "content_filtered" not in [e.type for e in await store.read_events(result.session_id)]


async def test_the_cli_prints_the_safety_message_as_the_answer() -> None:
    server = ReplayServer([RecordedResponse(200, AZURE_STREAM, SSE)], repeat_last=True)
    base = await server.start()
    env = {**os.environ, "FSM_AGENT_BASE_URL": base}
    env.pop("FSM_AGENT_PROVIDER", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fsm_agent.cli", "run", "How do I pick a lock?", "--model", "m", "--api-key", "k",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = (b.decode() for b in await proc.communicate())
    await server.close()
    assert proc.returncode == 7, err  # FAILED_TERMINAL
    assert out == STREAMED + "\n" + DEFAULT_CONTENT_FILTER_MESSAGE + "\n"
    assert "stop: FAILED_TERMINAL" in err and "content filter blocked the answer" in err


@pytest.mark.parametrize("case", ["azure-stream-cut-after-text", "azure-400-content-filter"])
async def test_a_content_filtered_run_replays(case: str) -> None:
    kind, response, _ = CASES[case]
    server = ReplayServer([response], repeat_last=True)
    base = await server.start()

    def build(live: bool) -> Agent:
        provider = create_provider(kind, ProviderConfig(base_url=base if live else "http://127.0.0.1:9", api_key="k",
                                                        model="m", retry=RetryPolicy(max_attempts=1)))
        return Agent(provider, store=MemoryStore())

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        try:
            return [await outcome_of(agent.run("How do I pick a lock?", session_id="s-filter", port=port))]
        finally:
            await agent.provider.aclose()

    try:
        rt = await roundtrip(build, drive, "s-filter")
    finally:
        await server.close()
    assert len(server.requests) == 1
    assert rt.results[0].output == DEFAULT_CONTENT_FILTER_MESSAGE
    assert [e["type"] for e in rt.recording.events].count("content_filtered") == 1


async def test_the_server_stream_carries_the_safety_message_and_the_content_filtered_event(tmp_path: Any) -> None:
    import time

    from aiohttp.test_utils import TestClient, TestServer

    from fsm_agent import ScriptedProvider
    from fsm_agent.server import create_app
    from fsm_agent.store import SQLiteStore
    from fsm_agent.types import MessageResponse, ModelStopReason, TextBlock, Usage

    blocked = MessageResponse("r1", "gpt-4o", AssistantMessage((TextBlock(STREAMED),)), ModelStopReason.CONTENT_FILTERED,
                              "content_filter", Usage(20, 9), "azure", extra={"content_filter_results": FILTERED})
    store = SQLiteStore(tmp_path / "s.db")
    client = TestClient(TestServer(create_app(lambda s: Agent(ScriptedProvider([blocked]), store=s), store),
                                   host="127.0.0.1"))
    await client.start_server()
    try:
        r = await client.post("/sessions", json={"task": "How do I pick a lock?", "session_id": "s1"})
        assert r.status == 201
        deadline = time.monotonic() + 10
        while (snap := await (await client.get("/sessions/s1")).json())["state"] != "FAILED_TERMINAL":
            assert time.monotonic() < deadline, snap
            await asyncio.sleep(0.02)
        assert snap["stop"]["error"]["kind"] == "content_filtered"
        r = await client.get("/sessions/s1/events", params={"after": "0"})
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        body = await asyncio.wait_for(r.read(), 5)  # the stream closes after the terminal event
    finally:
        await client.close()
        await store.close()
    frames = [dict(line.split(": ", 1) for line in raw.split("\n") if ": " in line and not line.startswith(":"))
              for raw in body.decode().split("\n\n") if raw.strip()]
    by_type = {f.get("event"): json.loads(f["data"]) for f in frames if "data" in f and "event" in f}
    payload = by_type["content_filtered"]["payload"]
    assert payload["details"] == {"content_filter_results": FILTERED} and payload["provider"] == "azure"
    assert payload["answer"] == DEFAULT_CONTENT_FILTER_MESSAGE
    said = [json.loads(f["data"])["payload"]["message"] for f in frames if f.get("event") == "message"]
    assert [m["role"] for m in said] == ["user", "assistant"]
    assert DEFAULT_CONTENT_FILTER_MESSAGE in json.dumps(said[-1]) and STREAMED not in json.dumps(said)
    assert frames[-1]["event"] == "run_stopped"
