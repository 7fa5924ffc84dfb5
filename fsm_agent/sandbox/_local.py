"""What the local sandboxes share: the uid pool, the per-call work dir, the launcher, the result.

A run, for :class:`~fsm_agent.sandbox.bubblewrap.BubblewrapSandbox` and
:class:`~fsm_agent.sandbox.subprocess.SubprocessSandbox` alike:

1. take a free dedicated uid (as root): an exclusive ``flock`` on
   ``LOCK_DIR/uid-<uid>.lock``, held for the whole call, so two calls never run as one uid at once,
   whichever sandbox object or OS process asks (``RLIMIT_NPROC`` counts every process of a uid,
   and the subprocess sandbox kills all of them after each call). The lock file says while a call
   runs; a taker that finds it saying so knows its holder died mid-call and first kills what still
   runs as the uid, removes that call's work dir and the uid's files in the world-writable
   directories;
2. create the work dir: a root-owned directory (mode 0711) holding ``work``, owned by the uid
   (mode 0700), so the code cannot rename its work dir or put a link in its place; write ``files``
   into it and note what is there; every later look at it goes through a descriptor of the
   root-owned directory and never follows a link;
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
``CancelledError`` propagates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from ._report import channel_cap, file_name, parse_channel, read_report, stream_text
from ._seccomp import seccomp_available, seccomp_program
from .base import (
    LIMIT_NAMES,
    OUTPUT_KILL_FACTOR,
    ExecutionResult,
    FileChange,
    GuaranteeNotHeldError,
    Guarantees,
    LimitName,
    Limits,
    SandboxError,
    SandboxInputError,
    SandboxUnavailableError,
    check_timeout,
    typed_errors,
)

__all__ = ["DEFAULT_UIDS", "LOCK_DIR", "LocalSandbox", "SELF_TEST", "processes_of"]

log = logging.getLogger("fsm_agent.sandbox")

T = TypeVar("T")

DEFAULT_UIDS: range = range(2_100_000_000, 2_100_000_004)
"""The dedicated uids (numeric; no passwd entry is needed) a sandbox run as root switches to, one per
concurrent run. Pick others (``uids=``) when these are used on your machine: nothing else may run as
them, since every process of such a uid counts against the run's process limit and is killed after
the subprocess sandbox's runs."""

MAX_UID = 2**31 - 2
"""The largest uid accepted (bwrap and setpriv take signed 32-bit ids; ``2**31 - 1`` is reserved)."""

LOCK_DIR = "/run/fsm-agent-sandbox"
"""Where the per-uid lock files live (root-owned, mode 0700; created on first use). A lock is held
for the whole of a call, across every process of the machine."""

BUSY_UIDS: set[int] = set()
"""The dedicated uids this process holds the lock of (a call runs as each)."""
_BUSY_LOCK = threading.Lock()

MAX_CODE_BYTES = 1024 * 1024
"""The largest source accepted, bytes."""
_MAX_ENTRIES = 10_000
_MAX_DEPTH = 64
_MAX_CHANGES = 1_000
_HASH_BUDGET = 256 * 1024 * 1024
_RUNNER = (Path(__file__).with_name("_runner.py")).read_text()
_WORK = "work"
SWEPT_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
"""World-writable directories from which the uid's entries are removed after a call, when the sandbox
cannot keep the code from writing there (the subprocess sandbox without Landlock), and after a
crashed call."""

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
for name, family in (("inet_socket", socket.AF_INET), ("unix_socket", socket.AF_UNIX)):
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
        facts[name] = "allowed"
    except OSError as exc:
        facts[name] = f"refused: {exc.strerror}"
try:
    facts["interfaces"] = [l.split(":")[0].strip() for l in open("/proc/self/net/dev").read().splitlines()[2:]]
except OSError as exc:
    facts["interfaces"] = None
limits = {}
for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"):
    limits[name] = list(resource.getrlimit(getattr(resource, name)))
facts["rlimits"] = limits
writable = []
for p in ("/", "/etc", "/usr", "/var", "/var/tmp", "/tmp", "/dev", "/dev/shm", "/root", "/home", "/run", "/run/lock",
          "/opt", "/srv", "/mnt"):
    probe = f"{p.rstrip('/')}/.fsm-sandbox-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        continue
    writable.append(p)
    try:
        os.unlink(probe)
    except OSError:
        pass
