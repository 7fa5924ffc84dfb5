"""Real peers and tools for the A2A tests.

* :class:`Live` serves an aiohttp app on a loopback TCP port (our server, for real clients).
* :func:`sdk_server` serves an agent built with the official ``a2a-sdk`` (its JSON-RPC routes and
  agent card on Starlette, run by uvicorn in a thread with its own event loop) on a loopback port.
  Its executor, :class:`SdkExecutor`, acts on the first word of the user's text (see its doc).
* :class:`DropProxy` is a loopback TCP proxy that cuts the server-to-client side of chosen
  connections after a number of bytes (a dropped stream), and records each request's head.
* :func:`rpc`, :func:`sse_frames`: one JSON-RPC call; the frames of an SSE answer.
* :data:`GATE`, :func:`holding_tool` and :data:`step`: tools a test holds in flight, then lets go.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from fsm_agent import Tool, tool

A2A = {"A2A-Version": "1.0"}

GATE: dict[str, Any] = {}
"""What a holding tool waits on: ``started`` (set when one starts), ``release`` (set it to let the
tool finish) and ``cancelled`` (how many were cancelled). A test module's autouse fixture calls
:func:`reset_gate` before each test."""


def reset_gate() -> None:
    """A fresh :data:`GATE` for the next test."""
    GATE.update(started=asyncio.Event(), release=asyncio.Event(), cancelled=0)


def holding_tool(name: str = "hold", *, result: str = "released", effect: str = "pure") -> Tool:
    """A tool named ``name`` that waits until the test sets ``GATE["release"]`` (or its run is
    interrupted or cancelled, which it counts), then answers ``result``."""

    async def hold() -> str:
        """Wait until the test lets go (or the run is interrupted or cancelled)."""
        GATE["started"].set()
        try:
            await GATE["release"].wait()
        except asyncio.CancelledError:
            GATE["cancelled"] += 1
            raise
        return result

    return tool(name=name, effect=effect)(hold)


@tool
def step(n: int) -> str:
    """One step."""
    return f"step {n} done"


class Live:
    """An aiohttp app served on 127.0.0.1 (a free port)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> Live:
        self.runner = web.AppRunner(self.app, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def rpc_url(self) -> str:
        return self.base + "/a2a"


async def rpc(session: aiohttp.ClientSession, url: str, method: str, params: Any, *, rid: Any = 1,
              headers: dict[str, str] | None = None, version: str | None = "1.0") -> dict[str, Any]:
    """One JSON-RPC call; the parsed JSON answer (HTTP 200 required)."""
    hdrs = {**({"A2A-Version": version} if version is not None else {}), **(headers or {})}
    async with session.post(url, json={"jsonrpc": "2.0", "id": rid, "method": method, "params": params},
                            headers=hdrs) as resp:
        assert resp.status == 200, (resp.status, await resp.text())
        data: dict[str, Any] = orjson.loads(await resp.read())
        return data


def dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body, which may be cut anywhere (a dropped connection)."""
    out = bytearray()
    pos = 0
    while pos < len(body):
        end = body.find(b"\r\n", pos)
        if end < 0:
            break
        size = int(body[pos:end].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += body[end + 2:end + 2 + size]
        pos = end + 2 + size + 2
    return bytes(out)


def parse_frames(raw: bytes) -> list[dict[str, Any]]:
    """Complete SSE frames of ``raw``: ``{"id": int|None, "event": str|None, "data": dict}`` (a
    last frame without its blank line is incomplete, and left out)."""
    out = []
    text = raw.replace(b"\r\n", b"\n")
    blocks = text.split(b"\n\n")
    if not text.endswith(b"\n\n"):
        blocks = blocks[:-1]
    for block in blocks:
        if not block.strip() or block.startswith(b":"):
            continue
        frame: dict[str, Any] = {"id": None, "event": None, "data": None}
        for line in block.split(b"\n"):
            if line.startswith(b"id: "):
                frame["id"] = int(line[4:])
            elif line.startswith(b"event: "):
                frame["event"] = line[7:].decode()
            elif line.startswith(b"data: "):
                frame["data"] = orjson.loads(line[6:])
        if frame["data"] is not None:
            out.append(frame)
    return out


async def sse_frames(session: aiohttp.ClientSession, url: str, method: str, params: Any, *,
                     headers: dict[str, str] | None = None, rid: Any = 1, max_frames: int | None = None
                     ) -> list[dict[str, Any]]:
    """The frames of a streaming call (all of them, or the first ``max_frames``: the connection is
    then closed by the client, mid-stream)."""
    async with session.post(url, json={"jsonrpc": "2.0", "id": rid, "method": method, "params": params},
                            headers={**A2A, **(headers or {})}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream"), await resp.text()
        buf = b""
        frames: list[dict[str, Any]] = []
        async for chunk in resp.content.iter_any():
            buf += chunk
            end = buf.rfind(b"\n\n")
            if end >= 0:
                frames.extend(parse_frames(buf[:end + 2]))
                buf = buf[end + 2:]
            if max_frames is not None and len(frames) >= max_frames:
                resp.close()  # drop the connection mid-stream
                return frames[:max_frames]
        return frames


def user_message(text: str, message_id: str, **extra: Any) -> dict[str, Any]:
    return {"messageId": message_id, "role": "ROLE_USER", "parts": [{"text": text}], **extra}


# -- the official SDK as a server -----------------------------------------------------------------
class SdkExecutor:
    """An ``a2a-sdk`` AgentExecutor. By the first word of the user's text:

    * ``echo TEXT``: artifact ``reply`` in three chunks (append, last chunk) = ``echo: TEXT``,
      usage ``{"input_tokens": 7, "output_tokens": 3}`` and ``cost_usd`` 0.002 in the final
      status update's metadata, COMPLETED;
    * ``slow``: WORKING with a message, then waits (``gate`` or cancellation); then COMPLETED ``done``;
    * ``fail`` / ``reject``: FAILED with ``boom`` / REJECTED with ``not allowed``;
    * ``ask``: INPUT_REQUIRED ``which color?``; the follow-up completes with ``you said <text>``.

    ``executed`` lists ``(task id, text)`` of every execute; ``cancelled`` the task ids cancelled.
    """

    def __init__(self) -> None:
        from a2a.server.agent_execution import AgentExecutor

        self.executed: list[tuple[str, str]] = []
        self.cancelled: list[str] = []
        self.gate = threading.Event()
        self.started = threading.Event()
        outer = self

        class _Exec(AgentExecutor):  # type: ignore[misc]
            async def execute(self, context: Any, event_queue: Any) -> None:
                await outer.execute(context, event_queue)

            async def cancel(self, context: Any, event_queue: Any) -> None:
                from a2a.server.tasks import TaskUpdater

                outer.cancelled.append(context.task_id)
                await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()

        self.executor = _Exec()

    async def execute(self, context: Any, event_queue: Any) -> None:
        from a2a.helpers.proto_helpers import new_task_from_user_message
        from a2a.server.tasks import TaskUpdater
        from a2a.types import a2a_pb2 as p

        text = context.get_user_input()
        task = context.current_task
        if task is None:
            task = new_task_from_user_message(context.message)
            await event_queue.enqueue_event(task)
        self.executed.append((task.id, text))
        up = TaskUpdater(event_queue, task.id, task.context_id)
        word, _, rest = text.partition(" ")
        if task.status.state == p.TASK_STATE_INPUT_REQUIRED:
            await up.add_artifact([p.Part(text=f"you said {text}")], artifact_id="reply", name="reply")
            await up.complete()
            return
        await up.start_work()
        if word == "echo":
            reply = f"echo: {rest}"
            chunks = [reply[i:i + 3] for i in range(0, len(reply), 3)] or [""]
            for i, c in enumerate(chunks):
                await up.add_artifact([p.Part(text=c)], artifact_id="reply", name="reply", append=i > 0,
                                      last_chunk=i == len(chunks) - 1)
            await up.update_status(p.TASK_STATE_COMPLETED, metadata={"usage": {"input_tokens": 7, "output_tokens": 3},
                                                                      "cost_usd": 0.002})
        elif word == "slow":
            await up.update_status(p.TASK_STATE_WORKING, message=up.new_agent_message([p.Part(text="thinking")]))
            self.started.set()
            while not self.gate.is_set():
                await asyncio.sleep(0.02)
            await up.add_artifact([p.Part(text="done")], artifact_id="reply")
            await up.complete()
        elif word == "fail":
            await up.failed(up.new_agent_message([p.Part(text="boom")]))
        elif word == "reject":
            await up.reject(up.new_agent_message([p.Part(text="not allowed")]))
        elif word == "ask":
            await up.requires_input(up.new_agent_message([p.Part(text="which color?")]))
        else:
            await up.add_artifact([p.Part(text=f"unknown: {text}")], artifact_id="reply")
            await up.complete()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def sdk_server(executor: SdkExecutor, *, streaming: bool = True, name: str = "sdk agent") -> Iterator[str]:
    """Serve ``executor`` with the official SDK (JSON-RPC at ``/``, the card at the well-known
    path) on a loopback port, in a thread; yields the base URL."""
    import uvicorn
    from a2a.server.request_handlers import DefaultRequestHandler
    from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
    from a2a.server.tasks import InMemoryTaskStore
    from a2a.types import a2a_pb2 as p
    from starlette.applications import Starlette

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    card = p.AgentCard(
        name=name, description="an agent built with the official a2a-sdk", version="1.0.0",
        supported_interfaces=[p.AgentInterface(url=base + "/", protocol_binding="JSONRPC", protocol_version="1.0")],
        capabilities=p.AgentCapabilities(streaming=streaming), default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[p.AgentSkill(id="echo", name="echo", description="echoes", tags=["test"])])
    handler = DefaultRequestHandler(agent_executor=executor.executor, task_store=InMemoryTaskStore(), agent_card=card)
    app = Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, "/")])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="sdk-a2a-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the a2a-sdk server did not start")
        time.sleep(0.02)
    try:
        yield base
    finally:
        executor.gate.set()
        server.should_exit = True
        thread.join(10)


# -- a proxy that drops streams -------------------------------------------------------------------
class DropProxy:
    """Forwards 127.0.0.1:port to ``target_port``. After a request that contains one of ``cut_on``
    (bytes), the connection is cut once ``cut_after`` bytes of its answer went to the client,
    ``cuts`` times in all. ``requests`` holds all the bytes each connection sent (heads and bodies)."""

    def __init__(self, target_port: int, *, cut_on: tuple[bytes, ...] = (), cut_after: int = 0, cuts: int = 1) -> None:
        self.target_port, self.cut_on, self.cut_after, self.cuts_left = target_port, cut_on, cut_after, cuts
        self.requests: list[bytes] = []
        self.delivered: list[bytes] = []
        """For each cut: the bytes of the cut answer that reached the client."""
        self.cut = 0
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def __aenter__(self) -> DropProxy:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            cw.close()
            return
        index = len(self.requests)
        self.requests.append(b"")
        armed = [False]
        sent = [0]
        got = bytearray()

        async def up() -> None:
            while data := await cr.read(65536):
                self.requests[index] += data
                # a keep-alive connection carries one request after another: a request with the
                # marker arms the cut, counted from the first byte of its answer
                if not armed[0] and self.cuts_left > 0 and any(k in data for k in self.cut_on):
                    self.cuts_left -= 1
                    armed[0], sent[0] = True, 0
                sw.write(data)
                await sw.drain()
            sw.close()

        async def down() -> None:
            while data := await sr.read(65536):
                if armed[0] and sent[0] + len(data) >= self.cut_after:
                    cw.write(data[:max(0, self.cut_after - sent[0])])
                    got.extend(data[:max(0, self.cut_after - sent[0])])
                    self.delivered.append(bytes(got))
                    with contextlib.suppress(Exception):
                        await cw.drain()
                    self.cut += 1
                    cw.transport.abort()
                    sw.transport.abort()
                    return
                sent[0] += len(data)
                if armed[0]:
                    got.extend(data)
                cw.write(data)
                await cw.drain()
            cw.close()

        with contextlib.suppress(Exception):
            await asyncio.gather(up(), down())
        for w in (cw, sw):
            with contextlib.suppress(Exception):
                w.close()
