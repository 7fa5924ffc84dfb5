"""Where a Chat Completions recording holds the follow-up request, the request our provider builds
from the same history (the user and tool messages as recorded, each assistant turn as *we* decoded
it from the recorded response) matches the recorded one on the fields the protocol defines:
role, text content, tool calls (id, name, parsed arguments), tool_call_id, and DeepSeek's
reasoning_content."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

import corpus
from fsm_agent.providers import ProviderConfig, create_provider
from fsm_agent.providers.decode import looks_like_sse
from fsm_agent.types import (
    AssistantMessage,
    MessageComplete,
    MessageRequest,
    SystemMessage,
    TextBlock,
    ThinkingBlock,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
)

RECORDINGS = [
    "deepseek/pydantic-ai__thinking_tool_calls_loop.yaml",
    "openai_chat/fantasy__gpt5_multi_tool_streaming.yaml",
    "openai_chat/pydantic-ai__complex_agent_run_stream_tool_loop.yaml",
    "openai_chat/simonw-llm__tool_use_basic_stream.yaml",
    "openai_chat/simonw-llm__tool_use_chain_of_two_calls.yaml",
    "other_openai_compatible/fantasy__groq_kimi_parallel_tools_streaming.yaml",
    "other_openai_compatible/fantasy__llamacpp_gptoss_reasoning_streaming.yaml",
    "other_openai_compatible/fantasy__openrouter_kimi_parallel_tools_streaming.yaml",
    "other_openai_compatible/fantasy__xai_grok3mini_reasoning_streaming.yaml",
    "other_openai_compatible/fantasy__zai_glm_tool_streaming.yaml",
    "other_openai_compatible/pydantic-ai__groq_tool_use_failed_400.yaml",
    "other_openai_compatible/simonw-llm__openrouter_kimi_tool_stream_variant_a.yaml",
    "other_openai_compatible/simonw-llm__openrouter_kimi_tool_stream_variant_b.yaml",
    "other_openai_compatible/simonw-llm__openrouter_tool_stream_variant_d_null_args.yaml",
]


_THINK = re.compile(r"<think>.*?</think>", re.S)


def _text(content: Any) -> str:
    """Text of a message; ``<think>`` sections are dropped (pydantic-ai folds reasoning into the content
    for Groq: a client convention, not a protocol field)."""
    if content is None:
        return ""
    if not isinstance(content, str):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return _THINK.sub("", content)


def normalize(messages: list[dict[str, Any]], *, reasoning: bool) -> list[dict[str, Any]]:
    """The protocol's fields of each message; consecutive assistant messages merged (simonw/llm sends
    an assistant turn's text and its tool calls as two messages)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        n: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content")).strip()}
        if m["role"] == "assistant":
            n["tool_calls"] = [(tc["id"], tc["function"]["name"],
                                json.loads(tc["function"].get("arguments") or "{}") or {})
                               for tc in m.get("tool_calls") or ()]
            if reasoning and m.get("reasoning_content"):
                n["reasoning_content"] = m["reasoning_content"]
            if out and out[-1]["role"] == "assistant":
                prev = out[-1]
                prev["content"] = (prev["content"] + n["content"]).strip()
                prev["tool_calls"] += n["tool_calls"]
                if "reasoning_content" in n:
                    prev["reasoning_content"] = n["reasoning_content"]
                continue
        if m["role"] == "tool":
            n["tool_call_id"] = m["tool_call_id"]
        out.append(n)
    return out


def decoded_responses(recording: str, provider: Any) -> list[Any]:
    out = []
    for ex in corpus.exchanges(recording):
        if ex.status != 200:
            out.append(None)
            continue
        if looks_like_sse(ex.body):
            final = [e for e in provider.decode_stream_bytes(ex.body) if isinstance(e, MessageComplete)]
            out.append(final[0].full_response)
        else:
            out.append(provider.decode_body(ex.body))
    return out


@pytest.mark.parametrize("recording", RECORDINGS)
def test_follow_up_request_matches_the_recording(recording: str) -> None:
    deepseek = recording.startswith("deepseek/")
    provider = create_provider("deepseek" if deepseek else "openai-compatible",
                               ProviderConfig(base_url="http://127.0.0.1:9", api_key="k", model="m"))
    exchanges = corpus.exchanges(recording)
    responses = decoded_responses(recording, provider)
    checked = matched = 0
    for k, ex in enumerate(exchanges):
        req = ex.request
        if k == 0 or not isinstance(req, dict) or "assistant" not in [m["role"] for m in req["messages"]]:
            continue
        recorded = normalize(req["messages"], reasoning=deepseek)
        neutral: list[Any] = []
        for m in recorded:
            if m["role"] == "system":
                neutral.append(SystemMessage(m["content"]))
            elif m["role"] == "user":
                neutral.append(UserMessage(m["content"]))
            elif m["role"] == "tool":
                wire = next(w for w in req["messages"] if w.get("tool_call_id") == m["tool_call_id"])
                neutral.append(ToolResultMessage(m["tool_call_id"], _text(wire.get("content"))))
            else:
                ids = [c[0] for c in m["tool_calls"]]
                match = next((r for r in responses[:k] if r is not None and [c.id for c in r.tool_calls] == ids
                              and (ids or r.text.strip() == m["content"])), None)
                if match is None:
                    # a turn the client made up (pydantic-ai's synthesized calls): rebuild it from the wire
                    blocks: list[Any] = [TextBlock(m["content"])] if m["content"] else []
                    blocks += [ToolUseBlock(i, n, a) for i, n, a in m["tool_calls"]]
                    if m.get("reasoning_content"):
                        blocks.insert(0, ThinkingBlock(m["reasoning_content"], source="openai-chat"))
                    neutral.append(AssistantMessage(tuple(blocks)))
                    continue
                matched += 1
                neutral.append(match.message)
        body = provider.build_body(MessageRequest("m", tuple(neutral)), False)
        built = normalize(body["messages"], reasoning=deepseek)
        # the protocol allows several system messages; fantasy sends one per instruction
        assert built == recorded, f"{recording} request #{k}"
        checked += 1
    assert checked >= 1 and matched >= 1  # at least one assistant turn came from our own decoding
