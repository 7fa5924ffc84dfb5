"""``fsm-agent worker``: carry out queued runs from PostgreSQL (:class:`fsm_agent.server.worker.Worker`),
or, with ``--temporal``, serve the session workflows and their activities on Temporal."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from typing import Any, TextIO

from ..agent import Agent
from ..errors import ConfigurationError
from ..server.worker import Worker
from ..store.postgres import PostgresStore
from .agent_ref import load_agent

__all__ = ["add_worker_command", "worker_command"]


# -----------------------------------------------------------------------------
def add_worker_command(subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """Add ``worker`` to the ``fsm-agent`` subcommands; its handler is ``args.handler(args, out, err)``.

    ``parents``: parent parsers (``add_help=False``) whose flags ``worker`` shares with other commands."""
    w = subparsers.add_parser("worker", parents=list(parents),
                              help="carry out queued runs (PostgreSQL) until SIGTERM/SIGINT")
    w.add_argument("--store", help="postgresql:// DSN of the sessions and the run queue ($FSM_AGENT_STORE)")
    w.add_argument("--agent", required=True, metavar="MODULE:ATTR",
                   help="the Agent to drive runs with (an Agent, or a callable returning one)")
    w.add_argument("--concurrency", type=int, default=4, help="runs at once (default 4)")
    w.add_argument("--poll", type=float, default=1.0, help="seconds between queue polls (default 1)")
    w.add_argument("--no-live-deltas", action="store_true", help="do not publish model-stream deltas live")
    w.set_defaults(handler=worker_command)
    return w  # type: ignore[no-any-return]


def worker_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``fsm-agent worker``: returns the exit code (0 after a clean stop).

    The first SIGTERM or SIGINT stops claiming and interrupts the runs in progress (each ends
    INTERRUPTED, resumable, and its job goes back to the queue for another worker); a second one
    cancels what is left.

    Raises:
        ConfigurationError: a bad ``--store``, ``--agent`` or number.
    """
    from .temporal import target_of, temporal_worker

    if target_of(args):  # a Temporal worker: the session workflows and their activities, any store
        return temporal_worker(args, out, err)
    args.store = args.store or os.environ.get("FSM_AGENT_STORE") or ""
    if not args.store.startswith(("postgresql://", "postgres://")):
        raise ConfigurationError(f"--store {args.store!r}: a worker needs a postgresql:// DSN (or $FSM_AGENT_STORE)")
    if args.concurrency < 1:
        raise ConfigurationError(f"--concurrency must be >= 1, not {args.concurrency}")
    if not args.poll > 0:
        raise ConfigurationError(f"--poll must be > 0, not {args.poll}")
    agent = load_agent(args.agent)
    return asyncio.run(_serve(agent, args, out, err))


async def _serve(agent: Agent, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    store = PostgresStore(args.store, max_size=max(4, args.concurrency + 2))
    worker = Worker(agent, store, concurrency=args.concurrency, poll=args.poll,
                    live_deltas=not args.no_live_deltas)
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(sig: signal.Signals) -> None:
        if worker.stopping:  # a second signal: cancel what is left
            worker.cancel_runs()
            return
        err.write(f"fsm-agent worker: {sig.name}: stopping (runs in progress are interrupted)\n")
        err.flush()
        worker.request_stop()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await store.pool()  # errors (DSN, password, unreachable) before announcing
        out.write(f"fsm-agent worker {worker.worker_id}: {store.location}, concurrency {args.concurrency}\n")
        out.flush()
        await worker.run_forever()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        with contextlib.suppress(Exception):
            await agent.provider.aclose()
        await store.close()
    out.write(f"fsm-agent worker {worker.worker_id}: stopped after {worker.completed} job(s)\n")
    return 0
