"""The runtimes bench_overhead.py compares, each doing the same task against bench/fake_server.py.

The task: one user message; the model (the fake server) asks for ``get_weather`` three times, one
call per round, then answers in text. Every runtime sends the tool definition, runs the tool,
sends the result back, and returns the final text. With ``stream=True`` each runtime streams the
model calls and hands every delta to the caller through its own public streaming API (the
caller only counts them).

Middleware / hooks of "the same work" (each pass-through, overriding one hook of each kind):

=================  ===========================  ============================  =========================
                   fsm_agent ``Middleware``     LangChain ``AgentMiddleware``  pydantic-ai capability
=================  ===========================  ============================  =========================
before the model   ``pre_turn``                 ``abefore_model``              ``before_model_request``
around the model   ``wrap_model_call``          ``awrap_model_call``           ``wrap_model_request``
before each tool   ``on_tool_call``             ``awrap_tool_call``            ``before_tool_execute``
after              ``post_turn``                ``aafter_model``               ``after_model_request``
=================  ===========================  ============================  =========================

Runtime names: ``floor``, ``openai-sdk``, ``fsm:N`` (N pass-through middleware, in-memory store),
``fsm:default`` (the CLI's default middleware, MessageRepair + LoopDetection, and the SQLite
store), ``fsm:otel`` (``fsm:0`` with OpenTelemetry tracing and metrics on: a batch span processor
and an OTLP/HTTP exporter to a loopback sink in its own process, bench/otlp_sink.py; each round's
spans are flushed inside the round, so their export is counted; metrics are exported on their own
60 s interval, a cost per interval, not per call), ``langchain:N``, ``pydantic-ai:N``. :func:`make` raises :class:`Unavailable` (with the
import error) when a peer is not installed.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

import orjson

TASK = "What is the weather in Paris, Tokyo and Lima right now?"
MODEL = "bench-model"
SYSTEM = "You are a weather assistant. Use the tool."


def get_weather(city: str) -> str:
    """Current weather for a city.

    Args:
        city: the city name, e.g. "Paris".
    """
    return f"{city}: 21 C, light wind"


TOOL_SCHEMA = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": 'the city name, e.g. "Paris".'}},
                   "required": ["city"]}}}


HOOK_CALLS = [0]
"""Pass-through hook invocations so far (every runtime's hooks bump it: proof they ran, at ~50 ns each)."""


class Unavailable(Exception):
    """The runtime cannot run here (a peer is not installed, or fails to import)."""


class Runtime:
    name: str
    stream: bool

    async def run_task(self) -> tuple[str, int]:
        """One task; returns (final text, deltas seen by the caller)."""
        raise NotImplementedError

    async def close(self) -> None:
        pass

    async def settle(self) -> None:
        """Finish the work a round's tasks left behind (inside the measured window); most have none."""


# ---------------------------------------------------------------------------------------- floor
class Floor(Runtime):
    """A hand-written aiohttp + orjson loop: the least a Python client can do for this task."""

    def __init__(self, base_url: str, stream: bool) -> None:
        import aiohttp

        self.name, self.stream = "floor", stream
        self.url = base_url + "/v1/chat/completions"
        self._aiohttp = aiohttp
        self.session: Any = None

    async def run_task(self) -> tuple[str, int]:
        if self.session is None:
            self.session = self._aiohttp.ClientSession(connector=self._aiohttp.TCPConnector(limit=0))
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        deltas = 0
        headers = {"Content-Type": "application/json", "Authorization": "Bearer x"}
        while True:
            body = orjson.dumps({"model": MODEL, "messages": messages, "tools": [TOOL_SCHEMA], "stream": self.stream})
            async with self.session.post(self.url, data=body, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
                if not self.stream:
                    msg = orjson.loads(await resp.read())["choices"][0]["message"]
                else:
                    text: list[str] = []
                    calls: dict[int, dict[str, Any]] = {}
                    buf = b""
                    done = False
                    while not done:
                        chunk = await resp.content.readany()
                        if not chunk:
                            break
                        buf += chunk
                        *lines, buf = buf.split(b"\n")
                        for line in lines:
                            if not line.startswith(b"data: "):
                                continue
                            data = line[6:]
                            if data == b"[DONE]":
                                done = True
                                break
                            for ch in orjson.loads(data)["choices"]:
                                d = ch["delta"]
                                deltas += 1
                                if d.get("content"):
                                    text.append(d["content"])
                                for tc in d.get("tool_calls") or ():
                                    c = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                                    c["id"] = tc.get("id") or c["id"]
                                    fn = tc.get("function") or {}
                                    c["name"] = fn.get("name") or c["name"]
                                    c["arguments"] += fn.get("arguments") or ""
                    msg = {"role": "assistant", "content": "".join(text) or None}
                    if calls:
                        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                                             for _, c in sorted(calls.items())]
            messages.append(msg)
            tcs = msg.get("tool_calls")
            if not tcs:
                return msg.get("content") or "", deltas
            for tc in tcs:
                args = orjson.loads(tc["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": tc["id"], "content": get_weather(**args)})

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


# ---------------------------------------------------------------------------------- openai SDK
class OpenAISDK(Runtime):
    """The official openai SDK, hand loop (the DESIGN §8 'openai SDK hand loop' row)."""

    def __init__(self, base_url: str, stream: bool) -> None:
        try:
            from openai import AsyncOpenAI
        except ImportError as exc:
            raise Unavailable(f"openai SDK not importable: {exc}") from exc
        self.name, self.stream = "openai-sdk", stream
        self.client = AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)

    async def run_task(self) -> tuple[str, int]:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        deltas = 0
        while True:
            if not self.stream:
                r = await self.client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL_SCHEMA])
                m = r.choices[0].message
                content, tcs = m.content, [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or ()]
            else:
                text: list[str] = []
                calls: dict[int, list[str]] = {}
                s = await self.client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL_SCHEMA],
                                                              stream=True)
                async for chunk in s:
                    for ch in chunk.choices:
                        deltas += 1
                        d = ch.delta
                        if d.content:
                            text.append(d.content)
                        for tc in d.tool_calls or ():
                            c = calls.setdefault(tc.index, ["", "", ""])
                            c[0] = tc.id or c[0]
                            if tc.function is not None:
                                c[1] = tc.function.name or c[1]
                                c[2] += tc.function.arguments or ""
                content, tcs = "".join(text) or None, [tuple(c) for _, c in sorted(calls.items())]
            if not tcs:
                return content or "", deltas
            messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in tcs]})
            for i, _n, a in tcs:
                messages.append({"role": "tool", "tool_call_id": i, "content": get_weather(**orjson.loads(a))})

    async def close(self) -> None:
        await self.client.close()


