"""Run configuration (budgets, limits) and the mutable context handed to middleware."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from attrs import define, field, frozen

from ..types.content import ToolUseBlock
from ..types.messages import Message, Usage
from ..types.requests import MessageResponse, ThinkingConfig
from .definition import MachineState

if TYPE_CHECKING:
    from ..providers.base import Provider
    from ..tools.registry import ToolRegistry

__all__ = ["RunConfig", "RunContext"]


@frozen
class RunConfig:
    """Limits and settings of a run. Budgets are checked at each PreTurn in seed 000's order:
    shutdown (interrupt/cancel) → iterations → wall clock → tokens → cost.
    """

    max_iterations: int = 50
    """Model calls per run (seed 000 §5.1.2 default 50)."""
    max_wall_clock: float | None = 600.0
    """Seconds from the run's start (seed 000 default 600 s); ``None``: no limit."""
    max_tokens: int | None = None
    """Input + output tokens over the run (seed 000 default: none)."""
    max_cost_usd: float | None = None
    """USD over the run; ``None``: no limit."""
    tool_timeout: float | None = None
    """Seconds per tool call, overriding each tool's own timeout (default 600 s per tool); ``None``: the tool's."""
    stream: bool = True
    """Stream model responses (observers see deltas)."""
    max_output_tokens: int | None = None
    """``max_tokens`` of each model request; ``None``: the provider's default."""
    temperature: float | None = None
    thinking: ThinkingConfig | None = None
    tool_choice: str | None = None
    approval_timeout: float | None = None
    """Hang-Wait: seconds to wait in process for a person's decision on a tool call before stopping
    WAITING_HUMAN (Stop-Resume). ``None`` (default): stop at once and resume later."""

    def __attrs_post_init__(self) -> None:
        from ..errors import ConfigurationError

        if self.max_iterations < 1:
            raise ConfigurationError(f"max_iterations must be at least 1, not {self.max_iterations}")
        for name in ("max_wall_clock", "max_tokens", "tool_timeout", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigurationError(f"{name} must be positive (or None for no limit), not {value}")
        for name in ("max_cost_usd", "approval_timeout"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigurationError(f"{name} must not be negative, not {value}")


@define(slots=False)
class RunContext:
    """Everything a run knows, handed to middleware hooks. Mutable; valid for one run (or resume).

    ``transcript`` is the conversation of record (append-only in practice);
    ``messages`` is the context of the current model call, rebuilt from the
    transcript at each PreTurn and free for PreTurn middleware to rewrite.
    """

    session_id: str
    config: RunConfig
    provider: Provider
    tools: ToolRegistry
    transcript: list[Message]
    machine: MachineState = field(factory=MachineState)
    messages: list[Message] = field(factory=list)
    turn: int = 0
    """Model calls started in this session (1-based once the first call starts)."""
    usage: Usage = Usage()
    """Tokens over the session."""
    cost_usd: float | None = 0.0
    """USD over the session; ``None`` once a call had no known price."""
    tool_calls_made: int = 0
    tool_call_counts: dict[str, int] = field(factory=dict)
    last_response: MessageResponse | None = None
    pending_calls: list[ToolUseBlock] = field(factory=list)
    active_tools: list[str] | None = None
    """Tool names offered to the model this turn; ``None``: all registered tools."""
    tools_enabled: bool = True
    """False for a wrap-up turn (one last call with no tools)."""
    started_at: float = field(factory=time.monotonic)
    """``time.monotonic()`` at the start of this run."""
    elapsed_before: float = 0.0
    """Wall-clock seconds spent by earlier runs of this session (resumes)."""
    evidence: list[str] = field(factory=list)
    extra_stop: dict[str, Any] = field(factory=dict)
    _states: dict[str, dict[str, Any]] = field(factory=dict)
    context_retry: bool = False
    """Set once the context-length recovery (re-trim and retry once, case B20) was used."""
    max_output_override: int | None = None
    """A lowered ``max_tokens`` for the next call (context-length recovery)."""
    decisions: dict[str, Any] = field(factory=dict)
    """Decisions (:class:`~fsm_agent.control.Decision`) on pending tool calls, by call id, given at resume."""
    ledger: dict[str, Any] = field(factory=dict)
    """The session's tool-call ledger (call id -> LedgerEntry) as loaded and updated by this run."""
    goal_version: int = 1
    """Incremented by each Steer."""
    cancel_confirmed: bool = False
    """A person confirmed a cancel whose side effects have no compensation."""
    outbox: list[Any] = field(factory=list)
    """Observer events queued by middleware with :meth:`emit`; delivered after the current hook."""
    call_provider: Any = None
    """``await ctx.call_provider(request, provider=None, *, account=False) -> MessageResponse``: one model
    call through the runtime's streaming path (observers see the deltas), with ``provider`` instead of
    the run's when given; ``account=True`` adds its usage and cost to the run (for calls outside the
    Model phase, e.g. a grader). Set by the driver; middleware use it for fallbacks and graders."""

    def emit(self, event: Any) -> None:
        """Queue an observer event (e.g. :class:`~fsm_agent.types.BudgetWarning`); middleware cannot await
        observers themselves, and observers cannot change the run."""
        self.outbox.append(event)

    @property
    def remaining_wall_clock(self) -> float | None:
        """Seconds left of the wall-clock budget, or ``None`` without one."""
        if self.config.max_wall_clock is None:
            return None
        return max(0.0, self.config.max_wall_clock - self.elapsed)

    @property
    def state_name(self) -> str:
        return str(self.machine.state.value)

    @property
    def elapsed(self) -> float:
        """Wall-clock seconds of this session so far (all runs)."""
        return self.elapsed_before + time.monotonic() - self.started_at

    def state(self, middleware: Any) -> dict[str, Any]:
        """A dict private to ``middleware`` for this run (created empty on first use)."""
        key = getattr(middleware, "middleware_name", None) or str(middleware)
        return self._states.setdefault(key, {})
