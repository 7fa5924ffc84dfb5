"""Issue 19, item 9: a plain ``Agent()`` never sends what the wire refuses.

Every history shape around tool calls that a strict server refuses — calls split over several
assistant messages, a system or user message between a call and its result, results after a later
turn or out of call order, a call given twice, a call with no result — is put in the shape each
protocol accepts by the protocol module itself (``fsm_agent.types.normalize_pairing``), losing and
inventing nothing but the "no result was recorded" error result every protocol already sends for a
call never answered. A result of no call cannot be fixed without dropping what it says: it is a
typed ``InvalidHistoryError`` before anything is sent. All of it on real HTTP against
``StrictServer``, which refuses what the real Chat Completions, Anthropic Messages and Responses
APIs refuse.
"""

from __future__ import annotations

import random
from typing import Any

import aiohttp
import orjson
import pytest

from fsm_agent import Agent, RunConfig, StopReason
from fsm_agent.errors import InvalidHistoryError
from fsm_agent.providers import ProviderConfig, create_provider
from fsm_agent.testing.conversations import random_conversation
from fsm_agent.testing.strict import (
    StrictServer,
    anthropic_violation,
    responses_violation,
    text,
    wire_violation,
)
from fsm_agent.types import (
    MISSING_RESULT,
    AssistantMessage,
    Message,
    MessageRequest,
    SystemMessage,
    TextBlock,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
    normalize_pairing,
    pairing_problems,
)

KINDS = ["openai", "anthropic", "openai-responses"]
RULES = {"openai": lambda body: wire_violation(body["messages"]), "anthropic": anthropic_violation,
         "openai-responses": responses_violation}


def call(cid: str, name: str = "lookup", **args: Any) -> ToolUseBlock:
    return ToolUseBlock(cid, name, args or {"q": cid})


def asst(*blocks: Any) -> AssistantMessage:
    return AssistantMessage(tuple(TextBlock(b) if isinstance(b, str) else b for b in blocks))


def res(cid: str, value: str | None = None) -> ToolResultMessage:
    return ToolResultMessage(cid, value or f"result of {cid}")


GO = UserMessage("Look both up.")
SHAPES: dict[str, tuple[Message, ...]] = {
    "calls split over two assistant messages": (
        GO, asst("Looking.", call("c1")), asst(call("c2")), res("c1"), res("c2")),
    "a split step with a system message between its messages, results shuffled": (
        GO, asst(call("c1")), SystemMessage("Be brief."), asst(call("c2")), res("c2"), res("c1")),
    "a system message between a call and its result": (
        GO, asst(call("c1"), call("c2")), res("c1"), SystemMessage("The clock says 10:00."), res("c2")),
    "a user message between a call and its result": (
        GO, asst(call("c1")), UserMessage("Are you there?"), res("c1")),
    "a result after a later assistant turn": (
        GO, asst(call("c1")), asst("Still waiting."), res("c1")),
    "a result after a later user and assistant turn": (
        GO, asst(call("c1")), UserMessage("hello?"), asst("One moment."), res("c1"), UserMessage("so?")),
    "results in another order than the calls, past a user message": (
        GO, asst(call("c1"), call("c2"), call("c3")), UserMessage("quick"), res("c3"), res("c1"), res("c2")),
    "a call with no result before the next user message": (
        GO, asst("Let me look.", call("c1")), UserMessage("Never mind, answer from memory.")),
    "the same call again in a later turn while it is open": (
        GO, asst(call("c1")), UserMessage("and?"), asst(call("c1")), res("c1")),
    "a call at the very end with no result": (GO, asst(call("c1"))),
}
"""Histories a strict server refuses when sent as they are."""


def texts(messages: Any) -> list[str]:
    return [m.text for m in messages if m.text]


def sent_texts(kind: str, body: dict[str, Any]) -> str:
    """Every text of a request body, as one string (to check that nothing was lost)."""
    return orjson.dumps(body).decode().replace("\\n", "\n")


