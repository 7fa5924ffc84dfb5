"""Demo tools for the CLI (``--tool calculator``, ``--tool clock``): small, real, and safe."""

from __future__ import annotations

import ast
import datetime
import math
import operator
import zoneinfo
from collections.abc import Callable
from typing import Any

from .registry import Tool, tool

__all__ = ["DEMO_TOOLS", "calculator", "clock"]

_BIN: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UN: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {"sqrt": math.sqrt, "abs": abs, "round": round, "log": math.log, "exp": math.exp,
          "sin": math.sin, "cos": math.cos, "tan": math.tan, "floor": math.floor, "ceil": math.ceil}
_CONSTS = {"pi": math.pi, "e": math.e}


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 1000:
            raise ValueError("exponent too large")
        return _BIN[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
        return _UN[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _FUNCS[node.func.id](*(_eval(a) for a in node.args))
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")


@tool(blocking=False)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: arithmetic using + - * / // % ** and parentheses, numbers, pi, e,
            and sqrt, abs, round, log, exp, sin, cos, tan, floor, ceil. Example: "(17 * 23) + 4".
    """
    expr = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if len(expr) > 500:
        raise ValueError("expression too long (500 characters at most)")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


@tool
def clock(timezone: str = "UTC") -> str:
    """Return the current date and time.

    Args:
        timezone: IANA time zone name such as "UTC", "Europe/Paris" or "Asia/Shanghai".
    """
    try:
        tz = zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"unknown time zone {timezone!r}; use an IANA name such as Europe/Paris") from exc
    return datetime.datetime.now(tz).isoformat(timespec="seconds")


DEMO_TOOLS: dict[str, Tool] = {"calculator": calculator, "clock": clock}
"""Demo tools by name."""
