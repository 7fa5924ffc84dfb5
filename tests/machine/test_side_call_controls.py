"""An Interrupt or a Cancel cuts a middleware's side call (``ctx.call_provider`` in PreTurn or
PostTurn: a planner's, a grader's) as it cuts the Model phase's own call: within a control poll,
and no further model call starts.

The side call streams 2,000 chunks, 5 ms apart (10 s); the control is queued once the first chunk
has reached the observers, with a control poll of 50 ms. What is counted: the side call's chunks
delivered after the control was queued (a cut within a poll or two lets through a few dozen; the
side call finishing would be 2,000), whether the side call completed, the model calls made after
the control, and the stop's reason and phase.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from fsm_agent import (Agent, Cancel, Interrupt, MemoryStore, Middleware, ScriptedProvider, StopReason, StopRun,
                       UserMessage)
from fsm_agent.providers import text_response
from fsm_agent.types import MessageComplete, MessageRequest, ModelStreamEvent, TextDelta

CHUNKS = 2000
SIDE_TEXT = "word " * CHUNKS  # chunk_chars=5: one chunk per word


class SideCaller(Middleware):
    """Makes one slow side call in ``phase`` (PreTurn of the first turn, or PostTurn of each turn).
    ``swallow``: catch whatever the call raises and go on (a careless plugin)."""

    name = "side_caller"

    def __init__(self, phase: str, swallow: bool = False) -> None:
        self.phase = phase
        self.swallow = swallow
        self.outcomes: list[str] = []

    async def _side(self, ctx: Any) -> None:
        request = MessageRequest(model="m", messages=(UserMessage("SIDE CALL"),))
        try:
            await ctx.call_provider(request, account=True)
            self.outcomes.append("completed")
        except Exception as exc:  # noqa: BLE001 - the careless plugin under test
            self.outcomes.append(type(exc).__name__)
            if not self.swallow:
                raise

    async def pre_turn(self, ctx: Any) -> None:
        if self.phase == "PreTurn" and ctx.turn == 0:
            await self._side(ctx)

    async def post_turn(self, ctx: Any) -> None:  # type: ignore[override]
        if self.phase == "PostTurn":
            await self._side(ctx)


class Counting:
    """The model: a side call (its last message says SIDE CALL) streams SIDE_TEXT, a turn of the run
    answers at once. Counts both, and the side call's chunks the observers got after the control."""

    def __init__(self) -> None:
        self.side_calls = 0
        self.model_calls = 0
        self.model_calls_after_control = 0
        self.control_at: float | None = None
        self.side_chunks = 0
        self.side_chunks_after_control = 0
        self.side_completed = 0
        self.first_chunk = asyncio.Event()

    def __call__(self, request: MessageRequest) -> Any:
        if request.messages[-1].text == "SIDE CALL":
            self.side_calls += 1
            return text_response(SIDE_TEXT)
        self.model_calls += 1
        if self.control_at is not None:
            self.model_calls_after_control += 1
        return text_response("the answer")

    def observe(self, event: Any) -> None:
        if not isinstance(event, ModelStreamEvent) or event.phase == "Model":
            return
        if isinstance(event.event, TextDelta):
            self.side_chunks += 1
            if self.control_at is not None:
                self.side_chunks_after_control += 1
            self.first_chunk.set()
        elif isinstance(event.event, MessageComplete):
            self.side_completed += 1


async def run_with_control(phase: str, control: Any, *,
                           swallow: bool = False) -> tuple[Any, Counting, SideCaller, float]:
    model = Counting()
    side = SideCaller(phase, swallow)
    agent = Agent(ScriptedProvider([model], repeat_last=True, stream_delay=0.005, chunk_chars=5),
                  store=MemoryStore(), middleware=[side], observers=[model.observe], control_poll=0.05)
    run = asyncio.ensure_future(agent.run("go", session_id="s"))
    await asyncio.wait_for(model.first_chunk.wait(), 30)
    model.control_at = time.monotonic()
    await agent.control("s", control)
    result = await asyncio.wait_for(run, 30)
    return result, model, side, time.monotonic() - model.control_at


@pytest.mark.parametrize("phase", ["PreTurn", "PostTurn"])
async def test_an_interrupt_cuts_a_side_call_at_once_and_no_model_call_follows(phase: str) -> None:
    result, model, side, took = await run_with_control(phase, Interrupt("stop now"))
    assert result.stop.reason is StopReason.INTERRUPTED
    assert result.stop.detail == f"stop now (during {phase})"
    assert model.side_calls == 1 and model.side_completed == 0 and side.outcomes == ["ControlCut"]
    # cut within a poll or two: a few dozen of the 2,000 chunks got through after the control
    assert model.side_chunks_after_control < CHUNKS // 10, model.side_chunks_after_control
    assert model.side_chunks < CHUNKS // 5
    assert took < 2.0  # the stream alone would take 10 s
    assert model.model_calls_after_control == 0
    assert model.model_calls == (0 if phase == "PreTurn" else 1)
    # the cut call's tokens count, estimated; the resumed run goes on normally
    assert result.usage.estimated and result.usage.input_tokens > 0


