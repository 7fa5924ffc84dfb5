"""LoopControl end to end: interrupt mid-stream, steer, followup and cancel-with-compensation, on the
real local llama.cpp server and on replayed provider recordings (real HTTP, recorded bytes)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import corpus
from conftest import Recorder
from fsm_agent import Agent, Middleware, RunConfig, StopReason, ToolContext, create_provider, tool
from fsm_agent.control import Cancel, Followup, Interrupt, Steer
from fsm_agent.providers import ProviderConfig
from fsm_agent.store import SQLiteStore
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import TextDelta, UserMessage


def body(path: str) -> corpus.Body:
    return next(b for b in corpus.bodies() if b.path == path)


class FirstDelta:
    """Observer: sets an event when the first text delta arrives."""

    def __init__(self) -> None:
        self.seen = asyncio.Event()
        self.deltas = 0

    def on_model_event(self, ev: Any) -> None:
        if isinstance(ev.event, TextDelta):
            self.deltas += 1
            self.seen.set()


async def interrupt_after_first_delta(agent: Agent, task: str, sid: str) -> Any:
    watcher = next(o for o in agent.hooks.observers if isinstance(o, FirstDelta))
    run = asyncio.ensure_future(agent.run(task, session_id=sid))
    await asyncio.wait_for(watcher.seen.wait(), 60)
    await agent.control(sid, Interrupt("enough"))
    return await run


COMPENSATED: list[dict] = []


@tool(effect="side_effect")
def reserve(item: str) -> str:
    """Reserve an item.

    Args:
        item: what to reserve.
    """
    return f"reserved {item}"


@reserve.on_compensate
def _release(arguments: dict, result: Any, ctx: ToolContext) -> None:
    COMPENSATED.append(arguments)


class CancelAfterTool(Middleware):
    def __init__(self, agent_ref: list[Agent]) -> None:
        self.agent_ref = agent_ref

    async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
        result = await call_next(call)
        await self.agent_ref[0].control(ctx.session_id, Cancel("the user changed their mind"))
        return result


class SteerAtFirstTool(Middleware):
    def __init__(self, agent_ref: list[Agent], text: str) -> None:
        self.agent_ref, self.text = agent_ref, text

    async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
        if not ctx.state(self):
            ctx.state(self)["done"] = True
            await self.agent_ref[0].control(ctx.session_id, Steer(self.text))
        return await call_next(call)


class FollowupDuringFirstCall(Middleware):
    def __init__(self, agent_ref: list[Agent], text: str) -> None:
        self.agent_ref, self.text = agent_ref, text

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        if ctx.turn == 1:
            await self.agent_ref[0].control(ctx.session_id, Followup(self.text))
        return await call_next(request)


# -- on the real local llama.cpp server ---------------------------------------------------------------


@pytest.mark.llama
async def test_llama_interrupt_mid_stream_then_resume(local_provider, tmp_path) -> None:
    watcher = FirstDelta()
    store = SQLiteStore(tmp_path / "s.db")
    agent = Agent(local_provider, store=store, observers=[watcher], control_poll=0.05,
                  config=RunConfig(max_output_tokens=400))
    result = await interrupt_after_first_delta(agent, "Write a long story about a lighthouse keeper.", "li")
    assert result.stop.reason is StopReason.INTERRUPTED and result.stop.resumable
    assert result.stop.detail.startswith("enough (during Model; the ")
    kept = result.messages[-1]
    assert kept.role == "assistant" and kept.provider_data == {"interrupted": True} and kept.text
    assert f"the {len(kept.text)} characters that had streamed are kept" in result.stop.detail
    assert result.usage.estimated and result.usage.output_tokens > 0
    resumed = await agent.resume("li", max_output_tokens=30)
    assert resumed.stop.reason is StopReason.COMPLETED and resumed.output


@pytest.mark.llama
async def test_llama_steer(local_provider) -> None:
    ref: list[Agent] = []
    agent = Agent(local_provider, tools=[reserve], config=RunConfig(tool_choice="required", max_iterations=2,
                                                            temperature=0.0, max_output_tokens=200),
                  middleware=[SteerAtFirstTool(ref, "reserve a bicycle instead")])
    ref.append(agent)
    rec = Recorder()
    agent.hooks = type(agent.hooks)([rec])
    result = await agent.run("Reserve a car.", session_id="ls")
    assert result.stop.reason in (StopReason.PAUSED_BUDGET, StopReason.COMPLETED)
    steer = [m for m in result.messages if isinstance(m, UserMessage) and "reserve a bicycle instead" in m.text]
    assert len(steer) == 1
    # the steer message went into the second model call's context, after the first tool result
    roles = [m.role for m in result.messages]
    assert roles.index("tool") < result.messages.index(steer[0])


@pytest.mark.llama
async def test_llama_followup(local_provider) -> None:
    ref: list[Agent] = []
    agent = Agent(local_provider, middleware=[FollowupDuringFirstCall(ref, "Now say it in French.")],
                  config=RunConfig(max_output_tokens=40))
    ref.append(agent)
    result = await agent.run("Say hello in English.", session_id="lf")
    assert result.stop.reason is StopReason.COMPLETED
    texts = [(m.role, m.text) for m in result.messages]
    assert texts[0] == ("user", "Say hello in English.")
    assert texts[2] == ("user", "Now say it in French.")
    assert [r for r, _ in texts] == ["user", "assistant", "user", "assistant"]


@pytest.mark.llama
async def test_llama_cancel_runs_compensation(local_provider) -> None:
    COMPENSATED.clear()
    ref: list[Agent] = []
    agent = Agent(local_provider, tools=[reserve], middleware=[CancelAfterTool(ref)],
                  config=RunConfig(tool_choice="required", temperature=0.0, max_output_tokens=200))
    ref.append(agent)
    result = await agent.run("Reserve a table for two.", session_id="lc")
    assert result.stop.reason is StopReason.CANCELLED
    assert result.stop.detail == "the user changed their mind"
    (call,) = [m for m in result.messages if m.role == "assistant" for m in m.tool_calls]
    assert COMPENSATED == [call.input]


# -- on replayed recordings ------------------------------------------------------------------------------
async def replay_provider(*bodies: corpus.Body, **server_kw: Any) -> tuple[ReplayServer, Any]:
    server = ReplayServer([RecordedResponse(b.status, b.data, b.content_type, chunk_delay=server_kw.pop("chunk_delay", 0))
                           for b in bodies], **server_kw)
    base = await server.start()
    return server, create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k"))


LONG_STREAM = "deepseek/openllmetry__deepseek_chat_stream.yaml.0.body"
MULTIPLY_TOOL = "openai_chat/simonw-llm__tool_use_basic_stream.yaml.0.body"
MULTIPLY_ANSWER = "openai_chat/simonw-llm__tool_use_basic_stream.yaml.1.body"


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two numbers."""
    return a * b


