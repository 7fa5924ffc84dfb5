"""bench_server.py: the HTTP server's event stream (issue 10), with the peers side by side in one run.

Three measures, each against a server in a process of its own (clients in this process or in one more):

a) **Server CPU per SSE event**: 20,000 events of ~74 bytes to one client over loopback, JSON
   encoding included. fsm_agent's ``SSEWriter`` (pre-encoded frames, ``encode_frame``; and
   ``event_frame`` of an ``EventRecord``, the join's real path) against ``aiohttp-sse`` 3.0
   (``sse_response().send()``, with orjson and with ``json.dumps``) and a floor (a bare
   ``StreamResponse.write`` of the same bytes, no send timeout), in alternating rounds. The server's
   CPU time is read through ``GET /cpu`` before and after each stream. Every variant's body is checked
   byte for byte against the floor's (the same frames; ``aiohttp-sse`` with ``sep="\\n"``).
b) **1,000 subscribers** of one session's stream through ``create_app``'s ``GET /sessions/{sid}/events``,
   while a real run (scripted provider, paced tool calls) emits its events: the server's RSS per
   subscriber, and the fan-out latency from the store commit of each event (the SQLite write returned)
   to its arrival at each client (``time.monotonic`` is the same clock in every process). Beside it,
   a floor: an in-memory broadcaster (a deque and a wake-up flag per subscriber, no store reads) that
   replays the same frames with the same commit timing.
c) **An approval round trip**: a session stopped WAITING_HUMAN; ``POST /sessions/{sid}/approvals/{call_id}``
   ``{"decision": "approve"}`` (202), then the event stream joined with ``Last-Event-ID`` (the stop's
   seq) until its ``run_stopped`` (COMPLETED) arrives. Beside it, the floor: the same resume in process
   (``Agent.resume`` with the decision, no HTTP).

    .venv/bin/python bench/bench_server.py              # a: 7 rounds; b: 1,000 subscribers; c: 200 round trips
    .venv/bin/python bench/bench_server.py --quick      # a: 3 rounds; b: 300 subscribers; c: 50 round trips
    .venv/bin/python bench/bench_server.py --only a,c

Needs ``aiohttp-sse`` (``bench/requirements.txt``); without it, (a) measures the rest and says so.
Results: ``bench/results/server-<UTC time>.json`` and ``server-latest.json``; markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import gc
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import orjson  # noqa: E402

from _common import machine, median, pct, rotate, say, table, versions, write_results  # noqa: E402

PACKAGES = ("fsm-agent", "aiohttp", "aiohttp-sse", "orjson")
WRITERS = ("floor", "floor + encode_frame", "floor + asyncio.timeout per write", "fsm_agent encode_frame",
           "fsm_agent event_frame", "aiohttp-sse (orjson)", "aiohttp-sse (json)")
SLUG = {"floor": "floor", "floor + encode_frame": "floor_encode", "floor + asyncio.timeout per write": "floor_timeout",
        "fsm_agent encode_frame": "ours", "fsm_agent event_frame": "ours_record",
        "aiohttp-sse (orjson)": "peer", "aiohttp-sse (json)": "peer_json"}


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def raise_fd_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, n))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# ==================================================================================================
# the server process
# ==================================================================================================

def _obj(i: int) -> dict[str, Any]:
    return {"seq": i, "text": "hello world", "turn": 3}


def writers_app() -> Any:
    from aiohttp import web

    from fsm_agent.server.sse import HEADERS, SSEWriter, encode_frame, event_frame
    from fsm_agent.store.base import EventRecord

    try:
        from aiohttp_sse import sse_response
    except ImportError:  # measured without the peer
        sse_response = None

    records: dict[int, list[EventRecord]] = {}

    async def cpu(request: web.Request) -> web.Response:
        return web.json_response({"cpu": time.process_time(), "rss_kb": rss_kb()})

    async def stream(request: web.Request) -> web.StreamResponse:
        impl = request.match_info["impl"]
        n = int(request.query["n"])
        dumps = orjson.dumps
        if impl == "floor":
            resp = web.StreamResponse(headers=HEADERS)
            await resp.prepare(request)
            for i in range(1, n + 1):
                await resp.write(b"id: %d\nevent: delta\ndata: %s\n\n" % (i, dumps(_obj(i))))
            await resp.write_eof()
            return resp
        if impl in ("floor_encode", "floor_timeout"):  # where SSEWriter's cost over the floor goes
            resp = web.StreamResponse(headers=HEADERS)
            await resp.prepare(request)
            if impl == "floor_encode":
                for i in range(1, n + 1):
                    await resp.write(encode_frame(dumps(_obj(i)), id=i, event="delta"))
            else:
                for i in range(1, n + 1):
                    async with asyncio.timeout(10.0):
                        await resp.write(b"id: %d\nevent: delta\ndata: %s\n\n" % (i, dumps(_obj(i))))
            await resp.write_eof()
            return resp
        if impl in ("ours", "ours_record"):
            w = SSEWriter(request, retry_ms=None, send_timeout=10.0)
            await w.prepare()
            if impl == "ours":
                for i in range(1, n + 1):
                    await w.write(encode_frame(dumps(_obj(i)), id=i, event="delta"))
            else:
                for rec in records[n]:
                    await w.write(event_frame(rec))
            await w.close()
            return w.response
        if sse_response is None:
            raise web.HTTPNotFound(text="aiohttp-sse is not installed")
        if impl == "peer":
            async with sse_response(request, sep="\n", send_timeout=10.0) as resp:
                for i in range(1, n + 1):
                    await resp.send(dumps(_obj(i)).decode(), id=str(i), event="delta")
            return resp
        if impl == "peer_json":
            async with sse_response(request, sep="\n", send_timeout=10.0) as resp:
                for i in range(1, n + 1):
                    await resp.send(json.dumps(_obj(i), separators=(",", ":")), id=str(i), event="delta")
            return resp
        raise web.HTTPNotFound()

    async def prepare_records(request: web.Request) -> web.Response:
        n = int(request.query["n"])
        # the records as the store hands them over (built once, outside the measure)
        records[n] = [EventRecord("s1", i, "delta", {"text": "hello world"}, None, 1796000000.123456, f"s1:{i}")
                      for i in range(1, n + 1)]
        return web.json_response({"n": n})

    app = web.Application()
    app.router.add_get("/cpu", cpu)
    app.router.add_post("/records", prepare_records)
    app.router.add_get("/w/{impl}", stream)
    return app


def _paced_provider(turns: int) -> Any:
    from fsm_agent import ScriptedProvider
    from fsm_agent.providers import tool_call_response
    from fsm_agent.types import ToolResultMessage, ToolUseBlock

    def answer(request: Any) -> Any:
        n = sum(isinstance(m, ToolResultMessage) for m in request.messages)
        return tool_call_response(ToolUseBlock(f"c{n}", "pace", {"n": n})) if n < turns else "done"

    return ScriptedProvider([answer], repeat_last=True)


def fanout_app(workdir: Path, turns: int, interval: float) -> Any:
    """create_app over a SQLiteStore whose writes record their commit time; a run whose first tool
    call waits for ``POST /bench/go``, then one paced tool call per turn."""
    from aiohttp import web

    from fsm_agent import tool
    from fsm_agent.agent import Agent
    from fsm_agent.config import RunConfig
    from fsm_agent.server import Tenants, create_app
    from fsm_agent.server.app import STORE_KEY
    from fsm_agent.store import SQLiteStore

    go = asyncio.Event()
    commits: dict[int, float] = {}

    @tool
    async def pace(n: int) -> str:
        """Wait for the start, then a little."""
        if n == 0:
            await go.wait()
        else:
            await asyncio.sleep(interval)
        return f"ok {n}"

    store = SQLiteStore(workdir / "fan.db")
    inner_write = store.write

    async def write(batch: Any) -> None:
        await inner_write(batch)
        t = time.monotonic()  # committed: the SQLite write returned (the notifier is rung after this)
        for ev in batch.events:
            commits[ev.seq] = t

    store.write = write  # type: ignore[method-assign]

    def make(s: Any) -> Agent:
        return Agent(_paced_provider(turns), tools=[pace], store=s, config=RunConfig(max_iterations=100_000))

    app = create_app(make, store, tenants=Tenants())
    nstore = app[STORE_KEY]

    async def stats(request: web.Request) -> web.Response:
        gc.collect()
        sid = request.query.get("sid", "fan")
        rec = await nstore.get_session(sid)
        return web.json_response({"subs": nstore.notifier.subscribers(sid), "cpu": time.process_time(),
                                  "rss_kb": rss_kb(), "state": rec.state if rec else None,
                                  "last_seq": rec.last_seq if rec else 0})

    async def start(request: web.Request) -> web.Response:
        go.set()
        return web.json_response({"go": True})

    async def get_commits(request: web.Request) -> web.Response:
        from fsm_agent.server.sse import event_frame

        sid = request.query.get("sid", "fan")
        evs = await nstore.read_events(sid)
        return web.json_response({"commits": {str(k): v for k, v in commits.items()},
                                  "frames": [[e.seq, event_frame(e).decode()] for e in evs]})

    app.router.add_get("/bench/stats", stats)
    app.router.add_post("/bench/go", start)
    app.router.add_get("/bench/commits", get_commits)
    return app


def floor_fanout_app(timeline: Path) -> Any:
    """An in-memory broadcaster: each subscriber has a deque and a wake-up flag; ``POST /bench/go``
    replays the timeline (frames grouped by commit, at the same offsets) into every deque."""
    from aiohttp import web

    from fsm_agent.server.sse import HEADERS

    data = orjson.loads(timeline.read_bytes())
    groups: list[tuple[float, list[tuple[int, bytes]]]] = []
    for off, frames in data["groups"]:
        groups.append((off, [(s, f.encode()) for s, f in frames]))
    subs: set[Any] = set()
    commits: dict[int, float] = {}

    class Sub:
        def __init__(self) -> None:
            import collections
            self.q: Any = collections.deque()
            self.wake = asyncio.Event()

    async def events(request: web.Request) -> web.StreamResponse:
        sub = Sub()
        subs.add(sub)
        resp = web.StreamResponse(headers=HEADERS)
        try:
            await resp.prepare(request)
            await resp.write(b"retry: 3000\n\n")
            while True:
                sub.wake.clear()
                while sub.q:
                    frame = sub.q.popleft()
                    if frame is None:
                        await resp.write_eof()
                        return resp
                    async with asyncio.timeout(10):
                        await resp.write(frame)
                await sub.wake.wait()
        finally:
            subs.discard(sub)

    async def produce() -> None:
        t0 = time.monotonic()
        for off, frames in groups:
            delay = t0 + off - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            t = time.monotonic()
            for seq, frame in frames:
                commits[seq] = t
                for sub in subs:
                    sub.q.append(frame)
            for sub in subs:
                sub.wake.set()
        for sub in subs:
            sub.q.append(None)
            sub.wake.set()

    tasks: set[Any] = set()

    async def start(request: web.Request) -> web.Response:
        task = asyncio.ensure_future(produce())
        tasks.add(task)
        return web.json_response({"go": True})

    async def stats(request: web.Request) -> web.Response:
        gc.collect()
        return web.json_response({"subs": len(subs), "cpu": time.process_time(), "rss_kb": rss_kb(),
                                  "state": None, "last_seq": 0})

    async def get_commits(request: web.Request) -> web.Response:
        return web.json_response({"commits": {str(k): v for k, v in commits.items()}})

    app = web.Application()
    app.router.add_get("/events", events)
    app.router.add_post("/bench/go", start)
    app.router.add_get("/bench/stats", stats)
    app.router.add_get("/bench/commits", get_commits)
    return app


def approvals_app(workdir: Path) -> Any:
    from fsm_agent import ScriptedProvider, tool
    from fsm_agent.agent import Agent
    from fsm_agent.providers import tool_call_response
    from fsm_agent.server import Tenants, create_app
    from fsm_agent.store import SQLiteStore
    from fsm_agent.types import ToolResultMessage, ToolUseBlock
    from fsm_agent_middleware.approval import HumanApproval

    def make(s: Any) -> Agent:
        return approval_agent(s, ScriptedProvider, tool, tool_call_response, ToolResultMessage, ToolUseBlock,
                              HumanApproval, Agent)

    return create_app(make, SQLiteStore(workdir / "approvals.db"), tenants=Tenants())


def approval_agent(store: Any, ScriptedProvider: Any, tool: Any, tool_call_response: Any, ToolResultMessage: Any,
                   ToolUseBlock: Any, HumanApproval: Any, Agent: Any) -> Any:
    """One ``send_mail`` call held for approval (id ``c0``), then "done"."""

    @tool(effect="side_effect")
    async def send_mail(to: str) -> str:
        """Send a mail."""
        return f"sent to {to}"

    def answer(request: Any) -> Any:
        done = any(isinstance(m, ToolResultMessage) for m in request.messages)
        return "done" if done else tool_call_response(ToolUseBlock("c0", "send_mail", {"to": "ann@example.com"}))

    return Agent(ScriptedProvider([answer], repeat_last=True), tools=[send_mail],
                 middleware=[HumanApproval(["send_mail"])], store=store)


def serve_main(args: argparse.Namespace) -> None:
    from aiohttp import web

    async def main() -> None:
        workdir = Path(args.dir)
        if args.serve == "writers":
            app = writers_app()
        elif args.serve == "fanout":
            app = fanout_app(workdir, args.turns, args.interval)
        elif args.serve == "floor-fanout":
            app = floor_fanout_app(workdir / "timeline.json")
        elif args.serve == "approvals":
            app = approvals_app(workdir)
        else:
            raise SystemExit(f"unknown server {args.serve}")
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
        await site.start()
        print(f"PORT {runner.addresses[0][1]}", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
        await runner.cleanup()

    raise_fd_limit(8192)
    asyncio.run(main())


class Server:
    """A server subprocess (this script with ``--serve KIND``)."""

    def __init__(self, kind: str, workdir: Path, *extra: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--dir", str(workdir), *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"server {kind} did not start: {line!r}")
        self.port = int(line.split()[1])
        self.base = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ==================================================================================================
# raw HTTP from this process
# ==================================================================================================

def http(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
         bufsize: int = 1 << 20) -> tuple[int, bytes]:
    """One HTTP/1.1 request with ``Connection: close``; returns the status and the (de-chunked) body."""
    hdrs = {"Host": f"127.0.0.1:{port}", "Connection": "close", **(headers or {})}
    if body or method == "POST":
        hdrs["Content-Length"] = str(len(body))
        hdrs.setdefault("Content-Type", "application/json")
    req = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(req.encode() + body)
        chunks = []
        while True:
            b = s.recv(bufsize)
            if not b:
                break
            chunks.append(b)
    raw = b"".join(chunks)
    head, _, rest = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        rest = dechunk(rest)
    return status, rest


def dechunk(raw: bytes) -> bytes:
    out = bytearray()
    pos = 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += raw[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


def get_json(port: int, path: str) -> Any:
    status, body = http(port, "GET", path)
    assert status == 200, (status, body[:200])
    return orjson.loads(body)


def post_json(port: int, path: str, data: Any = None) -> tuple[int, Any]:
    status, body = http(port, "POST", path, orjson.dumps(data if data is not None else {}))
    return status, (orjson.loads(body) if body else None)


# ==================================================================================================
# a) CPU per event
# ==================================================================================================

def bench_writers(rounds: int, n: int, workdir: Path) -> dict[str, Any]:
    srv = Server("writers", workdir)
    out: dict[str, Any] = {"rounds": rounds, "events": n, "cpu_us": {w: [] for w in WRITERS},
                           "wall_ms": {w: [] for w in WRITERS}, "bytes": {}, "absent": []}
    try:
        post_json(srv.port, f"/records?n={n}")
        impls = list(WRITERS)
        status, _ = http(srv.port, "GET", "/w/peer?n=1")
        if status == 404:
            impls = [w for w in impls if not w.startswith("aiohttp-sse")]
            out["absent"] = [w for w in WRITERS if w.startswith("aiohttp-sse")]
            say("aiohttp-sse: ABSENT (pip install -r bench/requirements.txt); measuring the rest")
        reference = None
        for r in range(rounds + 1):  # round 0 warms up
            for impl in rotate(impls, r):
                c0 = get_json(srv.port, "/cpu")["cpu"]
                t0 = time.perf_counter()
                status, body = http(srv.port, "GET", f"/w/{SLUG[impl]}?n={n}")
                wall = time.perf_counter() - t0
                c1 = get_json(srv.port, "/cpu")["cpu"]
                assert status == 200 and body.count(b"\n\n") == n, (impl, status, body[:200])
                if impl != "fsm_agent event_frame":
                    if reference is None:
                        reference = body
                    assert body == reference, f"{impl}: not the same bytes as the others"
                out["bytes"][impl] = len(body)
                if r == 0:
                    continue
                out["cpu_us"][impl].append((c1 - c0) / n * 1e6)
                out["wall_ms"][impl].append(wall * 1e3)
    finally:
        srv.close()
    return out


def report_writers(res: dict[str, Any]) -> str:
    ours = median(res["cpu_us"]["fsm_agent encode_frame"])
    rows = []
    for w in WRITERS:
        xs = res["cpu_us"][w]
        if not xs:
            rows.append([w, "absent", None, None, None, None])
            continue
        m = median(xs)
        rows.append([w, m, min(xs), max(xs), m / ours, res["bytes"][w] / res["events"]])
    return table(["writer", "server CPU µs/event (median)", "min", "max", "vs fsm_agent encode_frame",
                  "bytes/event"], rows,
                 f"a) server CPU per SSE event: {res['events']:,} events to one client over loopback, "
                 f"JSON included ({res['rounds']} rounds)")


# ==================================================================================================
# b) 1,000 subscribers
# ==================================================================================================

def clients_main(args: argparse.Namespace) -> None:
    """Open ``--clients`` streams, say CONNECTED once every one has its response headers, record
    each ``id:`` frame's arrival time, write the arrivals to ``--out`` when every stream has ended."""
    raise_fd_limit(args.clients + 100)
    req = (f"GET {args.path} HTTP/1.1\r\nHost: 127.0.0.1:{args.port}\r\nAccept: text/event-stream\r\n"
           "Connection: close\r\n"
           "\r\n").encode()

    class Sub(asyncio.Protocol):
        def __init__(self) -> None:
            self.seqs = array.array("q")
            self.times = array.array("d")
            self.tail = b""
            self.headers = asyncio.get_running_loop().create_future()
            self.done = asyncio.get_running_loop().create_future()

        def connection_made(self, transport: Any) -> None:
            transport.write(req)

        def data_received(self, data: bytes) -> None:
            now = time.monotonic()
            buf = self.tail + data
            if not self.headers.done():
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    self.tail = buf
                    return
                assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
                self.headers.set_result(None)
                buf = buf[end + 4:]
            pos = 0
            while True:
                i = buf.find(b"\nid: ", pos)
                if i < 0:
                    self.tail = buf[max(pos, len(buf) - 20):]
                    return
                j = buf.find(b"\n", i + 5)
                if j < 0:
                    self.tail = buf[i:]
                    return
                self.seqs.append(int(buf[i + 5:j]))
                self.times.append(now)
                pos = j

        def connection_lost(self, exc: Exception | None) -> None:
            if not self.done.done():
                self.done.set_result(None)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        subs: list[Sub] = []
        for start in range(0, args.clients, 100):
            batch = [Sub() for _ in range(min(100, args.clients - start))]
            await asyncio.gather(*(loop.create_connection(lambda s=s: s, "127.0.0.1", args.port) for s in batch))
            subs += batch
        await asyncio.wait_for(asyncio.gather(*(s.headers for s in subs)), 60)
        print("CONNECTED", flush=True)
        await asyncio.wait_for(asyncio.gather(*(s.done for s in subs)), 180)
        with open(args.out, "wb") as f:
            f.write(orjson.dumps([[s.seqs.tobytes().hex(), s.times.tobytes().hex()] for s in subs]))
        print("DONE", flush=True)

    asyncio.run(main())