# ----------------------------------------------------------------------------------- fsm_agent
def _fsm_passthrough(k: int) -> list[Any]:
    from fsm_agent import Middleware

    class PassThrough(Middleware):
        def pre_turn(self, ctx: Any) -> None:
            HOOK_CALLS[0] += 1

        async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
            HOOK_CALLS[0] += 1
            return await call_next(request)

        def on_tool_call(self, call: Any, ctx: Any) -> None:
            HOOK_CALLS[0] += 1

        def post_turn(self, ctx: Any) -> None:
            HOOK_CALLS[0] += 1

    return [type(f"PassThrough{i}", (PassThrough,), {"name": f"pass{i}"})() for i in range(k)]


class _DeltaCounter:
    def __init__(self) -> None:
        self.n = 0

    def on_model_event(self, event: Any) -> None:
        self.n += 1


class Fsm(Runtime):
    """fsm_agent's Agent over the openai-compatible profile (its aiohttp client)."""

    def __init__(self, base_url: str, stream: bool, k: int | None, otel: bool = False) -> None:
        from fsm_agent import Agent, RunConfig, create_provider, tool
        from fsm_agent.providers import ProviderConfig

        self.stream = stream
        self.provider = create_provider("openai-compatible", ProviderConfig(base_url=base_url + "/v1", model=MODEL,
                                                                            api_key="x"))
        self.counter = _DeltaCounter()
        self.tmp: tempfile.TemporaryDirectory[str] | None = None
        if k is None:  # the CLI's defaults: MessageRepair + LoopDetection, and the SQLite store
            from fsm_agent.store import SQLiteStore
            from fsm_agent_middleware.loop_detection import LoopDetection
            from fsm_agent_middleware.repair import MessageRepair

            self.name = "fsm:default"
            self.tmp = tempfile.TemporaryDirectory(prefix="fsm-bench-")
            store: Any = SQLiteStore(os.path.join(self.tmp.name, "sessions.db"))
            middleware: list[Any] = [MessageRepair(), LoopDetection()]
        else:
            self.name = f"fsm:{k}"
            store = None
            middleware = _fsm_passthrough(k)
        self.store = store
        self.otel: Any = None
        instrument: Any = None
        if otel:
            self.name = "fsm:otel"
            self.otel = _OtelExport()
            instrument = self.otel.settings
        self.agent = Agent(self.provider, tools=[tool(get_weather)], system_prompt=SYSTEM, middleware=middleware,
                           observers=[self.counter] if stream else [], store=store,
                           config=RunConfig(stream=stream, max_iterations=10), instrument=instrument)

    async def run_task(self) -> tuple[str, int]:
        before = self.counter.n
        result = await self.agent.run(TASK)
        if result.stop.reason.value != "COMPLETED":
            raise RuntimeError(f"fsm_agent stopped {result.stop.reason.value}: {result.stop.detail}")
        return result.output, self.counter.n - before

    async def settle(self) -> None:
        if self.otel is not None:
            await asyncio.to_thread(self.otel.flush)

    async def close(self) -> None:
        await self.provider.aclose()
        if self.store is not None:
            await self.store.close()
        if self.tmp is not None:
            self.tmp.cleanup()
        if self.otel is not None:
            await asyncio.to_thread(self.otel.close)


