"""Blocking jobs of a sandbox call in threads, which never outlive the call that started them.

A job that touches a run's descriptors, its work dir or its uid (creating the work dir, recovering a
uid a dead call left) must end before the call's cleanup runs and its uid is given back, even when
the call is cancelled meanwhile: :func:`settle` waits for it and only then re-raises the cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["in_thread", "settle"]

T = TypeVar("T")


async def settle(fut: asyncio.Future[T]) -> T:
    """Await ``fut`` (a job in a thread) to its end even when cancelled meanwhile, then re-raise the
    cancellation: a job that touches the run's descriptors or its uid must never outlive its caller."""
    cancelled: BaseException | None = None
    while not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        if not fut.cancelled():
            fut.exception()  # retrieved: no "never retrieved" warning
        raise cancelled
    return fut.result()


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread, awaited to its end (:func:`settle`)."""
    return await settle(asyncio.ensure_future(asyncio.to_thread(fn, *args)))