def _fanout_once(kind: str, workdir: Path, subs: int, extra: list[str], path_of: Any) -> dict[str, Any]:
    srv = Server(kind, workdir, *extra)
    try:
        if kind == "fanout":
            status, _ = post_json(srv.port, "/sessions", {"task": "go", "session_id": "fan"})
            assert status == 201, status
            time.sleep(0.5)  # the run is at its first tool call, waiting for /bench/go
        st0 = get_json(srv.port, "/bench/stats?sid=fan")
        out_file = workdir / f"arrivals-{kind}.json"
        cl = subprocess.Popen([sys.executable, __file__, "--clients", str(subs), "--port", str(srv.port),
                               "--path", path_of(st0), "--out", str(out_file)], stdout=subprocess.PIPE, text=True)
        assert cl.stdout is not None
        line = cl.stdout.readline()
        assert line.strip() == "CONNECTED", line
        deadline = time.monotonic() + 30
        while (st1 := get_json(srv.port, "/bench/stats?sid=fan"))["subs"] < subs:
            assert time.monotonic() < deadline, st1
            time.sleep(0.05)
        t_go = time.monotonic()
        post_json(srv.port, "/bench/go")
        line = cl.stdout.readline()
        assert line.strip() == "DONE", line
        wall = time.monotonic() - t_go
        cl.wait(30)
        st2 = get_json(srv.port, "/bench/stats?sid=fan")
        commits_doc = get_json(srv.port, "/bench/commits?sid=fan")
    finally:
        srv.close()
    commits = {int(k): v for k, v in commits_doc["commits"].items()}
    arrivals = orjson.loads(out_file.read_bytes())
    lat: list[float] = []
    per_event_last: dict[int, float] = {}
    counts = []
    after = st0["last_seq"]
    expected = sorted(s for s in commits if s > after)
    for seqs_hex, times_hex in arrivals:
        seqs = array.array("q", bytes.fromhex(seqs_hex))
        times = array.array("d", bytes.fromhex(times_hex))
        counts.append(len(seqs))
        assert list(seqs) == expected, (kind, "a subscriber missed or repeated events", len(seqs), len(expected))
        for s, t in zip(seqs, times):
            d = t - commits[s]
            lat.append(d)
            if d > per_event_last.get(s, -1.0):
                per_event_last[s] = d
    ms = [x * 1e3 for x in lat]
    last_ms = [x * 1e3 for x in per_event_last.values()]
    cpu = st2["cpu"] - st1["cpu"]
    return {"subscribers": subs, "events": len(expected), "deliveries": len(lat), "wall_s": wall,
            "rss_kb_before": st0["rss_kb"], "rss_kb_connected": st1["rss_kb"], "rss_kb_after": st2["rss_kb"],
            "rss_kb_per_subscriber": (st1["rss_kb"] - st0["rss_kb"]) / subs,
            "latency_ms": {"p50": pct(ms, 50), "p90": pct(ms, 90), "p99": pct(ms, 99), "max": max(ms)},
            "all_reached_ms": {"p50": pct(last_ms, 50), "p99": pct(last_ms, 99), "max": max(last_ms)},
            "server_cpu_s": cpu, "server_cpu_share": cpu / wall if wall else float("nan"),
            "server_cpu_us_per_delivery": cpu / len(lat) * 1e6 if lat else float("nan"),
            "_timeline": commits_doc.get("frames"), "_commits": commits, "_after": after}