class _OtelExport:
    """Tracing and metrics to an OTLP/HTTP sink in its own process, as a deployment exports them: a
    batch span processor (each round flushes it, inside the round) and a periodic metric reader (its
    own 60 s interval)."""

    def __init__(self) -> None:
        import subprocess
        import sys

        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from fsm_agent.otel import OtelSettings

        here = os.path.dirname(os.path.abspath(__file__))
        self.sink = subprocess.Popen([sys.executable, os.path.join(here, "otlp_sink.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.sink.stdout is not None
        line = self.sink.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"OTLP sink did not start: {line!r}")
        self.endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint + "/v1/traces")))
        self.meter_provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=self.endpoint + "/v1/metrics"))])
        self.settings = OtelSettings(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider)

    def flush(self) -> None:
        """The round's spans, exported now (their cost grows with the calls). Metrics keep their own
        interval: an export sends each stream's aggregate once, whatever the number of calls."""
        self.tracer_provider.force_flush()

    def close(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
        if self.sink.stdin:
            self.sink.stdin.close()
        self.sink.wait(timeout=10)


# ----------------------------------------------------------------------------------- LangChain
class LangChain(Runtime):
    """LangChain v1 ``create_agent`` with ``ChatOpenAI`` and k pass-through ``AgentMiddleware``."""

    def __init__(self, base_url: str, stream: bool, k: int) -> None:
        try:
            from langchain.agents import create_agent
            from langchain.agents.middleware import AgentMiddleware
            from langchain_core.tools import tool as lc_tool
            from langchain_openai import ChatOpenAI
        except ImportError as exc:
            raise Unavailable(f"langchain / langchain-openai not importable: {exc}") from exc
        self.name, self.stream = f"langchain:{k}", stream

        class PassThrough(AgentMiddleware):  # type: ignore[misc]
            async def abefore_model(self, state: Any, runtime: Any) -> None:
                HOOK_CALLS[0] += 1

            async def awrap_model_call(self, request: Any, handler: Any) -> Any:
                HOOK_CALLS[0] += 1
                return await handler(request)

            async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
                HOOK_CALLS[0] += 1
                return await handler(request)

            async def aafter_model(self, state: Any, runtime: Any) -> None:
                HOOK_CALLS[0] += 1

        mws = [type(f"PassThrough{i}", (PassThrough,), {})() for i in range(k)]
        self.model = ChatOpenAI(model=MODEL, base_url=base_url + "/v1", api_key="x", max_retries=0, streaming=stream)
        self.agent = create_agent(self.model, tools=[lc_tool(get_weather)], system_prompt=SYSTEM, middleware=mws)

    async def run_task(self) -> tuple[str, int]:
        inp = {"messages": [{"role": "user", "content": TASK}]}
        if not self.stream:
            out = await self.agent.ainvoke(inp)
            return out["messages"][-1].text, 0
        deltas = 0
        text: list[str] = []
        async for chunk, _meta in self.agent.astream(inp, stream_mode="messages"):
            if getattr(chunk, "type", "") == "AIMessageChunk":
                deltas += 1
                text.append(chunk.text)
        return "".join(text), deltas


# --------------------------------------------------------------------------------- pydantic-ai
class PydanticAI(Runtime):
    """pydantic-ai ``Agent`` with ``OpenAIChatModel`` and k pass-through capabilities."""

    def __init__(self, base_url: str, stream: bool, k: int) -> None:
        try:
            from pydantic_ai import Agent
            from pydantic_ai.capabilities import AbstractCapability
            from pydantic_ai.models.openai import OpenAIChatModel
            from pydantic_ai.providers.openai import OpenAIProvider
        except ImportError as exc:
            raise Unavailable(f"pydantic-ai-slim[openai] not importable: {exc}") from exc
        self.name, self.stream = f"pydantic-ai:{k}", stream

        class PassThrough(AbstractCapability):  # type: ignore[misc]
            async def before_model_request(self, ctx: Any, request_context: Any) -> Any:
                HOOK_CALLS[0] += 1
                return request_context

            async def wrap_model_request(self, ctx: Any, *, request_context: Any, handler: Any) -> Any:
                HOOK_CALLS[0] += 1
                return await handler(request_context)

            async def before_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any) -> Any:
                HOOK_CALLS[0] += 1
                return args

            async def after_model_request(self, ctx: Any, *, request_context: Any, response: Any) -> Any:
                HOOK_CALLS[0] += 1
                return response

        model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url + "/v1", api_key="x"))
        self.agent = Agent(model, tools=[get_weather], instructions=SYSTEM,
                           capabilities=[PassThrough() for _ in range(k)])

    async def run_task(self) -> tuple[str, int]:
        if not self.stream:
            r = await self.agent.run(TASK)
            return r.output, 0
        deltas = 0
        out = ""
        async with self.agent.run_stream_events(TASK) as events:
            async for ev in events:
                kind = getattr(ev, "event_kind", "")
                if kind in ("part_delta", "part_start"):
                    deltas += 1
                elif kind == "agent_run_result":
                    out = ev.result.output
        return out, deltas


