"""The state machine: states and the transition table, the shared machine, the driver loop."""

from .context import RunConfig, RunContext
from .definition import IllegalTransition, MachineState
from .driver import STOP_TRIGGERS, Driver
from .phases import PHASES, STATES, TERMINALS, TRANSITIONS, Phase, Transition, Trigger

__all__ = [
    "Driver",
    "IllegalTransition",
    "MachineState",
    "PHASES",
    "Phase",
    "RunConfig",
    "RunContext",
    "STATES",
    "STOP_TRIGGERS",
    "TERMINALS",
    "TRANSITIONS",
    "Transition",
    "Trigger",
]
