"""The seccomp filter every local sandbox loads, compiled to a BPF program by PyPI ``pyseccomp``
(ctypes over the system's libseccomp2; the ``sandbox`` extra).

Default action: allow. Refused (the call fails; nothing is killed, so the code sees an ordinary
``OSError``):

* ``socket``, for every address family (AF_UNIX included) → ``EACCES``: no TCP/UDP/raw/netlink/
  packet sockets, so no network and no DNS even where no network namespace exists, and no
  connection to a host service's UNIX socket (a database's ``/tmp/.s.PGSQL.*``, an abstract
  socket). ``socketpair`` stays allowed: a pair connects the code only to itself (asyncio's
  self-pipe, ``multiprocessing`` pipes);
* System V IPC (``shmget``/``shmat``/``shmdt``/``shmctl``, ``msgget``/``msgsnd``/``msgrcv``/
  ``msgctl``, ``semget``/``semop``/``semtimedop``/``semctl``), POSIX message queues (``mq_*``),
  ``memfd_create`` and ``memfd_secret`` → ``EPERM``: each holds memory that ``RLIMIT_AS`` does not
  count (a detached shared-memory segment, a memfd written with ``write``), and a System V
  segment outlives the process that made it;
* ``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd`` (reading other processes or their
  descriptors), ``keyctl``, ``add_key``, ``request_key`` (kernel keyrings), ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``io_uring_setup``/``enter``/``register``, ``personality``,
  ``kexec_load``, ``init_module``, ``finit_module``, ``delete_module``, ``mount``, ``umount2``,
  ``pivot_root``, ``swapon``, ``swapoff``, ``reboot``, ``unshare``, ``setns`` (new namespaces) →
  ``EPERM``;
* ``clone3`` → ``ENOSYS`` (its flags cannot be inspected; the C library falls back to ``clone``),
  and ``clone`` with ``CLONE_NEWUSER`` → ``EPERM``.

Only the native architecture's calls are allowed; a call made through another ABI kills the
process (libseccomp's default for a foreign architecture).
"""

from __future__ import annotations

import errno
import functools
import tempfile

__all__ = ["DENIED_SYSCALLS", "MEMORY_SYSCALLS", "seccomp_available", "seccomp_program"]

MEMORY_SYSCALLS: tuple[str, ...] = (
    "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop",
    "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "memfd_create", "memfd_secret",
)
"""System calls refused with ``EPERM`` because what they make holds memory no rlimit counts."""

DENIED_SYSCALLS: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "keyctl", "add_key", "request_key", "bpf",
    "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "personality",
    "kexec_load", "init_module", "finit_module", "delete_module", "mount", "umount2", "pivot_root", "swapon",
    "swapoff", "reboot", "unshare", "setns",
)
"""System calls refused with ``EPERM`` (besides :data:`MEMORY_SYSCALLS`)."""

_CLONE_NEWUSER = 0x10000000


@functools.cache
def _compile() -> bytes | str:
    try:
        import pyseccomp as sc  # type: ignore[import-untyped]
    except ImportError as exc:
        return f"the Python package pyseccomp is not installed ({exc}): pip install 'fsm-agent[sandbox]'"
    try:
        flt = sc.SyscallFilter(sc.ALLOW)
        flt.add_rule(sc.ERRNO(errno.EACCES), "socket")
        for name in DENIED_SYSCALLS + MEMORY_SYSCALLS:
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER))
        with tempfile.TemporaryFile() as fh:  # libseccomp writes to a file descriptor
            flt.export_bpf(fh)
            fh.seek(0)
            program = fh.read()
    except Exception as exc:  # noqa: BLE001 - libseccomp missing or too old: say so, do not crash
        return f"pyseccomp could not build the filter ({type(exc).__name__}: {exc}); install libseccomp2"
    return program


def seccomp_program() -> bytes:
    """The filter as a BPF program (``struct sock_filter[]``, native byte order), built once.

    Raises:
        RuntimeError: pyseccomp or libseccomp is missing (the message says what to install).
    """
    program = _compile()
    if isinstance(program, str):
        raise RuntimeError(program)
    return program


def seccomp_available() -> tuple[bool, str]:
    """``(True, "")`` when the filter can be built here, else ``(False, why)``."""
    program = _compile()
    return (False, program) if isinstance(program, str) else (True, "")
