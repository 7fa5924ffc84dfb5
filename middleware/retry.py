"""RetryFallback: retry a failed model call with backoff, then fall back to other providers.

One middleware rather than two, so that one place decides when the primary is
given up and the fallback chain starts (two separate layers would each need to
know the other's retry budget and the wall clock).

Layering — three levels of retry, each outside the one below:

1. **Provider, per HTTP attempt** (:class:`fsm_agent.RetryPolicy`, inside
   ``Provider.chat`` / ``chat_stream``): default 3 attempts, full jitter from
   0.5 s, honouring Retry-After up to 60 s, never past the run's deadline. A
   stream that already yielded content is not retried there.
2. **This middleware, per logical model call** (``wrap_model_call``, outside the
   provider's retries): ``max_attempts`` calls of ``call_next`` (the rest of the
   chain and the provider), so a call that failed after the provider's own
   retries (or mid-stream, or a provider without retries) is tried again whole.
   Worst case on the primary: ``max_attempts × RetryPolicy.max_attempts`` HTTP
   requests — 2 × 3 = 6 with the defaults, which is why ``max_attempts`` is 2.
3. **Fallbacks**: when the primary's last error is retryable (or its kind is in
   ``fallback_on``), each fallback provider is called in order with the same
   request (``model`` replaced by the fallback's) through
   ``ctx.call_provider(request, provider=...)``: the runtime's streaming path, so
   observers see its deltas. Each fallback gets ``fallback_attempts`` logical
   calls (default 1; its own HTTP retries still apply). Middleware listed inside
   this one do not run for fallback calls — list RetryFallback first.

Never retried here: :class:`~fsm_agent.errors.ContextLengthExceededError` (it is
raised at once, and the driver re-trims and retries once) and errors with
``retryable=False`` (authentication, permission, invalid request, quota ...).
Those go to the next provider only when their kind is in ``fallback_on`` (e.g.
``"context_length_exceeded"`` for a fallback with a larger window), without retries.

Waits: retry n (1-based) of a provider waits ``cap * (0.5 + 0.5 * rng())`` seconds with
``cap = min(max_delay, initial_delay * 2**(n-1))`` ("equal jitter": the provider's bursts
already happened, so a floor of half the cap spreads callers), or the server's
Retry-After (``RateLimitError.retry_after``, else the ``retry-after-ms`` /
``retry-after`` headers) when given. A Retry-After above ``max_retry_after``, or
any wait that would not end before the run's wall-clock budget
(``ctx.remaining_wall_clock``), ends the retries of that provider at once; with
no budget left at all, no further call starts and the last error is raised.

Result: the response of the first call that succeeds. Otherwise the last error
is raised unchanged, and the driver ends the run FAILED_RETRYABLE or
FAILED_TERMINAL from its ``retryable`` flag. ``ctx.state(self)`` records every
logical call: ``calls`` (list of ``{"turn", "attempts": [{"provider", "index",
"kind", "status", "waited"}], "answered_by"}``) and ``answered_by`` (the latest
``{"provider", "model", "index"}``; index 0 is the primary). The response's own
``provider`` field names the profile that served it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from attrs import evolve

from fsm_agent import MessageRequest, MessageResponse, Middleware, Provider, RunContext
from fsm_agent.errors import ContextLengthExceededError, ProviderError, RateLimitError
from fsm_agent.providers import parse_retry_after

__all__ = ["RetryFallback"]

log = logging.getLogger("fsm_agent.middleware.retry")

ModelCallNext = Callable[[MessageRequest], Awaitable[MessageResponse]]


class RetryFallback(Middleware):
    """Retry the model call with backoff, then try fallback providers (see the module doc).

    Args:
        max_attempts: logical calls on the primary, the first included (1: no retries here).
        initial_delay: seconds; the cap of the first retry's wait.
        max_delay: seconds; the largest cap.
        max_retry_after: seconds; a longer server-requested wait ends this provider's retries.
        fallbacks: providers tried in order after the primary gives up.
        fallback_on: error kinds (``ProviderError.kind``, e.g. ``"authentication"``,
            ``"quota_exceeded"``) that also go to the next provider although not retryable.
        fallback_attempts: logical calls per fallback provider.
        rng: ``() -> float`` in [0, 1) for the jitter (default ``random.random``).
        sleep: ``async (seconds) -> None`` used to wait (default ``asyncio.sleep``).

    Raises:
        ValueError: an attempt count below 1 or a negative delay.
    """

    name = "retry"

    def __init__(
        self,
        *,
        max_attempts: int = 2,
        initial_delay: float = 1.0,
        max_delay: float = 30.0,
        max_retry_after: float = 60.0,
        fallbacks: Sequence[Provider] = (),
        fallback_on: Collection[str] = (),
        fallback_attempts: int = 1,
        rng: Callable[[], float] = random.random,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if max_attempts < 1 or fallback_attempts < 1:
            raise ValueError("max_attempts and fallback_attempts must be at least 1")
        if initial_delay < 0 or max_delay < 0 or max_retry_after < 0:
            raise ValueError("delays must not be negative")
        self.max_attempts = max_attempts
        self.initial_delay = initial_delay
        self.max_delay = max_delay
        self.max_retry_after = max_retry_after
        self.fallbacks = tuple(fallbacks)
        self.fallback_on = frozenset(fallback_on)
        self.fallback_attempts = fallback_attempts
        self.rng = rng
        self.sleep = sleep

    def __repr__(self) -> str:
        return (f"RetryFallback(max_attempts={self.max_attempts}, initial_delay={self.initial_delay:g}, "
                f"max_delay={self.max_delay:g}, max_retry_after={self.max_retry_after:g}, "
                f"fallbacks={[_label(p) for p in self.fallbacks]}, fallback_on={sorted(self.fallback_on)}, "
                f"fallback_attempts={self.fallback_attempts})")

    # -- policy --------------------------------------------------------------------
    def delay(self, error: ProviderError, retry: int, remaining: float | None) -> float | None:
        """Seconds to wait before retry ``retry`` (1-based) after ``error``, or ``None`` to stop retrying.

        ``remaining`` is the run's wall-clock budget left (seconds), or ``None`` without one.
        """
        if not error.retryable or isinstance(error, ContextLengthExceededError):
            return None
        server = error.retry_after if isinstance(error, RateLimitError) else None
        if server is None and error.headers:
            server = parse_retry_after(error.headers)
        if server is not None:
            if server > self.max_retry_after:
                return None
            wait = server
        else:
            cap = min(self.max_delay, self.initial_delay * 2 ** (retry - 1))
            wait = cap * (0.5 + 0.5 * self.rng())
        if remaining is not None and wait >= remaining:
            return None
        return wait

    def falls_back(self, error: ProviderError) -> bool:
        """Whether ``error`` (after this provider's retries) sends the call to the next provider."""
        if isinstance(error, ContextLengthExceededError) and error.kind not in self.fallback_on:
            return False
        return error.retryable or error.kind in self.fallback_on

    # -- the hook ------------------------------------------------------------------
    async def wrap_model_call(self, request: MessageRequest, call_next: ModelCallNext,
                              ctx: RunContext) -> MessageResponse:
        """Call the primary up to ``max_attempts`` times, then each fallback; return the first success.

        Raises:
            ProviderError: the last provider's last error, when every call failed (unchanged, so the
                driver's FAILED_RETRYABLE / FAILED_TERMINAL choice follows its ``retryable`` flag).
        """
        state = ctx.state(self)
        record: dict[str, Any] = {"turn": ctx.turn, "attempts": [], "answered_by": None}
        state.setdefault("calls", []).append(record)
        chain: list[tuple[Provider | None, int]] = [(None, self.max_attempts)]
        chain += [(p, self.fallback_attempts) for p in self.fallbacks]
        last: ProviderError | None = None
        for index, (provider, attempts) in enumerate(chain):
            if last is not None and not self.falls_back(last):
                break
            waited = 0.0
            for attempt in range(1, attempts + 1):
                if last is not None and ctx.remaining_wall_clock is not None and ctx.remaining_wall_clock <= 0:
                    raise last
                try:
                    if provider is None:
                        response = await call_next(request)
                    else:
                        response = await ctx.call_provider(_for_provider(request, provider), provider=provider)
                except ProviderError as exc:
                    last = exc
                    record["attempts"].append({"provider": exc.provider or _name(provider, ctx), "index": index,
                                               "kind": exc.kind, "status": exc.status, "waited": waited})
                    if isinstance(exc, ContextLengthExceededError) and not self.falls_back(exc):
                        raise
                    wait = self.delay(exc, attempt, ctx.remaining_wall_clock) if attempt < attempts else None
                    if wait is None:
                        log.info("model call via %s failed (%s); no retry on this provider", _name(provider, ctx),
                                 exc.kind)
                        break
                    log.info("model call via %s failed (%s); retry %d in %.3f s", _name(provider, ctx), exc.kind,
                             attempt, wait)
                    await self.sleep(wait)
                    waited = wait
                    continue
                answered = {"provider": response.provider or _name(provider, ctx),
                            "model": response.model or request.model, "index": index}
                record["answered_by"] = state["answered_by"] = answered
                return response
        assert last is not None  # the loop either returned or recorded an error
        raise last


def _for_provider(request: MessageRequest, provider: Provider) -> MessageRequest:
    """The same request for ``provider``: its own model name ('' lets it fill its default)."""
    return evolve(request, model=provider.model or "")


def _name(provider: Provider | None, ctx: RunContext) -> str:
    return str(getattr(provider or ctx.provider, "name", "?"))


def _label(provider: Provider) -> str:
    return f"{getattr(provider, 'name', type(provider).__name__)}:{getattr(provider, 'model', None)}"
