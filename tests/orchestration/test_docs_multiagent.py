"""docs/multi-agent.md states what the code does: every stop reason has a row in the agent-tool
table with the error kind the tool really gives, and every error kind the patterns raise is named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsm_agent import Agent, ScriptedProvider
from fsm_agent.errors import SuspendCall, ToolError, WaitForHuman
from fsm_agent.orchestration._child import child_answer
from fsm_agent.orchestration.subagent import STOP_RESULTS
from fsm_agent.types import RunResult, RunStop, StopReason

DOC = (Path(__file__).parents[2] / "docs" / "multi-agent.md").read_text()


def _row(reason: StopReason) -> list[str]:
    table = DOC.split("**Output**, by the child's stop:", 1)[1].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith(f"| `{reason.value}` |")]
    assert len(rows) == 1, f"no row for {reason.value} in the agent-tool table"
    return [c.strip() for c in rows[0].strip("|").split("|")]


@pytest.mark.parametrize("reason", list(StopReason))
async def test_every_child_stop_has_a_row_with_the_real_error_kind(reason: StopReason) -> None:
    assert reason in STOP_RESULTS
    row = _row(reason)
    result = RunResult("child", RunStop(reason, "why"), "partial", ())
    try:  # the mapping agent_tool uses
        await child_answer(Agent(ScriptedProvider([])), result, label="sub-agent 'helper'", prefix="sub_agent")
    except ToolError as exc:
        assert row[2] == f"`{exc.kind}`"
    except WaitForHuman as wait:
        assert reason is StopReason.WAITING_HUMAN and f"`{wait.reason}`" in row[1]
    except SuspendCall:  # pragma: no cover - agent_tool leaves no stop open
        raise AssertionError(f"agent_tool does not leave the call open for {reason}") from None
    else:
        assert reason is StopReason.COMPLETED and row[2] == "—"


@pytest.mark.parametrize("kind", ["invalid_arguments", "invalid_handoff", "handoff_limit", "handoff_interrupted",
                                  "handoff_paused_budget", "handoff_failed_retryable", "handoff_session_conflict",
                                  "handoff_waiting", "merge_rule", "dispatch_failed", "verification_failed",
                                  "workers_waiting", "workers_interrupted", "workers_not_driven", "sub_agent_waiting",
                                  "sub_agent_session_conflict", "cost_unknown"])
def test_every_error_kind_and_reason_is_named(kind: str) -> None:
    assert re.search(rf"`{kind}`", DOC), kind
