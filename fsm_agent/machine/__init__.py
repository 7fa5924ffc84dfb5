"""The state machine: states and the transition table, the shared machine, the run state, the driver loop."""

from .config import RunConfig
from .context import CallProvider, RunContext
from .definition import IllegalTransition, MachineState
from .driver import STOP_TRIGGERS, Driver
from .journal import Journal
from .outcome import Move, Outcome, Stop
from .phases import PHASES, STATES, TERMINALS, TRANSITIONS, Phase, Transition, Trigger
from .state import RunState, TurnSettings

__all__ = [
    "CallProvider",
    "Driver",
    "IllegalTransition",
    "Journal",
    "MachineState",
    "Move",
    "Outcome",
    "PHASES",
    "Phase",
    "RunConfig",
    "RunContext",
    "RunState",
    "STATES",
    "STOP_TRIGGERS",
    "Stop",
    "TERMINALS",
    "TRANSITIONS",
    "Transition",
    "Trigger",
    "TurnSettings",
]
