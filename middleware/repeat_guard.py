"""Repeat guard: a side effect the model asks for again, with the same arguments, is not done twice.

The ledger keeps one *call* from running twice (a resume, a crash, a replayed approval). It cannot
keep the *model* from asking for the same effect again in a new call with a new id: a small model
that lost track after a fault re-issues the refund it already made, and every such repeat is a
fresh call that the ledger, loop detection (a new result each time is progress) and policy all let
through. ``bench/control_vs_model.py`` measured exactly that on the local model.

This plugin looks at ``side_effect`` tools only (:class:`~fsm_agent.ToolEffect`; ``pure`` and
``idempotent`` calls are safe to repeat by definition). A proposed call is a **repeat** when an
earlier call in the session's transcript had the same tool and the same arguments (canonical JSON:
re-ordered keys do not hide a repeat) and **ran to a result that was not an error**. Calls that
were denied, answered by middleware or a person, failed, or whose outcome is unknown (cut by an
interrupt) are not repeats: doing them again may be the right recovery, and policy, approval and
the tool's own ``on_reconcile`` decide that.

What happens to a repeat (``on_repeat``):

* ``"respond"`` (default): the tool does not run; the model gets the earlier call's result, with a
  note that it was not run again and why (a :class:`~fsm_agent.Respond`, not an error, since the
  effect the model wants has happened);
* ``"ask"``: a person decides (:class:`~fsm_agent.AskApproval`; the run stops WAITING_HUMAN, or
  waits in process with Hang-Wait), for tools where a deliberate second time is plausible;
* ``"deny"``: an error result saying it already ran.

``allow`` names tools whose repeats are normal (``send_heartbeat``); they are never intercepted.
``scope="session"`` (default) compares with every earlier call of the session; ``scope="input"``
only with calls since the latest user message, so a user who asks for the same thing again gets
it (a plugin's own user messages, such as a verifier's feedback or a PlanAct step, count as input
too, which is why it is not the default).

History comes from the transcript (:attr:`RunContext.transcript`), so a resumed run, in this
process or another, remembers what ran before it. Nothing is kept in the plugin.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Literal

from fsm_agent import AskApproval, ConfigurationError, Deny, Middleware, Respond, RunContext, ToolEffect
from fsm_agent.types import AssistantMessage, ToolResultMessage, ToolUseBlock, UserMessage

__all__ = ["RepeatGuard"]

_NOT_RAN_KEYS = ("denied_by", "responded_by", "synthetic", "error")
"""Result metadata of calls that did not run to a result of their own (or whose outcome is unknown)."""


def _identity(call: ToolUseBlock) -> str:
    if call.raw_input is not None:
        return f"{call.name}\x00raw:{call.raw_input}"
    return f"{call.name}\x00" + json.dumps(call.input, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                           default=str)


class RepeatGuard(Middleware):
    """Keep the model from doing a side effect twice by asking for it again (see the module doc).

    Args:
        on_repeat: ``"respond"`` (the earlier result, not run again), ``"ask"`` (a person decides) or
            ``"deny"`` (an error result).
        allow: tool names whose repeats are never intercepted.
        scope: ``"session"`` (every earlier call) or ``"input"`` (calls since the latest user message).
        preview_chars: characters of the earlier result quoted back to the model (at least 1).

    Raises:
        ConfigurationError: an unknown ``on_repeat`` or ``scope``, or ``preview_chars`` below 1.
    """

    name = "repeat_guard"

    def __init__(self, *, on_repeat: Literal["respond", "ask", "deny"] = "respond", allow: Iterable[str] = (),
                 scope: Literal["session", "input"] = "session", preview_chars: int = 2000) -> None:
        if on_repeat not in ("respond", "ask", "deny"):
            raise ConfigurationError(f"RepeatGuard(on_repeat={on_repeat!r}): use 'respond', 'ask' or 'deny'")
        if scope not in ("session", "input"):
            raise ConfigurationError(f"RepeatGuard(scope={scope!r}): use 'session' or 'input'")
        if isinstance(preview_chars, bool) or not isinstance(preview_chars, int) or preview_chars < 1:
            raise ConfigurationError(f"RepeatGuard(preview_chars={preview_chars!r}): give a whole number of at least 1")
        self.on_repeat = on_repeat
        self.allow = frozenset(allow)
        self.scope = scope
        self.preview_chars = preview_chars

    def _earlier(self, call: ToolUseBlock, ctx: RunContext) -> tuple[ToolUseBlock, ToolResultMessage] | None:
        """The latest earlier call with ``call``'s identity that ran to a non-error result, or ``None``."""
        wanted = _identity(call)
        results: dict[str, ToolResultMessage] = {}
        found: tuple[ToolUseBlock, ToolResultMessage] | None = None
        for msg in reversed(ctx.transcript):
            if isinstance(msg, ToolResultMessage):
                results.setdefault(msg.tool_call_id, msg)
            elif isinstance(msg, AssistantMessage):
                for c in msg.tool_calls:
                    if c.id == call.id or _identity(c) != wanted:
                        continue
                    res = results.get(c.id)
                    if res is None or res.is_error or any(k in (res.metadata or {}) for k in _NOT_RAN_KEYS):
                        continue
                    found = (c, res)
                    break
                if found is not None:
                    return found
            elif isinstance(msg, UserMessage) and self.scope == "input":
                return None
        return None

    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Respond | AskApproval | Deny | None:
        tool = ctx.tools.get(call.name)
        if tool is None or tool.effect is not ToolEffect.SIDE_EFFECT or call.name in self.allow:
            return None
        hit = self._earlier(call, ctx)
        if hit is None:
            return None
        earlier, result = hit
        shown = result.text
        if len(shown) > self.preview_chars:
            shown = shown[: self.preview_chars] + "…"
        what = (f"{call.name} with these exact arguments already ran in this session (call {earlier.id}), "
                f"and it has side effects")
        if self.on_repeat == "ask":
            return AskApproval(f"{what}; running it again would do it twice")
        if self.on_repeat == "deny":
            return Deny(f"{what}; it was not run again. Its result was: {shown}")
        return Respond(f"Not run again: {what}, so running it a second time would do it twice. "
                       f"Its result was: {shown}")
