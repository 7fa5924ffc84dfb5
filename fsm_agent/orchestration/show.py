"""What ``fsm-agent sessions show`` prints about a session's links: its parent and the tree of
sessions below it, as text lines (:func:`link_lines`) and as JSON data (:func:`tree_data`). The
store API the rendering reads is :mod:`fsm_agent.orchestration.links`."""

from __future__ import annotations

from typing import Any

from ..store.base import Store
from ..types.codec import unstructure
from ..types.plan import one_line
from .links import SessionNode, session_tree

__all__ = ["link_lines", "tree_data"]


async def link_lines(store: Store, session_id: str) -> list[str]:
    """Human-readable lines for ``fsm-agent sessions show``: the session's parent, then its
    descendants as an indented tree (``id  kind  [call]  state  goal``; `` ...`` marks a node whose
    children were cut: too deep, or a link loop). Empty for a session with neither parent nor
    children. Every text is one printable line.

    Raises:
        StoreError: the store could not be read.
    """
    lines: list[str] = []
    parent = await store.parent(session_id)
    if parent is not None:
        call = f" by call {one_line(parent.call_id)}" if parent.call_id else ""
        lines.append(f"parent: {one_line(parent.parent_id)} ({one_line(parent.kind)}{call})")
    tree = await session_tree(store, session_id)

    def walk(n: SessionNode, indent: int) -> None:
        for kid in n.children:
            assert kid.link is not None
            call = f" [{one_line(kid.link.call_id)}]" if kid.link.call_id else ""
            goal = one_line(kid.record.goal if kid.record is not None else "", 60)
            more = " ..." if kid.truncated else ""
            lines.append(f"{'  ' * indent}{one_line(kid.session_id)}  {one_line(kid.link.kind)}{call}  {kid.state}  "
                         f"{goal}{more}".rstrip())
            walk(kid, indent + 1)

    if tree.children:
        lines.append("children:")
        walk(tree, 1)
    return lines


def tree_data(node: SessionNode) -> dict[str, Any]:
    """A :class:`SessionNode` as JSON-safe data (``sessions show --json``'s ``tree``): ``session_id``,
    ``state``, ``goal``, ``link`` (its link to its parent, or ``None``), ``truncated`` and
    ``children`` (the same, nested)."""
    return {"session_id": node.session_id, "state": node.state,
            "goal": node.record.goal if node.record is not None else None,
            "link": unstructure(node.link) if node.link is not None else None, "truncated": node.truncated,
            "children": [tree_data(k) for k in node.children]}
