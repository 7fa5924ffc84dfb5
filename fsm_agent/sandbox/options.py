"""SandboxOptions: what every sandbox is configured with, in one value, validated once.

The three sandboxes take the same options, two ways:

* as keywords, one per field: ``BubblewrapSandbox(limits=Limits(cpu_seconds=5), workdir_root="/var/tmp")``;
* as one value: ``BubblewrapSandbox(options=SandboxOptions(limits=..., workdir_root=...))``, which can
  be kept, compared, handed to several sandboxes (and to
  :func:`~fsm_agent.sandbox.codeact.default_sandbox`), and changed with :func:`attrs.evolve`.

Not both in one call (``options=`` and a keyword of its fields raise :class:`SandboxInputError`):
there is no rule to learn about which one wins. What only one mechanism has stays a keyword of its
class (``ro_binds``, ``tmp_bytes``, ``bwrap`` of the bubblewrap sandbox; ``ro_paths``, ``landlock``
of the subprocess sandbox). :class:`~fsm_agent.sandbox.remote.RemoteSandbox` uses ``limits`` and
``required`` and refuses options that set a field only the local sandboxes use.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

import attrs
from attrs import field, frozen

from ._inputs import host_path, is_utf8
from .base import GUARANTEE_NAMES, Limits, SandboxInputError

__all__ = ["DEFAULT_UIDS", "MAX_UID", "SandboxOptions", "SandboxOptionsKeywords"]

DEFAULT_UIDS: range = range(2_100_000_000, 2_100_000_004)
"""The dedicated uids (numeric; no passwd entry is needed) a sandbox run as root switches to, one per
concurrent run. Pick others (``uids=``) when these are used on your machine: nothing else may run as
them, since every process of such a uid counts against the run's process limit and is killed after
the subprocess sandbox's runs."""

MAX_UID = 2**31 - 2
"""The largest uid accepted (bwrap and setpriv take signed 32-bit ids; ``2**31 - 1`` is reserved)."""

LOCAL_ONLY: tuple[str, ...] = ("uids", "python", "keep_workdir", "workdir_root", "env")
"""The fields only the local sandboxes use (a remote executor has its own)."""


def _limits(value: Any) -> Limits:
    if not isinstance(value, Limits):
        raise SandboxInputError(f"limits must be a Limits, not {type(value).__name__}")
    return value


