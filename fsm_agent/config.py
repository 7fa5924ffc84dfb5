"""Run configuration: budgets and limits of one run (seed 000 defaults)."""

from __future__ import annotations

from attrs import frozen

from .types.requests import ThinkingConfig
from .types.structured import OutputSchema

__all__ = ["RunConfig"]


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
    output_schema: OutputSchema | None = None
    """An :class:`~fsm_agent.types.OutputSchema` the final answer must match (checked at PostTurn:
    one repair turn on a mismatch, then FAILED_TERMINAL with error kind ``structured_output_invalid``);
    the parsed value is ``RunResult.output_data``. ``None``: free text."""
    approval_timeout: float | None = None
    """Hang-Wait: seconds to wait in process for a person's decision on a tool call before stopping
    WAITING_HUMAN (Stop-Resume). ``None`` (default): stop at once and resume later."""

    def __attrs_post_init__(self) -> None:
        from .errors import ConfigurationError

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
