"""``fsm-agent serve``: run the app (:func:`~fsm_agent.server.create_app`) on a host and port until
SIGTERM or SIGINT.

By default it listens on 127.0.0.1. It refuses any other address unless tokens are configured
(:func:`~fsm_agent.server.auth.check_bind`). With a SQLite store the runs happen in this process
(:class:`~fsm_agent.server.runs.LocalRunner`). With a PostgreSQL store they are queued for
``fsm-agent worker`` processes (:class:`~fsm_agent.server.queue.QueueRunner`), unless
``local_runs`` is set. An agent on Temporal (``agent.host`` set) runs through its workflows; over
PostgreSQL this process also listens for the workers' commits and live deltas
(:class:`~fsm_agent.server.queue.ListeningRunner`), so its streams follow them as they happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from aiohttp import web

from ..agent import Agent
from .a2a import A2AConfig, add_a2a_routes
from .app import create_app
from .auth import Tenants, check_bind

__all__ = ["serve"]


async def serve(agent: Agent, *, host: str = "127.0.0.1", port: int = 8000, tenants: Tenants | None = None,
                cors_origins: Sequence[str] = (), local_runs: bool = False, out: TextIO | None = None,
                ready: Callable[[str], Any] | None = None, a2a: A2AConfig | None = None) -> None:
    """Serve ``agent`` (over its store) until SIGTERM/SIGINT (or until cancelled).

    Args:
        agent: the agent; its store holds the sessions.
        host, port: where to listen (``port=0``: any free port).
        tenants: bearer tokens (default: :meth:`Tenants.from_env`).
        cors_origins: origins allowed cross-origin calls.
        local_runs: with PostgreSQL, run in this process instead of queueing for workers.
        out: where the URL is printed.
        ready: called with the base URL once listening.
        a2a: also serve the agent over A2A 1.0 (:func:`~fsm_agent.server.a2a.add_a2a_routes`).

    Raises:
        ConfigurationError: a non-loopback ``host`` without tokens.
        OSError: the address cannot be bound.
    """
    tenants = tenants if tenants is not None else Tenants.from_env()
    check_bind(host, tenants)
    from ..store.postgres import PostgresStore

    on_pg = isinstance(agent.store, PostgresStore)
    queued = on_pg and not local_runs and agent.host is None  # Temporal: its workers
    # Temporal over PostgreSQL: runs go through the agent (its workflows), while the workers'
    # commits and live deltas reach this process's streams by NOTIFY
    listening = on_pg and agent.host is not None

    def runner_factory(a: Agent, store: Any) -> Any:
        from .queue import ListeningRunner, QueueRunner
        from .runs import LocalRunner

        if listening:
            return ListeningRunner(LocalRunner(a, store.notifier), store.inner, store.notifier)
        return QueueRunner(store.inner, store.notifier)
    app = create_app(agent, runner=runner_factory if queued or listening else None, tenants=tenants,
                     cors_origins=cors_origins)
    if a2a is not None:
        add_a2a_routes(app, a2a)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0] if runner.addresses else (host, port)
        url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
        if out is not None:
            mode = ("runs queued for `fsm-agent worker`" if queued
                    else "runs on Temporal's workers" + ("; live deltas by PostgreSQL NOTIFY" if listening else "")
                    if agent.host is not None else "runs in this process")
            auth = f"{len(tenants.tokens)} token(s)" if tenants.enabled else "no tokens (loopback only)"
            also = f"; A2A card: {url}/.well-known/agent-card.json" if a2a is not None else ""
            out.write(f"fsm-agent: serving on {url} ({mode}; {auth}); review page: {url}/review/SESSION_ID{also}; "
                      "Ctrl-C stops\n")
            out.flush()
        if ready is not None:
            ready(url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
        if out is not None:
            out.write("fsm-agent: stopping; runs in progress end INTERRUPTED and are resumed when the server "
                      "starts again\n" if not queued else "fsm-agent: stopping (queued runs stay queued for workers)\n")
            out.flush()
    finally:
        await runner.cleanup()  # runs in progress end INTERRUPTED (resumable)
