"""The ``fsm-agent`` command line (argparse; no business logic here).

Commands: ``run``, ``resume``, ``sessions list|show``, ``control``, ``diagram``, ``decode``,
``middleware list``.

Exit codes: 0 COMPLETED (or success); 2 a usage or configuration error (a session store that
cannot be opened among them), an unknown session, a session that cannot be resumed (or a decision
or budget that does not fit it: a resume that would stop again at once is refused before anything
starts), or a ``run --session-id`` that already exists; 3 WAITING_HUMAN; 4 PAUSED_BUDGET; 5 INTERRUPTED;
6 FAILED_RETRYABLE; 7 FAILED_TERMINAL; 8 CANCELLED; 1 anything else, e.g. a body ``decode``
could not parse (a message says what).

Sessions are kept in ``$FSM_AGENT_STORE`` (a SQLite path or a ``postgresql://`` DSN), default
``~/.fsm-agent/sessions.db``, so a stopped run can be resumed later by ``fsm-agent resume``.

``run`` and ``resume`` drain on SIGINT (Ctrl-C) and SIGTERM: the run ends INTERRUPTED with the
streamed text kept, a checkpoint and its lease released, the usual stop line and resume hint are
printed, and the exit code is 5, exactly as after ``fsm-agent control ID interrupt``. A second
signal stops the process at once; it still prints the stop line when the run reached one, else the
session id and the command that resumes it (exit 5).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson

from ._version import __version__
from .errors import ConfigurationError, FsmAgentError, SessionEndedError, SessionExistsError, UserError
from .plugins import DEFAULT_MIDDLEWARE
from .types.run import StopReason

__all__ = ["EXIT_CODES", "main"]

EXIT_CODES: dict[StopReason, int] = {
    StopReason.COMPLETED: 0,
    StopReason.WAITING_HUMAN: 3,
    StopReason.PAUSED_BUDGET: 4,
    StopReason.INTERRUPTED: 5,
    StopReason.FAILED_RETRYABLE: 6,
    StopReason.FAILED_TERMINAL: 7,
    StopReason.CANCELLED: 8,
}
_BUDGETS = {"iterations": ("max_iterations", int), "wall_clock": ("max_wall_clock", float),
            "tokens": ("max_tokens", int), "cost": ("max_cost_usd", float)}


def _env(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


class _Printer:
    """Observer that streams the answer to stdout and tool activity (and plan changes) to stderr.

    Only the Model phase's call is the answer: calls a plugin makes in other phases (a planner, a
    grader, a summarizer, through ``ctx.call_provider``) stream to observers too, and are not printed."""

    def __init__(self, out: TextIO, err: TextIO, verbose: bool) -> None:
        self.out, self.err, self.verbose = out, err, verbose
        self.open_line = False

    def on_model_event(self, ev: Any) -> None:
        text = getattr(ev.event, "text", None)
        if ev.event.TAG == "text_delta" and text and ev.phase == "Model":
            self.out.write(text)
            self.out.flush()
            self.open_line = not text.endswith("\n")

    def end_line(self) -> None:
        self._nl()

    def _nl(self) -> None:
        if self.open_line:
            self.out.write("\n")
            self.out.flush()
            self.open_line = False

    def on_tool_started(self, ev: Any) -> None:
        self._nl()
        self.err.write(f"→ tool {ev.call.name}({orjson.dumps(ev.call.input).decode()})\n")

    def on_tool_finished(self, ev: Any) -> None:
        mark = "✗" if ev.result.is_error else "←"
        text = ev.result.text
        if len(text) > 300:
            text = text[:300] + "…"
        self.err.write(f"{mark} {ev.call.name}: {text} ({ev.duration_s:.2f} s)\n")

    def on_plan_updated(self, ev: Any) -> None:
        self._nl()
        self.err.write(f"plan v{ev.plan.version}: {ev.reason}\n")

    def on_transition(self, ev: Any) -> None:
        if self.verbose:
            self.err.write(f"  [{ev.from_state} --{ev.trigger}--> {ev.to_state}] {ev.reason}\n")

    def on_budget_warning(self, ev: Any) -> None:
        self.err.write(f"! budget {ev.budget}: {ev.used:g} of {ev.limit:g} used\n")

    def on_model_retry(self, ev: Any) -> None:
        self._nl()
        status = f" (HTTP {ev.status})" if ev.status is not None else ""
        hint = ", as the server asked" if ev.server_hint else ""
        self.err.write(f"! model call failed: {ev.kind}{status}; retry {ev.attempt} in {ev.delay_s:.3g} s{hint}\n")


# -- building blocks ------------------------------------------------------------------------
def open_store(location: str | None = None, *, create: bool = True) -> Any:
    """The session store at ``location`` / ``$FSM_AGENT_STORE`` / ``~/.fsm-agent/sessions.db``.

    Raises:
        ConfigurationError: ``create`` is false and no SQLite store exists there (a mistyped path).
    """
    from .store.postgres import PostgresStore
    from .store.sqlite import SQLiteStore

    loc = location or _env("FSM_AGENT_STORE") or str(Path(_env("FSM_AGENT_HOME") or "~/.fsm-agent").expanduser()
                                                      / "sessions.db")
    if loc.startswith(("postgres://", "postgresql://")):
        return PostgresStore(loc)
    if not create and not Path(loc).is_file():
        raise ConfigurationError(f"no session store at {loc} (no run has been stored there yet); "
                                 "check --store or $FSM_AGENT_STORE")
    return SQLiteStore(loc)


async def _checked_store(location: str | None = None, *, create: bool = True) -> Any:
    """:func:`open_store`, then one read, so that a store that cannot be opened (an unreachable
    server, a path that cannot be created, a file that is no database) is found before anything
    starts and before a session id is printed.

    Raises:
        ConfigurationError: the store cannot be opened; the message names its location and why.
    """
    from .errors import StoreError

    try:
        store = open_store(location, create=create)
    except StoreError as exc:
        raise ConfigurationError(_store_problem(exc)) from None
    try:
        await store.list_sessions(1)  # connects, creates or migrates the schema
    except StoreError as exc:
        with contextlib.suppress(Exception):
            await store.close()
        raise ConfigurationError(_store_problem(exc)) from None
    return store


def _store_problem(exc: Any) -> str:
    again = "; retrying may help" if exc.transient else ""
    return (f"cannot open the session store {exc.location}: {exc.cause}{again} "
            "(check --store or $FSM_AGENT_STORE)")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    provider = args.provider or _env("FSM_AGENT_PROVIDER")
    base_url = args.base_url or _env("FSM_AGENT_BASE_URL")
    if provider is None and base_url:
        provider = "openai-compatible"
    return {
        "provider": provider or "local",
        "base_url": base_url,
        "model": args.model or _env("FSM_AGENT_MODEL"),
        "tool_mode": args.tool_mode,
        "tools": list(args.tool),
        "system": args.system,
        "middleware": list(args.middleware),
        "default_middleware": not args.no_default_middleware,
        "policy": str(Path(args.policy).resolve()) if args.policy else None,
        "approve_tools": list(args.approve_tools),
        "local_model": _local_model(args.local_model, provider or "local"),
    }


def _local_model(path: str | None, provider: str, session_id: str | None = None) -> str | None:
    """``--local-model PATH`` checked before anything starts: the absolute path of a GGUF file.

    ``session_id``: the session a ``resume`` continues (its provider cannot change).

    Raises:
        ConfigurationError: the file is missing or not GGUF, or another provider was chosen.
    """
    if path is None:
        return None
    if provider != "local":
        if session_id is not None:
            raise ConfigurationError(f"--local-model runs a GGUF file on the embedded llama.cpp server; session "
                                     f"{session_id} runs on the provider {provider!r}, which a resume keeps "
                                     "(leave out --local-model)")
        raise ConfigurationError(f"--local-model runs a GGUF file on the embedded llama.cpp server; it does not "
                                 f"combine with the provider {provider!r} (leave out --provider/--base-url)")
    from .local import check_gguf

    return check_gguf(path, "--local-model")


class _AgentFactory:
    """Builds the agent of a run (or a resumed run) from CLI settings; owns the local server."""

    def __init__(self, settings: dict[str, Any], api_key: str | None, err: TextIO) -> None:
        self.s, self.api_key, self.err = settings, api_key, err
        self.server: Any = None
        self.provider: Any = None
        self.tools, self.middleware = self._plugins()  # bad names fail here, before any server starts

    def _plugins(self) -> tuple[list[Any], list[Any]]:
        from .plugins import discover, load_plugin
        from .tools.demo import DEMO_TOOLS

        tools = []
        for name in self.s["tools"]:
            if name not in DEMO_TOOLS:
                raise ConfigurationError(f"unknown tool {name!r}; demo tools: {', '.join(DEMO_TOOLS)}")
            tools.append(DEMO_TOOLS[name])
        names: list[str] = []
        if self.s["default_middleware"]:
            installed = {p.name for p in discover()}
            names += [n for n in DEFAULT_MIDDLEWARE if n in installed]
        names += [n for n in self.s["middleware"] if n not in names]
        middleware = [load_plugin(n)() for n in names]
        if self.s.get("policy"):
            middleware.insert(0, load_plugin("tool_policy").from_file(self.s["policy"]))  # type: ignore[attr-defined]
        approve = self.s.get("approve_tools") or []  # absent in sessions stored before the option existed
        for pattern in approve:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in self.s["tools"]):
                enabled = ", ".join(self.s["tools"]) or "none; enable one with --tool NAME"
                raise ConfigurationError(f"--approve-tools {pattern!r}: no enabled tool matches it (enabled: {enabled})")
        if approve:
            middleware.append(load_plugin("approval")(tools=approve))  # type: ignore[call-arg]
        return tools, middleware

    async def __aenter__(self) -> _AgentFactory:
        from .local import MODEL_FILE as SMOLLM2_FILE
        from .local import TOOL_MODEL_HINT, LocalLlamaServer
        from .providers.base import ProviderConfig, ToolMode
        from .providers.profiles import create_provider

        s = self.s
        name, base_url = s["provider"], s["base_url"]
        if name == "local":
            # settings made before --local-model existed have no "local_model"
            self.server = LocalLlamaServer(s.get("local_model"),
                                           log=lambda m: None if self.err.write(f"fsm-agent: {m}\n") else None)
            model = Path(self.server.model_path).name
            which = "SmolLM2-135M" if model == SMOLLM2_FILE else model
            self.err.write(f"fsm-agent: no provider configured; using the embedded local model ({which} via "
                           "llama.cpp)\n")
            if self.tools and model == SMOLLM2_FILE:
                self.err.write(f"fsm-agent: note: SmolLM2-135M cannot use tools reliably; for --tool give "
                               f"--local-model PATH.gguf with {TOOL_MODEL_HINT}\n")
            await asyncio.to_thread(self.server.start)
            name, base_url = "llamacpp", self.server.base_url
        self.provider = create_provider(name, ProviderConfig(
            model=s["model"], base_url=base_url, api_key=self.api_key or _env("FSM_AGENT_API_KEY"),
            tool_mode=ToolMode(s["tool_mode"]) if s["tool_mode"] else None))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.provider is not None:
            await self.provider.aclose()
        if self.server is not None:
            self.server.stop()

    def agent(self, store: Any, config: Any, observers: list[Any]) -> Any:
        from .agent import Agent

        return Agent(self.provider, tools=self.tools, system_prompt=self.s["system"], middleware=self.middleware,
                     observers=observers, config=config, store=store)




def _report(result: Any, args: argparse.Namespace, printer: _Printer | None, out: TextIO, err: TextIO,
            settings: dict[str, Any] | None = None) -> int:
    from .types.codec import unstructure

    if args.json:
        out.write(orjson.dumps(unstructure(result), option=orjson.OPT_INDENT_2).decode() + "\n")
        return EXIT_CODES[result.stop.reason]
    if printer is not None and printer.open_line:
        out.write("\n")
        printer.open_line = False
    if not result.output and result.stop.reason is StopReason.COMPLETED:
        out.write("(the model gave no text)\n")
    u = result.usage
    est = " (estimated)" if u.estimated else ""
    cost = f", ${result.cost_usd:.6f}" if result.cost_usd else ""
    stop = result.stop
    pending = [(p.call.id, p.call.name, p.call.input, p.reason) for p in stop.pending_actions]
    _stop_lines(stop.reason, stop.detail, stop.error, pending, err,
                usage=f"usage: {u.input_tokens} input + {u.output_tokens} output tokens{est}{cost}; "
                      f"{result.turns} model call(s), {result.tool_calls} tool call(s), {result.duration_s:.1f} s")
    hint = _hint(result.session_id, stop.reason, [p[0] for p in pending], stop.budget, stop.error, settings)
    err.write(f"session: {result.session_id}" + (f" (continue with: {hint})" if hint else "") + "\n")
    return EXIT_CODES[stop.reason]


def _stop_lines(reason: StopReason, detail: str, error: dict[str, Any] | None,
                pending: Sequence[tuple[str, str, Any, str]], err: TextIO, usage: str | None = None) -> None:
    """The ``stop:`` line (with ``usage:``, ``error:`` and ``pending:`` lines) of a stopped run."""
    if error and error.get("message") and error["message"] not in detail:
        said = f"error ({error.get('kind', 'error')}): {error['message']}"
    else:
        said = ""
    err.write(f"stop: {reason.value} — {detail}\n")
    if usage:
        err.write(usage + "\n")
    if said:
        err.write(said + "\n")
    for cid, name, arguments, why in pending:
        err.write(f"pending: {cid} {name}({orjson.dumps(arguments).decode()}) — {why}\n")


def _hint(sid: str, reason: StopReason, pending: Sequence[str], budget: str | None, error: dict[str, Any] | None,
          settings: dict[str, Any] | None = None) -> str | None:
    """The ``fsm-agent resume`` command that continues a session stopped for ``reason`` (only what
    ``resume`` can change), or ``None`` when it cannot be resumed."""
    if reason is StopReason.WAITING_HUMAN:
        approve = " ".join(f"--approve {cid}" for cid in pending) or "--approve CALL"
        return (f"fsm-agent resume {sid} {approve}; or, per call, --reject CALL --message TEXT | "
                f"--edit CALL='{{...}}' | --respond CALL=TEXT")
    if reason is StopReason.PAUSED_BUDGET:
        return f"fsm-agent resume {sid} --budget {budget or 'iterations'}=N"
    if reason is StopReason.INTERRUPTED:
        return f"fsm-agent resume {sid}"
    if reason is StopReason.FAILED_RETRYABLE:
        error = error or {}
        if error.get("kind") == "output_truncated":
            used = error.get("max_tokens")
            more = f" (more than {used})" if isinstance(used, int) else ""
            return f"fsm-agent resume {sid} --max-output-tokens N{more}"
        base_url = (settings or {}).get("base_url")
        if error.get("kind") == "connection" and base_url:
            return (f"fsm-agent resume {sid} once {base_url} answers; a resume keeps the session's provider and "
                    "base URL (a wrong URL needs a new run)")
        return f"fsm-agent resume {sid}"
    return None


# -- commands -----------------------------------------------------------------------------------
class _Progress:
    """How far a ``run`` or ``resume`` got, for what is printed after a second Ctrl-C."""

    def __init__(self) -> None:
        self.session_id: str | None = None  # set just before the run drives the session
        self.printer: _Printer | None = None
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


async def _run(args: argparse.Namespace, out: TextIO, err: TextIO, progress: _Progress | None = None) -> int:
    from .config import RunConfig

    progress = progress or _Progress()
    if not args.task.strip():
        raise ConfigurationError("the task is empty; say what the agent should do, e.g. "
                                 "fsm-agent run \"What is 17*23?\" --tool calculator")
    _positive("--max-iterations", args.max_iterations, whole=True)
    _positive("--timeout", args.timeout)
    _positive("--max-tokens", args.max_tokens, whole=True)
    _positive("--max-output-tokens", args.max_output_tokens, whole=True)
    settings = _settings(args)
    config = RunConfig(max_iterations=args.max_iterations, max_wall_clock=args.timeout, max_tokens=args.max_tokens,
                       max_output_tokens=args.max_output_tokens, stream=not args.no_stream)  # checks the values
    printer = None if args.json else _Printer(out, err, args.verbose)
    factory = _AgentFactory(settings, args.api_key, err)  # checks tools and plugins before anything starts
    session_id = args.session_id or uuid.uuid4().hex
    store = await _checked_store(args.store)  # a bad --store is found before the local server starts
    try:
        if args.session_id:  # before the local server starts: a reused id is a mistake found in a moment
            existing = await store.get_session(session_id)
            if existing is not None:
                err.write(f"fsm-agent: {_session_exists(session_id, existing.state, existing)}\n")
                return 2
        async with factory:
            agent = factory.agent(store, config, [printer] if printer else [])
            progress.session_id, progress.printer, progress.settings = session_id, printer, settings
            if printer is not None:
                err.write(f"fsm-agent: session {session_id}\n")
            async with agent.drain_on_signals():  # Ctrl-C / SIGTERM: end INTERRUPTED, resumable at once
                result = await agent.run(args.task, session_id=session_id, metadata={"cli": settings})
            progress.result = result
            if printer is not None:
                printer.end_line()  # finish the streamed answer before the local server's goodbye
    finally:
        await store.close()
    code = _report(result, args, printer, out, err, settings)
    progress.reported = True
    return code


def _session_exists(session_id: str, state: str | None = None, record: Any = None) -> str:
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


def _after_second_interrupt(progress: _Progress, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """What a second Ctrl-C (``KeyboardInterrupt``) during ``run``/``resume`` still prints: the stop
    line when the run reached one, else at least the session id and the command that resumes it."""
    code = EXIT_CODES[StopReason.INTERRUPTED]
    printer = progress.printer
    if progress.result is not None:
        if not progress.reported:
            _report(progress.result, args, printer, out, err, progress.settings)
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
            _stop_lines(reason, str(stop.get("detail", "")), stop.get("error"), pending, err)
            hint = _hint(sid, reason, [p[0] for p in pending], stop.get("budget"), stop.get("error"),
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


def _decisions(args: argparse.Namespace) -> dict[str, Any]:
    from .control import Decision

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
    from .agent import Agent
    from .providers.scripted import ScriptedProvider

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

    from .machine.state import RunState
    from .types.codec import structure

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


async def _resume(args: argparse.Namespace, out: TextIO, err: TextIO, progress: _Progress | None = None) -> int:
    from .errors import ResumeError

    progress = progress or _Progress()
    limits = _limits(args.budget)  # usage mistakes first: no store is needed to find them
    _positive("--max-output-tokens", args.max_output_tokens, whole=True)
    if args.max_output_tokens is not None:
        limits["max_output_tokens"] = args.max_output_tokens
    decisions = _decisions(args)
    store = await _checked_store(args.store, create=False)
    try:
        rec = await store.get_session(args.session_id)
        if rec is None:
            raise ResumeError(f"unknown session {args.session_id!r} in {store!r}")
        settings = rec.metadata.get("cli")
        if settings is None:
            raise ResumeError(f"session {args.session_id} was not started by the CLI; resume it with Agent.resume()")
        if args.local_model is not None:  # e.g. the run's GGUF file moved
            settings = {**settings, "local_model": _local_model(args.local_model, settings.get("provider") or "local",
                                                                args.session_id)}
        loaded = await _check_resume(store, args.session_id, decisions)
        _check_needs(args.session_id, loaded, decisions, limits, args.confirm_cancel)
        printer = None if args.json else _Printer(out, err, args.verbose)
        async with _AgentFactory(settings, args.api_key, err) as factory:
            agent = factory.agent(store, None, [printer] if printer else [])
            progress.session_id, progress.printer, progress.settings = args.session_id, printer, settings
            async with agent.drain_on_signals():
                result = await agent.resume(args.session_id, decisions=decisions,
                                            confirm_cancel=args.confirm_cancel, **limits)
            progress.result = result
            if printer is not None:
                printer.end_line()
    finally:
        await store.close()
    code = _report(result, args, printer, out, err, settings)
    progress.reported = True
    return code


async def _sessions(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .diagrams import latest_plan
    from .store.sessions import load_session, read_turns
    from .types.codec import unstructure
    from .types.plan import one_line

    store = await _checked_store(args.store, create=False)
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
            from .orchestration.links import session_tree
            from .orchestration.show import tree_data

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
            from .orchestration.show import link_lines

            out.write("\n".join(await link_lines(store, rec.session_id)) + "\n")
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


async def _control(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .store.sessions import send_control
    from .store.base import ControlKind

    kind = ControlKind(args.kind)
    if kind in (ControlKind.STEER, ControlKind.FOLLOWUP) and not args.text:
        raise ConfigurationError(f"control {kind.value} needs a TEXT")
    store = await _checked_store(args.store, create=False)
    try:
        note = await send_control(store, args.session_id, kind, args.text or "")
    finally:
        await store.close()
    err.write(note + "\n")
    return 0


async def _serve(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .server.auth import Tenants, check_bind
    from .server.serve import serve
    from .server.worker import load_agent

    if not 0 <= args.port <= 65535:
        raise ConfigurationError(f"--port {args.port}: give 0 (any free port) to 65535")
    tenants = Tenants.from_file(args.tokens) if args.tokens else Tenants.from_env()
    check_bind(args.host, tenants)  # before any model server starts
    a2a = None
    if args.a2a is not None:
        from .server.a2a import A2AConfig

        a2a = A2AConfig(name=args.a2a, description=args.a2a_description)  # a bad name fails before any server
    store = await _checked_store(args.store)
    try:
        if args.agent:
            agent = load_agent(args.agent)
            agent.store = store
            await serve(agent, host=args.host, port=args.port, tenants=tenants, cors_origins=args.cors_origin,
                        local_runs=args.local_runs, out=err, a2a=a2a)
            return 0
        from .config import RunConfig

        settings: dict[str, Any] = {"provider": "local", "base_url": None, "model": None, "tool_mode": None, "tools": [],
                                    "system": None, "middleware": [], "default_middleware": True, "policy": None,
                                    "approve_tools": [], "local_model": _local_model(None, "local")}
        async with _AgentFactory(settings, None, err) as factory:
            agent = factory.agent(store, RunConfig(), [])
            await serve(agent, host=args.host, port=args.port, tenants=tenants, cors_origins=args.cors_origin,
                        local_runs=args.local_runs, out=err, a2a=a2a)
        return 0
    finally:
        await store.close()


def _diagram(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .diagrams import check_diagram, chains_of, default_diagram_path, render_machine, trace_of, write_diagram

    if args.plan:
        return _plan_diagram(args, out, err)

    if args.check:
        path = (args.output or default_diagram_path()).resolve()
        problem = check_diagram(path)
        if problem:
            err.write(problem + "\n")
            return 1
        err.write(f"{path} is up to date\n")
        return 0
    chains = chains_of(args.agent) if args.agent else None
    trace = trace_of(Path(args.trace)) if args.trace else None
    if trace is not None and not trace:
        raise ConfigurationError(f"--trace {args.trace} holds no transition events (an empty file?); produce it "
                                 "with `fsm-agent sessions show ID --events > FILE`")
    if chains is None and trace is None and not args.stdout:
        path = write_diagram(args.output)
        err.write(f"wrote {path}\n")
        return 0
    text = render_machine(chains=chains, trace=trace, title=args.agent or (Path(args.trace).name if args.trace else None))
    if args.output:
        args.output.write_text(text)
        err.write(f"wrote {args.output.resolve()}\n")
    else:
        out.write(text)
    return 0


def _plan_diagram(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``diagram --plan EVENTS.jsonl``: the session's PlanAct plan (its last ``plan_updated``) as a flowchart."""
    from .diagrams import latest_plan, render_plan

    if args.check or args.agent or args.trace:
        raise ConfigurationError("--plan renders a session's plan on its own; leave out --check, --agent and --trace")
    path = Path(args.plan)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path}: {exc.strerror or exc}") from exc
    events = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                events.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise ConfigurationError(f"{path}:{n}: not a JSON event line ({exc}); produce the file with "
                                         "`fsm-agent sessions show ID --events`") from exc
    plan = latest_plan(events)
    if plan is None:
        raise ConfigurationError(f"{path} holds no plan_updated event: the session ran without the planact plugin "
                                 "(or this is not its `fsm-agent sessions show ID --events` output)")
    text = render_plan(plan)
    if args.output:
        args.output.write_text(text)
        err.write(f"wrote {args.output.resolve()}\n")
    else:
        out.write(text)
    return 0


