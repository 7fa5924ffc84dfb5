"""Versioning: recorded workflow histories replay on today's engine. A change to the engine that
would alter what a session's workflow does (the commands it issues, their order) fails here before
it ships; then regenerate with tests/temporal/make_histories.py and follow docs/temporal.md
("Upgrading workers")."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from fsm_agent.temporal import SessionWorkflow, register, sandbox_runner
from fsm_agent.temporal.registry import registered

from .history_agents import AGENTS

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def test_there_are_recorded_histories() -> None:
    assert [p.stem for p in HISTORIES] == ["trip"]


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_a_recorded_history_replays_on_todays_engine(path: Path) -> None:
    for name, make in AGENTS.items():
        if name not in registered():
            register(name, make())
    replayer = Replayer(workflows=[SessionWorkflow], workflow_runner=sandbox_runner())
    result = await replayer.replay_workflow(WorkflowHistory.from_json(path.stem, path.read_text()),
                                            raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
