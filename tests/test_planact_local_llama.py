"""PlanAct end to end on the real local llama.cpp model (SmolLM2-135M, schema-constrained decoding).

One session: the planner (a real model call, the numbered plan form enforced by llama.cpp's
grammar) writes three or four nodes; the model works on them; the second node fails its first
check and the replanner (a real call) rewrites what is left; the iteration budget pauses the run
mid-plan; a new Agent on the same SQLite file, with a new provider object, resumes it at the node
it was on, with no planner call, and finishes the plan.

What is deterministic and what is the model's: the one failed check is a programmatic check that
rejects the first attempt of the second node checked, so the replan happens on every run; every
other node is judged by the model grader (a real call; at temperature 0 SmolLM2 has passed each
node so far, but a rejection would only add a replan, which ``max_replans=4`` absorbs). The
assertions are about the runtime (plan shape, replan record, pause, resume point, call counts,
accounting), not about the quality of a 135M model's plan.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fsm_agent import Agent, NodeStatus, Plan, PlanNode, Provider, RunConfig, SQLiteStore, StopReason
from fsm_agent.types import MessageRequest, MessageResponse, ReplanTrigger, StreamEvent, structure
from fsm_agent_middleware.planact import PlanAct
from fsm_agent_middleware.verifier import Verdict

pytestmark = pytest.mark.llama

TASK = ("Write a short note about cats: list two facts about cats, write a title for the note, "
        "then write one closing sentence.")
ROLE = {"plan": "planner", "replan": "replanner", "verdict": "grader"}


class Counting(Provider):
    """The local provider, recording each request under its PlanAct role (by output schema name)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.model = inner.model
        self.profile = inner.profile  # PlanAct picks the numbered form for the llamacpp profile
        self.calls: Counter[str] = Counter()
        self.requests: list[tuple[str, MessageRequest]] = []

    @property
    def capabilities(self) -> Any:
        return self.inner.capabilities

    def _count(self, request: MessageRequest) -> None:
        role = ROLE.get(request.output_schema.name if request.output_schema is not None else "", "executor")
        self.calls[role] += 1
        self.requests.append((role, request))

    async def chat(self, request: MessageRequest) -> MessageResponse:
        self._count(request)
        response: MessageResponse = await self.inner.chat(request)
        return response

    def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
        self._count(request)
        stream: AsyncIterator[StreamEvent] = self.inner.chat_stream(request)
        return stream

    def executor_steps(self) -> list[str | None]:
        found = []
        for role, r in self.requests:
            if role == "executor":
                m = re.search(r"Current step (\S+):", r.messages[0].text if r.messages else "")
                found.append(m.group(1) if m else None)
        return found


class RejectSecondNodeOnce:
    """Rejects the first attempt of the second node checked; leaves every other verdict to the grader."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.rejected: str | None = None

    def __call__(self, ctx: Any, node: PlanNode) -> Verdict | None:
        if node.id not in self.order:
            self.order.append(node.id)
        if self.rejected is None and len(self.order) == 2 and node.id == self.order[1]:
            self.rejected = node.id
            return Verdict(False, "the answer does not show this step's result", ("check:reject-once",))
        return None


async def plans(store: Any, sid: str) -> list[Plan]:
    return [structure(e.payload["plan"], Plan) for e in await store.read_events(sid, types=("plan_updated",))]


def make_provider(base_url: str) -> Counting:
    from fsm_agent import create_provider
    from fsm_agent.providers import ProviderConfig

    return Counting(create_provider("llamacpp", ProviderConfig(base_url=base_url, first_token_timeout=300.0)))


@pytest.mark.timeout(600)
async def test_plan_replan_pause_and_resume_on_the_local_model(llama_server, tmp_path) -> None:
    path = tmp_path / "sessions.db"
    check = RejectSecondNodeOnce()
    config = RunConfig(max_output_tokens=120, temperature=0.0)

    # -- the first process: plan, node 1, node 2 fails and is replanned, the budget pauses the run
    first = make_provider(llama_server.base_url)
    store = SQLiteStore(path)
    try:
        agent = Agent(first, store=store, config=config,
                      middleware=[PlanAct(check=check, min_nodes=3, max_nodes=4, max_replans=4)])
        paused = await agent.run(TASK, max_iterations=2)
        sid = paused.session_id
        history = await plans(store, sid)
        calls = [(e.payload["usage"] or {}) for e in await store.read_events(sid, types=("model_call",))]
    finally:
        await store.close()
        await first.inner.aclose()
    assert paused.stop.reason is StopReason.PAUSED_BUDGET, paused.stop.detail
    assert paused.stop.budget == "iterations"
    planned = history[0]
    assert 3 <= len(planned.nodes) <= 4 and planned.version == 1
    assert [n.id for n in planned.nodes] == [f"s{i}" for i in range(1, len(planned.nodes) + 1)]
    assert all(n.goal.strip() and n.acceptance.strip() for n in planned.nodes)
    assert first.calls["planner"] == 1 and first.calls["replanner"] >= 1 and first.calls["executor"] == 2
    assert check.rejected is not None and check.rejected == check.order[1]
    at_pause = history[-1]
    replan = at_pause.history[0]
    assert replan.trigger is ReplanTrigger.FAILED and replan.node == check.rejected
    assert "does not show this step's result" in replan.reason and at_pause.version >= 2
    assert at_pause.node(check.order[0]).status is NodeStatus.PASSED
    assert at_pause.node(check.order[0]).result  # the passed node kept its answer's summary
    current = at_pause.current
    assert current is not None, "the pause must fall mid-plan: a node is running"
    # planner, replanner and grader calls are accounted to the run, on top of the executor's
    executor_tokens = sum(u.get("input_tokens", 0) + u.get("output_tokens", 0) for u in calls)
    assert paused.usage.total_tokens > executor_tokens

    # -- a second process: a new Agent and provider on the same file resume at the same node
    second = make_provider(llama_server.base_url)
    store = SQLiteStore(path)
    try:
        agent = Agent(second, store=store, config=config,
                      middleware=[PlanAct(check=check, min_nodes=3, max_nodes=4, max_replans=4)])
        result = await agent.resume(sid, max_iterations=12)
        final = (await plans(store, sid))[-1]
    finally:
        await store.close()
        await second.inner.aclose()
    assert second.calls["planner"] == 0, "the plan must come back from the checkpoint, not from a new planner call"
    assert second.executor_steps()[0] == current.id
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert final.done and final.version == at_pause.version + sum(
        r.version > at_pause.version for r in final.history)
    assert final.node(check.order[0]) == at_pause.node(check.order[0])
    assert any(r.startswith(f"plan:v{final.version}:") for r in result.stop.evidence_refs)
