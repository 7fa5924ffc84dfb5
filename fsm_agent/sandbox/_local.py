"""What the local sandboxes share: the uid pool, the per-call work dir, the launcher, the result.

A run, for :class:`~fsm_agent.sandbox.bubblewrap.BubblewrapSandbox` and
:class:`~fsm_agent.sandbox.subprocess.SubprocessSandbox` alike:

1. take a free uid from the pool (one run per dedicated uid at a time in this process, whichever
   sandbox object asks: ``RLIMIT_NPROC`` counts every process of a uid, so concurrent runs must not
   share one; other processes must use other uids);
2. create the work dir (``mkdtemp``, then owned by that uid, mode 0700), write ``files`` into it,
   and note what is there;
3. spawn the launcher chain with :func:`asyncio.create_subprocess_exec` in a new session (no
   ``preexec_fn``: the parent is a threaded asyncio process); the seccomp program and the result pipe
   are passed as inherited fds (``pass_fds``), the code goes in on stdin;
4. read stdout, stderr and the result pipe concurrently, each capped; on the wall-clock limit kill
   the process group; then kill whatever the uid still runs (the subprocess sandbox, which has no PID
   namespace) and wait until nothing of that uid is left;
5. compare the work dir with step 2 (``lstat`` only: no link is followed, no fifo opened), remove it
   unless asked to keep it, and give the uid back.

Cancelling a run kills its processes, removes its work dir and frees its uid before the
``CancelledError`` propagates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import posixpath
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson

from ._seccomp import seccomp_available, seccomp_program
from .base import (
    LIMIT_NAMES,
    CodeError,
    ExecutionResult,
    FileChange,
    GuaranteeNotHeldError,
    Guarantees,
    LimitName,
    Limits,
    SandboxError,
    SandboxInputError,
    SandboxUnavailableError,
)

__all__ = ["DEFAULT_UIDS", "LocalSandbox", "SELF_TEST", "processes_of"]

log = logging.getLogger("fsm_agent.sandbox")

DEFAULT_UIDS: range = range(2_100_000_000, 2_100_000_004)
"""The dedicated uids (numeric; no passwd entry is needed) a sandbox run as root switches to, one per
concurrent run. Pick others (``uids=``) when these are used on your machine: nothing else may run as
them, since every process of such a uid counts against the run's process limit and is killed after
the subprocess sandbox's runs."""

BUSY_UIDS: set[int] = set()
"""The dedicated uids running a call in this process, whichever sandbox object took them: two sandboxes
configured with the same uids never run as one of them at once (``RLIMIT_NPROC`` would count both,
and the subprocess sandbox's clean-up would kill the other's processes)."""
_BUSY_LOCK = threading.Lock()

MAX_CODE_BYTES = 1024 * 1024
"""The largest source accepted, bytes."""
_MAX_ENTRIES = 10_000
_MAX_CHANGES = 1_000
_HASH_BUDGET = 256 * 1024 * 1024
_RUNNER = (Path(__file__).with_name("_runner.py")).read_text()
_STARTED = b"S"

SELF_TEST = r'''
import os, resource, socket
facts = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
         "env": sorted(os.environ), "cwd": os.getcwd()}
status = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    status[key] = value.strip()
facts["seccomp"] = status.get("Seccomp")
facts["no_new_privs"] = status.get("NoNewPrivs")
facts["cap_eff"] = status.get("CapEff")
facts["cap_bnd"] = status.get("CapBnd")
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    facts["inet_socket"] = "allowed"
except OSError as exc:
    facts["inet_socket"] = f"refused: {exc.strerror}"
try:
    facts["interfaces"] = [l.split(":")[0].strip() for l in open("/proc/self/net/dev").read().splitlines()[2:]]
except OSError as exc:
    facts["interfaces"] = None
limits = {}
for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"):
    limits[name] = list(resource.getrlimit(getattr(resource, name)))
facts["rlimits"] = limits
facts["writable"] = [p for p in ("/", "/etc", "/usr", "/var", "/var/tmp", "/tmp", "/dev", "/dev/shm", "/root", "/home")
                     if os.path.isdir(p) and os.access(p, os.W_OK)]
facts["visible"] = [p for p in ("/etc/passwd", "/etc/shadow", "/root", "/home", "/proc/1/environ")
                    if os.path.exists(p)]
readable = []
for p in ("/etc/shadow", "/etc/passwd", "/proc/1/environ"):
    try:
        with open(p, "rb") as fh:
            fh.read(1)
        readable.append(p)
    except OSError:
        pass
facts["readable"] = readable
facts
'''
"""The self-test :meth:`LocalSandbox.start` runs inside the sandbox; its facts decide the guarantees."""


