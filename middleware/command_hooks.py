"""Command hooks: external commands run before and after each model call and each tool call.

Seed 000 (``HookExecutor``): hooks let a user put their own logic around the agent's LLM calls and
tool calls without writing a plugin. A hook is a command; it gets a JSON description of the event
on stdin and runs with a timeout. Its exit code decides:

==========  ==========================================================================================
exit ``0``  go on (a before-hook allows; an after-hook observed)
exit ``1``  a **before**-hook denies: ``before_model_call``: the model call is not made and the run
            stops FAILED_TERMINAL naming the hook and its stderr (``error.kind`` ``hook_denied``);
            ``before_tool_call``: the tool does not run and the model gets an error result with the
            hook's stderr as the reason. On an after-hook, exit 1 is a failure (see below).
other       a failure, as are a timeout (the hook's process group is killed), a command that cannot
            start (reported as exit 127, or 126 when it is not executable, as a shell would) and a
            signal (exit ``-N``). It follows the hook's ``on_failure``: ``fail_open`` (the default, as
            in the seed: logged, and the run goes on) or ``fail_closed``: a before-tool hook denies the
            call (as exit 1 would); a before-model hook stops the run before the call, an after-model
            hook stops it without using the answer, and an after-tool hook stops it once the turn's
            calls are done (the tool ran: its result is kept), all FAILED_TERMINAL with ``error.kind``
            ``hook_failed``.
==========  ==========================================================================================

Hooks of one event run one after another in file order; the first that denies (or fails closed)
ends that event's round. Every hook run is an event of the run (:class:`CommandHookRan`, session log
type ``command_hook``; observers get it through ``on_plugin_event``): the hook, its exit code, how
long it ran, and the outcome.

**Replay.** Each hook run is one effect of the run (``ctx.plugin_effect``): a recorded run replays
with the recorded exit codes and output, and runs no command; on Temporal, a hook runs as an
activity, on the worker, which finds the hook in its own agent's configuration.

The file format (TOML, or JSON when the name ends in ``.json``; ``docs/hooks.md`` has the whole
reference)::

    version = 1

    [[before_model_call]]
    name = "budget-gate"
    command = ["python3", "gate.py"]      # argv, run without a shell; a string is split like a shell
    timeout = 5                           # seconds (default 5)
    on_failure = "fail_closed"            # or "fail_open" (the default)

    [[before_tool_call]]
    matcher = ["shell", "fs_*"]           # tool-name glob patterns (tool events only)
    command = "./check-tool.sh"

    [[after_model_call]]
    command = "logger -t agent"

Paths in a file's hooks are relative to the file's directory: hooks run there unless ``cwd`` says
otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import logging
import os
import shlex
import signal
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any, ClassVar

import orjson
from attrs import field, frozen

from fsm_agent import Deny, Middleware, Ordering, RunContext, StopReason, StopRun
from fsm_agent.errors import ConfigurationError
from fsm_agent.types import Message, MessageRequest, MessageResponse, ToolResultMessage, ToolUseBlock, unstructure

__all__ = ["EVENTS", "FAILURE_POLICIES", "CommandHook", "CommandHookRan", "CommandHooks"]

log = logging.getLogger("fsm_agent.middleware.command_hooks")

EVENTS = ("before_model_call", "after_model_call", "before_tool_call", "after_tool_call")
"""The events a hook can run on."""

_ALIASES = {"before_llm_call": "before_model_call", "after_llm_call": "after_model_call"}
"""The seed's names for the model events, accepted too."""

FAILURE_POLICIES = ("fail_open", "fail_closed")
"""What a failing hook does: ``fail_open`` (logged, the run goes on) or ``fail_closed`` (deny or stop)."""

DEFAULT_TIMEOUT = 5.0
"""Seconds a hook may run (the seed's 5000 ms)."""

MAX_TIMEOUT = 3600.0

_KEYS = frozenset({"name", "command", "shell", "timeout", "on_failure", "matcher", "cwd", "env", "include_messages"})
_CUT = 2000  # characters of a hook's stderr / stdout kept in events, stop details and denials


