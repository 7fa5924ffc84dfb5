"""Cases C06, C07, C08 and C11 (../shared/cases) through the real HTTP path: each stream is served
by a local aiohttp server (``ReplayServer``) and read by the provider (or by an ``Agent`` run on
it) exactly as a live one; every assertion is a field of the case's ``expected.json`` or the
server rule CASES.md states, checked on the requests the server received.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from corpus import CASES
from fsm_agent import tool
from fsm_agent.agent import Agent
from fsm_agent.control import Interrupt
from fsm_agent.providers import ProviderConfig, ProviderType, RetryPolicy, create_provider
from fsm_agent.store import SQLiteStore
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import (MessageComplete, MessageRequest, StopReason, ThinkingConfig,
                             ToolDefinition, ToolResultMessage, UserMessage)


def expected(name: str) -> dict[str, Any]:
    return json.loads((CASES / f"{name}.expected.json").read_text())


def served(*names: str, seed: int | None = 3) -> ReplayServer:
    return ReplayServer([RecordedResponse(200, (CASES / n).read_bytes(), "text/event-stream") for n in names],
                        seed=seed)


def provider(kind: ProviderType, base: str, model: str = "test-model") -> Any:
    return create_provider(kind, ProviderConfig(base_url=base + ("/v1" if kind is ProviderType.ANTHROPIC else ""),
                                                api_key="k", model=model, retry=RetryPolicy(max_attempts=1)))


# ---------------------------------------------------------------------------- server rules (CASES.md)
def anthropic_violation(body: dict[str, Any], previous_assistant: list[dict[str, Any]] | None) -> str | None:
    """The 400s the local server of C06/C07 answers: the latest assistant turn's thinking blocks changed,
    a prefill, an empty message, a call without its result right after it."""
    msgs = body["messages"]
    if msgs[-1]["role"] != "user":
        return "prefill"
    for i, m in enumerate(msgs):
        if not m["content"]:
            return f"messages.{i}: empty content"
        if m["role"] == "assistant":
            calls = [b["id"] for b in m["content"] if b["type"] == "tool_use"]
            nxt = msgs[i + 1]["content"] if i + 1 < len(msgs) else []
            results = [b["tool_use_id"] for b in nxt if b["type"] == "tool_result"]
            if calls and (results[:len(calls)] != calls or len(set(calls)) != len(calls)):
                return f"messages.{i}: tool_use without tool_result right after"
    if previous_assistant is not None:
        last = [m for m in msgs if m["role"] == "assistant"][-1]["content"]
        think = [b for b in previous_assistant if b["type"] in ("thinking", "redacted_thinking")]
        if last[:len(think)] != think:
            return "`thinking` or `redacted_thinking` blocks in the latest assistant message cannot be modified"
    return None


def responses_violation(body: dict[str, Any]) -> str | None:
    """The 400/404s the local server of C08/C11 answers."""
    items = body["input"]
    for i, it in enumerate(items):
        if it.get("type") == "function_call":
            later = [x for x in items[i + 1:] if x.get("type") == "function_call_output"
                     and x["call_id"] == it["call_id"]]
            if len(later) != 1:
                return f"No tool output found for function call {it['call_id']}."
        if it.get("type") == "reasoning" and body.get("store") is False and not it.get("encrypted_content"):
            return f"Item with id '{it['id']}' not found. Items are not persisted when `store` is set to false."
    return None


# ---------------------------------------------------------------------------- C06
@tool
def read_file(path: str) -> str:
    """Read a file."""
    return "three open items" if path == "notes.md" else "# 12 sections"


async def test_c06_signature_only_and_redacted_thinking_are_replayed_unchanged() -> None:
    exp = expected("C06")
    server = served("C06.sse", "C06.turn2.sse")
    p = provider(ProviderType.ANTHROPIC, await server.start())
    agent = Agent(p, tools=[read_file])
    try:
        th = exp["agent"]["thinking"]
        result = await agent.run("What is in notes.md?", thinking=ThinkingConfig(budget_tokens=th["budget_tokens"]))
    finally:
        await p.aclose()
        await server.close()
    assert result.stop.reason is StopReason(exp["agent"]["stop_reason"])
    assert result.output == exp["agent"]["output"]
    first, second = (r.json() for r in server.requests)
    assert first["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    want = exp["second_request"]
    assistant = [m for m in second["messages"] if m["role"] == "assistant"][-1]
    assert assistant["content"] == want["assistant_content"]
    after = second["messages"][second["messages"].index(assistant) + 1]["content"][0]
    assert {k: after[k] for k in want["next_user_content_starts_with"]} == want["next_user_content_starts_with"]
    assert anthropic_violation(second, want["assistant_content"]) is None


# ---------------------------------------------------------------------------- C07
async def test_c07_cumulative_message_delta_usage_is_never_double_counted() -> None:
    exp = expected("C07")
    for name in ("C07.sse", "C07.turn2.sse"):  # decode: one stream each
        server = served(name, seed=11)
        p = provider(ProviderType.ANTHROPIC, await server.start())
        try:
            events = [e async for e in p.chat_stream(MessageRequest(model="m", messages=(UserMessage("x"),)))]
        finally:
            await p.aclose()
            await server.close()
        u, want = events[-1].full_response.usage, exp["decode"][name]
        assert (u.input_tokens - u.cache_read_tokens - u.cache_write_tokens, u.cache_write_tokens,
                u.cache_read_tokens, u.output_tokens, u.input_tokens) == (
            want["uncached_input_tokens"], want["cache_write_tokens"], want["cache_read_tokens"],
            want["output_tokens"], want["prompt_tokens_total"])
    server = served("C07.sse", "C07.turn2.sse")
    p = provider(ProviderType.ANTHROPIC, await server.start())
    try:
        result = await Agent(p, tools=[read_file]).run("How many sections?", **exp["agent"]["config"])
    finally:
        await p.aclose()
        await server.close()
    assert result.stop.reason is StopReason(exp["agent"]["stop_reason"]) and result.output == exp["agent"]["output"]
    ru = exp["agent"]["run_usage"]
    assert (result.usage.input_tokens, result.usage.output_tokens, result.usage.cache_write_tokens,
            result.usage.cache_read_tokens) == (ru["input_tokens"], ru["output_tokens"], ru["cache_write_tokens"],
                                                ru["cache_read_tokens"])
    assert len(server.requests) == 2


# ---------------------------------------------------------------------------- C08
LOOKUP = ToolDefinition("lookup_invoice", "Look up an invoice.", {"type": "object", "properties": {
    "invoice_id": {"type": "string"}}})


async def _c08(name: str, **request: Any) -> tuple[list[dict[str, Any]], Any]:
    server = served(name, "C08.turn2.sse")
    p = provider(ProviderType.OPENAI_RESPONSES, await server.start(), model="test-reasoning-model")
    history: list[Any] = [UserMessage("What is the total of invoice INV-PH-8?")]
    try:
        first = [e async for e in p.chat_stream(MessageRequest(model="", messages=tuple(history), tools=(LOOKUP,),
                                                               extra={"store": False}, **request))]
        answer = first[-1].full_response
        history += [answer.message, ToolResultMessage(answer.tool_calls[0].id, "1,240.00 EUR")]
        second = [e async for e in p.chat_stream(MessageRequest(model="", messages=tuple(history), tools=(LOOKUP,),
                                                                extra={"store": False}, **request))]
    finally:
        await p.aclose()
        await server.close()
    assert isinstance(second[-1], MessageComplete)
    return [r.json() for r in server.requests], answer


async def test_c08_store_false_replays_encrypted_reasoning_and_asks_for_it() -> None:
    exp = expected("C08")
    bodies, _ = await _c08("C08.sse", thinking=ThinkingConfig(effort="low"))
    first, second = bodies
    assert first["store"] is False and set(exp["first_request"]["should_include"]) <= set(first["include"])
    want = exp["second_request"]["C08.sse"]
    types = [it.get("type") for it in second["input"]]
    assert types[types.index("message") + 1:] == want["input_types_after_user"]
    reasoning = second["input"][1]
    assert {k: reasoning[k] for k in want["reasoning_item"]} == want["reasoning_item"]
    assert second["store"] is want["store"]
    assert [responses_violation(b) for b in bodies] == [None, None]


async def test_c08_noenc_sends_no_bare_reasoning_item_and_keeps_the_call() -> None:
    exp = expected("C08")["second_request"]["C08.noenc.sse"]
    bodies, _ = await _c08("C08.noenc.sse", thinking=ThinkingConfig(effort="low"))
    second = bodies[1]
    assert not any(it.get("id") == exp["no_reasoning_item_with_id"] for it in second["input"])
    call = next(it for it in second["input"] if it.get("type") == "function_call")
    assert {k: call[k] for k in exp["function_call_present"]} == exp["function_call_present"]
    assert second["store"] is exp["store"]
    assert [responses_violation(b) for b in bodies] == [None, None]


async def test_c08_include_is_asked_only_of_models_that_reason() -> None:
    # no thinking config: the model family (o-series, gpt-5) or reasoning in the history decides
    for model, asked in (("o4-mini", True), ("gpt-5.1", True), ("openai/o3", True), ("gpt-5-chat-latest", False),
                         ("gpt-4.1", False), ("test-reasoning-model", False)):
        p = provider(ProviderType.OPENAI_RESPONSES, "http://127.0.0.1:9", model=model)
        body = p.build_body(MessageRequest(model=model, messages=(UserMessage("q"),), extra={"store": False}), True)
        assert ("include" in body) is asked, model
        kept = p.build_body(MessageRequest(model=model, messages=(UserMessage("q"),),
                                           extra={"store": False, "include": ["file_search_call.results"]}), True)
        assert kept["include"][0] == "file_search_call.results" and (len(kept["include"]) == 2) is asked
        stored = p.build_body(MessageRequest(model=model, messages=(UserMessage("q"),), extra={"store": True}), True)
        assert "include" not in stored
    # a history with this protocol's reasoning means the model reasons, whatever its name
    _, answer = await _c08("C08.sse")
    p = provider(ProviderType.OPENAI_RESPONSES, "http://127.0.0.1:9", model="test-reasoning-model")
    body = p.build_body(MessageRequest(model="test-reasoning-model", messages=(
        UserMessage("q"), answer.message, ToolResultMessage("call_PH_C08", "r")), extra={"store": False}), True)
    assert body["include"] == ["reasoning.encrypted_content"]


# ---------------------------------------------------------------------------- C11
STARTED: list[str] = []


@tool
async def slow_lookup(query: str) -> str:
    """A slow lookup."""
    STARTED.append(query)
    await asyncio.sleep(5.0)
    return "churn 4.1%"


async def test_c11_interrupt_while_a_tool_runs_then_resume(tmp_path: Path) -> None:
    exp = expected("C11")
    STARTED.clear()
    server = served("C11.sse", "C11.turn2.sse")
    p = provider(ProviderType.OPENAI_RESPONSES, await server.start())
    agent = Agent(p, tools=[slow_lookup], store=SQLiteStore(tmp_path / "s.db"), control_poll=0.05)
    try:
        run = asyncio.ensure_future(agent.run("Look up Q3 churn.", session_id="s-PH-C11"))
        for _ in range(200):
            if STARTED:
                break
            await asyncio.sleep(0.02)
        await agent.control("s-PH-C11", Interrupt())
        first = await run
        assert first.stop.reason is StopReason(exp["first_run"]["stop_reason"])
        assert len(STARTED) == exp["first_run"]["slow_lookup_started"]
        resumed = await agent.resume("s-PH-C11")
    finally:
        await p.aclose()
        await server.close()
    assert resumed.stop.reason is StopReason(exp["resume"]["stop_reason"]) and resumed.output == exp["resume"]["output"]
    assert len(STARTED) == exp["resume"]["slow_lookup_started_total"]
    second = server.requests[1].json()
    want = exp["second_request"]
    items = second["input"]
    call = next(i for i, it in enumerate(items) if it.get("type") == "function_call")
    assert {k: items[call][k] for k in want["function_call"]} == want["function_call"]
    outputs = [i for i, it in enumerate(items) if it.get("type") == "function_call_output"
               and it["call_id"] == want["function_call_output"]["call_id"]]
    assert len(outputs) == want["function_call_output"]["count"] and outputs[0] > call
    assert "stopped" in items[outputs[0]]["output"]  # the driver's "interrupted" result
    assert all(responses_violation(r.json()) is None for r in server.requests)
    assert all(b'"interrupted"' not in r.body for r in server.requests)