def bench_fanout(subs: int, turns: int, interval: float, workdir: Path) -> dict[str, Any]:
    raise_fd_limit(subs + 200)
    ours = _fanout_once("fanout", workdir, subs, ["--turns", str(turns), "--interval", str(interval)],
                        lambda st: f"/sessions/fan/events?after={st['last_seq']}")
    # the floor replays the same frames, grouped by commit, at the same offsets from the first one
    commits, after, frames = ours.pop("_commits"), ours.pop("_after"), ours.pop("_timeline")
    by_seq = {s: f for s, f in frames}
    later = sorted(s for s in commits if s > after)
    t0 = commits[later[0]]
    groups: list[list[Any]] = []
    for s in later:
        off = commits[s] - t0
        if groups and groups[-1][0] == off:
            groups[-1][1].append([s, by_seq[s]])
        else:
            groups.append([off, [[s, by_seq[s]]]])
    (workdir / "timeline.json").write_bytes(orjson.dumps({"groups": groups}))
    floor = _fanout_once("floor-fanout", workdir, subs, [], lambda st: "/events")
    for r in (floor, ours):
        for k in ("_timeline", "_commits", "_after"):
            r.pop(k, None)
    return {"turns": turns, "interval_s": interval, "fsm_agent": ours, "floor": floor}


