"""The controls as a phase object: Interrupt, Cancel, Steer and Followup, where each lands.

* **At PreTurn** (:meth:`Controls.at_pre_turn`): a Cancel cancels (compensating side effects, or
  asking a person to confirm them); an Interrupt stops INTERRUPTED; a Steer appends the new
  direction and bumps the goal version (logged, checkpointed).
* **Mid-phase** (:meth:`Controls.after_cut`): an Interrupt or a Cancel that cut the Model phase's
  call, the tools in flight or a plugin's side call. The streamed part of a cut answer is kept
  (the user's choice, not a failure); every open tool call gets its result ("outcome unknown" for a
  call in flight) or, for an Interrupt, stays open where running it again is safe.
* **At PostTurn** (:meth:`Controls.followups`): queued followups run after the task would complete.

**No tool call is left without a result** on any path out of MidTurn: a call that ran keeps its
real result, a call in flight gets an honest "outcome unknown" (ledger ``interrupted``), a call
that never started is marked as not run (ledger ``not_run``).
"""

from __future__ import annotations

from ..errors import WaitForHuman
from ..store.base import ControlKind, ControlRecord, LedgerEntry, LedgerStatus
from ..tools.registry import ToolEffect
from ..types.content import TextBlock, ToolUseBlock
from ..types.messages import AssistantMessage, ToolResultMessage, UserMessage
from ..types.run import PendingAction, StopReason
from .host import Host
from .outcome import Move, Outcome, Stop
from .phases import Phase, Trigger

__all__ = ["MIDPHASE_CONTROLS", "Controls"]

MIDPHASE_CONTROLS = (ControlKind.INTERRUPT, ControlKind.CANCEL)
"""The controls that cut a phase in flight."""


