"""The self-test a local sandbox runs inside itself at start, and what its facts say.

:data:`SELF_TEST` reports what the code would find (its uid, groups and capabilities, the seccomp
mode, which sockets it may open, its network devices, rlimits, which host paths it may write or
read, whether System V shared memory, memfd and Landlock are there). Each sandbox's ``_interpret``
turns the facts into :class:`~fsm_agent.sandbox.base.Guarantees`, with :func:`rlimit_checks` and
:func:`memory_check` for what both local sandboxes measure alike.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .base import Limits

__all__ = ["SELF_TEST", "fs_type", "memory_check", "rlimit_checks"]

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
"""The self-test :meth:`~fsm_agent.sandbox._local.LocalSandbox.start` runs inside the sandbox; its facts
decide the guarantees."""


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


def rlimit_checks(facts: dict[str, Any], limits: Limits) -> dict[str, tuple[bool, str]]:
    """Per guarantee (and ``nproc_set``): (whether the self-test found the rlimit of ``limits`` in
    force, the mechanism)."""
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


def memory_check(facts: dict[str, Any], limits: Limits, root: str, private: Sequence[str] = (),
                 extra: str = "") -> tuple[bool, str, str]:
    """(holds, mechanism, reason) of ``memory_limited`` from the self-test's facts: RLIMIT_AS in
    force, System V shared memory and memfd refused, no writable host tmpfs (``private``: the
    sandbox's own bounded ones), the work dirs' ``root`` not on a tmpfs."""
    rl = rlimit_checks(facts, limits)["memory_limited"][0]
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
    kind = fs_type(root)
    if kind in ("tmpfs", "ramfs"):
        problems.append(f"workdir_root {root} is a {kind}: the work dir's files are RAM, and their "
                        "number is not bounded (pass workdir_root= a directory on a disk, such as /var/tmp)")
    mechanism = (f"RLIMIT_AS={limits.memory_bytes} per process (at most {limits.processes} processes); the "
                 "seccomp filter refuses System V shared memory, message queues and memfd_create" + extra)
    return not problems, mechanism, "; ".join(problems)