facts["writable"] = writable
facts["visible"] = [p for p in ("/etc/passwd", "/etc/shadow", "/root", "/home", "/proc/1/environ")
                    if os.path.exists(p)]
readable = []
for p in ("/etc/shadow", "/etc/passwd", "/etc/hostname", "/proc/1/cmdline"):
    try:
        with open(p, "rb") as fh:
            fh.read(1)
        readable.append(p)
    except OSError:
        pass
facts["readable"] = readable
try:
    os.close(os.memfd_create("fsm-sandbox-probe"))
    facts["memfd"] = "allowed"
except OSError as exc:
    facts["memfd"] = f"refused: {exc.strerror}"
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0, 4096, 0o1600)
if shmid >= 0:
    libc.shmctl(shmid, 0, None)
    facts["sysv_shm"] = "allowed"
else:
    facts["sysv_shm"] = f"refused: {os.strerror(ctypes.get_errno())}"
libc.syscall.restype = ctypes.c_long
facts["landlock_abi"] = max(0, libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
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


def fs_type(path: str) -> str:
    """The filesystem type (``ext4``, ``tmpfs`` ...) holding ``path``, from ``/proc/self/mountinfo``;
    ``""`` when unknown."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                point = fields[4].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except OSError:
        return ""
    return kind


def _check_files(files: Mapping[str, bytes | str] | None) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for path, content in (files or {}).items():
        if not isinstance(path, str) or not path or "\x00" in path:
            raise SandboxInputError(f"files: {path!r} is not a file path")
        if not _is_utf8(path):
            raise SandboxInputError(f"files: {path!r} holds a lone surrogate: a seeded file's path must be UTF-8 text")
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


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def host_path(what: str, value: Any) -> str:
    """``value`` (a str or path-like) as a host path string.

    Raises:
        SandboxInputError: it is not a path, holds a NUL, or cannot be encoded for the file system
            (a lone surrogate other than a non-UTF-8 byte's).
    """
    try:
        path = os.fspath(value)
    except TypeError:
        raise SandboxInputError(f"{what} must be a path, not {type(value).__name__}") from None
    if not isinstance(path, str) or "\x00" in path:
        raise SandboxInputError(f"{what} must be a text path without NUL, got {path!r}")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise SandboxInputError(f"{what} {path!r} cannot be encoded as a file name (a lone surrogate)") from None
    return path


def _check_code(code: Any) -> bytes:
    if not isinstance(code, str):
        raise SandboxInputError(f"code must be a str of Python source, not {type(code).__name__}")
    data = code.encode("utf-8", "surrogatepass")
    if len(data) > MAX_CODE_BYTES:
        raise SandboxInputError(f"code is {len(data)} bytes; at most {MAX_CODE_BYTES} are accepted")
    return data


def checked_run(code: Any, files: Mapping[str, bytes | str] | None, limits: Limits | None, timeout: float | None,
                default: Limits) -> tuple[str, list[tuple[str, bytes]], Limits]:
    """A run's inputs, checked the same way by every sandbox: the source, the seeded files, and the
    limits (``limits`` or ``default``, with ``timeout`` as the wall limit when given).

    Raises:
        SandboxInputError: ``code``, ``files``, ``limits`` or ``timeout`` is invalid.
    """
    source = _check_code(code)
    seeded = _check_files(files)
    lim = limits if limits is not None else default
    if not isinstance(lim, Limits):
        raise SandboxInputError(f"limits must be a Limits, not {type(lim).__name__}")
    if timeout is not None:
        lim = attrs.evolve(lim, wall_seconds=check_timeout(timeout))
    return source.decode("utf-8", "surrogatepass"), seeded, lim


def check_required(name: str, required: Sequence[str], g: Guarantees) -> None:
    """Raise :class:`GuaranteeNotHeldError` when a guarantee in ``required`` does not hold in ``g``."""
    missing = tuple(r for r in required if not getattr(g, r))
    if missing:
        raise GuaranteeNotHeldError(name, missing, g)


async def _settle(fut: asyncio.Future[T]) -> T:
    """Await ``fut`` (a job in a thread) to its end even when cancelled meanwhile, then re-raise the
    cancellation: a job that touches the run's descriptors or its uid must never outlive its caller."""
    cancelled: BaseException | None = None
    while not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        if not fut.cancelled():
            fut.exception()  # retrieved: no "never retrieved" warning
        raise cancelled
    return fut.result()


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    return await _settle(asyncio.ensure_future(asyncio.to_thread(fn, *args)))


# -- the work dir ---------------------------------------------------------------------------------
Entry = tuple[str, int, str | None]
"""(kind, size, sha256) of a work dir entry."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _walk(top: int, max_entries: int = _MAX_ENTRIES) -> Iterator[tuple[str, os.stat_result, int, str]]:
    """Every entry under the directory ``top`` (a descriptor) as (relative path, lstat, the
    descriptor of its directory, its name), depth first, streamed: never following a link, opening
    each directory relative to its parent's descriptor (``O_NOFOLLOW``), at most ``max_entries``
    entries and :data:`_MAX_DEPTH` levels. Raises :class:`_Truncated` (after the entries it yielded)
    when it stopped at a cap."""
    first = os.open(".", _DIR_FLAGS, dir_fd=top)
    stack: list[tuple[str, int, Any]] = [("", first, os.scandir(first))]
    count = 0
    cut = False
    try:
        while stack:
            rel, fd, it = stack[-1]
            entry = next(it, None)
            if entry is None:
                it.close()
                os.close(fd)
                stack.pop()
                continue
            count += 1
            if count > max_entries:
                cut = True
                break
            path = f"{rel}/{entry.name}" if rel else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            yield path, st, fd, entry.name
            if stat.S_ISDIR(st.st_mode):
                if len(stack) >= _MAX_DEPTH:
                    cut = True
                    continue
                try:
                    sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                try:
                    stack.append((path, sub, os.scandir(sub)))
                except OSError:
                    os.close(sub)
    finally:
        for _, fd, it in stack:
            it.close()
            with contextlib.suppress(OSError):
                os.close(fd)
    if cut:
        raise _Truncated


class _Truncated(Exception):
    pass


def _sha256(dir_fd: int, name: str, budget: list[int]) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
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


def _snapshot(outer_fd: int) -> tuple[dict[str, Entry], bool]:
    """What the work dir (``work`` under the root-owned ``outer_fd``) holds, and whether the listing
    was cut at a cap."""
    out: dict[str, Entry] = {}
    budget = [_HASH_BUDGET]
    try:
        top = os.open(_WORK, _DIR_FLAGS, dir_fd=outer_fd)
    except OSError:
        return out, False
    try:
        for rel, st, dir_fd, name in _walk(top):
            if stat.S_ISDIR(st.st_mode):
                continue
            path = file_name(rel)  # a name that is not UTF-8 is carried with \xNN escapes
            if stat.S_ISREG(st.st_mode):
                out[path] = ("file", st.st_size, _sha256(dir_fd, name, budget))
            elif stat.S_ISLNK(st.st_mode):
                out[path] = ("symlink", st.st_size, None)
            else:
                out[path] = ("other", st.st_size, None)
    except _Truncated:
        return out, True
    finally:
        os.close(top)
    return out, False


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
    """Remove a tree without following links, streaming (the parent's memory does not grow with the
    number of entries); ``rm -rf`` for a tree deeper than :data:`_MAX_DEPTH` levels."""
    try:
        if _remove_tree(path):
            return
    except FileNotFoundError:
        return
    except OSError:
        pass
    rm = shutil.which("rm")
    if rm:
        subprocess.run([rm, "-rf", "--one-file-system", "--", path], check=False, capture_output=True)


def _remove_tree(path: str) -> bool:
    """Remove ``path`` through directory descriptors (``O_NOFOLLOW``; a link is removed, never
    followed); ``False`` when it is deeper than :data:`_MAX_DEPTH` levels (the rest is left)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return True
    parent_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    stack = [os.open(os.path.basename(path), _DIR_FLAGS, dir_fd=parent_fd)]
    names = [os.path.basename(path)]
    try:
        while stack:
            fd = stack[-1]
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o700)  # code may have taken its own rights away (not root: they bind)
            sub = -1
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                            names.append(entry.name)
                            break
                        os.unlink(entry.name, dir_fd=fd)
                    except FileNotFoundError:
                        continue
            if sub >= 0:
                stack.append(sub)
                if len(stack) > _MAX_DEPTH:
                    return False
                continue
            os.close(stack.pop())
            os.rmdir(names.pop(), dir_fd=stack[-1] if stack else parent_fd)
        return True
    finally:
        for fd in stack:
            os.close(fd)
        os.close(parent_fd)


def _copy_in_place(dir_fd: int, name: str) -> None:
    """Replace the hard-linked file ``name`` by a copy of its own (so that changing it never changes
    the other link's file)."""
    tmp = f".fsm-copy-{secrets.token_hex(6)}"
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            while chunk := os.read(src, 1 << 20):
                os.write(dst, chunk)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _hand_to_root(outer_fd: int) -> None:
    """A kept work dir becomes the caller's: every entry owned by root, no set-id bits, nothing
    writable by group or others, the top mode 0700 (so no later run, of any uid, reaches it). A
    regular file with more than one link is replaced by a copy first (the other link may be a host
    file the code could link to). Symlinks stay symlinks (never followed here; the caller must not
    follow them either)."""
    top = os.open(_WORK, _DIR_FLAGS, dir_fd=outer_fd)
    try:
        try:
            for _, st, dir_fd, name in _walk(top, max_entries=10 * _MAX_ENTRIES):
                if stat.S_ISLNK(st.st_mode):
                    os.chown(name, 0, 0, dir_fd=dir_fd, follow_symlinks=False)
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    _copy_in_place(dir_fd, name)
                # no process of the uid runs any more and no other uid can reach the tree: the entry
                # checked by lstat above is still what the name holds
                os.chown(name, 0, 0, dir_fd=dir_fd, follow_symlinks=False)
                mode = stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH)
                os.chmod(name, mode, dir_fd=dir_fd)
        except _Truncated:
            pass  # the rest stays owned by the uid, under a top no one else can enter
        os.fchown(top, 0, 0)
        os.fchmod(top, 0o700)
    finally:
        os.close(top)


