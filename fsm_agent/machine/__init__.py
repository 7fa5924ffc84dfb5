"""The engine: the table, the machine, the run state, the phases on their host, the effect port and
the driver loop."""

from ..config import RunConfig
from ..context import CallProvider, RunContext, TurnSettings
from .definition import IllegalTransition, MachineState
from .driver import STOP_TRIGGERS, Driver
from .host import ControlCut, Host, InFlight
from .journal import Journal
from .live import LivePort
from .outcome import Move, Outcome, Stop
from .phases import PHASES, STATES, TERMINALS, TRANSITIONS, Phase, Transition, Trigger
from .port import Cancellable, EffectPort, ModelTrace
from .state import RunState
from .view import RunView

__all__ = [
    "CallProvider",
    "Cancellable",
    "ControlCut",
    "Driver",
    "EffectPort",
    "Host",
    "IllegalTransition",
    "InFlight",
    "Journal",
    "LivePort",
    "MachineState",
    "ModelTrace",
    "Move",
    "Outcome",
    "PHASES",
    "Phase",
    "RunConfig",
    "RunContext",
    "RunState",
    "RunView",
    "STATES",
    "STOP_TRIGGERS",
    "Stop",
    "TERMINALS",
    "TRANSITIONS",
    "Transition",
    "Trigger",
    "TurnSettings",
]
