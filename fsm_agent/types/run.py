"""How a run ends: the seven StopReasons, their payload, and the run's result.

Seed 004 §4: a stop reason is not a free string; it drives UI, resume, billing
and evaluation. Each carries ``checkpoint_id``, ``last_safe_point``,
``pending_actions``, ``required_decision``, ``evidence_refs``, ``detail`` and
``resumable``.
"""

from __future__ import annotations

import enum
from typing import Any

from attrs import field, frozen

from .content import _tuple, ToolUseBlock
from .messages import Message, ModelStopReason, Usage

__all__ = [
    "ContextRef",
    "PendingAction",
    "RunResult",
    "RunStop",
    "StopReason",
    "TurnRecord",
]


class StopReason(str, enum.Enum):
    """The seven ways a run ends. Each is a terminal state of the machine."""

    COMPLETED = "COMPLETED"
    """The verifier (or, with none, the model's end of turn) says the task is done."""
    WAITING_HUMAN = "WAITING_HUMAN"
    """A decision from a person is needed (approval of a tool call, a question)."""
    PAUSED_BUDGET = "PAUSED_BUDGET"
    """A budget (iterations, wall clock, tokens, cost) ran out; resumable with a larger one."""
    INTERRUPTED = "INTERRUPTED"
    """Stopped from outside; state frozen and resumable."""
    FAILED_RETRYABLE = "FAILED_RETRYABLE"
    """A transient failure outlasted the retries; resuming later may succeed."""
    FAILED_TERMINAL = "FAILED_TERMINAL"
    """A failure that retrying will not fix (bad request, content filtered, auth)."""
    CANCELLED = "CANCELLED"
    """The user cancelled the task."""

    @property
    def resumable(self) -> bool:
        return self in _RESUMABLE


_RESUMABLE = frozenset(
    {StopReason.WAITING_HUMAN, StopReason.PAUSED_BUDGET, StopReason.INTERRUPTED, StopReason.FAILED_RETRYABLE}
)


@frozen
class PendingAction:
    """A tool call waiting for something (a human decision, a reconcile) when a run stopped."""

    call: ToolUseBlock
    """The tool call as the model proposed it."""
    reason: str = ""
    """Why it waits: ``approval_required``, ``interrupted``, ``unknown_outcome`` ..."""
    allowed_decisions: tuple[str, ...] = field(default=("approve", "edit", "reject", "respond"), converter=_tuple)


@frozen
class RunStop:
    """The stop reason of a run with its payload (DESIGN.md §2)."""

    reason: StopReason
    detail: str = ""
    """What happened, in words a user can act on."""
    resumable: bool = False
    checkpoint_id: str | None = None
    """Checkpoint to resume from, or ``None`` when nothing was persisted."""
    last_safe_point: str | None = None
    """The phase boundary the run can resume from (``PreTurn``, ``MidTurn``), or ``None``."""
    pending_actions: tuple[PendingAction, ...] = field(default=(), converter=_tuple)
    required_decision: str | None = None
    """What a person must decide before resuming, or ``None``."""
    evidence_refs: tuple[str, ...] = field(default=(), converter=_tuple)
    """References to the evidence behind the stop (verifier records, event seqs)."""
    budget: str | None = None
    """For PAUSED_BUDGET: which budget ran out (``iterations``, ``wall_clock``, ``tokens``, ``cost``)."""
    error: dict[str, Any] | None = None
    """For failures: :meth:`fsm_agent.errors.ProviderError.to_info` or ``{"kind", "message"}``."""
    partial: str | None = None
    """For a model call a provider error cut mid-answer (an ``error`` event after some text, a
    dropped connection): the text that had streamed, for the user to see. It is **not** part of
    the conversation (``RunResult.messages``): a resume asks again from the history before it.
    ``None`` when nothing had streamed, or the stop is not such a failure. (An Interrupt or the
    wall clock keeps the streamed part in the conversation instead.) With middleware that filter
    stream events (``on_model_event``), it is the text as they passed it on to the observers: the
    ``redaction`` plugin's placeholders in place of secrets, without a tail still held back."""


@frozen
class RunResult:
    """What :meth:`fsm_agent.Agent.run` returns. Branch on ``stop.reason``, never on exceptions."""

    session_id: str
    stop: RunStop
    output: str
    """The last assistant text ('' when the model produced none)."""
    messages: tuple[Message, ...] = field(converter=_tuple)
    """The whole transcript, system prompt included."""
    usage: Usage = Usage()
    """Tokens over all model calls of this run (``estimated`` when any call reported none)."""
    turns: int = 0
    """Model calls made (iterations)."""
    tool_calls: int = 0
    """Tool calls executed."""
    model_stop_reason: ModelStopReason | None = None
    """Stop reason of the last model response, or ``None`` when no call finished."""
    cost_usd: float | None = None
    """Cost over all calls (USD) when every model had a price, else ``None``."""
    duration_s: float = 0.0
    """Wall-clock time of this run (seconds)."""
    output_data: Any = None
    """With an output schema (``RunConfig.output_schema``): the final answer parsed and validated
    against it; ``None`` otherwise."""

    @property
    def reason(self) -> StopReason:
        return self.stop.reason

    @property
    def ok(self) -> bool:
        return self.stop.reason is StopReason.COMPLETED


@frozen
class ContextRef:
    """A reference to exactly what one model call was sent (seed 004 §2: context snapshot ref)."""

    hash: str
    """SHA-256 (hex) of the request's messages, tools and settings as canonical JSON."""
    seq: int
    """The last event seq of the session log the context was built from."""
    messages: int
    """Messages in the request."""


@frozen
class TurnRecord:
    """One turn (PreTurn → Model → MidTurn → PostTurn) as seed 004 §2 describes it, written to the
    session log as a ``turn`` event when the turn ends."""

    turn: int
    """The turn number (the model call's, 1-based)."""
    input_seq: int | None = None
    """Seq of the event that started the turn (the user message, a followup, a steer, the last tool
    result), or ``None`` when unknown."""
    context: ContextRef | None = None
    """What the model was sent, or ``None`` when the turn stopped before the call."""
    model_call: dict[str, Any] | None = None
    """``model``, ``provider``, ``stop_reason``, ``usage``, ``cost_usd`` of the call, or ``None``."""
    tool_calls: tuple[str, ...] = field(default=(), converter=_tuple)
    """Ids of the tool calls the model made."""
    observations: tuple[dict[str, Any], ...] = field(default=(), converter=_tuple)
    """Per tool call: ``call_id``, ``tool``, ``status`` (the ledger status), ``is_error``."""
    verification: str | None = None
    """What PostTurn decided and who decided it (a verifier's verdict), or ``None``."""
    stop_reason: str | None = None
    """The run's StopReason when this turn ended the run, else ``None``."""
    resumed: bool = False
    """True for the rest of a turn that ran after a resume in MidTurn (the turn's first record, with
    its context and model call, was written when the run stopped)."""