def _decode(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``decode``: never a traceback. Whatever the body, the outcome is JSON on stdout or one line on
    stderr; an exception of fsm_agent's own (a bug) is reported in one line too, with exit 1."""
    from .providers.decode import decode_body

    headers: dict[str, str] = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise ConfigurationError(f"--header {h!r}: give NAME: VALUE (e.g. 'Retry-After: 30')")
        headers[name.strip().lower()] = value.strip()
    if headers and args.status is None:
        raise ConfigurationError("--header goes with --status (the headers of an error response)")
    if args.status is not None and not 100 <= args.status <= 599:
        raise ConfigurationError(f"--status {args.status}: an HTTP status is 100 to 599")
    if args.input == "-":
        raw = sys.stdin.buffer.read()
    else:
        try:
            raw = Path(args.input).read_bytes()
        except OSError as exc:
            raise ConfigurationError(f"cannot read {args.input}: {exc.strerror or exc}") from None
    try:
        return decode_body(args.protocol, raw, out=out, err=err, events=args.events, status=args.status,
                           headers=headers)
    except (FsmAgentError, OSError):
        raise  # main reports them (and a closed stdout)
    except Exception as exc:  # noqa: BLE001 - a bug of ours: one line, not a traceback
        err.write(f"fsm-agent decode: internal error ({type(exc).__name__}: {str(exc)[:500]}); please report it "
                  "with the body\n")
        return 1


def _middleware(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .plugins import discover, load_plugin

    plugins = discover()
    if not plugins:
        out.write("no middleware plugins installed\n")
        return 0
    for p in plugins:
        try:
            cls = load_plugin(p.name)
            o = cls.ordering
            parts = []
            if o.position:
                parts.append(o.position)
            parts += [f"wraps {', '.join(o.wraps)}"] if o.wraps else []
            parts += [f"wrapped_by {', '.join(o.wrapped_by)}"] if o.wrapped_by else []
            parts += [f"requires {', '.join(o.requires)}"] if o.requires else []
            hooks = [h for h in ("pre_turn", "wrap_model_call", "on_model_event", "on_tool_call", "wrap_tool_call",
                                 "post_turn") if getattr(cls, h) is not getattr(cls.__mro__[-2], h, None)]
            doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")
            out.write(f"{p.name:<16} {p.target:<44} [{p.distribution}] failure={getattr(cls.failure_policy, 'value', cls.failure_policy)}"
                      f" order={'; '.join(parts) or 'as listed'}\n"
                      f"{'':<16} hooks: {', '.join(hooks) or '-'} — {doc}\n")
        except ConfigurationError as exc:
            out.write(f"{p.name:<16} {p.target:<44} [{p.distribution}] BROKEN: {exc}\n")
    return 0


# -- parser -------------------------------------------------------------------------------------
def _names(value: str) -> list[str]:
    """``--approve-tools calculator,clock``: one value, comma-separated names."""
    names = [n.strip() for n in value.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{value!r}: give NAME or NAME,NAME... (no empty names)")
    return names


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="session store: SQLite path or postgresql:// DSN ($FSM_AGENT_STORE, "
                   "default ~/.fsm-agent/sessions.db)")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsm-agent", description="Run LLM agents as an explicit state machine.")
    p.add_argument("--version", action="version", version=f"fsm-agent {__version__}")
    sub = p.add_subparsers(dest="command", required=True,  # the metavar: a missing command names them all
                           metavar="{run,resume,sessions,control,serve,worker,diagram,decode,middleware}")

    r = sub.add_parser("run", help="run one task to a stop reason")
    r.add_argument("task", help="what the agent should do")
    r.add_argument("--provider", help="local (the embedded model, the default), openai, openai-responses, anthropic, "
                   "deepseek, qwen, openai-compatible (needs --base-url), llamacpp (a llama-server at --base-url); "
                   "default: $FSM_AGENT_PROVIDER, else local")
    r.add_argument("--base-url", help="provider base URL ($FSM_AGENT_BASE_URL)")
    r.add_argument("--model", help="model name ($FSM_AGENT_MODEL)")
    r.add_argument("--api-key", help="API key ($FSM_AGENT_API_KEY, or the vendor's own variable)")
    r.add_argument("--local-model", metavar="PATH.gguf",
                   help="run this GGUF model on the embedded llama.cpp server instead of SmolLM2-135M "
                        "($FSM_AGENT_LOCAL_MODEL); tools need a 0.5B+ instruct model, e.g. Qwen2.5-0.5B-Instruct. "
                        "llama.cpp threads: $LLAMA_ARG_THREADS, default the usable CPUs minus one")
    r.add_argument("--tool", action="append", default=[], metavar="NAME",
                   help="enable a demo tool: calculator, clock (repeatable)")
    r.add_argument("--tool-mode", choices=["native", "constrained"], help="override the profile's tool-calling mode")
    r.add_argument("--system", help="system prompt")
    r.add_argument("--middleware", action="append", default=[], metavar="NAME",
                   help="add an installed middleware plugin (see `fsm-agent middleware list`)")
    r.add_argument("--no-default-middleware", action="store_true",
                   help=f"leave out the default plugins ({', '.join(DEFAULT_MIDDLEWARE)})")
    r.add_argument("--policy", metavar="FILE",
                   help="a tool policy file: allow / deny / ask rules per tool and argument (TOML, or JSON when "
                        "FILE ends in .json; format: docs/policy.md of the fsm_agent repository)")
    r.add_argument("--approve-tools", type=_names, action="extend", default=[], metavar="NAME[,NAME...]",
                   help="these tools (names or glob patterns, comma-separated; repeatable) need a person's "
                        "approval: the run stops WAITING_HUMAN (exit 3) until `fsm-agent resume ID --approve CALL_ID`")
    r.add_argument("--max-iterations", type=int, default=50, help="model calls per run (default 50)")
    r.add_argument("--timeout", type=float, default=600.0, help="wall-clock budget in seconds (default 600)")
    r.add_argument("--max-tokens", type=int, help="token budget over the run (input + output)")
    r.add_argument("--max-output-tokens", type=int, help="max tokens of each model answer")
    r.add_argument("--no-stream", action="store_true", help="do not stream model answers")
    r.add_argument("--session-id", help="id for the new session (default: random)")
    r.add_argument("--json", action="store_true", help="print the run's result as JSON on stdout")
    r.add_argument("-v", "--verbose", action="store_true", help="show every state transition on stderr")
    _common(r)

    rs = sub.add_parser("resume", help="continue a stopped session")
    rs.add_argument("session_id")
    rs.add_argument("--approve", action="append", default=[], metavar="CALL", help="approve a pending tool call")
    rs.add_argument("--reject", action="append", default=[], metavar="CALL", help="reject a pending tool call")
    rs.add_argument("--message", action="append", default=[], metavar="TEXT",
                    help="the model-facing reason of the --reject at the same position")
    rs.add_argument("--edit", action="append", default=[], metavar="CALL=JSON", help="run a call with new arguments")
    rs.add_argument("--respond", action="append", default=[], metavar="CALL=TEXT",
                    help="answer a call yourself instead of running the tool")
    rs.add_argument("--budget", action="append", default=[], metavar="NAME=VALUE",
                    help="raise a budget: iterations, wall_clock (s), tokens, cost (USD)")
    rs.add_argument("--max-output-tokens", type=int, metavar="N",
                    help="max tokens of each model answer from now on (e.g. after an answer was cut)")
    rs.add_argument("--confirm-cancel", action="store_true", help="confirm a cancel waiting on side effects")
    rs.add_argument("--api-key", help="API key for the session's provider")
    rs.add_argument("--local-model", metavar="PATH.gguf",
                    help="for a session on the embedded model: the GGUF file to run (default: the run's own)")
    rs.add_argument("--json", action="store_true")
    rs.add_argument("-v", "--verbose", action="store_true")
    _common(rs)

    s = sub.add_parser("sessions", help="list and inspect sessions")
    ss = s.add_subparsers(dest="sessions_command", required=True, metavar="{list,show}")
    sl = ss.add_parser("list")
    sl.add_argument("--limit", type=int, default=50)
    sl.add_argument("--json", action="store_true")
    _common(sl)
    sh = ss.add_parser("show")
    sh.add_argument("session_id")
    sh.add_argument("--events", action="store_true", help="print the event log as JSON lines")
    sh.add_argument("--turns", action="store_true",
                    help="print one line per turn (input, context hash, model call, tool calls, verification, "
                         "stop); with --json, one JSON object per turn")
    sh.add_argument("--json", action="store_true")
    _common(sh)

    c = sub.add_parser("control", help="send a control event to a session (from any process)")
    c.add_argument("session_id")
    c.add_argument("kind", choices=["interrupt", "cancel", "steer", "followup"])
    c.add_argument("text", nargs="?", default="", help="the new direction (steer) or request (followup)")
    _common(c)

    d = sub.add_parser("diagram", help="render the state machine as Mermaid")
    d.add_argument("--check", action="store_true", help="exit 1 when the committed diagram (or --output) differs")
    d.add_argument("--output", "-o", type=Path, default=None,
                   help="file to write or check (default: diagrams/agent_loop.mmd of the fsm_agent checkout, "
                        "wherever you run this; an installed copy needs --output)")
    d.add_argument("--stdout", action="store_true", help="print instead of writing")
    d.add_argument("--agent", metavar="MODULE:ATTR", help="show the middleware chains of this Agent")
    d.add_argument("--trace", metavar="EVENTS.jsonl", help="mark the path of a run (`fsm-agent sessions show ID --events`)")
    d.add_argument("--plan", metavar="EVENTS.jsonl",
                   help="render the run's PlanAct plan as a Mermaid flowchart instead (from `sessions show ID --events`)")

    dc = sub.add_parser("decode", help="decode a recorded provider response body (stdin) to JSON")
    dc.add_argument("--protocol", required=True, choices=["openai-chat", "openai-responses", "anthropic"])
    dc.add_argument("--events", action="store_true", help="print each stream event as one JSON line")
    dc.add_argument("--status", type=int, metavar="N",
                    help="the HTTP status the body came with; from 400 up, print the typed error the HTTP path "
                         "raises for it (class, kind, retryable, retry_after, message) as JSON and exit 0")
    dc.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                    help="a response header given with --status (Retry-After, x-should-retry; repeatable)")
    dc.add_argument("input", nargs="?", default="-", help="file to read (default: stdin)")

    sv = sub.add_parser("serve", help="serve sessions over HTTP: runs, a live event stream, approvals, the review page")
    sv.add_argument("--agent", metavar="MODULE:ATTR",
                    help="the Agent to serve (an Agent, or a callable returning one); default: the embedded model "
                         "with the default plugins")
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; any other needs tokens)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    sv.add_argument("--tokens", metavar="FILE",
                    help="bearer tokens, one TENANT:TOKEN per line ($FSM_AGENT_TOKENS_FILE, or "
                         "$FSM_AGENT_TOKENS=tenant:token,...); without tokens only loopback is served")
    sv.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                    help="allow cross-origin calls from this origin (repeatable; default: CORS off)")
    sv.add_argument("--local-runs", action="store_true",
                    help="with a postgresql:// store: run in this process instead of queueing for `fsm-agent worker`")
    sv.add_argument("--a2a", metavar="NAME",
                    help="also serve the agent over A2A 1.0 (JSON-RPC at /a2a, its card at "
                         "/.well-known/agent-card.json) under this name; see docs/a2a.md")
    sv.add_argument("--a2a-description", metavar="TEXT", default="An fsm_agent agent.",
                    help="what the agent does, for its A2A card (with --a2a)")
    _common(sv)

    from .server.worker import add_worker_command

    add_worker_command(sub)

    m = sub.add_parser("middleware", help="installed middleware plugins")
    ms = m.add_subparsers(dest="middleware_command", required=True, metavar="{list}")
    ms.add_parser("list")
    return p


