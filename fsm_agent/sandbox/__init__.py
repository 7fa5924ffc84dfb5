"""Sandboxes for model-written code (CodeAct): run Python under real OS isolation.

* :class:`Sandbox` — the protocol (``run``, ``start``/``guarantees``, ``aclose``), with
  :class:`Limits`, :class:`ExecutionResult`, :class:`Guarantees` (:mod:`fsm_agent.sandbox.base`);
* :class:`SandboxOptions` — the options every sandbox takes, as ``options=`` or as keywords;
* :class:`BubblewrapSandbox` — setpriv + bwrap + seccomp + prlimit, the default when ``bwrap`` exists;
* :class:`SubprocessSandbox` — uid drop + seccomp + Landlock + rlimits, for pip-only installs;
* :class:`RemoteSandbox` over a :class:`RemoteExecutor` (:class:`HttpRemoteExecutor`: HTTP JSON);
* :func:`codeact_tool` — the sandbox as an ordinary tool; :func:`default_sandbox`;
  :func:`record_guarantees`.

See ``docs/codeact.md`` for the threat model, the probes and the wire shape.
"""

from .base import (
    GUARANTEE_NAMES,
    LIMIT_NAMES,
    CodeError,
    CodeExecutionError,
    ExecutionResult,
    FileChange,
    GuaranteeNotHeldError,
    Guarantees,
    LimitName,
    Limits,
    RemoteSandboxError,
    Sandbox,
    SandboxError,
    SandboxInputError,
    SandboxUnavailableError,
)
from .bubblewrap import BubblewrapSandbox
from .codeact import SESSION_METADATA_KEY, codeact_tool, default_sandbox, record_guarantees
from .options import DEFAULT_UIDS, SandboxOptions
from .remote import HttpRemoteExecutor, RemoteExecutor, RemoteRequest, RemoteSandbox
from .subprocess import SubprocessSandbox

__all__ = [
    "BubblewrapSandbox",
    "CodeError",
    "CodeExecutionError",
    "DEFAULT_UIDS",
    "ExecutionResult",
    "FileChange",
    "GUARANTEE_NAMES",
    "GuaranteeNotHeldError",
    "Guarantees",
    "HttpRemoteExecutor",
    "LIMIT_NAMES",
    "LimitName",
    "Limits",
    "RemoteExecutor",
    "RemoteRequest",
    "RemoteSandbox",
    "RemoteSandboxError",
    "SESSION_METADATA_KEY",
    "Sandbox",
    "SandboxError",
    "SandboxInputError",
    "SandboxOptions",
    "SandboxUnavailableError",
    "SubprocessSandbox",
    "codeact_tool",
    "default_sandbox",
    "record_guarantees",
]
