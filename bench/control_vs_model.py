"""Seed 004 §10 in numbers: the same tasks under the same faults, once with only the model, once with
the runtime's control.

Seed 004 §10 asks for a single agent, three injected faults (a tool timeout, a user interrupt, an
SSE disconnect), then a Replanner and a Verifier, and a comparison of "relying only on the model"
with "runtime control" on success rate, duplicate side effects and recovery time. This script runs
that comparison, in one run, on a fixed task set (``_control_world.TASKS``: 8 support-desk tasks,
5 of them with side effects), in these modes:

* ``model only``: a bare ReAct loop, as one writes it around a model API (:func:`naive_attempt`):
  call the model (streamed), run the tools it asks for, feed the results back, until it answers
  (at most ``--max-turns`` calls). No retries, no tool timeout, no verifier, no replanner, no
  ledger, no checkpoint. The user's rules: an interrupt, a dropped stream, an attempt that passes
  the wall limit (``--wall``: how long the user waits for a hung attempt) or no answer makes the
  user start again from the task, up to ``--user-attempts`` attempts in all; an answer is taken as
  it is.
* ``runtime control``: an fsm_agent :class:`~fsm_agent.Agent` on a SQLite store, with the
  ``retry`` plugin (re-issues a dropped model call), the default plugins (``repair``,
  ``loop_detection``, ``repeat_guard``), a ``tool_policy`` (an allow-list with argument rules), the ``planact``
  plugin (a planner, programmatic node checks, a replanner when a node fails its check: the node
  checks are the verifier, built from the task's acceptance rule, which reads the transcript,
  never the world), ``RunConfig.tool_timeout`` and the tool-call ledger. An interrupt is
  ``Agent.interrupt_all``; the user then resumes (``Agent.resume``), and resumes any resumable
  stop, up to ``--user-attempts`` runs and resumes in all.
* ``runtime control, verifier only`` (``--modes ...,verifier``; on by default for the scripted
  model): the same with the ``verifier`` plugin (the task's whole acceptance rule) in place of
  PlanAct; the two cannot share a chain, as PostTurn takes the first decision.

Both modes use the same provider object type and settings (the real OpenAI-compatible HTTP
provider, streaming, its default HTTP retries) through the same fault proxy, the same tools and
the same seeded fault schedule. Each run (task x repeat) gets one combination of faults, in
turn: a tool timeout, a user interrupt, an SSE disconnect, or all three; where each lands (which
model call, after how many SSE events; which tool execution, how far into it) is drawn from a
``random.Random`` seeded by ``--seed``, task and repeat, so every mode gets the same schedule. A
fault fires once per run, at the first chance at or after its scheduled point; model faults count
only the agent's own turns (requests that offer tools), never planner, replanner or grader calls.

* **tool timeout**: the scheduled tool execution hangs (a connection that never answers) until it
  is cancelled: by ``RunConfig.tool_timeout`` (``--tool-timeout``) under control, by the user's
  wall limit in the model-only loop;
* **user interrupt**: during a model stream (the proxy holds the stream after N events and
  interrupts) or during a tool execution (at a fraction of its run time; a side effect commits
  half-way, so a late interrupt leaves an effect whose answer never came back);
* **SSE disconnect**: the proxy forwards N events of a model stream, then aborts the TCP
  connection (a real dropped connection: the client sees an incomplete chunked body).

Two providers: the **scripted** model (``fsm_agent.testing.strict.StrictServer`` with the
deterministic policy ``_control_world.scripted_reply``, which refuses any request that breaks the
Chat Completions wire rules) and the **local** model (the real llama.cpp server with SmolLM2-135M,
started by ``fsm_agent.local.LocalLlamaServer``; fewer repeats; ``--no-local`` skips it).

Metrics per mode: success rate (the judge reads the world: the answer states the facts and every
intended side effect happened exactly once with the intended arguments, nothing else happened);
duplicate side effects (executions of a side effect beyond the first for the same key: ticket
title, e-mail recipient and subject, refunded order); recovery time (wall seconds from the run's
first fault to its correct finish; median and p90 over the runs that finished correctly); model
calls (requests that reached the model server, dropped ones included) and tokens (as reported by
the server for the calls that completed).

    python bench/control_vs_model.py                     # scripted x5 repeats, local x1, writes docs/ (≈ 12 min)
    python bench/control_vs_model.py --quick             # scripted x1, local on 2 tasks; docs/ left alone
    python bench/control_vs_model.py --repeats 10 --no-local --no-docs
    python bench/control_vs_model.py --docs-from bench/results/control_vs_model-latest.json

The exact rules and the last full run's numbers: ``docs/control_vs_model.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import orjson  # noqa: E402
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web  # noqa: E402
from attrs import define, field, frozen  # noqa: E402

from _common import REPO, machine, median, pct, say, table, write_results  # noqa: E402
from _control_world import (  # noqa: E402
    EFFECT_LATENCY,
    EFFECT_TOOLS,
    PURE_LATENCY,
    SYSTEM_PROMPT,
    TASKS,
    Task,
    World,
    grounded_problems,
    node_checks,
    scripted_reply,
)
from fsm_agent import (  # noqa: E402
    Agent,
    MessageRequest,
    RunConfig,
    SQLiteStore,
    StopReason,
    SystemMessage,
    Tool,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
    create_provider,
    default_middleware,
)
from fsm_agent.errors import FsmAgentError, ProviderError, ResumeError  # noqa: E402
from fsm_agent.providers import Provider, ProviderConfig  # noqa: E402
from fsm_agent.providers.constrained import SCHEMA_NAME  # noqa: E402
from fsm_agent.testing._loopback import serve_on_loopback  # noqa: E402
from fsm_agent.testing.strict import StrictServer  # noqa: E402
from fsm_agent.tools.execution import result_blocks  # noqa: E402
from fsm_agent.types import Message, MessageComplete  # noqa: E402
from fsm_agent_middleware.retry import RetryFallback  # noqa: E402
from fsm_agent_middleware.tool_policy import ToolPolicy  # noqa: E402
from fsm_agent_middleware.verifier import Verdict, Verifier  # noqa: E402

MODES = ("model only", "runtime control", "runtime control, verifier only")
"""Every mode, in table order; ``--modes`` picks which run (default: the first two)."""
MODE_NAMES = dict(zip(("model", "control", "verifier"), MODES))
FAULTS = ("tool_timeout", "interrupt", "sse_drop")
COMBOS: tuple[tuple[str, ...], ...] = (("tool_timeout",), ("interrupt",), ("sse_drop",), FAULTS)
"""Run ``k`` of a task gets ``COMBOS[(task index + k) % 4]``: every task meets every combination."""
HOLD = 3.0
"""Seconds the proxy holds a stream it interrupts (the interrupt lands well inside it)."""

POLICY = {
    "default": "deny",
    "rule": [
        {"tool": ["lookup_order", "get_rate", "get_price", "calculate", "search_kb", "find_*"], "action": "allow"},
        {"tool": "create_ticket", "action": "allow", "when": [{"arg": "priority", "in": ["low", "normal", "high"]}]},
        {"tool": "send_email", "action": "allow", "when": [{"arg": "to", "ends_with": "@example.com"}]},
        {"tool": "issue_refund", "action": "allow", "when": [{"arg": "amount", "gt": 0, "le": 500}]},
    ],
}
"""The desk's tool policy: reads are free; a ticket needs a known priority, an e-mail goes to
customers only, a refund is at most 500 USD; anything else is denied."""


# -- the fault schedule ------------------------------------------------------------------------------------
@frozen
class FaultPlan:
    """Where one run's faults land (indices are 1-based over the run: model requests, tool executions)."""

    combo: tuple[str, ...]
    drop: tuple[int, int] | None = None
    """(model request, SSE events forwarded before the connection is aborted)."""
    interrupt_stream: tuple[int, int] | None = None
    """(model request, SSE events forwarded before the user interrupts)."""
    interrupt_tool: tuple[int, float] | None = None
    """(tool execution, fraction of its run time at which the user interrupts)."""
    hang: int | None = None
    """The tool execution that hangs."""