def processes_of(uid: int) -> list[int]:
    """Pids of the live processes whose real, effective or saved uid is ``uid`` (read from ``/proc``).

    Zombies are left out: they run nothing. (bwrap's PID-namespace init can outlive bwrap by a moment
    and is then reaped by the host's init, which may take a second or two; until then it still counts
    against ``RLIMIT_NPROC``.)"""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as fh:
                zombie = False
                for line in fh:
                    if line.startswith(b"State:"):
                        zombie = b"(zombie)" in line or b"(dead)" in line
                    elif line.startswith(b"Uid:"):
                        if not zombie and uid in {int(x) for x in line.split()[1:4]}:
                            found.append(int(name))
                        break
        except OSError:
            continue  # gone meanwhile
    return found


def _check_files(files: Mapping[str, bytes | str] | None) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for path, content in (files or {}).items():
        if not isinstance(path, str) or not path or "\x00" in path:
            raise SandboxInputError(f"files: {path!r} is not a file path")
        norm = posixpath.normpath(path)
        if path.startswith("/") or norm == "." or norm.startswith("../") or norm == "..":
            raise SandboxInputError(f"files: {path!r} must be a relative path inside the work dir (no leading '/', "
                                    "no '..')")
        if isinstance(content, str):
            content = content.encode()
        if not isinstance(content, (bytes, bytearray)):
            raise SandboxInputError(f"files[{path!r}] must be bytes or str, not {type(content).__name__}")
        out.append((norm, bytes(content)))
    return out


def _check_code(code: Any) -> bytes:
    if not isinstance(code, str):
        raise SandboxInputError(f"code must be a str of Python source, not {type(code).__name__}")
    data = code.encode("utf-8", "surrogatepass")
    if len(data) > MAX_CODE_BYTES:
        raise SandboxInputError(f"code is {len(data)} bytes; at most {MAX_CODE_BYTES} are accepted")
    return data


# -- the work dir ---------------------------------------------------------------------------------
Entry = tuple[str, int, str | None]
"""(kind, size, sha256) of a work dir entry."""


