"""The checks every sandbox makes of what it is given: a run's source, seeded files and limits, the
required guarantees, and host paths.

The local and remote sandboxes and :func:`~fsm_agent.sandbox.codeact.codeact_tool` call these, so a
bad input is refused the same way, with the same message, whichever sandbox gets it.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from .base import GuaranteeNotHeldError, Guarantees, Limits, SandboxInputError, check_timeout

__all__ = ["MAX_CODE_BYTES", "check_required", "checked_run", "host_path", "host_paths", "is_utf8"]

MAX_CODE_BYTES = 1024 * 1024
"""The largest source accepted, bytes."""


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def host_path(what: str, value: Any) -> str:
    """``value`` (a str or path-like) as a host path string.

    Raises:
        SandboxInputError: it is not a path, holds a NUL, or cannot be encoded for the file system
            (a lone surrogate other than a non-UTF-8 byte's).
    """
    try:
        path = os.fspath(value)
    except TypeError:
        raise SandboxInputError(f"{what} must be a path, not {type(value).__name__}") from None
    if not isinstance(path, str) or "\x00" in path:
        raise SandboxInputError(f"{what} must be a text path without NUL, got {path!r}")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise SandboxInputError(f"{what} {path!r} cannot be encoded as a file name (a lone surrogate)") from None
    return path


def host_paths(what: str, values: Any) -> tuple[str, ...]:
    """``values`` (a list of str or path-like) as normalized absolute host paths, none of them ``/``.

    Raises:
        SandboxInputError: ``values`` is a single path rather than a list, or one of them is not an
            absolute path other than ``/`` (or not a path: see :func:`host_path`).
    """
    if isinstance(values, (str, bytes, os.PathLike)) or not isinstance(values, Iterable):
        raise SandboxInputError(f"{what} must be a list of absolute paths, not {type(values).__name__} {values!r}")
    paths = tuple(os.path.normpath(host_path(what, p)) for p in values)
    for p in paths:
        if not os.path.isabs(p) or p == "/":
            raise SandboxInputError(f"{what}: {p!r} must be an absolute path other than '/'")
    return paths


def _check_files(files: Mapping[str, bytes | str] | None) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for path, content in (files or {}).items():
        if not isinstance(path, str) or not path or "\x00" in path:
            raise SandboxInputError(f"files: {path!r} is not a file path")
        if not is_utf8(path):
            raise SandboxInputError(f"files: {path!r} holds a lone surrogate: a seeded file's path must be UTF-8 text")
        norm = posixpath.normpath(path)
        if path.startswith("/") or norm == "." or norm.startswith("../") or norm == "..":
            raise SandboxInputError(f"files: {path!r} must be a relative path inside the work dir (no leading '/', "
                                    "no '..')")
        if isinstance(content, str):
            content = content.encode()
        if not isinstance(content, (bytes, bytearray)):
            raise SandboxInputError(f"files[{path!r}] must be bytes or str, not {type(content).__name__}")
        out.append((norm, bytes(content)))
    return out


def _check_code(code: Any) -> bytes:
    if not isinstance(code, str):
        raise SandboxInputError(f"code must be a str of Python source, not {type(code).__name__}")
    data = code.encode("utf-8", "surrogatepass")
    if len(data) > MAX_CODE_BYTES:
        raise SandboxInputError(f"code is {len(data)} bytes; at most {MAX_CODE_BYTES} are accepted")
    return data


def checked_run(code: Any, files: Mapping[str, bytes | str] | None, limits: Limits | None, timeout: float | None,
                default: Limits) -> tuple[str, list[tuple[str, bytes]], Limits]:
    """A run's inputs, checked the same way by every sandbox: the source, the seeded files, and the
    limits (``limits`` or ``default``, with ``timeout`` as the wall limit when given).

    Raises:
        SandboxInputError: ``code``, ``files``, ``limits`` or ``timeout`` is invalid.
    """
    source = _check_code(code)
    seeded = _check_files(files)
    lim = limits if limits is not None else default
    if not isinstance(lim, Limits):
        raise SandboxInputError(f"limits must be a Limits, not {type(lim).__name__}")
    if timeout is not None:
        lim = attrs.evolve(lim, wall_seconds=check_timeout(timeout))
    return source.decode("utf-8", "surrogatepass"), seeded, lim


def check_required(name: str, required: Sequence[str], g: Guarantees) -> None:
    """Raise :class:`GuaranteeNotHeldError` when a guarantee in ``required`` does not hold in ``g``."""
    missing = tuple(r for r in required if not getattr(g, r))
    if missing:
        raise GuaranteeNotHeldError(name, missing, g)
