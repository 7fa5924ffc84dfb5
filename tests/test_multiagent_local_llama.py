"""The three multi-agent patterns end to end on the real local llama.cpp server (SmolLM2-135M): a
run across two agents each, with their own budgets, and the usage and cost of every session rolled
up into the parent.

The model is tiny: it rarely chooses a tool by itself. Where a pattern needs a tool call from it
(the handoff, the call of the sub-agent), a small middleware in this file requires one until it
succeeded (``tool_choice="required"`` leaves the constrained mode no final-answer branch), as the
team's own split does. The arguments, the answers and the merge are the model's own; what is
checked is the runtime: sessions, links, the boundary, budgets, stops, and sums.

A price is registered for the local model so that cost is computed and its roll-up can be checked
(llama.cpp bills nothing; the numbers are arbitrary but exact).
"""

from __future__ import annotations

from typing import Any

import pytest

from fsm_agent import Agent, Middleware, RunConfig, StopReason
from fsm_agent.orchestration.handoff import Handoffs, RecoveryPackage
from fsm_agent.orchestration.subagent import agent_tool
from fsm_agent.orchestration.team import Team, best_effort
from fsm_agent.pricing import PRICES, Price, register_price
from fsm_agent.store import SQLiteStore
from fsm_agent.store.sessions import descendants, load_session
from fsm_agent.types import MessageRequest, ToolResultMessage, UserMessage

pytestmark = pytest.mark.llama

PRICE = Price(0.5, 1.5)
SHORT_TASK = {"type": "object", "properties": {"task": {"type": "string", "minLength": 1, "maxLength": 120}},
              "required": ["task"], "additionalProperties": False}
"""Strings written under a grammar by a 135M model run on until their bound: a short one keeps the
calls quick (the team's split gets the same with ``max_task_chars``)."""


@pytest.fixture
async def priced(local_provider) -> Any:
    """The local provider, with a price for whatever model name its answers carry."""
    probe = await local_provider.chat(MessageRequest(messages=(UserMessage("Say hi."),), model=local_provider.model,
                                                     max_tokens=4))
    names = {local_provider.model, probe.model}
    for n in names:
        register_price(n, PRICE)
    yield local_provider
    for n in names:
        PRICES.pop(n, None)


class ToolUntilDone(Middleware):
    """Requires a call of ``tool`` until one succeeded; then offers no tools (the answer is text)."""

    def __init__(self, tool: str) -> None:
        self.tool = tool

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        from attrs import evolve

        done = any(isinstance(m, ToolResultMessage) and m.name == self.tool and not m.is_error for m in ctx.transcript)
        if done:
            request = evolve(request, tools=())
        else:
            request = evolve(request, tools=tuple(t for t in request.tools if t.name == self.tool),
                             tool_choice="required")
        return await call_next(request)


async def _spent(store: SQLiteStore, session_id: str) -> tuple[int, float]:
    """Tokens and USD of the model calls of ``session_id`` and every session below it, from their logs."""
    ids = [session_id] + [x.child_id for x in await descendants(store, session_id)]
    tokens, usd = 0, 0.0
    for sid in ids:
        for ev in await store.read_events(sid, types=("model_call",)):
            u = ev.payload.get("usage") or {}
            tokens += int(u.get("input_tokens", 0)) + int(u.get("output_tokens", 0))
            usd += float(ev.payload.get("cost_usd") or 0.0)
    return tokens, usd


def _cfg(**kw: Any) -> RunConfig:
    return RunConfig(temperature=0.0, max_wall_clock=120, **kw)