def draw_plan(task_index: int, repeat: int, seed: int, model_calls: int, tool_calls: int,
              combo: tuple[str, ...] | None = None) -> FaultPlan:
    """The seeded fault schedule of one run; the same for both modes."""
    rng = random.Random(zlib.crc32(f"{seed}:{task_index}:{repeat}".encode()))
    combo = combo if combo is not None else COMBOS[(task_index + repeat) % len(COMBOS)]
    drop = istream = itool = hang = None
    if "sse_drop" in combo:
        drop = (rng.randint(1, model_calls), rng.randint(2, 5))
    if "tool_timeout" in combo:
        hang = rng.randint(1, tool_calls)
    if "interrupt" in combo:
        if rng.random() < 0.5:
            istream = (rng.randint(1, model_calls), rng.randint(2, 5))
        else:
            choices = [i for i in range(1, tool_calls + 1) if i != hang] or [tool_calls + 1]
            itool = (rng.choice(choices), rng.uniform(0.15, 0.85))
    return FaultPlan(combo, drop, istream, itool, hang)


@define
class Injector:
    """Fires one run's faults, each once, and records when."""

    plan: FaultPlan
    interrupt_cb: Callable[[], Any] = lambda: None
    fired: dict[str, float] = field(factory=dict)
    """Fault kind → ``time.monotonic()`` when it fired."""

    def model_fault(self, request: int) -> tuple[str, int] | None:
        """The fault to apply to model request ``request``: ``("sse_drop" | "interrupt", after N events)``."""
        p = self.plan
        if p.drop is not None and "sse_drop" not in self.fired and request >= p.drop[0]:
            return "sse_drop", p.drop[1]
        if p.interrupt_stream is not None and "interrupt" not in self.fired and request >= p.interrupt_stream[0]:
            return "interrupt", p.interrupt_stream[1]
        return None

    def tool_fault(self, execution: int, tool: str) -> Any:
        """``"hang"``, a delay in seconds before the user interrupts, or ``None``."""
        p = self.plan
        if p.hang is not None and "tool_timeout" not in self.fired and execution >= p.hang:
            self.fired["tool_timeout"] = time.monotonic()
            return "hang"
        if p.interrupt_tool is not None and "interrupt" not in self.fired and execution >= p.interrupt_tool[0]:
            latency = EFFECT_LATENCY if tool in EFFECT_TOOLS else PURE_LATENCY
            self.fired["interrupt"] = float("nan")  # armed: the World calls interrupt() after the delay
            return p.interrupt_tool[1] * latency
        return None

    def fire(self, kind: str) -> None:
        self.fired[kind] = time.monotonic()
        if kind == "interrupt":
            self.interrupt_cb()

    def interrupt_now(self) -> None:
        self.fire("interrupt")

    @property
    def first(self) -> float | None:
        times = [t for t in self.fired.values() if t == t]
        return min(times) if times else None


