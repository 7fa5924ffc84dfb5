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
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Iterable, Sequence

from attrs import evolve, field, frozen

from ..errors import ConfigurationError, ProviderError
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import StreamEvent, TextDelta, ThinkingDelta, ToolCallArgumentsDelta
from .base import Provider, ProviderCapabilities, may_retry

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
        last: ProviderError | None = None
        for p in self.providers:
            try:
                return await p.chat(self._request(p, request))
            except ProviderError as exc:
                last = exc
                if not self.rule.falls_back(exc):
                    raise
        assert last is not None
        raise last

    async def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
        last: ProviderError | None = None
        for p in self.providers:
            produced = False
            held: StreamEvent | None = None
            try:
                async for ev in p.chat_stream(self._request(p, request)):
                    if isinstance(ev, _CONTENT):
                        produced = True
                    if ev.TAG == "error" and not produced and p is not self.providers[-1]:
                        held = ev  # the next provider may answer instead
                        continue
                    yield ev
                return
            except ProviderError as exc:
                last = exc
                if produced or not self.rule.falls_back(exc):
                    if held is not None:
                        yield held
                    raise
        assert last is not None
        raise last

    async def aclose(self) -> None:
        for p in self.providers:
            await p.aclose()
