"""Loop detection on Temporal (issue 23 item 2): the engine's verdicts are read from the transcript
inside the workflow, so a loop is warned of, blocked and stopped there as in process."""

from __future__ import annotations

import uuid

from fsm_agent import Agent, LoopConfig, RunConfig, ScriptedProvider, StopReason, tool
from fsm_agent.loops import NOTICE_PREFIX
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, create_worker
from fsm_agent.types import ToolResultMessage, ToolUseBlock, UserMessage


@tool
def status(job: str) -> str:
    """A job's status.

    Args:
        job: the job.
    """
    return "running"


def script() -> list:
    return [tool_call_response(ToolUseBlock(f"c{i}", "status", {"job": "7"})) for i in range(1, 6)] + ["gave up"]


async def test_a_loop_is_warned_of_blocked_and_stopped_on_temporal(temporal_client, task_queue, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    results = {}
    for then in ("block", "stop"):
        name = "tests.loops:" + uuid.uuid4().hex[:6]
        config = RunConfig(loop_detection=LoopConfig(then=then))
        provider = ScriptedProvider(script())
        worker_agent = Agent(provider, tools=[status], store=store, config=config)
        async with create_worker(temporal_client, {name: worker_agent}, task_queue=task_queue):
            client = Agent(ScriptedProvider([]), tools=[status], store=store, config=config,
                           host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
            results[then] = await client.run("Is job 7 done?", session_id=f"loop-{then}")
        warned = [r for r in provider.requests
                  if isinstance(r.messages[-1], UserMessage) and r.messages[-1].text.startswith(NOTICE_PREFIX)]
        assert len(warned) == (3 if then == "block" else 1), then

    blocked = results["block"]
    assert blocked.stop.reason is StopReason.COMPLETED and blocked.output == "gave up", blocked.stop.detail
    assert [m.tool_call_id for m in blocked.messages if isinstance(m, ToolResultMessage) and m.is_error] == ["c4", "c5"]
    stopped = results["stop"]
    assert stopped.stop.reason is StopReason.FAILED_TERMINAL, stopped.stop.detail
    assert stopped.stop.error == {"kind": "loop_detected", "pattern": ['status {"job":"7"}'], "count": 3, "call_id": "c4"}
    logged = [(e.payload["action"], e.payload.get("call_id")) for e in await store.read_events("loop-stop")
              if e.type == "loop_detected"]
    assert logged == [("warn", None), ("stop", "c4")]
