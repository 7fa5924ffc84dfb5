"""``fsm-agent sessions list|show`` and ``fsm-agent control``: the commands on stored sessions.

Neither runs a model: they read the session store (or, for ``control``, write one control
request that the run's driver picks up, from any process).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, TextIO

import orjson

from ..errors import ConfigurationError
from .factory import checked_store

__all__ = ["control_command", "sessions_command"]


async def sessions_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``sessions list`` (a table, or JSON) and ``sessions show ID`` (the record, ``--events``,
    ``--turns``, or all as ``--json``); returns 0, or 2 for an unknown session.

    Raises:
        ConfigurationError: no store there, or it cannot be opened.
    """
    from ..diagrams import latest_plan
    from ..store.sessions import load_session, read_turns
    from ..types.codec import unstructure
    from ..types.plan import one_line

    store = await checked_store(args.store, create=False)
    try:
        if args.sessions_command == "list":
            rows = await store.list_sessions(args.limit)
            if args.json:
                out.write(orjson.dumps([unstructure(r) for r in rows], option=orjson.OPT_INDENT_2).decode() + "\n")
                return 0
            out.write(f"{'SESSION':<34} {'STATE':<17} {'UPDATED':<20} GOAL\n")
            for r in rows:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.updated_at))
                goal = r.goal.replace("\n", " ")
                out.write(f"{r.session_id:<34} {r.state:<17} {when:<20} {goal[:60]}\n")
            return 0
        loaded = await load_session(store, args.session_id)
        if loaded is None:
            err.write(f"fsm-agent: unknown session {args.session_id!r}\n")
            return 2
        if args.turns:
            turns = await read_turns(store, args.session_id)
            for t in turns:
                out.write((orjson.dumps(unstructure(t)).decode() if args.json else _turn_line(t)) + "\n")
            return 0
        events = await store.read_events(args.session_id)
        if args.events:
            for e in events:
                out.write(orjson.dumps(unstructure(e)).decode() + "\n")
            return 0
        rec = loaded.record
        plan = latest_plan(events)
        parent, children = await store.parent(rec.session_id), await store.children(rec.session_id)
        doc = {"session": unstructure(rec), "checkpoint": unstructure(loaded.checkpoint),
               "ledger": {k: unstructure(v) for k, v in loaded.ledger.items()}, "events": len(events),
               "messages": len(loaded.transcript), "plan": unstructure(plan) if plan is not None else None,
               "parent": unstructure(parent) if parent is not None else None,
               "children": [unstructure(c) for c in children]}
        if children:  # linked sessions (fsm_agent.orchestration): the whole tree below, as the text shows it
            from ..orchestration.links import session_tree
            from ..orchestration.show import tree_data

            doc["tree"] = tree_data(await session_tree(store, rec.session_id))
        if args.json:
            out.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
            return 0
        # a model's (or a user's) text is shown as one printable line: no escape sequence reaches the terminal
        out.write(f"session {rec.session_id}: {rec.state}\ngoal: {one_line(rec.goal)}\n")
        if rec.stop:
            out.write(f"stop: {rec.stop['reason']} — {one_line(str(rec.stop['detail']))}\n")
            for p in rec.stop.get("pending_actions") or ():
                c = p["call"]
                out.write(f"pending: {c['id']} {c['name']}({orjson.dumps(c['input']).decode()}) — {p['reason']}\n")
        out.write(f"events: {len(events)}; messages: {len(loaded.transcript)}; turns: "
                  f"{loaded.checkpoint.data['turn'] if loaded.checkpoint else 0}\n")
        for entry in sorted(loaded.ledger.values(), key=lambda e: e.updated_at):
            out.write(f"tool call {entry.call_id} {entry.tool}: {entry.status.value} ({entry.effect})\n")
        if plan is not None:
            out.write("\n".join(plan.describe()) + "\n")
        if parent is not None or children:  # linked sessions (fsm_agent.orchestration): parent, then the tree below
            from ..orchestration.show import link_lines

            out.write("\n".join(await link_lines(store, rec.session_id)) + "\n")
        from .temporal import target_of, temporal_snapshot

        if target_of(args):  # the session's workflow: its status and snapshot
            await temporal_snapshot(args, out)
        return 0
    finally:
        await store.close()


