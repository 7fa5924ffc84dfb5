"""The effect port: the one interface through which a run touches the world.

The engine (the driver and its phases) is a deterministic function of what its effects return.
Everything a run does outside its own memory goes through one :class:`EffectPort`:

* **time and chance**: the wall clock (:meth:`~EffectPort.now`), the monotonic clock
  (:meth:`~EffectPort.monotonic`), timers (:meth:`~EffectPort.call_later`, on which every sleep and
  every deadline of the engine is built), random numbers (:meth:`~EffectPort.random`) and new ids
  (:meth:`~EffectPort.new_id`);
* **model calls** (:meth:`~EffectPort.call_model`), the Model phase's and every side call a plugin
  makes through ``ctx.call_provider`` (a summarizer, a planner, a grader);
* **tools** (:meth:`~EffectPort.run_tool`) and their recovery hooks (:meth:`~EffectPort.tool_hook`:
  ``on_reconcile``, ``on_compensate``); a sub-agent runs inside its tool's call;
* **the session's store** (:attr:`~EffectPort.store`): the event log, checkpoints and the ledger
  (one :meth:`~fsm_agent.store.Store.write` per commit), session records, control events;
* **controls**: watching for an Interrupt or a Cancel while a phase runs, and the lease that keeps
  one worker on a session (:meth:`~EffectPort.watch`), and waiting for a decision
  (:meth:`~EffectPort.wait_controls`);
* **a plugin's own I/O** (:meth:`~EffectPort.plugin_effect`): a call a middleware makes to its own
  service, such as the ``memory`` plugin's episode store, through ``ctx.plugin_effect``;
* **the agent's system prompt** (:meth:`~EffectPort.system_prompt`): its current text and version,
  which code may set and a prompt file may change while the run goes on.

:class:`~fsm_agent.machine.live.LivePort` is today's behaviour: asyncio, the store, the providers'
HTTP. A recording port and a replaying port (:mod:`fsm_agent.testing.effects`) stand in front of
it: given the same effect results, a run makes the same requests and writes the same event log,
byte for byte. A durable-execution host (Temporal) implements the same protocol with its own
deterministic clock, timers and activities.

Observers are not effects: they watch a run and are never replayed (nothing they do reaches the
run). Streamed model events reach the middleware's ``on_model_event`` filters and the observers
through ``on_event``, run by the call's own task; a replaying port hands the recorded events to
``on_event`` at the same points of the run.

Effects that report while they run (a tool's progress and usage, a provider's retry) hand their
reports to a callback the engine gives; the port decides when they arrive, so a replay delivers
them at the same points.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from attrs import define, field

if TYPE_CHECKING:
    from ..control import Decision
    from ..errors import ProviderError
    from ..prompt import PromptSnapshot, PromptSource
    from ..providers.base import Provider
    from ..store.base import ControlKind, ControlRecord, Store
    from ..tools.registry import Tool, ToolContext, ToolRegistry
    from ..types.content import ToolUseBlock
    from ..types.events import ToolProgress, UsageRolledUp
    from ..types.messages import ToolResultMessage
    from ..types.requests import MessageRequest, MessageResponse
    from ..types.stream import StreamEvent

__all__ = ["Cancellable", "EffectPort", "ModelTrace", "OnRetry", "ToolReport"]

OnRetry = Callable[["ProviderError", int, float], Awaitable[None]]
"""``await on_retry(error, retry_number, delay_s)``: the provider is about to retry a failed HTTP
attempt of a model call after ``delay_s`` seconds (called before the wait)."""

ToolReport = Callable[["ToolProgress | UsageRolledUp"], None]
"""``report(event)``: a running tool reported progress or usage (on the run's event loop)."""


class Cancellable(Protocol):
    """A timer or a watch that can be called off (calling off twice, or after it fired, does nothing)."""

    def cancel(self) -> None: ...


@define
class ModelTrace:
    """What a model call in flight has streamed so far, kept for the engine when the call is cut
    (an Interrupt, a Cancel, the wall clock): the cut answer's text is the user's, and its tokens
    are counted as an estimate."""

    text: list[str] = field(factory=list)
    """The text deltas received, in order."""
    shown: list[str] | None = None
    """The text deltas as the chain's ``on_model_event`` filters passed them on to the observers (a
    filter may mask text or hold it back: the ``redaction`` plugin), in order; ``None`` when no filter
    was put on this stream (the engine sets it)."""

    @property
    def streamed(self) -> str:
        """The text received so far."""
        return "".join(self.text)

    @property
    def kept(self) -> str:
        """The streamed text as the run records it (a failed call's ``stop.partial``, a cut answer kept
        in the transcript): what the filters passed on when the stream had filters, else :attr:`streamed`.
        So a filter's masking reaches the record too, and text a filter still held when the call ended
        (never shown) is not recorded."""
        return self.streamed if self.shown is None else "".join(self.shown)


class EffectPort(Protocol):
    """Everything a run does to the world (see the module doc). One port serves one run segment
    (a start or a resume, up to its stop) of one session."""

    store: Store
    """The session store: event log, checkpoints, ledger, session records and control events. Its
    errors (:class:`~fsm_agent.errors.StoreError`, :class:`~fsm_agent.errors.LeaseLost`) are the
    run's to handle."""

    # -- time and chance ---------------------------------------------------------------------
    def now(self) -> float:
        """The wall clock: seconds since the Unix epoch (event timestamps, ledger times)."""
        ...

    def monotonic(self) -> float:
        """A monotonic clock in seconds (durations, the wall-clock budget)."""
        ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        """Call ``callback()`` on the run's event loop after ``delay`` seconds (a timer: sleeps and
        deadlines are built on it); returns a handle that calls it off."""
        ...

    def random(self) -> float:
        """A random float in [0, 1) (retry jitter)."""
        ...

    def new_id(self) -> str:
        """A new unique id: 32 lowercase hex characters (checkpoint ids, renamed tool-call ids)."""
        ...

    # -- the model -----------------------------------------------------------------------------
    async def call_model(self, provider: Provider, request: MessageRequest, *, stream: bool,
                         on_event: Callable[[StreamEvent], Awaitable[None]] | None, on_retry: OnRetry | None,
                         trace: ModelTrace, deadline_s: float | None) -> MessageResponse:
        """One logical call to ``provider`` (its own HTTP retries included).

        Args:
            stream: stream the answer (when the provider can); each event goes to ``on_event`` (the
                observers' path, ``None`` for nobody) and its text into ``trace``.
            on_retry: told before the provider retries an HTTP attempt.
            trace: collects the streamed text (read it when the call is cut).
            deadline_s: seconds the call may take in all (the run's remaining wall clock), or ``None``.

        Raises:
            ProviderError: the call failed after the provider's retries (``partial`` holds what had
                been decoded).
            asyncio.CancelledError: the run cut the call.
        """
        ...

    # -- tools ---------------------------------------------------------------------------------
    async def run_tool(self, call: ToolUseBlock, tools: ToolRegistry, *, session_id: str, turn: int,
                       timeout: float | None, decision: Decision | None, report: ToolReport,
                       budget_left: Callable[[], dict[str, float]]) -> ToolResultMessage:
        """Run one tool call (validation, the tool, its timeout): see
        :func:`~fsm_agent.tools.execution.execute_tool_call`.

        Args:
            report: where the tool's progress and usage reports go.
            budget_left: what the tool reads through ``ToolContext.budget_left()``.

        Raises:
            SuspendCall: the tool left its call open (:class:`~fsm_agent.errors.WaitForHuman`: for a person).
            asyncio.CancelledError: the run cut the call.
        """
        ...

    async def tool_hook(self, tool: Tool, hook: str, args: Sequence[Any], ctx: ToolContext) -> Any:
        """Run a tool's recovery hook: ``hook`` is ``"reconcile"`` (``args``: the call's arguments) or
        ``"compensate"`` (``args``: arguments and the recorded result); returns what the hook returned.

        Raises:
            WaitForHuman: a ``compensate`` hook that waits for a person's confirmation.
        """
        ...

    # -- controls --------------------------------------------------------------------------------
    def watch(self, session_id: str, owner: str | None, lease_ttl: float, on_control: Callable[[], None],
              on_lost: Callable[[str], None]) -> Cancellable:
        """While a run is driven: call ``on_control()`` when an Interrupt or a Cancel is queued for
        the session, and keep its lease (owner ``owner``, ``lease_ttl`` seconds; ``None``: no lease),
        calling ``on_lost(reason)`` when it cannot be kept. Both callbacks run on the event loop and
        may be called more than once."""
        ...

    async def wait_controls(self, session_id: str, kinds: Sequence[ControlKind], timeout: float
                            ) -> list[ControlRecord]:
        """Take the queued control events of ``kinds`` (each once), waiting up to ``timeout`` seconds
        for the first; ``[]`` when none came."""
        ...

    # -- plugins' own I/O ------------------------------------------------------------------------
    async def plugin_effect(self, plugin: Any, method: str, args: Sequence[Any]) -> Any:
        """Run ``plugin.<method>(*args)`` (awaited when it returns an awaitable) as one effect and return
        what it returned: a middleware's call to its own service (``ctx.plugin_effect``).

        ``plugin`` is one of the run's middleware: a host that runs effects on other workers (Temporal
        activities) finds the same plugin there by its ``middleware_name`` in the same agent, and calls
        the same method. ``args`` and the result are plain data (JSON-like: None, bools, numbers,
        strings, lists, dicts; or fsm_agent's attrs values), so that they can be recorded and carried.
        A replay returns the recorded result without calling the plugin.

        Raises:
            Exception: what the method raised (recorded; a replay raises it again).
        """
        ...

    # -- the agent's system prompt ---------------------------------------------------------------
    async def system_prompt(self, source: PromptSource) -> PromptSnapshot | None:
        """The agent's system prompt now (:meth:`PromptSource.current
        <fsm_agent.prompt.PromptSource.current>`: a followed file is read again), read at a session's
        start and at each PreTurn. ``None``: this port cannot tell (a durable host replaying history
        made before prompts were read), and the session keeps the prompt it has. Never raises for a
        file that cannot be read (the last text stays)."""
        ...
