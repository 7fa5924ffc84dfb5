"""The run's accounting: usage and cost of each model call, estimates for calls that reported none
or were cut, and the usage tools roll up (a sub-agent's). Cost is computed here, by the pricing
function the agent was given (:func:`fsm_agent.pricing.cost_usd`), never by a stream event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..types.events import UsageRolledUp
from ..types.messages import Usage
from ..types.requests import MessageRequest, MessageResponse
from ..types.tokens import count_message_tokens, count_tokens
from .journal import Journal
from .state import RunState

__all__ = ["Accounting"]

log = logging.getLogger("fsm_agent.driver")

CostOf = Callable[[str, Usage], "float | None"]
"""``(model, usage) -> USD or None`` (unknown price)."""


class Accounting:
    """Adds usage and cost to the run state (and logs ``cost_unknown`` when a cost budget stops being
    enforceable)."""

    __slots__ = ("run", "journal", "cost_of", "session_id")

    def __init__(self, run: RunState, journal: Journal | None, cost_of: CostOf | None, session_id: str) -> None:
        self.run = run
        self.journal = journal
        self.cost_of = cost_of
        self.session_id = session_id

    def call(self, request: MessageRequest, response: MessageResponse) -> float | None:
        """Add a finished call's usage and cost; returns the call's cost (USD, ``None`` if unknown).
        A call that reported no usage is estimated and flagged, never zero (case B12)."""
        run = self.run
        usage = response.usage
        if usage is None:
            out_text = response.text + response.thinking + "".join(
                c.name + str(c.input) for c in response.tool_calls)
            usage = Usage(count_message_tokens(request.messages), count_tokens(out_text), estimated=True)
        run.usage = run.usage + usage
        model = response.model or request.model
        cost = self.cost_of(model, usage) if self.cost_of is not None else None
        if self.cost_of is not None and run.cost_usd is not None:
            run.cost_usd = None if cost is None else run.cost_usd + cost
            if cost is None and run.config.max_cost_usd is not None:
                note = (f"the cost budget (${run.config.max_cost_usd:g}) cannot be enforced: model {model!r} has no "
                        "known price (fsm_agent.pricing.register_price adds one); the other budgets still apply")
                self._warn(note, {"kind": "cost_unknown", "model": model, "message": note})
        return cost

    def cut(self, request: MessageRequest, streamed: str) -> None:
        """A call cut in flight (an Interrupt, a Cancel, the wall clock): its tokens count as an estimate."""
        self.run.usage = self.run.usage + Usage(count_message_tokens(request.messages), count_tokens(streamed),
                                                estimated=True)

    def rolled_up(self, event: UsageRolledUp) -> None:
        """Usage a tool reported (a sub-agent's session): added to the run's usage and cost."""
        run = self.run
        run.usage = run.usage + event.usage
        if run.cost_usd is not None:
            run.cost_usd = None if event.cost_usd is None else run.cost_usd + event.cost_usd
            if run.cost_usd is None and run.config.max_cost_usd is not None:
                who = f"session {event.child_session_id}" if event.child_session_id else f"call {event.call_id}"
                note = (f"the cost budget (${run.config.max_cost_usd:g}) cannot be enforced from now on: the "
                        f"cost of {who} (tool {event.tool!r}) is unknown (a model without a known price; "
                        "fsm_agent.pricing.register_price adds one); the other budgets still apply")
                self._warn(note, {"kind": "cost_unknown", "tool": event.tool,
                                  "child_session_id": event.child_session_id, "message": note}, event.turn)

    def budget_left(self) -> dict[str, float]:
        """What is left of the token and cost budgets (``ToolContext.budget_left()``)."""
        run, cfg = self.run, self.run.config
        left: dict[str, float] = {}
        if cfg.max_tokens is not None:
            left["max_tokens"] = cfg.max_tokens - run.usage.total_tokens
        if cfg.max_cost_usd is not None and run.cost_usd is not None:
            left["max_cost_usd"] = cfg.max_cost_usd - run.cost_usd
        return left

    def _warn(self, note: str, payload: dict[str, object], turn: int | None = None) -> None:
        log.warning("session %s: %s", self.session_id, note)
        if self.journal is not None:
            self.journal.record("warning", payload, self.run.turn if turn is None else turn)
