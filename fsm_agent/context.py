"""The plugin's view of a run: :class:`RunContext`, what every middleware hook is given.

The view is closed. A plugin reads the run (its config, counters, usage, the transcript, the
machine's state) and writes only:

* ``ctx.messages``: the context of the next model call (a fresh copy of the transcript at each
  PreTurn, which ``pre_turn`` middleware may rewrite: repair, redaction, compaction);
* ``ctx.settings``: :class:`TurnSettings` of the next model call;
* its own run-scoped data, ``ctx.state(self)``;
* observer events, ``ctx.emit(event)``;
* the run's plan, ``ctx.update_plan(plan, reason)``.

Everything else changes only through a hook's return value (a ``ToolDecision``, a
``TurnDecision``, a ``StopRun``). ``ctx.transcript`` is a read-only sequence, ``ctx.machine`` a
read-only view and ``ctx.tools`` a read-only registry; a write to any of them raises
:class:`~fsm_agent.errors.ContextWriteError`, which names the supported way.

**The world, through the context.** A plugin that must survive a replay (the engine's effects
are recorded and replayed: :mod:`fsm_agent.testing.effects`, and a durable host such as Temporal
replays a run the same way) reaches the world only through what the context offers: model calls
with :meth:`RunContext.call_provider`, time with :meth:`~RunContext.now` /
:meth:`~RunContext.monotonic`, waits with :meth:`~RunContext.sleep` and
:meth:`~RunContext.deadline`, chance with :meth:`~RunContext.random` and :meth:`~RunContext.new_id`,
and its own service (a memory store, say) with :meth:`~RunContext.plugin_effect`.
A plugin that calls ``time.time()``, ``asyncio.sleep`` or ``random`` itself still works live, but a
replay may diverge where its result changes what the plugin does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

from attrs import define

from .config import RunConfig

if TYPE_CHECKING:
    from .providers.base import Provider
    from .tools.registry import Tool
    from .types.content import ToolUseBlock
    from .types.messages import Message, Usage
    from .permissions import Permissions
    from .types.plan import Plan
    from .types.requests import MessageRequest, MessageResponse, ToolDefinition

__all__ = ["CallProvider", "Deadline", "MachineView", "RunConfig", "RunContext", "ToolsView", "TurnSettings"]


@define
class TurnSettings:
    """What PreTurn middleware may set for the next model call; reset to these defaults each PreTurn
    unless a middleware sets them again."""

    active_tools: list[str] | None = None
    """Tool names offered to the model this turn; ``None``: all registered tools."""
    tools_enabled: bool = True
    """``False`` for a wrap-up turn (one last call offered no tools)."""
    max_output_tokens: int | None = None
    """``max_tokens`` of the next request; ``None``: the run config's (or the provider's default)."""


class CallProvider(Protocol):
    """``await ctx.call_provider(request, provider=None, *, account=False)``: one model call through
    the runtime's streaming path (``on_model_event`` and the observers see the deltas). It does not
    go through the ``wrap_model_call`` layers.

    Args:
        request: the request to send.
        provider: another provider to call (a fallback, a grader); ``None``: the run's.
        account: add the call's usage and cost to the run (for calls outside the Model phase, such
            as a grader's; the Model phase accounts its own call).

    An Interrupt or a Cancel cuts the call (the runtime watches the controls as it does during the
    Model phase's call): the run then stops, from the phase the call was made in. The signal that
    ends the call is the runtime's; a plugin should let it through (catch ``ProviderError``, not
    ``Exception``), though the run stops before any further model call even if it does not.

    Raises:
        ProviderError: the call failed (after the provider's own retries).
    """

    async def __call__(self, request: MessageRequest, provider: Provider | None = None, *,
                       account: bool = False) -> MessageResponse: ...


class MachineView(Protocol):
    """The machine of a run, read-only: only the runtime moves it."""

    @property
    def state(self) -> Any:
        """The current state: a :class:`~fsm_agent.Phase` or a :class:`~fsm_agent.StopReason`."""
        ...

    @property
    def is_terminal(self) -> bool:
        """Whether the run has stopped (the state is a StopReason)."""
        ...

    def can_fire(self, trigger: Any) -> bool:
        """Whether the table has a move for ``trigger`` (a :class:`~fsm_agent.Trigger`) from here."""
        ...


class ToolsView(Protocol):
    """The run's tools, read-only."""

    def get(self, name: str) -> Tool | None: ...

    def __contains__(self, name: object) -> bool: ...

    def __iter__(self) -> Any: ...

    def __len__(self) -> int: ...

    @property
    def names(self) -> tuple[str, ...]: ...

    def definitions(self, names: Any = None) -> tuple[ToolDefinition, ...]: ...


class Deadline(Protocol):
    """The handle of :meth:`RunContext.deadline`."""

    def expired(self) -> bool:
        """Whether the deadline passed (the block was cut by it)."""
        ...


class RunContext(Protocol):
    """The plugin's view of one run (valid for one run or resume). See the module doc."""

    session_id: str
    """The session's id."""
    provider: Provider
    """The run's provider (read it for its name, model and capabilities)."""
    messages: list[Message]
    """The context of the current model call: a fresh copy of the transcript at each PreTurn, which
    ``pre_turn`` middleware may rewrite (later writes change nothing already sent)."""
    settings: TurnSettings
    """Settings of the next model call, reset at each PreTurn; ``pre_turn`` middleware may change them."""
    call_provider: CallProvider
    """One model call through the runtime (see :class:`CallProvider`)."""

    # -- read-only views ----------------------------------------------------------------------
    @property
    def transcript(self) -> Sequence[Message]:
        """The conversation of record, read-only (the runtime appends to it)."""
        ...

    @property
    def machine(self) -> MachineView:
        """The machine, read-only."""
        ...

    @property
    def tools(self) -> ToolsView:
        """The registered tools, read-only."""
        ...

    @property
    def config(self) -> RunConfig:
        """Budgets and settings of this run."""
        ...

    @property
    def turn(self) -> int:
        """Model calls started in this session (1-based once the first call starts)."""
        ...

    @property
    def usage(self) -> Usage:
        """Tokens over the session."""
        ...

    @property
    def cost_usd(self) -> float | None:
        """USD over the session; ``None`` once a call had no known price."""
        ...

    @property
    def tool_calls_made(self) -> int:
        """Tool calls executed in this session."""
        ...

    @property
    def tool_call_counts(self) -> Mapping[str, int]:
        """Executed tool calls per tool name (read-only)."""
        ...

    @property
    def last_response(self) -> MessageResponse | None:
        """The last model response of this session, or ``None`` before the first."""
        ...

    @property
    def pending_calls(self) -> Sequence[ToolUseBlock]:
        """Tool calls of the last response that have no result yet."""
        ...

    @property
    def context_retry(self) -> bool:
        """The next call is the one retry after a context-length error (re-trim harder)."""
        ...

    @property
    def max_output_override(self) -> int | None:
        """A ``max_tokens`` the runtime chose for the next call (context-length recovery, or the one
        retry with a larger limit after a tool call was cut off by it)."""
        ...

    @property
    def goal_version(self) -> int:
        """Incremented by each Steer."""
        ...

    @property
    def evidence(self) -> Sequence[str]:
        """Evidence references gathered so far."""
        ...

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The session's metadata as the run found it when it started or resumed (read-only): what the
        caller gave ``Agent.run(metadata=...)``, or the server stored (``tenant``); ``{}`` for none."""
        ...

    @property
    def plan(self) -> Plan | None:
        """The run's plan (frozen), or ``None`` when none was made; replace it with :meth:`update_plan`."""
        ...

    @property
    def permissions(self) -> Permissions | None:
        """The session's permissions (frozen: :class:`~fsm_agent.Permissions`), or ``None`` when it has
        none (every tool). A plugin reads them; it cannot change them (the engine checks every call
        against them, before any plugin sees it)."""
        ...

    @property
    def elapsed(self) -> float:
        """Wall-clock seconds of this session so far (all runs)."""
        ...

    @property
    def remaining_wall_clock(self) -> float | None:
        """Seconds left of the wall-clock budget, or ``None`` without one."""
        ...

    @property
    def state_name(self) -> str:
        """The machine state's name (``PreTurn`` ...)."""
        ...

    @property
    def active_tools(self) -> list[str] | None:
        """``settings.active_tools`` (read-only here; set ``ctx.settings.active_tools``)."""
        ...

    @property
    def tools_enabled(self) -> bool:
        """``settings.tools_enabled`` (read-only here; set ``ctx.settings.tools_enabled``)."""
        ...

    # -- what a plugin may do ----------------------------------------------------------------------
    def state(self, middleware: Any) -> dict[str, Any]:
        """A dict private to ``middleware`` for this run (created empty on first use). It lives as long
        as this context (one run or one resume); nothing in it is checkpointed, so what must survive
        a stop is rebuilt from :attr:`transcript`."""
        ...

    def emit(self, event: Any) -> None:
        """Queue an observer event (e.g. :class:`~fsm_agent.types.BudgetWarning`); it is delivered,
        and written to the session log, after the current hook returns."""
        ...

    def update_plan(self, plan: Plan, reason: str) -> None:
        """Replace the run's plan with ``plan`` (validated; logged as ``plan_updated``; checkpointed).

        Raises:
            InvalidPlanError: the plan breaks a rule, or its version is below the current plan's.
        """
        ...

    async def plugin_effect(self, plugin: Any, method: str, *args: Any) -> Any:
        """``await ctx.plugin_effect(self, "method", *args)``: call ``self.method(*args)`` (sync or async)
        as one effect of the run, and return what it returned. This is how a plugin reaches its own
        service (a database, an index, an API: the ``memory`` plugin's episode store) so that the run
        survives a replay: a recording keeps the result, a replay returns it without calling the
        method, and a durable host (Temporal) runs the call as an activity, on a worker that finds the
        same plugin by its name in the same agent.

        ``args`` and the result must be plain data (None, bools, numbers, strings, lists, dicts, or
        fsm_agent's attrs values): they are recorded, compared on replay and may cross processes. The
        call is not cut by an Interrupt or a Cancel: keep it short.

        Raises:
            ConfigurationError: ``plugin`` has no such method, is not a middleware of this run, or the
                run's effect port cannot run plugin effects.
            Exception: what the method raised.
        """
        ...

    # -- the world, replayable -------------------------------------------------------------------
    def now(self) -> float:
        """The wall clock, seconds since the Unix epoch (the run's port: replayed exactly)."""
        ...

    def monotonic(self) -> float:
        """A monotonic clock in seconds (the run's port)."""
        ...

    def random(self) -> float:
        """A random float in [0, 1) (the run's port)."""
        ...

    def new_id(self) -> str:
        """A new unique id, 32 lowercase hex characters (the run's port)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on the run's timers (the run's port)."""
        ...

    def deadline(self, seconds: float | None) -> AbstractAsyncContextManager[Deadline]:
        """``async with ctx.deadline(s) as d:`` cuts the block after ``s`` seconds on the run's timers
        and raises :class:`TimeoutError` (``d.expired()`` tells it was the deadline); ``None``: no
        deadline."""
        ...