# -- the fault proxy -----------------------------------------------------------------------------------------
@define
class Tap:
    """One run's traffic through the proxy."""

    injector: Injector | None
    requests: int = 0
    """Every request (planner, replanner and grader calls included)."""
    turns: int = 0
    """Requests of the agent's loop: what the fault schedule counts."""
    completed: int = 0
    tokens: int = 0
    dropped: int = 0


class FaultProxy:
    """An HTTP proxy in front of the model server (scripted or llama.cpp): each run talks to
    ``/r/<run>/v1``; the proxy counts the run's requests and tokens and applies its model faults
    (an aborted connection, an interrupt while it holds the stream)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.taps: dict[str, Tap] = {}
        self.base = ""
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/r/{run}/v1/chat/completions", self._handle)
        self._runner, self.base = await serve_on_loopback(app)
        # a fresh upstream connection per request: a pooled connection the server has closed would
        # fail a request that no fault was scheduled for
        self._session = ClientSession(timeout=ClientTimeout(total=None, sock_read=900),
                                      connector=TCPConnector(force_close=True))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def url(self, run: str, injector: Injector | None) -> str:
        self.taps[run] = Tap(injector)
        return f"{self.base}/r/{run}/v1"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        tap = self.taps[request.match_info["run"]]
        body = await request.read()
        tap.requests += 1
        fault = None
        if _is_turn(body):  # faults land on the agent's own turns, which both modes make
            tap.turns += 1
            fault = tap.injector.model_fault(tap.turns) if tap.injector is not None else None
        assert self._session is not None
        async with self._session.post(self.upstream + "/v1/chat/completions", data=body,
                                      headers={"Content-Type": "application/json"}) as up:
            ctype = up.headers.get("Content-Type", "")
            if "event-stream" not in ctype:
                data = await up.read()
                tap.tokens += _usage(data)
                tap.completed += up.status == 200
                return web.Response(body=data, status=up.status, content_type=ctype.split(";")[0] or None)
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            buf, events = b"", 0
            try:
                async for chunk in up.content.iter_any():
                    buf += chunk
                    while (cut := buf.find(b"\n\n")) >= 0:
                        event, buf = buf[:cut + 2], buf[cut + 2:]
                        await resp.write(event)
                        events += 1
                        if b'"usage"' in event:
                            tap.tokens += _usage(event[event.find(b"{"):])
                        if fault is not None and events == fault[1]:
                            assert tap.injector is not None
                            if fault[0] == "sse_drop":
                                tap.injector.fire("sse_drop")
                                tap.dropped += 1
                                await asyncio.sleep(0.01)  # the events written so far reach the client
                                if request.transport is not None:
                                    request.transport.abort()
                                return resp
                            tap.injector.fire("interrupt")
                            await asyncio.sleep(HOLD)
                if buf:
                    await resp.write(buf)
                await resp.write_eof()
                tap.completed += 1
            except (ConnectionError, RuntimeError):  # the client went away (an interrupt, a cancel)
                pass
            return resp


def _is_turn(body: bytes) -> bool:
    """A request of the agent's loop (it offers tools: natively, or as the constrained tool schema),
    not a planner, replanner or grader call."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(data, dict):
        return False
    fmt = data.get("response_format") or {}
    name = (fmt.get("json_schema") or {}).get("name") if isinstance(fmt, dict) else None
    return bool(data.get("tools")) or name == SCHEMA_NAME


def _usage(blob: bytes) -> int:
    try:
        data = orjson.loads(blob.strip())
    except orjson.JSONDecodeError:
        return 0
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return 0
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)


# -- the two modes -------------------------------------------------------------------------------------------
@frozen
class Settings:
    provider: str
    """``scripted`` or ``local``."""
    wall: float
    tool_timeout: float
    user_attempts: int
    max_turns: int
    max_output_tokens: int | None
    temperature: float | None
    run_limit: float
    """Seconds after which the harness gives up on a run (a bug, not a measurement)."""


async def naive_attempt(provider: Provider, tools: dict[str, Tool], prompt: str, s: Settings) -> str | None:
    """One attempt of the model-only loop: the answer, or ``None`` when ``max_turns`` calls gave none.
    Raises what the provider raises; a tool's exception becomes an error result for the model."""
    messages: list[Message] = [SystemMessage(SYSTEM_PROMPT), UserMessage(prompt)]
    defs = tuple(t.definition for t in tools.values())
    for _ in range(s.max_turns):
        request = MessageRequest(model=provider.model or "", messages=tuple(messages), tools=defs,
                                 max_tokens=s.max_output_tokens, temperature=s.temperature)
        response = None
        async for event in provider.chat_stream(request):
            if isinstance(event, MessageComplete):
                response = event.full_response
        assert response is not None
        messages.append(response.message)
        if not response.tool_calls:
            return response.text
        messages.extend(await asyncio.gather(*(_call_tool(tools, c) for c in response.tool_calls)))
    return None