def _cut(text: str, most: int = _CUT) -> str:
    return text if len(text) <= most else text[:most - 1] + "…"


def _seconds(x: float) -> str:
    return f"{x:g} s"


# -- the configuration ---------------------------------------------------------------------------
@frozen
class CommandHook:
    """One hook: a command run on one event.

    Attributes:
        event: one of :data:`EVENTS`.
        command: the argv (run without a shell), or with ``shell`` the command line for ``/bin/sh -c``.
        name: shown in events, denials and stops (default: the command, cut).
        timeout: seconds the hook may run (0 < timeout <= 3600); then its process group is killed.
        on_failure: ``fail_open`` or ``fail_closed`` (see the module doc).
        shell: run ``command`` with ``/bin/sh -c`` (only when the configuration says so).
        matcher: tool-name glob patterns (:func:`fnmatch.fnmatchcase`); tool events only; empty: every tool.
        cwd: the directory the hook runs in (``None``: the process's current directory).
        env: variables added to the hook's environment (it inherits the process's).
        include_messages: model events: put the whole conversation of the call in the JSON
            (``messages``); by default only a summary and the last message.
    """

    event: str
    command: tuple[str, ...] | str
    name: str = ""
    timeout: float = DEFAULT_TIMEOUT
    on_failure: str = "fail_open"
    shell: bool = False
    matcher: tuple[str, ...] = ()
    cwd: str | None = None
    env: Mapping[str, str] = field(factory=dict)
    include_messages: bool = False

    @classmethod
    def from_dict(cls, event: str, data: Mapping[str, Any], *, base: Path | None = None,
                  where: str = "hook") -> CommandHook:
        """A hook of ``event`` from one table of a hooks file (``base``: the file's directory, which
        relative ``cwd`` values and the default ``cwd`` are taken from).

        Raises:
            ConfigurationError: an unknown event or key, a value of the wrong type or out of range.
        """
        problems: list[str] = []
        ev = _ALIASES.get(event, event)
        if ev not in EVENTS:
            raise ConfigurationError(f"{where}: unknown hook event {event!r}; events: {', '.join(EVENTS)}")
        if not isinstance(data, Mapping):
            raise ConfigurationError(f"{where}: a hook is a table (command = ..., timeout = ...), not {data!r}")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            problems.append(f"unknown key(s) {', '.join(map(repr, unknown))}; keys: {', '.join(sorted(_KEYS))}")
        shell = data.get("shell", False)
        if not isinstance(shell, bool):
            problems.append(f"shell is true or false, not {shell!r}")
            shell = False
        raw = data.get("command")
        command: tuple[str, ...] | str = ()
        if raw is None:
            problems.append("command is required (an argv list, or a string)")
        elif isinstance(raw, str):
            if not raw.strip():
                problems.append("command is empty")
            elif shell:
                command = raw
            else:
                try:
                    command = tuple(shlex.split(raw))
                except ValueError as exc:
                    problems.append(f"command {raw!r} cannot be split into arguments: {exc}")
        elif isinstance(raw, (list, tuple)) and raw and all(isinstance(a, str) for a in raw):
            if shell:
                problems.append("with shell = true, command is one string (the command line), not a list")
            elif not raw[0]:
                problems.append("command's program (its first item) is empty")
            else:
                command = tuple(raw)
        else:
            problems.append(f"command is a non-empty list of strings or a string, not {raw!r}")
        timeout = data.get("timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
            problems.append(f"timeout is seconds, 0 < timeout <= {MAX_TIMEOUT:g}, not {timeout!r}")
            timeout = DEFAULT_TIMEOUT
        on_failure = data.get("on_failure", "fail_open")
        if on_failure not in FAILURE_POLICIES:
            problems.append(f"on_failure is 'fail_open' or 'fail_closed', not {on_failure!r}")
        matcher = data.get("matcher", ())
        if isinstance(matcher, str):
            matcher = (matcher,)
        if not isinstance(matcher, (list, tuple)) or not all(isinstance(m, str) and m for m in matcher):
            problems.append(f"matcher is a tool-name glob pattern or a list of them, not {matcher!r}")
            matcher = ()
        elif matcher and not ev.endswith("_tool_call"):
            problems.append(f"matcher picks tools; {ev} is not a tool event")
        elif any("|" in m for m in matcher):
            problems.append(f"matcher {list(matcher)!r}: patterns are globs (shell, fs_*), not regular expressions; "
                            "list several patterns instead of joining them with '|'")
        cwd = data.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not cwd):
            problems.append(f"cwd is a directory path, not {cwd!r}")
            cwd = None
        if base is not None:
            cwd = str(base / cwd) if cwd is not None else str(base)
        env = data.get("env", {})
        if not isinstance(env, Mapping) or not all(isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                                                   for k, v in env.items()):
            problems.append(f"env is a table of strings (NAME = \"value\"), not {env!r}")
            env = {}
        include = data.get("include_messages", False)
        if not isinstance(include, bool):
            problems.append(f"include_messages is true or false, not {include!r}")
            include = False
        elif include and not ev.endswith("_model_call"):
            problems.append(f"include_messages is for the model events, not {ev}")
        name = data.get("name")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            problems.append(f"name is a non-empty string, not {name!r}")
            name = None
        if problems:
            raise ConfigurationError(f"{where} ({ev}): " + "; ".join(problems))
        if name is None:
            name = _cut(command if isinstance(command, str) else shlex.join(command), 60)
        return cls(ev, command, name, float(timeout), on_failure, shell, tuple(matcher), cwd, dict(env), include)

    @classmethod
    def parse(cls, spec: str) -> CommandHook:
        """A hook from the command line's ``EVENT=COMMAND`` (``--hook``): the command is split like a
        shell does (no shell runs it), with the default timeout and failure policy, in the current
        directory.

        Raises:
            ConfigurationError: no ``=``, an unknown event, or an empty command.
        """
        event, sep, command = spec.partition("=")
        if not sep:
            raise ConfigurationError(f"--hook {spec!r}: write EVENT=COMMAND, e.g. --hook 'before_tool_call=python3 "
                                     f"check.py'; events: {', '.join(EVENTS)}")
        return cls.from_dict(event.strip(), {"command": command}, where=f"--hook {spec!r}")

    def matches(self, tool: str | None) -> bool:
        """Whether this hook runs for a call of ``tool`` (``None``: a model event)."""
        return not self.matcher or (tool is not None and any(fnmatch.fnmatchcase(tool, p) for p in self.matcher))