async def test_replay_interrupt_mid_stream(tmp_path) -> None:
    long = body(LONG_STREAM)
    server = ReplayServer([RecordedResponse(200, long.data, long.content_type, chunk_delay=0.005)], chunk_sizes=[200])
    base = await server.start()
    provider = create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k"))
    watcher = FirstDelta()
    agent = Agent(provider, store=SQLiteStore(tmp_path / "s.db"), observers=[watcher], control_poll=0.05)
    try:
        result = await interrupt_after_first_delta(agent, "write", "ri")
    finally:
        await provider.aclose()
        await server.close()
    assert result.stop.reason is StopReason.INTERRUPTED
    total = corpus.bodies  # the recording has 300+ deltas; we stopped early
    assert 0 < watcher.deltas < 300, total


async def test_replay_steer_and_followup_and_cancel(tmp_path) -> None:
    COMPENSATED.clear()
    tool_turn, answer = body(MULTIPLY_TOOL), body(MULTIPLY_ANSWER)

    # steer: lands in the second request, after the recorded tool call's result
    server, provider = await replay_provider(tool_turn, answer)
    ref: list[Agent] = []
    agent = Agent(provider, tools=[multiply], middleware=[SteerAtFirstTool(ref, "show your working")])
    ref.append(agent)
    result = await agent.run("What is 1231 * 2331?")
    second = server.requests[1].json()["messages"]
    await provider.aclose()
    await server.close()
    assert result.stop.reason is StopReason.COMPLETED
    assert [m["role"] for m in second] == ["user", "assistant", "tool", "user"]
    assert second[2]["content"] == str(1231 * 2331)
    assert "show your working" in second[3]["content"]

    # followup: queued during the first call, answered after the task completes
    server, provider = await replay_provider(tool_turn, answer, answer)
    ref = []
    agent = Agent(provider, tools=[multiply], middleware=[FollowupDuringFirstCall(ref, "And double it?")])
    ref.append(agent)
    result = await agent.run("What is 1231 * 2331?")
    third = server.requests[2].json()["messages"]
    await provider.aclose()
    await server.close()
    assert result.stop.reason is StopReason.COMPLETED and result.turns == 3
    assert third[-1] == {"role": "user", "content": "And double it?"}

    # cancel with compensation: the recorded call is made, then the run is cancelled and compensated
    @tool(effect="side_effect", name="multiply")
    def multiply_and_record(a: int, b: int) -> int:
        """Multiply two numbers."""
        return a * b

    multiply_and_record.on_compensate(lambda args, res, ctx: COMPENSATED.append(args))
    server, provider = await replay_provider(tool_turn, answer)
    ref = []
    agent = Agent(provider, tools=[multiply_and_record], middleware=[CancelAfterTool(ref)])
    ref.append(agent)
    result = await agent.run("What is 1231 * 2331?")
    await provider.aclose()
    await server.close()
    assert result.stop.reason is StopReason.CANCELLED
    assert COMPENSATED == [{"a": 1231, "b": 2331}]
    assert len(server.requests) == 1  # nothing after the cancel
