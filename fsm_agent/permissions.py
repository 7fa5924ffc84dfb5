"""A session's permissions: the tools it may call and the scopes of their arguments (seed 004:
``policy.require(call, session.permissions)``).

:class:`Permissions` are set when a session is created (``Agent.run(..., permissions=...)``, the
CLI's ``--permissions FILE`` / ``--allow-tools``, the server's ``POST /sessions``, a tenant's
default) and are stored in its checkpoint. The engine checks them itself, with no plugin: at
PreTurn (the model is offered only the tools the session may call) and for every tool call in
MidTurn (a call outside them is denied before any middleware sees it, and the denial names the
permission in the event log). Neither the model nor a plugin can widen them: plugins read them as
``ctx.permissions``, a frozen value. A person narrows them with a :class:`~fsm_agent.control.Restrict`
control event (applied at the next PreTurn, or before the next tool call), and widens them only
through a :class:`~fsm_agent.control.RequestPermissions` control, which stops the run
WAITING_HUMAN until a person approves (or rejects) the request.

A call is permitted when its tool matches one of :attr:`Permissions.tools` (glob patterns;
``None``: every tool) and every :class:`Scope` naming its tool holds for its arguments, and the
same holds for every :class:`Restriction` added since. A scope is a condition of
:mod:`fsm_agent.conditions` on one argument: paths (``under``), hosts (``host``), amounts
(``le``, ``lt``, ``ge``, ``gt``), values (``in``, ``equals``, ``matches`` ...). An argument a
scope names that is missing fails the scope unless the scope is ``optional``.

File format (TOML; JSON with the same structure), also the ``permissions`` table of a task file
and the ``permissions`` object of ``POST /sessions``::

    tools = ["read_file", "fetch", "pay"]       # absent: every tool

    [[scope]]
    tool = "read_file"                          # glob pattern(s) of the tools it limits
    arg = "path"                                # dotted path into the arguments
    under = "/srv/data"

    [[scope]]
    tool = "fetch"
    arg = "url"
    host = ["example.com", "*.example.com"]

    [[scope]]
    tool = "pay"
    arg = "amount"
    gt = 0
    le = 100
"""

from __future__ import annotations

import fnmatch
import json
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any, Literal

import orjson

from attrs import evolve, field, frozen

from .conditions import MISSING, ArgumentCondition, lookup, parse_condition
from .errors import PermissionsError
from .types.content import ToolUseBlock
from .types.run import PendingAction

__all__ = ["PERMISSIONS_METADATA_KEY", "PERMISSIONS_REQUEST_TOOL", "PermissionDenial", "PermissionRequest", "Permissions", "Restriction", "Scope",
           "allowed_tools_permissions", "control_text", "read_control_text"]

PERMISSIONS_METADATA_KEY = "permissions"
"""The session metadata key of the permissions a session was created with (the file format): what
``Agent.run(permissions=...)``, the server (a request's and the tenant's) and the CLI store; the
run narrows the agent's own by them (and by a task's), so a durable host that starts the run from
the metadata gets them too."""
PERMISSIONS_REQUEST_TOOL = "request_permissions"
"""The name a pending permission request carries in a WAITING_HUMAN stop's ``pending_actions``
(its ``call`` is not a tool call: approving it widens the session's permissions)."""
_SCOPE_KEYS = ("tool", "arg", "optional")
_TOP_KEYS = ("tools", "scope", "restriction", "version")


def _globs(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:  # not a list: the check names it
        return (value,)


def _opt_globs(value: Any) -> tuple[str, ...] | None:
    return None if value is None else _globs(value)


def _check_globs(value: Any, what: str, where: str, problems: list[str], *, empty_ok: bool) -> None:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value) \
            or (not value and not empty_ok):
        problems.append(f"{where}: '{what}' must be a tool name or glob pattern, or a list of them"
                        + (" (an empty list: no tool)" if empty_ok else ""))