async def _call_tool(tools: dict[str, Tool], call: ToolUseBlock) -> ToolResultMessage:
    tool = tools.get(call.name)
    if tool is None:
        return ToolResultMessage(call.id, f"unknown tool {call.name!r}", is_error=True, name=call.name)
    try:
        value = await tool.fn(**call.input)
    except Exception as exc:  # noqa: BLE001 - the model reads the failure
        return ToolResultMessage(call.id, f"{type(exc).__name__}: {exc}", is_error=True, name=call.name)
    return ToolResultMessage(call.id, result_blocks(value), name=call.name)


async def model_only(task: Task, provider: Provider, world: World, inj: Injector, s: Settings) -> dict[str, Any]:
    tools = {t.name: t for t in world.tools(task.tool_names)}
    answer: str | None = None
    failures: list[str] = []
    attempts = 0
    while attempts < s.user_attempts:
        attempts += 1
        attempt = asyncio.ensure_future(naive_attempt(provider, tools, task.prompt, s))
        inj.interrupt_cb = attempt.cancel
        done, _ = await asyncio.wait({attempt}, timeout=s.wall)
        if not done:
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
            failures.append("wall limit")
            continue
        if attempt.cancelled():
            failures.append("interrupted")
            continue
        exc = attempt.exception()
        if exc is not None:
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
            continue
        answer = attempt.result()
        if answer is None:
            failures.append("no answer within max_turns")
            continue
        break
    inj.interrupt_cb = lambda: None
    return {"answer": answer, "attempts": attempts, "failures": failures, "stop": "answered" if answer else "gave up",
            "actions": {"restarts from scratch": attempts - 1}}


def _tool_results(ctx: Any) -> list[tuple[str, str, bool]]:
    return [(m.name or "", m.text, m.is_error) for m in ctx.transcript if isinstance(m, ToolResultMessage)]


def _verdict(problems: list[str]) -> Verdict:
    return Verdict(not problems, "; ".join(problems) + ("; call the tool again and answer with what it returns"
                                                        if problems else ""))


def acceptance(task: Task) -> Callable[[Any], Verdict]:
    """The verifier's check: the answer quotes values from this run's successful tool results."""

    def check(ctx: Any) -> Verdict:
        answer = ctx.last_response.text if ctx.last_response is not None else ""
        return _verdict(grounded_problems(task.grounded, _tool_results(ctx), answer))

    return check


def plan_checks(task: Task) -> tuple[dict[str, Callable[[Any, Any], Verdict | None]], Callable[[Any, Any], Any]]:
    """PlanAct's checks for ``task``: (named node checks, the check of nodes that name none)."""
    named: dict[str, Callable[[Any, Any], Verdict | None]] = {}
    for name, reqs in node_checks(task).items():
        def check(ctx: Any, node: Any, reqs: Any = reqs) -> Verdict:
            answer = ctx.last_response.text if ctx.last_response is not None else ""
            return _verdict(grounded_problems(reqs, _tool_results(ctx), answer))

        check.__doc__ = "the step's answer quotes " + " and ".join(
            f"the {field} from a successful {' or '.join(tools)} result" for tools, field in reqs)
        named[name] = check

    def last_node(ctx: Any, node: Any) -> Verdict | None:
        """The last open node: the whole task's acceptance rule; any other node: no opinion."""
        plan = ctx.plan
        if plan is not None and any(n.status.open and n.id != node.id for n in plan.nodes):
            return None
        return acceptance(task)(ctx)

    return named, last_node


CONTROLS = {
    "runtime control": "PlanAct (planner, programmatic node checks, replanner) + retry, policy, tool timeout, ledger",
    "runtime control, verifier only": "Verifier (the task's acceptance rule) + retry, policy, tool timeout, ledger",
}


def control_middleware(task: Task, mode: str) -> list[Any]:
    """The runtime's control for ``mode``, outermost first. Without the planact plugin installed,
    ``runtime control`` falls back to the verifier-only stack (said in the results' settings)."""
    stack: list[Any] = [RetryFallback(initial_delay=0.2, max_delay=2.0), *default_middleware(),
                        ToolPolicy.from_dict(POLICY, source="bench policy")]
    planact = _planact_class() if mode == "runtime control" else None
    if planact is not None:
        checks, general = plan_checks(task)
        # the node checks are the verifier here: the Verifier plugin would decide every answer turn
        # first (post_turn: the first decision wins), so it cannot sit beside PlanAct
        stack.append(planact(checks=checks, check=general, grade=False, max_replans=3, on_exhausted="human"))
    else:
        stack.append(Verifier(acceptance(task), max_rejections=2, on_exhausted="human"))
    return stack


def _planact_class() -> Any:
    try:
        from fsm_agent_middleware.planact import PlanAct
    except ImportError:  # the plugin is not installed in this tree
        return None
    return PlanAct


