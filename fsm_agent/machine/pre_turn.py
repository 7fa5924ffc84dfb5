"""PreTurn as a phase object: control events → the session's permissions (:mod:`.gate`) → budgets →
the context of the next call → PreTurn middleware → the tools the permissions allow → ``call_model``.

Budgets are checked in seed 000's order: shutdown (interrupt/cancel, taken first) → iterations →
wall clock → tokens → cost. A budget stop is PAUSED_BUDGET, resumable with a raised budget.
"""

from __future__ import annotations

from ..types.content import TextBlock, ThinkingBlock
from ..types.messages import AssistantMessage, ModelStopReason, UserMessage
from ..types.run import StopReason
from .controls import Controls
from .gate import PermissionGate
from .host import Host
from .outcome import Move, Outcome, Stop
from .phases import Trigger
from .state import RunState
from .view import RunView

__all__ = ["PreTurn", "budget_exceeded"]


def budget_exceeded(run: RunState, view: RunView) -> tuple[str, str] | None:
    """(budget, detail) of the first exhausted budget in seed 000's order, or ``None``."""
    cfg = run.config
    if run.turn >= cfg.max_iterations:
        return "iterations", f"iterations budget exhausted: {run.turn} of {cfg.max_iterations} model calls used"
    if cfg.max_wall_clock is not None:
        elapsed = view.elapsed
        if elapsed > cfg.max_wall_clock:
            return "wall_clock", f"wall-clock budget exhausted: {elapsed:.1f} s of {cfg.max_wall_clock:g} s used"
    if cfg.max_tokens is not None and run.usage.total_tokens >= cfg.max_tokens:
        est = " (partly estimated)" if run.usage.estimated else ""
        return "tokens", f"token budget exhausted: {run.usage.total_tokens} of {cfg.max_tokens} tokens used{est}"
    if cfg.max_cost_usd is not None and run.cost_usd is not None and run.cost_usd >= cfg.max_cost_usd:
        return "cost", f"cost budget exhausted: ${run.cost_usd:.4f} of ${cfg.max_cost_usd:.4f} used"
    return None


class PreTurn:
    """The PreTurn phase (see the module doc)."""

    __slots__ = ("h", "controls", "gate")

    def __init__(self, host: Host, controls: Controls) -> None:
        self.h = host
        self.controls = controls
        self.gate = PermissionGate(host)

    async def run(self) -> Outcome:
        h = self.h
        ctx, run = h.view, h.run_state
        stopped = await self.controls.at_pre_turn()
        if stopped is None:  # the session's permissions: narrowed, a request decided or waiting
            stopped = await self.gate.at_pre_turn()
        if stopped is not None:
            return stopped
        hit = budget_exceeded(run, ctx)
        if hit is not None:
            return Stop(StopReason.PAUSED_BUDGET, hit[1], {"budget": hit[0]})
        self._no_prefill()
        ctx.messages = list(ctx._transcript)
        settings = ctx.settings
        settings.active_tools = None
        settings.tools_enabled = True
        settings.max_output_tokens = run.max_output_override
        await h.chain.pre_turn(ctx)
        self.gate.offer()  # only the tools the session may call, whatever a plugin chose
        return Move(Trigger.CALL_MODEL, f"turn {run.turn + 1}: context of {len(ctx.messages)} messages built")

    def _no_prefill(self) -> None:
        """A history that ends with a plain assistant answer (one cut by an interrupt or the wall
        clock, or a turn continued without a message) would be sent as a prefill, which OpenAI-style
        APIs refuse with HTTP 400: ask the model to go on in a user message instead. A paused turn
        (``pause_turn``) is continued as it is. A turn that holds only reasoning (thinking, encrypted
        reasoning, a summary; no text, no calls) is no answer to continue: nothing is added, and each
        protocol sends such a turn as its rules allow (Chat and Anthropic leave it out, Responses
        drops a reasoning item with no output after it), so the model is asked again."""
        h = self.h
        transcript = h.view._transcript
        last = transcript[-1] if transcript else None
        if not isinstance(last, AssistantMessage) or last.tool_calls or not _has_answer(last):
            return
        resp = h.run_state.last_response
        cut = bool((last.provider_data or {}).get("interrupted"))
        if not cut and resp is not None and resp.stop_reason is ModelStopReason.PAUSE_TURN:
            return
        h.append(UserMessage("Your previous answer was cut off before it finished; continue from where it "
                             "stopped." if cut else "Continue."))


def _has_answer(message: AssistantMessage) -> bool:
    """Whether an assistant message holds anything but reasoning (non-blank text, a call, a server
    tool block ...): reasoning alone is not an answer."""
    return any(not isinstance(b, (TextBlock, ThinkingBlock)) or (isinstance(b, TextBlock) and b.text.strip())
               for b in message.content)
