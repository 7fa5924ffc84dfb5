"""SubprocessSandbox: a uid drop, a seccomp filter and rlimits, without namespaces (for pip-only installs).

The launcher chain of every run (as root)::

    setpriv --reuid=U --regid=U --clear-groups --inh-caps=-all --bounding-set=-all --nnp --pdeathsig KILL --
      prlimit --as --cpu --nproc --fsize --nofile --core=0 --
      python3 -I -c RUNNER RESULT_FD SECCOMP_FD CAP

with a cleared environment (``PATH``, ``HOME`` and ``TMPDIR`` = the work dir, ``LANG``) and the work
dir as the current directory. The runner loads the seccomp BPF program (read from an inherited fd)
before the code runs: setpriv 2.38 has no ``--seccomp-filter``, and a ``preexec_fn`` is not safe in
a threaded asyncio process. After each run every process left running as ``U`` is killed (there is
no PID namespace to tear down), which is why ``U`` must be used by nothing else.

What does not hold, and :meth:`guarantees` says so:

* ``filesystem_readonly``: world-writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``) are
  writable; everything else is protected by ordinary file permissions only;
* ``secrets_invisible``: world-readable files are readable (``/etc/passwd``, source trees with
  mode 644); files readable only by their owner (mode 600, ``/etc/shadow``) are not;
* ``network_isolated`` holds through the seccomp filter alone (no socket but AF_UNIX can be made),
  not through a network namespace;
* ``disk_quota``: nothing bounds the number of files.

Not root, it cannot switch uid: ``uid_dropped`` and ``processes_limited`` do not hold, and by
default ``run`` refuses (pass ``required=`` without them to opt in; the code then runs as your own
uid and can read and write whatever you can).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from ._local import LocalSandbox
from ._seccomp import DENIED_SYSCALLS, seccomp_available
from .base import Guarantees, Limits, SandboxUnavailableError

__all__ = ["SubprocessSandbox"]

_BASE_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE", "PWD")


class SubprocessSandbox(LocalSandbox):
    """Runs each call as a dedicated uid under seccomp and rlimits, without namespaces (see the
    module docstring for what that leaves open).

    Args:
        limits: default :class:`~fsm_agent.sandbox.base.Limits` of each run.
        uids: the dedicated numeric uids (one per concurrent run); every process of such a uid is
            killed after each run, so nothing else may use them.
        python: the interpreter (default ``/usr/bin/python3``; it must be executable by the uid).
        required: guarantees that must hold, else ``run`` raises
            :class:`~fsm_agent.sandbox.base.GuaranteeNotHeldError`; default :attr:`DESIGNED`.
        keep_workdir: keep each run's work dir (its host path is ``ExecutionResult.workdir``).
        workdir_root: where work dirs are created (default: the system temp dir).
        env: extra environment variables for the code (never pass secrets).

    Raises:
        SandboxInputError: an option is invalid.
    """

    NAME = "subprocess"
    DESIGNED = ("network_isolated", "env_cleared", "seccomp_filter", "uid_dropped", "memory_limited", "cpu_limited",
                "processes_limited", "file_size_limited")

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
        super().__init__(limits=limits, uids=uids, python=python, required=required, keep_workdir=keep_workdir,
                         workdir_root=workdir_root, env=env)
        self.setpriv = shutil.which("setpriv")
        self.kill = shutil.which("kill")

    def __repr__(self) -> str:
        return f"SubprocessSandbox(uids={self.uids!r}, python={self.python!r}, limits={self.limits!r})"

    def _preflight(self) -> None:
        if not shutil.which("prlimit"):
            raise SandboxUnavailableError("prlimit is not installed: apt-get install util-linux")
        if not os.access(self.python, os.X_OK):
            raise SandboxUnavailableError(f"python {self.python!r} is not an executable; pass python=")
        if self.root and not self.setpriv:
            raise SandboxUnavailableError("setpriv is not installed (needed to leave uid 0): apt-get install util-linux")

    def _argv(self, uid: int | None, workdir: str, limits: Limits, result_fd: int,
              seccomp_fd: int) -> tuple[list[str], str, dict[str, str]]:
        argv: list[str] = []
        if uid is not None:
            assert self.setpriv is not None
            argv += [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                     "--bounding-set=-all", "--nnp", "--pdeathsig", "KILL", "--"]
        elif self.setpriv:
            argv += [self.setpriv, "--nnp", "--pdeathsig", "KILL", "--"]
        argv += [*self._prlimit(limits), *self._runner_argv(limits, result_fd, seccomp_fd)]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               **self.env}
        return argv, workdir, env

    def _after_exit(self, uid: int | None) -> None:
        # no PID namespace: a process the code started (even one that left the session) lives on as U
        if uid is not None and self.setpriv:
            from ._local import processes_of

            if processes_of(uid):
                kill = [self.kill, "-9", "-1"] if self.kill else [self.python, "-c",
                                                                              "import os; os.kill(-1, 9)"]
                subprocess.run([self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *kill],
                               capture_output=True, check=False, env={"PATH": "/usr/bin:/bin"})
        super()._after_exit(uid)

    def _interpret(self, facts: dict[str, Any], limits: Limits) -> Guarantees:
        holds: dict[str, bool] = {}
        reasons: dict[str, str] = {}
        how: dict[str, str] = {}

        def put(name: str, ok: bool, mechanism: str, reason: str) -> None:
            holds[name] = ok
            (how if ok else reasons)[name] = mechanism if ok else reason

        seccomp_on = facts.get("seccomp") == "2"
        inet = str(facts.get("inet_socket"))
        put("network_isolated", inet.startswith("refused"),
            "the seccomp filter refuses every socket but AF_UNIX (no network namespace: the host's devices "
            "exist, no socket can reach them)",
            "sockets can be opened: " + (seccomp_available()[1] or "no seccomp filter is loaded"))
        writable = facts.get("writable") or []
        put("filesystem_readonly", not writable, "nothing outside the work dir is writable by the uid",
            f"no mount namespace: these host directories are writable by the code: {writable}")
        readable = facts.get("readable") or []
        put("secrets_invisible", False, "",
            "no mount namespace: world-readable host files are readable (e.g. /etc/passwd, source trees); files "
            "readable only by their owner (mode 600, /etc/shadow) are not"
            + (f"; readable now: {readable}" if "/etc/shadow" in readable else ""))
        allowed = set(_BASE_ENV) | set(self.env)
        extra_env = [k for k in facts.get("env") or [] if k not in allowed]
        put("env_cleared", not extra_env, "the launcher is given only PATH, HOME, TMPDIR, LANG"
            + (f" and {', '.join(sorted(self.env))}" if self.env else ""), f"variables passed in: {extra_env}")
        ok_sc, why_sc = seccomp_available()
        put("seccomp_filter", seccomp_on,
            "loaded by the runner (no_new_privs, then PR_SET_SECCOMP) before the code: non-AF_UNIX sockets refused "
            f"(EACCES), clone3 ENOSYS, new user namespaces and {', '.join(DENIED_SYSCALLS)} refused (EPERM)",
            why_sc if not ok_sc else f"no seccomp filter is loaded (Seccomp: {facts.get('seccomp')})")
        uid = facts.get("uid")
        dropped = (self.root and uid in self.uids and facts.get("euid") == uid and facts.get("gid") == uid
                   and not facts.get("groups") and facts.get("cap_eff") == "0000000000000000")
        put("uid_dropped", bool(dropped),
            f"setpriv to the dedicated uid {uid} (no groups, empty capability and bounding sets, no_new_privs)",
            "not root: cannot switch to a dedicated uid; the code runs as your own uid and can read and write what "
            "you can" if not self.root else f"the code runs as uid {uid}, groups {facts.get('groups')}")
        rl = self._rlimit_checks(facts, limits)
        for name in ("memory_limited", "cpu_limited", "file_size_limited"):
            put(name, rl[name][0], rl[name][1], f"{name.replace('_limited', '')} rlimit not in force: {facts.get('rlimits')}")
        put("processes_limited", bool(rl["nproc_set"][0] and dropped),
            f"RLIMIT_NPROC={limits.processes} for a dedicated uid; what is left running is killed after each run",
            "RLIMIT_NPROC does not bind: " + ("it is not set" if not rl["nproc_set"][0] else
                                               "the code does not run as a dedicated uid, so the limit counts "
                                               "every process of that user (and is ignored for uid 0)"))
        put("disk_quota", False, "", "the work dir is on the host's disk: each file is capped by file_size_bytes, "
            "their number is not")
        return Guarantees(self.NAME, **holds, reasons=reasons, mechanisms=how, details={
            "uids": list(self.uids) if self.root else [os.geteuid()], "python": self.python,
            "setpriv": self.setpriv, "root": self.root, "self_test": facts})
