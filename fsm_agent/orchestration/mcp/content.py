"""Content mapping of MCP tools: a ``tools/call`` result as fsm_agent content blocks (the mapping
table is in the package docstring and ``docs/mcp.md``), and what a tool returns for it."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson

from ...errors import ToolError
from ...types.content import ContentBlock, ImageBlock, TextBlock

if TYPE_CHECKING:
    from mcp.types import CallToolResult

__all__ = ["IMAGE_TYPES", "MAX_IMAGE_BYTES", "content_blocks", "result_value"]

IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
"""The image media types an MCP result's image may have to reach the model as an image (what the
providers' APIs take); any other becomes a text note."""
MAX_IMAGE_BYTES = 5 * 1024 * 1024
"""The largest image (decoded bytes) that reaches the model as an image (the smallest provider
limit, Anthropic's 5 MB); a larger one becomes a text note."""


def _text(blocks: Sequence[ContentBlock]) -> str:
    return "\n".join(b.text for b in blocks if isinstance(b, TextBlock))


def _image(data: str, mime: str | None, what: str) -> ContentBlock:
    """An image the providers take (:data:`IMAGE_TYPES`, base64, at most :data:`MAX_IMAGE_BYTES`),
    else a text note saying why it is not shown."""
    kind = (mime or "").lower()
    size = len(data) * 3 // 4
    if kind not in IMAGE_TYPES:
        why = f"its type {mime or 'is missing and'} is not one of {', '.join(sorted(IMAGE_TYPES))}"
    elif size > MAX_IMAGE_BYTES:
        why = f"it is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB"
    else:
        try:
            base64.b64decode(data, validate=True)
            return ImageBlock(data=data, media_type=kind)
        except (binascii.Error, ValueError):
            why = "its data is not base64"
    return TextBlock(f"[{what} {mime or '(no type)'}, about {size} bytes: not shown, {why}]")


def _cut(blocks: list[ContentBlock], max_chars: int) -> list[ContentBlock]:
    """The blocks with their text cut to ``max_chars`` characters in all, and a note at the end."""
    total = sum(len(b.text) for b in blocks if isinstance(b, TextBlock))
    if total <= max_chars:
        return blocks
    out: list[ContentBlock] = []
    left = max_chars
    for b in blocks:
        if isinstance(b, TextBlock):
            if left <= 0:
                continue
            b = TextBlock(b.text[:left]) if len(b.text) > left else b
            left -= len(b.text)
        out.append(b)
    out.append(TextBlock(f"[cut: the result has {total:,} characters of text; the first {max_chars:,} are shown "
                         "(MCPToolset max_result_chars)]"))
    return out


def content_blocks(result: CallToolResult, *, prefer_structured: bool = False,
                   max_chars: int | None = None) -> tuple[ContentBlock, ...]:
    """An MCP ``CallToolResult`` as fsm_agent content blocks (see the package docstring's mapping).

    ``prefer_structured``: the ``structuredContent`` JSON in place of the text blocks; ignored for
    an ``isError`` result, whose text is the error (its JSON is used only when it has no text).

    An image (or an image resource) reaches the model as an image only when its type is one of
    :data:`IMAGE_TYPES`, its data is base64 and it is at most :data:`MAX_IMAGE_BYTES`; otherwise a
    text note stands in its place. ``max_chars``: the most text characters in all (the rest is cut,
    and a last text block says so); ``None``: no limit."""
    from mcp.types import (AudioContent, BlobResourceContents, EmbeddedResource, ImageContent, ResourceLink,
                           TextContent, TextResourceContents)

    structured = result.structured_content
    if result.is_error:  # the error's own words; the structured payload only when there are none
        use_json = structured is not None and not any(isinstance(c, TextContent) for c in result.content)
    else:
        use_json = structured is not None and (prefer_structured or not result.content)
    out: list[ContentBlock] = []
    if use_json:
        out.append(TextBlock(orjson.dumps(structured, option=orjson.OPT_NON_STR_KEYS).decode()))
    for item in result.content:
        if isinstance(item, TextContent):
            if not use_json:
                out.append(TextBlock(item.text))
        elif isinstance(item, ImageContent):
            out.append(_image(item.data, item.mime_type, "image"))
        elif isinstance(item, AudioContent):
            out.append(TextBlock(f"[audio {item.mime_type}, {len(item.data) * 3 // 4} bytes: not shown]"))
        elif isinstance(item, EmbeddedResource):
            res = item.resource
            mime = f" ({res.mime_type})" if res.mime_type else ""
            if isinstance(res, TextResourceContents):
                out.append(TextBlock(f"[resource {res.uri}{mime}]\n{res.text}"))
            elif isinstance(res, BlobResourceContents) and (res.mime_type or "").startswith("image/"):
                out.append(_image(res.blob, res.mime_type, f"resource {res.uri}, image"))
            else:
                out.append(TextBlock(f"[resource {res.uri}{mime}, {len(res.blob) * 3 // 4} bytes of binary data: "
                                     "not shown]"))
        elif isinstance(item, ResourceLink):
            parts = [f"[resource link {item.uri}", f" {item.name!r}" if item.name else "",
                     f" ({item.mime_type})" if item.mime_type else "", "]",
                     f" {item.description}" if item.description else ""]
            out.append(TextBlock("".join(parts)))
    if max_chars is not None:
        out = _cut(out, max_chars)
    return tuple(out)



def result_value(result: CallToolResult, remote_name: str, *, prefer_structured: bool,
                 max_chars: int | None) -> Any:
    """What the MCP tool ``remote_name`` returns for ``result``: its content blocks
    (:func:`content_blocks`), or a note when it has none.

    Raises:
        ToolError: (kind ``mcp_tool_error``) an ``isError`` result, carrying its content (a note when
            it has none) and its text as the message.
    """
    blocks = content_blocks(result, prefer_structured=prefer_structured, max_chars=max_chars)
    if result.is_error:
        if not blocks:
            blocks = (TextBlock(f"MCP tool {remote_name!r} reported an error without a message."),)
        raise ToolError(_text(blocks), content=blocks, kind="mcp_tool_error")
    return blocks or "(the tool returned no content)"
