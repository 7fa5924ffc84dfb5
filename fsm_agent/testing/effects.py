"""Record a run's effects, then replay the run from them: the same requests, the same event log,
byte for byte, or a :class:`~fsm_agent.errors.ReplayDivergence` naming the first effect that differs.

Every effect of a run goes through its :class:`~fsm_agent.machine.port.EffectPort` (model calls,
tools and their hooks, the store, clocks, timers, ids, chance, the control watch). An
:class:`EffectRecording` stands in front of the live port while a run happens, and answers every
effect from what it saw when the run is replayed::

    recording = EffectRecording()
    result = await agent.run("Pay invoice 17", session_id="s1", port=recording.record)
    ...                                                    # a resume is one more segment
    await agent.resume("s1", decisions=..., port=recording.record)

    replayed = await agent.run("Pay invoice 17", session_id="s1", port=recording.replay)
    await agent.resume("s1", decisions=..., port=recording.replay)   # raises ReplayDivergence on a change

No model, tool or store is touched by a replay: the agent given may have another provider and an
empty store. A changed plugin, prompt, tool schema or engine shows at the first effect it changes
(its index, what the recording has, what the replay asked for, and the first differing field).

**How interleavings replay.** A run is concurrent (parallel tools, the control watch beside a
model stream, a tool's progress reports). While recording, the port delivers each completion and
each callback (a timer, a control seen, a report, a streamed model event, a provider's retry
notice) one at a time, letting the run settle between two (until no task is ready), and keeps their
order; a replay delivers them in that order the same way. So the engine sees the same sequence of
facts, and makes the same requests and writes, in the same order. A streamed event and a retry
notice are run by the model call's own task, live and in a replay, so the middleware's
``on_model_event`` filters see the recorded stream at the same points (what they emit, a
``StopRun`` or a cancel they raise, replays). An effect that had ended when a cancel came (while
its result waited for its turn) still hands its result to the run, and the cancel lands at the
run's next await, in the recording and in the replay alike: a store write that committed is never
taken for a failed one. Recording costs a few event-loop turns per effect and per streamed event;
it is a test tool.

What a replay does not reproduce: observers (they watch, they are never replayed: they may see a
replayed stream, but nothing they do reaches the run), a plugin that reads the clock, sleeps, draws
random numbers or reads the store (or its own service) itself instead of through its context
(``ctx.now()``, ``ctx.sleep()``, ``ctx.random()``, ``ctx.plugin_effect()`` ...), and a cut from outside the run's effects: an interrupt
raised in process by a signal (:meth:`~fsm_agent.Agent.interrupt_all`) or the run's task cancelled
by the caller (an Interrupt sent through the store, :meth:`~fsm_agent.Agent.control`, replays; so
does a cancel a middleware hook raises, since the hook runs again in the replay). Where the replay
then waits for an effect whose result the recording never had, it raises
:class:`~fsm_agent.errors.ReplayDivergence` naming it instead of waiting.

A recording is kept in memory; :meth:`EffectRecording.save` and :meth:`EffectRecording.load` write
and read it as one file (pickle: load only recordings you made).
"""

from __future__ import annotations

import asyncio
import copyreg
import enum
import io
import pickle
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from attrs import define, field

from ..control import Decision
from ..errors import ReplayDivergence
from ..machine.port import Cancellable, EffectPort, ModelTrace, OnRetry, ToolReport
from ..prompt import PromptSnapshot, PromptSource
from ..providers.base import Provider
from ..store.base import ControlKind, ControlRecord, Store
from ..tools.registry import Tool, ToolContext, ToolRegistry
from ..types.codec import unstructure
from ..types.content import ToolUseBlock
from ..types.messages import ToolResultMessage
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import StreamEvent

__all__ = ["Effect", "EffectRecording", "RecordingPort", "ReplayingPort", "Segment"]

