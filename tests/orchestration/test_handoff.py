"""Handoff with a recovery package: the package is checked through the tool-error path, the
successor takes over in its own linked session seeded with the package only, the chain's stop,
usage and cost come back to its first session, and interrupts, cancels and resumes reach the agent
working now without anything done twice (ScriptedProvider; links on every store)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fsm_agent import Agent, Decision, Middleware, ScriptedProvider, StopReason, tool
from fsm_agent.control import Cancel, Interrupt
from fsm_agent.errors import ConfigurationError, ProviderError
from fsm_agent.middleware import AskApproval
from fsm_agent.orchestration.handoff import Handoffs, RecoveryPackage
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore
from fsm_agent.store.sessions import load_session

PKG = {"goal": "Refund invoice 17", "verified_facts": ["invoice 17 was charged twice"],
       "open_actions": ["refund the second charge"], "summary": "The customer was billed twice."}


def handoff(target: str, package: dict[str, Any] | None = None) -> Any:
    return tool_call_response((f"handoff_to_{target}", package if package is not None else PKG))


def tool_results(messages: Any) -> list[str]:
    return [m.text for m in messages if m.role == "tool"]


async def test_the_successor_takes_over_with_the_package_only(store) -> None:
    triage_p = ScriptedProvider([tool_call_response(("lookup", {"n": 17})), handoff("billing")])
    billing_p = ScriptedProvider(["Refunded the second charge of invoice 17."])

    @tool
    def lookup(n: int) -> str:
        """Look up an invoice."""
        return f"invoice {n}: two charges of 40 EUR"

    triage = Agent(triage_p, tools=[lookup], system_prompt="You triage.", store=store)
    billing = Agent(billing_p, system_prompt="You do billing.", store=store)
    chain = Handoffs({"triage": triage, "billing": billing})
    result = await chain.run("My invoice 17 is wrong", start="triage", session_id="t")

    assert result.stop.reason is StopReason.COMPLETED
    assert result.stop.detail.startswith("handed off to 'billing' (session handoff_to_billing-")
    assert result.output == "Refunded the second charge of invoice 17."
    assert [(s.agent, s.stop) for s in result.chain] == [("triage", StopReason.COMPLETED),
                                                           ("billing", StopReason.COMPLETED)]
    assert result.chain[1].package == RecoveryPackage(**PKG)

    (link,) = await store.children("t")
    assert (link.kind, link.metadata["from"], link.metadata["to"], link.metadata["package"]) == (
        "handoff", "triage", "billing", PKG)
    assert link.call_id == result.result.messages[4].tool_calls[0].id
    # the boundary: billing saw its own system prompt and the package, none of triage's conversation
    sent = billing_p.requests[0].messages
    assert [m.role for m in sent] == ["system", "user"] and sent[0].text == "You do billing."
    assert "Goal: Refund invoice 17" in sent[1].text and "- invoice 17 was charged twice" in sent[1].text
    assert "two charges of 40 EUR" not in sent[1].text and "My invoice 17 is wrong" not in sent[1].text
    # triage's run ended with the handoff: its model was not called again
    assert len(triage_p.requests) == 2
    # usage: triage 2 calls + billing 1, rolled up into the first session
    assert result.usage.input_tokens == 30
    billing_session = await load_session(store, link.child_id)
    assert billing_session.record.state == "COMPLETED"


@pytest.mark.parametrize(("bad", "kind", "says"), [
    ({k: v for k, v in PKG.items() if k != "open_actions"}, "invalid_arguments", "'open_actions' is a required"),
    ({**PKG, "goal": "   "}, "invalid_handoff", "goal is blank"),
    ({**PKG, "verified_facts": ["ok", " "]}, "invalid_handoff", "verified_facts[1] is blank"),
    ({**PKG, "extra": 1}, "invalid_arguments", "Additional properties are not allowed"),
])
async def test_a_bad_package_is_an_error_the_model_can_fix(bad: dict[str, Any], kind: str, says: str) -> None:
    store = MemoryStore()
    triage_p = ScriptedProvider([handoff("billing", bad), handoff("billing")])
    billing_p = ScriptedProvider(["done"])
    chain = Handoffs({"triage": Agent(triage_p, store=store), "billing": Agent(billing_p, store=store)})
    result = await chain.run("help", start="triage", session_id="t")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "done"
    first, _second = [m for m in result.result.messages if m.role == "tool"]
    assert first.is_error and first.metadata["error"] == kind and says in first.text
    assert len(await store.children("t")) == 1  # nothing was handed over with the bad package
    assert len(billing_p.requests) == 1


async def test_one_handoff_per_turn_and_a_bounded_chain() -> None:
    store = MemoryStore()
    a_p = ScriptedProvider([tool_call_response(("handoff_to_b", PKG), ("handoff_to_c", PKG))])
    b_p = ScriptedProvider([handoff("c"), "b finished it itself"])
    c_p = ScriptedProvider(["never"])
    chain = Handoffs({"a": Agent(a_p, store=store), "b": Agent(b_p, store=store), "c": Agent(c_p, store=store)},
                     max_handoffs=1)
    result = await chain.run("go", start="a", session_id="a1")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "b finished it itself"
    denied = [m for m in result.result.messages if m.role == "tool"][1]
    assert denied.is_error and "only one handoff per turn: handoff_to_b was called first" in denied.text
    b_session = (await store.children("a1"))[0].child_id
    b_results = [m for m in (await load_session(store, b_session)).transcript if m.role == "tool"]
    assert b_results[0].metadata["error"] == "handoff_limit" and "Finish the task yourself" in b_results[0].text
    assert c_p.requests == [] and [s.agent for s in result.chain] == ["a", "b"]


def test_bad_configurations_are_refused() -> None:
    a = Agent(ScriptedProvider([]))
    with pytest.raises(ConfigurationError, match="routes name 'x'"):
        Handoffs({"a": a, "b": Agent(ScriptedProvider([]), store=a.store)}, routes={"a": ["x"]})
    with pytest.raises(ConfigurationError, match="share one store"):
        Handoffs({"a": a, "b": Agent(ScriptedProvider([]))})
    with pytest.raises(ConfigurationError, match="must match"):
        Handoffs({"a b": a})
    with pytest.raises(ConfigurationError, match="unknown limit"):
        Handoffs({"a": a}, limits={"a": {"max_turns": 3}})


class AskForRefund(Middleware):
    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        return AskApproval("refunds need a person") if call.name == "refund" else None


async def test_a_successor_waiting_for_a_person_makes_the_chain_wait(store) -> None:
    refunds: list[int] = []

    @tool(effect="side_effect")
    def refund(invoice: int) -> str:
        """Refund an invoice."""
        refunds.append(invoice)
        return f"refunded {invoice}"

    billing_p = ScriptedProvider([tool_call_response(("refund", {"invoice": 17})), "refund done"])
    chain = Handoffs({"triage": Agent(ScriptedProvider([handoff("billing")]), store=store),
                      "billing": Agent(billing_p, tools=[refund], middleware=[AskForRefund()], store=store)})
    first = await chain.run("help", start="triage", session_id="t")
    assert first.stop.reason is StopReason.WAITING_HUMAN
    (pending,) = first.stop.pending_actions
    assert (pending.call.name, pending.reason) == ("handoff_to_billing", "handoff_waiting")
    assert "refunds need a person" in first.stop.detail and refunds == []
    done = await chain.resume("t", decisions={pending.call.id: Decision.approve()})
    assert done.stop.reason is StopReason.COMPLETED and done.output == "refund done" and refunds == [17]


@pytest.mark.parametrize(("script", "stop", "kind"), [
    ([ProviderError("bad request", retryable=False)], StopReason.FAILED_TERMINAL, None),
    ([tool_call_response(("noop", {}))], StopReason.FAILED_TERMINAL, "handoff_failed"),  # paused on its budget
])
async def test_a_failing_successor_ends_the_chain_with_a_typed_stop(script: list[Any], stop: StopReason,
                                                                     kind: str | None) -> None:
    store = MemoryStore()
    chain = Handoffs({"triage": Agent(ScriptedProvider([handoff("billing")]), store=store),
                      "billing": Agent(ScriptedProvider(script), tools=[tool(lambda: "x", name="noop")], store=store)},
                     limits={"billing": {"max_iterations": 1}})
    result = await chain.run("help", start="triage", session_id="t")
    assert result.stop.reason is stop
    assert "handed off to 'billing'" in result.stop.detail
    assert (result.stop.error or {}).get("kind") == kind
    assert result.chain[-1].stop is (StopReason.PAUSED_BUDGET if kind else StopReason.FAILED_TERMINAL)


async def test_interrupting_the_chain_reaches_the_successor_and_resume_continues_it(store) -> None:
    sent: list[str] = []
    entered, release = asyncio.Event(), asyncio.Event()

    @tool(effect="side_effect")
    async def send(to: str) -> str:
        """Send."""
        if to == "bob":
            entered.set()
            await release.wait()
        sent.append(to)
        return f"sent {to}"

    billing_p = ScriptedProvider([tool_call_response(("send", {"to": "ann"})), tool_call_response(("send", {"to": "bob"})),
                                  "both handled"])
    triage = Agent(ScriptedProvider([handoff("billing")]), store=store, control_poll=0.02)
    chain = Handoffs({"triage": triage, "billing": Agent(billing_p, tools=[send], store=store, control_poll=0.02)})
    run = asyncio.ensure_future(chain.run("help", start="triage", session_id="t"))
    await asyncio.wait_for(entered.wait(), 10)
    await triage.control("t", Interrupt("later"))
    stopped = await run
    assert stopped.stop.reason is StopReason.INTERRUPTED
    assert stopped.chain[-1].stop is StopReason.INTERRUPTED and sent == ["ann"]
    release.set()
    done = await chain.resume("t")
    assert done.stop.reason is StopReason.COMPLETED and done.output == "both handled"
    assert sent == ["ann"]  # the send cut in flight is "outcome unknown", never run again
    assert len(billing_p.requests) == 3 and len(await store.children("t")) == 1


async def test_cancelling_the_chain_cancels_the_successor() -> None:
    store = MemoryStore()
    entered = asyncio.Event()

    @tool
    async def think() -> str:
        """Think."""
        entered.set()
        await asyncio.sleep(30)
        return "x"

    triage = Agent(ScriptedProvider([handoff("billing")]), store=store, control_poll=0.02)
    chain = Handoffs({"triage": triage, "billing": Agent(ScriptedProvider([tool_call_response(("think", {}))]),
                                                         tools=[think], store=store, control_poll=0.02)})
    run = asyncio.ensure_future(chain.run("help", start="triage", session_id="t"))
    await asyncio.wait_for(entered.wait(), 10)
    await triage.control("t", Cancel("not needed"))
    result = await run
    assert result.stop.reason is StopReason.CANCELLED and result.chain[-1].stop is StopReason.CANCELLED