def report_fanout(res: dict[str, Any]) -> str:
    rows = []
    o, f = res["fsm_agent"], res["floor"]
    for name, r in (("fsm_agent create_app /events", o), ("floor: in-memory broadcast", f)):
        rows.append([name, r["subscribers"], r["events"], r["rss_kb_per_subscriber"], r["latency_ms"]["p50"],
                     r["latency_ms"]["p99"], r["latency_ms"]["max"], r["all_reached_ms"]["p99"],
                     r["server_cpu_us_per_delivery"], r["server_cpu_share"] * 100])
    ratio = ["fsm_agent / floor", "", "", o["rss_kb_per_subscriber"] / f["rss_kb_per_subscriber"]
             if f["rss_kb_per_subscriber"] > 0 else None,
             o["latency_ms"]["p50"] / f["latency_ms"]["p50"], o["latency_ms"]["p99"] / f["latency_ms"]["p99"],
             o["latency_ms"]["max"] / f["latency_ms"]["max"], o["all_reached_ms"]["p99"] / f["all_reached_ms"]["p99"],
             o["server_cpu_us_per_delivery"] / f["server_cpu_us_per_delivery"], ""]
    rows.append(ratio)
    return table(["stream", "subscribers", "events", "RSS KB/subscriber", "latency p50 ms", "p99 ms", "max ms",
                  "all reached p99 ms", "server CPU µs/delivery", "server CPU %"], rows,
                 f"b) one session's stream to {o['subscribers']:,} subscribers ({res['turns']} paced turns, "
                 f"{res['interval_s']} s apart; latency = arrival − store commit, per event and subscriber)")


