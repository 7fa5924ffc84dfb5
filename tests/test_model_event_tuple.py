"""``on_model_event`` may put a tuple of events in the place of one (the hook a holding filter needs
to release held text before a block's end): each passes the middleware after it, in order, and
reaches the observers; ``()`` hides the event like ``None``. A stream that raises without an
``ErrorEvent`` of its own gets one through the filters, so held text is never stranded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from attrs import evolve

from conftest import Recorder
from fsm_agent import Agent, Middleware, ScriptedProvider, StopReason
from fsm_agent.errors import ProviderError
from fsm_agent.providers import Provider, ProviderCapabilities
from fsm_agent.types import (ContentBlockEnd, ContentBlockStart, ErrorEvent, MessageComplete, MessageRequest,
                             MessageResponse, MessageStart, ModelStreamEvent, StreamEvent, TextDelta)


class Splitter(Middleware):
    """Cuts each text delta in two and hides every block end."""

    name = "splitter"

    def on_model_event(self, event: StreamEvent, ctx: Any) -> Any:
        if isinstance(event, TextDelta):
            half = len(event.text) // 2
            return (evolve(event, text=event.text[:half]), evolve(event, text=event.text[half:]))
        if isinstance(event, ContentBlockEnd):
            return ()
        return event


class Marker(Middleware):
    """Sees what the splitter hands on: wraps each text delta's text in brackets."""

    name = "marker"

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_model_event(self, event: StreamEvent, ctx: Any) -> Any:
        self.seen.append(type(event).__name__)
        return evolve(event, text=f"[{event.text}]") if isinstance(event, TextDelta) else event


async def test_a_tuple_of_events_passes_the_later_middleware_one_by_one_and_reaches_the_observers() -> None:
    rec = Recorder()
    marker = Marker()
    agent = Agent(ScriptedProvider(["abcdef"]), middleware=[Splitter(), marker], observers=[rec])
    result = await agent.run("go")
    assert result.output == "abcdef"  # the answer is the model's: filters change what is watched
    streamed = [e.event for e in rec.of(ModelStreamEvent)]
    assert [e.text for e in streamed if isinstance(e, TextDelta)] == ["[abc]", "[def]"]
    assert not [e for e in streamed if isinstance(e, ContentBlockEnd)]  # () hid them from the observers
    assert marker.seen.count("TextDelta") == 2 and "ContentBlockEnd" not in marker.seen


class Holder(Middleware):
    """Holds every text delta back and releases the text, joined, before the event that ends the stream."""

    name = "holder"

    def __init__(self) -> None:
        self.held = ""

    def on_model_event(self, event: StreamEvent, ctx: Any) -> Any:
        if isinstance(event, TextDelta):
            self.held += event.text
            return None
        if isinstance(event, (MessageComplete, ErrorEvent)) and self.held:
            out, self.held = (TextDelta(0, self.held), event), ""
            return out
        return event


class RaisingProvider(Provider):
    """Streams some text, then raises with no ``ErrorEvent`` (as a provider of one's own may)."""

    name = "raising"
    model = "raising-model"

    @property
    def capabilities(self) -> ProviderCapabilities:
        return ProviderCapabilities()

    async def chat(self, request: MessageRequest) -> MessageResponse:  # pragma: no cover - the test streams
        raise AssertionError("streams only")

    async def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
        yield MessageStart("r1", self.model)
        yield ContentBlockStart(0, "text")
        yield TextDelta(0, "half an ")
        yield TextDelta(0, "answer")
        raise ProviderError("connection reset by peer", provider=self.name, retryable=False)


async def test_a_stream_that_raises_without_an_error_event_gives_the_filters_one_so_held_text_comes_out() -> None:
    rec = Recorder()
    result = await Agent(RaisingProvider(), middleware=[Holder()], observers=[rec]).run("go")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.partial == "half an answer"
    streamed = [e.event for e in rec.of(ModelStreamEvent)]
    assert [type(e) for e in streamed] == [MessageStart, ContentBlockStart, TextDelta, ErrorEvent]
    assert streamed[2] == TextDelta(0, "half an answer")
    assert (streamed[3].kind, streamed[3].message) == ("provider_error", "[raising] connection reset by peer")


async def test_a_stream_that_sent_its_own_error_event_gets_no_second_one() -> None:
    class SaysError(RaisingProvider):
        async def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
            yield MessageStart("r1", self.model)
            yield TextDelta(0, "half")
            yield ErrorEvent("provider_error", "boom")
            raise ProviderError("boom", provider=self.name, retryable=False)

    rec = Recorder()
    await Agent(SaysError(), middleware=[Holder()], observers=[rec]).run("go")
    streamed = [e.event for e in rec.of(ModelStreamEvent)]
    assert streamed == [MessageStart("r1", "raising-model"), TextDelta(0, "half"), ErrorEvent("provider_error", "boom")]
