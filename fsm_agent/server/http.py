"""HTTP helpers shared by the server's routes: RFC 9457 problem documents, JSON bodies and fields.

A :class:`Problem` raised in a handler becomes an ``application/problem+json`` response
(``type``, ``title``, ``status``, ``detail``, ``instance``); so do aiohttp's own HTTP errors
(an unknown route 404, a wrong method 405, a body over the size limit 413).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

__all__ = ["Problem", "check_fields", "json_body", "json_response", "opt_bool", "opt_str", "problem_response", "problems"]


class Problem(Exception):
    """An error answered as an RFC 9457 problem document.

    Args:
        status: the HTTP status.
        title: a short summary of the kind of problem.
        detail: what was wrong in this request, and what to do.
        headers: extra response headers (``WWW-Authenticate`` ...).
    """

    def __init__(self, status: int, title: str, detail: str = "", headers: dict[str, str] | None = None) -> None:
        super().__init__(detail or title)
        self.status, self.title, self.detail, self.headers = status, title, detail or title, headers or {}


def problem_response(status: int, title: str, detail: str, instance: str,
                     headers: dict[str, str] | None = None) -> web.Response:
    """The ``application/problem+json`` response."""
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, "instance": instance}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/problem+json",
                        headers=headers)


@web.middleware
async def problems(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    """Turns :class:`Problem` and aiohttp's HTTP errors (>= 400) into problem documents."""
    try:
        return await handler(request)
    except Problem as p:
        return problem_response(p.status, p.title, p.detail, request.path, p.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        detail = e.text if e.text and not e.text.startswith(str(e.status)) else e.reason
        return problem_response(e.status, e.reason, detail, request.path)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response (orjson)."""
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json", headers=headers)


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (``{}`` when empty).

    Raises:
        Problem: 400 for malformed JSON or a body that is not an object; 413 (from aiohttp) over the size limit.
    """
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise Problem(400, "Malformed JSON", f"the body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise Problem(400, "Wrong body", "the body must be a JSON object")
    return data


def opt_str(data: dict[str, Any], key: str, *, required: bool = False, max_len: int = 100_000) -> str | None:
    """``data[key]`` as a non-empty string, or ``None`` when absent.

    Raises:
        Problem: 400 when missing (``required``), not a non-empty string, or longer than ``max_len``.
    """
    v = data.get(key)
    if v is None:
        if required:
            raise Problem(400, "Missing field", f"{key!r} is required")
        return None
    if not isinstance(v, str):
        raise Problem(400, "Wrong field", f"{key!r} must be a non-empty string, not {type(v).__name__}")
    if not v:
        raise Problem(400, "Wrong field", f"{key!r} must not be empty")
    if len(v) > max_len:
        raise Problem(400, "Wrong field", f"{key!r} is longer than {max_len} characters")
    return v


def opt_bool(data: dict[str, Any], key: str) -> bool:
    """``data[key]`` as a bool (``False`` when absent).

    Raises:
        Problem: 400 when present and not a bool.
    """
    v = data.get(key, False)
    if not isinstance(v, bool):
        raise Problem(400, "Wrong field", f"{key!r} must be true or false")
    return v


def check_fields(data: dict[str, Any], allowed: set[str]) -> None:
    """Refuse unknown fields (a typo must not be silently ignored).

    Raises:
        Problem: 400 naming the unknown fields and the allowed ones.
    """
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise Problem(400, "Unknown field", f"unknown field(s) {', '.join(map(repr, unknown))}; "
                                            f"allowed: {', '.join(sorted(allowed)) or 'none'}")
