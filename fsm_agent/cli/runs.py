"""``fsm-agent run`` and ``fsm-agent resume``: the commands that drive a session.

Both check what they can before anything starts (numbers, the store, a reused ``--session-id``;
for a resume its decisions and budgets against the stored session), then drive the run with
:class:`~fsm_agent.cli.factory.AgentFactory`'s agent, draining on SIGINT/SIGTERM. A second Ctrl-C
reaches :func:`fsm_agent.cli.main` as ``KeyboardInterrupt``; :func:`after_second_interrupt`
says what it still can from :class:`Progress`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any, TextIO

import orjson

from ..errors import ConfigurationError
from ..types.run import StopReason
from .factory import AgentFactory, checked_store, local_model, open_store, settings_of
from .output import EXIT_CODES, Printer, report, resume_hint, stop_lines, task_report

__all__ = ["Progress", "after_second_interrupt", "permissions_of", "resume_command", "run_command", "session_exists",
           "task_command"]

_BUDGETS = {"iterations": ("max_iterations", int), "wall_clock": ("max_wall_clock", float),
            "tokens": ("max_tokens", int), "cost": ("max_cost_usd", float)}
"""``--budget NAME=VALUE``: NAME -> (the RunConfig field, the value's type)."""


class Progress:
    """How far a ``run`` or ``resume`` got, for what is printed after a second Ctrl-C."""

    def __init__(self) -> None:
        self.session_id: str | None = None  # set just before the run drives the session
        self.printer: Printer | None = None
        self.settings: dict[str, Any] | None = None
        self.result: Any = None
        self.reported = False


def _positive(option: str, value: float | None, *, whole: bool = False) -> None:
    """A CLI number option checked with the CLI's own name (``--timeout``, ``--budget iterations``)."""
    if value is None:
        return
    if not math.isfinite(value) or value <= 0:
        what = "a whole number of at least 1" if whole else "a positive number"
        raise ConfigurationError(f"{option} must be {what}, not {value:g}")


def permissions_of(args: argparse.Namespace) -> Any:
    """The new session's permissions from ``--permissions FILE`` and ``--allow-tools`` (each narrows the
    other), or ``None`` when neither is given.

    Raises:
        PermissionsError: the file cannot be read or holds invalid permissions.
    """
    from ..permissions import Permissions, allowed_tools_permissions

    path = getattr(args, "permissions", None)
    perms = Permissions.from_file(path) if path else None
    return allowed_tools_permissions(getattr(args, "allow_tools", None), perms)


def _no_temporal_permissions(args: argparse.Namespace, permissions: Any, what: str) -> None:
    if permissions is not None:
        raise ConfigurationError(f"{what} on Temporal takes its permissions from the workers' agent: leave out "
                                 "--permissions and --allow-tools with --temporal")


# -- run ----------------------------------------------------------------------------------------
async def run_command(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress | None = None) -> int:
    """``fsm-agent run TASK``: returns the exit code of the run's stop reason (2: the id is taken).

    Raises:
        ConfigurationError: an empty task, a bad number, store, tool, plugin or local model.
    """
    from ..config import RunConfig

    progress = progress or Progress()
    if not args.task.strip():
        raise ConfigurationError("the task is empty; say what the agent should do, e.g. "
                                 "fsm-agent run \"What is 17*23?\" --tool calculator")
    _positive("--max-iterations", args.max_iterations, whole=True)
    _positive("--timeout", args.timeout)
    _positive("--max-tokens", args.max_tokens, whole=True)
    _positive("--max-output-tokens", args.max_output_tokens, whole=True)
    permissions = permissions_of(args)  # a bad file is found before anything starts
    from .temporal import target_of, temporal_run

    if target_of(args):  # the session runs on Temporal: the workers' agent, the same lines
        _no_temporal_permissions(args, permissions, "run")
        result = await temporal_run(args, out, err)
        progress.result, progress.session_id = result, result.session_id
        return report(result, args, None, out, err, {})  # temporal_run printed the answer
    if getattr(args, "agent", None):
        raise ConfigurationError(f"--agent {args.agent}: `run` takes --agent only with --temporal (the agent the "
                                 "workers serve); to run a module's agent here, use the Python API, or serve it "
                                 "with `fsm-agent serve --agent`")
    settings = settings_of(args)
    config = RunConfig(max_iterations=args.max_iterations, max_wall_clock=args.timeout, max_tokens=args.max_tokens,
                       max_output_tokens=args.max_output_tokens, stream=not args.no_stream)  # checks the values
    printer = None if args.json else Printer(out, err, args.verbose)
    factory = AgentFactory(settings, args.api_key, err)  # checks tools and plugins before anything starts
    session_id = args.session_id or uuid.uuid4().hex
    store = await checked_store(args.store)  # a bad --store is found before the local server starts
    try:
        if args.session_id:  # before the local server starts: a reused id is a mistake found in a moment
            existing = await store.get_session(session_id)
            if existing is not None:
                err.write(f"fsm-agent: {session_exists(session_id, existing.state, existing)}\n")
                return 2
        async with factory:
            agent = factory.agent(store, config, [printer] if printer else [])
            progress.session_id, progress.printer, progress.settings = session_id, printer, settings
            if printer is not None:
                err.write(f"fsm-agent: session {session_id}\n")
            async with agent.drain_on_signals():  # Ctrl-C / SIGTERM: end INTERRUPTED, resumable at once
                result = await agent.run(args.task, session_id=session_id, metadata={"cli": settings},
                                         permissions=permissions)
            progress.result = result
            if printer is not None:
                printer.end_line()  # finish the streamed answer before the local server's goodbye
    finally:
        await store.close()
    code = report(result, args, printer, out, err, settings)
    progress.reported = True
    return code


# -- task ---------------------------------------------------------------------------------------
async def task_command(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress | None = None) -> int:
    """``fsm-agent task FILE``: run a task file to a task result (docs/tasks.md). The streamed answer
    and the report go to ``err``; ``out`` gets the validated output once the task succeeded (the
    task result's JSON with ``--json``). Returns the exit code of the stop (7 for a task that
    completed without passing its checks; 2: the id is taken).

    Raises:
        TaskDefinitionError: the file cannot be read or holds an invalid task (every problem listed).
        ConfigurationError: a bad number, store, tool, plugin, permissions file or local model.
    """
    from ..config import RunConfig
    from ..task import Task

    progress = progress or Progress()
    task = Task.from_file(args.file)
    _positive("--max-output-tokens", args.max_output_tokens, whole=True)
    permissions = permissions_of(args)
    from .temporal import target_of

    if target_of(args):
        raise ConfigurationError("fsm-agent task runs in this process; on Temporal, run the task from Python with "
                                 "Agent(host=...).run_task(Task.from_file(...))")
    settings = settings_of(args)
    config = task.config(RunConfig(max_output_tokens=args.max_output_tokens, stream=not args.no_stream))
    printer = None if args.json else Printer(err, err, args.verbose)  # the answer streams to stderr
    factory = AgentFactory(settings, args.api_key, err)
    session_id = args.session_id or uuid.uuid4().hex
    store = await checked_store(args.store)
    try:
        if args.session_id:
            existing = await store.get_session(session_id)
            if existing is not None:
                err.write(f"fsm-agent: {session_exists(session_id, existing.state, existing)}\n")
                return 2
        async with factory:
            agent = factory.agent(store, config, [printer] if printer else [])
            progress.session_id, progress.printer, progress.settings = session_id, printer, settings
            if printer is not None:
                err.write(f"fsm-agent: session {session_id}, task {task.name or task.goal[:60]!r}\n")
            async with agent.drain_on_signals():
                result = await agent.run_task(task, session_id=session_id, permissions=permissions,
                                              metadata={"cli": settings})
            progress.result = result.run
            if printer is not None:
                printer.end_line()
    finally:
        await store.close()
    code = task_report(result, args, printer, out, err, settings)
    progress.reported = True
    return code


def session_exists(session_id: str, state: str | None = None, record: Any = None) -> str:
    """The one-line message for ``run --session-id`` naming a session that exists."""
    owner = getattr(record, "lease_owner", None)
    until = getattr(record, "lease_until", None) or 0.0
    if owner is not None and until > time.time():
        return (f"session {session_id!r} is running now (driven by worker {owner}, lease until "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(until))}); stop it with "
                f"`fsm-agent control {session_id} interrupt`, or choose another --session-id")
    try:
        stopped: StopReason | None = StopReason(state) if state else None
    except ValueError:
        stopped = None
    if stopped is not None and not stopped.resumable:
        return (f"session {session_id!r} already exists and ended {stopped.value}; choose another --session-id "
                "(or leave it out for a new random id)")
    now = f" ({state})" if state else ""
    return (f"session {session_id!r} already exists{now}; continue it with `fsm-agent resume {session_id}`, "
            "or choose another --session-id")


