"""Malformed answers of an MCP server, told at once: the read stream of a transport that turns an
answer the SDK cannot parse into an error for the request it answers (the SDK would drop it and
leave the call waiting for its timeout), and what was wrong with it, in words, for the model.

An answer that is no ``tools/call`` result (``"result": null``, a list, no ``content`` ...) becomes
an error tool result "the server answered with an invalid result: ..." (``mcp_invalid_result``),
whichever way it arrives: over stdio or HTTP through :class:`CheckedTransport`, as a result object
the SDK could not read, or as a body the SDK's HTTP client could not parse (:func:`invalid_answer`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, cast

import orjson

__all__ = ["CheckedReads", "CheckedTransport", "invalid_answer"]

_INVALID_MARK = "fsm-agent/invalid-answer"
"""``ErrorData.data`` key of the error :class:`CheckedReads` puts in place of an answer the SDK could
not parse; its value says what was wrong."""


def _cut_text(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _brief(value: Any, limit: int = 200) -> str:
    """``value`` as compact JSON, cut to ``limit`` characters."""
    try:
        text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS, default=repr).decode()
    except orjson.JSONEncodeError:
        text = repr(value)
    return _cut_text(text, limit)


def _what_is_wrong(message: Mapping[str, Any]) -> str:
    """What makes ``message`` (a response the SDK could not parse) no JSON-RPC response."""
    if "error" in message:
        return f"its 'error' is {_brief(message['error'])}, not an object with a code and a message"
    if "result" not in message:
        return "it has neither a 'result' nor an 'error'"
    result = message["result"]
    if not isinstance(result, dict):
        return f"its 'result' is {_brief(result)}, not an object"
    return f"it is not a JSON-RPC 2.0 response ({_brief(message)})"


_PYDANTIC_ERROR = re.compile(r"^(?:(?P<loc>\S.*)\n)?  (?P<msg>.+?) \[type=(?P<type>\w+)"
                             r"(?:, input_value=(?P<input>.*), input_type=\w+)?\]$", re.MULTILINE)


def _from_repr(text: str | None) -> str:
    """The Python literal ``text`` (pydantic's ``input_value``) as compact JSON, else as it is."""
    import ast

    try:
        return _brief(ast.literal_eval(text or ""))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return _cut_text(text or "", 200)


def _unparsed_answer(text: str) -> str:
    """What was wrong with an answer the SDK's HTTP client could not parse as JSON-RPC, from the
    text of its error (``Failed to parse JSON response: <pydantic ValidationError>``)."""
    detail = text.partition(": ")[2] or text
    found = {m["loc"] or "": m for m in _PYDANTIC_ERROR.finditer(detail)}
    bad = next((m for m in found.values() if m["type"] == "json_invalid"), None)
    if bad is not None:
        import ast

        try:
            raw = ast.literal_eval(bad["input"] or "")
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            text = bad["input"] or ""
        return f"it is not JSON ({bad['msg']}): {_cut_text(text, 120)!r}"
    result, error = found.get("JSONRPCResponse.result"), found.get("JSONRPCError.error")
    if result is not None and error is not None:
        if result["type"] != "missing":
            return f"its 'result' is {_from_repr(result['input'])}, not an object"
        if error["type"] != "missing":
            return f"its 'error' is {_from_repr(error['input'])}, not an object with a code and a message"
        return "it has neither a 'result' nor an 'error'"
    return _cut_text(detail.split("\n")[0], 200)


def _validation_summary(exc: Any) -> str:
    """A pydantic ``ValidationError`` in one line: up to three ``field: problem`` parts (for a
    ``tools/call`` result, the ``CallToolResult`` reading's)."""
    errors = exc.errors(include_url=False)
    chosen = [e for e in errors if e["loc"][:1] == ("CallToolResult",)] or errors
    parts: list[str] = []
    for e in chosen:
        loc = ".".join(str(x) for x in e["loc"] if x != "CallToolResult")
        part = f"{loc or 'the result'}: {e['msg']} (got {_brief(e.get('input'), 80)})"
        if part not in parts:
            parts.append(part)
    more = f" and {len(parts) - 3} more problem(s)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more


class CheckedReads:
    """The read stream of an MCP transport, with one change: a message the SDK could not parse
    that answers a request (it has an ``id`` and no ``method``: ``"result": null``, a list, no
    result at all ...) becomes a JSON-RPC error for that request, marked :data:`_INVALID_MARK`.
    The SDK itself drops such a message, and the call waits until it times out. A message that
    names no request is passed on as the SDK does, and its start given to ``on_stray`` (the
    connection counts them: no call can be told)."""

    def __init__(self, inner: Any, on_stray: Callable[[str], None]) -> None:
        self._inner = inner
        self._on_stray = on_stray

    def __getattr__(self, name: str) -> Any:  # last_context and whatever else the SDK reads
        return getattr(self._inner, name)

    def _check(self, item: Any) -> Any:
        if not isinstance(item, Exception) or not hasattr(item, "errors"):
            return item
        from mcp.shared.message import SessionMessage
        from mcp.types import INTERNAL_ERROR, ErrorData, JSONRPCError

        try:
            inputs = [e.get("input") for e in item.errors(include_url=False)]
        except Exception:  # noqa: BLE001 - not a pydantic error after all
            return item
        for value in inputs:
            if isinstance(value, dict) and "method" not in value:
                rid = value.get("id")
                if isinstance(rid, (int, str)) and not isinstance(rid, bool):
                    what = _what_is_wrong(value)
                    return SessionMessage(JSONRPCError(jsonrpc="2.0", id=rid, error=ErrorData(
                        code=INTERNAL_ERROR, message=f"invalid result: {what}", data={_INVALID_MARK: what})))
        text = next((v for v in inputs if isinstance(v, (str, bytes))), None)
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        self._on_stray(repr(_cut_text(text, 120)) if text is not None else _brief(inputs[:1], 120))
        return item

    async def receive(self) -> Any:
        return self._check(await self._inner.receive())

    def __aiter__(self) -> CheckedReads:
        return self

    async def __anext__(self) -> Any:
        return self._check(await self._inner.__anext__())

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> CheckedReads:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return cast("bool | None", await self._inner.__aexit__(*exc))


class CheckedTransport:
    """An MCP ``Transport`` whose read stream is a :class:`CheckedReads` (``on_stray``: see there)."""

    def __init__(self, inner: Any, on_stray: Callable[[str], None]) -> None:
        self._inner = inner
        self._on_stray = on_stray

    async def __aenter__(self) -> tuple[Any, Any]:
        read, write = await self._inner.__aenter__()
        return CheckedReads(read, self._on_stray), write

    async def __aexit__(self, *exc: Any) -> bool | None:
        return cast("bool | None", await self._inner.__aexit__(*exc))


def invalid_answer(cause: BaseException) -> str | None:
    """What was wrong with the server's answer, in words, when the call's failure ``cause`` (unwrapped
    from any exception group) says the answer was no valid ``tools/call`` result; else ``None``.

    Such an answer is a result object the SDK could not read as a ``CallToolResult`` (a pydantic
    ``ValidationError``), a response :class:`CheckedReads` put an error in place of, or a body the
    SDK's HTTP client could not parse as JSON-RPC."""
    from mcp.shared.exceptions import MCPError
    from mcp.types import PARSE_ERROR
    from pydantic import ValidationError

    if isinstance(cause, ValidationError):  # a result object the SDK could not read as a CallToolResult
        return _validation_summary(cause)
    if isinstance(cause, MCPError) and isinstance(cause.data, dict) and _INVALID_MARK in cause.data:
        return str(cause.data[_INVALID_MARK])  # a response CheckedReads caught
    if (isinstance(cause, MCPError) and cause.code == PARSE_ERROR
            and cause.message.startswith(("Failed to parse JSON response", "Failed to parse SSE message"))):
        return _unparsed_answer(cause.message)  # the SDK's HTTP client, which names the request
    return None
