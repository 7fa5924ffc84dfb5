"""BubblewrapSandbox: the default CodeAct sandbox when ``bwrap`` is installed.

The launcher chain of every run (as root; ``../shared/design/orchestration.md`` records the probes
this recipe passed)::

    setpriv --reuid=U --regid=U --clear-groups --inh-caps=-all --bounding-set=-all --pdeathsig KILL --
      bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session --cap-drop ALL
            --hostname sandbox
            --ro-bind /usr /usr   (and /lib, /lib64, /bin, /sbin as the host has them: symlinks or read-only binds)
            --proc /proc --dev /dev --size TMP_BYTES --tmpfs /dev/shm --remount-ro /dev
            --size TMP_BYTES --tmpfs /tmp
            --bind ROOT/fsm-sandbox-bubblewrap-XXXX/work /work --chdir /work
            --remount-ro /
            --clearenv --setenv PATH ... --setenv HOME /work --setenv TMPDIR /tmp --setenv LANG C.UTF-8
            --seccomp FD
      -- prlimit --as --cpu --nproc --fsize --nofile --core=0 --
      python3 -I -c RUNNER

``U`` is a dedicated numeric uid from the pool (default
:data:`~fsm_agent.sandbox.options.DEFAULT_UIDS`), locked machine-wide for the call. The runner forks
a monitor that reports the code's true exit status or signal (bwrap itself turns a death by signal
N into exit status 128+N, which code could fake). The root check matters: bwrap and rlimits as root
keep uid 0 (``RLIMIT_NPROC`` is ignored for it), so as root the uid is always dropped first. Run as
an ordinary user, ``setpriv`` is left out and the code runs as that user's uid inside the user
namespace (``uid_dropped`` and ``processes_limited`` then do not hold).

Beyond the recorded recipe: ``--unshare-user --disable-userns`` (no nested user namespaces),
``--size`` on ``/tmp`` and ``/dev/shm`` and a read-only ``/dev`` (a tmpfs holds memory that
``RLIMIT_AS`` does not count), ``--hostname``, ``--inh-caps=-all --bounding-set=-all`` on
setpriv, and a seccomp filter that also refuses AF_UNIX sockets, System V IPC and memfd.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._inputs import host_paths
from ._local import LocalSandbox
from ._seccomp import DENIED_SYSCALLS, seccomp_available
from ._selftest import memory_check, rlimit_checks
from .base import KiB, MiB, Guarantees, Limits, SandboxInputError, SandboxUnavailableError
from .options import SandboxOptions, SandboxOptionsKeywords, resolve

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["BubblewrapSandbox"]

_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
_BASE_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE", "PWD")
"""Variables the code may see: what the sandbox sets, and what the interpreter adds (``LC_CTYPE`` by
C-locale coercion; ``PWD``)."""


@functools.cache
def _bwrap_features(bwrap: str) -> tuple[str, frozenset[str]]:
    """(version, supported options among those used beyond the basic recipe)."""
    try:
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        helptext = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "", frozenset()
    return version, frozenset(o for o in ("--disable-userns", "--size") if o in helptext)


class BubblewrapSandbox(LocalSandbox):
    """Runs each call in a fresh bubblewrap sandbox as a dedicated uid (see the module docstring).

    Takes the options every sandbox takes (:class:`~fsm_agent.sandbox.options.SandboxOptions`), as
    ``options=`` or as keywords (not both), and its own:

    Args:
        options: the shared options in one value.
        **shared: or each as a keyword: ``limits``, ``uids`` (used only as root), ``python`` (must live
            under ``/usr`` or ``ro_binds``), ``required`` (default :attr:`DESIGNED`: all but
            ``disk_quota``; as an ordinary user, ``uid_dropped`` and ``processes_limited`` cannot
            hold), ``keep_workdir``, ``workdir_root``, ``env``; see
            :class:`~fsm_agent.sandbox.options.SandboxOptions` for each.
        ro_binds: extra host paths made visible read-only at the same path (a virtualenv, data).
        tmp_bytes: size of each of the private ``/tmp`` and ``/dev/shm`` tmpfs, bytes (default 64 MiB).
        bwrap: path of ``bwrap`` (default: found on ``PATH``).

    Raises:
        SandboxInputError: an option is invalid, or ``options`` and shared keywords are both given.
        TypeError: an unknown keyword.
    """

    NAME = "bubblewrap"
    DESIGNED = ("network_isolated", "filesystem_readonly", "secrets_invisible", "env_cleared", "seccomp_filter",
                "uid_dropped", "memory_limited", "cpu_limited", "processes_limited", "file_size_limited")

    def __init__(
        self,
        *,
        options: SandboxOptions | None = None,
        ro_binds: Sequence[str] = (),
        tmp_bytes: int = 64 * MiB,
        bwrap: str | None = None,
        **shared: Unpack[SandboxOptionsKeywords],
    ) -> None:
        super().__init__(resolve("BubblewrapSandbox", options, shared))
        self.ro_binds = host_paths("ro_binds", ro_binds)
        if isinstance(tmp_bytes, bool) or not isinstance(tmp_bytes, int) or tmp_bytes < 64 * KiB:
            raise SandboxInputError(f"tmp_bytes must be a whole number of bytes of at least 65536, got {tmp_bytes!r}")
        self.tmp_bytes = tmp_bytes
        self.bwrap = bwrap or shutil.which("bwrap")
        self.setpriv = shutil.which("setpriv")

    def __repr__(self) -> str:
        return f"BubblewrapSandbox(uids={self.uids!r}, python={self.python!r}, limits={self.limits!r})"

    def _preflight(self) -> None:
        if not self.bwrap or not os.access(self.bwrap, os.X_OK):
            raise SandboxUnavailableError("bubblewrap is not installed: apt-get install bubblewrap (or use "
                                          "SubprocessSandbox, or default_sandbox() to pick what is available)")
        if not shutil.which("prlimit"):
            raise SandboxUnavailableError("prlimit is not installed: apt-get install util-linux")
        if self.root and not self.setpriv:
            raise SandboxUnavailableError("setpriv is not installed (needed to leave uid 0): apt-get install util-linux")
        real = os.path.realpath(self.python)
        visible = ("/usr",) + self.ro_binds
        if not os.access(self.python, os.X_OK) or not any(real == v or real.startswith(v + "/") for v in visible):
            raise SandboxUnavailableError(f"python {self.python!r} (-> {real}) is not an executable under /usr or "
                                          "ro_binds; pass python= with an interpreter the sandbox can see")
        for p in self.ro_binds:
            if not os.path.exists(p):
                raise SandboxUnavailableError(f"ro_binds: {p!r} does not exist")

    def _argv(self, uid: int | None, workdir: str, limits: Limits, result_fd: int,
              seccomp_fd: int) -> tuple[list[str], str, dict[str, str]]:
        assert self.bwrap is not None
        _, features = _bwrap_features(self.bwrap)
        argv: list[str] = []
        if uid is not None:
            assert self.setpriv is not None
            argv += [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                     "--bounding-set=-all", "--pdeathsig", "KILL", "--"]
        argv += [self.bwrap, "--unshare-all", "--unshare-user"]
        if "--disable-userns" in features:
            argv.append("--disable-userns")
        argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox",
                 "--ro-bind", "/usr", "/usr"]
        for top in ("/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        for p in self.ro_binds:
            argv += ["--ro-bind", p, p]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        size = ["--size", str(self.tmp_bytes)] if "--size" in features else []
        # /dev is a tmpfs of its own, writable and unbounded: its files would hold memory no rlimit counts
        argv += [*size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev", *size, "--tmpfs", "/tmp"]
        argv += ["--bind", workdir, "/work", "--chdir", "/work", "--remount-ro", "/",
                 "--clearenv", "--setenv", "PATH", _SANDBOX_PATH, "--setenv", "HOME", "/work", "--setenv", "TMPDIR",
                 "/tmp", "--setenv", "LANG", "C.UTF-8"]
        for k, v in self.env.items():
            argv += ["--setenv", k, v]
        if seccomp_fd >= 0:
            argv += ["--seccomp", str(seccomp_fd)]
        argv += ["--", *self._prlimit(limits), *self._runner_argv(limits, result_fd, -1)]
        return argv, workdir, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}

    def _interpret(self, facts: dict[str, Any], limits: Limits) -> Guarantees:
        holds: dict[str, bool] = {}
        reasons: dict[str, str] = {}
        how: dict[str, str] = {}

        def put(name: str, ok: bool, mechanism: str, reason: str) -> None:
            holds[name] = ok
            (how if ok else reasons)[name] = mechanism if ok else reason

        seccomp_on = facts.get("seccomp") == "2"
        inet, unix = str(facts.get("inet_socket")), str(facts.get("unix_socket"))
        ifaces = facts.get("interfaces")
        put("network_isolated", isinstance(ifaces, list) and set(ifaces) <= {"lo"},
            "own network namespace with only a loopback device (bwrap --unshare-net; abstract UNIX sockets are "
            "per namespace too), and no host UNIX socket is mounted"
            + ("; the seccomp filter also refuses socket() for every family" if inet.startswith("refused")
               and unix.startswith("refused") else ""),
            f"the sandbox sees network devices {ifaces}")
        writable = [p for p in facts.get("writable") or [] if p not in ("/tmp", "/dev/shm")]
        put("filesystem_readonly", not writable,
            f"read-only root (--remount-ro /) and /dev, /usr bound read-only; /tmp and /dev/shm are private tmpfs of "
            f"{self.tmp_bytes} bytes each, dropped after the run; only the work dir (/work) is shared with the host",
            f"writable outside the work dir: {writable}")
        leaked = [p for p in facts.get("visible") or [] if p not in ("/proc/1/environ",)]
        readable = [p for p in facts.get("readable") or [] if p.startswith("/etc/")]  # /proc/1 is bwrap's own
        secret_ok = not leaked and not readable
        put("secrets_invisible", secret_ok,
            "a new mount namespace shows only /usr" + (f", {', '.join(self.ro_binds)}" if self.ro_binds else "")
            + " and the work dir: no /etc, /root, /home, keys or the caller's files",
            f"visible inside the sandbox: {leaked or readable}")
        allowed = set(_BASE_ENV) | set(self.env)
        extra_env = [k for k in facts.get("env") or [] if k not in allowed]
        put("env_cleared", not extra_env, "bwrap --clearenv, then only PATH, HOME, TMPDIR, LANG"
            + (f" and {', '.join(sorted(self.env))}" if self.env else "") + "; the launcher itself gets only PATH",
            f"variables passed in: {extra_env}")
        ok_sc, why_sc = seccomp_available()
        put("seccomp_filter", seccomp_on,
            "bwrap --seccomp with a BPF program from pyseccomp: sockets refused (EACCES), System V IPC and memfd "
            f"refused, clone3 ENOSYS, new user namespaces and {', '.join(DENIED_SYSCALLS)} refused (EPERM)",
            why_sc if not ok_sc else f"no seccomp filter is loaded (Seccomp: {facts.get('seccomp')})")
        uid = facts.get("uid")
        dropped = (self.root and uid in self.uids and facts.get("euid") == uid and facts.get("gid") == uid
                   and not facts.get("groups") and facts.get("cap_eff") == "0000000000000000")
        put("uid_dropped", bool(dropped),
            f"setpriv to the dedicated uid {uid} (no groups, empty capability and bounding sets), then "
            "bwrap --cap-drop ALL",
            "not root: the code runs as your own uid inside a user namespace (it cannot switch to a dedicated "
            "uid); run as root for a dedicated uid" if not self.root else f"the code runs as uid {uid}, "
            f"groups {facts.get('groups')}, capabilities {facts.get('cap_eff')}")
        rl = rlimit_checks(facts, limits)
        for name in ("cpu_limited", "file_size_limited"):
            put(name, rl[name][0], rl[name][1], f"{name.replace('_limited', '')} rlimit not in force: {facts.get('rlimits')}")
        ok_mem, mech_mem, why_mem = memory_check(
            facts, limits, self._root_dir, private=("/tmp", "/dev/shm"),
            extra=f"; the private /tmp and /dev/shm are tmpfs of {self.tmp_bytes} bytes each, /dev is read-only")
        put("memory_limited", ok_mem, mech_mem, why_mem)
        put("processes_limited", bool(rl["nproc_set"][0] and dropped),
            f"RLIMIT_NPROC={limits.processes} for a dedicated uid that nothing else uses",
            "RLIMIT_NPROC does not bind: " + ("it is not set" if not rl["nproc_set"][0] else
                                               "the code does not run as a dedicated uid, so the limit counts "
                                               "every process of that user (and is ignored for uid 0)"))
        put("disk_quota", False, "", "the work dir is on the host's disk: each file is capped by file_size_bytes, "
            f"their number is not (the private /tmp and /dev/shm are capped at {self.tmp_bytes} bytes each)")
        version, features = _bwrap_features(self.bwrap or "")
        return Guarantees(self.NAME, **holds, reasons=reasons, mechanisms=how, details={
            "uids": list(self.uids) if self.root else [os.geteuid()], "python": self.python, "bwrap": self.bwrap,
            "bwrap_version": version, "bwrap_options": sorted(features), "setpriv": self.setpriv if self.root else None,
            "root": self.root, "self_test": facts})
