"""Guardrails on Temporal: a guardrail that asks a model runs its call as an activity of the session's
workflow, beside the model call, and its tripwire stops the run with the same typed stop (cutting a
model call still in flight)."""

from __future__ import annotations

import asyncio
import uuid

from fsm_agent import Agent, ScriptedProvider, StopReason
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, create_worker
from fsm_agent_middleware.guardrails import Guardrails, input_guardrail, llm_guardrail, output_guardrail


class NeverAnswers(ScriptedProvider):
    """A model call that starts and never answers (counts the calls cut while waiting)."""

    def __init__(self) -> None:
        super().__init__([])
        self.started = 0
        self.cancelled = 0

    async def _wait(self) -> None:
        self.started += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def chat(self, request):
        await self._wait()
        raise AssertionError("unreachable")

    async def chat_stream(self, request):
        await self._wait()
        yield  # pragma: no cover - never reached


def guarded(judge: ScriptedProvider, main: ScriptedProvider, store: SQLiteStore) -> Agent:
    guards = Guardrails(input_guardrail(llm_guardrail(judge, "Trip on homework."), name="homework"),
                        output_guardrail(llm_guardrail(judge, "Trip on secrets."), name="secrets"))
    return Agent(main, middleware=[guards], store=store)


def client(temporal_client, task_queue: str, name: str, store: SQLiteStore) -> Agent:
    return Agent(ScriptedProvider([]), store=store,
                 host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))


async def test_llm_guardrails_run_as_activities_and_trip_on_temporal(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.guardrails:" + uuid.uuid4().hex[:6]
    judge = ScriptedProvider(['{"tripwire": false, "reason": "fine"}', '{"tripwire": false, "reason": "fine"}',
                              '{"tripwire": true, "reason": "homework request"}'], model="cheap")
    worker_agent = guarded(judge, ScriptedProvider(["Paris.", "The answer is 12."]), store)
    async with create_worker(temporal_client, {name: worker_agent}, task_queue=task_queue):
        ok = await client(temporal_client, task_queue, name, store).run("Capital of France?", session_id="g1")
        tripped = await client(temporal_client, task_queue, name, store).run("Do my homework", session_id="g2")
    assert ok.stop.reason is StopReason.COMPLETED and ok.output == "Paris.", ok.stop.detail
    assert tripped.stop.reason is StopReason.FAILED_TERMINAL
    assert tripped.stop.error["kind"] == "guardrail_tripwire" and tripped.stop.error["guardrail"] == "homework"
    assert tripped.output == ""
    logged = [(e.payload["guardrail"], e.payload["outcome"]) for e in await store.read_events("g1")
              if e.type == "guardrail"]
    assert logged == [("homework", "passed"), ("secrets", "passed")]
    assert len(judge.requests) == 3  # each guardrail's call ran once, as an activity


async def test_an_input_tripwire_cuts_a_slow_model_call_on_temporal(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.guardrails:" + uuid.uuid4().hex[:6]
    main = NeverAnswers()  # the run can end only if the tripwire cuts this call
    judge = ScriptedProvider(['{"tripwire": true, "reason": "homework request"}'], model="cheap")
    async with create_worker(temporal_client, {name: guarded(judge, main, store)}, task_queue=task_queue):
        result = await client(temporal_client, task_queue, name, store).run("Do my homework", session_id="g3")
    assert result.stop.error["guardrail"] == "homework", result.stop.detail
    assert main.started == main.cancelled <= 1  # a call that had started was cut, not awaited