async def test_handoff_across_two_agents(priced, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    try:
        triage = Agent(priced, system_prompt="You triage customer requests. Hand every billing request to billing.",
                       middleware=[ToolUntilDone("handoff_to_billing")], store=store,
                       config=_cfg(max_iterations=3, max_output_tokens=900))
        billing = Agent(priced, system_prompt="You are the billing agent. Answer in one short sentence.", store=store,
                        config=_cfg(max_iterations=4, max_output_tokens=120))
        chain = Handoffs({"triage": triage, "billing": billing}, routes={"triage": ["billing"]},
                         limits={"billing": {"max_iterations": 2}})
        result = await chain.run("My invoice 17 was charged twice. Please refund the second charge.",
                                 start="triage")
        assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
        assert [s.agent for s in result.chain] == ["triage", "billing"]
        assert result.stop.detail.startswith("handed off to 'billing'") and result.output.strip()
        (link,) = await store.children(result.session_id)
        assert link.kind == "handoff" and link.metadata["package"]["goal"].strip()
        successor = await load_session(store, link.child_id)
        # the boundary: billing began from its system prompt and the package, not triage's conversation
        assert [m.role for m in successor.transcript[:2]] == ["system", "user"]
        package = RecoveryPackage(**link.metadata["package"])
        assert successor.transcript[1].text == package.message("triage")
        assert not any(m.role == "user" for m in successor.transcript[2:])
        assert successor.checkpoint is not None and successor.checkpoint.data["config"]["max_iterations"] == 2
        tokens, usd = await _spent(store, result.session_id)
        assert result.usage.total_tokens == tokens > 0
        assert result.cost_usd == pytest.approx(usd) and usd > 0
    finally:
        await store.close()


async def test_agent_as_tool_across_two_agents(priced, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    try:
        expert = Agent(priced, system_prompt="You are a geography expert. Answer in one short sentence.", store=store,
                       config=_cfg(max_iterations=5, max_output_tokens=100))
        ask = agent_tool(expert, name="geography_expert", description="Ask the geography expert a question.",
                         limits={"max_iterations": 1}, parameters=SHORT_TASK)
        lead = Agent(priced, tools=[ask], system_prompt="Ask the geography expert, then answer the user.",
                     middleware=[ToolUntilDone("geography_expert")], store=store,
                     config=_cfg(max_iterations=3, max_output_tokens=300))
        result = await lead.run("What is the capital of France?")
        assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
        (link,) = await store.children(result.session_id)
        assert link.kind == "agent_tool" and link.metadata == {"tool": "geography_expert"}
        child = await load_session(store, link.child_id)
        assert child.record.state == "COMPLETED" and child.checkpoint is not None
        assert child.checkpoint.data["turn"] == 1  # its own budget: one model call
        answer = next(m.text for m in reversed(child.transcript) if m.role == "assistant")
        assert [m.text for m in result.messages if m.role == "tool"] == [answer]
        rolled = await store.read_events(result.session_id, types=("usage_rolled_up",))
        assert [e.payload["child_session_id"] for e in rolled] == [link.child_id]
        tokens, usd = await _spent(store, result.session_id)
        assert result.usage.total_tokens == tokens and rolled[0].payload["usage"]["input_tokens"] > 0
        assert result.cost_usd == pytest.approx(usd) and usd > 0
    finally:
        await store.close()


async def test_leader_and_workers(priced, tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    try:
        leader = Agent(priced, store=store, config=_cfg(max_iterations=4, max_output_tokens=300))
        worker = Agent(priced, system_prompt="Answer the question in one short sentence.", store=store,
                       config=_cfg(max_iterations=3, max_output_tokens=80))
        team = Team(leader, worker, merge=best_effort(), max_workers=2, max_parallel=2,
                    worker_limits={"max_iterations": 1}, max_task_chars=120)
        result = await team.run("Name the capital of France and the capital of Italy.")
        assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
        assert 1 <= len(result.workers) <= 2 and any(w.ok for w in result.workers)
        links = await store.children(result.session_id)
        assert [x.kind for x in links] == ["worker"] * len(result.workers)
        for w in result.workers:
            assert w.task.strip() and w.usage.total_tokens > 0
            rec = await load_session(store, w.session_id)
            assert rec.checkpoint is not None and rec.checkpoint.data["turn"] == 1  # its own budget
        assert result.output.strip()
        tokens, usd = await _spent(store, result.session_id)
        assert result.usage.total_tokens == tokens
        assert result.cost_usd == pytest.approx(usd) and usd > 0
        assert result.usage.total_tokens > sum(w.usage.total_tokens for w in result.workers)
    finally:
        await store.close()