def after_second_interrupt(progress: Progress, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """What a second Ctrl-C (``KeyboardInterrupt``) during ``run``/``resume`` still prints: the stop
    line when the run reached one, else at least the session id and the command that resumes it."""
    code = EXIT_CODES[StopReason.INTERRUPTED]
    printer = progress.printer
    if progress.result is not None:
        if not progress.reported:
            report(progress.result, args, printer, out, err, progress.settings)
        return code
    if printer is not None and printer.open_line:
        out.write("\n")
        printer.open_line = False
    sid = progress.session_id
    if sid is None:  # nothing was stored yet
        err.write("fsm-agent: interrupted\n")
        return code
    missing = object()
    rec: Any = missing
    try:  # the run's task was cancelled on the way out: it recorded its stop (INTERRUPTED) if it could
        rec = asyncio.run(asyncio.wait_for(_read_record(args.store, sid), 10))
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - the store is not needed to say how to resume
        rec = missing
    if rec is None:
        err.write(f"fsm-agent: interrupted before session {sid} was stored; nothing to resume\n")
        return code
    err.write("fsm-agent: interrupted\n")
    hint: str | None = f"fsm-agent resume {sid}"
    if rec is not missing:
        try:
            reason: StopReason | None = StopReason(rec.state)
        except ValueError:
            reason = None
        stop = rec.stop or {}
        if reason is not None and stop:
            pending = [(p["call"]["id"], p["call"]["name"], p["call"].get("input"), p.get("reason", ""))
                       for p in stop.get("pending_actions") or ()]
            stop_lines(reason, str(stop.get("detail", "")), stop.get("error"), pending, err)
            hint = resume_hint(sid, reason, [p[0] for p in pending], stop.get("budget"), stop.get("error"),
                               progress.settings)
        elif rec.lease_owner is not None and (rec.lease_until or 0) > time.time():
            until = time.strftime("%H:%M:%S", time.localtime(rec.lease_until))
            hint = f"fsm-agent resume {sid} after {until}, when this process's lease on it expires"
    err.write(f"session: {sid}" + (f" (continue with: {hint})" if hint else "") + "\n")
    return code


async def _read_record(location: str | None, session_id: str) -> Any:
    store = open_store(location)
    try:
        return await store.get_session(session_id)
    finally:
        await store.close()


# -- resume -------------------------------------------------------------------------------------
def _decisions(args: argparse.Namespace) -> dict[str, Any]:
    from ..control import Decision

    out: dict[str, Any] = {}
    seen: dict[str, str] = {}

    def once(cid: str, option: str) -> None:
        if cid in seen:
            raise ConfigurationError(f"tool call {cid!r} has two decisions ({seen[cid]} and {option}); give one")
        seen[cid] = option

    for cid in args.approve:
        once(cid, "--approve")
        out[cid] = Decision.approve()
    messages = list(args.message)
    if len(messages) > len(args.reject):
        raise ConfigurationError("each --message is the reason of the --reject at the same position; "
                                 f"got {len(messages)} --message for {len(args.reject)} --reject")
    for i, cid in enumerate(args.reject):
        once(cid, "--reject")
        out[cid] = Decision.reject(messages[i] if i < len(messages) else "rejected by a person")
    for item in args.edit:
        cid, _, raw = item.partition("=")
        once(cid, "--edit")
        try:
            arguments = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ConfigurationError(f"--edit {cid}: arguments must be a JSON object: {exc}") from None
        if not isinstance(arguments, dict):
            raise ConfigurationError(f"--edit {cid}: arguments must be a JSON object")
        out[cid] = Decision.edit(arguments)
    for item in args.respond:
        cid, _, text = item.partition("=")
        once(cid, "--respond")
        out[cid] = Decision.respond(text)
    return out


async def _check_resume(store: Any, session_id: str, decisions: dict[str, Any]) -> Any:
    """Check a resume before any lease is taken and before the local server starts; returns the
    loaded session.

    ``Agent.check_resume`` reads only the store, so a placeholder provider serves.

    Raises:
        ResumeError: the session ended for good, a decision names a call that is not pending (the
            message lists the pending ids) or a kind that call does not allow, or another worker
            drives it.
    """
    from ..agent import Agent
    from ..providers.scripted import ScriptedProvider

    return await Agent(ScriptedProvider([]), store=store).check_resume(session_id, decisions)


_DECISION_FLAGS = {"approve": "--approve {id}", "reject": "--reject {id} [--message TEXT]",
                   "edit": "--edit {id}='{{...}}'", "respond": "--respond {id}=TEXT"}


def _check_needs(session_id: str, loaded: Any, decisions: dict[str, Any], limits: dict[str, Any],
                 confirm_cancel: bool) -> None:
    """Refuse a resume that would stop again at once: a WAITING_HUMAN session given no decision, a
    budget still exhausted (no ``--budget``, or one not above what is used), a budget lowered.

    Raises:
        ConfigurationError: what is missing, with the pending calls and their allowed decisions, or
            the budget's name, limit and use.
    """
    from attrs import evolve

    from ..machine.state import RunState
    from ..types.codec import structure

    rec = loaded.record
    stop = rec.stop or {}
    state = structure(loaded.state_data, RunState) if loaded.state_data is not None else None
    if rec.state == StopReason.WAITING_HUMAN.value:
        if stop.get("required_decision") == "confirm_cancel" and not confirm_cancel:
            raise ConfigurationError(f"session {session_id} waits for a person to confirm its cancel "
                                     f"({stop.get('detail', '')}); give --confirm-cancel")
        pending = stop.get("pending_actions") or []
        decided = set(decisions) | set(state.decisions if state is not None else ())
        if pending and not decided & {p["call"]["id"] for p in pending}:
            calls = []
            for p in pending:
                c = p["call"]
                allowed = list(p.get("allowed_decisions") or _DECISION_FLAGS)
                flags = " | ".join(_DECISION_FLAGS[a].format(id=c["id"]) for a in allowed if a in _DECISION_FLAGS)
                calls.append(f"{c['id']} {c['name']}({orjson.dumps(c.get('input')).decode()}) allows "
                             f"{', '.join(allowed)}: {flags}")
            raise ConfigurationError(f"session {session_id} is waiting for a decision on {len(pending)} tool "
                                     f"call(s); give one: " + "; ".join(calls))
    if state is None:
        return
    cfg = state.config
    used: dict[str, float | None] = {"max_iterations": state.turn, "max_wall_clock": state.elapsed,
                                     "max_tokens": state.usage.total_tokens, "max_cost_usd": state.cost_usd}
    names = {field: name for name, (field, _) in _BUDGETS.items()}
    for field, value in limits.items():
        if field not in names:
            continue
        now, spent = getattr(cfg, field), used[field]
        if now is not None and value < now:
            raise ConfigurationError(f"--budget {names[field]}={value:g} would lower the budget (now {now:g}); "
                                     "--budget only raises one")
        if spent is not None and value <= spent:
            raise ConfigurationError(f"--budget {names[field]}={value:g} is not above what session {session_id} "
                                     f"has used already ({_amount(field, spent)}); give more than {spent:g}")
    new = evolve(cfg, **limits) if limits else cfg
    for field, spent in used.items():
        limit = getattr(new, field)
        if limit is None or spent is None:
            continue
        if spent > limit or (spent >= limit and field != "max_wall_clock"):
            raise ConfigurationError(f"session {session_id} is paused: its {names[field]} budget is exhausted "
                                     f"({_amount(field, spent)} of {limit:g} used); raise it with --budget "
                                     f"{names[field]}=N, N above {spent:g}")


def _amount(field: str, spent: float) -> str:
    return {"max_iterations": f"{spent:g} model call(s)", "max_wall_clock": f"{spent:.1f} s",
            "max_tokens": f"{spent:g} tokens", "max_cost_usd": f"${spent:.4f}"}[field]


def _limits(items: Sequence[str]) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    for item in items:
        for part in item.split(","):
            name, _, value = part.partition("=")
            name = name.strip()
            if name not in _BUDGETS:
                raise ConfigurationError(f"--budget {part!r}: budgets are {', '.join(_BUDGETS)} (NAME=VALUE)")
            field, kind = _BUDGETS[name]
            try:
                limits[field] = kind(value)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise ConfigurationError(f"--budget {part!r}: {value!r} is not {what}") from None
            _positive(f"--budget {name}", limits[field], whole=kind is int)
    return limits


_RUN_BUDGET_FLAGS = (("--max-iterations", "iterations"), ("--timeout", "wall_clock"), ("--max-tokens", "tokens"))
"""``run``'s budget flags, which ``resume`` takes too: (flag, its ``--budget`` name)."""


def _run_budget_flags(args: argparse.Namespace, limits: dict[str, Any]) -> None:
    """Add ``resume --max-iterations/--timeout/--max-tokens`` to ``limits`` (``--budget``'s).

    Raises:
        ConfigurationError: a value that is not positive, or one given both ways with two values.
    """
    for flag, name in _RUN_BUDGET_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is None:
            continue
        field, kind = _BUDGETS[name]
        _positive(flag, value, whole=kind is int)
        if field in limits and limits[field] != value:
            raise ConfigurationError(f"{flag} {value:g} and --budget {name}={limits[field]:g} disagree; give one")
        limits[field] = value


async def resume_command(args: argparse.Namespace, out: TextIO, err: TextIO, progress: Progress | None = None) -> int:
    """``fsm-agent resume ID``: returns the exit code of the resumed run's stop reason.

    Budgets are raised with ``--budget NAME=VALUE`` or ``run``'s own flags (``--max-iterations``,
    ``--timeout``, ``--max-tokens``).

    Raises:
        ConfigurationError: a bad decision, budget, number, store or local model, or a resume that
            would stop again at once.
        ResumeError: an unknown session, one not started by the CLI, or one that cannot be resumed.
        SessionEndedError: the session ended for good (nothing ran).
    """
    from ..errors import ResumeError

    progress = progress or Progress()
    limits = _limits(args.budget)  # usage mistakes first: no store is needed to find them
    _run_budget_flags(args, limits)
    _positive("--max-output-tokens", args.max_output_tokens, whole=True)
    if args.max_output_tokens is not None:
        limits["max_output_tokens"] = args.max_output_tokens
    decisions = _decisions(args)
    from .temporal import target_of, temporal_resume

    if target_of(args):  # through the session's workflow
        result = await temporal_resume(args, decisions, limits, out, err)
        progress.result, progress.session_id = result, result.session_id
        return report(result, args, None, out, err, {})  # temporal_resume printed the answer
    store = await checked_store(args.store, create=False)
    try:
        rec = await store.get_session(args.session_id)
        if rec is None:
            raise ResumeError(f"unknown session {args.session_id!r} in {store!r}")
        settings = rec.metadata.get("cli")
        if settings is None:
            raise ResumeError(f"session {args.session_id} was not started by the CLI; resume it with Agent.resume()")
        if args.local_model is not None:  # e.g. the run's GGUF file moved
            settings = {**settings, "local_model": local_model(args.local_model, settings.get("provider") or "local",
                                                               args.session_id)}
        loaded = await _check_resume(store, args.session_id, decisions)
        _check_needs(args.session_id, loaded, decisions, limits, args.confirm_cancel)
        task_session = "task_definition" in rec.metadata  # its answer streams to stderr, its output to stdout
        printer = None if args.json else Printer(err if task_session else out, err, args.verbose)
        async with AgentFactory(settings, args.api_key, err) as factory:
            agent = factory.agent(store, None, [printer] if printer else [])
            progress.session_id, progress.printer, progress.settings = args.session_id, printer, settings
            async with agent.drain_on_signals():
                if task_session:  # resumed as its task, reported as one
                    tresult = await agent.resume_task(args.session_id, decisions=decisions,
                                                      confirm_cancel=args.confirm_cancel, **limits)
                    result = tresult.run
                else:
                    tresult = None
                    result = await agent.resume(args.session_id, decisions=decisions,
                                                confirm_cancel=args.confirm_cancel, **limits)
            progress.result = result
            if printer is not None:
                printer.end_line()
    finally:
        await store.close()
    if tresult is not None:
        code = task_report(tresult, args, printer, out, err, settings)
        progress.reported = True
        return code
    code = report(result, args, printer, out, err, settings)
    progress.reported = True
    return code