# -- the event -----------------------------------------------------------------------------------
@frozen
class CommandHookRan:
    """A command hook ran (session log type ``command_hook``; observers get it through
    ``on_plugin_event``)."""

    TAG: ClassVar[str] = "command_hook"
    session_id: str
    turn: int
    hook: str
    """The hook's name."""
    event: str
    """One of :data:`EVENTS`."""
    exit_code: int | None
    """The hook's exit code (127 / 126: it could not start; ``-N``: killed by signal N); ``None``: it
    timed out, or a worker could not find it."""
    duration_s: float
    """How long it ran (seconds)."""
    outcome: str
    """``allowed`` (a before-hook exited 0), ``observed`` (an after-hook exited 0), ``denied`` (a
    before-hook exited 1), ``failed_open`` (a failure, and the run went on) or ``failed_closed`` (a
    failure that denied the call or stopped the run)."""
    on_failure: str
    """The hook's failure policy."""
    failure: str | None = None
    """Why the run counts it as failed (``timed out after 5 s``, ``exited with 2`` ...), or ``None``."""
    stderr: str = ""
    """What it wrote on stderr (cut): the reason of a denial."""
    stdout: str = ""
    """What it wrote on stdout (cut)."""
    tool: str | None = None
    """Tool events: the tool's name."""
    tool_call_id: str | None = None
    """Tool events: the call's id."""


