"""Issue 19 item 2: a reasoning-only assistant turn is not an answer to prefill against.

A history that ends with (or holds) an assistant turn of reasoning alone (thinking with its
signature, a redacted block, an encrypted reasoning item, a summary; no text, no call) gets no
"Continue." from the runtime, and each protocol sends the turn as its rules allow: Chat leaves it
out (also with the DeepSeek ``reasoning_content`` echo), Responses drops a reasoning item with no
output item of its response after it (case B05), Anthropic never sends an assistant turn whose last
block is thinking (its API answers 400 "The final block in an assistant message cannot be
`thinking`"). The reasoning-only turns are decoded from each protocol's own bodies by the provider,
the runs go over real HTTP, and the Chat server is the strict one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fsm_agent import Agent, Continue, Middleware, StopReason
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.testing.strict import StrictServer, text, wire_violation
from fsm_agent.types import AssistantMessage, ThinkingBlock, UserMessage

QUESTION = "Is 221 prime?"
ANSWER = "No: 221 = 13 * 17."

# the reasoning-only answers, as each protocol's server sends them (the output limit hit while thinking)
CHAT_REASONING = {"id": "c1", "object": "chat.completion", "model": "deepseek-reasoner",
                  "choices": [{"index": 0, "finish_reason": "length", "message": {
                      "role": "assistant", "content": "", "reasoning_content": "221 = 13 * 17? 13 * 17 = 221"}}],
                  "usage": {"prompt_tokens": 9, "completion_tokens": 64}}
RESPONSES_REASONING = {"id": "resp_1", "object": "response", "model": "o4-mini", "status": "incomplete",
                       "incomplete_details": {"reason": "max_output_tokens"},
                       "output": [{"id": "rs_1", "type": "reasoning", "encrypted_content": "PH_ENC_1",
                                   "summary": [{"type": "summary_text", "text": "Checking small factors."}]}],
                       "usage": {"input_tokens": 9, "output_tokens": 64}}
ANTHROPIC_REASONING = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
                       "content": [{"type": "thinking", "thinking": "Try 13.", "signature": "PH_SIG_1"},
                                   {"type": "redacted_thinking", "data": "PH_REDACTED_1"}],
                       "stop_reason": "max_tokens", "stop_sequence": None,
                       "usage": {"input_tokens": 9, "output_tokens": 64}}

RESPONSES_OK = {"id": "resp_2", "object": "response", "model": "o4-mini", "status": "completed",
                "output": [{"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": ANSWER, "annotations": []}]}],
                "usage": {"input_tokens": 9, "output_tokens": 9}}
CHAT_OK = {"id": "c2", "object": "chat.completion", "model": "deepseek-reasoner",
           "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ANSWER}}],
           "usage": {"prompt_tokens": 9, "completion_tokens": 9}}
ANTHROPIC_OK = {"id": "msg_2", "type": "message", "role": "assistant", "model": "claude-x",
                "content": [{"type": "text", "text": ANSWER}], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 9, "output_tokens": 9}}


def _provider(kind: str, base: str) -> Any:
    return create_provider(kind, ProviderConfig(base_url=base, api_key="k", model="m",
                                                retry=RetryPolicy(max_attempts=1)))


def _responses_violation(items: list[dict[str, Any]]) -> str | None:
    """Responses' rules for reasoning items (B05): each is followed by an output item."""
    for i, it in enumerate(items):
        if it.get("type") == "reasoning":
            nxt = items[i + 1] if i + 1 < len(items) else None
            if nxt is None or not (nxt.get("type") in ("function_call", "reasoning")
                                   or (nxt.get("type") == "message" and nxt.get("role") == "assistant")):
                return f"input[{i}]: reasoning item {it.get('id')} is not followed by an output item"
    return None


def _anthropic_violation(messages: list[dict[str, Any]]) -> str | None:
    """The Messages API's rules at stake: roles alternate, the last turn is the user's, and no
    assistant turn ends in thinking."""
    for i, m in enumerate(messages):
        if i and m["role"] == messages[i - 1]["role"]:
            return f"messages[{i}]: two {m['role']} turns in a row"
        if m["role"] == "assistant" and m["content"][-1]["type"] in ("thinking", "redacted_thinking"):
            return f"messages.{i}: The final block in an assistant message cannot be `thinking`."
    if messages[-1]["role"] != "user":
        return "the last turn must be the user's"
    return None


def _violation(kind: str, body: dict[str, Any]) -> str | None:
    if kind == "deepseek":
        return wire_violation(body["messages"])  # the strict server's rules
    if kind == "openai-responses":
        return _responses_violation(body["input"])
    return _anthropic_violation(body["messages"])


