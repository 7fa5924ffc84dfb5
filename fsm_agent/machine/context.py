"""What middleware sees of a run: :class:`RunContext`, a read-only view of the run state plus the
three things a plugin may write.

A plugin may write:

* ``ctx.messages`` — the context of the next model call (rebuilt from the transcript at each
  PreTurn; PreTurn middleware may rewrite it: repair, redaction, compaction);
* ``ctx.settings`` — :class:`~fsm_agent.machine.state.TurnSettings` for the next call (active
  tools, tools enabled, max output tokens);
* the run's plan, through one narrow write: :meth:`RunContext.update_plan` replaces it whole
  (validated), logs a ``plan_updated`` event, and the next checkpoint carries it (PlanAct).
  ``ctx.plan`` reads it; a :class:`~fsm_agent.types.Plan` is frozen, so it cannot be changed in place.

Everything else is read-only: the driver's own state (:class:`~fsm_agent.machine.state.RunState`)
is not reachable through the view, so no plugin can move a counter, the ledger or a decision.
Run-scoped plugin data goes in ``ctx.state(self)``; observer events go out through
:meth:`RunContext.emit`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import InvalidPlanError
from ..types.content import ToolUseBlock
from ..types.events import PlanUpdated
from ..types.messages import Message, Usage
from ..types.plan import Plan
from ..types.requests import MessageRequest, MessageResponse
from .config import RunConfig
from .definition import MachineState
from .state import RunState, TurnSettings

if TYPE_CHECKING:
    from ..providers.base import Provider
    from ..tools.registry import ToolRegistry

__all__ = ["CallProvider", "RunConfig", "RunContext", "TurnSettings"]


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


class RunContext:
    """The plugin's view of one run (valid for one run or resume).

    Read-only properties mirror the run state (``turn``, ``usage``, ``cost_usd``, ``last_response``,
    ``plan`` ...); ``messages`` and ``settings`` are the plugin's to write, and the plan is
    replaced only through :meth:`update_plan`.
    """

    __slots__ = ("_run", "_states", "_outbox", "call_provider", "machine", "messages", "provider", "session_id",
                 "settings", "started_at", "tools", "transcript")

    def __init__(self, session_id: str, provider: Provider, tools: ToolRegistry, transcript: list[Message],
                 run: RunState | None = None, *, machine: MachineState | None = None) -> None:
        self.session_id = session_id
        """The session's id."""
        self.provider = provider
        """The run's provider (read it for its name, model and capabilities)."""
        self.tools = tools
        """The registered tools."""
        self.transcript = transcript
        """The conversation of record (append-only; the driver appends). Read, never write."""
        self._run = run if run is not None else RunState()
        self.machine = machine if machine is not None else MachineState(state_named(self._run.state))
        """The machine: read ``machine.state`` (or :attr:`state_name`); only the driver moves it."""
        self.messages: list[Message] = []
        """The context of the current model call: a fresh copy of the transcript at each PreTurn,
        which ``pre_turn`` middleware may rewrite (later writes change nothing already sent)."""
        self.settings = TurnSettings()
        """Settings of the next model call, reset at each PreTurn; ``pre_turn`` middleware may change them."""
        self.started_at = time.monotonic()
        """``time.monotonic()`` at the start of this run (or resume)."""
        self._states: dict[str, dict[str, Any]] = {}
        self._outbox: list[Any] = []
        self.call_provider: CallProvider = _no_provider_call
        """One model call through the runtime (see :class:`CallProvider`); set by the driver."""

    # -- the plugin's own data ------------------------------------------------------------
    def state(self, middleware: Any) -> dict[str, Any]:
        """A dict private to ``middleware`` for this run (created empty on first use).

        It lives as long as this context: one run or one resume. Nothing in it is checkpointed, so
        what must survive a stop is rebuilt from :attr:`transcript`."""
        key = getattr(middleware, "middleware_name", None) or str(middleware)
        return self._states.setdefault(key, {})

    def emit(self, event: Any) -> None:
        """Queue an observer event (e.g. :class:`~fsm_agent.types.BudgetWarning`); it is delivered,
        and written to the session log, after the current hook returns. Observers cannot change
        the run, so middleware cannot await them."""
        self._outbox.append(event)

    def update_plan(self, plan: Plan, reason: str) -> None:
        """Replace the run's plan with ``plan`` (PlanAct: planned, a node started, passed or
        failed, a replan).

        The plan is kept in the run state, so the next checkpoint carries it and a resumed run
        gets it back; a :class:`~fsm_agent.types.PlanUpdated` event with the whole plan and
        ``reason`` goes to the observers and into the session log as ``plan_updated`` (after the
        current hook returns, like :meth:`emit`).

        Raises:
            InvalidPlanError: the plan breaks a rule (:meth:`~fsm_agent.types.Plan.problems`), or its
                version is below the current plan's; the run's plan is left as it was.
        """
        plan.validate()
        old = self._run.plan
        if old is not None and plan.version < old.version:
            raise InvalidPlanError([f"version {plan.version} is below the current plan's {old.version}; a plan's "
                                    "version only goes up (Plan.replan adds one)"])
        self._run.plan = plan
        self.emit(PlanUpdated(self.session_id, self._run.turn, plan, reason))

    # -- read-only view of the run state ----------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The run's plan (frozen), or ``None`` when none was made; replace it with :meth:`update_plan`."""
        return self._run.plan

    @property
    def config(self) -> RunConfig:
        """Budgets and settings of this run."""
        return self._run.config

    @property
    def turn(self) -> int:
        """Model calls started in this session (1-based once the first call starts)."""
        return self._run.turn

    @property
    def usage(self) -> Usage:
        """Tokens over the session."""
        return self._run.usage

    @property
    def cost_usd(self) -> float | None:
        """USD over the session; ``None`` once a call had no known price."""
        return self._run.cost_usd

    @property
    def tool_calls_made(self) -> int:
        """Tool calls executed in this session."""
        return self._run.tool_calls_made

    @property
    def tool_call_counts(self) -> Mapping[str, int]:
        """Executed tool calls per tool name (read-only)."""
        return _ReadOnly(self._run.tool_call_counts)

    @property
    def last_response(self) -> MessageResponse | None:
        """The last model response of this session, or ``None`` before the first."""
        return self._run.last_response

    @property
    def pending_calls(self) -> Sequence[ToolUseBlock]:
        """Tool calls of the last response that have no result yet."""
        return tuple(self._run.pending_calls)

    @property
    def context_retry(self) -> bool:
        """The next call is the one retry after a context-length error (re-trim harder)."""
        return self._run.context_retry

    @property
    def max_output_override(self) -> int | None:
        """A lowered ``max_tokens`` the runtime chose for the next call (context-length recovery)."""
        return self._run.max_output_override

    @property
    def goal_version(self) -> int:
        """Incremented by each Steer."""
        return self._run.goal_version

    @property
    def evidence(self) -> Sequence[str]:
        """Evidence references gathered so far."""
        return tuple(self._run.evidence)

    @property
    def elapsed(self) -> float:
        """Wall-clock seconds of this session so far (all runs)."""
        return self._run.elapsed + time.monotonic() - self.started_at

    @property
    def remaining_wall_clock(self) -> float | None:
        """Seconds left of the wall-clock budget, or ``None`` without one."""
        if self._run.config.max_wall_clock is None:
            return None
        return max(0.0, self._run.config.max_wall_clock - self.elapsed)

    @property
    def state_name(self) -> str:
        """The machine state's name (``PreTurn`` ...)."""
        return str(self.machine.state.value)

    # -- compatibility readers of the turn settings -------------------------------------------
    @property
    def active_tools(self) -> list[str] | None:
        """``settings.active_tools`` (read-only here; set ``ctx.settings.active_tools``)."""
        return self.settings.active_tools

    @property
    def tools_enabled(self) -> bool:
        """``settings.tools_enabled`` (read-only here; set ``ctx.settings.tools_enabled``)."""
        return self.settings.tools_enabled

    def __repr__(self) -> str:
        return f"RunContext(session_id={self.session_id!r}, state={self.state_name}, turn={self.turn})"


class _ReadOnly(Mapping[str, int]):
    __slots__ = ("_d",)

    def __init__(self, d: dict[str, int]) -> None:
        self._d = d

    def __getitem__(self, key: str) -> int:
        return self._d[key]

    def __iter__(self) -> Any:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


async def _no_provider_call(request: MessageRequest, provider: Provider | None = None, *,
                            account: bool = False) -> MessageResponse:
    from ..errors import ConfigurationError

    raise ConfigurationError("ctx.call_provider is available only while a driver runs the context")


def state_named(name: str) -> Any:
    """The machine state named ``name`` (a :class:`Phase` or a :class:`StopReason`)."""
    from ..types.run import StopReason
    from .phases import Phase

    try:
        return Phase(name)
    except ValueError:
        return StopReason(name)