def _turn_line(t: Any) -> str:
    """One human-readable line for a :class:`~fsm_agent.types.TurnRecord`."""
    parts = [f"turn {t.turn}" + (" (resumed)" if t.resumed else "") + ":"]
    if t.input_seq is not None:
        parts.append(f"input #{t.input_seq}")
    if t.context is not None:
        parts.append(f"context {t.context.hash[:12]} ({t.context.messages} messages, up to #{t.context.seq})")
    mc = t.model_call
    if mc:
        usage = mc.get("usage") or {}
        tokens = f", {usage.get('input_tokens', 0)}+{usage.get('output_tokens', 0)} tokens" if usage else ""
        cost = f", ${mc['cost_usd']:.6f}" if mc.get("cost_usd") is not None else ""
        parts.append(f"model {mc.get('model') or '?'} {mc.get('stop_reason')}{tokens}{cost}")
    elif t.context is not None:
        parts.append("model call did not finish")
    final: dict[str, Any] = {}
    for o in t.observations:  # the last ledger status of each call
        final[o["call_id"]] = o
    calls = []
    for cid in t.tool_calls:
        o = final.get(cid)
        calls.append(f"{cid} {o['tool']} {o['status']}{' (error)' if o.get('is_error') else ''}" if o else
                     f"{cid} (no result)")
    if calls:
        parts.append("tools: " + ", ".join(calls))
    if t.verification:
        parts.append(f"verification: {t.verification}")
    if t.stop_reason:
        parts.append(f"stop: {t.stop_reason}")
    return " ".join(parts[:1]) + " " + "; ".join(parts[1:]) if len(parts) > 1 else parts[0]


def _permissions_text(kind: Any, given: str, reason: str) -> str:
    """The control text of ``restrict`` / ``request_permissions`` from the CLI's TEXT: permissions as
    JSON, or the path of a TOML/JSON permissions file.

    Raises:
        ConfigurationError: no TEXT; PermissionsError: invalid permissions.
    """
    import json
    from pathlib import Path

    from ..permissions import Permissions, control_text
    from ..store.base import ControlKind

    if not given.strip():
        raise ConfigurationError(f"control {kind.value} needs permissions: JSON such as '{{\"tools\": [\"read_file\"]}}', "
                                 "or a TOML/JSON file's path (docs/permissions.md)")
    if given.lstrip().startswith("{"):
        try:
            data = json.loads(given)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"control {kind.value}: the permissions are not valid JSON: {exc}") from None
        perms = Permissions.from_dict(data, source=f"control {kind.value}")
    elif Path(given).is_file():
        perms = Permissions.from_file(given)
    else:
        raise ConfigurationError(f"control {kind.value}: {given!r} is neither JSON permissions nor a file")
    what = "restriction" if kind is ControlKind.RESTRICT else "permissions"
    return control_text(what, perms, reason)  # type: ignore[arg-type]


async def control_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``control ID KIND [TEXT]``: store one control request for the session; returns 0.

    Raises:
        ConfigurationError: ``steer``/``followup`` without a TEXT, or no store there.
    """
    from ..store.base import ControlKind
    from ..store.sessions import send_control

    kind = ControlKind(args.kind)
    if kind in (ControlKind.STEER, ControlKind.FOLLOWUP) and not args.text:
        raise ConfigurationError(f"control {kind.value} needs a TEXT")
    text = args.text or ""
    if kind in (ControlKind.RESTRICT, ControlKind.REQUEST_PERMISSIONS):
        text = _permissions_text(kind, text, getattr(args, "reason", "") or "")
    from ..control import Cancel, Followup, Interrupt, Steer
    from .temporal import target_of, temporal_control

    if target_of(args):  # a signal to the session's workflow
        if kind in (ControlKind.RESTRICT, ControlKind.REQUEST_PERMISSIONS):
            raise ConfigurationError(f"control {kind.value} goes through the session store: leave out --temporal")
        control = {ControlKind.INTERRUPT: Interrupt, ControlKind.CANCEL: Cancel, ControlKind.STEER: Steer,
                   ControlKind.FOLLOWUP: Followup}[kind](args.text or "")
        return await temporal_control(args, control, err)
    store = await checked_store(args.store, create=False)
    try:
        note = await send_control(store, args.session_id, kind, text)
    finally:
        await store.close()
    err.write(note + "\n")
    return 0
