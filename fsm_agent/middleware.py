"""The middleware contract: what a policy plugin may do at each phase.

Subclass :class:`Middleware` and override only the hooks you need; the
others are pass-through and the chain skips them. Hooks may be ``def`` or
``async def`` (checked when the chain is built, with the plugin's name in
any error).

Phases and hooks (placement is part of the contract):

``pre_turn(ctx)`` — **PreTurn**, before each model call, in list order.
    Read or rewrite ``ctx.messages`` (the context of this call; the
    transcript itself is ``ctx.transcript``). Return ``None``. Raise
    :class:`~fsm_agent.errors.StopRun` to end the run (PAUSED_BUDGET,
    WAITING_HUMAN, CANCELLED, INTERRUPTED, FAILED_TERMINAL).

``wrap_model_call(request, call_next, ctx)`` — **Model**, around the provider
    call, once per logical call and outside the provider's own retries
    (those run once per HTTP attempt inside ``call_next``). First listed is
    outermost. Return a :class:`~fsm_agent.types.MessageResponse` (usually
    ``await call_next(request)``, possibly with a changed request or
    response); raise a :class:`~fsm_agent.errors.ProviderError` to fail the
    call; raise ``StopRun`` to end the run.

``on_model_event(event, ctx)`` — **Model**, each stream event before
    observers see it, in list order. Return the event (changed or not), or
    ``None`` to hide it from observers. It cannot change the final response
    (use ``wrap_model_call``).

``on_tool_call(call, ctx)`` — **MidTurn**, once per proposed tool call,
    before execution, in list order. Return ``None`` (no objection) or a
    :class:`ToolDecision`: ``Allow()``, ``Deny(reason)`` (the model sees an
    error result with the reason), ``AskApproval(reason)`` (the run stops in
    WAITING_HUMAN with the call pending), ``Edit(arguments)`` (later
    middleware and the tool see the new arguments, validated against the
    schema), or ``Respond(result)`` (the call is answered without running
    the tool). The first Deny / AskApproval / Respond wins.

``wrap_tool_call(call, call_next, ctx)`` — **MidTurn**, around one tool's
    execution; first listed is outermost. Return a
    :class:`~fsm_agent.types.ToolResultMessage`.

``post_turn(ctx)`` — **PostTurn**, after each turn, in reverse list order
    ("after" hooks unwind). Return ``None`` (no opinion) or a
    :class:`TurnDecision`: ``Continue(message=None)`` (go on; an optional
    user message is appended, e.g. a verifier's feedback), ``Complete(evidence)``,
    or raise ``StopRun``. The first decision returned wins; with none, the run
    completes when the model ended its turn without tool calls and continues
    otherwise.

``on_run_start(ctx)`` / ``on_run_end(ctx, result)`` — once per run (and per
    resume), in list / reverse order: set up and tear down run-scoped state
    (``ctx.state(self)`` is a dict private to this middleware and this run).

Failure policy: a hook that raises (anything but ``StopRun`` or a
``ProviderError`` from ``wrap_model_call``) ends the run FAILED_TERMINAL when
``failure_policy`` is ``"propagate"`` (fail closed, the default: a broken
policy must not let actions through), or is logged and skipped when it is
``"isolate"``.
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
    from .machine.context import RunContext
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


@frozen
class Ordering:
    """Declarative placement in the chain (resolved once, when the chain is built).

    ``position``: ``"outermost"`` or ``"innermost"`` pins the middleware to an
    end (list order breaks ties among several). ``wraps``: names this one must
    sit outside of. ``wrapped_by``: names that must sit outside this one.
    ``requires``: names that must be present. Unknown names in ``wraps`` /
    ``wrapped_by`` are ignored (the other plugin is optional); a missing
    requirement or a cycle is a :class:`~fsm_agent.errors.ChainError`.
    """

    position: str | None = None
    wraps: tuple[str, ...] = field(default=(), converter=_tuple)
    wrapped_by: tuple[str, ...] = field(default=(), converter=_tuple)
    requires: tuple[str, ...] = field(default=(), converter=_tuple)


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
    """

    name: ClassVar[str] = ""
    ordering: ClassVar[Ordering] = Ordering()
    failure_policy: ClassVar[FailurePolicy | str] = FailurePolicy.PROPAGATE

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if not cls.__dict__.get("name"):
            cls.name = cls.__name__

    @property
    def middleware_name(self) -> str:
        return self.name or type(self).__name__

    # PreTurn
    def pre_turn(self, ctx: RunContext) -> Any:
        return None

    # Model
    async def wrap_model_call(self, request: MessageRequest, call_next: ModelCallNext, ctx: RunContext) -> MessageResponse:
        return await call_next(request)

    def on_model_event(self, event: StreamEvent, ctx: RunContext) -> StreamEvent | None:
        return event

    # MidTurn
    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> ToolDecision | None:
        return None

    async def wrap_tool_call(self, call: ToolUseBlock, call_next: ToolCallNext, ctx: RunContext) -> ToolResultMessage:
        return await call_next(call)

    # PostTurn
    def post_turn(self, ctx: RunContext) -> TurnDecision | None:
        return None

    # lifecycle
    def on_run_start(self, ctx: RunContext) -> Any:
        return None

    def on_run_end(self, ctx: RunContext, result: RunResult) -> Any:
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
