"""The live port: today's effects (asyncio timers and clocks, the providers' HTTP, the tools, the
session store, a control watcher that polls the store and keeps the lease).

This is the default :class:`~fsm_agent.machine.port.EffectPort` of every
:class:`~fsm_agent.Agent`. See :mod:`fsm_agent.machine.port` for the contract.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from ..control import Decision
from ..errors import ProviderError
from ..prompt import PromptSnapshot, PromptSource
from ..providers.base import Provider, call_deadline, retry_listener
from ..store.base import ControlKind, ControlRecord, Store
from ..tools.execution import execute_tool_call
from ..tools.registry import Tool, ToolContext, ToolRegistry
from ..types.content import ToolUseBlock
from ..types.events import ToolProgress, UsageRolledUp
from ..types.messages import ToolResultMessage, Usage
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import MessageComplete, StreamEvent, TextDelta
from .port import Cancellable, ModelTrace, OnRetry, ToolReport

__all__ = ["LivePort"]

log = logging.getLogger("fsm_agent.driver")

_MIDPHASE_CONTROLS = (ControlKind.INTERRUPT, ControlKind.CANCEL)


class LivePort:
    """The effects of a run as they happen (the default port).

    Args:
        store: the session store.
        control_poll: seconds between the watcher's looks for an Interrupt or a Cancel (and between
            looks for a decision while a run waits in process).
    """

    __slots__ = ("store", "control_poll")

    def __init__(self, store: Store, *, control_poll: float = 0.5) -> None:
        self.store = store
        self.control_poll = control_poll

    def __repr__(self) -> str:
        return f"LivePort(store={self.store!r}, control_poll={self.control_poll:g})"

    # -- time and chance ---------------------------------------------------------------------
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_later(max(0.0, delay), callback)

    def random(self) -> float:
        return random.random()

    def new_id(self) -> str:
        return uuid.uuid4().hex

    # -- the model -----------------------------------------------------------------------------
    async def call_model(self, provider: Provider, request: MessageRequest, *, stream: bool,
                         on_event: Callable[[StreamEvent], Awaitable[None]] | None, on_retry: OnRetry | None,
                         trace: ModelTrace, deadline_s: float | None) -> MessageResponse:
        token = call_deadline.set(time.monotonic() + deadline_s) if deadline_s is not None else None
        listening = retry_listener.set(on_retry) if on_retry is not None else None
        try:
            if not (stream and provider.capabilities.streaming):
                return await provider.chat(request)
            final: MessageResponse | None = None
            text = trace.text
            events = provider.chat_stream(request)
            try:
                async for event in events:
                    if type(event) is TextDelta:
                        text.append(event.text)
                    elif isinstance(event, MessageComplete):
                        final = event.full_response
                    if on_event is not None:
                        await on_event(event)
            finally:
                if isinstance(events, AsyncGenerator):  # typed AsyncIterator; providers are generators
                    await events.aclose()
            if final is None:  # pragma: no cover - providers always end with MessageComplete or raise
                raise ProviderError("the stream ended without a complete message",
                                    provider=getattr(provider, "name", None))
            return final
        finally:
            if listening is not None:
                retry_listener.reset(listening)
            if token is not None:
                call_deadline.reset(token)

    # -- tools ---------------------------------------------------------------------------------
    async def run_tool(self, call: ToolUseBlock, tools: ToolRegistry, *, session_id: str, turn: int,
                       timeout: float | None, decision: Decision | None, report: ToolReport,
                       budget_left: Callable[[], dict[str, float]]) -> ToolResultMessage:
        sink = _Sink(asyncio.get_running_loop(), report, budget_left)
        return await execute_tool_call(call, tools, session_id=session_id, turn=turn, timeout=timeout, sink=sink,
                                       decision=decision)

    async def tool_hook(self, tool: Tool, hook: str, args: Sequence[Any], ctx: ToolContext) -> Any:
        fn = {"reconcile": tool.reconcile, "compensate": tool.compensate}[hook]
        if fn is None:  # pragma: no cover - the engine asks only for hooks a tool has
            return None
        out = fn(*args, ctx)
        if inspect.isawaitable(out):
            out = await out
        return out

    # -- controls --------------------------------------------------------------------------------
    def watch(self, session_id: str, owner: str | None, lease_ttl: float, on_control: Callable[[], None],
              on_lost: Callable[[str], None]) -> Cancellable:
        return asyncio.ensure_future(self._watch(session_id, owner, lease_ttl, on_control, on_lost))

    async def _watch(self, sid: str, owner: str | None, lease_ttl: float, on_control: Callable[[], None],
                     on_lost: Callable[[str], None]) -> None:
        """Renew the lease and look for an Interrupt or a Cancel every ``control_poll`` seconds.

        A store error does not end the watcher: it retries with backoff (up to 8 polls). When the
        lease cannot be renewed for two thirds of its time-to-live, ``on_lost`` is called (the run
        stops driving) before another worker may take the session over.
        """
        store = self.store
        last_renew = last_ok = time.monotonic()
        delay = self.control_poll
        while True:
            await asyncio.sleep(delay)
            now = time.monotonic()
            try:
                if owner is not None and now - last_renew > lease_ttl / 3:
                    last_renew = now
                    if not await store.acquire_lease(sid, owner, lease_ttl):
                        on_lost(f"session {sid}: another worker took the lease")
                        return
                    last_ok = now
                if await store.peek_controls(sid, _MIDPHASE_CONTROLS):
                    on_control()
                delay = self.control_poll
            except Exception as exc:  # noqa: BLE001 - transient store trouble must not end the watcher
                log.warning("session %s: control watcher: %s; retrying", sid, exc)
                delay = min(delay * 2, self.control_poll * 8)
                if owner is not None and now - last_ok > lease_ttl * 2 / 3:
                    reason = (f"session {sid}: could not renew the lease for {now - last_ok:.1f} s ({exc}); "
                              "stopped driving before it expires")
                    log.error("%s", reason)
                    on_lost(reason)
                    return

    async def wait_controls(self, session_id: str, kinds: Sequence[ControlKind], timeout: float
                            ) -> list[ControlRecord]:
        deadline = time.monotonic() + timeout
        while True:
            taken = await self.store.take_controls(session_id, kinds)
            left = deadline - time.monotonic()
            if taken or left <= 0:
                return taken
            await asyncio.sleep(min(self.control_poll, left))


    # -- plugins' own I/O ------------------------------------------------------------------------
    async def plugin_effect(self, plugin: Any, method: str, args: Sequence[Any]) -> Any:
        out = getattr(plugin, method)(*args)
        if inspect.isawaitable(out):
            out = await out
        return out

    # -- the agent's system prompt ---------------------------------------------------------------
    async def system_prompt(self, source: PromptSource) -> PromptSnapshot | None:
        return source.current()


class _Sink:
    """The :class:`~fsm_agent.tools.registry.ToolSink` a live tool reports to: each report becomes an
    event handed to the run's event loop (reports may come from a tool's worker thread)."""

    __slots__ = ("loop", "report", "budget")

    def __init__(self, loop: asyncio.AbstractEventLoop, report: ToolReport,
                 budget: Callable[[], dict[str, float]]) -> None:
        self.loop = loop
        self.report = report
        self.budget = budget

    def _hand_over(self, event: ToolProgress | UsageRolledUp) -> None:
        loop = self.loop
        try:
            if loop.is_closed():
                return
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self.report(event)
            else:
                loop.call_soon_threadsafe(self.report, event)
        except RuntimeError:  # the loop closed meanwhile: the report has nowhere to go
            pass

    def progress(self, ctx: ToolContext, progress: float, total: float | None, message: str | None) -> None:
        self._hand_over(ToolProgress(ctx.session_id, ctx.turn, ctx.call_id, ctx.tool_name, progress, total,
                                     None if message is None else str(message)[:2000]))

    def usage(self, ctx: ToolContext, usage: Usage, cost_usd: float | None, child_session_id: str | None) -> None:
        self._hand_over(UsageRolledUp(ctx.session_id, ctx.turn, ctx.call_id, ctx.tool_name, usage, cost_usd,
                                      child_session_id))

    def budget_left(self) -> dict[str, float]:
        return self.budget()
