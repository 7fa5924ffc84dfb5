"""@tool schemas from signatures and docstrings, validation before the call, parallel execution with
per-call timeouts, failures as error results."""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Literal, Optional, TypedDict

import pytest

from fsm_agent.errors import ConfigurationError, ToolArgumentsError, ToolDefinitionError
from fsm_agent.tools import Tool, ToolContext, ToolRegistry, execute_tool_call, execute_tool_calls, idempotency_key, tool
from fsm_agent.tools.demo import calculator, clock
from fsm_agent.types import ToolUseBlock


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(TypedDict):
    x: int
    y: int


@tool
def paint(shape: str, color: Color, size: float = 1.0, tags: list[str] | None = None,
          mode: Literal["fill", "stroke"] = "fill", at: Optional[Point] = None) -> str:
    """Paint a shape.

    Args:
        shape: what to paint.
        color: the colour,
            one of the palette.
        size: scale factor.

    Returns:
        a description.
    """
    return f"{shape}:{color}:{size}"


def test_schema_from_signature_and_docstring() -> None:
    assert paint.name == "paint"
    assert paint.description == "Paint a shape."
    p = paint.parameters
    assert p["required"] == ["shape", "color"]
    assert p["additionalProperties"] is False
    assert p["properties"]["shape"] == {"type": "string", "description": "what to paint."}
    assert p["properties"]["color"] == {"enum": ["red", "blue"], "description": "the colour, one of the palette."}
    assert p["properties"]["size"] == {"type": "number", "description": "scale factor.", "default": 1.0}
    assert p["properties"]["tags"] == {"type": ["array", "null"], "items": {"type": "string"}}
    assert p["properties"]["mode"] == {"enum": ["fill", "stroke"], "default": "fill"}
    assert p["properties"]["at"]["type"] == ["object", "null"] and p["properties"]["at"]["required"] == ["x", "y"]


def test_rest_style_docstrings() -> None:
    @tool
    def f(a: int) -> int:
        """Double it.

        :param a: the number
        :returns: twice a
        """
        return 2 * a

    assert f.description == "Double it."
    assert f.parameters["properties"]["a"] == {"type": "integer", "description": "the number"}


def test_validation_reports_every_problem_with_its_path() -> None:
    with pytest.raises(ToolArgumentsError) as info:
        paint.validate({"shape": 3, "color": "green", "extra": 1})
    msg = str(info.value)
    assert "shape: 3 is not of type 'string'" in msg
    assert "color: 'green' is not one of ['red', 'blue']" in msg
    assert "Additional properties are not allowed ('extra' was unexpected)" in msg


def test_bad_definitions_fail_at_decoration_time() -> None:
    with pytest.raises(ToolDefinitionError, match="unsupported annotation"):
        @tool
        def g(x: object) -> None: ...
    with pytest.raises(ToolDefinitionError, match="must match"):
        tool(name="bad name!")(lambda: None)
    with pytest.raises(ToolDefinitionError, match=r"\*args"):
        @tool
        def h(*xs: int) -> None: ...
    with pytest.raises(ConfigurationError, match="unique"):
        ToolRegistry([calculator, calculator])


def test_context_parameter_is_hidden_from_the_model() -> None:
    @tool(effect="side_effect")
    def send(to: str, ctx: ToolContext) -> str:
        """Send."""
        return ctx.idempotency_key

    assert list(send.parameters["properties"]) == ["to"]
    assert send.effect.value == "side_effect"


async def test_tool_receives_a_stable_idempotency_key() -> None:
    @tool
    def send(to: str, ctx: ToolContext) -> str:
        """Send."""
        return f"{ctx.session_id}/{ctx.call_id}/{ctx.idempotency_key}"

    reg = ToolRegistry([send])
    call = ToolUseBlock("call_1", "send", {"to": "a"})
    r1 = await execute_tool_call(call, reg, session_id="s")
    r2 = await execute_tool_call(call, reg, session_id="s")
    assert r1.text == r2.text == f"s/call_1/{idempotency_key('s', 'call_1')}"
    assert idempotency_key("s", "call_1") != idempotency_key("s", "call_2")


