"""Sleeps and deadlines on a port's timers (:meth:`~fsm_agent.machine.port.EffectPort.call_later`),
so that every wait of a run is an effect a replay reproduces."""

from __future__ import annotations

import asyncio
from types import TracebackType

from .port import Cancellable, EffectPort

__all__ = ["PortDeadline", "sleep"]


async def sleep(port: EffectPort, seconds: float) -> None:
    """Wait ``seconds`` on ``port``'s timers (``0`` or less: yield once)."""
    if seconds <= 0:
        await asyncio.sleep(0)
        return
    done = asyncio.get_running_loop().create_future()
    handle = port.call_later(seconds, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        handle.cancel()


class PortDeadline:
    """``async with PortDeadline(port, seconds):`` cancels the block when ``seconds`` pass on the port's
    timers and raises :class:`TimeoutError` in its place (like :func:`asyncio.timeout`); ``None``:
    no deadline. :meth:`expired` tells whether the deadline cut the block."""

    __slots__ = ("_port", "_seconds", "_task", "_handle", "_expired")

    def __init__(self, port: EffectPort, seconds: float | None) -> None:
        self._port = port
        self._seconds = seconds
        self._task: asyncio.Task[object] | None = None
        self._handle: Cancellable | None = None
        self._expired = False

    def expired(self) -> bool:
        return self._expired

    def _fire(self) -> None:
        self._handle = None
        if self._task is not None and not self._task.done():
            self._expired = True
            self._task.cancel()

    async def __aenter__(self) -> PortDeadline:
        self._task = asyncio.current_task()
        if self._seconds is not None:
            self._handle = self._port.call_later(max(0.0, self._seconds), self._fire)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._expired and exc_type is asyncio.CancelledError and self._task is not None:
            if self._task.uncancel() == 0:
                raise TimeoutError from exc
        return False