class Controls:
    """Interrupt, Cancel, Steer and Followup (see the module doc)."""

    __slots__ = ("h",)

    def __init__(self, host: Host) -> None:
        self.h = host

    # -- PreTurn -------------------------------------------------------------------------------
    async def at_pre_turn(self) -> Outcome | None:
        """Take Cancel, Interrupt and Steer: the stop they cause, or ``None`` to go on."""
        h = self.h
        run = h.run_state
        controls = await h.take(ControlKind.CANCEL, ControlKind.INTERRUPT, ControlKind.STEER)
        for c in controls:
            if c.kind is ControlKind.CANCEL:
                return await self.cancel(c.text or "cancelled by the user")
        for c in controls:
            if c.kind is ControlKind.INTERRUPT:
                return Stop(StopReason.INTERRUPTED, c.text or "interrupted by the user")
        steers = [c for c in controls if c.kind is ControlKind.STEER]
        for c in steers:  # steer: new direction, verified facts kept, re-plan
            h.append(UserMessage(
                f"New direction from the user: {c.text}\nKeep what has already been verified, "
                "drop what no longer applies, and re-plan the remaining steps."))
            run.goal_version += 1
        j = h.journal
        if steers and j is not None:
            j.record("goal_changed", {"goal_version": run.goal_version}, run.turn)
            run.state = h.machine.state.value
            run.transcript_len = len(h.view._transcript)
            await j.flush(checkpoint=j.checkpoint(run, Phase.PRE_TURN.value))
            await h.port.store.update_metadata(h.session_id, {}, run.goal_version)
        return None

    # -- PostTurn ------------------------------------------------------------------------------
    async def followups(self) -> Outcome | None:
        """Queued followups run after the current task would complete: append and continue."""
        h = self.h
        taken: list[ControlRecord] = await h.take(ControlKind.FOLLOWUP)
        if not taken:
            return None
        for f in taken:
            h.append(UserMessage(f.text))
        h.turns.end(verification="followup queued by the user")
        return Move(Trigger.NEXT_TURN, f"{len(taken)} followup request(s) queued by the user")

    # -- mid-phase --------------------------------------------------------------------------------
    async def after_cut(self) -> Outcome:
        """An Interrupt or a Cancel arrived while the model or tools ran, or while a middleware's side
        call ran (the phase, or the call, was cut)."""
        h = self.h
        controls = await h.take(*MIDPHASE_CONTROLS)
        cancel = next((c for c in controls if c.kind is ControlKind.CANCEL), None)
        interrupt = next((c for c in controls if c.kind is ControlKind.INTERRUPT), None)
        if cancel is not None:
            kept = self.keep_cut_answer() if h.machine.state is Phase.MODEL else ""
            await self.close_open_calls(keep_unstarted=False)
            return await self.cancel(cancel.text or "cancelled by the user", kept)
        text = (interrupt.text if interrupt is not None else "") or "interrupted by the user"
        return await self.interrupted(text)

    async def interrupted(self, text: str) -> Stop:
        """The INTERRUPTED stop of an interrupted Model or MidTurn phase (streamed text kept; calls
        closed, or left pending when none had started)."""
        h = self.h
        during = h.machine.state
        if during is Phase.MODEL and not self.answered_with_calls():
            kept = self.keep_cut_answer()
            return Stop(StopReason.INTERRUPTED, f"{text} (during Model{kept})")
        fl, run = h.inflight, h.run_state
        cut = {c.id for c in run.pending_calls if c.id in fl.started_ids and c.id not in fl.settled}
        pending = await self.close_open_calls(keep_unstarted=True)
        if pending:
            resumed = [c.name for c in pending if c.id in cut]
            closed = [c.name for c in run.pending_calls if c.id in cut and c not in pending]
            how = (f"{', '.join(resumed)} left open, to continue on resume" if resumed
                   else "before the tool calls started")
            if closed:
                how += f"; {', '.join(closed)} closed, outcome unknown"
            return Stop(StopReason.INTERRUPTED, f"{text} ({how})",
                        {"pending_actions": tuple(PendingAction(c, "interrupted") for c in pending),
                         "last_safe_point": Phase.MID_TURN.value})
        return Stop(StopReason.INTERRUPTED, f"{text} (during {during.value})")

    def answered_with_calls(self) -> bool:
        """In Model: the call completed and its answer with tool calls is recorded (a stop landed just
        as it returned); those calls are open like MidTurn's before any started."""
        h = self.h
        run, transcript = h.run_state, h.view._transcript
        return (h.inflight.request is None and bool(run.pending_calls) and run.last_response is not None
                and bool(transcript) and transcript[-1] is run.last_response.message)

    def keep_cut_answer(self) -> str:
        """A model call was cut: keep the text that had streamed (as an assistant message marked
        ``interrupted``) and count the call's tokens as an estimate. Returns a note for the stop detail.

        The text kept is what the chain's stream filters had passed on when there are any
        (:attr:`ModelTrace.kept <fsm_agent.machine.port.ModelTrace.kept>`: masked by the ``redaction``
        plugin, without what it still held); the estimate counts all that streamed."""
        h = self.h
        fl = h.inflight
        streamed, partial = fl.trace.streamed, fl.trace.kept
        fl.trace.text.clear()
        fl.trace.shown = None
        request = fl.request
        if request is None:  # no call in flight: it completed (its answer is recorded) or never began
            return ""
        h.accounting.cut(request, streamed)
        fl.request = None
        h.record("model_call_interrupted", {"streamed_chars": len(streamed)})
        if not partial:
            return ""
        h.append(AssistantMessage((TextBlock(partial),), {"interrupted": True}))
        return f"; the {len(partial)} characters that had streamed are kept in the transcript"

    async def close_open_calls(self, *, keep_unstarted: bool) -> list[ToolUseBlock]:
        """After MidTurn stopped early, give every open tool call its result: what it returned if it
        ran, "outcome unknown" if it was in flight (or left open in flight by an earlier interrupt),
        "not run" if it never started.

        With ``keep_unstarted`` (an interrupt), calls may stay open instead, to run on resume: every
        call when none had started; else each call cut in flight whose tool is ``resumable`` (it runs
        again with the same idempotency key), while the other calls cut in flight are closed
        "outcome unknown" and the finished ones keep their results, for the resumed turn. Returns
        the calls left open (the turn stays pending), or ``[]`` when every call was closed."""
        h = self.h
        run, fl, ledger = h.run_state, h.inflight, h.ledger
        if not run.pending_calls or (h.machine.state is not Phase.MID_TURN and not self.answered_with_calls()):
            return []
        answered: set[str] = set()
        for m in reversed(h.view._transcript):
            if isinstance(m, ToolResultMessage):
                answered.add(m.tool_call_id)
            elif isinstance(m, AssistantMessage):
                break
        open_calls = [c for c in run.pending_calls if c.id not in answered]
        if keep_unstarted and not any(c.id in fl.started_ids or c.id in fl.settled for c in open_calls):
            return open_calls
        cut = [c for c in open_calls if c.id in fl.started_ids and c.id not in fl.settled]
        resumable = {c.id for c in cut if getattr(h.view.tools.get(c.name), "resumable", False)}
        keep = keep_unstarted and bool(resumable)
        # each call cut in flight of a resumable tool continues on resume; the rest get their results
        results: dict[str, ToolResultMessage] = {}
        for c in open_calls:
            if keep and c.id in resumable:
                continue
            res = fl.settled.get(c.id)
            if res is None:
                entry = ledger.get(c.id)
                if c.id in fl.started_ids or (entry is not None and entry.status is LedgerStatus.STARTED):
                    res = ToolResultMessage(c.id, "The run stopped while this tool call was running; its outcome is "
                                            "unknown: it may or may not have taken effect.", is_error=True,
                                            name=c.name, metadata={"synthetic": "interrupted"})
                    await ledger.record(c, LedgerStatus.INTERRUPTED, res, durable=True)
                else:
                    res = ToolResultMessage(c.id, "The run stopped before this tool call started; it did not run.",
                                            is_error=True, name=c.name, metadata={"synthetic": "not_run"})
                    await ledger.record(c, LedgerStatus.NOT_RUN, res, durable=False)
            results[c.id] = res
        if keep:
            # the turn stays open: the closed calls keep their results for the resumed MidTurn
            run.decided_results = {**run.decided_results, **results}
            return [c for c in open_calls if c.id in resumable]
        for c in open_calls:
            h.append(results[c.id])
        run.pending_calls = []
        run.decided_results = {}
        return []

    async def cancel(self, reason: str, note: str = "") -> Outcome:
        """Cancel: compensate side effects that happened (or may have: calls cut in flight), or ask a
        person to confirm them first. A compensation hook may ask for that confirmation too (it
        raises :class:`WaitForHuman`: a sub-agent whose own cancel waits for a person); once the
        person confirmed, each hook runs again with ``ToolContext.decision`` ``approve``."""
        h = self.h
        run, ledger = h.run_state, h.ledger
        unconfirmed: list[tuple[LedgerEntry, str]] = []
        for entry in list(ledger.entries.values()):
            if entry.status not in (LedgerStatus.COMPLETED, LedgerStatus.INTERRUPTED, LedgerStatus.STARTED):
                continue
            side_effect = entry.effect == ToolEffect.SIDE_EFFECT.value
            if not side_effect and not ledger.compensable(entry):
                continue
            try:
                if await ledger.compensate(entry, confirmed=run.cancel_confirmed):
                    continue
            except WaitForHuman as wait:
                unconfirmed.append((entry, wait.detail))
                continue
            if side_effect and not run.cancel_confirmed:
                unconfirmed.append((entry, "" if entry.status is LedgerStatus.COMPLETED else
                                    "outcome unknown: it was cut while running"))
        if unconfirmed and h.machine.can_fire(Trigger.WAIT_HUMAN) and h.journal is not None:
            names = ", ".join(f"{e.tool}({e.call_id})" + (f", {why}" if why else "") for e, why in unconfirmed)
            port = h.port
            await port.store.push_control(ControlRecord(h.session_id, ControlKind.CANCEL, reason, port.new_id(), port.now()))
            return Stop(StopReason.WAITING_HUMAN,
                        f"cancel requested, but these side effects happened (or may have) and have no "
                        f"compensation: {names}; confirm to finish cancelling", {"required_decision": "confirm_cancel"})
        return Stop(StopReason.CANCELLED, reason + note)