def _sweep(uid: int, extra: Sequence[str] = ()) -> list[str]:
    """Remove the top-level entries owned by ``uid`` in the world-writable directories (what a call
    of the subprocess sandbox without Landlock can leave behind); return what was removed."""
    removed = []
    for d in (*SWEPT_DIRS, *extra):
        try:
            dfd = os.open(d, _DIR_FLAGS)
        except OSError:
            continue
        try:
            with os.scandir(dfd) as it:
                names = [e.name for e in it if _owned(e, uid)]
            for name in names:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if st.st_uid != uid:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(name, dir_fd=dfd)
                    else:
                        os.unlink(name, dir_fd=dfd)
                    removed.append(f"{d}/{name}")
                except OSError:
                    continue
        finally:
            os.close(dfd)
    return removed


def _owned(entry: os.DirEntry[str], uid: int) -> bool:
    try:
        return entry.stat(follow_symlinks=False).st_uid == uid
    except OSError:
        return False


# -- the uid locks --------------------------------------------------------------------------------
@attrs.define
class _Slot:
    """A dedicated uid this process holds the lock of, and the lock file's descriptor."""

    uid: int
    fd: int
    previous: dict[str, Any] | None
    """What the lock file said when taken: ``None`` (clean) or the dead holder's note."""

    def note(self, workdir: str | None) -> None:
        """Say in the lock file that a call runs (and where its work dir is)."""
        data = json.dumps({"pid": os.getpid(), "workdir": workdir}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with _BUSY_LOCK:
            BUSY_UIDS.discard(self.uid)


def _lock_dir() -> str:
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(LOCK_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        raise SandboxUnavailableError(f"the sandbox's lock directory {LOCK_DIR!r} must be a directory owned by uid "
                                      f"{os.geteuid()} that no one else may write; remove it and retry")
    return LOCK_DIR


def _try_lock(uid: int) -> _Slot | None:
    """The lock of ``uid`` if free (non-blocking), else ``None``."""
    path = os.path.join(_lock_dir(), f"uid-{uid}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    try:
        data = os.pread(fd, 4096, 0)
    except OSError:
        data = b""
    previous: dict[str, Any] | None = None
    if data.strip():
        try:
            loaded = json.loads(data)
            previous = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            previous = {}
    with _BUSY_LOCK:
        BUSY_UIDS.add(uid)
    return _Slot(uid, fd, previous)


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
        if not pool or any(isinstance(u, bool) or not isinstance(u, int) or not 0 < u <= MAX_UID for u in pool):
            raise SandboxInputError(f"uids must be a non-empty list of numeric uids between 1 and {MAX_UID}: {uids!r}")
        if len(set(pool)) != len(pool):
            raise SandboxInputError(f"uids must be distinct: {uids!r}")
        self.uids: tuple[int, ...] = tuple(pool)
        self.python = host_path("python", python)
        req = tuple(self.DESIGNED if required is None else required)
        unknown = [r for r in req if r not in GUARANTEE_NAMES]
        if unknown:
            raise SandboxInputError(f"required names unknown guarantee(s) {unknown}; known: {', '.join(GUARANTEE_NAMES)}")
        self.required = req
        self.keep_workdir = keep_workdir
        self.workdir_root = host_path("workdir_root", workdir_root) if workdir_root is not None else None
        self.env = dict(env or {})
        for k, v in self.env.items():
            if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\x00" in k + v \
                    or not _is_utf8(k + v):
                raise SandboxInputError(f"env: {k!r}={v!r} is not an environment variable (UTF-8 text, a name "
                                        "without '=')")
        self.root = os.geteuid() == 0
        self._guarantees: Guarantees | None = None
        self._checked_uids = False

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
        if uid is None:
            return
        deadline = time.monotonic() + 5.0
        while left := processes_of(uid):
            if time.monotonic() > deadline:
                raise SandboxError(f"processes {left[:5]} of the {self.NAME} sandbox's uid {uid} are still running "
                                   "5 s after the run ended", sandbox=self.NAME)
            time.sleep(0.002)

    def _kill_uid(self, uid: int) -> None:
        """SIGKILL every process of ``uid`` (``kill -9 -1`` as that uid: it reaches exactly them)."""
        if not processes_of(uid):
            return
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SandboxError(f"cannot kill the processes of uid {uid}: setpriv is not installed", sandbox=self.NAME)
        kill = shutil.which("kill")
        argv = [kill, "-9", "-1"] if kill else [self.python, "-c", "import os; os.kill(-1, 9)"]
        subprocess.run([setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv],
                       capture_output=True, check=False, env={"PATH": "/usr/bin:/bin"})

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
        return os.path.realpath(self.workdir_root or tempfile.gettempdir())

    def _check_workdir_root(self) -> None:
        """The dedicated uid must be able to reach its work dir (every ancestor searchable by others),
        and must not be able to move the work dirs (the root may be world-writable only with the
        sticky bit, like /tmp)."""
        root = self._root_dir
        if not os.path.isdir(root):
            raise SandboxUnavailableError(f"workdir_root {root!r} is not a directory")
        mode = os.stat(root).st_mode
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise SandboxUnavailableError(
                f"workdir_root {root!r} is writable by everyone without the sticky bit (mode "
                f"{stat.S_IMODE(mode):04o}): the sandbox's uid could move its work dir; chmod +t or o-w it")
        if not self.root:
            return
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
        """At start: no process may run as a dedicated uid that no call holds (some other program uses
        it). A uid another call holds is skipped; one whose holder died mid-call is cleaned up."""
        if self._checked_uids or not self.root:
            return
        for uid in self.uids:
            slot = _try_lock(uid)
            if slot is None:
                continue  # a call (of this process or another) runs as it now
            try:
                self._recover(slot)
            finally:
                slot.release()
        self._checked_uids = True

    def _recover(self, slot: _Slot) -> None:
        """With the lock of ``slot.uid`` held: if its last holder died mid-call, kill what still runs
        as the uid and remove that call's leftovers; if it ended cleanly, no process may run as it."""
        uid = slot.uid
        if slot.previous is None:
            busy = processes_of(uid)
            if busy:
                raise SandboxUnavailableError(
                    f"uid {uid} is meant to be used by the {self.NAME} sandbox alone, but process(es) {busy[:5]} run "
                    f"as it; pass uids= with uids nothing else uses")
            return
        left = processes_of(uid)
        log.warning("sandbox uid %d: its last call (pid %s) ended without cleaning up; killing %d process(es) and "
                    "removing its files", uid, slot.previous.get("pid"), len(left))
        self._kill_uid(uid)
        deadline = time.monotonic() + 5.0
        while left := processes_of(uid):
            if time.monotonic() > deadline:
                raise SandboxError(f"processes {left[:5]} of uid {uid} survive SIGKILL", sandbox=self.NAME)
            time.sleep(0.005)
        workdir = slot.previous.get("workdir")
        if isinstance(workdir, str) and os.path.basename(workdir).startswith("fsm-sandbox-"):
            with contextlib.suppress(OSError):
                st = os.lstat(workdir)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                    _remove(workdir)
        _sweep(uid, self._sweep_extra())
        os.ftruncate(slot.fd, 0)
        slot.previous = None

    def _sweep_extra(self) -> list[str]:
        root = self._root_dir
        try:
            mode = os.stat(root).st_mode
        except OSError:
            return []
        return [root] if mode & stat.S_IWOTH and root not in SWEPT_DIRS else []

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
            self._check_workdir_root()
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
    async def _take_uid(self) -> _Slot | None:
        """The lock of a free dedicated uid (root), or ``None`` (not root: the caller's own uid, no
        pool). Waits while every uid of the pool runs a call, here or in another process."""
        if not self.root:
            return None
        delay = 0.005
        while True:
            for uid in self.uids:
                slot = _try_lock(uid)
                if slot is None:
                    continue
                try:
                    if slot.previous is not None:
                        await _in_thread(self._recover, slot)
                    slot.note(None)
                except BaseException:
                    slot.release()
                    raise
                return slot
            await asyncio.sleep(delay)  # loop-agnostic: runs on other event loops or processes hold the uids
            delay = min(delay * 2, 0.05)

    def _make_workdir(self, outer: str, uid: int | None, seeded: list[tuple[str, bytes]]) -> int:
        """Create ``outer`` (root-owned, 0711) holding ``work`` (the uid's, 0700) with ``files`` in it;
        return a descriptor of ``outer``."""
        try:
            os.mkdir(outer, 0o700)
        except OSError as exc:
            raise SandboxError(f"the {self.NAME} sandbox could not create its work dir in workdir_root "
                               f"{self._root_dir!r}: {exc.strerror}", sandbox=self.NAME) from exc
        fd = -1
        try:
            fd = os.open(outer, _DIR_FLAGS)
            os.mkdir(_WORK, 0o700, dir_fd=fd)
            workdir = os.path.join(outer, _WORK)
            for rel, content in seeded:  # the tree is ours alone until it is handed to the uid
                target = os.path.join(workdir, rel)
                try:
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with open(target, "wb") as fh:
                        fh.write(content)
                except OSError as exc:
                    raise SandboxInputError(f"files: {rel!r} cannot be written into the work dir: "
                                            f"{exc.strerror}") from exc
            if uid is not None:
                for dirpath, dirnames, filenames in os.walk(workdir):
                    for name in dirnames + filenames:
                        os.lchown(os.path.join(dirpath, name), uid, uid)
                os.chown(_WORK, uid, uid, dir_fd=fd, follow_symlinks=False)
            os.fchmod(fd, 0o711)
            return fd
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _remove(outer)
            raise

    async def _execute(self, code: str, seeded: list[tuple[str, bytes]], limits: Limits, *,
                       keep: bool | None = None) -> ExecutionResult:
        keep = self.keep_workdir if keep is None else keep
        slot = await self._take_uid()
        uid = slot.uid if slot is not None else None
        outer = os.path.join(self._root_dir, f"fsm-sandbox-{self.NAME}-{secrets.token_hex(8)}")
        made = asyncio.ensure_future(asyncio.to_thread(self._make_workdir, outer, uid, seeded))
        try:
            outer_fd = await _settle(made)
            if slot is not None:
                slot.note(outer)
            before, _ = await _in_thread(_snapshot, outer_fd)
            return await self._launch(code, uid, outer, outer_fd, before, limits, keep)
        finally:
            await _settle(asyncio.ensure_future(self._cleanup(made, outer, slot, keep)))

    async def _cleanup(self, made: asyncio.Future[int], outer: str, slot: _Slot | None, keep: bool) -> None:
        try:
            outer_fd = made.result() if made.done() and not made.cancelled() and made.exception() is None else None
            if outer_fd is None:
                if os.path.lexists(outer):
                    await asyncio.to_thread(_remove, outer)
                return
            try:
                if keep:
                    await asyncio.to_thread(_hand_to_root, outer_fd)
                else:
                    await asyncio.to_thread(_remove, outer)
            finally:
                os.close(outer_fd)
            if slot is not None and self._needs_sweep():
                removed = await asyncio.to_thread(_sweep, slot.uid, self._sweep_extra())
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
        workdir = os.path.join(outer, _WORK)
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
            await _in_thread(self._after_exit, uid)
            try:
                async with asyncio.timeout(5.0):
                    await feeder
                    (out, out_n), (err, err_n), (doc, doc_n) = await asyncio.gather(*tasks)
            except TimeoutError as exc:  # something of the run still holds a pipe open: must not happen
                raise SandboxError(f"the {self.NAME} sandbox's output did not close after its interpreter exited",
                                   sandbox=self.NAME) from exc
        except BaseException:
            # to its end even if cancelled again: the uid's lock is released only after this
            await _settle(asyncio.ensure_future(self._abort(proc, uid, tasks)))
            raise
        finally:
            for fd in ours + theirs:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for t in transports:
                t.close()
        after, truncated = await _in_thread(_snapshot, outer_fd)
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
        changes = _diff(before, after)
        if limits.file_size_bytes and any(c.kind == "file" and c.size == limits.file_size_bytes for c in changes):
            hit.add("file_size")  # a file exactly at the cap: a write was cut there
        ordered: tuple[LimitName, ...] = tuple(n for n in LIMIT_NAMES if n in hit)
        return ExecutionResult(
            sandbox=self.NAME, stdout=stream_text(out, out_n > len(out)), stderr=stream_text(err, err_n > len(err)),
            exit_code=exit_code, signal=int(sig) if sig is not None else None,
            return_value=claimed.return_value, return_repr=claimed.return_repr, error=claimed.error,
            files=tuple(changes[:_MAX_CHANGES]), limits_hit=ordered, duration_s=duration, stdout_bytes=out_n,
            stderr_bytes=err_n, files_truncated=truncated or len(changes) > _MAX_CHANGES, workdir=kept)

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

    def _memory_check(self, facts: dict[str, Any], limits: Limits, private: Sequence[str] = (),
                      extra: str = "") -> tuple[bool, str, str]:
        """(holds, mechanism, reason) of ``memory_limited`` from the self-test's facts: RLIMIT_AS in
        force, System V shared memory and memfd refused, no writable host tmpfs (``private``: the
        sandbox's own bounded ones), the work dir not on a tmpfs."""
        rl = self._rlimit_checks(facts, limits)["memory_limited"][0]
        problems = []
        if not rl:
            problems.append(f"RLIMIT_AS is not in force ({(facts.get('rlimits') or {}).get('RLIMIT_AS')})")
        for fact, what in (("sysv_shm", "System V shared memory"), ("memfd", "memfd_create")):
            if not str(facts.get(fact, "")).startswith("refused"):
                problems.append(f"{what} is allowed (it holds memory outside any address space)")
        ram = [p for p in facts.get("writable") or [] if p not in private and fs_type(p) in ("tmpfs", "ramfs")]
        if ram:
            problems.append(f"the host's {', '.join(ram)} {'is a' if len(ram) == 1 else 'are'} writable tmpfs: files "
                            "there hold RAM that no rlimit counts")
        kind = fs_type(self._root_dir)
        if kind in ("tmpfs", "ramfs"):
            problems.append(f"workdir_root {self._root_dir} is a {kind}: the work dir's files are RAM, and their "
                            "number is not bounded (pass workdir_root= a directory on a disk, such as /var/tmp)")
        mechanism = (f"RLIMIT_AS={limits.memory_bytes} per process (at most {limits.processes} processes); the "
                     "seccomp filter refuses System V shared memory, message queues and memfd_create" + extra)
        return not problems, mechanism, "; ".join(problems)


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
