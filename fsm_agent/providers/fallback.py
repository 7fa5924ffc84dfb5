"""The fallback chain: which errors move a call to the next provider, and what that provider is sent.

:class:`FallbackRule` is the one home of both rules. Two things walk a chain with it:
:class:`FallbackProvider` (a provider that tries providers in order, below the middleware) and the
``retry`` plugin (``fsm_agent_middleware.retry.RetryFallback``, per logical call, through the
runtime's streaming path). Neither has rules of its own.

The rule: an error moves on when sending the same request again may succeed
(:func:`~fsm_agent.providers.may_retry`: retryable, and not HTTP 400/401/403/404/422, and not a
context-length error), or when its kind (``ProviderError.kind``) is listed in ``also``. The next
provider gets the same request with ``model`` replaced by its own model name (``""`` when it has
none, so that it fills its default); the first provider gets the request unchanged.

:class:`FallbackProvider` keeps each provider's own retries; a stream falls back only before it
produced content, so a consumer never sees two answers spliced together. The response's
``provider`` field names the one that answered.

An empty response (no text, no tool call: :class:`~fsm_agent.errors.EmptyResponseError`, or an
empty answer a provider returned without raising) is retried once (seed 000 §5.2.6); in a chain that
one retry goes to the next provider: a provider that has a next one does not retry an empty answer
itself (:data:`~fsm_agent.providers.base.retry_empty_elsewhere`), the last one keeps its own policy.
Every move to the next provider is announced like a provider's own retry (a ``model_retry`` event in
a run's session log: the failed provider, the error's kind, ``delay_s`` 0).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Collection, Iterable, Sequence
from contextlib import aclosing

from attrs import evolve, field, frozen

from ..errors import ConfigurationError, EmptyResponseError, ProviderError
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import MessageComplete, StreamEvent, TextDelta, ThinkingDelta, ToolCallArgumentsDelta
from .base import Provider, ProviderCapabilities, announce_retry, may_retry, retry_empty_elsewhere

__all__ = ["FallbackProvider", "FallbackRule"]

_CONTENT = (TextDelta, ThinkingDelta, ToolCallArgumentsDelta)


def _kinds(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


@frozen
class FallbackRule:
    """When an error sends a call to the next provider of a chain, and the request that provider gets.

    Attributes:
        also: error kinds (``ProviderError.kind``: ``"authentication"``, ``"not_found"``,
            ``"quota_exceeded"``, ``"context_length_exceeded"`` ...) that move on although
            they are not retried.
        only: when set, exactly these error classes move on and nothing else (replaces the rule).
    """

    also: frozenset[str] = field(default=frozenset(), converter=_kinds)
    only: tuple[type[ProviderError], ...] | None = None

    def falls_back(self, error: ProviderError) -> bool:
        """Whether ``error`` (after the provider's own retries) sends the call to the next provider."""
        if self.only is not None:
            return isinstance(error, self.only)
        return error.kind in self.also or may_retry(error)

    @staticmethod
    def request_for(provider: Provider, request: MessageRequest) -> MessageRequest:
        """``request`` for a fallback ``provider``: its own model name (``""`` lets it fill its default)."""
        return evolve(request, model=provider.model or "")


DEFAULT_PROVIDER_RULE = FallbackRule(also=frozenset({"authentication", "not_found"}))
""":class:`FallbackProvider`'s default: retryable errors, plus authentication and not-found errors
(another vendor's key and model names differ)."""


class FallbackProvider(Provider):
    """Try ``providers`` in order.

    Args:
        providers: at least one provider; the first is the primary.
        on: error classes that move on to the next provider, and only those (shorthand for
            ``rule=FallbackRule(only=on)``).
        also: error kinds that move on besides the retryable errors (shorthand for
            ``rule=FallbackRule(also=also)``).
        rule: the whole rule (default :data:`DEFAULT_PROVIDER_RULE`: retryable errors,
            authentication and not-found errors).

    Raises:
        ConfigurationError: no providers given, or more than one of ``on``, ``also`` and ``rule``.
    """

    def __init__(self, providers: Sequence[Provider], *, on: tuple[type[ProviderError], ...] | None = None,
                 also: Collection[str] | None = None, rule: FallbackRule | None = None) -> None:
        if not providers:
            raise ConfigurationError("FallbackProvider needs at least one provider")
        if sum(x is not None for x in (on, also, rule)) > 1:
            raise ConfigurationError("FallbackProvider takes one of on=, also= and rule=")
        self.providers = list(providers)
        if rule is None:
            if on is not None:
                rule = FallbackRule(only=tuple(on))
            elif also is not None:
                rule = FallbackRule(also=frozenset(also))
            else:
                rule = DEFAULT_PROVIDER_RULE
        self.rule = rule
        self.on = on
        # whether an empty response moves on (the default rule: yes); when not, each provider keeps its own retry
        self._empty_moves_on = rule.falls_back(EmptyResponseError("an empty response"))
        self.name = "fallback(" + ",".join(p.name for p in self.providers) + ")"
        self.model = self.providers[0].model

    def __repr__(self) -> str:
        return f"FallbackProvider({self.providers!r})"

    @property
    def capabilities(self) -> ProviderCapabilities:
        return self.providers[0].capabilities

    def _request(self, provider: Provider, request: MessageRequest) -> MessageRequest:
        return request if provider is self.providers[0] else self.rule.request_for(provider, request)

    async def chat(self, request: MessageRequest) -> MessageResponse:
        """Ask each provider in turn until one answers (see the class doc).

        Raises:
            ProviderError: the first error the rule does not move on, else the last provider's.
        """
        last: ProviderError | None = None
        for n, p in enumerate(self.providers):
            has_next = n < len(self.providers) - 1
            if last is not None:
                await announce_retry(last, n, 0.0)
            token = retry_empty_elsewhere.set(True) if has_next and self._empty_moves_on else None
            try:
                response = await p.chat(self._request(p, request))
            except ProviderError as exc:
                last = exc
                if not has_next or not self.rule.falls_back(exc):
                    raise
                continue
            finally:
                if token is not None:
                    retry_empty_elsewhere.reset(token)
            if has_next and response.is_empty:
                empty = _empty(p, response)
                if self.rule.falls_back(empty):
                    last = empty
                    continue
            return response
        assert last is not None
        raise last

    async def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
        """Stream from each provider in turn until one answers; only before content (see the class doc).

        Raises:
            ProviderError: as :meth:`chat`; an error after content was yielded is raised as it is.
        """
        last: ProviderError | None = None
        for n, p in enumerate(self.providers):
            has_next = n < len(self.providers) - 1
            if last is not None:
                await announce_retry(last, n, 0.0)
            produced = False
            held: StreamEvent | None = None
            try:
                elsewhere = has_next and self._empty_moves_on
                async with aclosing(_scoped(p.chat_stream(self._request(p, request)), elsewhere)) as events:
                    async for ev in events:
                        if isinstance(ev, _CONTENT) and getattr(ev, "text", True) != "":
                            produced = True  # an empty delta (a scripted empty answer's) is not content
                        if ev.TAG == "error" and not produced and has_next:
                            held = ev  # the next provider may answer instead
                            continue
                        if (has_next and not produced and isinstance(ev, MessageComplete)
                                and ev.full_response.is_empty):
                            empty = _empty(p, ev.full_response)
                            if self.rule.falls_back(empty):
                                raise empty  # the next provider is the one retry
                        yield ev
                return
            except ProviderError as exc:
                last = exc
                if produced or not has_next or not self.rule.falls_back(exc):
                    if held is not None:
                        yield held
                    raise
        assert last is not None
        raise last

    async def aclose(self) -> None:
        for p in self.providers:
            await p.aclose()


def _empty(provider: Provider, response: MessageResponse) -> EmptyResponseError:
    return EmptyResponseError("the model returned an empty response (no text, no tool call)",
                              provider=response.provider or provider.name, partial=response)


async def _scoped(stream: AsyncIterator[StreamEvent], elsewhere: bool) -> AsyncGenerator[StreamEvent, None]:
    """``stream`` with :data:`retry_empty_elsewhere` set while it runs (not while its consumer does),
    when ``elsewhere``: the chain's next provider retries an empty response."""
    try:
        while True:
            token = retry_empty_elsewhere.set(True) if elsewhere else None
            try:
                ev = await stream.__anext__()
            except StopAsyncIteration:
                return
            finally:
                if token is not None:
                    retry_empty_elsewhere.reset(token)
            yield ev
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
