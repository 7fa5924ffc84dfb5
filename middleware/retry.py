"""RetryFallback: retry a failed model call with backoff, then fall back to other providers.

One middleware rather than two, so that one place decides when the primary is
given up and the fallback chain starts (two separate layers would each need to
know the other's retry budget and the wall clock).

Layering — three levels of retry, each outside the one below:

1. **Provider, per HTTP attempt** (:class:`fsm_agent.RetryPolicy`, inside
   ``Provider.chat`` / ``chat_stream``): default 3 attempts, waits from 0.5 s,
   honouring Retry-After up to 60 s, never past the run's deadline. A
   stream that already yielded content is not retried there.
2. **This middleware, per logical model call** (``wrap_model_call``, outside the
   provider's retries): ``max_attempts`` calls of ``call_next`` (the rest of the
   chain and the provider), so a call that failed after the provider's own
   retries (or mid-stream, or a provider without retries) is tried again whole.
   Worst case on the primary: ``max_attempts × RetryPolicy.max_attempts`` HTTP
   requests — 2 × 3 = 6 with the defaults, which is why ``max_attempts`` is 2.
3. **Fallbacks**: when the primary's last error is retryable (or its kind is in
   ``fallback_on``), each fallback provider is called in order with the same
   request (``model`` replaced by the fallback's, by :class:`~fsm_agent.providers.FallbackRule`) through
   ``ctx.call_provider(request, provider=...)``: the runtime's streaming path, so
   observers see its deltas. Each fallback gets ``fallback_attempts`` logical
   calls (default 1; its own HTTP retries still apply). Middleware listed inside
   this one do not run for fallback calls — list RetryFallback first.
   An empty response (no text, no tool call: :class:`~fsm_agent.errors.EmptyResponseError`, or an
   empty answer returned) goes to the next provider at once, without this layer's retries on the
   same one (seed 000 §5.2.6: the one retry after an empty response may switch provider). The
   provider's own HTTP layer still retries an empty answer ``RetryPolicy.empty_response_retries``
   times (one) first; give the primary ``ProviderConfig(retry=RetryPolicy(empty_response_retries=0))``
   to make the next provider the only retry.

The rules live in the provider layer, not here, so both layers agree:

- **Backoff** is :class:`fsm_agent.providers.RetryPolicy` (the same object the provider's HTTP
  retries use; pass ``policy=`` to share one). Retry n (1-based) of a provider waits uniformly in
  ``[base(n), min(2 * base(n), max_delay)]`` seconds, ``base(n) = min(max_delay, initial_delay *
  2**(n-1))``: never below its base. A server's Retry-After (``RateLimitError.retry_after``, else
  the ``retry-after-ms`` / ``retry-after`` headers) is waited exactly instead; one above
  ``max_retry_after``, or any wait that would not end before the run's wall-clock budget
  (``ctx.remaining_wall_clock`` and the driver's ``call_deadline``), ends the retries of that
  provider at once. With no budget left at all, no further call starts and the last error is raised.
- **Never retried** (:func:`fsm_agent.providers.may_retry`): errors with ``retryable=False``
  (authentication, permission, invalid request, quota ...), HTTP 400, 401, 403, 404 and 422 whatever
  the flag says, and :class:`~fsm_agent.errors.ContextLengthExceededError` (raised at once; the
  driver re-trims and retries once).
- **Which errors move to the next provider, and the model name it is sent**:
  :class:`fsm_agent.providers.FallbackRule`, the rule :class:`~fsm_agent.providers.FallbackProvider`
  uses too. Here its ``also`` is ``fallback_on``: listed kinds (e.g. ``"context_length_exceeded"``
  for a fallback with a larger window) go to the next provider without retries.

Result: the response of the first call that succeeds. Otherwise the last error
is raised unchanged, and the driver ends the run FAILED_RETRYABLE or
FAILED_TERMINAL from its ``retryable`` flag. A failed attempt is not an answer, even
when it had streamed text (observers saw those deltas): every attempt sends the same
request, nothing of a failed one enters the conversation (an Interrupt during the
wait keeps none of it), and the run's stop carries the last failed attempt's text as
``stop.partial``. ``ctx.state(self)`` records every
logical call: ``calls`` (list of ``{"turn", "attempts": [{"provider", "index",
"kind", "status", "waited"}], "answered_by"}``) and ``answered_by`` (the latest
``{"provider", "model", "index"}``; index 0 is the primary). The response's own
``provider`` field names the profile that served it.

Every retry made here is announced with a :class:`fsm_agent.ModelRetry` event (``layer="retry"``:
status, kind, the error's message as ``reason``, the chosen ``delay_s``, ``server_hint`` when the
wait is the server's Retry-After), queued with ``ctx.emit`` before the wait: observers get it and
the session log records it as ``model_retry``. The provider's own HTTP retries are announced the same
way by the runtime (``layer="provider"``). A stop because the server's wait is longer than what is
left of the budget (or than ``max_retry_after``) carries the wait as ``error["retry_after_s"]``, and
its message says so.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from fsm_agent import MessageRequest, MessageResponse, Middleware, ModelRetry, Provider, RunContext
from fsm_agent.errors import ContextLengthExceededError, EmptyResponseError, ProviderError
from fsm_agent.providers import FallbackRule, RetryPolicy

__all__ = ["RetryFallback"]

log = logging.getLogger("fsm_agent.middleware.retry")

ModelCallNext = Callable[[MessageRequest], Awaitable[MessageResponse]]


class RetryFallback(Middleware):
    """Retry the model call with backoff, then try fallback providers (see the module doc).

    Args:
        max_attempts: logical calls on the primary, the first included (1: no retries here).
        initial_delay: seconds; the base of the first retry's wait.
        max_delay: seconds; the longest computed wait.
        max_retry_after: seconds; a longer server-requested wait ends this provider's retries.
        fallbacks: providers tried in order after the primary gives up.
        fallback_on: error kinds (``ProviderError.kind``, e.g. ``"authentication"``,
            ``"quota_exceeded"``) that also go to the next provider although not retryable.
        fallback_attempts: logical calls per fallback provider.
        rng: ``() -> float`` in [0, 1) for the jitter (default ``ctx.random``, the run's: a replay draws alike).
        sleep: ``async (seconds) -> None`` used to wait (default ``ctx.sleep``, the run's timers).
        policy: a whole :class:`~fsm_agent.providers.RetryPolicy` (e.g. the one given to the
            provider's ``ProviderConfig``), used instead of the five arguments above.

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
        rng: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[Any]] | None = None,
        policy: RetryPolicy | None = None,
    ) -> None:
        if max_attempts < 1 or fallback_attempts < 1:
            raise ValueError("max_attempts and fallback_attempts must be at least 1")
        if policy is None:
            policy = RetryPolicy(max_attempts=max_attempts, initial_delay=initial_delay, max_delay=max_delay,
                                 max_retry_after=max_retry_after, rng=rng, sleep=sleep)
        self.policy = policy
        self.fallbacks = tuple(fallbacks)
        self.fallback_on = frozenset(fallback_on)
        self.rule = FallbackRule(also=self.fallback_on)
        self.fallback_attempts = fallback_attempts

    @property
    def max_attempts(self) -> int:
        return self.policy.max_attempts

    @property
    def initial_delay(self) -> float:
        return self.policy.initial_delay

    @property
    def max_delay(self) -> float:
        return self.policy.max_delay

    @property
    def max_retry_after(self) -> float:
        return self.policy.max_retry_after

    def __repr__(self) -> str:
        return (f"RetryFallback(max_attempts={self.max_attempts}, initial_delay={self.initial_delay:g}, "
                f"max_delay={self.max_delay:g}, max_retry_after={self.max_retry_after:g}, "
                f"fallbacks={[_label(p) for p in self.fallbacks]}, fallback_on={sorted(self.fallback_on)}, "
                f"fallback_attempts={self.fallback_attempts})")

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
        chain: list[tuple[Provider | None, int]] = [(None, self.policy.max_attempts)]
        chain += [(p, self.fallback_attempts) for p in self.fallbacks]
        last: ProviderError | None = None
        for index, (provider, attempts) in enumerate(chain):
            if last is not None and not self.rule.falls_back(last):
                break
            waited = 0.0
            for attempt in range(1, attempts + 1):
                if last is not None and ctx.remaining_wall_clock is not None and ctx.remaining_wall_clock <= 0:
                    raise last
                try:
                    if provider is None:
                        response = await call_next(request)
                    else:
                        response = await ctx.call_provider(self.rule.request_for(provider, request),
                                                           provider=provider)
                    if response.is_empty and index < len(chain) - 1:
                        raise EmptyResponseError("the model returned an empty response (no text, no tool call)",
                                                 provider=response.provider or _name(provider, ctx), partial=response)
                except ProviderError as exc:
                    last = exc
                    record["attempts"].append({"provider": exc.provider or _name(provider, ctx), "index": index,
                                               "kind": exc.kind, "status": exc.status, "waited": waited})
                    if isinstance(exc, ContextLengthExceededError) and not self.rule.falls_back(exc):
                        raise
                    if isinstance(exc, EmptyResponseError) and index < len(chain) - 1:
                        # the one retry after an empty response goes to the next provider (seed 000 §5.2.6)
                        log.info("model call via %s gave an empty response; the next provider retries it",
                                 _name(provider, ctx))
                        break
                    # chance and waits through the run's context, so that a replay of the run waits alike
                    wait = self.policy.delay(exc, attempt, ctx.random if self.policy.rng is None else None,
                                             attempts=attempts, remaining=ctx.remaining_wall_clock)
                    if wait is None:
                        log.info("model call via %s failed (%s); no retry on this provider", _name(provider, ctx),
                                 exc.kind)
                        break
                    log.info("model call via %s failed (%s); retry %d in %.3f s", _name(provider, ctx), exc.kind,
                             attempt, wait)
                    ctx.emit(ModelRetry(ctx.session_id, ctx.turn, attempt, exc.status, exc.kind, exc.message[:2000],
                                        wait, server_hint=exc.retry_after is not None,
                                        provider=exc.provider or _name(provider, ctx), layer="retry"))
                    await (ctx.sleep(wait) if self.policy.sleep is None else self.policy.wait(wait))
                    waited = wait
                    continue
                answered = {"provider": response.provider or _name(provider, ctx),
                            "model": response.model or request.model, "index": index}
                record["answered_by"] = state["answered_by"] = answered
                return response
        assert last is not None  # the loop either returned or recorded an error
        raise last


def _name(provider: Provider | None, ctx: RunContext) -> str:
    return str(getattr(provider or ctx.provider, "name", "?"))


def _label(provider: Provider) -> str:
    return f"{getattr(provider, 'name', type(provider).__name__)}:{getattr(provider, 'model', None)}"
