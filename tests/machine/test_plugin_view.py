"""The plugin view is closed: a hook that writes to the transcript, the machine, the tools or a counter
gets :class:`~fsm_agent.errors.ContextWriteError` naming the supported way, and nothing changes;
``ctx.messages`` and ``ctx.settings`` stay writable (in ``pre_turn``) and reach the request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fsm_agent import Agent, MemoryStore, Middleware, ScriptedProvider, StopReason, Trigger, tool
from fsm_agent.context import TurnSettings
from fsm_agent.errors import ContextWriteError
from fsm_agent.providers import text_response
from fsm_agent.types import Usage, UserMessage


@tool
def noop() -> str:
    """Do nothing."""
    return "ok"


@tool
def extra() -> str:
    """Another tool."""
    return "ok"


def _iadd(ctx: Any) -> None:
    t = ctx.transcript
    t += [UserMessage("x")]


def _del_item(ctx: Any) -> None:
    del ctx.transcript[0]


def _set_item(ctx: Any) -> None:
    ctx.transcript[0] = UserMessage("x")


WRITES: dict[str, Callable[[Any], Any]] = {
    "transcript.append": lambda ctx: ctx.transcript.append(UserMessage("x")),
    "transcript.extend": lambda ctx: ctx.transcript.extend([UserMessage("x")]),
    "transcript.insert": lambda ctx: ctx.transcript.insert(0, UserMessage("x")),
    "transcript.pop": lambda ctx: ctx.transcript.pop(),
    "transcript.remove": lambda ctx: ctx.transcript.remove(ctx.transcript[0]),
    "transcript.clear": lambda ctx: ctx.transcript.clear(),
    "transcript.sort": lambda ctx: ctx.transcript.sort(),
    "transcript.reverse": lambda ctx: ctx.transcript.reverse(),
    "transcript[0] =": _set_item,
    "del transcript[0]": _del_item,
    "transcript +=": _iadd,
    "machine.fire": lambda ctx: ctx.machine.fire(Trigger.COMPLETE),
    "machine.state =": lambda ctx: setattr(ctx.machine, "state", "COMPLETED"),
    "tools.add": lambda ctx: ctx.tools.add(extra),
    "del machine.state": lambda ctx: delattr(ctx.machine, "state"),
    "tools.x =": lambda ctx: setattr(ctx.tools, "names", ("extra",)),
    "del tools.names": lambda ctx: delattr(ctx.tools, "names"),
    **{f"ctx.{name} =": (lambda ctx, name=name: setattr(ctx, name, None))
       for name in ("turn", "usage", "provider", "config", "plan", "session_id", "transcript", "machine", "tools",
                    "cost_usd", "tool_calls_made", "last_response", "pending_calls", "goal_version", "elapsed",
                    "started_at", "new_attribute")},
    **{f"del ctx.{name}": (lambda ctx, name=name: delattr(ctx, name))
       for name in ("session_id", "provider", "messages", "settings", "turn")},
}

SUPPORTED = "ctx.messages and ctx.settings in pre_turn"
"""Every refusal names the supported ways (the hooks' return values and the documented writes)."""


class _Writer(Middleware):
    """Tries one write in ``pre_turn`` and keeps what happened."""

    name = "writer"

    def __init__(self, write: Callable[[Any], Any]) -> None:
        self.write = write
        self.raised: BaseException | None = None
        self.seen: dict[str, Any] = {}

    async def pre_turn(self, ctx: Any) -> None:
        if ctx.turn:
            return
        before = (list(ctx.transcript), ctx.machine.state, ctx.tools.names, ctx.turn, ctx.usage, ctx.session_id)
        try:
            self.write(ctx)
        except Exception as exc:  # noqa: BLE001 - the refusal is what is checked
            self.raised = exc
        self.seen = {"before": before, "after": (list(ctx.transcript), ctx.machine.state, ctx.tools.names,
                                                 ctx.turn, ctx.usage, ctx.session_id)}


@pytest.mark.parametrize("what", list(WRITES))
async def test_a_write_to_the_closed_view_raises_context_write_error_and_changes_nothing(what: str) -> None:
    writer = _Writer(WRITES[what])
    agent = Agent(ScriptedProvider(["done"]), tools=[noop], middleware=[writer], store=MemoryStore())
    result = await agent.run("go", session_id="s1")
    assert isinstance(writer.raised, ContextWriteError), (what, writer.raised)
    assert isinstance(writer.raised, AttributeError)  # code that expects a read-only attribute still works
    assert SUPPORTED in str(writer.raised) and "ctx.state(self)" in str(writer.raised), str(writer.raised)
    assert writer.seen["after"] == writer.seen["before"]
    assert result.stop.reason is StopReason.COMPLETED and result.output == "done"
    assert [m.text for m in result.messages] == ["go", "done"]


async def test_messages_and_settings_stay_writable_in_pre_turn() -> None:
    class Shaper(Middleware):
        name = "shaper"

        async def pre_turn(self, ctx: Any) -> None:
            ctx.messages = [*ctx.messages, UserMessage("a note for this call only")]
            ctx.settings = TurnSettings(active_tools=["noop"], max_output_tokens=77)

    provider = ScriptedProvider([text_response("done", usage=Usage(1, 1))])
    agent = Agent(provider, tools=[noop, extra], middleware=[Shaper()], store=MemoryStore())
    result = await agent.run("go")
    request = provider.requests[0]
    assert [m.text for m in request.messages] == ["go", "a note for this call only"]
    assert [t.name for t in request.tools] == ["noop"] and request.max_tokens == 77
    assert [m.text for m in result.messages] == ["go", "done"]  # the transcript of record is unchanged
