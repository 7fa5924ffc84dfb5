"""System prompt hot reload on Temporal (issue 23 item 6; docs/system-prompt.md): the worker's agent's
prompt, changed while a session's workflow runs, reaches its next model call; the read is a local
activity, so the workflow's history replays with the prompt it saw, whatever the prompt is now."""

from __future__ import annotations

import uuid

from temporalio.worker import Replayer

from fsm_agent import Agent, ScriptedProvider, StopReason, SystemMessage, tool
from fsm_agent.prompt import prompt_digest
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import SessionWorkflow, TemporalHost, create_worker, sandbox_runner
from fsm_agent.types import ToolUseBlock

WORKER: list[Agent] = []


@tool
def retune(to: str) -> str:
    """Change the system prompt of the agent the worker serves.

    Args:
        to: the new prompt.
    """
    WORKER[0].set_system_prompt(to)
    return "retuned"


async def test_a_prompt_changed_on_the_worker_reaches_the_next_model_call(temporal_client, task_queue,
                                                                          tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.prompt:" + uuid.uuid4().hex[:6]
    provider = ScriptedProvider([tool_call_response(ToolUseBlock("c1", "retune", {"to": "v2"})), "done"])
    worker_agent = Agent(provider, tools=[retune], system_prompt="v1", store=store)
    WORKER[:] = [worker_agent]
    client_agent = Agent(ScriptedProvider([]), tools=[retune], store=store,
                         host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    async with create_worker(temporal_client, {name: worker_agent}, task_queue=task_queue):
        result = await client_agent.run("hello", session_id="p1")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "done", result.stop.detail
    assert [[m.text for m in r.messages if isinstance(m, SystemMessage)] for r in provider.requests] == [["v1"], ["v2"]]
    changed = await store.read_events("p1", types=("system_prompt_changed",))
    assert [(e.payload["version"], e.payload["text"], e.payload["digest"], e.payload["previous_digest"])
            for e in changed] == [(2, "v2", prompt_digest("v2"), prompt_digest("v1"))]

    # The history holds the prompt reads: it replays although the worker's prompt is another one now.
    worker_agent.set_system_prompt("v3")
    history = await temporal_client.get_workflow_handle("p1").fetch_history()
    replayer = Replayer(workflows=[SessionWorkflow], workflow_runner=sandbox_runner())
    replayed = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert replayed.replay_failure is None, replayed.replay_failure
    reads = [e for e in history.events if e.HasField("marker_recorded_event_attributes")
             and e.marker_recorded_event_attributes.marker_name == "core_local_activity"]
    assert len(reads) == 2  # the session's start and the second PreTurn (the first one uses the start's read)