def _ended(exc: SessionEndedError, err: TextIO) -> None:
    """``resume`` of a session that ended for good: say so, with its stored stop (nothing ran)."""
    err.write(f"fsm-agent: session {exc.session_id} already ended {exc.reason.value}; nothing was run again "
              f"(fsm-agent sessions show {exc.session_id} for its record)\n")
    if exc.result is not None:
        stop = exc.result.stop
        _stop_lines(stop.reason, stop.detail, stop.error, [], err)


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point; returns the exit code (the console script exits with it)."""
    out = out or sys.stdout
    err = err or sys.stderr
    args = _build_parser().parse_args(argv)
    progress = _Progress()
    try:
        if args.command == "run":
            return asyncio.run(_run(args, out, err, progress))
        if args.command == "resume":
            return asyncio.run(_resume(args, out, err, progress))
        if args.command == "sessions":
            return asyncio.run(_sessions(args, out, err))
        if args.command == "control":
            return asyncio.run(_control(args, out, err))
        if args.command == "serve":
            return asyncio.run(_serve(args, out, err))
        if args.command == "worker":
            return int(args.handler(args, out, err))
        if args.command == "diagram":
            return _diagram(args, out, err)
        if args.command == "decode":
            return _decode(args, out, err)
        if args.command == "middleware":
            return _middleware(args, out, err)
    except SessionExistsError as exc:  # Agent.run found the id taken (a race with the check in _run)
        err.write(f"fsm-agent: {_session_exists(exc.session_id)}\n")
        return 2
    except SessionEndedError as exc:  # resume of a session that ended for good: its stored result, nothing run
        _ended(exc, err)
        return 2
    except UserError as exc:  # configuration, usage, unknown or final sessions
        err.write(f"fsm-agent: {exc}\n")
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (the first drains the run)
        return _after_second_interrupt(progress, args, out, err)
    except BrokenPipeError:  # `... | head`: the reader went away; that is not an error
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return 0
    except FsmAgentError as exc:
        err.write(f"fsm-agent: {exc}\n")
        return 1
    except OSError as exc:  # a file named on the command line
        err.write(f"fsm-agent: {exc.strerror or exc}: {exc.filename or ''}\n")
        return 1
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
