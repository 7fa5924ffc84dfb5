"""ToolActivation: offer the model a bounded, least-recently-used set of tools each turn.

Seed 000 §5.2.2 ("工具 LRU 管理 tick + 自动淘汰": tool LRU management, a tick
per iteration and automatic eviction) and §5.2.5 (most models get worse when
more than 25 tools are offered: empty answers, poor choices).

Each PreTurn is a **tick**. This middleware owns ``ctx.active_tools`` (the
tool names offered in the next model call; the registry itself is unchanged):

* at most ``max_active`` registered tools are offered; ``always_on`` tools are
  always among them and never evicted;
* the other slots hold the most recently used tools. At the start of a run
  they are filled in registration order; a tool the model calls (MidTurn,
  ``on_tool_call``) becomes the most recent one, and when that overfills the
  slots the least recently used tool is evicted;
* with ``max_idle_turns`` set, a tool not called for that many completed
  turns is evicted at the tick, even when slots are free (automatic eviction);
* the active set is about what the model is *offered*, not a permission: a
  call to an inactive but registered tool still runs (and re-activates the
  tool). Use :mod:`fsm_agent_middleware.tool_policy` to forbid tools.

**Re-activation** is by a small meta-tool, ``activate_tool`` (name
configurable; ``activation_tool=None`` turns it off). It is added to the
request's tool list in ``wrap_model_call`` whenever some tool is inactive
and tools are enabled; its description lists the inactive tools (name and
first line of description) and its ``name`` argument is an ``enum`` of them.
A call ``activate_tool({"name": "clock"})`` is answered by this middleware
(``Respond``; nothing runs and no tool budget is used): ``"Tool 'clock' is
active from your next step."``, and ``clock`` becomes the most recent tool,
offered from the next turn on (evicting the least recently used one when
full). An unknown name gets an error result listing what can be activated.
The meta-tool is not counted in ``max_active``. Because it answers its own
calls, this middleware is ordered outside ToolPolicy, HumanApproval and Budget.

Too many tools: the runtime itself warns (logger ``fsm_agent.driver`` and a
``warning`` event in the session log) when more than 25 tools are offered on a
run's first call (seed 000 §5.2.5); with the defaults (``max_active=25``) this
middleware keeps a run under that line.

State (the LRU order, last use per tool) is per run: a resumed run starts
again from registration order. Errors: bad options raise
:class:`~fsm_agent.ConfigurationError` at construction; ``always_on`` names that
are not registered, or a registered tool with the meta-tool's name, raise it
at the first PreTurn (the run ends FAILED_TERMINAL naming this middleware).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from attrs import evolve

from fsm_agent import ConfigurationError, Middleware, Ordering, Respond, RunContext, ToolUseBlock
from fsm_agent.types import MessageRequest, MessageResponse, ToolDefinition

__all__ = ["ToolActivation"]

log = logging.getLogger("fsm_agent.middleware.tool_activation")


def _count(option: str, value: Any, minimum: int) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ConfigurationError(f"ToolActivation: {option} must be an integer >= {minimum} or None, not {value!r}")
    return value


class ToolActivation(Middleware):
    """Bound the tools offered per turn with LRU eviction, and re-activate them by a meta-tool.

    Args:
        max_active: registered tools offered per turn (``always_on`` included); ``None``: no bound.
        always_on: tool names that are always offered and never evicted.
        max_idle_turns: evict a tool after this many completed turns without a call; ``None``: never.
        activation_tool: name of the meta-tool that re-activates an evicted tool; ``None``: none.

    Raises:
        ConfigurationError: a non-integer or too small bound, or ``max_active`` leaving no slot
            beyond ``always_on``.
    """

    name = "tool_activation"

    ordering = Ordering(wraps=("tool_policy", "approval", "budget"))

    def __init__(
        self,
        max_active: int | None = 25,
        *,
        always_on: Iterable[str] = (),
        max_idle_turns: int | None = None,
        activation_tool: str | None = "activate_tool",
    ) -> None:
        self.max_active = _count("max_active", max_active, 1)
        self.always_on: tuple[str, ...] = (always_on,) if isinstance(always_on, str) else tuple(always_on)
        self.max_idle_turns = _count("max_idle_turns", max_idle_turns, 1)
        if max_active is not None and max_active <= len(self.always_on):
            raise ConfigurationError(f"ToolActivation: max_active={max_active} leaves no slot beyond the "
                                     f"{len(self.always_on)} always_on tool(s); raise it or shorten always_on")
        self.activation_tool = activation_tool

    @property
    def _slots(self) -> int | None:
        return None if self.max_active is None else self.max_active - len(self.always_on)

    def __repr__(self) -> str:
        return (f"ToolActivation(max_active={self.max_active!r}, always_on={list(self.always_on)!r}, "
                f"max_idle_turns={self.max_idle_turns!r}, "
                f"activation_tool={self.activation_tool!r})")

    # -- LRU -------------------------------------------------------------------------
    def _setup(self, ctx: RunContext) -> dict[str, Any]:
        st = ctx.state(self)
        if "active" in st:
            return st
        names = ctx.tools.names
        unknown = [n for n in self.always_on if n not in ctx.tools]
        if unknown:
            raise ConfigurationError(f"ToolActivation: always_on names unregistered tool(s) "
                                     f"{', '.join(map(repr, unknown))} (registered: {', '.join(names) or 'none'})")
        if self.activation_tool is not None and self.activation_tool in ctx.tools:
            raise ConfigurationError(f"ToolActivation: a registered tool is already named {self.activation_tool!r}; "
                                     "pass activation_tool='another_name'")
        others = [n for n in names if n not in self.always_on]
        active = others if self._slots is None else others[: self._slots]
        st.update(active=active, last_used={n: 0 for n in active}, meta=None)
        return st

    def _touch(self, ctx: RunContext, st: dict[str, Any], name: str) -> None:
        if name in self.always_on:
            return
        active: list[str] = st["active"]
        if name in active:
            active.remove(name)
        active.insert(0, name)
        st["last_used"][name] = ctx.turn
        if self._slots is not None and len(active) > self._slots:
            evicted = active[self._slots:]
            del active[self._slots:]
            log.debug("turn %d: %s evicted (least recently used)", ctx.turn, ", ".join(evicted))

    def inactive(self, ctx: RunContext) -> list[str]:
        """Registered tools not offered this turn, in registration order."""
        st = self._setup(ctx)
        return [n for n in ctx.tools.names if n not in self.always_on and n not in st["active"]]

    # -- hooks -----------------------------------------------------------------------
    def on_run_start(self, ctx: RunContext) -> None:
        ctx.state(self).clear()

    def pre_turn(self, ctx: RunContext) -> None:
        st = self._setup(ctx)
        done = ctx.turn  # completed model calls before this tick
        if self.max_idle_turns is not None:
            idle = [n for n in st["active"] if done - st["last_used"][n] >= self.max_idle_turns]
            if idle:
                st["active"] = [n for n in st["active"] if n not in idle]
                log.debug("turn %d: %s evicted (idle for %d turns)", done + 1, ", ".join(idle), self.max_idle_turns)
        offered = [n for n in ctx.tools.names if n in self.always_on or n in st["active"]]
        ctx.settings.active_tools = offered
        inactive = self.inactive(ctx)
        st["meta"] = self._meta_definition(ctx, inactive) if self.activation_tool and inactive else None

    def _meta_definition(self, ctx: RunContext, inactive: list[str]) -> ToolDefinition:
        lines = []
        for n in inactive:
            t = ctx.tools.get(n)
            first = (t.description.strip().splitlines() or [""])[0][:100] if t is not None else ""
            lines.append(f"{n} ({first})" if first else n)
        return ToolDefinition(
            str(self.activation_tool),
            "Activate a tool that is not offered right now; you can call it from your next step. "
            "Inactive tools: " + "; ".join(lines) + ".",
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": inactive, "description": "the tool to activate"}},
             "required": ["name"], "additionalProperties": False},
        )

    async def wrap_model_call(self, request: MessageRequest, call_next: Any, ctx: RunContext) -> MessageResponse:
        meta = ctx.state(self).get("meta")
        if meta is not None and ctx.tools_enabled:
            request = evolve(request, tools=(*request.tools, meta))
        response: MessageResponse = await call_next(request)
        return response

    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Respond | None:
        st = self._setup(ctx)
        if self.activation_tool is not None and call.name == self.activation_tool:
            name = call.input.get("name")
            inactive = self.inactive(ctx)
            if name in self.always_on or name in st["active"]:
                return Respond(f"Tool {name!r} is already active.")
            if not isinstance(name, str) or name not in inactive:
                can = ", ".join(inactive) or "none"
                return Respond(f"Unknown tool {name!r}; tools you can activate: {can}.", is_error=True)
            self._touch(ctx, st, name)
            return Respond(f"Tool {name!r} is active from your next step.")
        if call.name in ctx.tools:
            self._touch(ctx, st, call.name)
        return None
