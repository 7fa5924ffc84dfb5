"""What a phase returns to the loop: the next move along the table, or a stop.

Phases never fire triggers themselves; :class:`~fsm_agent.machine.driver.Driver` applies the
outcome (one trigger per outcome) and does the bookkeeping that goes with it (checkpoint,
stop record, turn record).
"""

from __future__ import annotations

from typing import Any, Union

from attrs import field, frozen

from ..types.run import StopReason
from .phases import Trigger

__all__ = ["Move", "Outcome", "Stop"]


@frozen
class Move:
    """Fire ``trigger`` (a non-terminal move: ``call_model``, ``tool_use``, ``next_turn`` ...)."""

    trigger: Trigger
    reason: str


@frozen
class Stop:
    """End the run with ``reason``; ``payload`` holds :class:`~fsm_agent.types.RunStop` fields
    (``pending_actions``, ``required_decision``, ``budget``, ``error``, ``evidence_refs``,
    ``last_safe_point``)."""

    reason: StopReason
    detail: str
    payload: dict[str, Any] = field(factory=dict)


Outcome = Union[Move, Stop]
