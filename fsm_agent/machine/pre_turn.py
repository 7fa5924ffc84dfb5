"""PreTurn as a phase object: control events → the session's permissions (:mod:`.gate`) → budgets →
the system prompt (the agent's current one, read through the port) → the context of the next call →
PreTurn middleware → the current system prompt put into the context → the tools the permissions
allow → loop detection's warning (:mod:`.loops`) → ``call_model``.

Budgets are checked in seed 000's order: shutdown (interrupt/cancel, taken first) → iterations →
wall clock → tokens → cost. A budget stop is PAUSED_BUDGET, resumable with a raised budget.
"""

from __future__ import annotations

from typing import Any

from ..prompt import PROMPT_KEY, prompt_digest
from ..types.content import TextBlock, ThinkingBlock
from ..types.events import SystemPromptChanged
from ..types.messages import AssistantMessage, Message, ModelStopReason, SystemMessage, UserMessage
from ..types.run import StopReason
from .controls import Controls
from .gate import PermissionGate
from .host import Host
from .loops import LoopWatch
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

    __slots__ = ("h", "controls", "gate", "loops")

    def __init__(self, host: Host, controls: Controls) -> None:
        self.h = host
        self.controls = controls
        self.gate = PermissionGate(host)
        self.loops = LoopWatch(host)

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
        prompt = await self._system_prompt()
        ctx.messages = list(ctx._transcript)
        settings = ctx.settings
        settings.active_tools = None
        settings.tools_enabled = True
        settings.max_output_tokens = run.max_output_override
        await h.chain.pre_turn(ctx)
        if prompt is not None:  # after the middleware: a plugin rebuilding the context from the transcript
            _put_prompt(ctx.messages, prompt, ctx._transcript)  # (compaction) finds its messages as they are
        self.gate.offer()  # only the tools the session may call, whatever a plugin chose
        await self.loops.at_pre_turn()  # after the plugins: the warning reaches the model as it is
        return Move(Trigger.CALL_MODEL, f"turn {run.turn + 1}: context of {len(ctx.messages)} messages built")

    async def _system_prompt(self) -> dict[str, Any] | None:
        """The session's prompt record (:data:`~fsm_agent.prompt.PROMPT_KEY`), after reading the agent's
        prompt through the port: when its text differs from the one the session used, a
        ``system_prompt_changed`` event (logged, to the observers) and the new text from this turn's
        model call on. A pinned session (``RunConfig.pin_system_prompt``) and one that brought its own
        system message read nothing. ``None``: no prompt source (the transcript is used as it is)."""
        h = self.h
        run = h.run_state
        if h.prompt is None:
            return None
        use = run.metadata.get(PROMPT_KEY)
        if use is None:  # a session from before prompts were versioned: its transcript's system message
            first = h.view._transcript[0] if h.view._transcript else None
            text = first.text if isinstance(first, SystemMessage) else None
            use = run.metadata[PROMPT_KEY] = {"version": 0, "digest": prompt_digest(text), "source": "session",
                                               "text": text, "leading": text is not None, "own": False}
        if use.pop("fresh", False) or use.get("own") or run.config.pin_system_prompt:
            return use  # read at the session's start just now; or kept as it is
        snap = await h.port.system_prompt(h.prompt)
        if snap is not None and snap.digest != use["digest"]:
            h.view.emit(SystemPromptChanged(h.session_id, run.turn, snap.version, snap.digest, snap.text, snap.source,
                                            use["digest"]))
            await h.flush_outbox()
            use.update(version=snap.version, digest=snap.digest, source=snap.source, text=snap.text)
        return use

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


def _put_prompt(messages: list[Message], use: dict[str, Any], transcript: list[Message]) -> None:
    """Make the context's system prompt the session's current one (its record ``use``): in place of
    the transcript's first message when that is the prompt the session started with (``leading``;
    found in ``messages`` as the same object, else as an equal message), else first. A session that
    brought its own system message (``own``) is left as it is."""
    if use.get("own"):
        return
    text = use.get("text")
    first = transcript[0] if use.get("leading") and transcript and isinstance(transcript[0], SystemMessage) else None
    if first is not None:
        at = next((i for i, m in enumerate(messages) if m is first), None)
        if at is None:
            at = next((i for i, m in enumerate(messages) if m == first), None)
        if at is not None:
            if not text:
                del messages[at]
            elif first.text != text:
                messages[at] = SystemMessage(text)
            return
        # A plugin rewrote the first message (the repair plugin merges system messages into one):
        # the prompt is still in it, at its start, unless the plugin dropped it.
        head = messages[0] if messages and isinstance(messages[0], SystemMessage) else None
        if head is not None and first.text != text and head.text.startswith(first.text):
            rest = head.text[len(first.text):]
            if text:
                messages[0] = SystemMessage(text + rest)
            elif rest.strip():
                messages[0] = SystemMessage(rest.lstrip("\n"))
            else:
                del messages[0]
        return
    if text:
        messages.insert(0, SystemMessage(text))
