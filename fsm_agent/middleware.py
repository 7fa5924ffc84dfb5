"""The middleware contract: what a policy plugin may do at each phase.

Subclass :class:`Middleware` and override only the hooks you need; the others pass through and
the chain skips them. Each hook's docstring is its contract: when it runs, what to return, what
to raise, what it may read and write on the :class:`~fsm_agent.context.RunContext`, and
when it is *not* called.

In the order a run meets them:

* :meth:`Middleware.on_run_start`: once per run or resume, in list order;
* :meth:`Middleware.pre_turn`: **PreTurn**, before each model call, in list order;
* :meth:`Middleware.wrap_model_call`: **Model**, around each logical model call (first listed
  outermost); :meth:`Middleware.on_model_event`: each streamed event of it, in list order;
* :meth:`Middleware.on_tool_call`: **MidTurn**, each proposed tool call, in list order;
  :meth:`Middleware.wrap_tool_call`: around each tool that runs (first listed outermost);
* :meth:`Middleware.post_turn`: **PostTurn**, after each turn, in reverse list order;
* :meth:`Middleware.on_run_end`: once per run or resume, in reverse list order.

Rules shared by every hook:

* **Stopping.** ``raise StopRun(reason, detail)`` ends the run with that
  :class:`~fsm_agent.types.StopReason`, if the machine's table (:data:`fsm_agent.TRANSITIONS`)
  allows it from the current phase; otherwise the run fails closed (FAILED_TERMINAL, the detail
  saying which stop was refused). Each hook lists the reasons legal where it runs.
* **Failure policy.** Any other exception is the middleware's failure: with ``failure_policy =
  "propagate"`` (the default: fail closed) the run ends FAILED_TERMINAL naming the middleware
  and hook; with ``"isolate"`` it is logged (logger ``fsm_agent.chain``) and the hook counts as
  having passed through. A :class:`~fsm_agent.errors.ProviderError` is not a middleware failure:
  see each hook for what it does.
* **What a plugin writes.** ``ctx.messages`` and ``ctx.settings`` (in ``pre_turn``), its own
  ``ctx.state(self)``, observer events through ``ctx.emit``, and the run's plan through
  ``ctx.update_plan(plan, reason)`` (validated, logged as ``plan_updated``, checkpointed; the
  PlanAct plugin's, in ``pre_turn`` and ``post_turn``). Everything else on ``ctx`` is read-only;
  the transcript is the driver's.
* Hooks may be ``def`` or ``async def``, except ``wrap_*`` (always ``async def``) and
  ``on_model_event`` (always ``def``): checked when the chain is built.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Union

from attrs import field, frozen

from .types.content import ToolUseBlock
from .types.messages import Message, ToolResultMessage
from .types.requests import MessageRequest, MessageResponse
from .types.stream import StreamEvent

if TYPE_CHECKING:
    from .context import RunContext
    from .types.run import RunResult

__all__ = [
    "Allow",
    "AskApproval",
    "Complete",
    "Continue",
    "Deny",
    "Edit",
    "FailurePolicy",
    "Middleware",
    "ModelCallNext",
    "Ordering",
    "Respond",
    "ToolCallNext",
    "ToolDecision",
    "TurnDecision",
]

ModelCallNext = Callable[[MessageRequest], Awaitable[MessageResponse]]
"""``await call_next(request)`` runs the rest of the model chain and the provider call."""
ToolCallNext = Callable[[ToolUseBlock], Awaitable[ToolResultMessage]]
"""``await call_next(call)`` runs the rest of the tool chain and the tool."""


class FailurePolicy(str, enum.Enum):
    """What a hook's unexpected exception does to the run."""

    PROPAGATE = "propagate"
    """Fail closed: the run ends FAILED_TERMINAL naming the middleware (the default)."""
    ISOLATE = "isolate"
    """Log it and continue as if the hook had passed through."""


def _tuple(v: Any) -> tuple[str, ...]:
    return (v,) if isinstance(v, str) else tuple(v)