@frozen
class _Verdict:
    """A hook that denied, or failed closed: what the run does about it."""

    hook: CommandHook
    denied: bool
    failure: str | None
    reason: str

    @property
    def why(self) -> str:
        if self.denied:
            return f"{self.hook.event} hook {self.hook.name!r} denied it: {self.reason or 'no reason given'}"
        said = f": {self.reason}" if self.reason else ""
        return f"{self.hook.event} hook {self.hook.name!r} failed ({self.failure}) and fails closed{said}"

    def error(self) -> dict[str, Any]:
        return {"kind": "hook_denied" if self.denied else "hook_failed", "hook": self.hook.name,
                "event": self.hook.event, "message": self.reason, **({} if self.denied else {"failure": self.failure})}


# -- running one command -------------------------------------------------------------------------
def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """Kill the hook's process group (it was started in a session of its own)."""
    killpg = getattr(os, "killpg", None)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if killpg is not None:
            killpg(proc.pid, signal.SIGKILL)
        elif proc.returncode is None:
            proc.kill()


async def _read_capped(stream: asyncio.StreamReader | None, cap: int) -> tuple[bytes, bool]:
    """Everything ``stream`` gives until EOF, keeping the first ``cap`` bytes (and whether more came)."""
    if stream is None:
        return b"", False
    kept = bytearray()
    total = 0
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(kept), total > cap
        total += len(chunk)
        if len(kept) < cap:
            kept += chunk[:cap - len(kept)]


async def _feed(stdin: asyncio.StreamWriter | None, data: bytes) -> None:
    if stdin is None:
        return
    try:
        stdin.write(data)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the hook did not read its input: its exit code still decides
    finally:
        stdin.close()


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


async def run_command(hook: CommandHook, data: bytes, *, max_output_bytes: int = 65536) -> dict[str, Any]:
    """Run ``hook``'s command with ``data`` on stdin, within its timeout; never raises for the hook's
    own failures (they are in the result).

    Returns:
        ``{"exit_code": int | None, "timed_out": bool, "error": str | None, "stdout": str,
        "stderr": str, "stdout_truncated": bool, "stderr_truncated": bool, "duration_s": float}``;
        each stream keeps its first ``max_output_bytes`` bytes (decoded as UTF-8, bad bytes replaced).
        A command that cannot start has ``exit_code`` 127 (not found) or 126 (not executable) and
        ``error`` saying why; a timeout has ``exit_code`` ``None``.
    """
    started = time.monotonic()
    env = {**os.environ, **hook.env} if hook.env else None
    pipes: dict[str, Any] = {"stdin": asyncio.subprocess.PIPE, "stdout": asyncio.subprocess.PIPE,
                             "stderr": asyncio.subprocess.PIPE, "cwd": hook.cwd, "env": env,
                             "start_new_session": True}
    try:
        if hook.shell:
            proc = await asyncio.create_subprocess_shell(str(hook.command), **pipes)
        else:
            proc = await asyncio.create_subprocess_exec(*hook.command, **pipes)
    except OSError as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        program = hook.command if isinstance(hook.command, str) else hook.command[0]
        what = "not found" if code == 127 else "cannot be run"
        return {"exit_code": code, "timed_out": False,
                "error": f"{program!r} {what}: {exc.strerror or exc}" + (f" (cwd {hook.cwd})" if hook.cwd else ""),
                "stdout": "", "stderr": "", "stdout_truncated": False, "stderr_truncated": False,
                "duration_s": round(time.monotonic() - started, 3)}
    feeder: asyncio.Future[None] = asyncio.ensure_future(_feed(proc.stdin, data))
    out = asyncio.ensure_future(_read_capped(proc.stdout, max_output_bytes))
    err = asyncio.ensure_future(_read_capped(proc.stderr, max_output_bytes))
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), hook.timeout)
    except TimeoutError:
        timed_out = True
    except BaseException:  # cancelled (the run was cut): leave nothing running
        _kill_group(proc)
        feeder.cancel()
        out.cancel()
        err.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(proc.wait(), 2.0)
        raise
    _kill_group(proc)  # a timeout, or what the hook left running in its group
    if timed_out:
        await proc.wait()
    duration = round(time.monotonic() - started, 3)
    pending: set[asyncio.Future[Any]] = {feeder, out, err}
    done, late = await asyncio.wait(pending, timeout=2.0)  # one that left the group may hold a pipe
    for task in late:
        task.cancel()
    stdout, stdout_cut = out.result() if out in done and out.exception() is None else (b"", False)
    stderr, stderr_cut = err.result() if err in done and err.exception() is None else (b"", False)
    return {"exit_code": None if timed_out else proc.returncode, "timed_out": timed_out, "error": None,
            "stdout": _text(stdout), "stderr": _text(stderr), "stdout_truncated": stdout_cut,
            "stderr_truncated": stderr_cut, "duration_s": duration}


