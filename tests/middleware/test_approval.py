"""HumanApproval: asked calls stop the run WAITING_HUMAN with exactly those calls pending (batched or
one per turn), nothing of the turn runs, and apply_decisions turns a person's decisions into outcomes
or a clear error."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import Recorder
from fsm_agent import (
    Agent,
    Allow,
    ConfigurationError,
    Deny,
    Edit,
    PendingAction,
    Respond,
    RunConfig,
    ScriptedProvider,
    StopReason,
    ToolResultMessage,
    tool,
)
from fsm_agent.control import Decision
from fsm_agent.providers import tool_call_response
from fsm_agent.tools.demo import calculator
from fsm_agent_middleware.approval import DECISIONS, DecisionError, HumanApproval, Resolution, apply_decisions
from fsm_agent_middleware.tool_policy import ToolPolicy

RAN: list[str] = []


@tool
def pay(amount: int, to: str = "shop") -> str:
    """Pay an amount."""
    RAN.append(f"pay {amount}")
    return f"paid {amount} to {to}"


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    RAN.append(f"echo {text}")
    return text


def three_calls() -> Any:
    return tool_call_response(("pay", {"amount": 5}), ("echo", {"text": "hi"}), ("pay", {"amount": 500}))


async def run(script: list[Any], *middleware: Any) -> tuple[Any, Agent, Recorder]:
    RAN.clear()
    rec = Recorder()
    agent = Agent(ScriptedProvider(script), tools=[pay, echo], middleware=middleware, observers=[rec])
    return await agent.run("go"), agent, rec


async def test_batch_mode_puts_every_asked_call_of_the_turn_in_the_stop() -> None:
    turn = three_calls()
    result, _, rec = await run([turn, "done"], HumanApproval("pay"))
    assert result.stop.reason is StopReason.WAITING_HUMAN
    assert result.stop.detail == "2 tool call(s) need approval: pay, pay"
    assert result.stop.pending_actions == (
        PendingAction(turn.tool_calls[0], "tool 'pay' needs human approval", DECISIONS),
        PendingAction(turn.tool_calls[2], "tool 'pay' needs human approval", DECISIONS),
    )
    assert result.stop.required_decision == "approve, edit, reject or respond to each pending tool call"
    assert result.stop.resumable and result.stop.last_safe_point == "MidTurn"
    assert RAN == [] and result.tool_calls == 0  # nothing of the turn ran, not even echo
    assert rec.transitions()[-1] == ("MidTurn", "wait_human", "WAITING_HUMAN")


async def test_batch_decisions_on_resume_settle_the_turn() -> None:
    turn = three_calls()
    result, agent, _ = await run([turn, "done"], HumanApproval("pay"))
    first, second = (p.call.id for p in result.stop.pending_actions)
    decisions = {first: Decision.edit({"amount": 6}), second: Decision.reject("too much")}
    assert [r.decision for r in apply_decisions(result.stop.pending_actions, decisions, agent.tools)] == [
        Edit({"amount": 6}, reason="edited by a person"), Deny("too much")]
    result = await agent.resume(result.session_id, decisions=decisions)
    assert result.stop.reason is StopReason.COMPLETED
    assert sorted(RAN) == ["echo hi", "pay 6"]


async def test_per_call_mode_asks_one_call_and_denies_the_others_of_the_turn() -> None:
    turn = three_calls()
    result, agent, _ = await run([turn, "done"], HumanApproval("pay", mode="per_call"))
    assert result.stop.detail == "1 tool call(s) need approval: pay"
    (action,) = result.stop.pending_actions
    assert action.call == turn.tool_calls[0]
    result = await agent.resume(result.session_id, decisions={action.call.id: Decision.approve()})
    assert result.stop.reason is StopReason.COMPLETED
    assert sorted(RAN) == ["echo hi", "pay 5"]
    results = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert [(m.tool_call_id, m.is_error) for m in results] == [(c.id, c.name == "pay" and c.input["amount"] == 500)
                                                              for c in turn.tool_calls]
    assert results[2].text == (
        f"Tool call denied by policy (approval): not run: tool call {turn.tool_calls[0].id} (pay) is waiting "
        "for a person's approval and only one call that needs approval is asked per turn; propose this call "
        "again after that one is decided")


async def test_predicate_chooses_the_calls() -> None:
    big = HumanApproval(when=lambda call, ctx: call.name == "pay" and call.input.get("amount", 0) > 100,
                        reason="large payment: {tool}", allowed_decisions=("approve", "reject"))
    turn = three_calls()
    result, _, _ = await run([turn, "done"], big)
    assert result.stop.pending_actions == (
        PendingAction(turn.tool_calls[2], "large payment: pay", ("approve", "reject")),)


async def test_a_call_the_policy_denies_is_never_put_to_a_person() -> None:
    policy = ToolPolicy([{"tool": "pay", "action": "deny", "reason": "no payments"}], default="allow")
    result, _, _ = await run([three_calls(), "done"], HumanApproval("*"), policy)  # listed inside-out on purpose
    assert [p.call.name for p in result.stop.pending_actions] == ["echo"]


async def test_calls_that_need_no_approval_run_normally() -> None:
    result, _, _ = await run([tool_call_response(("echo", {"text": "a"})), "done"], HumanApproval("pay"))
    assert result.stop.reason is StopReason.COMPLETED and RAN == ["echo a"]


# -- apply_decisions -----------------------------------------------------------------------------
@pytest.fixture
def pending() -> tuple[PendingAction, ...]:
    turn = tool_call_response(*(("pay", {"amount": n}) for n in (1, 2, 3, 4)))
    return tuple(PendingAction(c, "r", DECISIONS) for c in turn.tool_calls)


def test_apply_decisions_maps_every_kind_in_pending_order(pending: tuple[PendingAction, ...]) -> None:
    a, b, c, d = (p.call for p in pending)
    decisions = {
        d.id: {"kind": "respond", "message": "paid already", "is_error": False},  # the JSON form
        a.id: Decision.approve(),
        c.id: Decision.reject("not today"),
        b.id: Decision.edit({"amount": 20, "to": "bank"}),
    }
    assert apply_decisions(pending, decisions, {"pay": pay}) == [
        Resolution(a, Allow(), "approve"),
        Resolution(b.__class__(b.id, "pay", {"amount": 20, "to": "bank"}),
                   Edit({"amount": 20, "to": "bank"}, reason="edited by a person"), "edit"),
        Resolution(c, Deny("not today"), "reject"),
        Resolution(d, Respond("paid already"), "respond"),
    ]


@pytest.mark.parametrize("decisions,message", [
    ({0: Decision.approve()}, "no decision for pending tool call(s) '{1}' (pay), '{2}' (pay), '{3}' (pay); "
                              "each needs one of its allowed decisions"),
    ({"call_x": Decision.approve()}, "decision for tool call(s) 'call_x', which are not pending "
                                     "(pending: '{0}', '{1}', '{2}', '{3}')"),
    ({0: Decision.edit({"amount": "ten"})}, "edited arguments for tool call '{0}' are invalid: invalid arguments "
                                            "for tool 'pay': amount: 'ten' is not of type 'integer'"),
    ({0: Decision.edit({"amount": 1, "extra": 1})},
     "edited arguments for tool call '{0}' are invalid: invalid arguments for tool 'pay': (root): Additional "
     "properties are not allowed ('extra' was unexpected)"),
    ({0: {"kind": "edit"}}, "decision 'edit' for tool call '{0}' needs an arguments object, not None"),
    ({0: {"kind": "maybe"}}, "unknown decision kind 'maybe' for tool call '{0}' (use one of: approve, edit, "
                             "reject, respond)"),
    ({0: {"kind": "respond", "message": 42}}, "decision 'respond' for tool call '{0}' needs a string message, "
                                              "not 42"),
])
def test_apply_decisions_errors(pending: tuple[PendingAction, ...], decisions: dict[Any, Any], message: str) -> None:
    ids = [p.call.id for p in pending]
    full = {ids[k] if isinstance(k, int) else k: v for k, v in decisions.items()}
    if "no decision" not in message and "not pending" not in message:
        full.update({i: Decision.approve() for i in ids[1:]})
    with pytest.raises(DecisionError) as exc:
        apply_decisions(pending, full, {"pay": pay})
    assert str(exc.value) == message.format(*ids)


def test_apply_decisions_respects_allowed_decisions_and_known_tools() -> None:
    call = tool_call_response(("gone", {})).tool_calls[0]
    only = (PendingAction(call, "r", ("approve", "reject")),)
    with pytest.raises(DecisionError, match=r"decision 'edit' is not allowed for tool call '.*' \(gone\); "
                                            r"allowed: approve, reject$"):
        apply_decisions(only, {call.id: Decision.edit({})}, {})
    anything = (PendingAction(call, "r"),)
    with pytest.raises(DecisionError, match="cannot edit tool call '.*': no tool named 'gone' is registered$"):
        apply_decisions(anything, {call.id: Decision.edit({})}, {})


@pytest.mark.parametrize("kw,message", [
    ({}, "HumanApproval: give tools=[...] and/or when=(call, ctx) -> bool (tools='*' asks for every call)"),
    ({"tools": "x", "mode": "serial"}, "HumanApproval: mode must be 'batch' or 'per_call', not 'serial'"),
    ({"tools": "x", "allowed_decisions": ("approve", "ignore")},
     "HumanApproval: allowed_decisions must be a non-empty subset of approve, edit, reject, respond, "
     "not ('approve', 'ignore')"),
])
def test_invalid_options(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as exc:
        HumanApproval(**kw)
    assert str(exc.value) == message


def test_repr_shows_the_options() -> None:
    def risky(call: Any, ctx: Any) -> bool:
        return False

    assert repr(HumanApproval(["pay", "rm_*"], when=risky, mode="per_call")) == (
        "HumanApproval(tools=['pay', 'rm_*'], when=test_repr_shows_the_options.<locals>.risky, mode='per_call', "
        "reason='tool {tool!r} needs human approval', allowed_decisions=['approve', 'edit', 'reject', 'respond'])")


# -- the real local model ------------------------------------------------------------------------


@pytest.mark.llama
async def test_llama_calculator_call_waits_for_a_person(local_provider: Any) -> None:
    rec = Recorder()
    cfg = RunConfig(tool_choice="required", temperature=0.0, max_output_tokens=100, max_iterations=3)
    agent = Agent(local_provider, tools=[calculator], middleware=[HumanApproval("calculator")], observers=[rec],
                  config=cfg)
    result = await agent.run("Use the calculator to compute 17 * 23.")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    assert result.stop.detail == "1 tool call(s) need approval: calculator"
    assert result.turns == 1 and result.tool_calls == 0
    (action,) = result.stop.pending_actions
    assert (action.call.name, action.reason) == ("calculator", "tool 'calculator' needs human approval")
    assert action.call.provider_data == {"constrained": True}  # the model's own call, as proposed
    assert rec.transitions()[-1] == ("MidTurn", "wait_human", "WAITING_HUMAN")
    ok = apply_decisions(result.stop.pending_actions, {action.call.id: Decision.edit({"expression": "17 * 23"})},
                         agent.tools)
    assert ok[0].decision == Edit({"expression": "17 * 23"}, reason="edited by a person")
    with pytest.raises(DecisionError, match="'expression' is a required property"):
        apply_decisions(result.stop.pending_actions, {action.call.id: Decision.edit({"expr": "1"})}, agent.tools)
    # resuming with the edit runs the calculator with the person's arguments
    result = await agent.resume(result.session_id, decisions={action.call.id: Decision.edit({"expression": "17 * 23"})})
    first = next(m for m in result.messages if isinstance(m, ToolResultMessage))
    assert (first.tool_call_id, first.text, first.is_error) == (action.call.id, "391", False)
    assert result.tool_calls == 1
