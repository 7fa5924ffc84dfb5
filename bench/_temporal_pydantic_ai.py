"""pydantic-ai on Temporal for bench_temporal.py: ``Agent(OpenAIChatModel, tools=[get_weather])`` wrapped in
``TemporalAgent`` (``pydantic_ai.durable_exec.temporal``); the model request and each tool call are
activities (pydantic-ai's default for a function tool); the workflow calls ``temporal_agent.run``.

Imported only in the peers' venv (``/work/bench-venv``). The model's address is
``$BENCH_TEMPORAL_MODEL_URL`` (``http://127.0.0.1:PORT``), read at import: pydantic-ai wants its
``TemporalAgent`` built at import, beside the workflow.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

from temporalio import workflow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with workflow.unsafe.imports_passed_through():
    from _runtimes import MODEL, SYSTEM, get_weather

from pydantic_ai import Agent
from pydantic_ai.durable_exec.temporal import AgentPlugin, PydanticAIPlugin, TemporalAgent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

__all__ = ["AgentPlugin", "PydanticAIPlugin", "PydWorkflow", "agent", "temporal_agent"]

MODEL_URL = os.environ.get("BENCH_TEMPORAL_MODEL_URL", "http://127.0.0.1:9")


def agent() -> Any:
    """The plain agent (the in-process run, and what ``TemporalAgent`` wraps)."""
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=MODEL_URL + "/v1", api_key="x"))
    return Agent(model, tools=[get_weather], instructions=SYSTEM, name="weather")


temporal_agent = TemporalAgent(agent(), activity_config=workflow.ActivityConfig(
    start_to_close_timeout=timedelta(seconds=60)))


@workflow.defn(name="bench.PydWeather")
class PydWorkflow:
    @workflow.run
    async def run(self, prompt: str) -> str:
        result = await temporal_agent.run(prompt)
        return result.output