async def post_raw(url: str, body: dict[str, Any]) -> int:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        return resp.status


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_the_raw_shapes_are_refused_by_the_strict_chat_server(shape: str) -> None:
    """The server agrees with the real rule: each shape, sent naively (one wire message per
    message), is a 400."""
    history = SHAPES[shape]
    naive: list[dict[str, Any]] = []
    for m in history:
        if isinstance(m, AssistantMessage):
            msg: dict[str, Any] = {"role": "assistant", "content": m.text or None}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": orjson.dumps(c.input).decode()}} for c in m.tool_calls]
            naive.append(msg)
        elif isinstance(m, ToolResultMessage):
            naive.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.text})
        else:
            naive.append({"role": m.role, "content": m.text})
    server = StrictServer([text("ok")])
    base = await server.start()
    try:
        assert await post_raw(base + "/chat/completions", {"model": "m", "messages": naive}) == 400
    finally:
        await server.close()
    assert len(server.rejected) == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_every_shape_goes_out_in_the_shape_the_wire_accepts(kind: str, shape: str) -> None:
    history = SHAPES[shape]
    server = StrictServer([text("Both found.")])
    base = await server.start()
    provider = create_provider(kind, ProviderConfig(base_url=base, api_key="x", model="m"))
    try:
        answer = await provider.chat(MessageRequest("m", history))
    finally:
        await provider.aclose()
        await server.close()
    assert server.rejected == [] and server.accepted == 1
    assert answer.text == "Both found."
    body = sent_texts(kind, server.requests[0])
    for t in texts(history):  # nothing lost: every text and every result went out
        assert t in body, (t, body)
    calls = [c.id for m in history if isinstance(m, AssistantMessage) for c in m.tool_calls]
    answered = {m.tool_call_id for m in history if isinstance(m, ToolResultMessage)}
    if set(calls) - answered:  # a call never answered: the one error result every protocol sends
        assert MISSING_RESULT in body
    else:
        assert MISSING_RESULT not in body


async def test_split_calls_go_as_one_chat_message_with_their_results_after_it() -> None:
    server = StrictServer([text("ok")])
    base = await server.start()
    provider = create_provider("openai", ProviderConfig(base_url=base, api_key="x", model="m"))
    try:
        await provider.chat(MessageRequest("m", SHAPES["a split step with a system message between its messages, "
                                                        "results shuffled"]))
    finally:
        await provider.aclose()
        await server.close()
    sent = server.requests[0]["messages"]
    assert [(m["role"], [c["id"] for c in m.get("tool_calls") or ()] or m.get("tool_call_id")) for m in sent] == [
        ("user", None), ("assistant", ["c1", "c2"]), ("tool", "c1"), ("tool", "c2"), ("system", None)]


@pytest.mark.parametrize("kind", ["openai", "anthropic", "openai-responses"])
async def test_a_result_of_no_call_is_a_typed_error_before_anything_is_sent(kind: str) -> None:
    history = (GO, asst(call("c1")), res("c1"), res("ghost", "a result nobody asked for"), UserMessage("and?"))
    server = StrictServer([text("ok")])
    base = await server.start()
    provider = create_provider(kind, ProviderConfig(base_url=base, api_key="x", model="m"))
    try:
        with pytest.raises(InvalidHistoryError) as info:
            await provider.chat(MessageRequest("m", history))
    finally:
        await provider.aclose()
        await server.close()
    assert server.requests == []  # refused here, not by the server
    assert "'ghost'" in str(info.value) and "answers no earlier tool call" in str(info.value)
    assert info.value.retryable is False and info.value.provider == kind


async def test_responses_keeps_a_result_whose_call_is_on_the_server() -> None:
    server = StrictServer([text("ok")])
    base = await server.start()
    provider = create_provider("openai-responses", ProviderConfig(base_url=base, api_key="x", model="m"))
    try:
        await provider.chat(MessageRequest("m", (res("call_on_server"),), extra={"previous_response_id": "resp_1"}))
    finally:
        await provider.aclose()
        await server.close()
    assert server.rejected == []
    assert server.requests[0]["input"][0] == {"type": "function_call_output", "call_id": "call_on_server",
                                              "output": "result of call_on_server"}


