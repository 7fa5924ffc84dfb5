"""The vendor record of the Chat Completions protocol: what fsm_agent does not model, kept on the block
it came with and sent back to the vendor that produced it, and to no other (C03-C05).

The record sits under ``provider_data["openai-chat"]`` (:data:`SOURCE`) with the ``vendor`` that produced
the block (:attr:`~fsm_agent.providers.openai_chat.OpenAIChatProvider.vendor`): a tool call's extra keys
(Gemini's ``extra_content``), OpenRouter's ``reasoning_details`` (on the thinking block), and the field
reasoning text came under (``reasoning_content`` or ``reasoning``). The decoders
(:mod:`.response`, :mod:`.stream`) write it; the request mapping (:mod:`.request`) reads it back.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SOURCE", "TOOL_CALL_KEYS", "merge_reasoning_details", "merge_vendor_fields", "thinking_data",
           "tool_vendor_fields", "vendor_data"]

SOURCE = "openai-chat"
"""The protocol's name on what it decodes: a block's ``source`` and its ``provider_data`` key."""

TOOL_CALL_KEYS = frozenset({"index", "id", "type", "function"})
"""Keys of a ``tool_calls`` entry the protocol defines; any other key is a vendor field (Gemini's
``extra_content``), kept on the block and sent back only to the vendor it came from."""


def vendor_data(block: Any) -> dict[str, Any]:
    """This protocol's vendor record on a block (``provider_data["openai-chat"]``), or ``{}``.

    ``vendor`` names the endpoint that produced the block (:attr:`OpenAIChatProvider.vendor`); the
    other keys are wire fields fsm_agent does not model: ``fields`` (extra keys of a tool call),
    ``field`` (the name reasoning text came under), ``reasoning_details`` (OpenRouter)."""
    pd = getattr(block, "provider_data", None)
    data = pd.get(SOURCE) if isinstance(pd, dict) else None
    return data if isinstance(data, dict) else {}


def merge_vendor_fields(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Fold the vendor fields of a later stream fragment into those of earlier ones: objects merge
    key by key, arrays extend, anything else replaces; ``null`` adds nothing."""
    out = dict(old)
    for k, v in new.items():
        if v is None:
            continue
        cur = out.get(k)
        if isinstance(cur, dict) and isinstance(v, dict):
            out[k] = merge_vendor_fields(cur, v)
        elif isinstance(cur, list) and isinstance(v, list):
            out[k] = cur + v
        else:
            out[k] = v
    return out


def merge_reasoning_details(entries: list[Any], new: Any) -> list[Any]:
    """OpenRouter's ``reasoning_details`` of one more chunk folded into ``entries``.

    A stream sends an entry in pieces that share its ``index`` and ``type`` (``reasoning.text``
    text a few tokens at a time): their ``text``/``summary``/``data`` strings are joined and other
    keys kept from the first piece (a later value fills a missing one). Entries without an index,
    or with a new one, are appended unchanged, so a non-streamed array comes back as received."""
    out = list(entries)
    for e in new if isinstance(new, list) else ():
        if not isinstance(e, dict):
            continue
        idx = e.get("index")
        at = None
        if isinstance(idx, int):
            at = next((j for j in range(len(out) - 1, -1, -1)
                       if isinstance(out[j], dict) and out[j].get("index") == idx), None)
        if at is None or out[at].get("type") != e.get("type"):
            out.append(dict(e))
            continue
        merged = dict(out[at])
        for k, v in e.items():
            if k in ("text", "summary", "data") and isinstance(v, str) and isinstance(merged.get(k), str):
                merged[k] = merged[k] + v
            elif merged.get(k) is None:
                merged[k] = v
        out[at] = merged
    return out


def thinking_data(vendor: str | None, field_name: str | None,
                  details: list[Any] | None = None) -> dict[str, Any] | None:
    """The ``provider_data`` of a decoded thinking block: the ``vendor``, the wire field its text came
    under and OpenRouter's ``reasoning_details``, each only when known; ``None`` when none is."""
    rec: dict[str, Any] = {}
    if vendor is not None:
        rec["vendor"] = vendor
    if field_name is not None:
        rec["field"] = field_name
    if details:
        rec["reasoning_details"] = details
    return {SOURCE: rec} if rec else None


def tool_vendor_fields(tc: dict[str, Any]) -> dict[str, Any]:
    """The vendor fields of one ``tool_calls`` entry: its keys outside :data:`TOOL_CALL_KEYS` that are not null."""
    return {k: v for k, v in tc.items() if k not in TOOL_CALL_KEYS and v is not None}