_STORE_METHODS = ("create_session", "get_session", "list_sessions", "update_metadata", "write", "read_events",
                  "latest_checkpoint", "get_checkpoint", "ledger", "acquire_lease", "release_lease", "push_control",
                  "take_controls", "peek_controls", "claim_idempotency_key", "idempotency_records", "link_session",
                  "parent", "children", "close")


# -- the record ---------------------------------------------------------------------------------------
@define
class Effect:
    """One effect the run asked for, in the order it asked."""

    kind: str
    """``now``, ``monotonic``, ``random``, ``new_id``, ``call_later``, ``call_model``, ``run_tool``,
    ``tool_hook``, ``watch``, ``wait_controls``, ``plugin_effect``, ``system_prompt`` or ``store.<method>``."""
    args: Any
    """Its arguments in a canonical, comparable form (JSON-like: dicts, lists, strings, numbers)."""
    value: Any = None
    """A clock, id or random value (the sync effects), as the run got it."""
    delivered: bool = False
    """Its result reached the run (``False``: the run cut it first, or it never ended)."""
    cut_text: list[str] | None = None
    """A model call's streamed text when it ended (a cut or a failed call keeps it)."""


@define
class Segment:
    """The effects of one run segment (a start or a resume, up to its stop)."""

    effects: list[Effect] = field(factory=list)
    arrivals: list[tuple[str, int, bytes | None]] = field(factory=list)
    """What reached the run, in order: ``(what, effect index, pickled payload)`` where ``what`` is
    ``done`` (an effect's result), ``timer``, ``control``, ``lost``, ``report``, ``retry`` (a provider's
    retry notice) or ``event`` (a streamed model event)."""

    @property
    def requests(self) -> list[Any]:
        """The model requests of the segment, as sent (canonical form)."""
        return [e.args["request"] for e in self.effects if e.kind == "call_model"]

    @property
    def events(self) -> list[Any]:
        """The event log the segment wrote (canonical form of each event, in seq order)."""
        return [ev for e in self.effects if e.kind == "store.write" for ev in e.args["a"][0]["events"]]


