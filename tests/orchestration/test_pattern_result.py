"""The results of the handoff chain and the team share one base, PatternResult: the top session's
handle, stop, usage and cost, and the answer (a chain's last agent's, the team's merged one)."""

from __future__ import annotations

import attrs

from fsm_agent.orchestration.handoff import HandoffResult, HandoffStep
from fsm_agent.orchestration.result import PatternResult
from fsm_agent.orchestration.team import TeamResult, WorkerOutcome
from fsm_agent.types import RunResult, RunStop, StopReason, Usage

SHARED = ["session_id", "stop", "output", "output_data", "usage", "cost_usd", "result"]


def test_both_results_are_pattern_results_with_the_shared_fields_first() -> None:
    for cls, own in ((HandoffResult, "chain"), (TeamResult, "workers")):
        assert issubclass(cls, PatternResult)
        assert [a.name for a in attrs.fields(cls)] == [*SHARED, own]


def test_from_run_takes_the_answer_from_the_last_agent_and_the_totals_from_the_top_session() -> None:
    top = RunResult("first", RunStop(StopReason.COMPLETED, "handed off"), "handing over", (), Usage(10, 5),
                    cost_usd=0.25, output_data={"from": "first"})
    last = RunResult("first-handoff", RunStop(StopReason.COMPLETED, "done"), "the refund is on its way", (),
                     Usage(3, 2), cost_usd=0.05, output_data={"from": "last"})
    steps = (HandoffStep("triage", "first", StopReason.COMPLETED), HandoffStep("billing", "first-handoff",
                                                                               StopReason.COMPLETED))
    chain = HandoffResult.from_run(top, answer=last, chain=steps)
    assert (chain.session_id, chain.stop, chain.usage, chain.cost_usd, chain.result) == \
        ("first", top.stop, Usage(10, 5), 0.25, top)
    assert (chain.output, chain.output_data, chain.chain) == ("the refund is on its way", {"from": "last"}, steps)


def test_from_run_without_an_answer_takes_the_top_sessions_own() -> None:
    top = RunResult("lead", RunStop(StopReason.PAUSED_BUDGET, "out of tokens"), "partial merge", (), Usage(7, 1),
                    cost_usd=None)
    worker = WorkerOutcome(0, "part", "lead-worker0", StopReason.COMPLETED, "", "ok")
    team = TeamResult.from_run(top, workers=(worker,))
    assert (team.session_id, team.stop.reason, team.output, team.output_data, team.cost_usd, team.workers) == \
        ("lead", StopReason.PAUSED_BUDGET, "partial merge", None, None, (worker,))
