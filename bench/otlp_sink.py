"""A loopback OTLP/HTTP sink for bench_overhead.py's ``fsm:otel`` runtime, in its own process (its
CPU is not the runtime's): accepts ``POST /v1/traces`` and ``/v1/metrics``, reads each body and
answers 200. ``GET /stats``: ``{"requests", "bytes"}``. Prints ``PORT <n>`` once it listens; stops
when its stdin closes."""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

STATS = {"requests": 0, "bytes": 0}


async def _take(request: web.Request) -> web.Response:
    body = await request.read()
    STATS["requests"] += 1
    STATS["bytes"] += len(body)
    return web.Response(body=b"", content_type="application/x-protobuf")


async def _stats(_request: web.Request) -> web.Response:
    return web.json_response(STATS)


async def main() -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", _take)
    app.router.add_post("/v1/metrics", _take)
    app.router.add_get("/stats", _stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[union-attr]
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the benchmark closes our stdin
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