async def test_a_cancel_cuts_a_side_call_and_cancels_the_run() -> None:
    result, model, side, _ = await run_with_control("PreTurn", Cancel("no more"))
    assert result.stop.reason is StopReason.CANCELLED and result.stop.detail == "no more"
    assert model.side_completed == 0 and model.side_chunks_after_control < CHUNKS // 10
    assert model.model_calls == 0


async def test_a_plugin_that_swallows_the_cut_still_starts_no_model_call() -> None:
    """The middleware catches the signal and returns: the pending control still stops the run before
    the Model phase's call starts."""
    result, model, side, _ = await run_with_control("PreTurn", Interrupt("stop now"), swallow=True)
    assert side.outcomes == ["ControlCut"]
    assert result.stop.reason is StopReason.INTERRUPTED
    assert model.model_calls == 0 and model.side_completed == 0


async def test_the_cut_side_call_is_logged_and_the_run_resumes() -> None:
    model = Counting()
    store = MemoryStore()
    side = SideCaller("PreTurn")
    agent = Agent(ScriptedProvider([model], repeat_last=True, stream_delay=0.005, chunk_chars=5), store=store,
                  middleware=[side], observers=[model.observe], control_poll=0.05)
    run = asyncio.ensure_future(agent.run("go", session_id="r"))
    await asyncio.wait_for(model.first_chunk.wait(), 30)
    await agent.control("r", Interrupt("pause"))
    stopped = await run
    assert stopped.stop.reason is StopReason.INTERRUPTED
    cut = [e.payload for e in await store.read_events("r", types=("model_call_interrupted",))]
    assert len(cut) == 1 and cut[0]["side_call"] is True and cut[0]["phase"] == "PreTurn"
    assert 0 < cut[0]["streamed_chars"] < len(SIDE_TEXT)
    model.control_at = None
    side.phase = "off"
    resumed = await agent.resume("r")
    assert resumed.stop.reason is StopReason.COMPLETED and model.model_calls == 1


@pytest.mark.parametrize("store", [MemoryStore, None], ids=["memory store", "no store"])
async def test_an_in_process_interrupt_cuts_a_side_call_too(store: Any) -> None:
    """``Agent.interrupt_all`` (a signal handler's way) cuts the side call at once, with or without
    a store (without one there is no control watcher: the signal alone must do it)."""
    model = Counting()
    agent = Agent(ScriptedProvider([model], repeat_last=True, stream_delay=0.005, chunk_chars=5),
                  store=store() if store is not None else None, middleware=[SideCaller("PreTurn")],
                  observers=[model.observe], control_poll=0.05)
    run = asyncio.ensure_future(agent.run("go"))
    await asyncio.wait_for(model.first_chunk.wait(), 30)
    model.control_at = time.monotonic()
    assert agent.interrupt_all("the user pressed ctrl-c") == 1
    result = await asyncio.wait_for(run, 30)
    assert result.stop.reason is StopReason.INTERRUPTED
    assert result.stop.detail == "the user pressed ctrl-c (during PreTurn)"
    assert model.side_completed == 0 and model.side_chunks_after_control < 5 and model.model_calls == 0


class CarefulCaller(SideCaller):
    """Lets ``StopRun`` through and records any other failure as its own (the compaction plugin's
    summarizer does this)."""

    async def _side(self, ctx: Any) -> None:
        try:
            await ctx.call_provider(MessageRequest(model="m", messages=(UserMessage("SIDE CALL"),)), account=True)
        except StopRun:
            self.outcomes.append("let through")
            raise
        except Exception as exc:  # noqa: BLE001
            self.outcomes.append(f"own failure: {type(exc).__name__}")


async def test_a_plugin_that_lets_stoprun_through_passes_the_cut_on_unchanged() -> None:
    model = Counting()
    side = CarefulCaller("PreTurn")
    agent = Agent(ScriptedProvider([model], repeat_last=True, stream_delay=0.005, chunk_chars=5),
                  store=MemoryStore(), middleware=[side], observers=[model.observe], control_poll=0.05)
    run = asyncio.ensure_future(agent.run("go", session_id="c"))
    await asyncio.wait_for(model.first_chunk.wait(), 30)
    await agent.control("c", Interrupt("stop"))
    result = await asyncio.wait_for(run, 30)
    assert side.outcomes == ["let through"]
    assert result.stop.reason is StopReason.INTERRUPTED and result.stop.detail == "stop (during PreTurn)"