async def runtime_control(mode: str, task: Task, provider: Provider, world: World, inj: Injector, s: Settings,
                          store: SQLiteStore, sid: str) -> dict[str, Any]:
    agent = Agent(provider, tools=world.tools(task.tool_names), system_prompt=SYSTEM_PROMPT, middleware=control_middleware(task, mode),
                  store=store, control_poll=0.05,
                  config=RunConfig(max_iterations=s.max_turns, tool_timeout=s.tool_timeout,
                                   max_output_tokens=s.max_output_tokens, temperature=s.temperature))
    inj.interrupt_cb = lambda: agent.interrupt_all("the user interrupted")
    result = await agent.run(task.prompt, session_id=sid)
    stops = [result.stop.reason.value]
    attempts = 1
    while (result.stop.reason is not StopReason.COMPLETED and result.stop.resumable
           and attempts < s.user_attempts):
        attempts += 1
        # a budget stop gets another attempt's worth of model calls, as the model-only user's restart does
        more: dict[str, Any] = ({"max_iterations": s.max_turns * attempts}
                                if result.stop.reason is StopReason.PAUSED_BUDGET else {})
        try:
            result = await agent.resume(sid, **more)
        except ResumeError as exc:
            stops.append(f"resume refused: {exc}")
            break
        stops.append(result.stop.reason.value)
    inj.interrupt_cb = lambda: None
    actions: dict[str, int] = {}
    counts: dict[str, int] = {}
    for e in await store.read_events(sid):
        counts[e.type] = counts.get(e.type, 0) + 1
        if e.type == "plan_updated":
            reason = str(e.payload.get("reason", ""))
            for name, hit in (("plan node checks failed", " failed its check: " in reason and reason.startswith("node")),
                              ("replans", reason.startswith("replanned")), ("plans made", reason.startswith("planned"))):
                if hit:
                    actions[name] = actions.get(name, 0) + 1
        msg = e.payload.get("message") if e.type == "message" else None
        if not isinstance(msg, dict):
            continue
        meta = msg.get("metadata") or {}
        text = "".join(b.get("text", "") for b in msg.get("content") or () if isinstance(b, dict))
        for name, hit in (("verifier rejections", msg.get("role") == "user" and "did not pass verification" in text),
                          ("tool timeouts", meta.get("error") == "timeout"),
                          ("outcome unknown results", meta.get("synthetic") == "interrupted"),
                          (f"calls denied by {meta.get('denied_by')}", bool(meta.get("denied_by"))),
                          (f"calls answered by {meta.get('responded_by')}", bool(meta.get("responded_by")))):
            if hit:
                actions[name] = actions.get(name, 0) + 1
    actions["model retries"] = counts.get("model_retry", 0)
    actions["resumes"] = counts.get("resume", 0)
    answer = result.output if result.stop.reason is StopReason.COMPLETED else None
    return {"answer": answer, "attempts": attempts, "stops": stops, "stop": result.stop.reason.value,
            "detail": result.stop.detail[:300], "events": counts, "actions": actions}


