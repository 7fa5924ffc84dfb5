"""The local sandboxes' common run: take a uid, make the work dir, launch, read, clean up.

A run, for :class:`~fsm_agent.sandbox.bubblewrap.BubblewrapSandbox` and
:class:`~fsm_agent.sandbox.subprocess.SubprocessSandbox` alike:

1. take a free dedicated uid (as root) from the pool (:mod:`._uids`): locked machine-wide for the
   whole call; a dead holder's leftovers are killed and removed first;
2. create the work dir (:mod:`._workdir`): a root-owned directory (mode 0711) holding ``work``, owned
   by the uid (mode 0700); write ``files`` into it and note what is there;
3. spawn the launcher chain with :func:`asyncio.create_subprocess_exec` in a new session (no
   ``preexec_fn``: the parent is a threaded asyncio process); the seccomp program and the result pipe
   are passed as inherited fds (``pass_fds``), the code goes in on stdin;
4. read stdout, stderr and the result pipe concurrently, each capped (a run that floods stdout or
   stderr is killed); on the wall-clock limit kill the process group; then kill whatever the uid
   still runs (the subprocess sandbox, which has no PID namespace) and wait until nothing of that uid
   is left;
5. compare the work dir with step 2, remove it (or, kept, hand every entry to root), remove what the
   uid left in the world-writable directories (when the sandbox cannot keep it from writing there),
   and give the uid back.

Cancelling a run kills its processes, removes its work dir and frees its uid before the
``CancelledError`` propagates. At start, the self-test (:mod:`._selftest`) measures the guarantees.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import _workdir
from ._inputs import check_required, checked_run
from ._report import channel_cap, parse_channel, read_report, stream_text
from ._seccomp import seccomp_available, seccomp_program
from ._selftest import SELF_TEST
from ._threads import in_thread, settle
from ._uids import Slot, UidPool
from ._workdir import Entry
from .base import (
    LIMIT_NAMES,
    OUTPUT_KILL_FACTOR,
    ExecutionResult,
    Guarantees,
    LimitName,
    Limits,
    SandboxError,
    typed_errors,
)
from .options import SandboxOptions

__all__ = ["LocalSandbox"]

log = logging.getLogger("fsm_agent.sandbox")

_MAX_CHANGES = 1_000
"""The most work dir changes a result lists (``files_truncated`` says when there were more)."""
_RUNNER = (Path(__file__).with_name("_runner.py")).read_text()


# -- reading capped streams -----------------------------------------------------------------------
async def _drain(reader: asyncio.StreamReader, cap: int, ceiling: int | None = None,
                 flood: Callable[[], None] | None = None) -> tuple[bytes, int]:
    kept = bytearray()
    total = 0
    while chunk := await reader.read(65536):
        total += len(chunk)
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
        if ceiling is not None and total > ceiling:
            if flood is not None:
                flood()
            break  # stop reading: the run is being killed
    return bytes(kept), total


def _feed(fd: int, data: bytes) -> None:
    """Write the code to the runner's stdin and close it (blocking; runs in a thread). A runner that
    died before reading it closes the pipe: the write then fails with EPIPE, which ends this."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass
    finally:
        os.close(fd)


async def _pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader, transport