# -- the plugin ----------------------------------------------------------------------------------
class CommandHooks(Middleware):
    """Run command hooks before and after each model call and tool call (see the module doc).

    Args:
        hooks: the hooks (:class:`CommandHook`, or ``(event, table)`` pairs as in a hooks file).
        max_output_bytes: the bytes of each of a hook's stdout and stderr kept (the rest is read and
            dropped, so a chatty hook never blocks).

    Raises:
        ConfigurationError: a bad hook, or ``max_output_bytes`` not a positive integer.
    """

    name = "command_hooks"
    ordering = Ordering(wraps=("retry", "approval"), wrapped_by=("verifier",))

    def __init__(self, hooks: Iterable[CommandHook | tuple[str, Mapping[str, Any]]] = (), *,
                 max_output_bytes: int = 16384) -> None:
        if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int) or max_output_bytes < 1:
            raise ConfigurationError(f"max_output_bytes is a positive integer, not {max_output_bytes!r}")
        built: list[CommandHook] = []
        for h in hooks:
            if isinstance(h, CommandHook):
                built.append(h)
            elif isinstance(h, tuple) and len(h) == 2 and isinstance(h[0], str):
                built.append(CommandHook.from_dict(h[0], h[1]))
            else:
                raise ConfigurationError(f"a hook is a CommandHook or an (event, table) pair, not {h!r}")
        self.hooks: tuple[CommandHook, ...] = tuple(built)
        self.max_output_bytes = max_output_bytes

    def __repr__(self) -> str:
        return f"CommandHooks({len(self.hooks)} hook(s): {', '.join(f'{h.event}:{h.name}' for h in self.hooks)})"

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "hooks", base: Path | None = None,
                  **options: Any) -> CommandHooks:
        """The hooks of a parsed hooks file: ``{"version": 1, "<event>": [table, ...], ...}``.

        Raises:
            ConfigurationError: an unknown top-level key or version, an event that is not a list of
                tables, a bad hook.
        """
        if not isinstance(data, Mapping):
            raise ConfigurationError(f"{source}: a hooks file is a table of events, not {type(data).__name__}")
        version = data.get("version", 1)
        if version != 1 or isinstance(version, bool):
            raise ConfigurationError(f"{source}: version {version!r} is not supported (the only version is 1)")
        hooks: list[CommandHook] = []
        for key, tables in data.items():
            if key == "version":
                continue
            if _ALIASES.get(key, key) not in EVENTS:
                raise ConfigurationError(f"{source}: unknown key {key!r}; a hooks file has `version` and the events "
                                         f"{', '.join(EVENTS)} (each a list of hooks: [[{EVENTS[0]}]])")
            if not isinstance(tables, list):
                raise ConfigurationError(f"{source}: {key} is a list of hooks ([[{key}]] in TOML), not {tables!r}")
            for i, table in enumerate(tables, 1):
                hooks.append(CommandHook.from_dict(key, table, base=base, where=f"{source}: {key} hook {i}"))
        return cls(hooks, **options)

    @classmethod
    def from_file(cls, path: str | PathLike[str], **options: Any) -> CommandHooks:
        """Load a hooks file: TOML, or JSON when the name ends in ``.json``. The file's hooks run in
        its directory (unless their ``cwd`` says otherwise; a relative ``cwd`` is taken from there).

        Raises:
            ConfigurationError: the file cannot be read or parsed, or a hook is invalid.
        """
        source = str(path)
        try:
            text = Path(path).read_bytes()
            data = json.loads(text) if source.endswith(".json") else tomllib.loads(text.decode("utf-8"))
        except OSError as exc:
            raise ConfigurationError(f"{source}: cannot read the hooks file: {exc.strerror or exc}") from exc
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            kind = "JSON" if source.endswith(".json") else "TOML"
            raise ConfigurationError(f"{source}: invalid {kind}: {exc}") from exc
        return cls.from_dict(data, source=source, base=Path(path).resolve().parent, **options)

    @classmethod
    def from_cli(cls, file: str | PathLike[str] | None = None, specs: Iterable[str] = ()) -> CommandHooks:
        """The hooks of ``--hooks FILE`` (first) and each ``--hook EVENT=COMMAND`` (after them).

        Raises:
            ConfigurationError: see :meth:`from_file` and :meth:`CommandHook.parse`.
        """
        hooks = list(cls.from_file(file).hooks) if file else []
        hooks += [CommandHook.parse(s) for s in specs]
        return cls(hooks)

    # -- the effect (through ctx.plugin_effect: recorded, replayed, run where effects run) ----------
    async def run_hook(self, index: int, name: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Run hook number ``index`` (whose name is ``name``) with ``payload`` as its JSON input; an
        effect of the run. See :func:`run_command` for the result."""
        hook = self.hooks[index] if isinstance(index, int) and 0 <= index < len(self.hooks) else None
        if hook is None or hook.name != name:
            return {"exit_code": None, "timed_out": False, "stdout": "", "stderr": "", "stdout_truncated": False,
                    "stderr_truncated": False, "duration_s": 0.0,
                    "error": f"this process's command_hooks have no hook {name!r} at position {index} (the agent "
                             "running the hooks must be configured with the same hooks)"}
        data = orjson.dumps(payload, default=str, option=orjson.OPT_NON_STR_KEYS)
        return await run_command(hook, data, max_output_bytes=self.max_output_bytes)

    # -- running an event's hooks ------------------------------------------------------------------
    def _for(self, event: str, tool: str | None = None) -> list[tuple[int, CommandHook]]:
        return [(i, h) for i, h in enumerate(self.hooks) if h.event == event and h.matches(tool)]

    async def _run(self, ctx: RunContext, hooks: list[tuple[int, CommandHook]], payload: dict[str, Any],
                   call: ToolUseBlock | None = None, messages: Sequence[Message] = ()) -> _Verdict | None:
        """Run ``hooks`` in order; the first that denies or fails closed ends the round (its verdict)."""
        base: dict[str, Any] = {"session_id": ctx.session_id, "turn": ctx.turn}
        tenant = ctx.metadata.get("tenant") if hasattr(ctx.metadata, "get") else None
        if isinstance(tenant, str):
            base["tenant"] = tenant
        base.update(payload)
        for index, hook in hooks:
            data = {"event": hook.event, "hook": hook.name, **base}
            if hook.include_messages:
                data["messages"] = [unstructure(m) for m in messages]
            res: dict[str, Any] = await ctx.plugin_effect(self, "run_hook", index, hook.name, data)
            code, stderr = res.get("exit_code"), str(res.get("stderr") or "")
            reason = _cut((stderr.strip() or str(res.get("stdout") or "").strip()))
            before = hook.event.startswith("before_")
            failure: str | None = None
            if res.get("timed_out"):
                failure = f"timed out after {_seconds(hook.timeout)}; its process group was killed"
            elif res.get("error"):
                failure = str(res["error"]) + (f" (exit code {code})" if code is not None else "")
            elif code == 0:
                pass
            elif code == 1 and before:
                pass
            elif isinstance(code, int) and code < 0:
                failure = f"killed by signal {-code}"
            else:
                failure = f"exited with {code}" + (" (exit 1 denies only in a before-hook)" if code == 1 else "")
            if failure is None:
                outcome = ("allowed" if code == 0 else "denied") if before else "observed"
            else:
                outcome = "failed_closed" if hook.on_failure == "fail_closed" else "failed_open"
            ctx.emit(CommandHookRan(ctx.session_id, ctx.turn, hook.name, hook.event, code,
                                    float(res.get("duration_s") or 0.0), outcome, hook.on_failure, failure,
                                    _cut(stderr), _cut(str(res.get("stdout") or "")),
                                    call.name if call is not None else None, call.id if call is not None else None))
            if outcome == "denied":
                return _Verdict(hook, True, None, reason)
            if outcome == "failed_closed":
                return _Verdict(hook, False, failure, reason)
            if outcome == "failed_open":
                log.warning("session %s: %s hook %r failed (%s); fail_open: the run goes on", ctx.session_id,
                            hook.event, hook.name, failure)
        return None

    @staticmethod
    def _stop(verdict: _Verdict, what: str) -> StopRun:
        return StopRun(StopReason.FAILED_TERMINAL, f"{what}: {verdict.why}", error=verdict.error())

    # -- hooks -----------------------------------------------------------------------------------
    async def wrap_model_call(self, request: MessageRequest, call_next: Any, ctx: RunContext) -> MessageResponse:
        before, after = self._for("before_model_call"), self._for("after_model_call")
        if not before and not after:
            return await call_next(request)  # type: ignore[no-any-return]
        summary = {"model": request.model, "provider": getattr(ctx.provider, "name", ""),
                   "message_count": len(request.messages), "tools": [t.name for t in request.tools],
                   "max_tokens": request.max_tokens}
        if before:
            last = request.messages[-1] if request.messages else None
            payload = {**summary, "last_message": None if last is None else
                       {"role": last.role, "text": _cut(last.text, 8000)}}
            verdict = await self._run(ctx, before, payload, messages=request.messages)
            if verdict is not None:
                raise self._stop(verdict, "the model call was not made")
        started = ctx.monotonic() if after else 0.0
        response: MessageResponse = await call_next(request)
        if after:
            payload = {**summary, "duration_s": round(ctx.monotonic() - started, 3),
                       "response": {"text": response.text, "stop_reason": response.stop_reason.value,
                                    "tool_calls": [{"id": c.id, "name": c.name, "input": c.input}
                                                   for c in response.message.tool_calls],
                                    "usage": None if response.usage is None else unstructure(response.usage),
                                    "model": response.model}}
            verdict = await self._run(ctx, after, payload, messages=(*request.messages, response.message))
            if verdict is not None:
                raise self._stop(verdict, "the model's answer is not used and the run stops")
        return response

    async def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Deny | None:  # type: ignore[override]
        hooks = self._for("before_tool_call", call.name)
        if not hooks:
            return None
        verdict = await self._run(ctx, hooks, {"tool_name": call.name, "tool_call_id": call.id,
                                               "tool_input": call.input}, call)
        if verdict is None:
            return None
        if verdict.denied:
            return Deny(f"hook {verdict.hook.name!r} denied the call: {verdict.reason or 'no reason given'}")
        said = f": {verdict.reason}" if verdict.reason else ""
        return Deny(f"hook {verdict.hook.name!r} failed ({verdict.failure}) and fails closed{said}")

    async def wrap_tool_call(self, call: ToolUseBlock, call_next: Any, ctx: RunContext) -> ToolResultMessage:
        hooks = self._for("after_tool_call", call.name)
        if not hooks:
            return await call_next(call)  # type: ignore[no-any-return]
        started = ctx.monotonic()
        result: ToolResultMessage = await call_next(call)
        verdict = await self._run(ctx, hooks, {
            "tool_name": call.name, "tool_call_id": call.id, "tool_input": call.input,
            "tool_response": {"text": result.text, "is_error": result.is_error},
            "duration_s": round(ctx.monotonic() - started, 3)}, call)
        if verdict is not None:  # the tool ran: its result is kept, and the run stops after this turn's calls
            ctx.state(self).setdefault("stop", (call.name, verdict))
        return result

    def post_turn(self, ctx: RunContext) -> None:
        self._stop_after_tools(ctx)

    def pre_turn(self, ctx: RunContext) -> None:
        self._stop_after_tools(ctx)  # in case another middleware's post_turn decided first

    def _stop_after_tools(self, ctx: RunContext) -> None:
        pending = ctx.state(self).pop("stop", None)
        if pending is not None:
            tool, verdict = pending
            raise self._stop(verdict, f"the tool {tool!r} ran (its result is kept) and the run stops")