# ==================================================================================================
# c) approval round trip
# ==================================================================================================

def bench_approvals(n: int, workdir: Path) -> dict[str, Any]:
    srv = Server("approvals", workdir)
    res: dict[str, Any] = {"round_trips": n}
    try:
        sids = [f"a{i}" for i in range(n + 5)]  # 5 warm-ups
        for sid in sids:
            status, body = post_json(srv.port, "/sessions", {"task": "mail ann", "session_id": sid})
            assert status == 201, (status, body)
        deadline = time.monotonic() + 60
        while True:
            listed = get_json(srv.port, "/sessions?state=WAITING_HUMAN&limit=1000")["sessions"]
            if len(listed) == len(sids):
                break
            assert time.monotonic() < deadline, f"{len(listed)} of {len(sids)} sessions waiting"
            time.sleep(0.05)
        snaps = {s["session_id"]: s for s in listed}
        post_ms, total_ms = [], []
        for i, sid in enumerate(sids):
            snap = snaps[sid]
            call_id = snap["pending_approvals"][0]["call"]["id"]
            t0 = time.perf_counter()
            status, body = post_json(srv.port, f"/sessions/{sid}/approvals/{call_id}", {"decision": "approve"})
            t1 = time.perf_counter()
            if status in (404, 405) and body and "Not pending" not in str(body):
                res["error"] = f"the approval route answered {status}: {body}"
                return res
            assert status == 202, (status, body)
            status, stream = http(srv.port, "GET", f"/sessions/{sid}/events",
                                  headers={"Last-Event-ID": str(snap["last_seq"]), "Accept": "text/event-stream"})
            t2 = time.perf_counter()  # the stream closes right after the run_stopped event
            assert status == 200
            last = stream.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
            assert b"event: run_stopped" in last and b'"COMPLETED"' in last, last[:300]
            if i >= 5:
                post_ms.append((t1 - t0) * 1e3)
                total_ms.append((t2 - t0) * 1e3)
    finally:
        srv.close()
    res["post_ms"] = {"p50": pct(post_ms, 50), "p99": pct(post_ms, 99), "max": max(post_ms)}
    res["round_trip_ms"] = {"p50": pct(total_ms, 50), "p99": pct(total_ms, 99), "max": max(total_ms)}
    res["in_process_ms"] = asyncio.run(_in_process_resumes(n, workdir))
    return res


