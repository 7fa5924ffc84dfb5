"""The :class:`Sandbox` protocol and its value types: what a run may use, what came back, what holds.

A sandbox runs model-written Python (CodeAct) under operating-system isolation and returns an
:class:`ExecutionResult`. Three implementations ship with fsm_agent:

====================================================  =============================================
:class:`~fsm_agent.sandbox.bubblewrap.BubblewrapSandbox`  ``setpriv`` to a dedicated uid, ``bwrap``
                                                      namespaces, seccomp, ``prlimit`` (the default
                                                      when ``bwrap`` is installed)
:class:`~fsm_agent.sandbox.subprocess.SubprocessSandbox`  uid drop, seccomp, Landlock and rlimits, no
                                                      namespaces (for pip-only installs)
:class:`~fsm_agent.sandbox.remote.RemoteSandbox`      a remote executor over HTTP JSON (or any
                                                      :class:`~fsm_agent.sandbox.remote.RemoteExecutor`)
====================================================  =============================================

Isolation is never done by inspecting or interpreting the code (no AST interpreter): the code runs in
a real CPython process that the kernel confines.

Errors (all under :mod:`fsm_agent.errors`)::

    UserError
    ├── ConfigurationError
    │   └── SandboxUnavailableError      this sandbox cannot run here (a binary, a kernel feature,
    │       │                            root rights or a free uid is missing); says what to install
    │       └── GuaranteeNotHeldError    it could run, but a required guarantee does not hold here
    └── SandboxInputError (+ValueError)  bad code, files or limits given to ``run``
    RunError
    ├── SandboxError                     the sandbox itself failed (the launcher or the interpreter
    │   │                                did not start); not the code's failure
    │   └── RemoteSandboxError           the remote executor failed or answered off the wire shape
    └── ToolError
        └── CodeExecutionError           (CodeAct) the code raised, exited non-zero, or a limit
                                         fired: the call's error result; carries the result

The code's own failures are not exceptions of :meth:`Sandbox.run`: they come back in the result
(``error``, ``exit_code``, ``signal``, ``limits_hit``).
"""

from __future__ import annotations

import contextlib
import math
import re
import signal as _signal
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import attrs
import orjson
from attrs import field, frozen

from ..errors import ConfigurationError, RunError, ToolError, UserError

__all__ = [
    "CodeError",
    "CodeExecutionError",
    "DOCUMENTED_ERRORS",
    "ExecutionResult",
    "FileChange",
    "GUARANTEE_NAMES",
    "GuaranteeNotHeldError",
    "Guarantees",
    "LIMIT_NAMES",
    "LimitName",
    "Limits",
    "RemoteSandboxError",
    "Sandbox",
    "SandboxError",
    "SandboxInputError",
    "SandboxUnavailableError",
]

KiB = 1024
MiB = 1024 * KiB

LimitName = Literal["memory", "cpu", "wall", "processes", "file_size", "output"]
"""Which limit fired: ``memory`` (address space), ``cpu`` (CPU seconds), ``wall`` (wall-clock
seconds), ``processes`` (processes and threads of the sandbox's uid), ``file_size`` (one file's
size), ``output`` (captured stdout / stderr / return value bytes)."""

LIMIT_NAMES: tuple[LimitName, ...] = ("memory", "cpu", "wall", "processes", "file_size", "output")
"""Every :data:`LimitName`, in the order ``limits_hit`` lists them."""


# -- errors ---------------------------------------------------------------------------------------
class SandboxUnavailableError(ConfigurationError):
    """This sandbox cannot run on this machine: a binary (``bwrap``, ``setpriv``, ``prlimit``,
    ``python3``), a kernel feature (user namespaces), the rights to switch uid, the ``pyseccomp``
    package, or a free dedicated uid is missing. The message says what is missing and what to do."""