def _required(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise SandboxInputError(f"required must be a list of guarantee names, not {type(value).__name__} {value!r}")
    req = tuple(value)
    unknown = [r for r in req if r not in GUARANTEE_NAMES]
    if unknown:
        raise SandboxInputError(f"required names unknown guarantee(s) {unknown}; known: {', '.join(GUARANTEE_NAMES)}")
    return req


def _uids(value: Any) -> tuple[int, ...]:
    bad = f"uids must be a non-empty list of numeric uids between 1 and {MAX_UID}: {value!r}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise SandboxInputError(bad)
    pool = tuple(value)
    if not pool or any(isinstance(u, bool) or not isinstance(u, int) or not 0 < u <= MAX_UID for u in pool):
        raise SandboxInputError(bad)
    if len(set(pool)) != len(pool):
        raise SandboxInputError(f"uids must be distinct: {value!r}")
    return pool


def _python(value: Any) -> str:
    return host_path("python", value)


def _workdir_root(value: Any) -> str | None:
    return None if value is None else host_path("workdir_root", value)


def _bool(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise SandboxInputError(f"{attribute.name} must be True or False, not {value!r}")


def _env(value: Any) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise SandboxInputError(f"env must be a mapping of variable names to values, not {type(value).__name__}")
    env = dict(value)
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\x00" in k + v \
                or not is_utf8(k + v):
            raise SandboxInputError(f"env: {k!r}={v!r} is not an environment variable (UTF-8 text, a name "
                                    "without '=')")
    return types.MappingProxyType(env)


@frozen
class SandboxOptions:
    """The options every sandbox takes (see the module docstring for the two ways to pass them).

    Each field is checked here, once, when the value is made.

    Raises:
        SandboxInputError: a field is invalid (the message names it and what is accepted).
    """

    limits: Limits = field(factory=Limits, converter=_limits)
    """Default :class:`~fsm_agent.sandbox.base.Limits` of each run (bytes, seconds, counts); a run's own
    ``limits=`` or ``timeout=`` (seconds) overrides them for that run."""
    required: tuple[str, ...] | None = field(default=None, converter=_required)
    """Names of :data:`~fsm_agent.sandbox.base.GUARANTEE_NAMES` that must hold, else ``run`` raises
    :class:`~fsm_agent.sandbox.base.GuaranteeNotHeldError`. ``None``: the sandbox's own default
    (a local sandbox's ``DESIGNED``: every guarantee it is built to give; the remote sandbox: none).
    ``()`` requires nothing; fewer names opt in to weaker isolation."""
    uids: tuple[int, ...] = field(default=tuple(DEFAULT_UIDS), converter=_uids)
    """(Local sandboxes.) The dedicated numeric uids, 1 to :data:`MAX_UID`, distinct: one per
    concurrent run, each locked machine-wide for its call. Used only when running as root. Nothing
    else may use them."""
    python: str = field(default="/usr/bin/python3", converter=_python)
    """(Local sandboxes.) Host path of the interpreter that runs the code; the bubblewrap sandbox
    needs it under ``/usr`` or one of its ``ro_binds``."""
    keep_workdir: bool = field(default=False, validator=_bool)
    """(Local sandboxes.) Keep each run's work dir, handed to root (its host path is
    ``ExecutionResult.workdir``); ``False`` removes it when the run returns."""
    workdir_root: str | None = field(default=None, converter=_workdir_root)
    """(Local sandboxes.) Host directory the work dirs are created in; ``None``: the system temp dir.
    Every directory above it must be searchable by others, and it must not be writable by others
    without the sticky bit (checked at ``start()``)."""
    env: Mapping[str, str] = field(factory=dict, converter=_env, hash=False,
                                   repr=lambda env: repr(dict(env)))
    """(Local sandboxes.) Extra environment variables for the code (read-only; never pass secrets)."""

    def for_remote(self) -> SandboxOptions:
        """These options, checked to set no field only the local sandboxes use.

        Raises:
            SandboxInputError: one of :data:`LOCAL_ONLY` differs from its default.
        """
        set_ = [n for n in LOCAL_ONLY if getattr(self, n) != getattr(_DEFAULTS, n)]
        if set_:
            raise SandboxInputError(f"the remote sandbox uses only limits and required from its options; "
                                    f"{', '.join(set_)} appl{'ies' if len(set_) == 1 else 'y'} to the local "
                                    "sandboxes (configure the remote executor instead)")
        return self


_DEFAULTS = SandboxOptions()


class SandboxOptionsKeywords(TypedDict, total=False):
    """The fields of :class:`SandboxOptions` as keywords of a local sandbox's constructor (for type
    checkers; the values are checked by :class:`SandboxOptions`)."""

    limits: Limits
    required: Sequence[str] | None
    uids: Sequence[int]
    python: str | os.PathLike[str]
    keep_workdir: bool
    workdir_root: str | os.PathLike[str] | None
    env: Mapping[str, str]


_FIELDS = frozenset(a.name for a in attrs.fields(SandboxOptions))


def resolve(owner: str, options: SandboxOptions | None, keywords: Mapping[str, Any]) -> SandboxOptions:
    """The options of a sandbox constructor called ``owner``: ``options``, or one made from
    ``keywords`` (fields of :class:`SandboxOptions`).

    Raises:
        TypeError: a keyword is no field of :class:`SandboxOptions` (nor an option of ``owner``).
        SandboxInputError: ``options`` is not a :class:`SandboxOptions`, both ``options`` and
            keywords are given, or a value is invalid.
    """
    unknown = sorted(set(keywords) - _FIELDS)
    if unknown:
        raise TypeError(f"{owner}() got unexpected keyword argument(s) {', '.join(unknown)}")
    if options is None:
        return SandboxOptions(**keywords)
    if not isinstance(options, SandboxOptions):
        raise SandboxInputError(f"options must be a SandboxOptions, not {type(options).__name__}")
    if keywords:
        given = ", ".join(f"{k}=" for k in sorted(keywords))
        raise SandboxInputError(f"{owner}: pass options= or the keywords {given}, not both "
                                "(attrs.evolve(options, ...) makes options with some fields changed)")
    return options