# -- one run ------------------------------------------------------------------------------------------------
async def one_run(mode: str, task: Task, plan: FaultPlan | None, s: Settings, proxy: FaultProxy, work: Path,
                  run_id: str, model: str) -> dict[str, Any]:
    inj = Injector(plan) if plan is not None else None
    world = World()
    if inj is not None:
        world.on_tool_start = inj.tool_fault
        world.interrupt = inj.interrupt_now
    kind = "llamacpp" if s.provider == "local" else "openai-compatible"
    provider = create_provider(kind, ProviderConfig(base_url=proxy.url(run_id, inj), model=model, api_key="bench"))
    started = time.monotonic()
    record: dict[str, Any] = {"mode": mode, "task": task.name, "run": run_id,
                              "plan": None if plan is None else orjson.loads(orjson.dumps(plan, default=_plain))}
    try:
        async with asyncio.timeout(s.run_limit):
            if mode == "model only":
                out = await model_only(task, provider, world, inj or Injector(FaultPlan(())), s)
            else:
                store = SQLiteStore(str(work / f"{run_id}.db"))
                try:
                    out = await runtime_control(mode, task, provider, world, inj or Injector(FaultPlan(())), s, store, run_id)
                finally:
                    await store.close()
    except TimeoutError:
        out = {"answer": None, "attempts": None, "stop": "harness limit", "error": f"run passed {s.run_limit:g} s"}
    except FsmAgentError as exc:
        out = {"answer": None, "attempts": None, "stop": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        await provider.aclose()
    ended = time.monotonic()
    verdict = task.outcome(world, out.get("answer"))
    tap = proxy.taps.pop(run_id)
    first = inj.first if inj is not None else None
    record.update(out)
    record.update({
        "correct": verdict["correct"], "outcome": verdict, "duplicates": verdict["duplicates"],
        "wall_s": round(ended - started, 3),
        "faults": sorted(k for k, t in (inj.fired.items() if inj else ()) if t == t),
        "recovery_s": round(ended - first, 3) if first is not None and verdict["correct"] else None,
        "model_calls": tap.requests, "completed_calls": tap.completed, "tokens": tap.tokens,
        "executions": len(world.executions),
        "side_effects": sum(world.effects().values()),
    })
    return record


def _plain(obj: Any) -> Any:
    import attrs

    if attrs.has(type(obj)):
        return attrs.asdict(obj)
    raise TypeError


# -- the whole bench -------------------------------------------------------------------------------------------
async def bench(provider_kind: str, tasks: Sequence[Task], repeats: int, s: Settings, seed: int, upstream: str,
                model: str, work: Path, concurrency: int, modes: Sequence[str], clean: bool = True,
                progress: Callable[[str], None] = say) -> list[dict[str, Any]]:
    """Every task x repeat under faults, plus (``clean``) one fault-free run per task, in both modes."""
    proxy = FaultProxy(upstream)
    await proxy.start()
    jobs: list[tuple[str, Task, FaultPlan | None, str]] = []
    for ti, task in enumerate(tasks):
        calls, execs = (task.model_calls, task.tool_calls) if provider_kind == "scripted" else (2, 1)
        if clean:
            for mode in modes:
                jobs.append((mode, task, None, f"{provider_kind[0]}-clean-{task.name}-{MODES.index(mode)}"))
        for r in range(repeats):
            plan = draw_plan(ti, r, seed, calls, execs)
            for mode in modes:
                jobs.append((mode, task, plan, f"{provider_kind[0]}-{task.name}-{r}-{MODES.index(mode)}"))
    records: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def go(job: tuple[str, Task, FaultPlan | None, str]) -> None:
        nonlocal done
        async with sem:
            rec = await one_run(job[0], job[1], job[2], s, proxy, work, job[3], model)
        rec["provider"] = provider_kind
        records.append(rec)
        done += 1
        if done % 10 == 0 or done == len(jobs):
            progress(f"  {provider_kind}: {done}/{len(jobs)} runs")

    try:
        await asyncio.gather(*(go(j) for j in jobs))
    finally:
        await proxy.close()
    records.sort(key=lambda r: r["run"])
    return records


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (provider, mode, fault set): the metrics of the brief."""
    rows = []
    keys: list[tuple[str, str, str]] = []
    for r in records:
        k = (r["provider"], r["mode"], _label(r))
        if k not in keys:
            keys.append(k)
    keys.sort(key=lambda k: (k[0] != "scripted", _ORDER.index(k[2]) if k[2] in _ORDER else 99, MODES.index(k[1])))
    for prov, mode, label in keys:
        rs = [r for r in records if r["provider"] == prov and r["mode"] == mode and _label(r) == label]
        rows.append(_row(prov, mode, label, rs))
    for prov in dict.fromkeys(r["provider"] for r in records):
        for mode in [m for m in MODES if any(r["mode"] == m for r in records)]:
            rs = [r for r in records if r["provider"] == prov and r["mode"] == mode and r["plan"] is not None]
            if rs:
                rows.append(_row(prov, mode, "all faulted runs", rs))
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    return sorted(rows, key=lambda r: provs.index(r["provider"]))  # stable: each provider's rows together


_ORDER = ["no faults", "tool_timeout", "interrupt", "sse_drop", "tool_timeout+interrupt+sse_drop", "all faulted runs"]


def _label(r: dict[str, Any]) -> str:
    return "no faults" if r["plan"] is None else "+".join(r["plan"]["combo"])


def _row(prov: str, mode: str, label: str, rs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    rec = [r["recovery_s"] for r in rs if r["recovery_s"] is not None]
    faulted = [r for r in rs if r["faults"]]
    return {"provider": prov, "mode": mode, "faults": label, "runs": len(rs),
            "faults_fired": sum(len(r["faults"]) for r in rs),
            "runs_with_a_fault": len(faulted),
            "success": sum(r["correct"] for r in rs), "success_rate": sum(r["correct"] for r in rs) / len(rs),
            "duplicates": sum(r["duplicates"] for r in rs),
            "runs_with_duplicates": sum(1 for r in rs if r["duplicates"]),
            "recovery_median_s": median(rec) if rec else None, "recovery_p90_s": pct(rec, 90) if rec else None,
            "recovered": len(rec),
            "wall_median_s": median([r["wall_s"] for r in rs]),
            "model_calls": sum(r["model_calls"] for r in rs), "tokens": sum(r["tokens"] for r in rs),
            "attempts": sum(r["attempts"] or 0 for r in rs)}


def action_rows(records: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """What each mode did about the faults, summed per provider: (provider, mode, action, count)."""
    out: list[list[Any]] = []
    for prov in dict.fromkeys(r["provider"] for r in records):
        for mode in [m for m in MODES if any(r["mode"] == m for r in records)]:
            total: dict[str, int] = {}
            for r in records:
                if r["provider"] == prov and r["mode"] == mode and r["plan"] is not None:
                    for k, v in (r.get("actions") or {}).items():
                        total[k] = total.get(k, 0) + v
            out += [[prov, mode, k, v] for k, v in sorted(total.items())]
    return out


HEADERS = ["provider", "faults", "mode", "runs", "faults fired", "success", "duplicate side effects",
           "recovery median s", "recovery p90 s", "model calls", "tokens"]


def row_cells(r: dict[str, Any]) -> list[Any]:
    return [r["provider"], r["faults"], r["mode"], r["runs"], r["faults_fired"],
            f"{r['success']}/{r['runs']} ({100 * r['success_rate']:.0f} %)", r["duplicates"],
            r["recovery_median_s"], r["recovery_p90_s"], r["model_calls"], r["tokens"]]


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Three panels (success rate, duplicate side effects, recovery median and p90), per fault set and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    provs = list(dict.fromkeys(r["provider"] for r in rows))
    fig, axes = plt.subplots(len(provs), 3, figsize=(15, 4.2 * len(provs)), squeeze=False)
    colors = {"model only": "#b91c1c", "runtime control": "#15803d", "runtime control, verifier only": "#65a30d"}
    for pi, prov in enumerate(provs):
        pr = [r for r in rows if r["provider"] == prov]
        labels = list(dict.fromkeys(r["faults"] for r in pr))
        x = range(len(labels))
        modes = [m for m in MODES if any(r["mode"] == m for r in pr)]
        width = 0.8 / len(modes)
        for mi, mode in enumerate(modes):
            by = {r["faults"]: r for r in pr if r["mode"] == mode}
            off = [i + (mi - (len(modes) - 1) / 2) * width for i in x]
            axes[pi][0].bar(off, [100 * by[lb]["success_rate"] if lb in by else 0 for lb in labels], width,
                            color=colors[mode], label=mode)
            for o, lb in zip(off, labels):
                if lb in by:
                    axes[pi][0].annotate(f"{by[lb]['success']}/{by[lb]['runs']}", (o, 100 * by[lb]["success_rate"]),
                                         ha="center", va="bottom", fontsize=5.5)
                    axes[pi][1].annotate(str(by[lb]["duplicates"]), (o, by[lb]["duplicates"]), ha="center",
                                         va="bottom", fontsize=6)
            axes[pi][1].bar(off, [by[lb]["duplicates"] if lb in by else 0 for lb in labels], width, color=colors[mode])
            have = [(o, by[lb]["recovery_median_s"], by[lb]["recovery_p90_s"]) for o, lb in zip(off, labels)
                    if lb in by and by[lb]["recovery_median_s"] is not None]
            if have:
                axes[pi][2].bar([h[0] for h in have], [h[1] for h in have], width, color=colors[mode])
                axes[pi][2].errorbar([h[0] for h in have], [h[1] for h in have],
                                     yerr=[[0] * len(have), [max(0.0, h[2] - h[1]) for h in have]],
                                     fmt="none", ecolor="#333", capsize=3)
        if not any(r["recovery_median_s"] is not None for r in pr):
            axes[pi][2].text(0.5, 0.5, "no run finished correctly", transform=axes[pi][2].transAxes,
                             ha="center", va="center", fontsize=10, color="#555")
        for ai, title in enumerate(("success rate (%)", "duplicate side effects (count)",
                                    "recovery time, median (bar) to p90 (s)")):
            ax = axes[pi][ai]
            ax.set_title(f"{prov}: {title}", fontsize=10)
            ax.set_xticks(list(x))
            ax.set_xticklabels([lb.replace("tool_timeout+interrupt+sse_drop", "all three").replace(" ", "\n", 1)
                                for lb in labels], fontsize=7, rotation=20)
            ax.grid(axis="y", alpha=0.3)
        axes[pi][0].set_ylim(0, 112)
    handles: dict[str, Any] = {}
    for ax in axes[:, 0]:
        for h, lb in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lb, h)
    fig.suptitle("Seed 004 §10: relying only on the model vs runtime control, under injected faults", fontsize=12)
    fig.legend(list(handles.values()), list(handles), loc="upper center", ncol=len(handles), fontsize=9,
               bbox_to_anchor=(0.5, 0.965), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fsm-cvm-"))
    records: list[dict[str, Any]] = []
    settings: dict[str, Any] = {"modes": {m: CONTROLS.get(m, "a bare ReAct loop (naive_attempt)")
                                          for m in dict.fromkeys([*args.modes, *args.local_modes])},
                                "planact": _planact_class() is not None}
    if not settings["planact"]:
        say("the planact plugin is not installed: 'runtime control' uses the verifier-only stack")
    try:
        if not args.no_scripted:
            s = Settings("scripted", wall=args.wall, tool_timeout=args.tool_timeout, user_attempts=args.user_attempts,
                         max_turns=args.max_turns, max_output_tokens=None, temperature=None, run_limit=120.0)
            settings["scripted"] = orjson.loads(orjson.dumps(s, default=_plain))
            server = StrictServer(scripted_reply)
            await server.start()
            try:
                say(f"scripted: {len(TASKS)} tasks x {args.repeats} repeats x {len(args.modes)} modes "
                    "(+ a fault-free run each)")
                records += await bench("scripted", TASKS, args.repeats, s, args.seed, server.base_url, "scripted",
                                       work, args.concurrency, args.modes)
            finally:
                await server.close()
            if server.rejected:
                say(f"  the strict server refused {len(server.rejected)} request(s): {server.rejected[:3]}")
            settings["scripted_rejected"] = len(server.rejected)
        if not args.no_local:
            records += await run_local(args, work, settings)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = summarize(records)
    say(table(HEADERS, [row_cells(r) for r in rows],
              title=f"Control vs model ({time.monotonic() - started:.0f} s)"))
    actions = action_rows(records)
    say(table(["provider", "mode", "what happened (faulted runs)", "count"], actions))
    data = {"machine": machine(), "args": vars(args), "argv": sys.argv[1:], "settings": settings, "rows": rows, "actions": actions, "runs": records,
            "elapsed_s": round(time.monotonic() - started, 1)}
    path = write_results("control_vs_model", data)
    say(f"\nresults: {path}")
    if not args.no_docs:
        write_docs(data)
    return data


async def run_local(args: argparse.Namespace, work: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    from fsm_agent.local import LocalLlamaServer

    tasks = [t for t in TASKS if t.name in LOCAL_TASKS][: 2 if args.quick else None]
    s = Settings("local", wall=args.local_wall, tool_timeout=args.tool_timeout, user_attempts=args.local_user_attempts,
                 max_turns=args.local_max_turns, max_output_tokens=160, temperature=0.0, run_limit=600.0)
    settings["local"] = orjson.loads(orjson.dumps(s, default=_plain))
    say(f"local: starting llama.cpp (SmolLM2-135M); {len(tasks)} tasks x {args.local_repeats} repeats x "
        f"{len(args.local_modes)} modes")
    server = LocalLlamaServer(ctx_size=8192)
    await asyncio.to_thread(server.start)
    try:
        settings["local_model"] = Path(server.model_path).name
        return await bench("local", tasks, args.local_repeats, s, args.seed, server.root_url, "local", work, 1,
                           args.local_modes, clean=not args.quick)
    finally:
        await asyncio.to_thread(server.stop)


LOCAL_TASKS = ("order_status", "open_ticket", "refund", "delay_email")
"""The local model's tasks: one or two tool steps each."""


def write_docs(data: dict[str, Any]) -> None:
    """Write ``docs/control_vs_model.png`` and the results block of ``docs/control_vs_model.md`` (the
    text between its ``results`` markers; the rest of the page is kept) from one run's data."""
    docs = REPO / "docs"
    rows = data["rows"]
    plot(rows, docs / "control_vs_model.png")
    say(f"wrote {docs / 'control_vs_model.png'}")
    md = docs / "control_vs_model.md"
    m, args = data["machine"], data["args"]
    command = " ".join(data.get("argv") or []) or "(defaults)"
    stamp = (f"Run of {m['date'][:10]} ({data['elapsed_s'] / 60:.1f} min, load average {m['loadavg_at_start']} at "
             f"the start, {m['cpus']} cores, commit {(m['source'].get('commit') or '?')[:8]}): "
             f"`python bench/control_vs_model.py {command}`. Seed {args['seed']}; scripted: {args['repeats']} "
             f"faulted runs per task and mode, wall limit {args['wall']:g} s, tool timeout {args['tool_timeout']:g} s, "
             f"{args['user_attempts']} user attempts; local: {args['local_repeats']} faulted run(s) per task and "
             f"mode, wall limit {args['local_wall']:g} s, {args['local_user_attempts']} user attempts.")
    acts = data.get("actions") or []
    block = "\n".join([
        MARK_START, stamp, "", table(HEADERS, [row_cells(r) for r in rows]), "",
        "What each mode did about the faults (all faulted runs):", "",
        table(["provider", "mode", "what happened", "count"], acts), "",
        "![success rate, duplicate side effects and recovery time per fault set and mode](control_vs_model.png)",
        MARK_END])
    text = md.read_text() if md.exists() else f"# Control vs model (seed 004 §10)\n\n{MARK_START}\n{MARK_END}\n"
    if MARK_START not in text or MARK_END not in text:
        text += f"\n{MARK_START}\n{MARK_END}\n"
    pre, rest = text.split(MARK_START, 1)
    md.write_text(pre + block + rest.split(MARK_END, 1)[1])
    say(f"wrote {md}")


MARK_START, MARK_END = "<!-- results:start -->", "<!-- results:end -->"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="faulted runs per task on the scripted model (default 5; --quick 1)")
    p.add_argument("--local-repeats", type=int, default=None, help="faulted runs per task on the local model (default 1)")
    p.add_argument("--no-local", action="store_true", help="skip the local llama.cpp model")
    p.add_argument("--no-scripted", action="store_true", help="skip the scripted model")
    p.add_argument("--quick", action="store_true",
                   help="scripted x1, local on 2 tasks with no fault-free runs; docs/ is left alone")
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--wall", type=float, default=10.0, help="model only: seconds the user waits for an attempt (scripted)")
    p.add_argument("--local-wall", type=float, default=60.0, help="model only: the same on the local model")
    p.add_argument("--tool-timeout", type=float, default=2.0, help="runtime control: RunConfig.tool_timeout (s)")
    p.add_argument("--user-attempts", type=int, default=5, help="attempts (model only) or runs + resumes (control)")
    p.add_argument("--max-turns", type=int, default=12, help="model calls per attempt / per session (scripted)")
    p.add_argument("--local-max-turns", type=int, default=4, help="the same on the local model")
    p.add_argument("--local-user-attempts", type=int, default=3, help="--user-attempts on the local model")
    p.add_argument("--concurrency", type=int, default=4, help="scripted runs in flight at once")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/control_vs_model.{md,png}")
    p.add_argument("--docs-from", metavar="JSON", help="rewrite the docs from a results file, without running")
    p.add_argument("--modes", default="model,control,verifier",
                   help="comma-separated modes on the scripted model: model (model only), control (runtime "
                        "control, with PlanAct), verifier (runtime control with the Verifier and no plan); "
                        "default all three")
    p.add_argument("--local-modes", default="model,control", help="the same on the local model (default model,control)")
    args = p.parse_args(argv)
    for option in ("modes", "local_modes"):
        names = [m.strip() for m in getattr(args, option).split(",") if m.strip()]
        unknown = [m for m in names if m not in MODE_NAMES]
        if unknown or not names:
            p.error(f"--{option.replace('_', '-')}: unknown mode(s) {unknown}; choose from {', '.join(MODE_NAMES)}")
        setattr(args, option, [MODE_NAMES[m] for m in names])
    if args.quick:
        args.no_docs = True  # docs/ shows a default-size run
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.local_repeats is None:
        args.local_repeats = 1
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.docs_from:
        write_docs(orjson.loads(Path(arguments.docs_from).read_bytes()))
    else:
        asyncio.run(main(arguments))
