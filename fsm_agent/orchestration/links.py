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
so the same call always names the same child, across resumes and workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import frozen

from ..errors import SessionLinkError
from ..store.base import SessionLink, SessionRecord, Store
from ..tools.registry import ToolContext

__all__ = ["SessionNode", "child_session_id", "link_child", "link_lines", "session_tree"]

MAX_DEPTH = 32
"""Deepest tree :func:`session_tree` walks (a deeper one is cut there, marked ``truncated``)."""


def child_session_id(ctx: ToolContext, name: str) -> str:
    """The id of the child session a tool call starts: ``"<name>-<20 hex digits of the call's
    idempotency key>"``. The same call (same parent session, same call id) gives the same id on
    every resume and every worker; two calls never share one."""
    return f"{name}-{ctx.idempotency_key[:20]}"


async def link_child(store: Store, parent_id: str, child_id: str, kind: str, *, call_id: str | None = None,
                     metadata: Mapping[str, Any] | None = None) -> SessionLink:
    """Record that ``parent_id`` started ``child_id`` (``kind``: a
    :class:`~fsm_agent.store.LinkKind` value or another name), unless that link exists already.

    Idempotent: linking the same child to the same parent (and call) again returns the stored link.

    Returns:
        the stored link (the earlier one when the child was linked before).

    Raises:
        SessionLinkError: ``child_id`` is linked to another parent, or to another call of this one
            (two starts would share one child session).
        KeyError: ``parent_id`` is no session of ``store``.
        ValueError: an empty id or kind, or a session as its own parent.
        StoreError: the store could not be read or written.
    """
    wanted = SessionLink(child_id, parent_id, kind, call_id, dict(metadata or {}))
    stored, _created = await store.link_session(wanted)
    if (stored.parent_id, stored.call_id) != (parent_id, call_id):
        by = f" by call {stored.call_id}" if stored.call_id else ""
        raise SessionLinkError(
            f"session {child_id!r} was started by session {stored.parent_id!r}{by} ({stored.kind}); it cannot also "
            f"be the child of session {parent_id!r}" + (f" by call {call_id}" if call_id else "")
            + ": give this child another session id")
    return stored


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
        if left <= 0 or any(x.child_id in seen for x in links):
            return SessionNode(sid, record, link, (), truncated=bool(links))
        kids = [await node(x.child_id, x, left - 1) for x in links]
        return SessionNode(sid, record, link, tuple(kids))

    return await node(session_id, await store.parent(session_id), depth)


async def link_lines(store: Store, session_id: str) -> list[str]:
    """Human-readable lines for ``fsm-agent sessions show``: the session's parent, then its
    descendants as an indented tree (``id  kind  [call]  state  goal``). Empty for a session with
    neither parent nor children.

    Raises:
        StoreError: the store could not be read.
    """
    lines: list[str] = []
    parent = await store.parent(session_id)
    if parent is not None:
        call = f" by call {parent.call_id}" if parent.call_id else ""
        lines.append(f"parent: {parent.parent_id} ({parent.kind}{call})")
    tree = await session_tree(store, session_id)

    def walk(n: SessionNode, indent: int) -> None:
        for kid in n.children:
            assert kid.link is not None
            call = f" [{kid.link.call_id}]" if kid.link.call_id else ""
            goal = (kid.record.goal if kid.record is not None else "").replace("\n", " ")
            goal = goal if len(goal) <= 60 else goal[:57] + "..."
            more = " ..." if kid.truncated else ""
            lines.append(f"{'  ' * indent}{kid.session_id}  {kid.link.kind}{call}  {kid.state}  {goal}{more}".rstrip())
            walk(kid, indent + 1)

    if tree.children:
        lines.append("children:")
        walk(tree, 1)
    return lines
