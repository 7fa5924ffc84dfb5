"""Serving an aiohttp app on a free loopback port: the test servers' one way to start."""

from __future__ import annotations

from aiohttp import web

__all__ = ["serve_on_loopback"]


async def serve_on_loopback(app: web.Application) -> tuple[web.AppRunner, str]:
    """Start ``app`` on 127.0.0.1 at a free port; returns its runner (``await runner.cleanup()`` to
    stop it) and its base URL ``http://127.0.0.1:PORT``."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
