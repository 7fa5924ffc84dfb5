"""The ``transitions`` machine built from :data:`~.phases.TRANSITIONS` (the only importer of transitions
besides the diagram renderer).

One :class:`transitions.Machine` serves every run: a run's state lives in a
small :class:`MachineState` object and triggers are fired through the shared
machine's events, so no per-run machine or per-run method binding is built.
The machine holds no behaviour: no callbacks, no conditions. Legal moves are
its job; the work of each phase runs in :mod:`.driver`, between triggers
(``transitions``' async callbacks run concurrently, so an ordered chain cannot
be a callback list: STYLE.md, pitfalls).
"""

from __future__ import annotations

import functools
import logging

from transitions import Machine, MachineError

from ..errors import FsmAgentError
from ..types.run import StopReason
from .phases import STATES, TRANSITIONS, Phase, Trigger

__all__ = ["IllegalTransition", "MachineState", "machine"]

logging.getLogger("transitions").setLevel(logging.WARNING)


class IllegalTransition(FsmAgentError):
    """A trigger fired in a state the table has no row for (a driver bug, or a bad resume)."""


class MachineState:
    """The state of one run, moved only by :meth:`fire`."""

    __slots__ = ("state",)

    def __init__(self, state: Phase | StopReason = Phase.IDLE) -> None:
        self.state: Phase | StopReason = state

    def fire(self, trigger: Trigger) -> Phase | StopReason:
        """Apply ``trigger``; return the new state.

        Raises:
            IllegalTransition: no row of the table starts at the current state with ``trigger``.
        """
        m = machine()
        event = m.events.get(trigger.value)
        try:
            if event is None:
                raise MachineError(f"unknown trigger {trigger.value}")
            event.trigger(self)
        except MachineError as exc:
            raise IllegalTransition(
                f"no transition {trigger.value!r} from {self.state.value!r}"
            ) from exc
        return self.state

    def can_fire(self, trigger: Trigger) -> bool:
        return any(t.trigger is trigger and t.source == self.state for t in TRANSITIONS)

    @property
    def is_terminal(self) -> bool:
        return isinstance(self.state, StopReason)


@functools.lru_cache(maxsize=1)
def machine() -> Machine:
    """The shared machine (built once, on first use)."""
    m = Machine(
        model=None,
        states=list(STATES),
        initial=Phase.IDLE,
        auto_transitions=False,
        ignore_invalid_triggers=False,
        send_event=False,
    )
    for state in StopReason:
        m.get_state(state).final = True
    for t in TRANSITIONS:
        m.add_transition(t.trigger.value, t.source, t.dest)
    return m