# -- canonical forms, copies ------------------------------------------------------------------------
def _canon(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_canon(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _canon(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted((_canon(x) for x in obj), key=repr)
    if isinstance(obj, bytes):
        return {"bytes": obj.hex()}
    if isinstance(obj, ToolRegistry):
        return {"tools": list(obj.names)}
    if isinstance(obj, Tool):
        return {"tool": obj.name}
    if isinstance(obj, Provider):
        return {"provider": getattr(obj, "name", type(obj).__name__), "model": getattr(obj, "model", None)}
    if isinstance(obj, ToolContext):
        return {"call_id": obj.call_id, "session_id": obj.session_id, "turn": obj.turn, "tool": obj.tool_name,
                "decision": _canon(obj.decision)}
    if isinstance(obj, BaseException):
        return {"exception": type(obj).__name__, "message": str(obj)}
    if isinstance(obj, enum.Enum):
        return _canon(obj.value)
    if attrs.has(type(obj)):
        return _canon(unstructure(obj))
    if callable(obj):
        return {"callable": getattr(obj, "__qualname__", type(obj).__name__)}
    return {"object": repr(obj)}


def _plugin_args(plugin: Any, method: str, args: Sequence[Any]) -> dict[str, Any]:
    """A plugin effect's identity: the plugin by name (not by object), the method and its arguments."""
    name = getattr(plugin, "middleware_name", None) or type(plugin).__name__
    return {"plugin": name, "method": method, "args": list(args)}


_HOST = "<worker>"


def _hostless(kind: str, args: Any) -> Any:
    """``args`` without what names the worker that ran the segment (its lease owner id): a replay by
    another agent or process of the same run makes the same effects."""
    if kind in ("store.acquire_lease", "store.release_lease") and len(args["a"]) > 1:
        args["a"][1] = _HOST
    elif kind == "store.write" and args["a"] and isinstance(args["a"][0], dict) \
            and args["a"][0].get("expected_owner"):
        args["a"][0]["expected_owner"] = _HOST
    elif kind == "watch" and args.get("owner"):
        args["owner"] = _HOST
    return args


def _difference(a: Any, b: Any, path: str = "") -> str:
    """The path of the first field where ``a`` and ``b`` differ (``""`` when they are equal)."""
    if type(a) is not type(b):
        return path or "(the value)"
    if isinstance(a, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}.{k}" if path else k
            d = _difference(a[k], b[k], f"{path}.{k}" if path else k)
            if d:
                return d
        return ""
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return f"{path} (length {len(a)} against {len(b)})" if len(a) != len(b) else ""
    return "" if a == b else (path or "(the value)")


def _short(kind: str, args: Any) -> str:
    text = repr(args)
    return f"{kind}({text[:200]}{'…' if len(text) > 200 else ''})"


def _rebuild_exception(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class _Pickler(pickle.Pickler):
    """Pickles exceptions without calling their ``__init__`` (many take keyword-only arguments)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, BaseException):
            return _rebuild_exception, (type(obj), obj.args, dict(obj.__dict__))
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


copyreg.constructor(_rebuild_exception)  # type: ignore[arg-type]


# -- the gate: one arrival at a time -------------------------------------------------------------------
async def _settle() -> None:
    """Let the run go on until no task is ready (every task waits for an effect, a lock or I/O)."""
    loop = asyncio.get_running_loop()
    ready = getattr(loop, "_ready", None)  # CPython's asyncio; without it, a fixed number of turns
    quiet = 0
    for turn in range(10_000):
        await asyncio.sleep(0)
        if ready is None:
            if turn >= 50:
                return
            continue
        quiet = quiet + 1 if not ready else 0
        if quiet >= 2:
            return


class _Gate:
    """Delivers arrivals to the run one at a time, the run settling between two."""

    def __init__(self) -> None:
        self.queue: list[tuple[Callable[[], Awaitable[None] | None], Callable[[], bool]]] = []
        self.task: asyncio.Task[None] | None = None
        self.failed: BaseException | None = None

    def put(self, deliver: Callable[[], Awaitable[None] | None], live: Callable[[], bool] = lambda: True) -> None:
        self.queue.append((deliver, live))
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        await _settle()
        while self.queue:
            deliver, live = self.queue.pop(0)
            if not live():
                continue
            out = deliver()
            if out is not None:
                await out
            await _settle()


async def _hold_cancel(wait: asyncio.Future[Any]) -> bool:
    """Await ``wait`` even when the task is cancelled meanwhile; ``True`` when it was (the caller then
    cancels the task again, with :func:`_cancel_again`, once it has handed over the effect's result).

    An effect that ended has a result the live run would have had: a cancel that comes while the
    result waits for its turn at the gate must not lose it (a store write that committed, seen as
    failed, would be written again). So the cancel lands at the run's next await instead, as it would
    had the effect ended a moment earlier."""
    held = False
    task = asyncio.current_task()
    while True:
        try:
            await asyncio.shield(wait)
            return held
        except asyncio.CancelledError:
            if wait.cancelled() or task is None:
                raise
            task.uncancel()
            held = True


def _cancel_again() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.cancel()


# -- recording ------------------------------------------------------------------------------------------
class _Handle:
    __slots__ = ("inner", "cancelled")

    def __init__(self) -> None:
        self.inner: Cancellable | None = None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.inner is not None:
            self.inner.cancel()

    def guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn``, doing nothing once this handle is called off."""

        def guarded(*args: Any) -> None:
            if not self.cancelled:
                fn(*args)

        return guarded


def _store_facet(port: Any, base: type) -> Store:
    """A :class:`Store` whose every method is an effect of ``port`` (``store.<method>``)."""

    def method(name: str) -> Callable[..., Awaitable[Any]]:
        async def call(self: Any, *a: Any, **kw: Any) -> Any:
            return await port._store(name, a, kw)

        call.__name__ = name
        return call

    cls = type(f"{base.__name__}Store", (Store,), {name: method(name) for name in _STORE_METHODS})
    return cls()  # type: ignore[no-any-return]


class RecordingPort:
    """Passes every effect to ``inner`` (the live port) and records it into ``segment``."""

    def __init__(self, inner: EffectPort, segment: Segment) -> None:
        self.inner = inner
        self.segment = segment
        self.gate = _Gate()
        self.store = _store_facet(self, RecordingPort)

    def _start(self, kind: str, args: Any, value: Any = None) -> int:
        self.segment.effects.append(Effect(kind, _hostless(kind, _canon(args)), value))
        return len(self.segment.effects) - 1

    async def _await(self, i: int, work: Awaitable[Any], trace: ModelTrace | None = None) -> Any:
        """Run ``work`` (the effect's live form), then hand its outcome to the run through the gate."""
        loop = asyncio.get_running_loop()
        try:
            outcome: tuple[str, Any] = ("ok", await work)
        except asyncio.CancelledError:
            if trace is not None:
                self.segment.effects[i].cut_text = list(trace.text)
            raise
        except BaseException as exc:  # noqa: BLE001 - every outcome is recorded, then raised
            outcome = ("raise", exc)
        turn: asyncio.Future[None] = loop.create_future()
        effect = self.segment.effects[i]

        def deliver() -> None:
            effect.delivered = True
            if trace is not None:
                effect.cut_text = list(trace.text)
            self.segment.arrivals.append(("done", i, _dumps(outcome)))
            turn.set_result(None)

        self.gate.put(deliver, lambda: not turn.done())
        held = await _hold_cancel(turn)
        try:
            if outcome[0] == "raise":
                raise outcome[1]
            return outcome[1]
        finally:
            if held:
                _cancel_again()

    def _callback(self, what: str, i: int, fn: Callable[..., Any], *payload: Any) -> Callable[..., None]:
        def arrived(*args: Any) -> None:
            data = args or payload

            def deliver() -> Awaitable[None] | None:
                self.segment.arrivals.append((what, i, _dumps(data) if data else None))
                return fn(*data)  # type: ignore[no-any-return]

            self.gate.put(deliver)

        return arrived

    async def _store(self, name: str, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        i = self._start(f"store.{name}", {"a": a, "kw": kw})
        return await self._await(i, getattr(self.inner.store, name)(*a, **kw))

    # -- sync effects ---------------------------------------------------------------------------------
    def now(self) -> float:
        v = self.inner.now()
        self._start("now", None, v)
        return v

    def monotonic(self) -> float:
        v = self.inner.monotonic()
        self._start("monotonic", None, v)
        return v

    def random(self) -> float:
        v = self.inner.random()
        self._start("random", None, v)
        return v

    def new_id(self) -> str:
        v = self.inner.new_id()
        self._start("new_id", None, v)
        return v

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        i = self._start("call_later", {"delay": delay})
        handle = _Handle()

        def fired() -> None:
            def deliver() -> None:
                self.segment.arrivals.append(("timer", i, None))
                callback()

            self.gate.put(deliver, lambda: not handle.cancelled)

        handle.inner = self.inner.call_later(delay, fired)
        return handle

    # -- async effects ---------------------------------------------------------------------------------
    async def call_model(self, provider: Provider, request: MessageRequest, *, stream: bool,
                         on_event: Callable[[StreamEvent], Awaitable[None]] | None, on_retry: OnRetry | None,
                         trace: ModelTrace, deadline_s: float | None) -> MessageResponse:
        i = self._start("call_model", {"provider": provider, "request": request, "stream": stream,
                                       "deadline_s": deadline_s})
        retry = None if on_retry is None else _async_arrival(self, "retry", i, on_retry)
        events = None if on_event is None else _async_arrival(self, "event", i, on_event)
        work = self.inner.call_model(provider, request, stream=stream, on_event=events, on_retry=retry,
                                     trace=trace, deadline_s=deadline_s)
        return await self._await(i, work, trace)  # type: ignore[no-any-return]

    async def run_tool(self, call: ToolUseBlock, tools: ToolRegistry, *, session_id: str, turn: int,
                       timeout: float | None, decision: Decision | None, report: ToolReport,
                       budget_left: Callable[[], dict[str, float]]) -> ToolResultMessage:
        i = self._start("run_tool", {"call": call, "tools": tools, "session_id": session_id, "turn": turn,
                                     "timeout": timeout, "decision": decision})
        reports = self._callback("report", i, report)
        work = self.inner.run_tool(call, tools, session_id=session_id, turn=turn, timeout=timeout, decision=decision,
                                   report=reports, budget_left=budget_left)
        return await self._await(i, work)  # type: ignore[no-any-return]

    async def tool_hook(self, tool: Tool, hook: str, args: Sequence[Any], ctx: ToolContext) -> Any:
        i = self._start("tool_hook", {"tool": tool, "hook": hook, "args": list(args), "ctx": ctx})
        return await self._await(i, self.inner.tool_hook(tool, hook, args, ctx))

    def watch(self, session_id: str, owner: str | None, lease_ttl: float, on_control: Callable[[], None],
              on_lost: Callable[[str], None]) -> Cancellable:
        i = self._start("watch", {"session_id": session_id, "owner": owner, "lease_ttl": lease_ttl})
        handle = _Handle()
        control = self._callback("control", i, on_control)
        lost = self._callback("lost", i, on_lost)
        handle.inner = self.inner.watch(session_id, owner, lease_ttl, handle.guard(control), handle.guard(lost))
        return handle

    async def wait_controls(self, session_id: str, kinds: Sequence[ControlKind], timeout: float
                            ) -> list[ControlRecord]:
        i = self._start("wait_controls", {"session_id": session_id, "kinds": list(kinds), "timeout": timeout})
        return await self._await(i, self.inner.wait_controls(session_id, kinds, timeout))  # type: ignore[no-any-return]

    async def plugin_effect(self, plugin: Any, method: str, args: Sequence[Any]) -> Any:
        i = self._start("plugin_effect", _plugin_args(plugin, method, args))
        return await self._await(i, self.inner.plugin_effect(plugin, method, args))

    async def system_prompt(self, source: PromptSource) -> PromptSnapshot | None:
        i = self._start("system_prompt", {"source": source.label})
        return await self._await(i, self.inner.system_prompt(source))  # type: ignore[no-any-return]


def _async_arrival(port: RecordingPort, what: str, i: int, fn: Callable[..., Awaitable[None]]
                   ) -> Callable[..., Awaitable[None]]:
    """An async callback of an effect in flight (a provider's retry notice, a streamed model event),
    delivered through the gate: the effect's task waits for its turn, then runs ``fn`` itself (in the
    run's task, as it would live), and the gate waits until ``fn`` returned before the next arrival."""

    async def arrived(*args: Any) -> None:
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        finished: asyncio.Future[None] = loop.create_future()

        def deliver() -> Awaitable[None]:
            port.segment.arrivals.append((what, i, _dumps(args)))
            turn.set_result(None)
            return finished

        port.gate.put(deliver, lambda: not turn.done())
        try:
            await turn
            await fn(*args)
        except asyncio.CancelledError:  # cut while waiting for its turn (then the run never saw it) or in fn
            turn.cancel()
            raise
        finally:
            if not finished.done():
                finished.set_result(None)

    return arrived


# -- replaying ---------------------------------------------------------------------------------------------
class _Awaited:
    """An effect the replayed run awaits: the pump hands it what the live run got while it waited (a
    streamed event, a retry notice: run by the effect's own task, as live), then its result."""

    __slots__ = ("queue", "handlers", "over")

    def __init__(self, handlers: dict[str, Callable[..., Awaitable[None]] | None]) -> None:
        self.queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.handlers = handlers
        self.over = False
        """The run no longer awaits it (it got its result, raised, or was cut)."""


class ReplayingPort:
    """Answers every effect from ``segment``; raises :class:`~fsm_agent.errors.ReplayDivergence` at the
    first effect that differs (and for every effect after it: the first divergence is the one raised)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.next = 0
        self.divergence: ReplayDivergence | None = None
        self.awaited: dict[int, _Awaited] = {}
        self.callbacks: dict[tuple[str, int], Callable[..., Any]] = {}
        self.store = _store_facet(self, ReplayingPort)
        self._pump: asyncio.Task[None] | None = None

    # -- matching --------------------------------------------------------------------------------------
    def _diverge(self, index: int, expected: Effect | None, kind: str | None, args: Any, *,
                 difference: str | None = None, expected_text: str | None = None,
                 actual_text: str | None = None) -> ReplayDivergence:
        if self.divergence is None:
            if difference is None:
                difference = ("" if expected is None or kind is None or expected.kind != kind
                              else _difference(expected.args, args))
            self.divergence = ReplayDivergence(
                index, expected_text or (None if expected is None else _short(expected.kind, expected.args)),
                actual_text or (None if kind is None else _short(kind, args)), difference)
            for waiting in self.awaited.values():
                if not waiting.over:
                    waiting.queue.put_nowait(("divergence",))
        return self.divergence

    def _start(self, kind: str, args: Any) -> tuple[int, Effect]:
        if self.divergence is not None:
            raise self.divergence
        i = self.next
        effects = self.segment.effects
        canon = _hostless(kind, _canon(args))
        if i >= len(effects):
            raise self._diverge(i, None, kind, canon)
        expected = effects[i]
        if expected.kind != kind or expected.args != canon:
            raise self._diverge(i, expected, kind, canon)
        self.next += 1
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._deliver_all())
        return i, expected

    def finished(self) -> None:
        """Raise :class:`ReplayDivergence` when the recording goes on after where the run stopped."""
        if self.divergence is not None:
            raise self.divergence
        if self.next < len(self.segment.effects):
            e = self.segment.effects[self.next]
            raise self._diverge(self.next, e, None, None)

    def _never_answered(self, i: int) -> ReplayDivergence:
        """The run waits for effect ``i``, whose result the recording does not have."""
        e = self.segment.effects[i]
        return self._diverge(i, e, e.kind, e.args, expected_text=f"{_short(e.kind, e.args)}, never answered",
                             actual_text=f"{_short(e.kind, e.args)}, waiting for its result",
                             difference="the live run was cut while it waited for this effect, from outside the "
                                        "run's effects (a task cancelled, a signal), or the replay waits where the "
                                        "live run did not")

    async def _deliver_all(self) -> None:
        loop = asyncio.get_running_loop()
        for what, i, payload in self.segment.arrivals:
            await _settle()
            if self.divergence is not None:
                return
            if what in ("done", "event", "retry"):
                waiting = self.awaited.get(i)
                if waiting is None:
                    await _settle()
                    waiting = self.awaited.get(i)
                if waiting is None:
                    self._never_asked(i)
                    return
                if waiting.over:
                    continue
                assert payload is not None
                data = pickle.loads(payload)  # noqa: S301 - the recording is the user's own
                if what == "done":
                    waiting.queue.put_nowait(("done", data))
                    continue
                handled: asyncio.Future[None] = loop.create_future()
                waiting.queue.put_nowait((what, data, handled))
                await handled  # the effect's task ran it (it sets this on every way out)
                continue
            fn = self.callbacks.get((what, i))
            if fn is None:
                await _settle()
                fn = self.callbacks.get((what, i))
            if fn is None:  # the run never set the timer / watch / effect up again
                self._never_asked(i)
                return
            data = pickle.loads(payload) if payload is not None else ()  # noqa: S301
            fn(*data)
        await _settle()
        # the recording has nothing more to deliver: an effect the run still waits for never gets its result
        for i, waiting in sorted(self.awaited.items()):
            if not waiting.over:
                self._never_answered(i)
                return

    def _never_asked(self, i: int) -> None:
        """The recording delivers to effect ``i`` (a result, a timer, a control ...) what the replayed run
        did not ask for: the run waits elsewhere."""
        waiting = [j for j, w in sorted(self.awaited.items()) if not w.over]
        if i >= self.next and waiting:  # it waits for an effect the live run was cut from (from outside)
            self._never_answered(waiting[0])
            return
        at = min(i, self.next)
        e = self.segment.effects[at]
        self._diverge(at, e, None, None, actual_text=None if i < self.next else
                      "nothing: the replayed run waits outside its effects (a plugin's own sleep or I/O?)")

    async def _await(self, i: int, trace: ModelTrace | None = None,
                     handlers: dict[str, Callable[..., Awaitable[None]] | None] | None = None) -> Any:
        if self._pump is not None and self._pump.done() and self.divergence is None:
            raise self._never_answered(i)
        waiting = self.awaited[i] = _Awaited(handlers or {})
        effect = self.segment.effects[i]
        raised: BaseException | None = None
        held = False
        task = asyncio.current_task()
        try:
            while True:
                try:
                    item = await waiting.queue.get()
                except asyncio.CancelledError:
                    if not effect.delivered or self.divergence is not None or task is None:
                        raise
                    # the live run got this effect's result although a cancel came meanwhile (see
                    # _hold_cancel): so does the replay, and the cancel lands at the next await
                    task.uncancel()
                    held = True
                    continue
                if item[0] == "divergence":
                    assert self.divergence is not None
                    raise self.divergence
                if item[0] == "done":
                    kind, value = item[1]
                    if trace is not None and effect.cut_text is not None:
                        trace.text[:] = effect.cut_text
                    if held:
                        _cancel_again()
                    if raised is not None:  # a callback raised, live too: the call ended with it
                        raise raised
                    if kind == "ok":
                        return value
                    raise value
                _, data, handled = item
                try:
                    fn = waiting.handlers.get(item[0])
                    if fn is not None and raised is None:
                        await fn(*data)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - it reaches the run with the call's recorded end
                    raised = exc
                finally:
                    if not handled.done():
                        handled.set_result(None)
        except asyncio.CancelledError:
            if trace is not None and effect.cut_text is not None:
                trace.text[:] = effect.cut_text
            raise
        finally:
            waiting.over = True
            while not waiting.queue.empty():
                rest = waiting.queue.get_nowait()
                if len(rest) == 3 and not rest[2].done():
                    rest[2].set_result(None)

    async def _store(self, name: str, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        i, _ = self._start(f"store.{name}", {"a": a, "kw": kw})
        return await self._await(i)

    # -- sync effects ---------------------------------------------------------------------------------
    def now(self) -> float:
        return self._start("now", None)[1].value  # type: ignore[no-any-return]

    def monotonic(self) -> float:
        return self._start("monotonic", None)[1].value  # type: ignore[no-any-return]

    def random(self) -> float:
        return self._start("random", None)[1].value  # type: ignore[no-any-return]

    def new_id(self) -> str:
        return self._start("new_id", None)[1].value  # type: ignore[no-any-return]

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        i, _ = self._start("call_later", {"delay": delay})
        handle = _Handle()
        self.callbacks[("timer", i)] = handle.guard(callback)
        return handle

    # -- async effects ---------------------------------------------------------------------------------
    async def call_model(self, provider: Provider, request: MessageRequest, *, stream: bool,
                         on_event: Callable[[StreamEvent], Awaitable[None]] | None, on_retry: OnRetry | None,
                         trace: ModelTrace, deadline_s: float | None) -> MessageResponse:
        i, _ = self._start("call_model", {"provider": provider, "request": request, "stream": stream,
                                          "deadline_s": deadline_s})
        return await self._await(i, trace, {"retry": on_retry, "event": on_event})  # type: ignore[no-any-return]

    async def run_tool(self, call: ToolUseBlock, tools: ToolRegistry, *, session_id: str, turn: int,
                       timeout: float | None, decision: Decision | None, report: ToolReport,
                       budget_left: Callable[[], dict[str, float]]) -> ToolResultMessage:
        i, _ = self._start("run_tool", {"call": call, "tools": tools, "session_id": session_id, "turn": turn,
                                        "timeout": timeout, "decision": decision})
        self.callbacks[("report", i)] = report
        return await self._await(i)  # type: ignore[no-any-return]

    async def tool_hook(self, tool: Tool, hook: str, args: Sequence[Any], ctx: ToolContext) -> Any:
        i, _ = self._start("tool_hook", {"tool": tool, "hook": hook, "args": list(args), "ctx": ctx})
        return await self._await(i)

    def watch(self, session_id: str, owner: str | None, lease_ttl: float, on_control: Callable[[], None],
              on_lost: Callable[[str], None]) -> Cancellable:
        i, _ = self._start("watch", {"session_id": session_id, "owner": owner, "lease_ttl": lease_ttl})
        handle = _Handle()
        self.callbacks[("control", i)] = handle.guard(on_control)
        self.callbacks[("lost", i)] = handle.guard(on_lost)
        return handle

    async def wait_controls(self, session_id: str, kinds: Sequence[ControlKind], timeout: float
                            ) -> list[ControlRecord]:
        i, _ = self._start("wait_controls", {"session_id": session_id, "kinds": list(kinds), "timeout": timeout})
        return await self._await(i)  # type: ignore[no-any-return]

    async def plugin_effect(self, plugin: Any, method: str, args: Sequence[Any]) -> Any:
        i, _ = self._start("plugin_effect", _plugin_args(plugin, method, args))
        return await self._await(i)

    async def system_prompt(self, source: PromptSource) -> PromptSnapshot | None:
        i, _ = self._start("system_prompt", {"source": source.label})
        return await self._await(i)  # type: ignore[no-any-return]


# -- the user's handle --------------------------------------------------------------------------------------
class EffectRecording:
    """The recorded effects of run segments, in order (see the module doc).

    ``port=recording.record`` records a segment; ``port=recording.replay`` replays the next recorded
    segment (the first replay takes the first segment, and so on).
    """

    def __init__(self, segments: Sequence[Segment] = ()) -> None:
        self.segments: list[Segment] = list(segments)
        self._replays: list[ReplayingPort] = []

    def record(self, live: EffectPort) -> RecordingPort:
        """A :data:`~fsm_agent.agent.PortFactory`: the live port, recorded into a new segment."""
        segment = Segment()
        self.segments.append(segment)
        return RecordingPort(live, segment)

    def replay(self, live: EffectPort) -> ReplayingPort:
        """A :data:`~fsm_agent.agent.PortFactory`: the next recorded segment, replayed (``live`` is not used).

        Raises:
            ReplayDivergence: every segment was replayed already.
        """
        n = len(self._replays)
        if self._replays:
            self._replays[-1].finished()
        if n >= len(self.segments):
            raise ReplayDivergence(0, None, f"a run segment (#{n + 1})", f"the recording has {n} segment(s)")
        port = ReplayingPort(self.segments[n])
        self._replays.append(port)
        return port

    def check(self) -> None:
        """Raise :class:`ReplayDivergence` when the last replayed segment stopped before its recording
        did, or when recorded segments were not replayed."""
        if self._replays:
            self._replays[-1].finished()
        if len(self._replays) < len(self.segments):
            raise ReplayDivergence(0, f"{len(self.segments)} segment(s)", f"{len(self._replays)} replayed")

    @property
    def requests(self) -> list[Any]:
        """Every model request of every segment, in order (canonical form)."""
        return [r for s in self.segments for r in s.requests]

    @property
    def events(self) -> list[Any]:
        """The event log every segment wrote, in order (canonical form)."""
        return [e for s in self.segments for e in s.events]

    def save(self, path: str | Path) -> None:
        """Write the recording to ``path`` (one pickle file)."""
        Path(path).write_bytes(_dumps(self.segments))

    @classmethod
    def load(cls, path: str | Path) -> EffectRecording:
        """Read a recording :meth:`save` wrote (pickle: load only recordings you made)."""
        return cls(pickle.loads(Path(path).read_bytes()))  # noqa: S301

