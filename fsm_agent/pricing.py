"""Prices (USD per million tokens) and the cost of a call.

Each price carries the date it was read and its source page, so a reviewer
can check it; prices change, and a model missing here has no cost (``None``),
never a guessed one. Cached input tokens are billed at ``cached_input``
(OpenAI: a subset of input; Anthropic: reported separately, billed at the
cache-read rate). Override or extend with :func:`register_price`.

A leaf module: it imports nothing from fsm_agent at run time, so every layer (the stream
types included) may use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attrs import frozen

if TYPE_CHECKING:
    from .types.messages import Usage

__all__ = ["PRICES", "Price", "cost_usd", "price_for", "register_price"]


@frozen
class Price:
    """USD per 1,000,000 tokens."""

    input: float
    output: float
    cached_input: float | None = None
    """Rate for cache-read input tokens; ``None``: same as ``input``."""
    cache_write: float | None = None
    """Rate for cache-write tokens (Anthropic); ``None``: same as ``input``."""
    date: str = ""
    """When the price was read (ISO date)."""
    source: str = ""
    """Where it was read (the vendor's pricing page)."""


_OPENAI = "https://openai.com/api/pricing/"
_ANTHROPIC = "https://docs.anthropic.com/en/docs/about-claude/pricing"
_DEEPSEEK = "https://api-docs.deepseek.com/quick_start/pricing"
_QWEN = "https://help.aliyun.com/zh/model-studio/models"

PRICES: dict[str, Price] = {
    "gpt-4o": Price(2.50, 10.00, 1.25, date="2025-06-01", source=_OPENAI),
    "gpt-4o-mini": Price(0.15, 0.60, 0.075, date="2025-06-01", source=_OPENAI),
    "gpt-4.1": Price(2.00, 8.00, 0.50, date="2025-06-01", source=_OPENAI),
    "gpt-4.1-mini": Price(0.40, 1.60, 0.10, date="2025-06-01", source=_OPENAI),
    "gpt-5": Price(1.25, 10.00, 0.125, date="2025-08-07", source=_OPENAI),
    "gpt-5-mini": Price(0.25, 2.00, 0.025, date="2025-08-07", source=_OPENAI),
    "o3-mini": Price(1.10, 4.40, 0.55, date="2025-06-01", source=_OPENAI),
    "claude-sonnet-4": Price(3.00, 15.00, 0.30, 3.75, date="2025-06-01", source=_ANTHROPIC),
    "claude-sonnet-4-5": Price(3.00, 15.00, 0.30, 3.75, date="2025-09-29", source=_ANTHROPIC),
    "claude-opus-4": Price(15.00, 75.00, 1.50, 18.75, date="2025-06-01", source=_ANTHROPIC),
    "claude-3-5-haiku": Price(0.80, 4.00, 0.08, 1.00, date="2025-06-01", source=_ANTHROPIC),
    "claude-3-7-sonnet": Price(3.00, 15.00, 0.30, 3.75, date="2025-06-01", source=_ANTHROPIC),
    "deepseek-chat": Price(0.27, 1.10, 0.07, date="2025-06-01", source=_DEEPSEEK),
    "deepseek-reasoner": Price(0.55, 2.19, 0.14, date="2025-06-01", source=_DEEPSEEK),
    "qwen-plus": Price(0.40, 1.20, date="2025-06-01", source=_QWEN),
    "qwen-max": Price(1.60, 6.40, date="2025-06-01", source=_QWEN),
    "qwen3-max": Price(1.20, 6.00, date="2025-09-24", source=_QWEN),
    "SmolLM2-135M-Instruct": Price(0.0, 0.0, date="2025-02-07", source="local model: no charge"),
}
"""Known prices by model name (longest prefix wins: ``gpt-4o-2024-08-06`` uses ``gpt-4o``)."""


def register_price(model: str, price: Price) -> None:
    """Add or replace the price of ``model`` (a name or a prefix)."""
    PRICES[model] = price


def price_for(model: str) -> Price | None:
    """The price of ``model``: an exact entry, else the longest known prefix, else ``None``."""
    if model in PRICES:
        return PRICES[model]
    best = None
    for name in PRICES:
        if model.startswith(name) and (best is None or len(name) > len(best)):
            best = name
    return PRICES[best] if best else None


def cost_usd(model: str, usage: Usage) -> float | None:
    """USD for ``usage`` on ``model``, or ``None`` when the model has no known price."""
    p = price_for(model)
    if p is None:
        return None
    cached = min(usage.cache_read_tokens, usage.input_tokens)
    fresh = usage.input_tokens - cached
    total = fresh * p.input + cached * (p.cached_input if p.cached_input is not None else p.input)
    total += usage.cache_write_tokens * (p.cache_write if p.cache_write is not None else p.input)
    total += usage.output_tokens * p.output
    return total / 1_000_000