def make(name: str, base_url: str, stream: bool) -> Runtime:
    """Build runtime ``name`` (see the module docstring). Raises :class:`Unavailable`."""
    kind, _, arg = name.partition(":")
    if kind == "floor":
        return Floor(base_url, stream)
    if kind == "openai-sdk":
        return OpenAISDK(base_url, stream)
    if kind == "fsm":
        if arg == "otel":
            try:
                return Fsm(base_url, stream, 0, otel=True)
            except ImportError as exc:
                raise Unavailable(f"the otel extra is not installed: {exc}") from exc
        return Fsm(base_url, stream, None if arg == "default" else int(arg))
    if kind == "langchain":
        return LangChain(base_url, stream, int(arg or 0))
    if kind == "pydantic-ai":
        return PydanticAI(base_url, stream, int(arg or 0))
    raise ValueError(f"unknown runtime {name!r}")


async def _smoke(base_url: str) -> None:  # pragma: no cover - a manual check
    import sys

    for name in sys.argv[2:]:
        for stream in (False, True):
            try:
                rt = make(name, base_url, stream)
            except Unavailable as exc:
                print(name, "UNAVAILABLE", exc)
                continue
            h = HOOK_CALLS[0]
            text, deltas = await rt.run_task()
            print(name, "stream" if stream else "plain", repr(text), deltas, "hooks", HOOK_CALLS[0] - h)
            await rt.close()


if __name__ == "__main__":  # python bench/_runtimes.py BASE_URL NAME...
    import sys

    asyncio.run(_smoke(sys.argv[1]))
