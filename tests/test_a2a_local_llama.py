"""A2A end to end on the real local llama.cpp model (SmolLM2-135M), nothing mocked: agent B runs
on the local model behind fsm_agent's A2A server (loopback TCP); agent A, on the same local model,
calls B as a remote tool (``remote_agent_tool``) over A2A 1.0 streaming.

The model is tiny, so A's first call is required to be a tool call (constrained mode with
``tool_choice="required"``) and A gets one iteration: what is checked is the runtime across the
two agents (A's tool result is B's answer, B's task ended COMPLETED, B's usage rolled up into A's
run once, the remote task linked to A's call), not the model's judgement.
"""

from __future__ import annotations

import pytest

from a2a_peers import Live
from fsm_agent import Agent, RunConfig, StopReason
from fsm_agent.orchestration.a2a import A2AClient, TaskState, fetch_agent_card, remote_agent_tool
from fsm_agent.server import create_app
from fsm_agent.server.a2a import A2AConfig, add_a2a_routes
from fsm_agent.server.app import STORE_KEY
from fsm_agent.server.auth import Tenants
from fsm_agent.store import MemoryStore
from fsm_agent.types import ToolResultMessage

pytestmark = pytest.mark.llama


async def test_agent_a_calls_agent_b_over_a2a_on_the_local_model(local_provider) -> None:
    b = Agent(local_provider, store=MemoryStore(), system_prompt="You answer geography questions in one sentence.",
              config=RunConfig(max_output_tokens=48, temperature=0.0))
    app = create_app(b, tenants=Tenants())
    add_a2a_routes(app, A2AConfig(name="geographer", description="Answers geography questions"))
    async with Live(app) as live:
        card = await fetch_agent_card(live.base)
        store = MemoryStore()
        ask = remote_agent_tool(card, store=store, continuation=False, timeout=120)
        a = Agent(local_provider, tools=[ask], store=store,
                  config=RunConfig(tool_choice="required", max_iterations=1, max_output_tokens=80, temperature=0.0))
        result = await a.run("Ask the geographer what the capital of France is.")

        # A called B once; its tool result is B's answer (the artifact of B's completed task)
        assert result.stop.reason in (StopReason.PAUSED_BUDGET, StopReason.COMPLETED), result.stop.detail
        (res,) = [m for m in result.messages if isinstance(m, ToolResultMessage)]
        assert not res.is_error, res.text
        (task_rec,) = await live.app[STORE_KEY].list_sessions()
        assert task_rec.state == "COMPLETED"
        async with A2AClient(card) as client:
            task = await client.get_task(task_rec.session_id)
        assert task.state is TaskState.COMPLETED and task.text.strip()
        assert res.text == task.text
        # B's usage (reported by llama.cpp, not estimated) rolled up into A's run once
        b_usage = task.metadata["fsm_agent"]["usage"]
        assert b_usage["input_tokens"] > 0 and b_usage["output_tokens"] > 0
        rolled = [e.payload for e in await store.read_events(result.session_id, types=("usage_rolled_up",))]
        assert [r["usage"]["input_tokens"] for r in rolled] == [b_usage["input_tokens"]]
        own = sum(e.payload["usage"]["input_tokens"]
                  for e in await store.read_events(result.session_id, types=("model_call",)))
        assert result.usage.input_tokens == own + b_usage["input_tokens"]
        (link,) = await store.children(result.session_id)
        assert (link.child_id, link.kind) == (task_rec.session_id, "remote")