async def _reasoning_only(kind: str) -> AssistantMessage:
    """The reasoning-only answer, decoded by the real provider of ``kind`` from its server's body."""
    body = {"deepseek": CHAT_REASONING, "openai-responses": RESPONSES_REASONING,
            "anthropic": ANTHROPIC_REASONING}[kind]
    p = _provider(kind, "http://127.0.0.1:9")
    try:
        message = p.decode_body(json.dumps(body).encode()).message
    finally:
        await p.aclose()
    assert message.content and all(isinstance(b, ThinkingBlock) for b in message.content)
    return message


async def _run(kind: str, history: list[Any], middleware: list[Middleware] = ()) -> tuple[Any, list[Any]]:
    """Run ``history`` on ``kind`` over HTTP; returns the result and the request bodies sent."""
    if kind == "deepseek":
        strict = StrictServer([text(ANSWER)])
        base = await strict.start()
        p = _provider(kind, base)
        try:
            result = await Agent(p, middleware=list(middleware)).run(history, stream=False)
        finally:
            await p.aclose()
            await strict.close()
        assert strict.rejected == [], strict.rejected
        return result, strict.requests
    ok = RESPONSES_OK if kind == "openai-responses" else ANTHROPIC_OK
    server = ReplayServer([RecordedResponse(200, json.dumps(ok).encode())], repeat_last=True)
    base = await server.start()
    p = _provider(kind, base)
    try:
        result = await Agent(p, middleware=list(middleware)).run(history, stream=False)
    finally:
        await p.aclose()
        await server.close()
    bodies = [r.json() for r in server.requests]
    for b in bodies:
        assert _violation(kind, b) is None, _violation(kind, b)
    return result, bodies


def _sent(kind: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    return body["input"] if kind == "openai-responses" else body["messages"]


def _user_texts(kind: str, body: dict[str, Any]) -> list[str]:
    out = []
    for m in _sent(kind, body):
        if m.get("role") != "user":
            continue
        c = m["content"]
        out.append(c if isinstance(c, str) else "".join(p.get("text", "") for p in c))
    return out


KINDS = ["deepseek", "openai-responses", "anthropic"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_history_ending_in_reasoning_gets_no_continue(kind: str) -> None:
    thought = await _reasoning_only(kind)
    result, bodies = await _run(kind, [UserMessage(QUESTION), thought])
    assert result.stop.reason is StopReason.COMPLETED and result.output == ANSWER
    assert _user_texts(kind, bodies[0]) == [QUESTION]  # nothing appended: the model is asked again
    assert "Continue" not in json.dumps(_sent(kind, bodies[0]))
    assert [m.role for m in result.messages] == ["user", "assistant", "assistant"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_reasoning_only_turn_inside_the_history_is_sent_as_the_protocol_allows(kind: str) -> None:
    thought = await _reasoning_only(kind)
    result, bodies = await _run(kind, [UserMessage(QUESTION), thought, UserMessage("Take your time.")])
    assert result.stop.reason is StopReason.COMPLETED
    assert _user_texts(kind, bodies[0])[-1].endswith("Take your time.")  # Anthropic merges the two user turns
    assert "Continue" not in json.dumps(_sent(kind, bodies[0]))


class OnceMore(Middleware):
    """A verifier that asks for one more turn, with no message, after the first answer."""

    def __init__(self) -> None:
        self.asked = False

    def post_turn(self, ctx: Any) -> Any:
        if self.asked:
            return None
        self.asked = True
        return Continue(reason="not verified yet")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_turn_continued_after_a_reasoning_only_answer_adds_nothing(kind: str) -> None:
    """The model's own reasoning-only answer (from its server) and a verifier that continues the run
    without a message: the next request is the question again, valid for the protocol."""
    first = {"deepseek": CHAT_REASONING, "openai-responses": RESPONSES_REASONING, "anthropic": ANTHROPIC_REASONING}
    ok = {"deepseek": CHAT_OK, "openai-responses": RESPONSES_OK, "anthropic": ANTHROPIC_OK}
    server = ReplayServer([RecordedResponse(200, json.dumps(first[kind]).encode()),
                           RecordedResponse(200, json.dumps(ok[kind]).encode())])
    base = await server.start()
    p = _provider(kind, base)
    try:
        result = await Agent(p, middleware=[OnceMore()]).run(QUESTION, stream=False)
    finally:
        await p.aclose()
        await server.close()
    assert result.stop.reason is StopReason.COMPLETED and result.output == ANSWER
    second = server.requests[1].json()
    assert _user_texts(kind, second) == [QUESTION]
    assert _violation(kind, second) is None, _violation(kind, second)
