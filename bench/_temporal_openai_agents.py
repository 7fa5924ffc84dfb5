"""The OpenAI Agents SDK on Temporal for bench_temporal.py: ``Runner.run`` inside a workflow with the
Temporal plugin (``temporalio.openai_agents``, the package ``temporalio-openai-agents``); each model call
is an activity. ``OAIWorkflow``: the tool is an activity too (``activity_as_tool``);
``OAIWorkflowToolInWorkflow``: the tool is a plain ``function_tool`` and runs inside the workflow.

Imported only in the peers' venv (``/work/bench-venv``). The model's address is
``$BENCH_TEMPORAL_MODEL_URL`` (``http://127.0.0.1:PORT``); tracing is off (no export to the vendor).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with workflow.unsafe.imports_passed_through():
    from _runtimes import MODEL, SYSTEM
    from _runtimes import get_weather as weather

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from temporalio.openai_agents import ModelActivityParameters, OpenAIAgentsPlugin
from temporalio.openai_agents import workflow as oai_workflow

__all__ = ["OAIWorkflow", "OAIWorkflowToolInWorkflow", "agent", "get_weather", "plugin"]

MODEL_URL = os.environ.get("BENCH_TEMPORAL_MODEL_URL", "http://127.0.0.1:9")
TIMEOUT = timedelta(seconds=60)
set_tracing_disabled(True)


@activity.defn  # the tool takes the function's name: the model calls get_weather
async def get_weather(city: str) -> str:
    """Current weather for a city.

    Args:
        city: the city name, e.g. "Paris".
    """
    return weather(city)


def agent() -> Any:
    """The plain agent (the in-process run), on Chat Completions."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=MODEL_URL + "/v1", api_key="x", max_retries=0)
    return Agent(name="weather", instructions=SYSTEM, tools=[function_tool(weather)],
                 model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client))


def plugin() -> Any:
    """The plugin, its model provider on the fake server's Chat Completions (workers and clients)."""
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=MODEL_URL + "/v1", api_key="x", max_retries=0)
    return OpenAIAgentsPlugin(model_params=ModelActivityParameters(start_to_close_timeout=TIMEOUT),
                              model_provider=OpenAIProvider(openai_client=client, use_responses=False))


@workflow.defn(name="bench.OAIWeather")
class OAIWorkflow:
    @workflow.run
    async def run(self, prompt: str) -> str:
        agent = Agent(name="weather", instructions=SYSTEM, model=MODEL, tools=[
            oai_workflow.activity_as_tool(get_weather, start_to_close_timeout=TIMEOUT)])
        result = await Runner.run(agent, prompt)
        return str(result.final_output)


@workflow.defn(name="bench.OAIWeatherInWorkflow")
class OAIWorkflowToolInWorkflow:
    @workflow.run
    async def run(self, prompt: str) -> str:
        agent = Agent(name="weather", instructions=SYSTEM, model=MODEL, tools=[function_tool(weather)])
        result = await Runner.run(agent, prompt)
        return str(result.final_output)
