"""Conditions on a value inside a JSON object: the one vocabulary of argument and output checks.

A condition names a value by a dotted path (``"path"``, ``"options.mode"``, ``"paths.0"``) and one
or more operators, all of which must hold. The same vocabulary serves the tool policy plugin's
``when`` rules (``docs/policy.md``), a session's permission scopes (paths, hosts, amounts:
``docs/permissions.md``) and a task's acceptance checks on its output (``docs/tasks.md``).

==============  =====================================================================
``equals``      equal to the value (any JSON value); ``not_equals``: different
``in``          one of a list of values; ``not_in``: none of them
``lt`` ``le``   number (not bool) less than / at most the value (also ``gt``, ``ge``)
``starts_with`` string starts with the value (or one of a list); ``ends_with`` likewise
``contains``    string contains the substring, or list contains the element
``matches``     string matches the regular expression *as a whole* (``re.fullmatch``)
``under``       string is an absolute POSIX path inside the directory once normalized
                (``/srv/../etc`` is *not* under ``/srv``; ``starts_with`` would say yes)
``host``        string is a URL (``https://api.example.com/x``) or a bare host
                (``api.example.com``, ``api.example.com:8443``) whose host is one of the
                patterns: ``example.com`` (that host), ``*.example.com`` (its subdomains, not
                itself), ``*`` (any host). Case-insensitive; a value with a backslash,
                whitespace or a control character never holds
``exists``      ``true``: the value is present; ``false``: it is absent
==============  =====================================================================

Every operator but ``exists`` is false when the value is missing or has the wrong type.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from attrs import frozen

__all__ = ["CONDITION_OPERATORS", "MISSING", "ArgumentCondition", "host_of", "lookup", "parse_condition"]

_NUM = ("lt", "le", "gt", "ge")
CONDITION_OPERATORS = ("equals", "not_equals", "in", "not_in", *_NUM, "starts_with", "ends_with", "contains",
                       "matches", "under", "host", "exists")
"""The operators of a condition, in the order of the module's table."""


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()
"""What :func:`lookup` returns for a path that names nothing."""

_HOST_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?")
_BAD_IN_HOST_VALUE = re.compile(r"[\\\s\x00-\x1f\x7f]")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _strs(v: Any) -> tuple[str, ...] | None:
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list | tuple) and v and all(isinstance(x, str) for x in v):
        return tuple(v)
    return None


def lookup(data: Any, path: str) -> Any:
    """The value at dotted ``path`` in ``data`` (mapping keys, list indexes), or :data:`MISSING`.
    The empty path is ``data`` itself."""
    value: Any = data
    if path == "":
        return value
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list | tuple) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return MISSING
    return value


def _eq(a: Any, b: Any) -> bool:
    """JSON equality: ``true`` is not ``1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def _under(value: str, base: str) -> bool:
    if not value.startswith("/"):
        return False
    norm = posixpath.normpath(value)
    return norm == base or norm.startswith(base.rstrip("/") + "/")


def host_of(value: str) -> str | None:
    """The host (lower-case, no trailing dot) of a URL or of a bare ``host[:port]``, or ``None``
    when ``value`` names none or holds a backslash, whitespace or a control character."""
    if _BAD_IN_HOST_VALUE.search(value):
        return None
    try:
        host = urlsplit(value if "://" in value else "//" + value).hostname
    except ValueError:
        return None
    if not host:
        return None
    return host.rstrip(".") or None


def _host_matches(host: str, pattern: str) -> bool:
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern


def _check(op: str, expected: Any, value: Any) -> bool:
    if op == "exists":
        return (value is not MISSING) is expected
    if value is MISSING:
        return False
    if op in ("equals", "not_equals"):
        return _eq(value, expected) is (op == "equals")
    if op in ("in", "not_in"):
        return any(_eq(value, x) for x in expected) is (op == "in")
    if op in _NUM:  # the table is only built for numbers
        return _is_num(value) and {"lt": value < expected, "le": value <= expected, "gt": value > expected,
                                   "ge": value >= expected}[op]
    if op == "contains":
        if isinstance(value, str):
            return isinstance(expected, str) and expected in value
        return isinstance(value, list) and any(_eq(v, expected) for v in value)
    if not isinstance(value, str):
        return False
    if op in ("starts_with", "ends_with"):
        return value.startswith(expected) if op == "starts_with" else value.endswith(expected)
    if op == "matches":
        return expected.fullmatch(value) is not None
    if op == "host":
        host = host_of(value)
        return host is not None and any(_host_matches(host, p) for p in expected)
    return any(_under(value, b) for b in expected)  # under


def _shown(op: str, expected: Any) -> str:
    if op == "matches":
        return f"matches {expected.pattern!r}"
    if isinstance(expected, tuple):
        expected = list(expected)
    return f"{op} {expected!r}"


@frozen
class ArgumentCondition:
    """Every ``(operator, value)`` in ``checks`` must hold for the value at ``arg``.

    Build one with :func:`parse_condition`, which checks and compiles the operators' values.
    """

    arg: str
    """Dotted path into the object (``""``: the object itself)."""
    checks: tuple[tuple[str, Any], ...]
    """Operators and their (validated, compiled) values."""

    def holds(self, data: Any) -> bool:
        """Whether every operator holds for the value at :attr:`arg` in ``data``."""
        value = lookup(data, self.arg)
        return all(_check(op, expected, value) for op, expected in self.checks)

    def failure(self, data: Any) -> str | None:
        """``None`` when the condition holds; else what does not hold, e.g. ``"'amount' is 400: not
        le 100"`` or ``"'path' is missing"``."""
        value = lookup(data, self.arg)
        failed = [_shown(op, expected) for op, expected in self.checks if not _check(op, expected, value)]
        if not failed:
            return None
        name = repr(self.arg) if self.arg else "the value"
        if value is MISSING:
            return f"{name} is missing" + ("" if failed == ["exists True"] else f" (needs: {', '.join(failed)})")
        shown = repr(value) if not isinstance(value, str) or len(value) <= 200 else repr(value[:200] + "…")
        return f"{name} is {shown}: not {', not '.join(failed)}"

    def describe(self) -> str:
        """The condition as text: ``"'path' under ['/srv']"``."""
        name = repr(self.arg) if self.arg else "the value"
        return f"{name} " + " and ".join(_shown(op, expected) for op, expected in self.checks)


