"""Child sessions as workflows of their own: what a worker's tool activity gives
:mod:`fsm_agent.orchestration` (``CHILD_HOSTS``), so that a sub-agent a tool starts runs as its own
``fsm_agent.Session`` workflow (id: the child session's id) on the worker's client and task queue,
served under the name :func:`fsm_agent.temporal.register` derived for it (``parent/tool``).

The tool's body runs in an activity, and only workflow code can start a Temporal child workflow:
the child's workflow is an independent one, linked to its parent by the store's session links and
its memo (``{"child_of": {"session": parent id, "call": call id}}``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from temporalio.client import Client

from ..orchestration._child import CHILD_HOSTS, CHILD_OF
from .host import TemporalHost
from .registry import name_of

if TYPE_CHECKING:
    from ..agent import Agent

__all__ = ["WorkerChildHosts", "children_as_workflows"]


class WorkerChildHosts:
    """Child sessions of agents this process serves (:func:`~fsm_agent.temporal.registry.name_of`)
    run as workflows on ``client`` / ``task_queue``; others run in process, as before."""

    def __init__(self, client: Client, task_queue: str) -> None:
        self.client = client
        self.task_queue = task_queue

    def host_for(self, agent: Agent, *, parent_id: str, call_id: str | None) -> TemporalHost | None:
        name = name_of(agent)
        if name is None:
            return None
        return TemporalHost(self.client, agent_name=name, task_queue=self.task_queue, store=agent.store,
                            memo={CHILD_OF: {"session": parent_id, "call": call_id}})


@contextmanager
def children_as_workflows(client: Client, task_queue: str) -> Iterator[None]:
    """Within the block, child sessions started by tools run as workflows (see the module doc)."""
    token = CHILD_HOSTS.set(WorkerChildHosts(client, task_queue))
    try:
        yield
    finally:
        CHILD_HOSTS.reset(token)