def _matches(name: str, globs: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


@frozen
class Scope:
    """A limit on one argument of the tools it names.

    Args:
        tools: glob patterns of the tools it limits (``"read_file"``, ``"fs_*"``).
        arg: dotted path of the argument (``"path"``, ``"payment.amount"``).
        checks: operators of :mod:`fsm_agent.conditions` and their values, all of which must hold
            (``{"under": "/srv"}``, ``{"host": ["example.com"]}``, ``{"gt": 0, "le": 100}``).
        optional: a call without the argument passes (default: it fails the scope).

    Raises:
        PermissionsError: an unknown operator or a value of the wrong type (every problem listed).
    """

    tools: tuple[str, ...] = field(converter=_globs)
    arg: str
    checks: dict[str, Any] = field(converter=dict)
    optional: bool = False
    _condition: ArgumentCondition = field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        problems: list[str] = []
        _check_globs(list(self.tools), "tool", "scope", problems, empty_ok=False)
        cond = parse_condition({"arg": self.arg, **self.checks}, f"scope on {self.arg!r}", problems)
        if "arg" in self.checks:
            problems.append(f"scope on {self.arg!r}: give the argument as arg=, not inside checks")
        if problems or cond is None:
            raise PermissionsError(problems)
        object.__setattr__(self, "_condition", cond)

    @classmethod
    def of(cls, tools: str | Sequence[str], arg: str, *, optional: bool = False, **checks: Any) -> Scope:
        """``Scope.of("read_file", "path", under="/srv")``: the checks as keywords."""
        return cls(tools, arg, checks, optional)

    def applies_to(self, tool: str) -> bool:
        """Whether this scope limits calls of ``tool``."""
        return _matches(tool, self.tools)

    def failure(self, arguments: Mapping[str, Any]) -> str | None:
        """``None`` when the arguments keep to this scope; else what does not."""
        if self.optional and lookup(arguments, self.arg) is MISSING:
            return None
        return self._condition.failure(arguments)

    def describe(self) -> str:
        """``"read_file: 'path' under ['/srv']"``."""
        return f"{', '.join(self.tools)}: {self._condition.describe()}" + (" (optional)" if self.optional else "")

    def to_dict(self) -> dict[str, Any]:
        """The scope as a table of the file format."""
        out: dict[str, Any] = {"tool": list(self.tools), "arg": self.arg, **self.checks}
        if self.optional:
            out["optional"] = True
        return out


def _layer_denial(tools: tuple[str, ...] | None, scopes: tuple[Scope, ...], name: str,
                  arguments: Mapping[str, Any], prefix: str) -> PermissionDenial | None:
    if tools is not None and not _matches(name, tools):
        allowed = ", ".join(tools) or "none"
        return PermissionDenial(f"{prefix}tools", f"tool {name!r} is not among the tools this session may call "
                                                  f"({allowed})")
    for i, scope in enumerate(scopes, 1):
        if scope.applies_to(name):
            why = scope.failure(arguments)
            if why is not None:
                return PermissionDenial(f"{prefix}scope {i}", why, scope.describe())
    return None


@frozen
class PermissionDenial:
    """Why a call is outside a session's permissions."""

    permission: str
    """The permission that refused it: ``"tools"``, ``"scope 2"``, ``"restriction 1: tools"``,
    ``"restriction 1: scope 1"``."""
    detail: str
    """What does not hold."""
    rule: str = ""
    """The refusing scope as text (``"read_file: 'path' under ['/srv']"``); empty for ``tools``."""

    def message(self) -> str:
        """The text of the denied call's result (what the model reads)."""
        rule = f" {self.rule}" if self.rule else ""
        return f"Tool call denied: outside this session's permissions ({self.permission}{rule}): {self.detail}"


def _scopes_to(values: Any) -> tuple[Scope, ...]:
    return tuple(values)


def _restrictions_to(values: Any) -> tuple[Restriction, ...]:
    return tuple(values)


@frozen
class Restriction:
    """A narrowing of a session's permissions (a person's :class:`~fsm_agent.control.Restrict`): a
    call must also keep to it. ``tools`` ``None``: no limit on the tool names."""

    tools: tuple[str, ...] | None = field(default=None, converter=_opt_globs)
    scopes: tuple[Scope, ...] = field(default=(), converter=_scopes_to)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The restriction as a table of the file format."""
        out: dict[str, Any] = {}
        if self.tools is not None:
            out["tools"] = list(self.tools)
        if self.scopes:
            out["scope"] = [s.to_dict() for s in self.scopes]
        if self.reason:
            out["reason"] = self.reason
        return out


@frozen
class Permissions:
    """What a session may do: the tools it may call and the scopes of their arguments (see the module doc).

    Args:
        tools: glob patterns of the tools it may call; ``None`` (default): every tool of the agent.
        scopes: limits on arguments (:class:`Scope`).
        restrictions: narrowings added since they were set (:meth:`narrow`).
    """

    tools: tuple[str, ...] | None = field(default=None, converter=_opt_globs)
    scopes: tuple[Scope, ...] = field(default=(), converter=_scopes_to)
    restrictions: tuple[Restriction, ...] = field(default=(), converter=_restrictions_to)

    def check(self, tool: str, arguments: Mapping[str, Any]) -> PermissionDenial | None:
        """``None`` when a call of ``tool`` with ``arguments`` is permitted; else the first permission
        that refuses it."""
        denied = _layer_denial(self.tools, self.scopes, tool, arguments, "")
        if denied is not None:
            return denied
        for i, r in enumerate(self.restrictions, 1):
            denied = _layer_denial(r.tools, r.scopes, tool, arguments, f"restriction {i}: ")
            if denied is not None:
                why = f"{denied.detail}; narrowed by a person" + (f": {r.reason}" if r.reason else "")
                return PermissionDenial(denied.permission, why, denied.rule)
        return None

    def allows(self, tool: str, arguments: Mapping[str, Any]) -> bool:
        """Whether a call of ``tool`` with ``arguments`` is permitted."""
        return self.check(tool, arguments) is None

    def may_call(self, tool: str) -> bool:
        """Whether ``tool`` may be called at all (its name; the scopes are checked per call)."""
        return all(t is None or _matches(tool, t) for t in (self.tools, *(r.tools for r in self.restrictions)))

    def narrow(self, restriction: Restriction | Permissions, reason: str = "") -> Permissions:
        """These permissions, narrowed: a call must also keep to ``restriction`` (a
        :class:`Restriction`, or :class:`Permissions` whose tools and scopes become one, and whose own
        restrictions are kept too). Never wider than ``self``."""
        more: tuple[Restriction, ...]
        if isinstance(restriction, Permissions):
            more = (Restriction(restriction.tools, restriction.scopes, reason), *restriction.restrictions)
        else:
            more = (evolve(restriction, reason=reason) if reason else restriction,)
        more = tuple(r for r in more if r.tools is not None or r.scopes)
        return evolve(self, restrictions=(*self.restrictions, *more)) if more else self

    def describe(self) -> str:
        """One line: ``"tools: read_file, pay; scopes: read_file: 'path' under ['/srv']; 1 restriction"``."""
        parts = [f"tools: {', '.join(self.tools) or 'none'}" if self.tools is not None else "tools: all"]
        if self.scopes:
            parts.append("scopes: " + "; ".join(s.describe() for s in self.scopes))
        if self.restrictions:
            parts.append(f"{len(self.restrictions)} restriction(s)")
        return "; ".join(parts)

    # -- the file format ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The permissions in the file format (``tools``, ``scope``, ``restriction``), JSON-ready."""
        out: dict[str, Any] = {}
        if self.tools is not None:
            out["tools"] = list(self.tools)
        if self.scopes:
            out["scope"] = [s.to_dict() for s in self.scopes]
        if self.restrictions:
            out["restriction"] = [r.to_dict() for r in self.restrictions]
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<permissions>") -> Permissions:
        """Permissions from the file format (see the module doc).

        Raises:
            PermissionsError: anything invalid, every problem listed as ``"<source>: <problem>"``.
        """
        problems: list[str] = []
        if not isinstance(data, Mapping):
            raise PermissionsError([f"{source}: permissions must be a table / JSON object"])
        for key in data:
            if key not in _TOP_KEYS:
                problems.append(f"{source}: unknown key {key!r} (use {', '.join(_TOP_KEYS[:3])})")
        if data.get("version", 1) != 1:
            problems.append(f"{source}: unsupported version {data.get('version')!r} (this reader knows version 1)")
        tools, scopes = _layer(data, source, problems)
        restrictions: list[Restriction] = []
        raw_r = data.get("restriction", [])
        if not isinstance(raw_r, list):
            problems.append(f"{source}: 'restriction' must be an array of tables")
            raw_r = []
        for i, r in enumerate(raw_r, 1):
            where = f"{source}: restriction {i}"
            if not isinstance(r, Mapping):
                problems.append(f"{where}: a restriction must be a table")
                continue
            for key in r:
                if key not in ("tools", "scope", "reason"):
                    problems.append(f"{where}: unknown key {key!r} (use tools, scope, reason)")
            rt, rs = _layer(r, where, problems)
            reason = r.get("reason", "")
            if not isinstance(reason, str):
                problems.append(f"{where}: 'reason' must be a string")
                reason = ""
            restrictions.append(Restriction(rt, rs, reason) if not problems else Restriction())
        if problems:
            raise PermissionsError(problems)
        return cls(tools, scopes, tuple(restrictions))

    @classmethod
    def from_file(cls, path: str | PathLike[str]) -> Permissions:
        """Load a TOML permissions file (JSON when the name ends in ``.json``).

        Raises:
            PermissionsError: the file cannot be read or parsed, or anything in it is invalid.
        """
        source = str(path)
        try:
            text = Path(path).read_bytes()
            data = json.loads(text) if source.endswith(".json") else tomllib.loads(text.decode("utf-8"))
        except OSError as exc:
            raise PermissionsError([f"{source}: cannot read the permissions file: {exc.strerror or exc}"]) from exc
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            kind = "JSON" if source.endswith(".json") else "TOML"
            raise PermissionsError([f"{source}: invalid {kind}: {exc}"]) from exc
        return cls.from_dict(data, source=source)


def _layer(data: Mapping[str, Any], where: str, problems: list[str]) -> tuple[tuple[str, ...] | None, tuple[Scope, ...]]:
    """``tools`` and ``scope`` of a table, checked (a problem found: ``(None, ...)``; the caller raises)."""
    before_all = len(problems)
    tools = data.get("tools")
    if tools is not None:
        _check_globs(tools, "tools", where, problems, empty_ok=True)
    raw = data.get("scope", [])
    if not isinstance(raw, list):
        problems.append(f"{where}: 'scope' must be an array of tables ([[scope]])")
        raw = []
    scopes: list[Scope] = []
    for i, s in enumerate(raw, 1):
        at = f"{where}: scope {i}"
        if not isinstance(s, Mapping):
            problems.append(f"{at}: a scope must be a table like {{ tool = \"read_file\", arg = \"path\", "
                            "under = \"/srv\" }")
            continue
        before = len(problems)
        if "tool" not in s:
            problems.append(f"{at}: 'tool' must name the tools it limits (a glob pattern or a list of them)")
        else:
            _check_globs(s["tool"], "tool", at, problems, empty_ok=False)
        optional = s.get("optional", False)
        if not isinstance(optional, bool):
            problems.append(f"{at}: 'optional' must be true or false")
        parse_condition(s, at, problems, extra_keys=("tool", "optional"))
        if len(problems) == before:
            checks = {k: v for k, v in s.items() if k not in _SCOPE_KEYS}
            scopes.append(Scope(s["tool"], s["arg"], checks, optional))
    if len(problems) > before_all or tools is None:
        return None, tuple(scopes)
    return _globs(tools), tuple(scopes)


def allowed_tools_permissions(allowed: Sequence[str] | None, base: Permissions | None = None) -> Permissions | None:
    """``base`` narrowed to the tools ``allowed`` (glob patterns), or ``base`` when ``allowed`` is
    ``None`` (a task's ``allowed_tools``, the CLI's ``--allow-tools``)."""
    if allowed is None:
        return base
    if base is None:
        return Permissions(tuple(allowed))
    if base.tools is None and not base.restrictions:
        return evolve(base, tools=tuple(allowed))
    return base.narrow(Restriction(tuple(allowed)))


@frozen
class PermissionRequest:
    """A request to widen a session's permissions (a :class:`~fsm_agent.control.RequestPermissions`
    control) that waits for a person's approval. Approved, :attr:`permissions` replace the
    session's; rejected, nothing changes."""

    request_id: str
    """The id a decision names (the ``call.id`` of its pending action)."""
    permissions: Permissions
    """What the session's permissions become once approved."""
    reason: str = ""
    """Why they are asked for."""

    def pending_action(self) -> PendingAction:
        """The pending action of the WAITING_HUMAN stop that asks a person: ``approve`` or ``reject``."""
        call = ToolUseBlock(self.request_id, PERMISSIONS_REQUEST_TOOL,
                            {"permissions": self.permissions.to_dict(), "reason": self.reason})
        return PendingAction(call, "permissions_requested", ("approve", "reject"))


def control_text(what: Literal["restriction", "permissions"], permissions: Permissions | Restriction,
                 reason: str = "") -> str:
    """The text of a ``restrict`` control (``what="restriction"``) or a ``request_permissions`` control
    (``what="permissions"``): ``{"<what>": <the file format>, "reason": ...}``."""
    if isinstance(permissions, Restriction):
        reason = reason or permissions.reason
        permissions = Permissions(permissions.tools, permissions.scopes)
    return orjson.dumps({what: permissions.to_dict(), "reason": reason}).decode()


def read_control_text(text: str, what: Literal["restriction", "permissions"]) -> tuple[Permissions, str]:
    """``(permissions, reason)`` from the text :func:`control_text` wrote.

    Raises:
        PermissionsError: not that JSON, or invalid permissions.
    """
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise PermissionsError([f"{what}: not JSON: {exc}"]) from exc
    if not isinstance(data, dict) or not isinstance(data.get(what), dict) \
            or not isinstance(data.get("reason", ""), str):
        raise PermissionsError([f"{what}: expected {{\"{what}\": {{...}}, \"reason\": \"...\"}}"])
    return Permissions.from_dict(data[what], source=what), data.get("reason", "")