class GuaranteeNotHeldError(SandboxUnavailableError):
    """The sandbox could run, but a guarantee it was asked to require does not hold here.

    Attributes:
        sandbox: the sandbox's name.
        missing: the names of the required guarantees that do not hold.
        guarantees: the :class:`Guarantees` measured on this machine.
    """

    def __init__(self, sandbox: str, missing: tuple[str, ...], guarantees: Guarantees) -> None:
        self.sandbox = sandbox
        self.missing = missing
        self.guarantees = guarantees
        by_reason: dict[str, list[str]] = {}
        for name in missing:
            by_reason.setdefault(guarantees.reasons.get(name, "does not hold"), []).append(name)
        why = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())
        super().__init__(
            f"the {sandbox} sandbox refuses to run: required guarantee(s) do not hold on this machine: {why}. "
            f"Fix the cause, or opt in to weaker isolation by passing required= without "
            f"{', '.join(repr(m) for m in missing)}")


class SandboxInputError(UserError, ValueError):
    """What was given to :meth:`Sandbox.run` (or to :class:`Limits`) is invalid: code that is not a
    string or is too large, a file path outside the work dir, a limit out of range. The message
    names the field and the accepted range."""


class SandboxError(RunError):
    """The sandbox failed to run the code at all: the launcher chain or the interpreter did not
    start (``detail`` holds what it printed). Not raised for the code's own failures."""

    def __init__(self, message: str, *, sandbox: str = "", detail: str = "") -> None:
        self.sandbox = sandbox
        self.detail = detail
        super().__init__(message + (f": {detail.strip()[:2000]}" if detail.strip() else ""))


class RemoteSandboxError(SandboxError):
    """The remote executor could not be reached, answered with an HTTP error, or answered off the
    documented wire shape.

    Attributes:
        status: the HTTP status, or ``None`` when no response arrived.
        body: the response body (cut to 2 KiB), or ``None``.
    """

    def __init__(self, message: str, *, status: int | None = None, body: str | None = None,
                 sandbox: str = "remote") -> None:
        self.status = status
        self.body = body[:2048] if body is not None else None
        super().__init__(message, sandbox=sandbox, detail=self.body or "")


class CodeExecutionError(ToolError):
    """(CodeAct) The code raised, exited non-zero, was killed, or a limit fired.

    A :class:`~fsm_agent.errors.ToolError`: the call's result is an error result (``is_error``)
    whose text is the JSON the model reads (see :meth:`ExecutionResult.for_model`), naming the
    exception and each limit that fired; ``kind`` (the result's ``metadata["error"]``) is
    ``limit_exceeded`` when a limit other than ``output`` fired, else ``code_error``.

    Attributes:
        result: the :class:`ExecutionResult`.
    """

    def __init__(self, result: ExecutionResult, text: str) -> None:
        self.result = result
        fired = [n for n in result.limits_hit if n != "output"]
        super().__init__(text, kind="limit_exceeded" if fired else "code_error")


DOCUMENTED_ERRORS: tuple[type[Exception], ...] = (SandboxUnavailableError, SandboxInputError, SandboxError,
                                                  CodeExecutionError)
"""The errors a sandbox (and :func:`~fsm_agent.sandbox.codeact.codeact_tool`'s tool) raises; anything
else is wrapped in :class:`SandboxError` (:func:`typed_errors`)."""


@contextlib.contextmanager
def typed_errors(sandbox: str, doing: str, error: type[SandboxError] = SandboxError) -> Iterator[None]:
    """Let the :data:`DOCUMENTED_ERRORS` (and cancellation) through; raise any other exception as
    ``error`` (a :class:`SandboxError`) naming ``sandbox``, what it was ``doing``, and the exception
    (its cause)."""
    try:
        yield
    except DOCUMENTED_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001 - the boundary: what reaches the caller is typed
        raise error(f"the {sandbox} sandbox failed while {doing}: {type(exc).__name__}: {exc}",
                    sandbox=sandbox) from exc


# -- limits ---------------------------------------------------------------------------------------
OUTPUT_KILL_FACTOR = 64
"""A run writing more than this many times ``Limits.output_bytes`` to stdout or stderr is killed."""

