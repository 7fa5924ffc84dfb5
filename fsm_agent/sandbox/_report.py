"""The result channel of the local sandboxes: what the parent reads from the runner, and how far it
trusts it.

The result pipe carries (``_runner.py``'s module docstring): ``S`` when the interpreter started;
then, from the runner's **monitor** once the code's process ended, ``M`` and one line of JSON, the
status ``wait4`` gave it (``exit`` or ``signal``, ``cpu_s``), which the code cannot reach; then what
came through the report pipe, whose last ``RS`` byte (``\\x1e``) starts the child's **report**. The
report is written by the interpreter that ran the code, so the code can write one of its own (to any
of its descriptors, in any format): it is read as the code's claim about itself and nothing more.

* Limits: the report may name only :data:`CODE_LIMITS` (``memory``, ``processes``, ``file_size``),
  which the code's own process sees fail. ``cpu`` comes from the monitor's status, ``wall`` and
  ``output`` from the parent's own observation (a ``return_repr`` or ``return_value`` larger than
  ``output_bytes`` is cut or dropped *here*, and that is what names ``output``).
* Texts: every text is carried with escapes, so an :class:`~fsm_agent.sandbox.base.ExecutionResult`
  always encodes as UTF-8 JSON: a byte that is not UTF-8 (in a file name, in stdout, or a lone
  surrogate ``os.fsdecode`` made of it, ``"\\udcff"``) as ``\\xff``; any other lone surrogate
  (``"\\ud800"``) as the six characters ``\\ud800`` (:func:`~fsm_agent.sandbox.base.escaped_text`).
* Off the shape (not JSON, huge integers, non-finite numbers, a wrong type): that part is dropped;
  the rest of the result stands.
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs
import orjson

from .base import CodeError, escaped_text

__all__ = ["CODE_LIMITS", "channel_cap", "escaped", "file_name", "parse_channel", "read_report", "stream_text"]

STARTED = b"S"
STATUS = b"M"
REPORT = b"\x1e"
CODE_LIMITS: frozenset[str] = frozenset({"memory", "processes", "file_size"})
"""The limits the code's own report may name: those its own process sees fail (an allocation, a
fork or thread start, a write)."""
_INT_RANGE = (-(2**63), 2**64 - 1)
_NOTE_ROOM = 64
"""Bytes a text may exceed its cap by: the runner's ``[N characters cut]`` note."""


def channel_cap(output_bytes: int) -> int:
    """Bytes of the result pipe the parent keeps: the runner's report budget (``_runner.report_budget``:
    ``24 × output_bytes + 65536``) and the markers and status line before it."""
    return 24 * output_bytes + 65536 + 4096


escaped = escaped_text


def stream_text(data: bytes, was_cut: bool) -> str:
    """Captured output as text: UTF-8, each byte that is not as ``\\xNN``; when the stream was cut, a
    character the cut split is left out."""
    if was_cut:
        for back in range(1, min(4, len(data)) + 1):
            byte = data[-back]
            if byte & 0xC0 == 0x80:
                continue  # a continuation byte: look further back for its lead byte
            need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            if need > back:
                data = data[:-back]
            break
    return data.decode("utf-8", "backslashreplace")


def file_name(name: str) -> str:
    """A name read from the file system (``os.scandir``: bytes that are not UTF-8 come as lone
    surrogates) as UTF-8 text, each byte that is not UTF-8 as ``\\xNN``."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def cut(text: str, cap: int, *, note: bool = True, keep_end: bool = False) -> tuple[str, bool]:
    """(``text`` cut to at most ``cap`` UTF-8 bytes, whether it was cut); with ``note``, a cut text
    says how many characters were cut (the note is beyond the cap)."""
    data = text.encode("utf-8")
    if len(data) <= cap:
        return text, False
    kept = (data[-cap:] if keep_end else data[:cap]).decode("utf-8", "ignore")
    if not note:
        return kept, True
    said = f"[{len(text) - len(kept)} characters cut]"
    return (said + kept if keep_end else kept + said), True


def _int64(text: str) -> int:
    value = int(text)
    if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
        raise ValueError("an integer beyond 64 bits")
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is not a finite number")
    return value


def _load(data: bytes) -> dict[str, Any]:
    """A JSON object, trusting nothing: anything off the shape (not UTF-8, deep, huge integers,
    non-finite numbers, not an object) is ``{}``."""
    if not data.strip():
        return {}
    try:
        doc = json.loads(data, parse_int=_int64, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def parse_channel(doc: bytes) -> tuple[bool, dict[str, Any], dict[str, Any]]:
    """(the interpreter started, the monitor's status, the child's report) from the result pipe's
    bytes. The status is ``{}`` when the monitor wrote none (the code killed it); the report is the
    object after the last ``RS`` byte (or, with none, what the code wrote itself), ``{}`` when it is
    not one."""
    started = doc.startswith(STARTED)
    if not started or doc[1:2] != STATUS:
        return started, {}, {}
    line, _, rest = doc[2:].partition(b"\n")
    return True, _load(line), _load(rest.rpartition(REPORT)[2])


@attrs.frozen
class Report:
    """What the parent keeps of the child's report, checked and escaped."""

    return_value: Any = None
    return_repr: str | None = None
    error: CodeError | None = None
    limits: frozenset[str] = frozenset()
    """Among :data:`CODE_LIMITS` only, plus ``output`` when the parent cut or dropped a part here."""


def read_report(report: dict[str, Any], output_bytes: int) -> Report:
    """The parts of ``report`` (a decoded JSON object) the result takes: the limits the code may name,
    its error (texts escaped; message and traceback cut to ``output_bytes``), its ``repr`` (escaped;
    beyond ``output_bytes`` cut, naming ``output``) and its value (dropped when it is not plain JSON
    orjson can write, or larger than ``output_bytes``, naming ``output`` then)."""
    claimed = report.get("limits")
    hit = {x for x in claimed if isinstance(x, str) and x in CODE_LIMITS} if isinstance(claimed, list) else set()
    error = None
    e = report.get("error")
    if isinstance(e, dict):

        def text(key: str) -> str:
            value = e.get(key)
            return escaped(value) if isinstance(value, str) else ""

        line = e.get("line")
        error = CodeError(cut(text("type") or "Exception", 200, note=False)[0],
                          cut(text("message"), output_bytes + _NOTE_ROOM)[0],
                          cut(text("traceback"), output_bytes + _NOTE_ROOM, keep_end=True)[0],
                          line if type(line) is int else None)
    rep = report.get("return_repr")
    return_repr = None
    if isinstance(rep, str):
        return_repr, was_cut = cut(escaped(rep), output_bytes, note=False)
        if was_cut:
            hit.add("output")
    value = report.get("return_value") if return_repr is not None else None
    if value is not None:
        try:
            too_big = len(orjson.dumps(value)) > output_bytes
        except (orjson.JSONEncodeError, TypeError):  # a lone surrogate in a string: the repr carries it escaped
            value, too_big = None, False
        if too_big:
            value = None
            hit.add("output")
    return Report(value, return_repr, error, frozenset(hit))
