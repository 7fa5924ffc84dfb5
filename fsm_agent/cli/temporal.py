"""``--temporal HOST:PORT``: the commands against sessions that run on Temporal.

* ``worker --temporal HOST:PORT --agent MODULE:ATTR``: serve the agent's sessions (workflow and
  activities) until SIGTERM / SIGINT;
* ``run --temporal HOST:PORT --agent MODULE:ATTR TASK``: start a session on it, print the same lines
  as a local run;
* ``resume``, ``control``: through the session's workflow (an Update, a signal);
* ``sessions show``: the store's view plus the workflow's snapshot.

The agent names itself by its ``MODULE:ATTR``: a worker serves it under that name, and the starter
names it so. Both build it from the same code; the session store (the agent's own, or ``--store``)
is the one the review page and ``sessions show`` read.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import uuid
from typing import Any, TextIO

import orjson

from ..errors import ConfigurationError

__all__ = ["add_temporal_flags", "connect", "host_of", "temporal_control", "temporal_resume", "temporal_run",
           "temporal_snapshot", "temporal_worker"]


def add_temporal_flags(p: argparse.ArgumentParser) -> None:
    """``--temporal``, ``--namespace``, ``--task-queue`` on ``p`` (the commands' common parent)."""
    p.add_argument("--temporal", metavar="HOST:PORT",
                   help="run on Temporal at HOST:PORT ($FSM_AGENT_TEMPORAL): sessions are workflows")
    p.add_argument("--namespace", default=None, help="Temporal namespace (default: default)")
    p.add_argument("--task-queue", default=None, help="Temporal task queue (default: fsm-agent)")


def target_of(args: argparse.Namespace) -> str | None:
    """The Temporal address the command was given (flag, else ``$FSM_AGENT_TEMPORAL``), or ``None``."""
    return getattr(args, "temporal", None) or os.environ.get("FSM_AGENT_TEMPORAL") or None


async def connect(args: argparse.Namespace) -> Any:
    """A Temporal client for the command.

    Raises:
        ConfigurationError: the ``temporal`` extra is missing, or nothing answers at the address.
    """
    try:
        from temporalio.client import Client
    except ImportError as exc:
        raise ConfigurationError("--temporal needs the temporal extra: pip install 'fsm-agent[temporal]'") from exc
    target = target_of(args)
    interceptors: list[Any] = []
    if getattr(args, "otel", False):  # one trace across the client, the workflow and its activities
        from temporalio.contrib.opentelemetry import TracingInterceptor

        interceptors.append(TracingInterceptor())
    try:
        return await Client.connect(target, namespace=args.namespace or "default", interceptors=interceptors)
    except Exception as exc:  # noqa: BLE001 - any failure to reach the cluster is a setup problem
        raise ConfigurationError(f"--temporal {target}: cannot connect ({exc}); is the cluster (or "
                                 "`temporal server start-dev`) running there?") from exc


def _agent(args: argparse.Namespace) -> Any:
    from .agent_ref import load_agent

    if not getattr(args, "agent", None):
        raise ConfigurationError("--temporal needs --agent MODULE:ATTR (the agent the workers serve)")
    agent = load_agent(args.agent)
    if getattr(args, "store", None):
        from .factory import open_store

        agent.store = open_store(args.store)
    return agent


def host_of(agent: Any, client: Any, args: argparse.Namespace) -> Any:
    """``agent``'s :class:`~fsm_agent.temporal.TemporalHost` for the command's address and queue."""
    from ..temporal import DEFAULT_TASK_QUEUE, TemporalHost

    return TemporalHost(client, agent_name=args.agent, task_queue=args.task_queue or DEFAULT_TASK_QUEUE,
                        store=agent.store)


def _live_deltas(agent: Any, args: argparse.Namespace) -> Any:
    """With a PostgreSQL store (and no ``--no-live-deltas``), the agent's model deltas are published
    to every server replica (:meth:`~fsm_agent.server.queue.PgLiveDeltas.attach`, model deltas
    only: the machine runs in the workflow); returns the publisher, else ``None``."""
    from ..store.postgres import PostgresStore

    if getattr(args, "no_live_deltas", False) or not isinstance(agent.store, PostgresStore):
        return None
    from ..server.queue import PgLiveDeltas

    return PgLiveDeltas.attach(agent, states=False)


EXIT_HARD = [False]
"""Set once a Temporal worker stopped cleanly: the console script then ends the process with
``os._exit`` after flushing, because the Temporal SDK's Rust core threads can crash the
interpreter's finalization (SIGABRT/SIGSEGV in ``PyGILState_Release``, temporalio/sdk-python#300),
which would turn a clean stop into a failed exit."""


def temporal_worker(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``fsm-agent worker --temporal``: serve the agent's sessions until SIGTERM or SIGINT (exit 0).
    With a PostgreSQL store, the model calls' streaming deltas are published live to the servers'
    event streams (``NOTIFY fsm_live``; not with ``--no-live-deltas``), never to the workflow's history."""

    async def serve() -> int:
        from ..temporal import DEFAULT_TASK_QUEUE, create_worker

        agent = _agent(args)
        client = await connect(args)
        queue = args.task_queue or DEFAULT_TASK_QUEUE
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        live = _live_deltas(agent, args)
        try:
            async with create_worker(client, {args.agent: agent}, task_queue=queue,
                                     max_concurrent_activities=max(4, int(getattr(args, "concurrency", 4)) * 4)):
                also = "; live deltas by PostgreSQL NOTIFY" if live is not None else ""
                err.write(f"fsm-agent: worker serving {args.agent} on Temporal {target_of(args)} "
                          f"(task queue {queue}{also})\n")
                err.flush()
                await stop.wait()
        finally:
            if live is not None:
                await live.aclose()
        return 0

    code = asyncio.run(serve())
    EXIT_HARD[0] = True
    return code


async def temporal_run(args: argparse.Namespace, out: TextIO, err: TextIO) -> Any:
    """``fsm-agent run --temporal``: start the session, wait for its stop; returns the result."""
    agent = _agent(args)
    client = await connect(args)
    agent.host = host_of(agent, client, args)
    session_id = args.session_id or uuid.uuid4().hex
    err.write(f"fsm-agent: session {session_id} (on Temporal {target_of(args)})\n")
    result = await agent.run(args.task, session_id=session_id)
    if not args.json and result.output:
        out.write(result.output + "\n")
    return result


async def temporal_resume(args: argparse.Namespace, decisions: dict[str, Any], limits: dict[str, Any], out: TextIO,
                          err: TextIO) -> Any:
    """``fsm-agent resume --temporal``: resume through the session's workflow; returns the result."""
    agent = _agent(args)
    client = await connect(args)
    agent.host = host_of(agent, client, args)
    result = await agent.resume(args.session_id, decisions=decisions, confirm_cancel=args.confirm_cancel, **limits)
    if not args.json and result.output:
        out.write(result.output + "\n")
    return result


async def temporal_control(args: argparse.Namespace, control: Any, err: TextIO) -> int:
    """``fsm-agent control --temporal``: a signal to the session's workflow."""
    from ..temporal import DEFAULT_TASK_QUEUE, TemporalHost

    client = await connect(args)
    host = TemporalHost(client, agent_name=getattr(args, "agent", None) or "",
                        task_queue=args.task_queue or DEFAULT_TASK_QUEUE)
    await host.control(args.session_id, control)
    err.write(f"sent {args.kind} to the workflow of session {args.session_id}\n")
    return 0


async def temporal_snapshot(args: argparse.Namespace, out: TextIO) -> None:
    """``sessions show --temporal``: the workflow's status and snapshot, after the store's view."""
    from ..temporal import DEFAULT_TASK_QUEUE, TemporalHost

    client = await connect(args)
    host = TemporalHost(client, agent_name="", task_queue=args.task_queue or DEFAULT_TASK_QUEUE)
    handle = host.handle(args.session_id)
    try:
        desc = await handle.describe()
        status = desc.status.name if desc.status is not None else "UNKNOWN"
        snap = await host.snapshot(args.session_id) if status == "RUNNING" else None
    except Exception as exc:  # noqa: BLE001 - no workflow (never started there, or retention passed)
        out.write(f"workflow: none on {target_of(args)} ({type(exc).__name__})\n")
        return
    out.write(f"workflow: {status} on {target_of(args)}\n")
    if snap is not None:
        out.write("snapshot: " + orjson.dumps(snap).decode() + "\n")
