"""What observers receive: one frozen params object per signal (STYLE habit 4).

These are notifications, not commands: an observer cannot change the run, and
an observer that raises is logged and ignored.
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

from attrs import frozen

from .content import ToolUseBlock
from .messages import ToolResultMessage, Usage
from .plan import Plan
from .run import PendingAction
from .stream import StreamEvent

__all__ = [
    "ApprovalRequested",
    "BudgetWarning",
    "MemoryRecalled",
    "ModelRetry",
    "ModelStreamEvent",
    "ObserverEvent",
    "OutputPartial",
    "PlanUpdated",
    "PolicyDecision",
    "SystemPromptChanged",
    "ToolFinished",
    "ToolProgress",
    "ToolStarted",
    "TransitionEvent",
    "UsageRolledUp",
]


@frozen
class TransitionEvent:
    """The machine moved: ``from_state`` --``trigger``--> ``to_state``."""

    TAG: ClassVar[str] = "transition"
    session_id: str
    turn: int
    """Turn number (1-based; 0 before the first model call)."""
    from_state: str
    trigger: str
    to_state: str
    reason: str
    """Why, in words (``model stop reason tool_use``, ``iterations budget exhausted`` ...)."""
    ts: float
    """Unix time (seconds)."""


@frozen
class ModelStreamEvent:
    """One stream event of the current model call (text and thinking deltas, tool-call deltas ...)."""

    TAG: ClassVar[str] = "model_event"
    session_id: str
    turn: int
    event: StreamEvent
    phase: str = "Model"
    """The machine state the call was made in: ``Model`` for the run's own call (the answer, or a
    tool call); another phase (``PreTurn``, ``PostTurn`` ...) for a plugin's side call through
    ``ctx.call_provider`` (a planner, a grader, a summarizer), which is not the answer."""


@frozen
class OutputPartial:
    """The structured answer (``RunConfig.output_schema``) as far as it has streamed, checked as far
    as it goes; or, with ``validated``, the whole answer as the final check accepted it.

    While the Model phase's answer streams, one event each time its JSON value grows (a member, an
    item or string content added): ``value`` is that partial value (see
    :class:`~fsm_agent.types.partial_json.PartialJSON`: open strings as far as they go, numbers and
    literals once complete). ``error`` is ``None`` when the partial value violates nothing but what
    the rest of the answer may still supply (missing required members, too few items, a string
    still being written), else what is already wrong. Then, when the answer passed the final check
    at PostTurn, one event with ``validated=True`` and the value ``RunResult.output_data`` holds
    (unless a middleware sends the run on for another answer). A repair turn, a retried call or a
    later turn starts a new series (``turn``). Not written to the session log: a replay is
    unaffected. Treat ``value`` as read-only (partial values share their complete members)."""

    TAG: ClassVar[str] = "output_partial"
    session_id: str
    turn: int
    """The model call's number (``RunResult.turns`` counts them)."""
    schema: str
    """The output schema's name."""
    value: Any
    """The JSON value so far (``dict``, ``list``, ``str``...); the final value with ``validated``."""
    error: str | None = None
    """What the partial value already gets wrong (JSON path, failed constraint), or ``not JSON ...``
    when the answer stopped being JSON; ``None``: valid as far as it goes."""
    validated: bool = False
    """``True``: the complete answer, accepted by the final check (:func:`fsm_agent.structured.parse_output`)."""
    chars: int = 0
    """Characters of the answer's text streamed so far (0 for the validated event)."""


@frozen
class ModelRetry:
    """A failed model call is about to be tried again, after ``delay_s`` seconds.

    Emitted for the provider's own retries of an HTTP attempt (``layer="provider"``), for the
    ``retry`` plugin's retries of a whole call (``layer="retry"``), and for a plugin's retries of its
    own side calls (``layer`` the plugin's name, e.g. ``planact``); written to the session log as
    ``model_retry``."""

    TAG: ClassVar[str] = "model_retry"
    session_id: str
    turn: int
    attempt: int
    """The retry about to be made (1 for the first retry)."""
    status: int | None
    """The failed attempt's HTTP status (``None``: no response, e.g. a dropped connection)."""
    kind: str
    """The error's kind (``rate_limited``, ``server_error``, ``connection`` ...)."""
    reason: str
    """The error's message (secrets already scrubbed)."""
    delay_s: float
    """The chosen wait before the retry, in seconds."""
    server_hint: bool = False
    """``delay_s`` is the wait the server asked for (``Retry-After``), honoured exactly."""
    provider: str | None = None
    """The provider that failed."""
    layer: str = "provider"
    """``provider`` (an HTTP attempt retried inside the provider call), ``retry`` (the plugin), or the
    name of a plugin retrying its own side call (``planact``)."""


@frozen
class ToolStarted:
    """A tool call is about to execute."""

    TAG: ClassVar[str] = "tool_started"
    session_id: str
    turn: int
    call: ToolUseBlock


@frozen
class ToolFinished:
    """A tool call got its result (``result.is_error`` for failures, denials and timeouts). Calls that
    did not run (denied by policy, answered by middleware or a person) are announced too, with
    ``duration_s`` 0 and no :class:`ToolStarted` before them."""

    TAG: ClassVar[str] = "tool_finished"
    session_id: str
    turn: int
    call: ToolUseBlock
    result: ToolResultMessage
    duration_s: float
    """Execution time (seconds)."""


@frozen
class BudgetWarning:
    """A budget crossed its soft threshold."""

    TAG: ClassVar[str] = "budget_warning"
    session_id: str
    turn: int
    budget: str
    used: float
    limit: float