@pytest.mark.parametrize("stream", [True, False])
async def test_a_plain_agent_run_on_a_broken_history_is_accepted(stream: bool) -> None:
    """No repair plugin: the task is a whole history with a split step, a system message inside a
    step and a user message between a call and its result."""
    history = [SystemMessage("You look things up."), GO, asst("Looking.", call("c1")), SystemMessage("note"),
               asst(call("c2")), UserMessage("are you there?"), res("c2"), res("c1"), UserMessage("Summarise.")]
    server = StrictServer([text("Summary.")])
    base = await server.start()
    provider = create_provider("openai", ProviderConfig(base_url=base, api_key="x", model="m"))
    try:
        result = await Agent(provider, config=RunConfig(stream=stream)).run(history)
    finally:
        await provider.aclose()
        await server.close()
    assert server.rejected == []
    assert result.stop.reason is StopReason.COMPLETED and result.output == "Summary."


async def test_a_plain_agent_run_with_a_result_of_no_call_stops_typed() -> None:
    history = [GO, res("ghost"), UserMessage("and?")]
    server = StrictServer([text("ok")])
    base = await server.start()
    provider = create_provider("openai", ProviderConfig(base_url=base, api_key="x", model="m"))
    try:
        result = await Agent(provider).run(history)
    finally:
        await provider.aclose()
        await server.close()
    assert server.requests == []
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error is not None and result.stop.error["kind"] == "invalid_history"


def _mutate(rng: random.Random, messages: list[Message]) -> list[Message]:
    """One of the refused shapes, somewhere in a valid history."""
    out = list(messages)
    steps = [i for i, m in enumerate(out) if isinstance(m, AssistantMessage) and m.tool_calls]
    if not steps:
        return out
    i = rng.choice(steps)
    what = rng.randrange(5)
    j = i + 1
    while j < len(out) and isinstance(out[j], ToolResultMessage):
        j += 1
    if what == 0:  # a system message inside the step's results
        out.insert(rng.randint(i + 1, j), SystemMessage(f"system note {i}"))
    elif what == 1:  # a user message inside the step's results
        out.insert(rng.randint(i + 1, j), UserMessage(f"user aside {i}"))
    elif what == 2 and j > i + 1:  # a result moved after the next message
        r = out.pop(rng.randint(i + 1, j - 1))
        out.insert(min(j, len(out)), r)
    elif what == 3 and j > i + 1:  # a result lost
        out.pop(rng.randint(i + 1, j - 1))
    else:  # the step's calls split over two messages
        m = out[i]
        assert isinstance(m, AssistantMessage)
        calls = m.tool_calls
        if len(calls) > 1:
            k = rng.randint(1, len(calls) - 1)
            first = tuple(b for b in m.content if not isinstance(b, ToolUseBlock)) + calls[:k]
            out[i:i + 1] = [AssistantMessage(first), AssistantMessage(calls[k:])]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_generated_histories_with_refused_shapes_always_build_an_accepted_request(kind: str) -> None:
    """300 generated histories (split steps, shuffled results, positional ids reused across steps,
    interrupted steps, a pending tail), each with up to three refused shapes put in: every request
    body passes the protocol's strict rules, and every text of the history is in it."""
    provider = create_provider(kind, ProviderConfig(base_url="http://127.0.0.1:9", api_key="x", model="m"))
    rule = RULES[kind]
    for seed in range(300):
        rng = random.Random(seed)
        conv = random_conversation(rng, split_calls=0.5, shuffle_results=0.5, reuse_ids=0.0, big_results=0.0)
        history = list(conv.messages)
        for _ in range(rng.randint(1, 3)):
            history = _mutate(rng, history)
        body = provider.build_body(provider.prepare(MessageRequest("m", tuple(history))), False)
        assert rule(body) is None, (seed, rule(body))
        dumped = sent_texts(kind, body)
        for t in texts(history):
            assert t in dumped, (seed, t)


def test_a_valid_history_comes_back_as_it_is_and_the_fixed_one_pairs() -> None:
    for seed in range(200):
        conv = random_conversation(random.Random(seed), split_calls=0.5, shuffle_results=0.0, reuse_ids=0.5)
        out, orphans = normalize_pairing(conv.messages)
        assert orphans == []
        if out is not conv.messages:  # only when a step was split or a result is missing at the tail
            assert pairing_problems(out) == [] and len(out) >= len(conv.messages)
        mutated = _mutate(random.Random(seed), list(conv.messages))
        fixed, orphans = normalize_pairing(mutated, fill=lambda c, a, n: ToolResultMessage(c.id, "filled"))
        assert orphans == [] and pairing_problems(fixed, pending=()) == []
