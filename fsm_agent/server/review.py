"""The review page: ``GET /review/{sid}`` and its static files under ``GET /static/{name}``.

The page (``static/review.html`` + ``static/review.js``) works with no network beyond its own
origin: Mermaid is vendored (``static/mermaid.min.js``, MIT, see ``static/README.md``). The page
reads the session id from its own URL, so one HTML file serves every session.

Only the files shipped in ``fsm_agent/server/static/`` are served, looked up by exact name (no
path, no traversal); they are found with :mod:`importlib.resources`, so an installed package
serves them as well as a checkout. ``mermaid.min.js`` is cached for a year (its content only
changes with its name's package version, and the page asks for it with a version query); the
others are ``no-cache``. Anything else is a 404 problem document.
"""

from __future__ import annotations

import importlib.resources
from functools import lru_cache

import orjson
from aiohttp import web

__all__ = ["STATIC_FILES", "add_review_routes", "static_bytes"]

STATIC_FILES: dict[str, str] = {
    "review.html": "text/html; charset=utf-8",
    "review.js": "text/javascript; charset=utf-8",
    "mermaid.min.js": "text/javascript; charset=utf-8",
    "LICENSE.mermaid": "text/plain; charset=utf-8",
    "README.md": "text/markdown; charset=utf-8",
}
"""The files served under ``/static/``, with their content types."""

IMMUTABLE = {"mermaid.min.js"}
"""Served with a one-year ``immutable`` cache; the rest with ``no-cache``."""

_LONG_CACHE = "public, max-age=31536000, immutable"
_NO_CACHE = "no-cache"


@lru_cache(maxsize=None)
def static_bytes(name: str) -> bytes:
    """The bytes of one shipped static file.

    Raises:
        KeyError: ``name`` is not one of :data:`STATIC_FILES`.
        FileNotFoundError: the package data is missing (a broken install).
    """
    if name not in STATIC_FILES:
        raise KeyError(name)
    return importlib.resources.files(__package__).joinpath("static", name).read_bytes()


def _not_found(request: web.Request, detail: str) -> web.Response:
    body = {"type": "about:blank", "title": "Not Found", "status": 404, "detail": detail, "instance": request.path}
    return web.Response(status=404, body=orjson.dumps(body), content_type="application/problem+json")


def _file(name: str) -> web.Response:
    ctype = STATIC_FILES[name]
    headers = {
        "Content-Type": ctype,
        "Cache-Control": _LONG_CACHE if name in IMMUTABLE else _NO_CACHE,
        "X-Content-Type-Options": "nosniff",
    }
    if name == "review.html":
        # The page's CSP is also in its <meta>; a header covers what a meta cannot (frame-ancestors).
        headers["Content-Security-Policy"] = "frame-ancestors 'none'"
        headers["Referrer-Policy"] = "same-origin"
    return web.Response(body=static_bytes(name), headers=headers)


async def _review(request: web.Request) -> web.Response:
    return _file("review.html")


async def _static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in STATIC_FILES:  # exact names only: "..", "a/b", "%2F" never match
        return _not_found(request, f"no static file {name!r}")
    try:
        return _file(name)
    except FileNotFoundError:
        return _not_found(request, f"static file {name!r} is missing from this installation")


def add_review_routes(app: web.Application) -> None:
    """Register ``GET /review/{sid}`` (the page) and ``GET /static/{name}`` (its files) on ``app``."""
    app.router.add_get("/review/{sid}", _review)
    app.router.add_get("/static/{name}", _static)