async def test_failures_become_error_results() -> None:
    @tool
    def boom(x: int) -> int:
        """Fail."""
        raise ValueError("no good")

    reg = ToolRegistry([boom, calculator])
    r = await execute_tool_call(ToolUseBlock("c", "boom", {"x": 1}), reg)
    assert r.is_error and r.text == "Tool 'boom' failed: ValueError: no good"
    r = await execute_tool_call(ToolUseBlock("c", "nope", {}), reg)
    assert r.is_error and r.text == "Unknown tool 'nope'. Available tools: boom, calculator."
    r = await execute_tool_call(ToolUseBlock("c", "boom", {}, raw_input='{"x": 1'), reg)
    assert r.is_error and "not a valid JSON object" in r.text
    r = await execute_tool_call(ToolUseBlock("c", "boom", {"x": "one"}), reg)
    assert r.is_error and "x: 'one' is not of type 'integer'" in r.text
    assert r.metadata == {"error": "invalid_arguments"}


async def test_calls_run_in_parallel_each_with_its_own_timeout() -> None:
    @tool(timeout=0.2)
    async def slow(n: int) -> int:
        """Sleep."""
        await asyncio.sleep(n)
        return n

    @tool
    async def quick(n: int) -> int:
        """Sleep a bit."""
        await asyncio.sleep(0.3)
        return n

    reg = ToolRegistry([slow, quick])
    calls = [ToolUseBlock("a", "slow", {"n": 5}), ToolUseBlock("b", "quick", {"n": 1}), ToolUseBlock("c", "quick", {"n": 2})]
    t = time.monotonic()
    results = await execute_tool_calls(calls, reg)
    took = time.monotonic() - t
    assert [r.tool_call_id for r in results] == ["a", "b", "c"]
    assert results[0].is_error and results[0].text == "Tool 'slow' timed out after 0.2 s."
    assert [r.text for r in results[1:]] == ["1", "2"]
    assert took < 0.9  # parallel: about 0.3 s, not 0.2 + 0.3 + 0.3


async def test_sync_tools_run_in_a_thread() -> None:
    @tool
    def blocking(n: int) -> int:
        """Block."""
        time.sleep(0.2)
        return n

    reg = ToolRegistry([blocking])
    t = time.monotonic()
    rs = await execute_tool_calls([ToolUseBlock(str(i), "blocking", {"n": i}) for i in range(4)], reg)
    assert [r.text for r in rs] == ["0", "1", "2", "3"]
    assert time.monotonic() - t < 0.7


async def test_return_values_are_serialized() -> None:
    @tool
    def data() -> dict:
        """Data."""
        return {"a": [1, 2], "b": None}

    r = await execute_tool_call(ToolUseBlock("c", "data", {}), ToolRegistry([data]))
    assert r.text == '{"a":[1,2],"b":null}'


def test_demo_tools() -> None:
    assert calculator("(17 * 23) + 4") == "395"
    assert calculator("2 ^ 10") == "1024"
    assert calculator("sqrt(16) / 8") == "0.5"
    with pytest.raises(ValueError, match="unsupported"):
        calculator("__import__('os')")
    with pytest.raises(ValueError, match="exponent too large"):
        calculator("9 ** 99999")
    assert clock("UTC").endswith("+00:00")
    with pytest.raises(ValueError, match="unknown time zone"):
        clock("Mars/Olympus")


def test_tool_with_explicit_schema() -> None:
    t = Tool(lambda **kw: kw, name="raw", parameters={"type": "object", "properties": {"q": {"type": "string"}}})
    t.validate({"q": "x"})
    with pytest.raises(ToolDefinitionError, match="invalid JSON Schema"):
        Tool(lambda: None, name="bad", parameters={"type": 12})


async def test_non_blocking_sync_tools_run_inline_and_still_report_failures() -> None:
    import threading

    loop_thread = threading.get_ident()

    @tool(blocking=False)
    def where() -> bool:
        """Which thread."""
        return threading.get_ident() == loop_thread

    @tool(blocking=False)
    def fails() -> None:
        """Fail."""
        raise RuntimeError("inline failure")

    reg = ToolRegistry([where, fails])
    assert (await execute_tool_call(ToolUseBlock("a", "where", {}), reg)).text == "true"
    r = await execute_tool_call(ToolUseBlock("b", "fails", {}), reg)
    assert r.is_error and r.text == "Tool 'fails' failed: RuntimeError: inline failure"