async def _in_process_resumes(n: int, workdir: Path) -> dict[str, float]:
    """The floor: the same resume with the decision, in process (no HTTP, no stream)."""
    from fsm_agent import ScriptedProvider, tool
    from fsm_agent.agent import Agent
    from fsm_agent.control import Decision
    from fsm_agent.providers import tool_call_response
    from fsm_agent.store import SQLiteStore
    from fsm_agent.types import ToolResultMessage, ToolUseBlock
    from fsm_agent_middleware.approval import HumanApproval

    store = SQLiteStore(workdir / "inproc.db")
    agent = approval_agent(store, ScriptedProvider, tool, tool_call_response, ToolResultMessage, ToolUseBlock,
                           HumanApproval, Agent)
    sids = [f"p{i}" for i in range(n + 5)]
    for sid in sids:
        r = await agent.run("mail ann", session_id=sid)
        assert r.stop.reason.value == "WAITING_HUMAN", r.stop
    ms = []
    for i, sid in enumerate(sids):
        t0 = time.perf_counter()
        r = await agent.resume(sid, decisions={"c0": Decision.approve()})
        dt = time.perf_counter() - t0
        assert r.stop.reason.value == "COMPLETED", r.stop
        if i >= 5:
            ms.append(dt * 1e3)
    await store.close()
    return {"p50": pct(ms, 50), "p99": pct(ms, 99), "max": max(ms)}


