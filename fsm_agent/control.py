"""LoopControl (seed 004 §2) and human decisions: what the outside world can say to a run.

Control events come from outside the model: ``Steer`` (change direction, keep verified facts,
re-plan), ``Followup`` (queued until the current task is done), ``Interrupt`` (stop now, even
mid-stream; state frozen and resumable), ``Cancel`` (end the task; compensate side effects or
have a person confirm them). They are queued in the session's store, so they can come from
another thread, process or host, and are consumed by the driving worker at safe points
(Interrupt and Cancel also mid-phase).

Two more control events change a session's permissions (:mod:`fsm_agent.permissions`):
``Restrict`` narrows them at once (at the next PreTurn, or before the next tool call), and
``RequestPermissions`` asks to widen them: the run stops WAITING_HUMAN until a person approves
(or rejects) the request; neither the model nor a plugin can send either.

A :class:`Decision` answers a pending tool call of a WAITING_HUMAN run: approve, edit (new
arguments, validated against the tool's schema), reject (with a message the model sees), or
respond (a person gives the result instead of the tool).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from attrs import field, frozen

from .permissions import Permissions, Restriction

__all__ = ["Cancel", "Decision", "Followup", "Interrupt", "LoopControl", "RequestPermissions", "Restrict", "Steer"]


@frozen
class Steer:
    """New direction for the current task: appended as a user message at the next PreTurn."""

    text: str


@frozen
class Followup:
    """A further request, run after the current task would complete (not mixed into it)."""

    text: str


@frozen
class Interrupt:
    """Stop now (mid-stream or mid-tool too); the run ends INTERRUPTED and can be resumed."""

    reason: str = "interrupted by the user"


@frozen
class Cancel:
    """End the task (CANCELLED). Completed side-effect calls are compensated by their tool's
    compensation hook, or a person is asked to confirm them first (WAITING_HUMAN)."""

    reason: str = "cancelled by the user"


@frozen
class Restrict:
    """Narrow the session's permissions: every later tool call must also keep to ``restriction``
    (a :class:`~fsm_agent.permissions.Restriction`, or :class:`~fsm_agent.permissions.Permissions`
    whose tools and scopes become one). Applied at the next PreTurn, or before the next tool call
    runs, whichever comes first; a permission request still waiting is narrowed too. It can never
    widen them."""

    restriction: Restriction | Permissions
    reason: str = ""


@frozen
class RequestPermissions:
    """Ask to widen the session's permissions to ``permissions`` (what they become, whole). At the
    next PreTurn the run stops WAITING_HUMAN with the request pending (``call.name``
    ``request_permissions``, decisions ``approve`` or ``reject``); a person's approval applies it,
    a rejection leaves the permissions as they are. A newer request replaces one still waiting."""

    permissions: Permissions
    reason: str = ""


LoopControl = Union[Steer, Followup, Interrupt, Cancel, Restrict, RequestPermissions]


@frozen
class Decision:
    """A person's answer to one pending tool call.

    Build with :meth:`approve`, :meth:`edit`, :meth:`reject` or :meth:`respond`.
    """

    kind: Literal["approve", "edit", "reject", "respond"]
    arguments: dict[str, Any] | None = None
    """For ``edit``: the new arguments (validated against the tool's schema before it runs)."""
    message: str = ""
    """For ``reject``: what the model is told; for ``respond``: the result text."""
    is_error: bool = field(default=False)
    """For ``respond``: whether the given result reports a failure."""

    @classmethod
    def approve(cls) -> Decision:
        return cls("approve")

    @classmethod
    def edit(cls, arguments: dict[str, Any]) -> Decision:
        return cls("edit", dict(arguments))

    @classmethod
    def reject(cls, message: str = "rejected by a person") -> Decision:
        return cls("reject", message=message)

    @classmethod
    def respond(cls, result: str, *, is_error: bool = False) -> Decision:
        return cls("respond", message=result, is_error=is_error)
