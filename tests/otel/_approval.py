"""The tools and policy of the approval scenario, shared by the test and its resume worker."""

from __future__ import annotations

from typing import Any

from fsm_agent import AskApproval, Middleware, tool


@tool(effect="side_effect")
def pay(invoice: int) -> str:
    "Pays an invoice."
    return f"invoice {invoice} paid"


class NeedsApproval(Middleware):
    """Every ``pay`` call waits for a person."""

    name = "approval_policy"

    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        return AskApproval("payments need a person") if call.name == "pay" else None


def approval_agent_parts() -> tuple[list[Any], list[Any]]:
    return [pay], [NeedsApproval()]
