"""``fsm-agent serve``: sessions over HTTP (:mod:`fsm_agent.server`).

``fsm-agent worker`` is :mod:`fsm_agent.server.worker`'s own command (its parser and handler live
there); the parser of :mod:`fsm_agent.cli.parser` only adds it.
"""

from __future__ import annotations

import argparse
from typing import TextIO

from ..errors import ConfigurationError
from .factory import AGENT_FLAGS, AgentFactory, checked_store, settings_of

__all__ = ["serve_command"]


async def serve_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``serve``: the ``--agent`` given, else the agent ``run`` builds from the same flags
    (``--provider``, ``--tool``, ``--policy``, ``--approve-tools``, ``--middleware`` ...; with none, the
    embedded model with the default plugins), until stopped; returns 0.

    Raises:
        ConfigurationError: a bad port, tokens file, bind address without tokens, A2A name or store;
            ``--agent`` together with agent flags; an unknown tool or plugin, a bad policy file, an
            ``--approve-tools`` pattern that matches no enabled tool (before anything starts).
    """
    from ..server.auth import Tenants, check_bind
    from ..server.serve import serve
    from .agent_ref import load_agent

    if not 0 <= args.port <= 65535:
        raise ConfigurationError(f"--port {args.port}: give 0 (any free port) to 65535")
    given = [f"--{name.replace('_', '-')}" for name in AGENT_FLAGS if getattr(args, name, None) not in (None, [], False)]
    if args.agent and given:
        raise ConfigurationError(f"--agent {args.agent} serves your Agent as it is built, and {', '.join(given)} "
                                 "configure the agent the command line builds: give --agent or these, not both")
    factory = None if args.agent else AgentFactory(settings_of(args), args.api_key, err)  # bad names fail here
    tenants = Tenants.from_file(args.tokens) if args.tokens else Tenants.from_env()
    if getattr(args, "tenant_permissions", None):  # each tenant's default session permissions
        tenants.set_permissions(Tenants.read_permissions(args.tenant_permissions))
    check_bind(args.host, tenants)  # before any model server starts
    a2a = None
    if args.a2a is not None:
        from ..server.a2a import A2AConfig

        a2a = A2AConfig(name=args.a2a, description=args.a2a_description)  # a bad name fails before any server
    store = await checked_store(args.store)
    try:
        if args.agent:
            agent = load_agent(args.agent)
            agent.store = store
            from .temporal import connect, host_of, target_of

            if target_of(args):  # the runs happen on Temporal's workers; this process serves their log
                agent.host = host_of(agent, await connect(args), args)
            await serve(agent, host=args.host, port=args.port, tenants=tenants, cors_origins=args.cors_origin,
                        local_runs=args.local_runs, out=err, a2a=a2a)
            return 0
        from ..config import RunConfig

        assert factory is not None
        async with factory:
            agent = factory.agent(store, RunConfig(), [])
            await serve(agent, host=args.host, port=args.port, tenants=tenants, cors_origins=args.cors_origin,
                        local_runs=args.local_runs, out=err, a2a=a2a)
        return 0
    finally:
        await store.close()
