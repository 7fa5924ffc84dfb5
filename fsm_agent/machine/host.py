"""The host a phase runs on: the narrow protocol the phases see of the driver.

A phase (:mod:`.pre_turn`, :mod:`.model`, :mod:`.midturn`, :mod:`.post_turn`, :mod:`.controls`)
takes the run state through its host, does its work, and returns an
:data:`~.outcome.Outcome`; it never fires a trigger and never imports the driver. What it may use:

* the run's data: ``run_state`` (the :class:`~.state.RunState`), ``view`` (the plugin's
  :class:`~.view.RunView`), ``machine`` (read it; only the driver moves it), ``inflight``;
* the run's services: ``chain`` (the middleware), ``bus`` (the observers), ``port`` (every effect),
  ``journal`` (``None``: nothing is persisted), ``ledger``, ``turns``, ``accounting``, ``prompt``
  (the agent's system prompt source);
* a few verbs: :meth:`Host.append` a message to the transcript, :meth:`Host.record` an event,
  :meth:`Host.take` control events, :meth:`Host.interruptible` (run work a control may cut) and
  :meth:`Host.flush_outbox`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from attrs import define, field

from ..errors import StopRun
from ..types.run import StopReason
from .port import ModelTrace

if TYPE_CHECKING:
    from ..chain import MiddlewareChain
    from ..errors import SuspendCall
    from ..hooks import HookBus
    from ..prompt import PromptSource
    from ..store.base import ControlKind, ControlRecord
    from ..types.messages import Message, ToolResultMessage
    from ..types.requests import MessageRequest
    from .accounting import Accounting
    from .definition import MachineState
    from .journal import Journal
    from .ledger import ToolLedger
    from .port import EffectPort
    from .state import RunState
    from .turns import TurnRecorder
    from .view import RunView

__all__ = ["ControlCut", "Host", "InFlight"]

T = TypeVar("T")


class ControlCut(StopRun):
    """Raised where an Interrupt or a Cancel (or a signal) cut a phase or a plugin's side call
    (``ctx.call_provider``). A ``StopRun``, so the middleware chain, and a plugin that lets
    ``StopRun`` through, passes it to the driver, which takes the control that caused it to decide
    the stop."""

    def __init__(self) -> None:
        super().__init__(StopReason.INTERRUPTED, "an Interrupt or a Cancel cut the call")


@define
class InFlight:
    """What is under way in the current phase, for the controls that may cut it."""

    request: MessageRequest | None = None
    """The Model phase's request in flight (``None`` once its answer is recorded)."""
    trace: ModelTrace = field(factory=ModelTrace)
    """What the Model phase's call in flight has streamed (its current attempt: a failed attempt's
    text is dropped, so that an Interrupt or the wall clock never keeps a failed answer's text)."""
    failed_partial: str = ""
    """The text a failed attempt of the Model phase's call had streamed (the stop's ``partial``)."""
    started_ids: set[str] = field(factory=set)
    """MidTurn: calls whose ``started`` state was recorded (in flight until their result arrives)."""
    settled: dict[str, ToolResultMessage] = field(factory=dict)
    """MidTurn: every result known (run, denied, answered, decided), by call id."""
    done: set[str] = field(factory=set)
    """MidTurn: calls that ran to a result."""
    suspended: dict[str, SuspendCall] = field(factory=dict)
    """MidTurn: calls whose tool raised ``SuspendCall`` (or ``WaitForHuman``): no result, by call id."""

    def new_tools(self) -> None:
        """A MidTurn starts: nothing of the tools is under way."""
        self.started_ids, self.settled, self.done, self.suspended = set(), {}, set(), {}


class Host(Protocol):
    """What a phase sees of the driver (see the module doc)."""

    run_state: RunState
    view: RunView
    chain: MiddlewareChain
    bus: HookBus
    port: EffectPort
    journal: Journal | None
    ledger: ToolLedger
    turns: TurnRecorder
    accounting: Accounting
    inflight: InFlight
    prompt: PromptSource | None
    """The agent's system prompt (read it through ``port.system_prompt``), or ``None``."""

    @property
    def machine(self) -> MachineState:
        """The run's machine (read it; only the driver fires)."""
        ...

    @property
    def session_id(self) -> str: ...

    def append(self, message: Message) -> None:
        """Append ``message`` to the transcript (and its ``message`` event to the log)."""
        ...

    def record(self, type: str, payload: dict[str, Any]) -> None:
        """Log an event of ``type`` for the current turn (nothing without a journal)."""
        ...

    async def take(self, *kinds: ControlKind, wait: float = 0.0) -> list[ControlRecord]:
        """Take the queued control events of ``kinds`` (each once), logging each; ``wait``: seconds to
        wait for the first when none is queued (through the port)."""
        ...

    async def interruptible(self, work: Awaitable[T], *, side_call: bool = False) -> T:
        """Await ``work`` so that an Interrupt or a Cancel (or a signal) can cut it. Inside the Model
        and MidTurn phases (which are cut as a whole) it is simply awaited. ``side_call``: a plugin's
        model call; once cut, nothing else starts until the controls are taken, even if the plugin
        catches the signal.

        Raises:
            ControlCut: a control cut it.
        """
        ...

    async def flush_outbox(self) -> None:
        """Deliver (and log) the observer events middleware queued with ``ctx.emit``."""
        ...
