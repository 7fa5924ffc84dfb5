"""The provider layer's pricing of a call: the one place a stream's cost is computed.

Stream event types carry a cost; they do not compute it (:class:`~fsm_agent.types.CostUpdate` is a
value). The protocol modules price each update here, with :func:`fsm_agent.pricing.cost_usd`, and the
engine's accounting prices each finished call with the same function.
"""

from __future__ import annotations

from ..pricing import cost_usd
from ..types.messages import Usage
from ..types.requests import MessageResponse
from ..types.stream import CostUpdate, StreamEvent, events_for_response

__all__ = ["cost_update", "events_for"]


def cost_update(usage: Usage, model: str | None) -> CostUpdate:
    """The :class:`~fsm_agent.types.CostUpdate` of a call's ``usage`` on ``model`` (USD; ``None`` without a
    model or a known price)."""
    return CostUpdate(usage, cost_usd(model, usage) if model else None)


def events_for(response: MessageResponse) -> list[StreamEvent]:
    """The stream of a complete response (a server that ignored ``stream: true``, a scripted or
    constrained answer), its :class:`~fsm_agent.types.CostUpdate` priced by :func:`cost_update`."""
    usage = response.usage
    cost = cost_update(usage, response.model).cost_usd if usage is not None else None
    return events_for_response(response, cost)