def _conflicts(v: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(v, str):
        return ((v, ""),)
    if isinstance(v, Mapping):
        return tuple((str(k), str(why)) for k, why in v.items())
    return tuple((x, "") if isinstance(x, str) else (str(x[0]), str(x[1])) for x in v)


@frozen
class Ordering:
    """Declarative placement in the chain (resolved once, when the chain is built).

    ``position``: ``"outermost"`` or ``"innermost"`` pins the middleware to an
    end (list order breaks ties among several). ``wraps``: names this one must
    sit outside of. ``wrapped_by``: names that must sit outside this one.
    ``requires``: names that must be present. ``conflicts``: names that must not
    be in the same chain, each with why (a mapping ``{name: reason}``, or names
    alone). Unknown names in ``wraps`` / ``wrapped_by`` are ignored (the other
    plugin is optional); a missing requirement, a conflict or a cycle is a
    :class:`~fsm_agent.errors.ChainError`.
    """

    position: str | None = None
    wraps: tuple[str, ...] = field(default=(), converter=_tuple)
    wrapped_by: tuple[str, ...] = field(default=(), converter=_tuple)
    requires: tuple[str, ...] = field(default=(), converter=_tuple)
    conflicts: tuple[tuple[str, str], ...] = field(default=(), converter=_conflicts)
    """``(name, reason)`` pairs: a middleware named ``name`` in the same chain is a ChainError
    that gives ``reason``."""


# -- decisions -------------------------------------------------------------------
@frozen
class Allow:
    """Run the call (the default when every middleware returns ``None``)."""


@frozen
class Deny:
    """Do not run the call; the model gets an error tool result with ``reason``."""

    reason: str


@frozen
class AskApproval:
    """Stop the run in WAITING_HUMAN with this call pending until a person decides."""

    reason: str = "approval required"
    allowed_decisions: tuple[str, ...] = ("approve", "edit", "reject", "respond")


@frozen
class Edit:
    """Replace the call's arguments (validated against the tool's schema before it runs)."""

    arguments: Mapping[str, Any]
    reason: str = ""


@frozen
class Respond:
    """Answer the call with ``result`` instead of running the tool."""

    result: str
    is_error: bool = False


ToolDecision = Union[Allow, Deny, AskApproval, Edit, Respond]


@frozen
class Continue:
    """Go on to the next turn; ``message`` (if any) is appended to the transcript first."""

    message: Message | None = None
    reason: str = "continue"


@frozen
class Complete:
    """The task is done; ``evidence`` is recorded in the stop reason's ``evidence_refs``."""

    evidence: tuple[str, ...] = ()
    detail: str = "task complete"


TurnDecision = Union[Continue, Complete]


class Middleware:
    """Base class of every middleware. Override only the hooks you need.

    Class attributes:
        name: unique name in a chain (default: the class name).
        ordering: an :class:`Ordering` (default: where the user listed it).
        failure_policy: ``"propagate"`` (default, fail closed) or ``"isolate"``.
        handles_loops: ``True`` for a middleware that detects loops of tool calls itself (the
            ``loop_detection`` plugin): in a chain that has one, the engine's loop detection
            (``RunConfig.loop_detection``) stands aside, so that a model is not warned twice.
    """

    name: ClassVar[str] = ""
    ordering: ClassVar[Ordering] = Ordering()
    failure_policy: ClassVar[FailurePolicy | str] = FailurePolicy.PROPAGATE
    handles_loops: ClassVar[bool] = False

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if not cls.__dict__.get("name"):
            cls.name = cls.__name__

    @property
    def middleware_name(self) -> str:
        return self.name or type(self).__name__

    # -- lifecycle ---------------------------------------------------------------------
    def on_run_start(self, ctx: RunContext) -> Any:
        """Set up run-scoped state: once per :meth:`Agent.run <fsm_agent.Agent.run>` and once per
        :meth:`Agent.resume <fsm_agent.Agent.resume>` (a crashed session taken over included), in
        list order, before the machine's first move of that run.

        Returns:
            Ignored.

        Raises:
            Nothing, by contract. This hook runs outside every phase, so a ``StopRun`` or a
            failure here is not turned into a stop reason: it propagates out of ``run`` /
            ``resume`` as an exception (the lease is released; with ``failure_policy="isolate"``
            a failure is logged and skipped). Stop the run from ``pre_turn`` instead.

        Reads and writes:
            ``ctx`` is new for each run and resume, so ``ctx.state(self)`` starts empty: what must
            survive a stop has to be rebuilt from ``ctx.transcript`` (as ``loop_detection`` does).
            Messages and settings written here are replaced at the next PreTurn.
        """
        return None

    # -- PreTurn -----------------------------------------------------------------------
    def pre_turn(self, ctx: RunContext) -> Any:
        """Shape the next model call: **PreTurn**, before each model call, in list order.

        By then the driver has handled queued control events (cancel, interrupt, steer), checked
        the budgets, set ``ctx.messages`` to a fresh copy of the transcript and reset
        ``ctx.settings`` (all tools offered, tools enabled, ``max_output_tokens`` at the runtime's
        choice). It also runs again before the one retry after a context-length error
        (``ctx.context_retry`` is then true: trim harder).

        Returns:
            Ignored (``None``).

        Raises:
            StopRun: legal reasons here: PAUSED_BUDGET, WAITING_HUMAN, INTERRUPTED, CANCELLED,
                FAILED_TERMINAL (COMPLETED and FAILED_RETRYABLE fail closed). The run stops
                before the model call; a resume starts at PreTurn again.
            ProviderError: (from ``ctx.call_provider``, say) not covered by the failure policy:
                the run ends FAILED_TERMINAL.

        Reads and writes:
            Write ``ctx.messages`` (the context of this call: trim, repair, redact, summarize;
            the transcript itself stays as it is) and ``ctx.settings`` (``active_tools``,
            ``tools_enabled``, ``max_output_tokens``); later middleware see what earlier ones
            wrote. Replace the plan with ``ctx.update_plan``. Everything else is read-only.

        Not called:
            when a control event or an exhausted budget stops the run first; on a resume that
            goes straight back to the tool calls of a stopped turn (WAITING_HUMAN with decisions,
            INTERRUPTED before the calls started, a crashed worker's MidTurn): those run first,
            and ``pre_turn`` runs before the next model call.
        """
        return None

    # -- Model -------------------------------------------------------------------------
    async def wrap_model_call(self, request: MessageRequest, call_next: ModelCallNext, ctx: RunContext
                              ) -> MessageResponse:
        """Wrap the model call: **Model**, around each logical model call; the first listed is
        the outermost layer.

        Once per logical call, *outside* the provider's own retries (those run per HTTP attempt
        inside ``call_next``), and inside the wall-clock budget (the whole chain is cut when it
        runs out: PAUSED_BUDGET). ``ctx.turn`` already counts this call. The one retry after a
        context-length error is a new logical call (PreTurn runs again first). A layer may call
        ``call_next`` more than once (a retry or fallback plugin); the layers inside it then run
        once per call.

        Args:
            request: the request built from ``ctx.messages`` and ``ctx.settings``; change it with
                ``attrs.evolve`` before passing it on (writing ``ctx.messages`` now changes
                nothing sent).
            call_next: ``await call_next(request)`` runs the inner layers and the provider call
                (streamed events then pass :meth:`on_model_event` and the observers).

        Returns:
            The :class:`~fsm_agent.types.MessageResponse` the turn goes on with: usually
            ``await call_next(request)``, possibly changed, or one made without calling the
            provider (a cache).

        Raises:
            ProviderError: fails the call as the provider's own error would: a context-length
                error gets the one re-trim and retry, a retryable one ends FAILED_RETRYABLE, any
                other FAILED_TERMINAL. Errors from ``call_next`` may be caught and handled.
            StopRun: legal reasons here: PAUSED_BUDGET, INTERRUPTED, CANCELLED, FAILED_RETRYABLE,
                FAILED_TERMINAL (WAITING_HUMAN and COMPLETED fail closed). The response, if any,
                is not kept.

        With ``failure_policy="isolate"``, a failure before ``call_next`` is logged and the call
        passes through to the inner layers; one after it ends the run FAILED_TERMINAL.

        Not called:
            for calls made with ``ctx.call_provider`` (a grader's, a summarizer's): those go
            straight to the provider.
        """
        return await call_next(request)

    def on_model_event(self, event: StreamEvent, ctx: RunContext) -> StreamEvent | tuple[StreamEvent, ...] | None:
        """Filter the stream: **Model**, each event of a streamed model call, in list order,
        before the observers see it (always a plain ``def``: it is on the hot path).

        Called for every streamed call through the runtime: the Model phase's (each time a
        ``wrap_model_call`` layer calls ``call_next``) and those made with ``ctx.call_provider``.

        Returns:
            The event to pass on (the same or a changed one), or ``None`` to hide it from the
            middleware after this one and from the observers, or a tuple of events to pass on in its
            place, in order (each goes through the middleware after this one as if it had streamed;
            ``()`` hides the event like ``None``). A tuple lets a filter that held text back release
            it before the event that ends the text (a block's end, ``MessageComplete``): the
            ``redaction`` plugin does this. What the model answered is not changed by this hook (the
            final response is taken before it): use :meth:`wrap_model_call` for that. What the run
            keeps of a stream cut short (a failed call's ``stop.partial``, an interrupted answer kept
            in the transcript) is the text deltas as the filters passed them on.

        Raises:
            Nothing, by contract. Every exception here, ``StopRun`` included, is a failure of this
            middleware: with ``"propagate"`` the call and the run end FAILED_TERMINAL; with
            ``"isolate"`` the event goes on unchanged.

        Reads and writes:
            Read ``ctx``; write only ``ctx.state(self)``.

        Not called:
            for calls that are not streamed (``RunConfig.stream`` false, or a provider without
            streaming); for the events of a call a ``wrap_model_call`` layer answered itself; for a
            ``ctx.call_provider`` call made in the Model phase from another task than the phase's
            (beside the model call, such as a guardrail's: not the answer).
        """
        return event

    # -- MidTurn -----------------------------------------------------------------------
    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> ToolDecision | None:
        """Decide on a tool call: **MidTurn**, once per proposed call, before any call of the turn
        runs, in list order.

        Returns:
            ``None`` or ``Allow()``: no objection (the next middleware is asked);
            ``Edit(arguments)``: the next middleware and the tool see the new arguments
            (validated against the tool's schema before it runs);
            ``Deny(reason)``: the tool does not run, the model gets an error result naming this
            middleware and the reason (ledger ``rejected``);
            ``Respond(result)``: the tool does not run, the model gets ``result`` (ledger
            ``responded``);
            ``AskApproval(reason)``: the call waits for a person; the run stops WAITING_HUMAN
            (after ``RunConfig.approval_timeout`` seconds of waiting in process, if set) and
            nothing of this turn runs until a resume brings decisions.
            The first Deny, Respond or AskApproval ends the round: later middleware are not asked.

        Raises:
            StopRun: legal reasons here: WAITING_HUMAN, INTERRUPTED, CANCELLED, FAILED_TERMINAL
                (PAUSED_BUDGET, COMPLETED and FAILED_RETRYABLE fail closed). Every call of the turn
                that has no result yet is then closed with a "not run" result. To have a person
                decide on one call, return ``AskApproval`` instead.
            ProviderError: not covered by the failure policy: the run ends FAILED_TERMINAL.

        Reads and writes:
            Read ``ctx`` (``ctx.tool_call_counts`` does not count this turn's calls yet); write
            only ``ctx.state(self)``. Decide from the call and ``ctx``: it may be asked again.

        Not called:
            for a call the ledger already closed (its recorded result is used, the tool never
            runs twice); for a call whose worker died while it ran (its tool's ``on_reconcile``
            or a person settles it, or a pure or idempotent tool runs again); for a call a person
            decided on at resume (approve, edit, reject, respond). It *is* called again on a
            resume for a call still waiting without a decision, and for the calls this
            middleware allowed in a turn that then stopped to wait for a person.
        """
        return None

    async def wrap_tool_call(self, call: ToolUseBlock, call_next: ToolCallNext, ctx: RunContext
                             ) -> ToolResultMessage:
        """Wrap a tool's execution: **MidTurn**, around each call that runs; the first listed is
        the outermost layer.

        The calls of one turn run concurrently, each in its own task (``call_next`` stays in the
        caller's task); their ledger entries say ``started`` before any of them starts. The tool's
        timeout applies inside ``call_next``; a tool's exception comes back as an error result,
        not as an exception.

        Args:
            call: the call as decided (edited arguments included).
            call_next: ``await call_next(call)`` runs the inner layers and the tool.

        Returns:
            The :class:`~fsm_agent.types.ToolResultMessage` the model gets (usually
            ``await call_next(call)``, possibly changed); an error result is recorded ``failed``,
            any other ``completed``.

        Raises:
            StopRun: legal reasons here: WAITING_HUMAN, INTERRUPTED, CANCELLED, FAILED_TERMINAL
                (others fail closed). The turn's other calls are cancelled; every call gets its
                result: the real one if it finished, "outcome unknown" if it was cut while
                running.
            ProviderError: not covered by the failure policy: the run ends FAILED_TERMINAL.

        With ``failure_policy="isolate"``, a failure before ``call_next`` is logged and the call
        passes through to the inner layers; one after it (the tool may have run) ends the run
        FAILED_TERMINAL.

        Reads and writes:
            Read ``ctx``; write only ``ctx.state(self)`` (shared by the concurrent calls).

        Not called:
            for calls that do not run: denied or answered by ``on_tool_call``, rejected or
            answered by a person, waiting for approval, closed by the ledger, or settled by their
            tool's ``on_reconcile``.
        """
        return await call_next(call)

    # -- PostTurn ----------------------------------------------------------------------
    def post_turn(self, ctx: RunContext) -> TurnDecision | None:
        """Judge the turn: **PostTurn**, after every turn that got this far (a turn with tool
        calls included: their results are in the transcript), in reverse list order.

        With an output schema, the answer is checked first (a mismatch gets one repair turn).

        Returns:
            ``None``: no opinion (the next middleware is asked); with none at all, the run
            completes when the model ended its turn without tool calls and goes on otherwise.
            ``Continue(message=None, reason)``: another turn (``message``, e.g. a verifier's
            feedback, is appended to the transcript first).
            ``Complete(evidence, detail)``: the run ends COMPLETED with ``evidence`` in the stop
            (unless the user queued a followup: it runs first).
            The first decision wins: middleware listed earlier are not asked.

        Raises:
            StopRun: legal reasons here: COMPLETED, WAITING_HUMAN, INTERRUPTED, CANCELLED,
                FAILED_TERMINAL (PAUSED_BUDGET and FAILED_RETRYABLE fail closed: check budgets in
                ``pre_turn``).
            ProviderError: (a grader's call through ``ctx.call_provider``) not covered by the
                failure policy: the run ends FAILED_TERMINAL.

        Reads and writes:
            Read ``ctx`` (``ctx.last_response``, ``ctx.transcript``, ``ctx.plan``); make model calls
            with ``ctx.call_provider(..., account=True)``; write only ``ctx.state(self)`` and the
            plan (``ctx.update_plan``).

        Not called:
            when the run stopped earlier in the turn (in Model or MidTurn, or waiting for a
            person); when the answer broke the output schema (repair turn or stop); before the
            retry after a context-length error.
        """
        return None

    # -- lifecycle, the end ------------------------------------------------------------
    def on_run_end(self, ctx: RunContext, result: RunResult) -> Any:
        """Tear down: once per run or resume, after the run reached its stop (and it was recorded,
        unless the store failed), in reverse list order, with the
        :class:`~fsm_agent.types.RunResult`.

        Returns:
            Ignored.

        Raises:
            Nothing that matters: the run has ended; a failure or a ``StopRun`` is logged and the
            result stands.

        Reads and writes:
            Read ``ctx`` and ``result``; events queued with ``ctx.emit`` are still delivered.

        Not called:
            when the task running ``run`` / ``resume`` was cancelled (INTERRUPTED is recorded and
            ``CancelledError`` goes on), when another worker took the session's lease, or when
            :meth:`on_run_start` raised.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


HOOKS: tuple[str, ...] = (
    "pre_turn",
    "wrap_model_call",
    "on_model_event",
    "on_tool_call",
    "wrap_tool_call",
    "post_turn",
    "on_run_start",
    "on_run_end",
)
"""Every hook name, in phase order."""
ASYNC_ONLY: frozenset[str] = frozenset({"wrap_model_call", "wrap_tool_call"})
"""Hooks that must be ``async def`` (they await ``call_next``)."""
SYNC_ONLY: frozenset[str] = frozenset({"on_model_event"})
"""Hooks that must be plain ``def`` (they run per streamed event, on the hot path)."""