@frozen
class MemoryRecalled:
    """The ``memory`` plugin looked up past episodes for the run (once per run or resume, at its first
    PreTurn) and put the ones that fit its token budget into the context; written to the session log
    as ``memory_recalled``. Delivered to observers as a plugin event (``on_plugin_event``, ``on_event``)."""

    TAG: ClassVar[str] = "memory_recalled"
    session_id: str
    turn: int
    tenant: str
    """Whose episodes were searched."""
    query: str
    """What was searched for (the session's goal and latest request; cut)."""
    episodes: tuple[str, ...]
    """The ids of the episodes put into the context, best first."""
    scores: tuple[float, ...]
    """Their search scores (higher is better; comparable within one search only)."""
    tokens: int
    """Tokens the recalled block takes (0: nothing was recalled)."""
    budget: int
    """Tokens the block may take (the plugin's share of the context window)."""
    skipped: tuple[str, ...] = ()
    """Episodes found but left out: too large for what was left of the budget."""
    error: str | None = None
    """Why nothing could be recalled (the store's error), or ``None``."""


@frozen
class ApprovalRequested:
    """Tool calls wait for a person's decision (the run stops WAITING_HUMAN, or waits in process
    with Hang-Wait)."""

    TAG: ClassVar[str] = "approval_requested"
    session_id: str
    turn: int
    pending: tuple[PendingAction, ...]


@frozen
class ToolProgress:
    """A running tool reported progress (``ToolContext.report_progress``: an MCP server's progress
    notifications, a sub-agent's turns); written to the session log as ``tool_progress``."""

    TAG: ClassVar[str] = "tool_progress"
    session_id: str
    turn: int
    call_id: str
    tool: str
    progress: float
    """Work done so far, in the tool's own unit (increases)."""
    total: float | None = None
    """The work in all, in the same unit, when known."""
    message: str | None = None


@frozen
class UsageRolledUp:
    """A tool's own model usage was added to the run's (``ToolContext.add_usage``: a sub-agent's
    session, a remote agent's reported cost); written to the session log as ``usage_rolled_up``.
    The run's token and cost budgets count it from then on."""

    TAG: ClassVar[str] = "usage_rolled_up"
    session_id: str
    turn: int
    call_id: str
    tool: str
    usage: Usage
    cost_usd: float | None
    """USD of that usage; ``None``: unknown (the run's cost becomes unknown too)."""
    child_session_id: str | None = None
    """The sub-agent's session, when the usage is a child session's."""


@frozen
class PlanUpdated:
    """The run's plan changed (``ctx.update_plan``: planned, a node started, passed or failed, a
    replan); written to the session log as ``plan_updated``. The last one holds the plan a
    checkpoint taken after it carries (``RunState.plan``)."""

    TAG: ClassVar[str] = "plan_updated"
    session_id: str
    turn: int
    plan: Plan
    """The whole plan after the change."""
    reason: str
    """What changed and why, in words (``node s2 failed its check: ...; replanned``)."""


@frozen
class PolicyDecision:
    """A middleware decided something that changes the run: on a tool call (``deny``, ``ask``,
    ``edit``, ``respond``, from ``on_tool_call``), on the turn (``complete``, ``continue``, from
    ``post_turn``), or ended it (``stop``: a ``StopRun`` raised by one of its hooks). The engine's
    loop detection (``RunConfig.loop_detection``) reports as ``loop_detection`` too: ``warn``
    (hook ``PreTurn``), ``deny`` (hook ``MidTurn``, with the call) and ``stop``. Delivered to
    observers only; the session log keeps the outcomes (the tool result, the transition, the stop)."""

    TAG: ClassVar[str] = "policy_decision"
    session_id: str
    turn: int
    middleware: str
    """The deciding middleware's ``middleware_name``."""
    hook: str
    """The hook that decided (``on_tool_call``, ``post_turn``); for ``stop``, the phase the run was in
    (``PreTurn``, ``Model``, ``MidTurn``, ``PostTurn``)."""
    decision: str
    """``deny``, ``ask``, ``edit``, ``respond``, ``complete``, ``continue``, ``stop`` or ``warn``."""
    reason: str = ""
    """The decision's own words (a deny's reason, a stop's detail ...); may quote the conversation."""
    call: ToolUseBlock | None = None
    """The tool call decided on (``on_tool_call`` decisions), as the model made it."""
    stop_reason: str | None = None
    """For ``stop``: the :class:`~fsm_agent.StopReason` value asked for."""


@frozen
class SystemPromptChanged:
    """The system prompt a session's model calls use changed (the agent's prompt was set in code or its
    prompt file changed): from this PreTurn's model call on, the model sees :attr:`text`. Written to
    the session log as ``system_prompt_changed``, so a replay and a resume know what the model saw."""

    TAG: ClassVar[str] = "system_prompt_changed"
    session_id: str
    turn: int
    """The turn before the first model call that uses it (the call's number is ``turn + 1``)."""
    version: int
    """The agent's prompt version (:class:`~fsm_agent.prompt.PromptSnapshot`)."""
    digest: str
    """Content hash of :attr:`text` (:func:`~fsm_agent.prompt.prompt_digest`)."""
    text: str | None
    """The new prompt (``None``: no system prompt)."""
    source: str
    """``code`` or ``file:<absolute path>``."""
    previous_digest: str
    """Content hash of the prompt the session used before."""


ObserverEvent = Union[TransitionEvent, ModelStreamEvent, OutputPartial, ModelRetry, ToolStarted, ToolFinished,
                      BudgetWarning, ApprovalRequested, ToolProgress, UsageRolledUp, PlanUpdated, PolicyDecision,
                      SystemPromptChanged]
