"""An incremental parser for JSON that arrives in pieces (a structured answer while it streams).

:class:`PartialJSON` is fed the text as it comes (:meth:`~PartialJSON.feed`) and gives, after
each piece, the value the text so far determines (:meth:`~PartialJSON.snapshot`):

* the objects and arrays opened so far, holding the members complete so far;
* the string being written, as far as it goes (an escape cut in the middle, ``\\u00`` or a
  surrogate pair's first half, waits for its end);
* a key appears once its value has begun (``{"a": "`` gives ``{"a": ""}``, ``{"a`` gives ``{}``);
* numbers and ``true`` / ``false`` / ``null`` appear once they end (``12`` may still become
  ``123``), so a snapshot never shows a number the answer does not hold.

The text may begin with prose or a code fence (```` ```json ````): the JSON value is the first
``{`` or ``[`` after prose, or the first value after the fence's line, or the text itself when it
starts with a JSON value (an object, an array, a string or a number). Once that value is complete
the rest is not read (:attr:`~PartialJSON.done`). A syntax error stops the parser for good
(:attr:`~PartialJSON.error` says where and why); it never raises.

Cost: each character is read once, string content in runs at C speed, so feeding a text of ``n``
characters in any number of pieces costs O(n) in all. A snapshot copies only the open containers
(shallowly: the members they hold are shared with the parser and with later snapshots, so treat a
snapshot as read-only) and joins the open string: O(depth + size of the open containers + length
of the open string), not a parse of the whole text.

    >>> p = PartialJSON()
    >>> p.feed('{"city": "Par')
    True
    >>> p.snapshot()
    {'city': 'Par'}
    >>> p.feed('is", "population": 21')
    True
    >>> p.snapshot()
    {'city': 'Paris'}
    >>> p.feed('02650}'), p.snapshot(), p.done
    (True, {'city': 'Paris', 'population': 2102650}, True)
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["PartialJSON"]

MAX_DEPTH = 512
"""The deepest nesting of arrays and objects read; deeper is an error (as in :mod:`fsm_agent.structured`)."""

_MISSING: Any = object()
_WS = frozenset(" \t\r\n")
_STR_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUM_RUN = re.compile(r"[0-9+\-.eE]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")
_JSON_START = re.compile(r"[{\[]")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": ("true", True), "f": ("false", False), "n": ("null", None)}

# parser states
_PRE, _FENCE, _PROSE = 0, 1, 2  # before the value: whitespace; a fence's first line; prose
_VALUE, _VALUE_OR_END = 3, 4  # a value is due (after "[": or "]")
_KEY_OR_END, _KEY, _COLON, _AFTER = 5, 6, 7, 8  # in an object / after a member or an item
_STRING, _NUMBER_S, _LITERAL = 9, 10, 11
_DONE, _FAILED = 12, 13


class _Frame:
    """An open object or array."""

    __slots__ = ("value", "path", "key")

    def __init__(self, value: dict[str, Any] | list[Any], path: tuple[str | int, ...]) -> None:
        self.value = value
        self.path = path
        self.key: str | None = None
        """Objects: the key whose value is being read (set at its colon), else ``None``."""


class PartialJSON:
    """Reads one JSON value from text fed in pieces; see the module doc.

    Args:
        max_depth: arrays and objects nested deeper than this are an error.
    """

    __slots__ = ("_state", "_stack", "_root", "_chunks", "_is_key", "_esc", "_high", "_token", "_literal",
                 "_offset", "_changed", "error", "max_depth")

    def __init__(self, *, max_depth: int = MAX_DEPTH) -> None:
        self.max_depth = max_depth
        self._state = _PRE
        self._stack: list[_Frame] = []
        self._root: Any = _MISSING
        self._chunks: list[str] = []  # the string being read
        self._is_key = False
        self._esc = ""  # an escape begun and not finished ("\\", "\\u", "\\u0"...)
        self._high: int | None = None  # a high surrogate waiting for its low half
        self._token: list[str] = []  # the number being read
        self._literal = ""  # the literal being read, as far as it goes
        self._offset = 0  # characters fed before the current piece
        self._changed = False
        self.error: str | None = None
        """Why the text is not JSON (and where), or ``None``; once set, nothing more is read."""

    # -- reading -------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """The JSON value is complete (what follows it is not read)."""
        return self._state == _DONE

    @property
    def started(self) -> bool:
        """The JSON value has begun (its first character was read)."""
        return self._state not in (_PRE, _FENCE, _PROSE, _FAILED) or self._root is not _MISSING

    def feed(self, text: str) -> bool:
        """Read ``text``, the next piece. Returns whether the snapshot changed (a member, an item or
        string content was added, or a container opened or closed)."""
        self._changed = False
        if self._state in (_DONE, _FAILED) or not text:
            self._offset += len(text)
            return False
        try:
            self._read(text)
        except _Fail as exc:
            self._state = _FAILED
            self.error = str(exc)
        self._offset += len(text)
        return self._changed

    def _fail(self, i: int, why: str) -> _Fail:
        return _Fail(f"not JSON at character {self._offset + i}: {why}")

    def _read(self, text: str) -> None:  # noqa: C901 - one state machine, kept in one place
        i, n = 0, len(text)
        while i < n:
            state = self._state
            if state == _STRING:
                i = self._read_string(text, i, n)
                continue
            ch = text[i]
            if state == _NUMBER_S:
                m = _NUM_RUN.match(text, i)
                if m:
                    self._token.append(m.group())
                    i = m.end()
                    continue
                self._end_number(i)  # ch is not part of the number: read it again in the new state
                continue
            if state == _LITERAL:
                word, value = _LITERALS[self._literal[0]]
                if word[len(self._literal)] != ch:
                    raise self._fail(i, f"expected {word!r}, got {self._literal + ch!r}")
                self._literal += ch
                i += 1
                if self._literal == word:
                    self._literal = ""
                    self._put(value)
                continue
            if ch in _WS and state != _PROSE and state != _FENCE:
                i += 1
                continue
            if state == _PRE:
                if ch == "`":
                    self._state = _FENCE
                elif ch in '{["-0123456789':
                    self._state = _VALUE
                    continue
                else:
                    self._state = _PROSE
                    continue
                i += 1
            elif state == _FENCE:
                nl = text.find("\n", i)
                if nl < 0:
                    return
                self._state = _PRE
                i = nl + 1
            elif state == _PROSE:
                m = _JSON_START.search(text, i)
                if m is None:
                    return
                self._state = _VALUE
                i = m.start()
            elif state == _VALUE or state == _VALUE_OR_END:
                if ch == "]" and state == _VALUE_OR_END:
                    self._close(i, ch)
                else:
                    self._begin_value(i, ch)
                i += 1
            elif state == _KEY_OR_END or state == _KEY:
                if ch == '"':
                    self._state, self._is_key = _STRING, True
                elif ch == "}" and state == _KEY_OR_END:
                    self._close(i, ch)
                else:
                    raise self._fail(i, f"expected a key (a string){' or }' if state == _KEY_OR_END else ''}, "
                                        f"got {ch!r}")
                i += 1
            elif state == _COLON:
                if ch != ":":
                    raise self._fail(i, f"expected ':' after the key, got {ch!r}")
                self._state = _VALUE
                i += 1
            elif state == _AFTER:
                top = self._stack[-1]
                if ch == ",":
                    self._state = _KEY if isinstance(top.value, dict) else _VALUE
                elif ch in "}]":
                    self._close(i, ch)
                else:
                    raise self._fail(i, f"expected ',' or {'}' if isinstance(top.value, dict) else ']'}, got {ch!r}")
                i += 1
            else:  # _DONE: the rest is not read
                return

    def _begin_value(self, i: int, ch: str) -> None:
        if ch == '"':
            self._state, self._is_key = _STRING, False
            self._changed = True  # the value is there: an empty string so far
        elif ch == "{" or ch == "[":
            if len(self._stack) >= self.max_depth:
                raise self._fail(i, f"arrays and objects nest more than {self.max_depth} levels deep")
            self._stack.append(_Frame({} if ch == "{" else [], self._slot_path()))
            self._state = _KEY_OR_END if ch == "{" else _VALUE_OR_END
            self._changed = True
        elif ch == "-" or "0" <= ch <= "9":
            self._state = _NUMBER_S
            self._token = [ch]
        elif ch in _LITERALS:
            self._state = _LITERAL
            self._literal = ch
        else:
            raise self._fail(i, f"expected a value, got {ch!r}")

    def _slot_path(self) -> tuple[str | int, ...]:
        """The path of the value about to be read."""
        if not self._stack:
            return ()
        top = self._stack[-1]
        if isinstance(top.value, dict):
            return (*top.path, top.key if top.key is not None else "")
        return (*top.path, len(top.value))

    def _close(self, i: int, ch: str) -> None:
        top = self._stack[-1]
        if (ch == "}") != isinstance(top.value, dict):
            raise self._fail(i, f"{ch!r} does not close the {'object' if isinstance(top.value, dict) else 'array'}")
        self._stack.pop()
        self._put(top.value)

    def _put(self, value: Any) -> None:
        """A value is complete: into its container, or it is the answer."""
        self._changed = True
        if not self._stack:
            self._root = value
            self._state = _DONE
            return
        top = self._stack[-1]
        if isinstance(top.value, dict):
            top.value[top.key if top.key is not None else ""] = value
            top.key = None
        else:
            top.value.append(value)
        self._state = _AFTER

    def _end_number(self, i: int) -> None:
        token = "".join(self._token)
        self._token = []
        m = _NUMBER.match(token)
        if m is None:
            raise self._fail(i, f"{token!r} is not a number")
        self._put(float(token) if m.group(1) or m.group(2) else int(token))

    def _read_string(self, text: str, i: int, n: int) -> int:
        """Read string content from ``i``; returns where reading stopped."""
        while i < n:
            if self._esc:
                i = self._read_escape(text, i, n)
                continue
            m = _STR_RUN.match(text, i)
            if m is not None:
                self._flush_high()
                self._chunks.append(m.group())
                self._changed |= not self._is_key
                i = m.end()
                continue
            ch = text[i]
            if ch == '"':
                self._flush_high()
                value = "".join(self._chunks)
                self._chunks = []
                if self._is_key:
                    self._stack[-1].key = value
                    self._state = _COLON
                else:
                    self._put(value)
                return i + 1
            if ch == "\\":
                self._esc = "\\"
                i += 1
                continue
            raise self._fail(i, f"a control character ({ch!r}) inside a string must be escaped")
        return i

    def _read_escape(self, text: str, i: int, n: int) -> int:
        while i < n:
            ch = text[i]
            esc = self._esc
            if esc == "\\":
                if ch == "u":
                    self._esc = "\\u"
                    i += 1
                    continue
                if ch not in _ESCAPES:
                    raise self._fail(i, "invalid escape " + repr("\\" + ch))
                self._esc = ""
                self._flush_high()
                self._chunks.append(_ESCAPES[ch])
                self._changed |= not self._is_key
                return i + 1
            if ch not in _HEX:
                raise self._fail(i, f"invalid escape {esc + ch!r}: \\u takes four hex digits")
            esc += ch
            i += 1
            if len(esc) < 6:
                self._esc = esc
                continue
            self._esc = ""
            self._code_point(int(esc[2:], 16))
            return i
        return i

    def _code_point(self, code: int) -> None:
        if 0xD800 <= code < 0xDC00:
            self._flush_high()
            self._high = code  # shown once its low half comes
            return
        if 0xDC00 <= code < 0xE000:
            if self._high is None:
                char = "\ufffd"  # a low half alone
            else:
                char = chr(0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00))
                self._high = None
        else:
            self._flush_high()
            char = chr(code)
        self._chunks.append(char)
        self._changed |= not self._is_key

    def _flush_high(self) -> None:
        if self._high is not None:  # a high surrogate with no low half after it
            self._high = None
            self._chunks.append("\ufffd")

    # -- the value so far -------------------------------------------------------------------------
    def snapshot(self) -> Any:
        """The value so far (see the module doc), or ``None`` before the value begins or when no
        part of it is known yet (a top-level number still being read). Members of the open
        containers are shared with the parser: do not change them."""
        value = self._partial()
        return None if value is _MISSING else value

    def _partial(self) -> Any:
        if self._root is not _MISSING:
            return self._root
        value: Any = _MISSING
        if self._state == _STRING and not self._is_key:
            if len(self._chunks) > 1:
                self._chunks = ["".join(self._chunks)]
            value = self._chunks[0] if self._chunks else ""
        for frame in reversed(self._stack):
            if isinstance(frame.value, dict):
                copy: Any = dict(frame.value)
                if value is not _MISSING and frame.key is not None:
                    copy[frame.key] = value
            else:
                copy = list(frame.value)
                if value is not _MISSING:
                    copy.append(value)
            value = copy
        return value

    def open_paths(self) -> tuple[tuple[str | int, ...], ...]:
        """The JSON paths (keys and indexes from the top) of the values still being written in the
        snapshot: the open arrays and objects, outermost first, and last the open string if one is
        being written. Everything else in the snapshot is complete."""
        paths = [f.path for f in self._stack]
        leaf = self.string_path()
        if leaf is not None:
            paths.append(leaf)
        return tuple(paths)

    def string_path(self) -> tuple[str | int, ...] | None:
        """The path of the string value being written, or ``None`` when none is."""
        if self._state != _STRING or self._is_key:
            return None
        return self._slot_path()


class _Fail(Exception):
    """The text is not JSON (internal: becomes :attr:`PartialJSON.error`)."""
