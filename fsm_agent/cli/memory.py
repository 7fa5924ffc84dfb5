"""``fsm-agent memory list|search|show|delete``: the episodic memory kept beside the session store.

The episodes the ``memory`` plugin saved (:mod:`fsm_agent.store.episodes`) live in the session
store's file or database (``--store``, ``$FSM_AGENT_STORE``, default ``~/.fsm-agent/sessions.db``).
This is the operator's view: without ``--tenant``, ``list``, ``show`` and ``delete ID`` reach every
tenant; ``search`` and ``delete --all`` take one tenant. Nothing here runs a model.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, TextIO

import orjson

from ..errors import ConfigurationError, StoreError
from ..types.codec import unstructure

__all__ = ["add_memory_command", "memory_command"]


def add_memory_command(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Add ``memory`` and its subcommands to the ``fsm-agent`` parser (``parents``: ``--store``)."""
    m = sub.add_parser("memory", help="list, search, show and delete the episodes the memory plugin saved")
    ms = m.add_subparsers(dest="memory_command", required=True, metavar="{list,search,show,delete}")
    ls = ms.add_parser("list", parents=parents, help="the newest episodes first")
    ls.add_argument("--tenant", help="only this tenant's (default: every tenant's)")
    ls.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    ls.add_argument("--json", action="store_true", help="print them as JSON")
    se = ms.add_parser("search", parents=parents, help="what the memory plugin would recall for a task")
    se.add_argument("query", help="the task's words")
    se.add_argument("--tenant", default="default", help="whose episodes (default: default)")
    se.add_argument("--limit", type=int, default=5, help="at most this many (default 5)")
    se.add_argument("--json", action="store_true", help="print them as JSON, each with its score")
    sh = ms.add_parser("show", parents=parents, help="one episode: goal, outcome, every step, what failed")
    sh.add_argument("episode_id")
    sh.add_argument("--tenant", help="only if it is this tenant's")
    sh.add_argument("--json", action="store_true")
    de = ms.add_parser("delete", parents=parents, help="delete an episode, or --all of a tenant's")
    de.add_argument("episode_id", nargs="?", help="the episode (its session's id)")
    de.add_argument("--tenant", help="only if it is this tenant's (with --all: whose episodes)")
    de.add_argument("--all", action="store_true", help="every episode of --tenant")


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _line(text: str, most: int) -> str:
    one = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return one if len(one) <= most else one[:most - 1] + "…"


async def memory_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run ``memory list|search|show|delete``; returns 0, or 2 for an unknown episode or a usage error.

    Raises:
        ConfigurationError: no store there, it cannot be opened, or a bad argument (an empty tenant,
            a limit out of range, ``delete`` without an id or ``--all``).
    """
    from ..store.episodes_open import open_episode_store

    cmd = args.memory_command
    if cmd == "delete" and bool(args.all) == bool(args.episode_id):
        raise ConfigurationError("memory delete: give an EPISODE_ID, or --all with --tenant (not both)")
    if cmd == "delete" and args.all and not args.tenant:
        raise ConfigurationError("memory delete --all deletes one tenant's episodes: give --tenant")
    try:
        store = open_episode_store(args.store, create=False)
    except StoreError as exc:
        raise ConfigurationError(f"cannot open the memory at {exc.location}: {exc.cause}") from None
    try:
        return await _run(store, args, out, err)
    except StoreError as exc:
        raise ConfigurationError(f"the memory at {exc.location} cannot be read or written: {exc.cause}") from None
    finally:
        await store.close()


async def _run(store: Any, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    cmd = args.memory_command
    if cmd == "list":
        episodes = await store.list_episodes(tenant=args.tenant, limit=args.limit)
        if args.json:
            out.write(orjson.dumps([unstructure(e) for e in episodes], option=orjson.OPT_INDENT_2).decode() + "\n")
            return 0
        out.write(f"{'EPISODE':<34} {'TENANT':<12} {'OUTCOME':<17} {'UPDATED':<20} GOAL\n")
        for e in episodes:
            out.write(f"{_line(e.episode_id, 34):<34} {_line(e.tenant, 12):<12} {e.outcome:<17} "
                      f"{_when(e.updated_at):<20} {_line(e.goal, 60)}\n")
        return 0
    if cmd == "search":
        hits = await store.search(args.tenant, args.query, limit=args.limit)
        if args.json:
            out.write(orjson.dumps([{"score": h.score, "episode": unstructure(h.episode)} for h in hits],
                                   option=orjson.OPT_INDENT_2).decode() + "\n")
            return 0
        out.write(f"{'SCORE':>9} {'EPISODE':<34} {'OUTCOME':<17} GOAL\n")
        for h in hits:
            e = h.episode
            out.write(f"{h.score:>9.3f} {_line(e.episode_id, 34):<34} {e.outcome:<17} {_line(e.goal, 60)}\n")
        return 0
    if cmd == "show":
        e = await store.get(args.episode_id, tenant=args.tenant)
        if e is None:
            err.write(f"fsm-agent: no episode {args.episode_id!r}" + (f" of tenant {args.tenant!r}" if args.tenant
                                                                     else "") + "\n")
            return 2
        if args.json:
            out.write(orjson.dumps(unstructure(e), option=orjson.OPT_INDENT_2).decode() + "\n")
            return 0
        cost = "unknown" if e.cost_usd is None else f"${e.cost_usd:.4f}"
        out.write(f"episode {e.episode_id} (tenant {e.tenant}, session {e.session_id})\n"
                  f"saved {_when(e.created_at)}, updated {_when(e.updated_at)}; {e.turns} model call(s), "
                  f"{e.tool_calls} tool call(s), cost {cost}\n")
        out.write(e.describe(steps=None) + "\n")
        return 0
    if args.all:
        n = await store.delete_tenant(args.tenant)
        out.write(f"deleted {n} episode(s) of tenant {args.tenant}\n")
        return 0
    if not await store.delete(args.episode_id, tenant=args.tenant):
        err.write(f"fsm-agent: no episode {args.episode_id!r}" + (f" of tenant {args.tenant!r}" if args.tenant
                                                                 else "") + "\n")
        return 2
    out.write(f"deleted episode {args.episode_id}\n")
    return 0
