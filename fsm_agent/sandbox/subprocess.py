"""SubprocessSandbox: a uid drop, a seccomp filter, Landlock and rlimits, without namespaces (for
pip-only installs).

The launcher chain of every run (as root)::

    setpriv --reuid=U --regid=U --clear-groups --inh-caps=-all --bounding-set=-all --nnp --pdeathsig KILL --
      prlimit --as --cpu --nproc --fsize --nofile --core=0 --
      python3 -I -c RUNNER RESULT_FD SECCOMP_FD CAP OPTIONS

with a cleared environment (``PATH``, ``HOME`` and ``TMPDIR`` = the work dir, ``LANG``) and the work
dir as the current directory. The runner loads the seccomp BPF program (read from an inherited fd)
before the code runs: setpriv 2.38 has no ``--seccomp-filter``, and a ``preexec_fn`` is not safe in
a threaded asyncio process. Then, in the process that runs the code, it applies **Landlock** (Linux
5.13+, when the kernel enables it): the code may write only beneath its work dir, read only
``/usr``, ``/lib*``, ``/bin``, ``/sbin``, the interpreter's prefix, ``ro_paths``, a few devices and
its own ``/proc/self``; from Linux 6.7 no TCP either, and from 6.12 no abstract UNIX socket or
signal reaches outside the run. After each run every process left running as ``U`` is killed
(there is no PID namespace to tear down), which is why ``U`` must be used by nothing else.

What holds depends on the kernel, and :meth:`guarantees` measures it:

* with Landlock: ``filesystem_readonly`` and ``secrets_invisible`` hold (the self-test's writes to
  ``/tmp``, ``/dev/shm`` ... and reads of ``/etc/passwd``, ``/proc/1/cmdline`` are refused), and so
  does ``memory_limited``;
* without it (or with ``landlock=False``): world-writable directories (``/tmp``, ``/var/tmp``,
  ``/dev/shm``) are writable, so ``filesystem_readonly`` does not hold (what the uid left at the top
  of them is removed after each call; deeper entries in other world-writable directories are not);
  ``/dev/shm`` is a tmpfs, so ``memory_limited`` does not hold either and the sandbox refuses by
  default; world-readable files and other processes' command lines are readable, so
  ``secrets_invisible`` does not hold (mode 600 files such as ``/etc/shadow`` stay unreadable);
* ``network_isolated`` holds through the seccomp filter (no socket of any family), not through a
  network namespace;
* ``disk_quota``: nothing bounds the number of files.

Not root, it cannot switch uid: ``uid_dropped`` and ``processes_limited`` do not hold, and by
default ``run`` refuses (pass ``required=`` without them to opt in; the code then runs as your own
uid).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._inputs import host_paths
from ._local import LocalSandbox
from ._seccomp import DENIED_SYSCALLS, seccomp_available
from ._selftest import memory_check, rlimit_checks
from .base import Guarantees, Limits, SandboxInputError, SandboxUnavailableError
from .options import SandboxOptions, SandboxOptionsKeywords, resolve

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["SubprocessSandbox"]

_BASE_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE", "PWD")
_SYSTEM_RO = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
_DEV_RW = ("/dev/null",)
_DEV_RO = ("/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


class SubprocessSandbox(LocalSandbox):
    """Runs each call as a dedicated uid under seccomp, Landlock and rlimits, without namespaces (see
    the module docstring for what that leaves open).

    Takes the options every sandbox takes (:class:`~fsm_agent.sandbox.options.SandboxOptions`), as
    ``options=`` or as keywords (not both), and its own:

    Args:
        options: the shared options in one value.
        **shared: or each as a keyword: ``limits``, ``uids`` (every process of such a uid is killed
            after each run, so nothing else may use them), ``python`` (it must be executable by the
            uid; its prefix is readable under Landlock), ``required`` (default :attr:`DESIGNED`),
            ``keep_workdir``, ``workdir_root``, ``env``; see
            :class:`~fsm_agent.sandbox.options.SandboxOptions` for each.
        ro_paths: extra host paths the code may read under Landlock (a virtualenv, data).
        landlock: apply Landlock when the kernel has it (default ``True``); ``False`` leaves the code
            the host's world-writable and world-readable files (and the guarantees say so).

    Raises:
        SandboxInputError: an option is invalid, or ``options`` and shared keywords are both given.
        TypeError: an unknown keyword.
    """

    NAME = "subprocess"
    DESIGNED = ("network_isolated", "env_cleared", "seccomp_filter", "uid_dropped", "memory_limited", "cpu_limited",
                "processes_limited", "file_size_limited")

    def __init__(
        self,
        *,
        options: SandboxOptions | None = None,
        ro_paths: Sequence[str] = (),
        landlock: bool = True,
        **shared: Unpack[SandboxOptionsKeywords],
    ) -> None:
        super().__init__(resolve("SubprocessSandbox", options, shared))
        self.ro_paths = host_paths("ro_paths", ro_paths)
        if not isinstance(landlock, bool):
            raise SandboxInputError(f"landlock must be True or False, not {landlock!r}")
        self.landlock = landlock
        self.setpriv = shutil.which("setpriv")

    def __repr__(self) -> str:
        return f"SubprocessSandbox(uids={self.uids!r}, python={self.python!r}, limits={self.limits!r})"

    def _preflight(self) -> None:
        if not shutil.which("prlimit"):
            raise SandboxUnavailableError("prlimit is not installed: apt-get install util-linux")
        if not os.access(self.python, os.X_OK):
            raise SandboxUnavailableError(f"python {self.python!r} is not an executable; pass python=")
        if self.root and not self.setpriv:
            raise SandboxUnavailableError("setpriv is not installed (needed to leave uid 0): apt-get install util-linux")

    def _readable(self) -> list[str]:
        prefixes = {os.path.dirname(os.path.dirname(p)) for p in (os.path.abspath(self.python),
                                                                   os.path.realpath(self.python))}
        paths = [*_SYSTEM_RO, *sorted(p for p in prefixes if p not in ("", "/")), *self.ro_paths, "/proc/self"]
        return list(dict.fromkeys(paths))

    def _argv(self, uid: int | None, workdir: str, limits: Limits, result_fd: int,
              seccomp_fd: int) -> tuple[list[str], str, dict[str, str]]:
        argv: list[str] = []
        if uid is not None:
            assert self.setpriv is not None
            argv += [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                     "--bounding-set=-all", "--nnp", "--pdeathsig", "KILL", "--"]
        elif self.setpriv:
            argv += [self.setpriv, "--nnp", "--pdeathsig", "KILL", "--"]
        options: dict[str, Any] = {}
        if self.landlock:
            options["landlock"] = {"ro": self._readable(), "rw": [workdir], "dev_rw": list(_DEV_RW),
                                   "dev_ro": list(_DEV_RO)}
        argv += [*self._prlimit(limits), *self._runner_argv(limits, result_fd, seccomp_fd, options)]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               **self.env}
        return argv, workdir, env

    def _after_exit(self, uid: int | None) -> None:
        # no PID namespace: a process the code started (even one that left the session) lives on as U
        if uid is not None and self.setpriv:
            self._pool.kill(uid)
        super()._after_exit(uid)

    def _needs_sweep(self) -> bool:
        g = self._guarantees
        return g is None or not g.filesystem_readonly

    def _interpret(self, facts: dict[str, Any], limits: Limits) -> Guarantees:
        holds: dict[str, bool] = {}
        reasons: dict[str, str] = {}
        how: dict[str, str] = {}

        def put(name: str, ok: bool, mechanism: str, reason: str) -> None:
            holds[name] = ok
            (how if ok else reasons)[name] = mechanism if ok else reason

        got = facts.get("landlock_abi")
        abi = got if isinstance(got, int) else 0
        if not self.landlock:
            landlock = "Landlock is switched off (landlock=False)"
        elif abi < 1:
            landlock = "the kernel has no Landlock (Linux 5.13+ with landlock in its LSM list)"
        else:
            landlock = f"Landlock ABI {abi}"
        seccomp_on = facts.get("seccomp") == "2"
        inet, unix = str(facts.get("inet_socket")), str(facts.get("unix_socket"))
        put("network_isolated", inet.startswith("refused") and unix.startswith("refused"),
            "the seccomp filter refuses socket() for every family, AF_UNIX included (no network namespace: the "
            "host's devices exist, no socket can reach them or a host service's UNIX socket)"
            + ("; Landlock also refuses TCP" if self.landlock and abi >= 4 else ""),
            "sockets can be opened (" + ", ".join(f"{k}: {v}" for k, v in (("AF_INET", inet), ("AF_UNIX", unix)))
            + "): " + (seccomp_available()[1] or "no seccomp filter is loaded"))
        writable = facts.get("writable") or []
        put("filesystem_readonly", not writable,
            f"{landlock}: the code may write only beneath its work dir",
            f"no mount namespace and {landlock}: these host directories are writable by the code: {writable} "
            "(what the uid leaves at their top is removed after each call)")
        readable = facts.get("readable") or []
        put("secrets_invisible", not readable,
            f"{landlock}: the code may read only /usr, /lib*, /bin, /sbin, the interpreter's prefix"
            + (f", {', '.join(self.ro_paths)}" if self.ro_paths else "") + ", its work dir and its own /proc/self",
            f"no mount namespace and {landlock}: world-readable host files and other processes' command lines are "
            f"readable (readable now: {readable}); files readable only by their owner (mode 600, /etc/shadow) are not")
        allowed = set(_BASE_ENV) | set(self.env)
        extra_env = [k for k in facts.get("env") or [] if k not in allowed]
        put("env_cleared", not extra_env, "the launcher is given only PATH, HOME, TMPDIR, LANG"
            + (f" and {', '.join(sorted(self.env))}" if self.env else ""), f"variables passed in: {extra_env}")
        ok_sc, why_sc = seccomp_available()
        put("seccomp_filter", seccomp_on,
            "loaded by the runner (no_new_privs, then PR_SET_SECCOMP) before the code: sockets refused (EACCES), "
            "System V IPC and memfd refused, clone3 ENOSYS, new user namespaces and "
            f"{', '.join(DENIED_SYSCALLS)} refused (EPERM)",
            why_sc if not ok_sc else f"no seccomp filter is loaded (Seccomp: {facts.get('seccomp')})")
        uid = facts.get("uid")
        dropped = (self.root and uid in self.uids and facts.get("euid") == uid and facts.get("gid") == uid
                   and not facts.get("groups") and facts.get("cap_eff") == "0000000000000000")
        put("uid_dropped", bool(dropped),
            f"setpriv to the dedicated uid {uid} (no groups, empty capability and bounding sets, no_new_privs)",
            "not root: cannot switch to a dedicated uid; the code runs as your own uid" if not self.root
            else f"the code runs as uid {uid}, groups {facts.get('groups')}")
        rl = rlimit_checks(facts, limits)
        for name in ("cpu_limited", "file_size_limited"):
            put(name, rl[name][0], rl[name][1], f"{name.replace('_limited', '')} rlimit not in force: {facts.get('rlimits')}")
        ok_mem, mech_mem, why_mem = memory_check(facts, limits, self._root_dir, extra=f"; {landlock} keeps /dev/shm unwritable")
        put("memory_limited", ok_mem, mech_mem, why_mem)
        put("processes_limited", bool(rl["nproc_set"][0] and dropped),
            f"RLIMIT_NPROC={limits.processes} for a dedicated uid; what is left running is killed after each run",
            "RLIMIT_NPROC does not bind: " + ("it is not set" if not rl["nproc_set"][0] else
                                               "the code does not run as a dedicated uid, so the limit counts "
                                               "every process of that user (and is ignored for uid 0)"))
        put("disk_quota", False, "", "the work dir is on the host's disk: each file is capped by file_size_bytes, "
            "their number is not")
        return Guarantees(self.NAME, **holds, reasons=reasons, mechanisms=how, details={
            "uids": list(self.uids) if self.root else [os.geteuid()], "python": self.python,
            "setpriv": self.setpriv, "root": self.root, "landlock_abi": abi, "landlock": self.landlock,
            "self_test": facts})
