"""A tool's reports reach the run: progress to observers and the log, a sub-run's usage to the budgets.

``ToolContext.report_progress`` and ``ToolContext.add_usage`` are what the MCP adapter (progress
notifications) and the multi-agent patterns (a child session's usage and cost) build on.
"""

from __future__ import annotations

import asyncio

from fsm_agent import Agent, ScriptedProvider, ToolContext, ToolProgress, Usage, UsageRolledUp, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore


class Seen:
    def __init__(self) -> None:
        self.progress: list[ToolProgress] = []
        self.usage: list[UsageRolledUp] = []

    def on_tool_progress(self, event: ToolProgress) -> None:
        self.progress.append(event)

    def on_usage_rolled_up(self, event: UsageRolledUp) -> None:
        self.usage.append(event)


@tool
def crunch(n: int, ctx: ToolContext) -> str:
    """A blocking tool (runs in a worker thread) that reports its progress and a sub-run's usage.

    Args:
        n: steps.
    """
    for i in range(1, n + 1):
        ctx.report_progress(i, n, f"step {i}")
    ctx.add_usage(Usage(1000, 500), 0.25, child_session_id="child-1")
    return "done"


async def _run(**limits: object) -> tuple[object, Seen, MemoryStore]:
    seen = Seen()
    store = MemoryStore()
    agent = Agent(ScriptedProvider([tool_call_response(("crunch", {"n": 3})), "ok", "never"]), tools=[crunch],
                  observers=[seen], store=store)
    result = await agent.run("go", session_id="s1", **limits)
    await asyncio.sleep(0)  # observer deliveries scheduled from the worker thread
    return result, seen, store


async def test_progress_and_usage_reach_observers_the_log_and_the_run() -> None:
    result, seen, store = await _run()
    assert result.stop.reason.value == "COMPLETED"
    assert [(p.progress, p.total, p.message) for p in seen.progress] == [(1, 3, "step 1"), (2, 3, "step 2"),
                                                                          (3, 3, "step 3")]
    assert {p.tool for p in seen.progress} == {"crunch"}
    assert len(seen.usage) == 1 and seen.usage[0].child_session_id == "child-1"
    # the run's usage is the scripted calls' plus the rolled-up 1,500 tokens
    assert result.usage.input_tokens >= 1000 and result.usage.output_tokens >= 500
    kinds = [e.type for e in await store.read_events("s1")]
    assert kinds.count("tool_progress") == 3 and kinds.count("usage_rolled_up") == 1


async def test_rolled_up_usage_counts_against_the_token_budget() -> None:
    # the scripted calls alone stay far below 1,000 tokens; the sub-run's 1,500 exhaust the budget
    result, _, _ = await _run(max_tokens=1000)
    assert result.stop.reason.value == "PAUSED_BUDGET"
    assert "token" in (result.stop.detail or "")
