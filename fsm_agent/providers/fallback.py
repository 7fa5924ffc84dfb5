"""A provider that tries a chain of providers in order (the provider layer's fallback chain).

Each provider keeps its own retries; when one fails with an error in ``on`` (by default any
retryable error, plus authentication and not-found errors that another vendor may not share),
the next is tried with the same request. A stream falls back only before it produced content,
so a consumer never sees two answers spliced together. The response's ``provider`` field names
the one that answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from ..errors import AuthenticationError, ConfigurationError, NotFoundError, ProviderError
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import StreamEvent, TextDelta, ThinkingDelta, ToolCallArgumentsDelta
from .base import Provider, ProviderCapabilities

__all__ = ["FallbackProvider"]

_CONTENT = (TextDelta, ThinkingDelta, ToolCallArgumentsDelta)


class FallbackProvider(Provider):
    """Try ``providers`` in order.

    Args:
        providers: at least one provider; the first is the primary.
        on: error classes that move on to the next provider (default: retryable errors,
            :class:`AuthenticationError`, :class:`NotFoundError`).

    Raises:
        ConfigurationError: no providers given.
    """

    def __init__(self, providers: Sequence[Provider], *, on: tuple[type[ProviderError], ...] | None = None) -> None:
        if not providers:
            raise ConfigurationError("FallbackProvider needs at least one provider")
        self.providers = list(providers)
        self.on = on
        self.name = "fallback(" + ",".join(p.name for p in self.providers) + ")"
        self.model = self.providers[0].model

    def __repr__(self) -> str:
        return f"FallbackProvider({self.providers!r})"

    @property
    def capabilities(self) -> ProviderCapabilities:
        return self.providers[0].capabilities

    def _falls_back(self, exc: ProviderError) -> bool:
        if self.on is not None:
            return isinstance(exc, self.on)
        return exc.retryable or isinstance(exc, (AuthenticationError, NotFoundError))

    async def chat(self, request: MessageRequest) -> MessageResponse:
        last: ProviderError | None = None
        for p in self.providers:
            try:
                return await p.chat(request if p is self.providers[0] else _for(p, request))
            except ProviderError as exc:
                last = exc
                if not self._falls_back(exc):
                    raise
        assert last is not None
        raise last

    async def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
        last: ProviderError | None = None
        for p in self.providers:
            produced = False
            try:
                async for ev in p.chat_stream(request if p is self.providers[0] else _for(p, request)):
                    if isinstance(ev, _CONTENT):
                        produced = True
                    if ev.TAG == "error" and not produced and p is not self.providers[-1]:
                        continue  # the next provider answers instead
                    yield ev
                return
            except ProviderError as exc:
                last = exc
                if produced or not self._falls_back(exc):
                    raise
        assert last is not None
        raise last

    async def aclose(self) -> None:
        for p in self.providers:
            await p.aclose()


def _for(provider: Provider, request: MessageRequest) -> MessageRequest:
    """The request with the fallback provider's own model."""
    from attrs import evolve

    return evolve(request, model=provider.model or request.model)
