"""The ``transitions`` machine built from :data:`~.phases.TRANSITIONS` (the only importer of transitions
besides the diagram renderer).

One :class:`transitions.Machine` serves every run: a run's state lives in a
small :class:`MachineState` object, so no per-run machine or per-run method
binding is built. The machine holds no behaviour: no callbacks, no conditions.
Legal moves are its job: its rows are read once into :func:`moves`, and a
trigger is fired by one lookup there (``Machine`` would look up the same row
through its event objects, at about 20 µs a trigger). The work of each phase
runs in :mod:`.driver`, between triggers (``transitions``' async callbacks run
concurrently, so an ordered chain cannot be a callback list: STYLE.md, pitfalls).
"""

from __future__ import annotations

import functools
import logging

from transitions import Machine, MachineError

from ..errors import FsmAgentError
from ..types.run import StopReason
from .phases import STATES, TRANSITIONS, Phase, State, Trigger

__all__ = ["IllegalTransition", "MachineState", "machine", "moves"]

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
        dest = (_MOVES or moves()).get((self.state, trigger))
        if dest is None:
            raise IllegalTransition(f"no transition {trigger.value!r} from {self.state.value!r}")
        self.state = dest
        return dest

    def can_fire(self, trigger: Trigger) -> bool:
        return (self.state, trigger) in (_MOVES or moves())

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


_MOVES: dict[tuple[State, Trigger], State] = {}


def moves() -> dict[tuple[State, Trigger], State]:
    """Every legal move of the shared machine, ``(state, trigger) -> next state``, read once from its
    events. The machine has no callbacks and no conditions, so its ``trigger`` would only look up the
    same row, at about 20 µs a call; :meth:`MachineState.fire` looks it up here instead."""
    if not _MOVES:
        m = machine()
        for name, event in m.events.items():
            trigger = Trigger(name)
            for source, rows in event.transitions.items():
                (row,) = rows  # one row per (source, trigger): the table has no conditions
                if row.conditions or row.prepare or row.before or row.after:  # pragma: no cover - table rule
                    raise MachineError(f"transition {name!r} from {source!r} has callbacks or conditions")
                _MOVES[(_state(m, source), trigger)] = _state(m, row.dest)
    return _MOVES


def _state(m: Machine, name: str | None) -> State:
    """The :data:`State` the machine registered under ``name`` (``transitions`` types it ``str | Enum``)."""
    value = m.get_state(name).value if name is not None else None
    if not isinstance(value, (Phase, StopReason)):  # pragma: no cover - table rule
        raise MachineError(f"state {name!r} is not a Phase or a StopReason")
    return value
