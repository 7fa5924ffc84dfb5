"""CodeAct: the model writes Python as its action; an ordinary tool runs it in a sandbox.

``codeact_tool(sandbox)`` returns a :class:`~fsm_agent.tools.registry.Tool` (default name
``run_python``, one argument ``code``). Because it is an ordinary tool, every call goes through the
ledger, approvals (``HumanApproval("run_python")``), policy (``ToolPolicy`` rules on ``code``),
the tool timeout, resume and the session log like any other.

What the model gets back:

* the code ran (``ExecutionResult.ok``): a JSON object from
  :meth:`~fsm_agent.sandbox.base.ExecutionResult.for_model` — ``ok``, ``stdout``, ``stderr``,
  ``return_value`` (or ``return_repr``), ``files``, and ``limits_hit`` when output was cut;
* the code raised, exited non-zero, was killed, or a limit fired: the tool-error path
  (:class:`~fsm_agent.sandbox.base.CodeExecutionError`, a :class:`~fsm_agent.errors.ToolError`):
  an error result (``is_error``; the ledger says ``failed``; ``metadata["error"]`` is
  ``limit_exceeded`` or ``code_error``) whose text is the same JSON object, naming the exception
  and each limit that fired (``"limits_hit": ["cpu"]`` and a sentence per limit);
* the sandbox refused or failed (not the code's doing): the runtime's error result ``Tool 'run_python'
  failed: <type>: <message>``, where the type is always one of the sandbox's documented errors
  (:class:`~fsm_agent.sandbox.base.GuaranteeNotHeldError`,
  :class:`~fsm_agent.sandbox.base.SandboxUnavailableError`,
  :class:`~fsm_agent.sandbox.base.SandboxInputError`, :class:`~fsm_agent.sandbox.base.SandboxError`):
  any other exception from the sandbox is wrapped in a ``SandboxError``.

Effect (what a resume may repeat), chosen from the sandbox's guarantees unless ``effect=`` is given:
``pure`` when the sandbox reports ``network_isolated`` and ``filesystem_readonly`` and throws each
call's work dir away (then a call leaves nothing behind, and repeating it after a crash cannot do
anything twice): the bubblewrap sandbox, and the subprocess sandbox with Landlock; ``side_effect``
otherwise (the subprocess sandbox without Landlock can write ``/tmp``; a remote executor, or a kept
work dir, may keep state).

Where the guarantees are recorded for the session:

* always, in the session log: the first call of each session (in this process) reports a
  ``tool_progress`` event whose message is ``sandbox <summary>`` (:meth:`Guarantees.summary`);
  every call then reports ``ok in 0.05 s`` / ``failed in 2.01 s (limits: cpu)``;
* with ``store=``, in the session's metadata under ``"sandbox"`` (:func:`record_guarantees`: every
  guarantee, its reason or mechanism, the machine's facts), shown by
  ``fsm-agent sessions show ID --json``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson

from ..tools.registry import Tool, ToolContext, ToolEffect
from ._inputs import checked_run
from .base import (
    CodeExecutionError,
    GuaranteeNotHeldError,
    Guarantees,
    Limits,
    Sandbox,
    SandboxInputError,
    check_timeout,
    typed_errors,
)

if TYPE_CHECKING:
    from ..store.base import Store

__all__ = ["SESSION_METADATA_KEY", "codeact_tool", "default_sandbox", "record_guarantees"]

log = logging.getLogger("fsm_agent.sandbox")

SESSION_METADATA_KEY = "sandbox"
"""The session metadata key :func:`record_guarantees` writes."""


def default_sandbox(**options: Any) -> Sandbox:
    """The best local sandbox on this machine: :class:`~fsm_agent.sandbox.bubblewrap.BubblewrapSandbox`
    when ``bwrap`` is on ``PATH``, else :class:`~fsm_agent.sandbox.subprocess.SubprocessSandbox`. Says
    which in the ``fsm_agent.sandbox`` log (INFO) and in the returned sandbox's ``name``.

    ``options`` go to the chosen class (``options=`` a :class:`~fsm_agent.sandbox.options.SandboxOptions`,
    or ``limits``, ``uids``, ``python``, ``required`` ...; a bubblewrap-only option such as ``ro_binds``
    is dropped when the subprocess sandbox is chosen, with a warning)."""
    from .bubblewrap import BubblewrapSandbox
    from .subprocess import SubprocessSandbox

    bwrap = shutil.which("bwrap")
    if bwrap:
        log.info("CodeAct sandbox: bubblewrap (%s)", bwrap)
        return BubblewrapSandbox(**options)
    dropped = sorted(set(options) & {"ro_binds", "tmp_bytes", "bwrap"})
    if dropped:
        log.warning("CodeAct sandbox: bwrap is not installed; the subprocess sandbox ignores %s", ", ".join(dropped))
    log.info("CodeAct sandbox: subprocess (bwrap is not installed: apt-get install bubblewrap for namespaces)")
    return SubprocessSandbox(**{k: v for k, v in options.items() if k not in dropped})


async def record_guarantees(store: Store, session_id: str, guarantees: Guarantees | Sandbox) -> dict[str, Any]:
    """Write the guarantees into the session's metadata under :data:`SESSION_METADATA_KEY` (merged with
    the metadata already there) and return what was written (:meth:`Guarantees.to_json`).

    Raises:
        KeyError: unknown session.
        StoreError: the store could not be written.
    """
    g = guarantees if isinstance(guarantees, Guarantees) else await guarantees.start()
    doc = g.to_json()
    await store.update_metadata(session_id, {SESSION_METADATA_KEY: doc})
    return doc


def _describe(limits: Limits) -> str:
    return (
        "Run Python 3 code in an isolated sandbox and get its result as JSON. The value of the last line, if it "
        "is an expression (or else of a variable named `result`), comes back as return_value; print() output "
        "comes back as stdout. Use it for any calculation. There is no network access; files written in the "
        "current directory last for this call only. Limits: "
        f"{limits.memory_bytes // (1024 * 1024)} MiB memory, {limits.cpu_seconds} s CPU, "
        f"{limits.wall_seconds:g} s in all.")


def codeact_tool(
    sandbox: Sandbox | None = None,
    *,
    name: str = "run_python",
    description: str | None = None,
    limits: Limits | None = None,
    files: Mapping[str, bytes | str] | None = None,
    effect: ToolEffect | str | None = None,
    store: Store | None = None,
    timeout_margin: float = 10.0,
    max_chars: int = 8000,
) -> Tool:
    """A tool that runs the model's Python in ``sandbox`` (see the module docstring).

    Args:
        sandbox: where the code runs (default :func:`default_sandbox()`).
        name: the tool's name.
        description: what the model reads (default: what it does, the return-value rule, the limits).
        limits: limits of each call (default: the sandbox's own ``limits``, else :class:`Limits()`).
        files: written into each call's work dir first (relative path -> content).
        effect: the tool's :class:`~fsm_agent.tools.registry.ToolEffect`; default from the guarantees.
        store: when given, the first call of each session records the guarantees in the session's
            metadata (:func:`record_guarantees`).
        timeout_margin: seconds the tool's timeout adds to ``limits.wall_seconds`` (the sandbox
            enforces the wall limit itself; the tool timeout is a backstop).
        max_chars: each text of the result is cut to this many characters for the model.

    Raises:
        GuaranteeNotHeldError: a guarantee the sandbox requires does not hold here (found now,
            not at the first call).
        SandboxUnavailableError: the sandbox cannot run on this machine.
        SandboxInputError: an option is invalid (``files`` included: each path relative, UTF-8 text).
    """
    if sandbox is None:
        sandbox = default_sandbox()
    if not isinstance(sandbox, Sandbox):
        raise SandboxInputError(f"sandbox must implement the Sandbox protocol, not {type(sandbox).__name__}")
    lim = limits if limits is not None else getattr(sandbox, "limits", None) or Limits()
    if not isinstance(lim, Limits):
        raise SandboxInputError(f"limits must be a Limits, not {type(lim).__name__}")
    margin = check_timeout(timeout_margin, "timeout_margin")
    g = sandbox.guarantees()
    required = tuple(getattr(sandbox, "required", ()))
    missing = tuple(r for r in required if not getattr(g, r))
    if missing and g.details:  # a remote sandbox not started yet has no details: checked at its first run
        raise GuaranteeNotHeldError(sandbox.name, missing, g)
    if effect is None:
        throwaway = getattr(sandbox, "keep_workdir", True) is False
        effect = ToolEffect.PURE if (g.network_isolated and g.filesystem_readonly and throwaway) else ToolEffect.SIDE_EFFECT
    checked_run("", files, lim, None, lim)  # the files are the caller's: refused now, not at the model's call
    seeded = dict(files or {})
    seen: set[str] = set()
    box = sandbox

    async def run_python(code: str, ctx: ToolContext) -> dict[str, Any]:
        # every sandbox error the model reads is a documented one (anything else: a SandboxError)
        if ctx.session_id not in seen:
            with typed_errors(box.name, "starting"):
                started = await box.start()
            ctx.report_progress(0, 1, f"sandbox {started.summary()}")
            if store is not None and ctx.session_id:
                await record_guarantees(store, ctx.session_id, started)
            seen.add(ctx.session_id)
        with typed_errors(box.name, "running the model's code"):
            result = await box.run(code, files=seeded or None, limits=lim)
            answer = result.for_model(max_chars)
            text = orjson.dumps(answer).decode()
        note = f" (limits: {', '.join(result.limits_hit)})" if result.limits_hit else ""
        ctx.report_progress(1, 1, f"{'ok' if result.ok else 'failed'} in {result.duration_s:.2f} s{note}")
        if not result.ok:
            raise CodeExecutionError(result, text)
        return answer

    return Tool(run_python, name=name, description=description if description is not None else _describe(lim),
                parameters={"type": "object", "properties": {"code": {
                    "type": "string", "description": "Python 3 source to run, e.g. \"sum(range(10))\""}},
                    "required": ["code"], "additionalProperties": False},
                timeout=lim.wall_seconds + margin, effect=effect)