def report_approvals(res: dict[str, Any]) -> str:
    if "error" in res:
        return f"\n### c) approval round trip\n\nnot run: {res['error']}"
    rt, post, ip = res["round_trip_ms"], res["post_ms"], res["in_process_ms"]
    rows = [["POST approval → run_stopped (COMPLETED) on the stream", rt["p50"], rt["p99"], rt["max"], rt["p50"] / ip["p50"]],
            ["  of which the POST (202)", post["p50"], post["p99"], post["max"], post["p50"] / ip["p50"]],
            ["floor: Agent.resume with the decision, in process", ip["p50"], ip["p99"], ip["max"], 1.0]]
    return table(["approval round trip", "p50 ms", "p99 ms", "max ms", "p50 vs in process"], rows,
                 f"c) approval round trip ({res['round_trips']} sessions stopped WAITING_HUMAN, one at a time)")


# ==================================================================================================

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="a,b,c", help="which measures: a,b,c")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--subscribers", type=int, default=None)
    ap.add_argument("--turns", type=int, default=20, help="(b) paced turns of the run (~11 events each)")
    ap.add_argument("--interval", type=float, default=0.25, help="(b) seconds between turns")
    ap.add_argument("--approvals", type=int, default=None)
    # internal: the server and client processes
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--clients", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve_main(args)
        return
    if args.clients:
        clients_main(args)
        return

    only = set(args.only.split(","))
    rounds = args.rounds or (3 if args.quick else 7)
    subs = args.subscribers or (300 if args.quick else 1000)
    n_appr = args.approvals or (50 if args.quick else 200)
    data: dict[str, Any] = {"machine": machine(), "versions": versions(PACKAGES), "command": sys.argv}
    say(f"bench_server: load average {data['machine']['loadavg_at_start']}, {os.cpu_count()} CPUs")
    out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        workdir = Path(tmp)
        if "a" in only:
            t = time.monotonic()
            data["writers"] = bench_writers(rounds, args.events, workdir)
            out.append(report_writers(data["writers"]))
            say(out[-1], f"\n({time.monotonic() - t:.0f} s)")
        if "b" in only:
            t = time.monotonic()
            data["fanout"] = bench_fanout(subs, args.turns, args.interval, workdir)
            out.append(report_fanout(data["fanout"]))
            say(out[-1], f"\n({time.monotonic() - t:.0f} s)")
        if "c" in only:
            t = time.monotonic()
            data["approvals"] = bench_approvals(n_appr, workdir)
            out.append(report_approvals(data["approvals"]))
            say(out[-1], f"\n({time.monotonic() - t:.0f} s)")
    data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path = write_results("server", data)
    say(f"\nload average at the end {data['machine']['loadavg_at_end']}; results: {path}")


if __name__ == "__main__":
    main()
