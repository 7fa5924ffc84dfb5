"""Run configuration: budgets and limits of one run (seed 000 defaults)."""

from __future__ import annotations

from attrs import frozen

from .loops import LoopConfig
from .types.requests import ThinkingConfig
from .types.structured import OutputSchema

__all__ = ["DEFAULT_CONTENT_FILTER_MESSAGE", "RunConfig"]

DEFAULT_CONTENT_FILTER_MESSAGE = ("I can't help with that: the model provider's safety filter blocked this answer. "
                                  "Please rephrase your request.")
"""The answer a user gets when the provider's content filter blocks one (seed 000 §5.3.4: the loop ends
and returns a safety message): :attr:`RunConfig.content_filter_message`'s default."""


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
    pin_system_prompt: bool = False
    """Keep the system prompt the session uses now (at its start: the one it started with) across its
    turns and resumes, whatever the agent's prompt becomes. ``False`` (default): each PreTurn takes
    the agent's current prompt (``Agent.set_system_prompt``, a ``PromptFile``); see docs/system-prompt.md."""
    loop_detection: LoopConfig | None = LoopConfig()
    """Loop detection in the engine (seed 000 §5.4): a :class:`~fsm_agent.LoopConfig` (default: the
    last 12 calls, patterns of 1, 2 or 3 calls, 3 repetitions with the same results; a warning in
    the model's context, then ``then``: ``"warn"``, ``"block"`` or ``"stop"``). ``None``: none. A
    chain with the ``loop_detection`` plugin (or any middleware with ``handles_loops = True``)
    detects loops itself, and the engine's stands aside. See docs/loops.md."""
    content_filter_message: str = DEFAULT_CONTENT_FILTER_MESSAGE
    """The answer the user gets when the provider's content filter blocks the model's answer or the
    request (seed 000 §5.3.4): it is ``RunResult.output`` and the run's last assistant message, and
    nothing the model had written before the filter hit stays in the conversation. The run stops
    FAILED_TERMINAL with error kind ``content_filtered`` (a ``content_filtered`` event holds the
    provider's details). Default :data:`DEFAULT_CONTENT_FILTER_MESSAGE`; must not be blank."""

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
        if not isinstance(self.content_filter_message, str) or not self.content_filter_message.strip():
            raise ConfigurationError(
                f"content_filter_message must be a non-blank text (what the user is told when the provider's "
                f"content filter blocks an answer), not {self.content_filter_message!r}")