def _walk(root: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under ``root`` as (relative path, lstat), iteratively (no recursion limit), never
    following a link."""
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(os.path.join(root, rel) if rel else root) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            path = f"{rel}/{e.name}" if rel else e.name
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(path)
            else:
                yield path, st


def _sha256(path: str, budget: list[int]) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            budget[0] -= len(chunk)
            if budget[0] < 0:
                return None
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def _snapshot(root: str) -> tuple[dict[str, Entry], bool]:
    out: dict[str, Entry] = {}
    budget = [_HASH_BUDGET]
    truncated = False
    for i, (rel, st) in enumerate(_walk(root)):
        if i >= _MAX_ENTRIES:
            truncated = True
            break
        if stat.S_ISREG(st.st_mode):
            out[rel] = ("file", st.st_size, _sha256(os.path.join(root, rel), budget))
        elif stat.S_ISLNK(st.st_mode):
            out[rel] = ("symlink", st.st_size, None)
        else:
            out[rel] = ("other", st.st_size, None)
    return out, truncated


def _diff(before: dict[str, Entry], after: dict[str, Entry]) -> list[FileChange]:
    changes = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if new is None:
            assert old is not None
            changes.append(FileChange(path, "deleted", old[0]))  # type: ignore[arg-type]
        elif old is None:
            changes.append(FileChange(path, "created", new[0], new[1], new[2]))  # type: ignore[arg-type]
        elif old != new:
            changes.append(FileChange(path, "modified", new[0], new[1], new[2]))  # type: ignore[arg-type]
    return changes


def _remove(path: str) -> None:
    try:
        shutil.rmtree(path)
    except (OSError, RecursionError):
        rm = shutil.which("rm")
        if rm:
            import subprocess

            subprocess.run([rm, "-rf", "--one-file-system", "--", path], check=False, capture_output=True)


# -- reading capped streams -----------------------------------------------------------------------
async def _drain(reader: asyncio.StreamReader, cap: int) -> tuple[bytes, int]:
    kept = bytearray()
    total = 0
    while chunk := await reader.read(65536):
        total += len(chunk)
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
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
    """

    NAME = "local"
    DESIGNED: tuple[str, ...] = ()
    """The guarantees this mechanism is built to give: ``required`` by default."""

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        uids: Sequence[int] | None = None,
        python: str = "/usr/bin/python3",
        required: Sequence[str] | None = None,
        keep_workdir: bool = False,
        workdir_root: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        from .base import GUARANTEE_NAMES

        self.limits = limits if limits is not None else Limits()
        if not isinstance(self.limits, Limits):
            raise SandboxInputError(f"limits must be a Limits, not {type(self.limits).__name__}")
        pool = list(DEFAULT_UIDS if uids is None else uids)
        if not pool or any(isinstance(u, bool) or not isinstance(u, int) or not 0 < u < 2**32 - 1 for u in pool):
            raise SandboxInputError(f"uids must be a non-empty list of numeric uids between 1 and {2**32 - 2}: {uids!r}")
        if len(set(pool)) != len(pool):
            raise SandboxInputError(f"uids must be distinct: {uids!r}")
        self.uids: tuple[int, ...] = tuple(pool)
        self.python = python
        req = tuple(self.DESIGNED if required is None else required)
        unknown = [r for r in req if r not in GUARANTEE_NAMES]
        if unknown:
            raise SandboxInputError(f"required names unknown guarantee(s) {unknown}; known: {', '.join(GUARANTEE_NAMES)}")
        self.required = req
        self.keep_workdir = keep_workdir
        self.workdir_root = os.fspath(workdir_root) if workdir_root is not None else None
        self.env = dict(env or {})
        for k, v in self.env.items():
            if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\x00" in k + v:
                raise SandboxInputError(f"env: {k!r}={v!r} is not an environment variable")
        self.root = os.geteuid() == 0
        self._guarantees: Guarantees | None = None
        self._checked_uids = False

    # -- to override ------------------------------------------------------------------------------
    def _preflight(self) -> None:
        """Raise :class:`SandboxUnavailableError` when a needed binary is missing."""

    def _argv(self, uid: int | None, workdir: str, limits: Limits, result_fd: int,
              seccomp_fd: int) -> tuple[list[str], str, dict[str, str]]:
        """(argv, cwd, env) of the launcher chain."""
        raise NotImplementedError

    def _interpret(self, facts: dict[str, Any], limits: Limits) -> Guarantees:
        raise NotImplementedError

    def _after_exit(self, uid: int | None) -> None:
        """After the interpreter exited: make sure nothing of the run is left (blocking; runs in a
        thread). Waits until no process runs as the run's dedicated uid (a PID namespace being torn
        down, a killed process being reaped); the subprocess sandbox first kills them."""
        if uid is None:
            return
        deadline = time.monotonic() + 5.0
        while left := processes_of(uid):
            if time.monotonic() > deadline:
                raise SandboxError(f"processes {left[:5]} of the {self.NAME} sandbox's uid {uid} are still running "
                                   "5 s after the run ended", sandbox=self.NAME)
            time.sleep(0.002)

    # -- the protocol ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.NAME

    def _prlimit(self, limits: Limits) -> list[str]:
        prlimit = shutil.which("prlimit") or "/usr/bin/prlimit"
        return [prlimit, f"--as={limits.memory_bytes}", f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
                f"--nproc={limits.processes}", f"--fsize={limits.file_size_bytes}", f"--nofile={limits.open_files}",
                "--core=0", "--"]

    def _runner_argv(self, limits: Limits, result_fd: int, seccomp_fd: int) -> list[str]:
        return [self.python, "-I", "-c", _RUNNER, str(result_fd), str(seccomp_fd), str(limits.output_bytes)]

    def _check_workdir_root(self) -> None:
        """The dedicated uid must be able to reach its work dir: every ancestor must be searchable by others."""
        if not self.root:
            return
        root = os.path.realpath(self.workdir_root or tempfile.gettempdir())
        if not os.path.isdir(root):
            raise SandboxUnavailableError(f"workdir_root {root!r} is not a directory")
        path = root
        while True:
            mode = os.stat(path).st_mode
            if not mode & stat.S_IXOTH:
                raise SandboxUnavailableError(
                    f"workdir_root {root!r} cannot be reached by the sandbox's uid: {path!r} has mode "
                    f"{stat.S_IMODE(mode):04o} (no search permission for others); choose a directory every user "
                    f"may enter (such as /tmp), or chmod o+x {path}")
            if path == "/":
                break
            path = os.path.dirname(path)

    def _check_uids(self) -> None:
        if self._checked_uids or not self.root:
            return
        for uid in self.uids:
            busy = processes_of(uid)
            if busy:
                raise SandboxUnavailableError(
                    f"uid {uid} is meant to be used by the {self.NAME} sandbox alone, but process(es) {busy[:5]} run "
                    f"as it; pass uids= with uids nothing else uses")
        self._checked_uids = True

    async def start(self) -> Guarantees:
        """Run the self-test once and return the guarantees (cached).

        Raises:
            SandboxUnavailableError: a needed binary is missing, or a dedicated uid is in use.
        """
        if self._guarantees is None:
            self._preflight()
            self._check_workdir_root()
            self._check_uids()
            limits = Limits(wall_seconds=20.0)
            try:
                result = await self._execute(SELF_TEST, [], limits)
            except SandboxError as exc:
                self._guarantees = Guarantees.unknown(self.NAME, f"the sandbox did not start: {exc}")
            else:
                if not isinstance(result.return_value, dict):
                    detail = result.error.message if result.error else result.stderr[-500:]
                    self._guarantees = Guarantees.unknown(self.NAME, f"the self-test failed: {detail}")
                else:
                    self._guarantees = self._interpret(result.return_value, limits)
            log.info("sandbox %s", self._guarantees.summary())
        return self._guarantees

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
            SandboxInputError: ``code``, ``files``, ``limits`` or ``timeout`` is invalid.
            SandboxError: the launcher chain or the interpreter did not start.
        """
        source = _check_code(code)
        seeded = _check_files(files)
        lim = limits if limits is not None else self.limits
        if not isinstance(lim, Limits):
            raise SandboxInputError(f"limits must be a Limits, not {type(lim).__name__}")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise SandboxInputError(f"timeout must be a positive number of seconds, got {timeout!r}")
            lim = attrs.evolve(lim, wall_seconds=float(timeout))
        g = await self.start()
        missing = tuple(r for r in self.required if not getattr(g, r))
        if missing:
            raise GuaranteeNotHeldError(self.NAME, missing, g)
        return await self._execute(source.decode("utf-8", "surrogatepass"), seeded, lim)

    # -- one run ----------------------------------------------------------------------------------
    async def _take_uid(self) -> int | None:
        """A free dedicated uid (root), or ``None`` (not root: the caller's own uid, no pool)."""
        if not self.root:
            return None
        while True:
            with _BUSY_LOCK:
                for uid in self.uids:
                    if uid not in BUSY_UIDS:
                        BUSY_UIDS.add(uid)
                        return uid
            await asyncio.sleep(0.005)  # a loop-agnostic wait: runs on other event loops may hold the uids

    def _make_workdir(self, uid: int | None, seeded: list[tuple[str, bytes]]) -> str:
        workdir = tempfile.mkdtemp(prefix=f"fsm-sandbox-{self.NAME}-", dir=self.workdir_root)
        for rel, content in seeded:
            target = os.path.join(workdir, rel)
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as fh:
                    fh.write(content)
            except OSError as exc:
                _remove(workdir)
                raise SandboxInputError(f"files: {rel!r} cannot be written into the work dir: {exc.strerror}") from exc
        if uid is not None and self.root:
            for dirpath, dirnames, filenames in os.walk(workdir):
                for name in dirnames + filenames:
                    os.lchown(os.path.join(dirpath, name), uid, uid)
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        return workdir

    async def _execute(self, code: str, seeded: list[tuple[str, bytes]], limits: Limits) -> ExecutionResult:
        uid = await self._take_uid()
        workdir: str | None = None
        try:
            workdir = await asyncio.to_thread(self._make_workdir, uid, seeded)
            before, _ = await asyncio.to_thread(_snapshot, workdir)
            return await self._launch(code, uid, workdir, before, limits)
        finally:
            if workdir is not None and not self.keep_workdir:
                await asyncio.shield(asyncio.to_thread(_remove, workdir))
            elif workdir is not None and uid is not None:
                os.chown(workdir, 0, 0)  # kept for the caller: later runs as the same uid cannot reach it
            if uid is not None:
                with _BUSY_LOCK:
                    BUSY_UIDS.discard(uid)

    def _seccomp_fd(self) -> int:
        ok, _ = seccomp_available()
        if not ok:
            return -1
        fd = os.memfd_create("fsm-sandbox-seccomp", 0)  # inherited: no MFD_CLOEXEC
        os.write(fd, seccomp_program())
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    async def _launch(self, code: str, uid: int | None, workdir: str, before: dict[str, Entry],
                      limits: Limits) -> ExecutionResult:
        # Every pipe is the parent's own (os.pipe2), not asyncio's: asyncio 3.11's Process.wait() also
        # waits for its pipes to close, which a child the code forked would hold open past the exit.
        ours: list[int] = []  # read ends (and the stdin write end), closed here at the end
        theirs: list[int] = []  # what the child inherits, closed here once it is spawned
        transports: list[asyncio.BaseTransport] = []
        proc: asyncio.subprocess.Process | None = None
        tasks: list[asyncio.Future[Any]] = []
        killed_by_parent = False
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
            cap = limits.output_bytes
            for fd, keep in ((out_r, cap), (err_r, cap), (res_r, 2 * cap + 65536)):
                ours.remove(fd)
                reader, transport = await _pipe_reader(fd)
                transports.append(transport)
                tasks.append(asyncio.ensure_future(_drain(reader, keep)))
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
            await asyncio.to_thread(self._after_exit, uid)
            try:
                async with asyncio.timeout(5.0):
                    await feeder
                    (out, out_n), (err, err_n), (doc, doc_n) = await asyncio.gather(*tasks)
            except TimeoutError as exc:  # something of the run still holds a pipe open: must not happen
                raise SandboxError(f"the {self.NAME} sandbox's output did not close after its interpreter exited",
                                   sandbox=self.NAME) from exc
        except BaseException:
            await asyncio.shield(self._abort(proc, uid, tasks))
            raise
        finally:
            for fd in ours + theirs:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for t in transports:
                t.close()
        after, truncated = await asyncio.to_thread(_snapshot, workdir)
        return self._result(proc.returncode, out, out_n, err, err_n, doc, doc_n > len(doc), killed_by_parent,
                            duration, before, after, truncated, workdir, limits)

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
                doc_cut: bool, killed_by_parent: bool, duration: float, before: dict[str, Entry], after: dict[str, Entry],
                truncated: bool, workdir: str, limits: Limits) -> ExecutionResult:
        started = doc.startswith(_STARTED)
        report: dict[str, Any] = {}
        if started and len(doc) > 1:
            try:
                loaded = orjson.loads(doc[1:])
                report = loaded if isinstance(loaded, dict) else {}
            except orjson.JSONDecodeError:
                report = {}
        exit_code, sig = self._status(returncode, finished=bool(report))
        if not started and not killed_by_parent:
            text = err.decode("utf-8", "replace")
            raise SandboxError(f"the {self.NAME} sandbox did not start its interpreter (exit status {returncode}); "
                               "if the memory limit is low, raise it", sandbox=self.NAME, detail=text)
        hit: set[str] = {x for x in report.get("limits") or () if x in LIMIT_NAMES}
        if killed_by_parent:
            hit.add("wall")
            exit_code, sig = None, signal.SIGKILL
        elif sig == signal.SIGXCPU or sig == signal.SIGKILL:
            hit.add("cpu")  # SIGXCPU at the soft limit, SIGKILL at the hard one; nothing else here sends them
        elif sig == signal.SIGXFSZ:
            hit.add("file_size")
        if (out_n > len(out) or err_n > len(err) or doc_cut or report.get("value_truncated")
                or report.get("repr_truncated")):
            hit.add("output")
        changes = _diff(before, after)
        if limits.file_size_bytes and any(c.kind == "file" and c.size == limits.file_size_bytes for c in changes):
            hit.add("file_size")  # a file exactly at the cap: a write was cut there
        error = None
        if isinstance(report.get("error"), dict):
            e = report["error"]
            error = CodeError(str(e.get("type")), str(e.get("message")), str(e.get("traceback")),
                              e.get("line") if isinstance(e.get("line"), int) else None)
        if not started and killed_by_parent:
            exit_code = None
        ordered: tuple[LimitName, ...] = tuple(n for n in LIMIT_NAMES if n in hit)
        return ExecutionResult(
            sandbox=self.NAME, stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
            exit_code=exit_code, signal=int(sig) if sig is not None else None,
            return_value=report.get("return_value"), return_repr=report.get("return_repr"), error=error,
            files=tuple(changes[:_MAX_CHANGES]), limits_hit=ordered, duration_s=duration, stdout_bytes=out_n,
            stderr_bytes=err_n, files_truncated=truncated or len(changes) > _MAX_CHANGES,
            workdir=workdir if self.keep_workdir else None)

    def _status(self, returncode: int | None, *, finished: bool) -> tuple[int | None, signal.Signals | None]:
        """(exit code, signal) from the launcher's status (negative: the interpreter itself got a signal).
        ``finished``: the runner wrote its report, so the status is the code's own exit status."""
        if returncode is None:
            return None, None
        if returncode < 0:
            return None, _sig(-returncode)
        return returncode, None

    # -- guarantee helpers for subclasses ----------------------------------------------------------
    @staticmethod
    def _rlimit_checks(facts: dict[str, Any], limits: Limits) -> dict[str, tuple[bool, str]]:
        rl = facts.get("rlimits") or {}

        def is_set(name: str, want: int) -> bool:
            got = rl.get(name)
            return isinstance(got, list) and len(got) == 2 and got[0] == want

        return {
            "memory_limited": (is_set("RLIMIT_AS", limits.memory_bytes),
                               "RLIMIT_AS (address space) set by prlimit inside the sandbox"),
            "cpu_limited": (is_set("RLIMIT_CPU", limits.cpu_seconds),
                            "RLIMIT_CPU set by prlimit; the parent also keeps a wall-clock limit"),
            "file_size_limited": (is_set("RLIMIT_FSIZE", limits.file_size_bytes), "RLIMIT_FSIZE set by prlimit"),
            "nproc_set": (is_set("RLIMIT_NPROC", limits.processes), ""),
        }


def _sig(n: int) -> signal.Signals | None:
    try:
        return signal.Signals(n)
    except ValueError:
        return None


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