MAX_LIMIT = 2**62
"""The largest value any :class:`Limits` field accepts (far beyond any machine; ``prlimit`` takes it)."""


def _at_least(minimum: float) -> Any:
    def check(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SandboxInputError(f"Limits.{attribute.name} must be a number, not {type(value).__name__}")
        if not math.isfinite(value):
            raise SandboxInputError(f"Limits.{attribute.name} must be a finite number, got {value!r}")
        if value < minimum:
            raise SandboxInputError(f"Limits.{attribute.name} must be at least {minimum:g}, got {value!r}")
        if value > MAX_LIMIT:
            raise SandboxInputError(f"Limits.{attribute.name} must be at most 2**62, got {value!r}")

    return check


def check_timeout(timeout: Any, name: str = "timeout") -> float:
    """``timeout`` as a float of seconds.

    Raises:
        SandboxInputError: it is not a finite positive number (``nan``, ``inf``, ``0``, a bool ...).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0 or timeout > MAX_LIMIT:
        raise SandboxInputError(f"{name} must be a finite positive number of seconds, got {timeout!r}")
    return float(timeout)


def _whole(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, int):
        raise SandboxInputError(f"Limits.{attribute.name} must be a whole number, got {value!r}")


@frozen
class Limits:
    """What one run may use. Every limit is always set; there is no "unlimited".

    Enforced by the kernel (``prlimit`` inside the sandbox) except ``wall_seconds`` (the parent
    kills the process group) and ``output_bytes`` (the parent stops keeping output, and kills the
    run past :data:`OUTPUT_KILL_FACTOR` times it). Every field must be finite and at most
    ``2**62``. Raises :class:`SandboxInputError` for a value out of range.

    What ``memory_bytes`` bounds is each process's address space; a run's whole memory is at most
    about ``memory_bytes × processes``, plus the bubblewrap sandbox's private ``/tmp`` and
    ``/dev/shm`` (``tmp_bytes`` each) and kernel buffers (pipes, socket pairs), because the seccomp
    filter refuses what would hold memory outside any address space (System V shared memory and
    message queues, POSIX message queues, ``memfd_create``) and no writable host tmpfs is left to
    the code (the subprocess sandbox needs Landlock for that: see ``Guarantees.memory_limited``).
    Files in the work dir are on the host's disk (on RAM if ``workdir_root`` is a tmpfs, which the
    guarantees then report).
    """

    memory_bytes: int = field(default=512 * MiB, validator=[_whole, _at_least(64 * MiB)])
    """Address space of each process, bytes (``RLIMIT_AS``; an allocation beyond it fails with
    ``MemoryError``). At least 64 MiB, which CPython needs to start."""
    cpu_seconds: int = field(default=10, validator=[_whole, _at_least(1)])
    """CPU time of each process, whole seconds (``RLIMIT_CPU``: ``SIGXCPU`` at this, ``SIGKILL`` one
    second later)."""
    wall_seconds: float = field(default=30.0, validator=_at_least(0.1))
    """Wall-clock time of the whole run, seconds, from spawn to exit; then the process group is killed."""
    processes: int = field(default=32, validator=[_whole, _at_least(2)])
    """Processes and threads of the sandbox's dedicated uid at once (``RLIMIT_NPROC``; the
    sandbox's monitor and the interpreter running the code are two of them). A fork beyond it fails
    with ``BlockingIOError``."""
    file_size_bytes: int = field(default=16 * MiB, validator=[_whole, _at_least(0)])
    """Size of any one file the code writes, bytes (``RLIMIT_FSIZE``; a write beyond it fails with
    ``EFBIG``)."""
    open_files: int = field(default=64, validator=[_whole, _at_least(16)])
    """Open file descriptors per process (``RLIMIT_NOFILE``)."""
    output_bytes: int = field(default=64 * KiB, validator=[_whole, _at_least(1024)])
    """Bytes of stdout, of stderr, of the return value's JSON, of its ``repr`` and of the error's
    message and traceback kept each (UTF-8). Beyond it, stdout, stderr and the ``repr`` are cut (the
    output counted and dropped) and ``output`` is added to ``limits_hit``; a larger value is given by
    its ``repr`` only; the message and traceback are cut with a note. A run that writes more
    than :data:`OUTPUT_KILL_FACTOR` × this to stdout or stderr is killed (``SIGKILL``, ``output``
    in ``limits_hit``): past that the parent stops reading."""


# -- results --------------------------------------------------------------------------------------
@frozen
class FileChange:
    """One entry of the work dir that the run created, modified or deleted."""

    path: str
    """POSIX path relative to the work dir; a byte of a name that is not UTF-8 as ``\\xNN``."""
    change: Literal["created", "modified", "deleted"]
    kind: Literal["file", "symlink", "other"] = "file"
    """``file`` (regular file), ``symlink`` (never followed), ``other`` (fifo, socket, device)."""
    size: int | None = None
    """Bytes (the link's length for a symlink); ``None`` for a deleted entry."""
    sha256: str | None = None
    """Hex digest of a regular file's content; ``None`` for a deleted entry, a non-file, or when the
    run's hashing budget (256 MiB) was spent."""


@frozen
class CodeError:
    """An exception the code raised and did not catch (a ``SyntaxError`` included)."""

    type: str
    """The exception's class name (``ZeroDivisionError``, ``SyntaxError`` ...)."""
    message: str
    traceback: str
    """As Python prints it, with the code's own frames only (file name ``<code>``)."""
    line: int | None = None
    """Line of the code where it was raised (1-based), when known."""


@frozen
class ExecutionResult:
    """What one run produced.

    The return value rule: when the code's last top-level statement is an expression, its value
    (as in a notebook cell); otherwise the value of a top-level variable named ``result``, when the
    code assigned one; otherwise ``None``. ``return_value`` is that value as JSON (``None`` when it
    is not JSON-serialisable, is larger than ``output_bytes``, nests more than 200 levels deep, or
    holds an integer outside the 64-bit range ``-2**63 .. 2**64-1``, which JSON readers such as
    orjson would turn into a float); ``return_repr`` is its ``repr()`` (cut to ``output_bytes``;
    exact for any integer) whenever there is a value.

    Who vouches for what: ``exit_code``, ``signal`` and the ``cpu`` limit come from the sandbox's
    monitor, which waited for the code's process and cannot be reached by it; ``wall`` and
    ``output`` and the sizes are the parent's own observations; ``files`` is the parent's diff of
    the work dir; ``return_value``, ``return_repr``, ``error`` and the ``memory``, ``processes``
    and ``file_size`` limits are reported by the interpreter that ran the code, so code can forge
    them about itself, and nothing more: a report it writes itself can name no other limit.

    Every text encodes as UTF-8: a byte that is not UTF-8 (in a file name, in the output, or as the
    lone surrogate ``os.fsdecode`` makes of it) comes as ``\\xNN``, any other lone surrogate as
    ``\\udXXX`` (see :func:`escaped_text`).
    """

    sandbox: str
    """The sandbox's name (``bubblewrap``, ``subprocess``, ``remote`` ...)."""
    stdout: str
    """Captured stdout, decoded as UTF-8 (each byte that is not UTF-8 as ``\\xNN``), at most
    ``Limits.output_bytes`` bytes."""
    stderr: str
    """Captured stderr, likewise (the traceback of an uncaught exception is here too)."""
    exit_code: int | None
    """The interpreter's exit status, or ``None`` when a signal ended it (or, with ``signal`` also
    ``None``, when the run ended without a status the sandbox could trust: the code killed the
    sandbox's monitor)."""
    signal: int | None = None
    """The signal that ended the interpreter (``SIGXCPU``, ``SIGKILL`` ...), or ``None``; as the
    kernel reported it to the monitor (code that exits with status 137 is ``exit_code`` 137, not
    ``SIGKILL``)."""
    return_value: Any = None
    """The return value as JSON (see the class docstring), or ``None``."""
    return_repr: str | None = None
    """``repr()`` of the return value, or ``None`` when there was none."""
    error: CodeError | None = None
    """The uncaught exception, or ``None``."""
    files: tuple[FileChange, ...] = ()
    """Work dir entries created, modified or deleted, sorted by path (at most 1,000)."""
    limits_hit: tuple[LimitName, ...] = ()
    """Limits that fired, in :data:`LIMIT_NAMES` order."""
    duration_s: float = 0.0
    """Wall-clock seconds from spawn to exit."""
    stdout_bytes: int = 0
    """Bytes the code wrote to stdout, kept or not."""
    stderr_bytes: int = 0
    """Bytes the code wrote to stderr, kept or not."""
    files_truncated: bool = False
    """More than 1,000 changes (or 10,000 entries) were found; ``files`` lists the first."""
    workdir: str | None = None
    """The host path of the work dir when it was kept (``keep_workdir``), else ``None``."""

    @property
    def ok(self) -> bool:
        """The code ran to the end: exit status 0, no uncaught exception, and no limit fired except
        ``output`` (output beyond the cap is dropped, the run itself succeeded)."""
        return (self.exit_code == 0 and self.error is None and self.signal is None
                and all(name == "output" for name in self.limits_hit))

    @property
    def signal_name(self) -> str | None:
        """``SIGXCPU``, ``SIGKILL`` ... for :attr:`signal`, or ``None``."""
        if self.signal is None:
            return None
        try:
            return _signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def for_model(self, max_chars: int = 8000) -> dict[str, Any]:
        """The JSON object the model reads: ``ok``, ``stdout``, ``stderr``, ``return_value`` /
        ``return_repr``, ``error`` (type, message, line, traceback), ``files`` (path, change, size),
        ``limits_hit``, ``exit_code``/``signal``; empty fields left out. Each text is cut to
        ``max_chars`` characters (its end kept, where errors are). It always encodes as UTF-8 JSON,
        whatever sandbox made the result: a lone surrogate in a text is given as an escape
        (:func:`escaped_text`), and a ``return_value`` holding one (or anything else JSON cannot
        carry) by ``return_repr``."""

        def cut(text: str) -> str:
            text = _escaped(text)
            return text if len(text) <= max_chars else f"[{len(text) - max_chars} characters cut]…" + text[-max_chars:]

        out: dict[str, Any] = {"ok": self.ok}
        if self.stdout:
            out["stdout"] = cut(self.stdout)
        if self.stderr:
            out["stderr"] = cut(self.stderr)
        if self.return_repr is not None:
            if self.return_value is not None and _plain_json(self.return_value):
                out["return_value"] = self.return_value
            else:
                out["return_repr"] = cut(self.return_repr)
        if self.error is not None:
            out["error"] = {"type": _escaped(self.error.type), "message": cut(self.error.message),
                            "line": self.error.line}
        if self.files:
            out["files"] = [{"path": _escaped(f.path), "change": f.change,
                             **({"size": f.size} if f.size is not None else {})} for f in self.files[:100]]
        if self.limits_hit:
            out["limits_hit"] = list(self.limits_hit)
            out["limits_note"] = "; ".join(_LIMIT_TEXT[name] for name in self.limits_hit)
        if self.exit_code not in (0, None):
            out["exit_code"] = self.exit_code
        if self.signal is not None:
            out["signal"] = self.signal_name
        return out


_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_one(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"


def escaped_text(text: str) -> str:
    """``text`` as a str that encodes as UTF-8 (unchanged when it does): a lone surrogate that stands
    for a byte that was not UTF-8 (``os.fsdecode(b"\\xff")`` is ``"\\udcff"``) as ``\\xff``, any
    other lone surrogate as ``\\ud800``."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub(_escape_one, text)


def _escaped(text: Any) -> str:
    return escaped_text(text if isinstance(text, str) else str(text))


def _plain_json(value: Any) -> bool:
    """``value`` encodes as JSON (orjson: UTF-8 strings, string keys, 64-bit integers, at most 255 levels)."""
    try:
        orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):
        return False
    return True


_LIMIT_TEXT: dict[str, str] = {
    "memory": "memory limit: an allocation beyond the address-space limit failed",
    "cpu": "CPU time limit: the code was killed after using its CPU seconds",
    "wall": "wall-clock limit: the code was killed when its time ran out",
    "processes": "process limit: a new process or thread could not be started",
    "file_size": "file size limit: a write beyond the largest allowed file failed",
    "output": "output limit: output beyond the cap was dropped",
}


# -- guarantees -----------------------------------------------------------------------------------
GUARANTEE_NAMES: tuple[str, ...] = (
    "network_isolated", "filesystem_readonly", "secrets_invisible", "env_cleared", "seccomp_filter",
    "uid_dropped", "memory_limited", "cpu_limited", "processes_limited", "file_size_limited", "disk_quota",
)
"""Every guarantee a :class:`Guarantees` reports, in its field order."""


@frozen
class Guarantees:
    """Which isolation properties hold on this machine, measured when the sandbox starts (a
    self-test run inside the sandbox reads its own uid, capabilities, seccomp mode, rlimits,
    network devices, environment and visible files).

    Each property is a ``bool``; ``reasons[name]`` says why one does not hold, and
    ``mechanisms[name]`` how one that holds is enforced.
    """

    NAMES: ClassVar[tuple[str, ...]] = GUARANTEE_NAMES
    sandbox: str
    """The sandbox's name."""
    network_isolated: bool = False
    """The code cannot open sockets of any family (AF_INET, AF_INET6, AF_NETLINK, and AF_UNIX, so
    no host service's UNIX socket either) or resolve names; it may only connect to itself
    (``socketpair``)."""
    filesystem_readonly: bool = False
    """Nothing of the host's filesystem outside the per-call work dir can be written (measured: the
    self-test tries to create a file in ``/``, ``/etc``, ``/usr``, ``/var``, ``/tmp``, ``/var/tmp``,
    ``/dev``, ``/dev/shm`` ...; the bubblewrap sandbox's private ``/tmp`` and ``/dev/shm`` do not
    count)."""
    secrets_invisible: bool = False
    """Host files outside ``/usr`` (``/etc/shadow``, ``/etc/passwd``, home directories, keys, the
    caller's files) and other processes' command lines cannot be read."""
    env_cleared: bool = False
    """The caller's environment (API keys included) is not passed in; only ``PATH``, ``HOME``,
    ``TMPDIR``, ``LANG`` and what the sandbox was configured with."""
    seccomp_filter: bool = False
    """A seccomp filter is loaded (sockets, System V IPC, memfd, ptrace, bpf, keyctl, io_uring ...
    refused)."""
    uid_dropped: bool = False
    """The code runs as a dedicated unprivileged uid with no capabilities and no groups."""
    memory_limited: bool = False
    """The run's memory is bounded: ``RLIMIT_AS`` of each process is in force, the calls that hold
    memory outside an address space (System V shared memory, ``memfd_create``) are refused, and no
    host tmpfs (``/dev/shm``; the work dir when ``workdir_root`` is one) is writable. See
    :class:`Limits` for the ceiling."""
    cpu_limited: bool = False
    processes_limited: bool = False
    """``RLIMIT_NPROC`` binds: it is ignored for uid 0, and for a shared uid it counts that user's
    other processes, so it holds only with a dedicated uid."""
    file_size_limited: bool = False
    disk_quota: bool = False
    """The work dir's total size is bounded (each file is, by ``file_size_bytes``; their number is
    not, on any shipped sandbox)."""
    reasons: dict[str, str] = field(factory=dict)
    """Name -> why it does not hold (for each ``False``)."""
    mechanisms: dict[str, str] = field(factory=dict)
    """Name -> what enforces it (for each ``True``)."""
    details: dict[str, Any] = field(factory=dict)
    """Facts of the machine: ``uid``, ``python``, tool paths and versions, the self-test's raw report."""

    def holding(self) -> tuple[str, ...]:
        return tuple(n for n in GUARANTEE_NAMES if getattr(self, n))

    def not_holding(self) -> tuple[str, ...]:
        return tuple(n for n in GUARANTEE_NAMES if not getattr(self, n))

    def summary(self) -> str:
        """One line: ``bubblewrap: holds network_isolated, ...; does not hold: disk_quota``."""
        missing = self.not_holding()
        text = f"{self.sandbox}: holds {', '.join(self.holding()) or 'nothing'}"
        return text + (f"; does not hold: {', '.join(missing)}" if missing else "")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: every guarantee, ``reasons``, ``mechanisms`` and ``details`` (without the
        raw self-test report)."""
        out: dict[str, Any] = {"sandbox": self.sandbox}
        for name in GUARANTEE_NAMES:
            out[name] = getattr(self, name)
        out["reasons"] = dict(self.reasons)
        out["mechanisms"] = dict(self.mechanisms)
        out["details"] = {k: v for k, v in self.details.items() if k != "self_test"}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Guarantees:
        """The inverse of :meth:`to_json`; unknown keys are ignored, missing guarantees are ``False``.

        Raises:
            ValueError: ``data`` is not an object with a string ``sandbox``.
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("sandbox"), str):
            raise ValueError("guarantees must be an object with a string 'sandbox'")
        flags = {n: data.get(n) is True for n in GUARANTEE_NAMES}
        return cls(data["sandbox"], **flags,
                   reasons={str(k): str(v) for k, v in dict(data.get("reasons") or {}).items()},
                   mechanisms={str(k): str(v) for k, v in dict(data.get("mechanisms") or {}).items()},
                   details=dict(data.get("details") or {}))

    @classmethod
    def unknown(cls, sandbox: str, reason: str) -> Guarantees:
        """Nothing known to hold, each for ``reason``."""
        return cls(sandbox, reasons={n: reason for n in GUARANTEE_NAMES})


# -- the protocol ---------------------------------------------------------------------------------
@runtime_checkable
class Sandbox(Protocol):
    """Runs Python source under isolation. Implementations are safe to share between concurrent
    runs and between event loops.

    ``run`` never raises for the code's own failures: an exception, a non-zero exit, a signal, a
    limit come back in the :class:`ExecutionResult`. It raises
    :class:`GuaranteeNotHeldError` / :class:`SandboxUnavailableError` when it refuses to run here,
    :class:`SandboxInputError` for bad arguments, :class:`SandboxError` when the sandbox itself
    failed; the shipped sandboxes raise nothing else (:func:`typed_errors`). Cancelling ``run``
    kills every process of the call before the cancellation propagates.
    """

    @property
    def name(self) -> str:
        """``bubblewrap``, ``subprocess``, ``remote`` ..."""
        ...

    async def start(self) -> Guarantees:
        """Measure and return the guarantees that hold here; ``run`` calls it first. A measurement
        that succeeded is kept; one that failed (nothing holds, each for why) is made again next time."""
        ...

    def guarantees(self) -> Guarantees:
        """The guarantees, measured on first use (a blocking self-test of ~50 ms for the local
        sandboxes); a remote sandbox not yet started reports nothing as holding."""
        ...

    async def run(self, code: str, *, files: Mapping[str, bytes | str] | None = None,
                  timeout: float | None = None, limits: Limits | None = None) -> ExecutionResult:
        """Run ``code`` in a fresh work dir holding ``files`` (relative path -> content), under
        ``limits`` (the sandbox's default when ``None``); ``timeout`` (seconds) overrides
        ``limits.wall_seconds``."""
        ...

    async def aclose(self) -> None:
        """Release what the sandbox holds (idempotent); later runs may restart it."""
        ...