class LocalSandbox:
    """Base of the local sandboxes: a pool of dedicated uids, per-call work dirs, the launcher.

    Subclasses give the launcher chain (:meth:`_argv`) and read the self-test's facts
    (:meth:`_interpret`). Not for direct use.

    Args:
        options: the checked options (the subclasses take them as ``options=`` or as keywords).
    """

    NAME = "local"
    DESIGNED: tuple[str, ...] = ()
    """The guarantees this mechanism is built to give: ``required`` by default."""

    def __init__(self, options: SandboxOptions) -> None:
        self.options = options
        self.root = os.geteuid() == 0
        self._pool = UidPool(options.uids, sandbox=self.NAME, python=options.python)
        self._guarantees: Guarantees | None = None

    # -- the options, as attributes -------------------------------------------------------------
    @property
    def limits(self) -> Limits:
        """Default limits of each run (:attr:`SandboxOptions.limits`)."""
        return self.options.limits

    @property
    def required(self) -> tuple[str, ...]:
        """The guarantees that must hold: :attr:`SandboxOptions.required`, else :attr:`DESIGNED`."""
        return self.DESIGNED if self.options.required is None else self.options.required

    @property
    def uids(self) -> tuple[int, ...]:
        """The dedicated uids (:attr:`SandboxOptions.uids`)."""
        return self.options.uids

    @property
    def python(self) -> str:
        """The interpreter's host path (:attr:`SandboxOptions.python`)."""
        return self.options.python

    @property
    def keep_workdir(self) -> bool:
        """Whether work dirs are kept (:attr:`SandboxOptions.keep_workdir`)."""
        return self.options.keep_workdir

    @property
    def workdir_root(self) -> str | None:
        """Where work dirs are made; ``None``: the temp dir (:attr:`SandboxOptions.workdir_root`)."""
        return self.options.workdir_root

    @property
    def env(self) -> Mapping[str, str]:
        """Extra variables for the code (:attr:`SandboxOptions.env`)."""
        return self.options.env

    # -- to override ------------------------------------------------------------------------------
    def _preflight(self) -> None:
        """Raise :class:`SandboxUnavailableError` when a needed binary is missing."""

    def _argv(self, uid: int | None, workdir: str, limits: Limits, result_fd: int,
              seccomp_fd: int) -> tuple[list[str], str, dict[str, str]]:
        """(argv, cwd, env) of the launcher chain; ``workdir`` is the host path of the work dir."""
        raise NotImplementedError

    def _interpret(self, facts: dict[str, Any], limits: Limits) -> Guarantees:
        raise NotImplementedError

    def _needs_sweep(self) -> bool:
        """Whether the code may have left files in the world-writable host directories."""
        return False

    def _after_exit(self, uid: int | None) -> None:
        """After the interpreter exited: make sure nothing of the run is left (blocking; runs in a
        thread). Waits until no process runs as the run's dedicated uid (a PID namespace being torn
        down, a killed process being reaped); the subprocess sandbox first kills them."""
        if uid is not None:
            self._pool.wait_gone(uid)

    # -- the protocol ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.NAME

    def _prlimit(self, limits: Limits) -> list[str]:
        prlimit = shutil.which("prlimit") or "/usr/bin/prlimit"
        return [prlimit, f"--as={limits.memory_bytes}", f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
                f"--nproc={limits.processes}", f"--fsize={limits.file_size_bytes}", f"--nofile={limits.open_files}",
                "--core=0", "--"]

    def _runner_argv(self, limits: Limits, result_fd: int, seccomp_fd: int,
                     options: Mapping[str, Any] | None = None) -> list[str]:
        return [self.python, "-I", "-c", _RUNNER, str(result_fd), str(seccomp_fd), str(limits.output_bytes),
                json.dumps(dict(options or {}))]

    @property
    def _root_dir(self) -> str:
        return _workdir.root_dir(self.workdir_root)

    def _check_uids(self) -> None:
        """At start, as root: the pool's uids are free of other programs (:meth:`UidPool.check`)."""
        if self.root:
            self._pool.check(self._root_dir)

    async def start(self) -> Guarantees:
        """Run the self-test and return the guarantees. A self-test that ran is cached; one that failed
        (the sandbox did not start, or the test did not finish: a transient shortage such as ``EAGAIN``
        on a fork while the uid's last processes are still being reaped) is not, and the returned
        :class:`Guarantees` hold nothing, each for that reason: the next ``start()`` or ``run()`` tests
        again.

        Raises:
            SandboxUnavailableError: a needed binary is missing, or a dedicated uid is in use by some
                other program.
            SandboxError: the sandbox failed in some other way (the message says how).
        """
        if self._guarantees is not None:
            return self._guarantees
        with typed_errors(self.NAME, "starting"):
            self._preflight()
            _workdir.check_root(self._root_dir, as_root=self.root)
            await asyncio.to_thread(self._check_uids)
            limits = Limits(wall_seconds=20.0)
            try:
                result = await self._execute(SELF_TEST, [], limits, keep=False)
            except SandboxError as exc:
                failed = Guarantees.unknown(self.NAME, f"the sandbox did not start (tested again at the next "
                                                       f"start or run): {exc}")
            else:
                if isinstance(result.return_value, dict):
                    self._guarantees = self._interpret(result.return_value, limits)
                    log.info("sandbox %s", self._guarantees.summary())
                    return self._guarantees
                detail = result.error.message if result.error else result.stderr[-500:]
                failed = Guarantees.unknown(self.NAME, f"the self-test failed (tested again at the next start or "
                                                       f"run): {detail}")
        log.warning("sandbox %s", failed.summary() + f" ({failed.reasons['network_isolated']})")
        return failed

    def guarantees(self) -> Guarantees:
        if self._guarantees is not None:
            return self._guarantees
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # callable from inside a running loop
            return pool.submit(asyncio.run, self.start()).result()

    async def aclose(self) -> None:
        """Nothing is held between runs (every run's processes and work dir are gone when it returns)."""

    async def run(self, code: str, *, files: Mapping[str, bytes | str] | None = None,
                  timeout: float | None = None, limits: Limits | None = None) -> ExecutionResult:
        """Run ``code`` (see :class:`~fsm_agent.sandbox.base.Sandbox`).

        Raises:
            GuaranteeNotHeldError: a guarantee in ``required`` does not hold here.
            SandboxUnavailableError: a needed binary is missing or a dedicated uid is in use.
            SandboxInputError: ``code``, ``files``, ``limits`` or ``timeout`` is invalid (``timeout``
                must be a finite positive number of seconds).
            SandboxError: the launcher chain or the interpreter did not start, or the sandbox failed in
                some other way (a work dir it could not create ...): never another exception type.
        """
        source, seeded, lim = checked_run(code, files, limits, timeout, self.limits)
        check_required(self.NAME, self.required, await self.start())
        with typed_errors(self.NAME, "running the code"):
            return await self._execute(source, seeded, lim)

    # -- one run ----------------------------------------------------------------------------------
    async def _take_uid(self, root: str) -> Slot | None:
        """The lock of a free dedicated uid (root), or ``None`` (not root: the caller's own uid, no
        pool). Waits while every uid of the pool runs a call, here or in another process."""
        return await self._pool.take(root) if self.root else None

    async def _execute(self, code: str, seeded: list[tuple[str, bytes]], limits: Limits, *,
                       keep: bool | None = None) -> ExecutionResult:
        keep = self.keep_workdir if keep is None else keep
        root = self._root_dir
        slot = await self._take_uid(root)
        uid = slot.uid if slot is not None else None
        outer = _workdir.new_path(root, self.NAME)
        made = asyncio.ensure_future(asyncio.to_thread(_workdir.create, outer, uid, seeded, sandbox=self.NAME,
                                                       root=root))
        try:
            outer_fd = await settle(made)
            if slot is not None:
                slot.note(outer)
            before, _ = await in_thread(_workdir.snapshot, outer_fd)
            return await self._launch(code, uid, outer, outer_fd, before, limits, keep)
        finally:
            await settle(asyncio.ensure_future(self._cleanup(made, outer, root, slot, keep)))

    async def _cleanup(self, made: asyncio.Future[int], outer: str, root: str, slot: Slot | None,
                       keep: bool) -> None:
        try:
            outer_fd = made.result() if made.done() and not made.cancelled() and made.exception() is None else None
            if outer_fd is None:
                if os.path.lexists(outer):
                    await asyncio.to_thread(_workdir.remove, outer)
                return
            try:
                if keep:
                    await asyncio.to_thread(_workdir.hand_to_root, outer_fd)
                else:
                    await asyncio.to_thread(_workdir.remove, outer)
            finally:
                os.close(outer_fd)
            if slot is not None and self._needs_sweep():
                removed = await asyncio.to_thread(_workdir.sweep, slot.uid, _workdir.sweep_extra(root))
                if removed:
                    log.info("sandbox uid %d left %d entries in world-writable directories; removed: %s", slot.uid,
                             len(removed), ", ".join(removed[:10]))
        finally:
            if slot is not None:
                slot.release()

    def _seccomp_fd(self) -> int:
        ok, _ = seccomp_available()
        if not ok:
            return -1
        fd = os.memfd_create("fsm-sandbox-seccomp", 0)  # inherited: no MFD_CLOEXEC
        os.write(fd, seccomp_program())
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    async def _launch(self, code: str, uid: int | None, outer: str, outer_fd: int, before: dict[str, Entry],
                      limits: Limits, keep: bool) -> ExecutionResult:
        # Every pipe is the parent's own (os.pipe2), not asyncio's: asyncio 3.11's Process.wait() also
        # waits for its pipes to close, which a child the code forked would hold open past the exit.
        ours: list[int] = []  # read ends (and the stdin write end), closed here at the end
        theirs: list[int] = []  # what the child inherits, closed here once it is spawned
        transports: list[asyncio.BaseTransport] = []
        proc: asyncio.subprocess.Process | None = None
        tasks: list[asyncio.Future[Any]] = []
        killed_by_parent = False
        flooded = False
        workdir = os.path.join(outer, _workdir.WORK)
        try:
            pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(4)]  # stdin, stdout, stderr, result
            (in_r, in_w), (out_r, out_w), (err_r, err_w), (res_r, res_w) = pipes
            ours += [in_w, out_r, err_r, res_r]
            theirs += [in_r, out_w, err_w, res_w]
            os.set_inheritable(res_w, True)
            seccomp_fd = self._seccomp_fd()
            if seccomp_fd >= 0:
                theirs.append(seccomp_fd)
            argv, cwd, env = self._argv(uid, workdir, limits, res_w, seccomp_fd)
            started = time.monotonic()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=in_r, stdout=out_w, stderr=err_w, pass_fds=[res_w] + theirs[4:],
                    start_new_session=True, close_fds=True, cwd=cwd, env=env)
            except OSError as exc:
                raise SandboxError(f"the {self.NAME} sandbox could not start its launcher {argv[0]!r}",
                                   sandbox=self.NAME, detail=str(exc)) from exc
            finally:
                while theirs:
                    os.close(theirs.pop())
            launched = proc

            def flood() -> None:
                nonlocal flooded
                if not flooded and launched.returncode is None:
                    flooded = True
                    _killpg(launched.pid)

            cap = limits.output_bytes
            ceiling = OUTPUT_KILL_FACTOR * cap
            for fd, keep_n, limit in ((out_r, cap, ceiling), (err_r, cap, ceiling), (res_r, channel_cap(cap), None)):
                ours.remove(fd)
                reader, transport = await _pipe_reader(fd)
                transports.append(transport)
                tasks.append(asyncio.ensure_future(_drain(reader, keep_n, limit, flood)))
            ours.remove(in_w)
            feeder = asyncio.ensure_future(asyncio.to_thread(_feed, in_w, code.encode("utf-8", "surrogatepass")))
            try:
                async with asyncio.timeout(limits.wall_seconds):
                    await proc.wait()
            except TimeoutError:
                killed_by_parent = True
                _killpg(proc.pid)
                await proc.wait()
            duration = time.monotonic() - started
            await in_thread(self._after_exit, uid)
            try:
                async with asyncio.timeout(5.0):
                    await feeder
                    (out, out_n), (err, err_n), (doc, doc_n) = await asyncio.gather(*tasks)
            except TimeoutError as exc:  # something of the run still holds a pipe open: must not happen
                raise SandboxError(f"the {self.NAME} sandbox's output did not close after its interpreter exited",
                                   sandbox=self.NAME) from exc
        except BaseException:
            # to its end even if cancelled again: the uid's lock is released only after this
            await settle(asyncio.ensure_future(self._abort(proc, uid, tasks)))
            raise
        finally:
            for fd in ours + theirs:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for t in transports:
                t.close()
        after, truncated = await in_thread(_workdir.snapshot, outer_fd)
        return self._result(proc.returncode, out, out_n, err, err_n, doc, killed_by_parent, flooded,
                            duration, before, after, truncated, workdir if keep else None, limits)

    async def _abort(self, proc: asyncio.subprocess.Process | None, uid: int | None,
                     tasks: list[asyncio.Future[Any]]) -> None:
        if proc is not None and proc.returncode is None:
            _killpg(proc.pid)
            with contextlib.suppress(Exception):
                await proc.wait()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._after_exit, uid)
        for t in tasks:
            t.cancel()

    def _result(self, returncode: int | None, out: bytes, out_n: int, err: bytes, err_n: int, doc: bytes,
                killed_by_parent: bool, flooded: bool, duration: float, before: dict[str, Entry],
                after: dict[str, Entry], truncated: bool, kept: str | None, limits: Limits) -> ExecutionResult:
        started, status, report = parse_channel(doc)
        if not started and not killed_by_parent and not flooded:
            text = err.decode("utf-8", "replace")
            raise SandboxError(f"the {self.NAME} sandbox did not start its interpreter (exit status {returncode}); "
                               "if the memory limit is low, raise it", sandbox=self.NAME, detail=text)
        # the code's report names only what its own process saw fail (memory, processes, file_size);
        # cpu is the monitor's, wall and output the parent's
        claimed = read_report(report, limits.output_bytes)
        hit: set[str] = set(claimed.limits)
        exit_code: int | None = None
        sig: int | None = None
        if killed_by_parent or flooded:
            hit.add("wall" if killed_by_parent else "output")
            sig = signal.SIGKILL
        elif type(status.get("signal")) is int:
            sig = status["signal"]
            cpu = status.get("cpu_s")
            used = float(cpu) if isinstance(cpu, (int, float)) and not isinstance(cpu, bool) else 0.0
            if sig in (signal.SIGXCPU, signal.SIGKILL) and used >= 0.9 * limits.cpu_seconds:
                # the kernel's RLIMIT_CPU signals, after the process really used its seconds (rusage, as
                # the monitor's wait4 got it, can read a little under the kernel's own CPU clock)
                hit.add("cpu")
            elif sig == signal.SIGXFSZ:
                hit.add("file_size")
        elif type(status.get("exit")) is int:
            exit_code = status["exit"]
        # else: no status from the monitor (the code killed it): neither exit status nor signal is known
        if out_n > len(out) or err_n > len(err):
            hit.add("output")
        changes = _workdir.diff(before, after)
        if limits.file_size_bytes and any(c.kind == "file" and c.size == limits.file_size_bytes for c in changes):
            hit.add("file_size")  # a file exactly at the cap: a write was cut there
        ordered: tuple[LimitName, ...] = tuple(n for n in LIMIT_NAMES if n in hit)
        return ExecutionResult(
            sandbox=self.NAME, stdout=stream_text(out, out_n > len(out)), stderr=stream_text(err, err_n > len(err)),
            exit_code=exit_code, signal=int(sig) if sig is not None else None,
            return_value=claimed.return_value, return_repr=claimed.return_repr, error=claimed.error,
            files=tuple(changes[:_MAX_CHANGES]), limits_hit=ordered, duration_s=duration, stdout_bytes=out_n,
            stderr_bytes=err_n, files_truncated=truncated or len(changes) > _MAX_CHANGES, workdir=kept)


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
