"""RepeatGuard: the model asking again for a side effect that already happened does not do it twice.

Every test counts the tool's real executions; ``bench/control_vs_model.py`` found the fault on the
local model (a repeat is a new call with a new id, which the ledger and loop detection let through).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_agent import Agent, ConfigurationError, Decision, ScriptedProvider, SQLiteStore, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.types import AssistantMessage, ToolResultMessage, ToolUseBlock, UserMessage
from fsm_agent_middleware.repeat_guard import RepeatGuard

RUNS: list[tuple[str, int]] = []


@tool(effect="side_effect")
def refund(order: str, amount: int) -> str:
    """Refund an order.

    Args:
        order: order id.
        amount: USD.
    """
    RUNS.append((order, amount))
    return f"refunded {amount} USD on {order} (ref R{len(RUNS)})"


@tool
def lookup(order: str) -> str:
    """Look an order up (pure).

    Args:
        order: order id.
    """
    RUNS.append((f"lookup {order}", 0))
    return f"{order}: paid 40 USD"


@pytest.fixture(autouse=True)
def _clear() -> None:
    RUNS.clear()


def _script(*turns: object) -> ScriptedProvider:
    return ScriptedProvider(list(turns))


async def test_a_repeated_side_effect_gets_the_earlier_result_and_does_not_run() -> None:
    agent = Agent(_script(tool_call_response(("refund", {"order": "A1", "amount": 40})),
                          tool_call_response(("refund", {"amount": 40, "order": "A1"})),  # keys re-ordered
                          "done"), tools=[refund], middleware=[RepeatGuard()])
    result = await agent.run("refund A1")
    assert result.stop.reason.value == "COMPLETED"
    assert RUNS == [("A1", 40)]
    second = [m for m in result.messages if isinstance(m, ToolResultMessage)][1]
    assert not second.is_error and "Not run again" in second.text and "ref R1" in second.text
    assert second.metadata == {"responded_by": "repeat_guard"}


async def test_other_arguments_pure_tools_failures_and_allowed_tools_run_again() -> None:
    agent = Agent(_script(tool_call_response(("refund", {"order": "A1", "amount": 40})),
                          tool_call_response(("refund", {"order": "A1", "amount": 41})),  # other arguments
                          tool_call_response(("lookup", {"order": "A1"})),
                          tool_call_response(("lookup", {"order": "A1"})),  # pure: safe to repeat
                          "done"), tools=[refund, lookup], middleware=[RepeatGuard()])
    await agent.run("go")
    assert RUNS == [("A1", 40), ("A1", 41), ("lookup A1", 0), ("lookup A1", 0)]

    RUNS.clear()
    allowed = Agent(_script(tool_call_response(("refund", {"order": "B", "amount": 1})),
                            tool_call_response(("refund", {"order": "B", "amount": 1})), "done"),
                    tools=[refund], middleware=[RepeatGuard(allow=["refund"])])
    await allowed.run("go")
    assert RUNS == [("B", 1), ("B", 1)]


async def test_an_earlier_failure_or_unknown_outcome_is_not_a_repeat() -> None:
    call_failed = ToolUseBlock("c1", "refund", {"order": "C", "amount": 5})
    call_cut = ToolUseBlock("c2", "refund", {"order": "D", "amount": 5})
    history = [UserMessage("refund C and D"), AssistantMessage([call_failed, call_cut]),
               ToolResultMessage("c1", "Tool 'refund' failed: gateway down", is_error=True, name="refund"),
               ToolResultMessage("c2", "outcome unknown", is_error=True, name="refund",
                                 metadata={"synthetic": "interrupted"})]
    agent = Agent(_script(tool_call_response(("refund", {"order": "C", "amount": 5}),
                                             ("refund", {"order": "D", "amount": 5})), "done"),
                  tools=[refund], middleware=[RepeatGuard()])
    await agent.run(history)
    assert RUNS == [("C", 5), ("D", 5)]


async def test_ask_puts_the_repeat_to_a_person_and_deny_refuses_it() -> None:
    asked = Agent(_script(tool_call_response(("refund", {"order": "E", "amount": 9})),
                          tool_call_response(("refund", {"order": "E", "amount": 9})), "done"),
                  tools=[refund], middleware=[RepeatGuard(on_repeat="ask")])
    result = await asked.run("go", session_id="ask")
    assert result.stop.reason.value == "WAITING_HUMAN" and RUNS == [("E", 9)]
    pending = result.stop.pending_actions[0]
    assert "already ran in this session" in pending.reason or "already ran" in str(pending)
    resumed = await asked.resume("ask", decisions={pending.call.id: Decision.approve()})
    assert resumed.stop.reason.value == "COMPLETED" and RUNS == [("E", 9), ("E", 9)]  # a person said yes

    RUNS.clear()
    denied = Agent(_script(tool_call_response(("refund", {"order": "F", "amount": 9})),
                           tool_call_response(("refund", {"order": "F", "amount": 9})), "done"),
                   tools=[refund], middleware=[RepeatGuard(on_repeat="deny")])
    result = await denied.run("go")
    assert RUNS == [("F", 9)]
    second = [m for m in result.messages if isinstance(m, ToolResultMessage)][1]
    assert second.is_error and "not run again" in second.text


async def test_scope_input_lets_a_new_user_request_repeat_it() -> None:
    first = [UserMessage("refund G"), AssistantMessage([ToolUseBlock("g1", "refund", {"order": "G", "amount": 2})]),
             ToolResultMessage("g1", "refunded 2 USD on G (ref R0)", name="refund"),
             AssistantMessage("done"), UserMessage("please refund G once more")]
    for scope, expected in (("input", [("G", 2)]), ("session", [])):
        RUNS.clear()
        agent = Agent(_script(tool_call_response(("refund", {"order": "G", "amount": 2})), "done"),
                      tools=[refund], middleware=[RepeatGuard(scope=scope)])  # type: ignore[arg-type]
        await agent.run(first)
        assert RUNS == expected, scope


async def test_a_resume_in_a_new_agent_remembers_what_ran(tmp_path: Path) -> None:
    db = tmp_path / "s.db"

    def agent(store: SQLiteStore, script: ScriptedProvider) -> Agent:
        return Agent(script, tools=[refund], middleware=[RepeatGuard()], store=store)

    store = SQLiteStore(str(db))
    paused = await agent(store, _script(tool_call_response(("refund", {"order": "H", "amount": 3})))).run(
        "refund H", session_id="h", max_iterations=1)
    assert paused.stop.reason.value == "PAUSED_BUDGET" and RUNS == [("H", 3)]
    await store.close()

    store = SQLiteStore(str(db))
    resumed = await agent(store, _script(tool_call_response(("refund", {"order": "H", "amount": 3})), "done")).resume(
        "h", max_iterations=5)
    await store.close()
    assert resumed.stop.reason.value == "COMPLETED" and RUNS == [("H", 3)]


@pytest.mark.parametrize("kw", [{"on_repeat": "twice"}, {"scope": "forever"}, {"preview_chars": 0},
                                {"preview_chars": True}])
def test_bad_options_are_configuration_errors(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError, match="RepeatGuard"):
        RepeatGuard(**kw)  # type: ignore[arg-type]
