"""The Chat Completions provider: the HTTP endpoint, with the request mapping (:mod:`.request`), the
response decoder (:mod:`.response`) and the stream parser (:mod:`.stream`) of the protocol."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from ...types.requests import MessageRequest, MessageResponse
from ..base import HttpProvider, StreamParser
from .request import request_body
from .response import parse_completion
from .stream import OpenAIChatStreamParser

__all__ = ["OpenAIChatProvider"]


class OpenAIChatProvider(HttpProvider):
    """Chat Completions over aiohttp, for every OpenAI-compatible profile."""

    protocol = "openai-chat"

    @property
    def vendor(self) -> str:
        """The endpoint this provider talks to, as recorded on what it decodes: the profile name, plus
        ``@host[:port]`` when the base URL is not the profile's own (any ``openai-compatible`` or
        local server). Reasoning and vendor fields are sent back only to the same vendor."""
        host = urlsplit(self.base_url).netloc
        own = urlsplit(self.profile.base_url).netloc if self.profile.base_url else None
        return self.profile.name if host == own else f"{self.profile.name}@{host}"

    def endpoint(self, request: MessageRequest, stream: bool) -> str:
        return "/chat/completions"

    def build_body(self, request: MessageRequest, stream: bool) -> dict[str, Any]:
        model = request.model or self.model
        return request_body(request, self.wire_profile(model), model=model, vendor=self.vendor, provider=self.name,
                            stream=stream)

    def parse_response(self, data: dict[str, Any]) -> MessageResponse:
        return parse_completion(data, self.name, self.vendor)

    def stream_parser(self) -> StreamParser:
        return OpenAIChatStreamParser(self.name, self.vendor)