def parse_condition(raw: Any, where: str, problems: list[str], *, arg_key: str = "arg",
                    extra_keys: Sequence[str] = ()) -> ArgumentCondition | None:
    """Check and compile one condition table (``{arg = "path", under = "/srv"}``).

    Each problem is appended to ``problems`` as ``"<where>: <problem>"``; returns ``None`` when
    the table is not a mapping at all. ``arg_key`` names the key holding the path (``"field"``
    for a task's output checks); keys in ``extra_keys`` are skipped (the caller reads them).
    """
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: a condition must be a table like {{ {arg_key} = \"path\", under = \"/srv\" }}")
        return None
    before = len(problems)
    arg = raw.get(arg_key)
    if not isinstance(arg, str) or (not arg and arg_key == "arg"):
        problems.append(f"{where}: '{arg_key}' must name an argument (a non-empty string)")
        arg = "?"
    checks: list[tuple[str, Any]] = []
    for op, value in raw.items():
        if op == arg_key or op in extra_keys:
            continue
        bad = None
        if op not in CONDITION_OPERATORS:
            bad = f"unknown operator {op!r} (use one of: {', '.join(CONDITION_OPERATORS)})"
        elif op in ("in", "not_in") and not isinstance(value, list):
            bad = f"'{op}' needs a list of values"
        elif op in _NUM and not _is_num(value):
            bad = f"'{op}' needs a number, not {value!r}"
        elif op in ("starts_with", "ends_with", "under", "host") and _strs(value) is None:
            bad = f"'{op}' needs a string or a list of strings, not {value!r}"
        elif op == "under" and not all(s.startswith("/") for s in _strs(value) or ()):
            bad = f"'under' needs absolute paths (starting with '/'), not {value!r}"
        elif op == "host" and not all(_host_pattern(s) for s in _strs(value) or ()):
            bad = (f"'host' needs host names, '*.' + a host name (its subdomains) or '*' (any host), "
                   f"not {value!r}")
        elif op == "matches" and not isinstance(value, str):
            bad = f"'matches' needs a regular expression string, not {value!r}"
        elif op == "exists" and not isinstance(value, bool):
            bad = f"'exists' needs true or false, not {value!r}"
        elif op == "matches":
            try:
                value = re.compile(value)
            except re.error as exc:
                bad = f"'matches' is not a valid regular expression ({exc}): {value!r}"
        if bad:
            problems.append(f"{where}: {bad}")
            continue
        if op in ("starts_with", "ends_with"):
            value = _strs(value)
        elif op == "under":
            value = tuple(posixpath.normpath(s) for s in _strs(value) or ())
        elif op == "host":
            value = tuple(s.lower().rstrip(".") for s in _strs(value) or ())
        checks.append((op, value))
    if not checks and len(problems) == before:
        problems.append(f"{where}: no operator given for argument {arg!r}")
    return ArgumentCondition(arg, tuple(checks))


def _host_pattern(pattern: str) -> bool:
    if pattern == "*":
        return True
    name = pattern[2:] if pattern.startswith("*.") else pattern
    labels = name.lower().rstrip(".").split(".")
    return bool(name) and all(_HOST_LABEL.fullmatch(label) for label in labels)
