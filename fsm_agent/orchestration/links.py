"""Parent/child links between sessions: the one place every orchestration pattern (an agent as a
tool, a handoff, a leader's workers, a remote A2A task) records which session started which.

A link lives in the store (``session_links`` table, :class:`~fsm_agent.store.SessionLink`), is
written **before** the child starts and never changes, so a parent resumed after a crash finds
the child it had started (and a child can always name its parent)::

    link = await link_child(store, parent_id, child_id, "agent_tool", call_id="call_1",
                            metadata={"tool": "researcher"})      # once; the same link again is a no-op
    await store.children(parent_id)                               # [SessionLink, ...], oldest first
    await store.parent(child_id)                                  # SessionLink | None
    tree = await session_tree(store, root_id)                     # SessionNode: record, link, children

:func:`child_session_id` derives a child's id from the parent's tool call (its idempotency key),
so the same call always names the same child, across resumes and workers. (What ``fsm-agent
sessions show`` prints of a tree is in :mod:`fsm_agent.orchestration.show`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import frozen

from ..errors import SessionLinkError
from ..store.base import SessionLink, SessionRecord, Store
from ..tools.execution import idempotency_key
from ..tools.registry import ToolContext

__all__ = ["SessionNode", "child_session_id", "claim_child", "link_child", "session_tree"]

MAX_DEPTH = 32
"""Deepest tree :func:`session_tree` walks (a deeper one is cut there, marked ``truncated``), and
the longest chain of parents :func:`link_child` follows to refuse a cycle."""


def child_session_id(ctx: ToolContext | tuple[str, str], name: str) -> str:
    """The id of the child session a tool call starts: ``"<name>-<20 hex digits of the call's
    idempotency key>"``. ``ctx``: the call's :class:`ToolContext`, or its ``(session id, call id)``.
    The same call (same parent session, same call id) gives the same id on every resume and every
    worker; two calls never share one. (The one formula of every pattern: a team's worker ``i`` is
    ``child_session_id(ctx, f"worker{i}")``.)"""
    key = ctx.idempotency_key if isinstance(ctx, ToolContext) else idempotency_key(*ctx)
    return f"{name}-{key[:20]}"


async def link_child(store: Store, parent_id: str, child_id: str, kind: str, *, call_id: str | None = None,
                     metadata: Mapping[str, Any] | None = None) -> SessionLink:
    """Record that ``parent_id`` started ``child_id`` (``kind``: a
    :class:`~fsm_agent.store.LinkKind` value or another name), unless that link exists already.

    Idempotent: linking the same child to the same parent (and call) again returns the stored link.

    Returns:
        the stored link (the earlier one when the child was linked before).

    Raises:
        SessionLinkError: ``child_id`` is linked to another parent, or to another call of this one
            (two starts would share one child session); or it is ``parent_id`` itself or one of its
            ancestors (the link would close a cycle).
        KeyError: ``parent_id`` is no session of ``store``.
        ValueError: an empty id or kind, or a session as its own parent.
        StoreError: the store could not be read or written.
    """
    return (await claim_child(store, parent_id, child_id, kind, call_id=call_id, metadata=metadata))[0]


async def claim_child(store: Store, parent_id: str, child_id: str, kind: str, *, call_id: str | None = None,
                      metadata: Mapping[str, Any] | None = None) -> tuple[SessionLink, bool]:
    """:func:`link_child`, also saying whether this call wrote the link (``True``) or found it
    (``False``): a child session that exists although its link is new was not started by this
    parent's call.

    Raises:
        SessionLinkError, KeyError, ValueError, StoreError: as :func:`link_child`.
    """
    wanted = SessionLink(child_id, parent_id, kind, call_id, dict(metadata or {}))
    known = await store.parent(child_id)
    if known is None:
        await _refuse_cycle(store, parent_id, child_id)
    stored, created = await store.link_session(wanted)
    if (stored.parent_id, stored.call_id) != (parent_id, call_id):
        by = f" by call {stored.call_id}" if stored.call_id else ""
        raise SessionLinkError(
            f"session {child_id!r} was started by session {stored.parent_id!r}{by} ({stored.kind}); it cannot also "
            f"be the child of session {parent_id!r}" + (f" by call {call_id}" if call_id else "")
            + ": give this child another session id")
    return stored, created


async def _refuse_cycle(store: Store, parent_id: str, child_id: str) -> None:
    """Raise :class:`SessionLinkError` when ``child_id`` is ``parent_id``'s ancestor."""
    sid, seen = parent_id, {parent_id}
    for _ in range(MAX_DEPTH * 4):
        up = await store.parent(sid)
        if up is None:
            return
        if up.parent_id == child_id:
            raise SessionLinkError(f"session {child_id!r} is an ancestor of session {parent_id!r}: linking it as "
                                   "its child would close a cycle")
        if up.parent_id in seen:
            return  # a loop written by hand above: not this link's doing
        seen.add(up.parent_id)
        sid = up.parent_id


@frozen
class SessionNode:
    """One session of a tree of linked sessions (:func:`session_tree`)."""

    session_id: str
    record: SessionRecord | None
    """The session's row; ``None`` when it is no session of this store (a remote task, or a child
    linked but not started)."""
    link: SessionLink | None
    """Its link to its parent; ``None`` at the root when it has no parent."""
    children: tuple[SessionNode, ...] = ()
    truncated: bool = False
    """The walk stopped here (:data:`MAX_DEPTH`, or a link loop written by hand)."""

    @property
    def state(self) -> str:
        """The session's state (a phase or a StopReason), ``remote`` for a remote task, ``not started``."""
        if self.record is not None:
            return self.record.state
        return "remote" if self.link is not None and self.link.kind == "remote" else "not started"


async def session_tree(store: Store, session_id: str, *, depth: int = MAX_DEPTH) -> SessionNode:
    """``session_id`` with its descendants (each parent's children oldest first).

    Raises:
        StoreError: the store could not be read.
    """
    seen: set[str] = set()

    async def node(sid: str, link: SessionLink | None, left: int) -> SessionNode:
        seen.add(sid)
        record = await store.get_session(sid)
        links = await store.children(sid)
        if left <= 0:
            return SessionNode(sid, record, link, (), truncated=bool(links))
        fresh = [x for x in links if x.child_id not in seen]  # a link loop written by hand is cut where it closes
        seen.update(x.child_id for x in fresh)
        kids = [await node(x.child_id, x, left - 1) for x in fresh]
        return SessionNode(sid, record, link, tuple(kids), truncated=len(fresh) < len(links))

    return await node(session_id, await store.parent(session_id), depth)
