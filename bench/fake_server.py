"""A scripted, zero-latency OpenAI-compatible Chat Completions server for bench_overhead.py.

Run in its own process (``python bench/fake_server.py``); it prints ``PORT <n>`` on stdout once
it listens on 127.0.0.1. Every task gets the same script, decided from the request alone (so any
number of concurrent sessions can share it): while the request holds fewer than 3 ``tool``
messages, answer with one call of ``get_weather`` for the next city; then answer with a final
text. ``"stream": true`` gets the same answers as SSE chunks (role chunk, tool-call fragments or
content deltas, finish chunk, usage chunk, ``[DONE]``), written one event per ``write``.

``GET /stats`` returns the server's own accounting, read by the benchmark before and after each
measured round: ``requests``, ``handler_s`` (wall seconds spent inside the request handler, from
entry to ``write_eof``: parsing the request, choosing the answer, writing it) and ``cpu_s`` (this
process's CPU seconds). The benchmark subtracts ``handler_s`` from a task's wall time.

Answers are prebuilt bytes, so the handler does as little as a server can: read the body, parse it
with orjson to count the tool results, write the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import orjson
from aiohttp import web

CITIES = ("Paris", "Tokyo", "Lima")
"""The tool call of round i asks for CITIES[i]; different arguments each round, so loop detection stays quiet."""
TOOL_ROUNDS = len(CITIES)
CALLS_PER_TASK = TOOL_ROUNDS + 1
FINAL_TEXT = "Paris is sunny, Tokyo is rainy and Lima is cloudy today."
MODEL = "bench-model"
_USAGE = {"prompt_tokens": 52, "completion_tokens": 17, "total_tokens": 69}


def _completion(round_no: int) -> dict:
    if round_no < TOOL_ROUNDS:
        message = {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_r{round_no}", "type": "function",
            "function": {"name": "get_weather", "arguments": orjson.dumps({"city": CITIES[round_no]}).decode()}}]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": FINAL_TEXT}
        finish = "stop"
    return {"id": f"chatcmpl-bench{round_no}", "object": "chat.completion", "created": 1764489600, "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _USAGE}


def _chunks(round_no: int) -> list[bytes]:
    base = {"id": f"chatcmpl-bench{round_no}", "object": "chat.completion.chunk", "created": 1764489600,
            "model": MODEL}

    def ev(choices: list, **extra: object) -> bytes:
        return b"data: " + orjson.dumps({**base, "choices": choices, **extra}) + b"\n\n"

    def delta(d: dict, finish: str | None = None) -> dict:
        return {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}

    out = [ev([delta({"role": "assistant", "content": ""})])]
    if round_no < TOOL_ROUNDS:
        args = orjson.dumps({"city": CITIES[round_no]}).decode()
        out.append(ev([delta({"tool_calls": [{"index": 0, "id": f"call_r{round_no}", "type": "function",
                                               "function": {"name": "get_weather", "arguments": ""}}]})]))
        for i in range(0, len(args), 6):
            out.append(ev([delta({"tool_calls": [{"index": 0, "function": {"arguments": args[i:i + 6]}}]})]))
        out.append(ev([delta({}, "tool_calls")]))
    else:
        words = FINAL_TEXT.split(" ")
        for i, w in enumerate(words):
            out.append(ev([delta({"content": w if i == 0 else " " + w})]))
        out.append(ev([delta({}, "stop")]))
    out.append(ev([], usage=_USAGE))
    out.append(b"data: [DONE]\n\n")
    return out


JSON_BODIES = [orjson.dumps(_completion(r)) for r in range(CALLS_PER_TASK)]
SSE_EVENTS = [_chunks(r) for r in range(CALLS_PER_TASK)]
SSE_EVENTS_PER_TASK = sum(len(e) for e in SSE_EVENTS)
"""SSE events a streamed task receives (each ``data:`` event, ``[DONE]`` included)."""


class Stats:
    requests = 0
    handler_s = 0.0
    bad = 0


async def chat(request: web.Request) -> web.StreamResponse:
    t0 = time.perf_counter()
    body = orjson.loads(await request.read())
    n_tool = 0
    for m in body.get("messages") or ():
        if m.get("role") == "tool":
            n_tool += 1
    round_no = min(n_tool, TOOL_ROUNDS)
    if n_tool > TOOL_ROUNDS:
        Stats.bad += 1
    if body.get("stream"):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in SSE_EVENTS[round_no]:
            await resp.write(chunk)
    else:
        data = JSON_BODIES[round_no]
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data)
    await resp.write_eof()
    Stats.requests += 1
    Stats.handler_s += time.perf_counter() - t0
    return resp


async def stats(request: web.Request) -> web.Response:
    return web.json_response({"requests": Stats.requests, "handler_s": Stats.handler_s,
                              "cpu_s": time.process_time(), "bad": Stats.bad}, dumps=lambda o: orjson.dumps(o).decode())


async def main(port: int) -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/stats", stats)
    runner = web.AppRunner(app, access_log=None, handle_signals=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
    await site.start()
    real_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    sys.stdout.write(f"PORT {real_port}\n")
    sys.stdout.flush()
    # Stop when the parent closes our stdin (the benchmark ends or dies): never outlive it.
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await runner.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    try:
        asyncio.run(main(args.port))
    except KeyboardInterrupt:
        pass
