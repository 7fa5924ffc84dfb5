"""Running tool calls: validate, execute in parallel with a timeout each, always return a result.

Seed 004 §2: the calls of one turn form a batch, but each has its own argument
check, permission, timeout and result. Whatever goes wrong with one call (an
unknown tool, arguments that are not JSON or break the schema, an exception,
a timeout) becomes an error :class:`~fsm_agent.types.ToolResultMessage` the
model sees; it never ends the run and never affects the other calls.

Sync tools run in a worker thread (``asyncio.to_thread``). A timed-out sync
tool cannot be stopped: its thread runs to completion in the background, and
its result is discarded.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import orjson

from ..control import Decision
from ..errors import SuspendCall, ToolArgumentsError, ToolError
from ..types.codec import unstructure
from ..types.content import ContentBlock, ImageBlock, TextBlock, ToolUseBlock
from ..types.messages import ToolResultMessage
from .registry import Tool, ToolContext, ToolRegistry, ToolSink

__all__ = ["execute_tool_call", "execute_tool_calls", "idempotency_key", "result_blocks"]


def idempotency_key(session_id: str, call_id: str) -> str:
    """A key that is the same for the same call in the same session, across resumes and workers."""
    return hashlib.sha256(f"{session_id}\x00{call_id}".encode()).hexdigest()[:32]


def result_blocks(value: Any) -> tuple[ContentBlock, ...]:
    """A tool's return value as content blocks: text as is, blocks as they are, anything else as JSON."""
    if isinstance(value, str):
        return (TextBlock(value),)
    if isinstance(value, (TextBlock, ImageBlock)):
        return (value,)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (TextBlock, ImageBlock)) for v in value):
        return tuple(value)
    if value is None:
        return (TextBlock("null"),)
    if attrs.has(type(value)):
        value = unstructure(value)
    try:
        return (TextBlock(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()),)
    except TypeError:
        return (TextBlock(str(value)),)


def _error(call: ToolUseBlock, text: str, kind: str) -> ToolResultMessage:
    return ToolResultMessage(call.id, text, is_error=True, name=call.name, metadata={"error": kind})


async def execute_tool_call(
    call: ToolUseBlock,
    registry: ToolRegistry,
    *,
    session_id: str = "",
    turn: int = 0,
    timeout: float | None = None,
    sink: ToolSink | None = None,
    decision: Decision | None = None,
) -> ToolResultMessage:
    """Run one call and return its result; never raises except on cancellation and
    :class:`~fsm_agent.errors.SuspendCall` (the call stays open: no result; its subclass
    :class:`~fsm_agent.errors.WaitForHuman`: the call waits for a person).

    A tool that raises :class:`~fsm_agent.errors.ToolError` answers with an error result of its
    own content; any other exception becomes ``Tool 'x' failed: <type>: <message>``.

    ``timeout`` (seconds) overrides the tool's own when given; ``sink`` receives the tool's
    progress and usage reports (:class:`~fsm_agent.tools.registry.ToolContext`); ``decision`` is
    the person's decision that let the call run (``ToolContext.decision``).
    """
    t: Tool | None = registry.get(call.name)
    if t is None:
        available = ", ".join(registry.names) or "none"
        return _error(call, f"Unknown tool {call.name!r}. Available tools: {available}.", "unknown_tool")
    if call.raw_input is not None:
        return _error(
            call, f"The arguments for tool {call.name!r} are not a valid JSON object: {call.raw_input[:500]!r}. "
            "Call the tool again with a JSON object.", "invalid_json")
    try:
        t.validate(call.input)
    except ToolArgumentsError as exc:
        return _error(call, f"{exc}. Call the tool again with corrected arguments.", "invalid_arguments")
    ctx = ToolContext(call.id, idempotency_key(session_id, call.id), session_id, turn, call.name, sink, decision)
    kwargs = t.bind(call.input, ctx)
    limit = t.timeout if timeout is None else timeout
    try:
        if not t.is_async and not t.blocking:
            value = t.fn(**kwargs)  # a quick CPU-only tool: no thread hop (its timeout cannot apply)
            return ToolResultMessage(call.id, result_blocks(value), name=call.name)
        if t.is_async:
            coro: Awaitable[Any] = t.fn(**kwargs)
        else:
            coro = asyncio.to_thread(t.fn, **kwargs)
        if limit is None:
            value = await coro
        else:
            async with asyncio.timeout(limit):
                value = await coro
    except TimeoutError:
        return _error(call, f"Tool {call.name!r} timed out after {limit:g} s.", "timeout")
    except (asyncio.CancelledError, SuspendCall):
        raise
    except ToolError as exc:  # the tool's own error answer, not a crash
        return ToolResultMessage(call.id, exc.content or exc.message, is_error=True, name=call.name,
                                 metadata={"error": exc.kind})
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's information
        return _error(call, f"Tool {call.name!r} failed: {type(exc).__name__}: {exc}", "exception")
    return ToolResultMessage(call.id, result_blocks(value), name=call.name)


async def execute_tool_calls(
    calls: Sequence[ToolUseBlock],
    registry: ToolRegistry,
    *,
    session_id: str = "",
    turn: int = 0,
    on_start: Callable[[ToolUseBlock], None] | None = None,
    on_end: Callable[[ToolUseBlock, ToolResultMessage, float], None] | None = None,
    run_one: Callable[[ToolUseBlock], Awaitable[ToolResultMessage]] | None = None,
) -> list[ToolResultMessage]:
    """Run ``calls`` concurrently; results come back in call order.

    ``run_one`` replaces the default execution of one call (middleware wrap it).
    """

    async def one(call: ToolUseBlock) -> ToolResultMessage:
        if on_start is not None:
            on_start(call)
        started = time.monotonic()
        if run_one is not None:
            result = await run_one(call)
        else:
            result = await execute_tool_call(call, registry, session_id=session_id, turn=turn)
        if on_end is not None:
            on_end(call, result, time.monotonic() - started)
        return result

    if len(calls) == 1:
        return [await one(calls[0])]
    return list(await asyncio.gather(*(one(c) for c in calls)))
