"""The pool of dedicated uids: one call at a time per uid, machine-wide, and cleanup after a holder
that died.

As root, every call of a local sandbox runs as a uid of its pool. Taking one is an exclusive
``flock`` on ``LOCK_DIR/uid-<uid>.lock``, held for the whole call, so two calls never run as one uid
at once, whichever sandbox object or OS process asks (``RLIMIT_NPROC`` counts every process of a
uid, and the subprocess sandbox kills all of them after each call). While a call runs, its lock file
says so (the pid, the work dir); a taker that finds it saying so knows its holder died mid-call and
first kills what still runs as the uid, removes that call's work dir and the uid's files in the
world-writable directories (:meth:`UidPool.recover`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import threading
import time
from typing import Any

import attrs

from . import _workdir
from ._threads import in_thread
from .base import SandboxError, SandboxUnavailableError

__all__ = ["BUSY_UIDS", "LOCK_DIR", "Slot", "UidPool", "processes_of", "try_lock"]

log = logging.getLogger("fsm_agent.sandbox")

LOCK_DIR = "/run/fsm-agent-sandbox"
"""Where the per-uid lock files live (root-owned, mode 0700; created on first use). A lock is held
for the whole of a call, across every process of the machine."""

BUSY_UIDS: set[int] = set()
"""The dedicated uids this process holds the lock of (a call runs as each)."""
_BUSY_LOCK = threading.Lock()


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


@attrs.define
class Slot:
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
        """Give the uid back: the lock file emptied (no call runs), the lock released."""
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


def try_lock(uid: int) -> Slot | None:
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
    return Slot(uid, fd, previous)


class UidPool:
    """The dedicated uids of one sandbox object, as root: a free one taken for each call, and the
    leftovers of a holder that died cleaned up by the next taker.

    Args:
        uids: the pool (checked by :class:`~fsm_agent.sandbox.options.SandboxOptions`).
        sandbox: the sandbox's name, for messages.
        python: an interpreter to kill with when ``kill`` is not installed.
    """

    def __init__(self, uids: tuple[int, ...], *, sandbox: str, python: str) -> None:
        self.uids = uids
        self.sandbox = sandbox
        self.python = python
        self._checked = False

    def check(self, root: str) -> None:
        """At start: no process may run as a dedicated uid that no call holds (some other program uses
        it). A uid another call holds is skipped; one whose holder died mid-call is cleaned up
        (``root``: where that call's work dir may be). Once per pool.

        Raises:
            SandboxUnavailableError: a process that is no call's runs as one of the uids.
        """
        if self._checked:
            return
        for uid in self.uids:
            slot = try_lock(uid)
            if slot is None:
                continue  # a call (of this process or another) runs as it now
            try:
                self.recover(slot, root)
            finally:
                slot.release()
        self._checked = True

    async def take(self, root: str) -> Slot:
        """The lock of a free dedicated uid, noted in its lock file as running a call. Waits while every
        uid of the pool runs a call, here or in another process; first cleans up after a dead holder
        (``root``: where its work dir may be)."""
        delay = 0.005
        while True:
            for uid in self.uids:
                slot = try_lock(uid)
                if slot is None:
                    continue
                try:
                    if slot.previous is not None:
                        await in_thread(self.recover, slot, root)
                    slot.note(None)
                except BaseException:
                    slot.release()
                    raise
                return slot
            await asyncio.sleep(delay)  # loop-agnostic: runs on other event loops or processes hold the uids
            delay = min(delay * 2, 0.05)

    def recover(self, slot: Slot, root: str) -> None:
        """With the lock of ``slot.uid`` held: if its last holder died mid-call, kill what still runs
        as the uid and remove that call's leftovers (its work dir, the uid's entries in the
        world-writable directories); if it ended cleanly, no process may run as it.

        Raises:
            SandboxUnavailableError: the uid's last call ended cleanly, yet a process runs as it.
            SandboxError: a process of the uid survives SIGKILL.
        """
        uid = slot.uid
        if slot.previous is None:
            busy = processes_of(uid)
            if busy:
                raise SandboxUnavailableError(
                    f"uid {uid} is meant to be used by the {self.sandbox} sandbox alone, but process(es) {busy[:5]} "
                    f"run as it; pass uids= with uids nothing else uses")
            return
        left = processes_of(uid)
        log.warning("sandbox uid %d: its last call (pid %s) ended without cleaning up; killing %d process(es) and "
                    "removing its files", uid, slot.previous.get("pid"), len(left))
        self.kill(uid)
        deadline = time.monotonic() + 5.0
        while left := processes_of(uid):
            if time.monotonic() > deadline:
                raise SandboxError(f"processes {left[:5]} of uid {uid} survive SIGKILL", sandbox=self.sandbox)
            time.sleep(0.005)
        _workdir.remove_leftover(slot.previous.get("workdir"))
        _workdir.sweep(uid, _workdir.sweep_extra(root))
        os.ftruncate(slot.fd, 0)
        slot.previous = None

    def kill(self, uid: int) -> None:
        """SIGKILL every process of ``uid`` (``kill -9 -1`` as that uid: it reaches exactly them).

        Raises:
            SandboxError: a process runs as ``uid`` and ``setpriv`` is not installed.
        """
        if not processes_of(uid):
            return
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SandboxError(f"cannot kill the processes of uid {uid}: setpriv is not installed",
                               sandbox=self.sandbox)
        kill = shutil.which("kill")
        argv = [kill, "-9", "-1"] if kill else [self.python, "-c", "import os; os.kill(-1, 9)"]
        subprocess.run([setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv],
                       capture_output=True, check=False, env={"PATH": "/usr/bin:/bin"})

    def wait_gone(self, uid: int) -> None:
        """Wait until no process runs as ``uid`` (a PID namespace being torn down, a killed process
        being reaped).

        Raises:
            SandboxError: some still run 5 s later.
        """
        deadline = time.monotonic() + 5.0
        while left := processes_of(uid):
            if time.monotonic() > deadline:
                raise SandboxError(f"processes {left[:5]} of the {self.sandbox} sandbox's uid {uid} are still running "
                                   "5 s after the run ended", sandbox=self.sandbox)
            time.sleep(0.002)
