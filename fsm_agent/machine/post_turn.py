"""PostTurn as a phase object: the output schema check (one repair turn) → the ``post_turn``
decisions (verifier, PlanAct) → queued followups → ``complete`` or ``next_turn``."""

from __future__ import annotations

from typing import Any

from ..middleware import Complete, Continue
from ..structured import deliver_output, output_listener, parse_output, repair_message
from ..types.events import OutputPartial, PolicyDecision
from ..types.messages import ModelStopReason, UserMessage
from ..types.requests import MessageResponse
from ..types.run import StopReason
from .controls import Controls
from .host import Host
from .outcome import Move, Outcome, Stop
from .phases import Trigger

__all__ = ["PostTurn"]


class PostTurn:
    """The PostTurn phase (see the module doc)."""

    __slots__ = ("h", "controls")

    def __init__(self, host: Host, controls: Controls) -> None:
        self.h = host
        self.controls = controls

    async def run(self) -> Outcome:
        h = self.h
        ctx, run = h.view, h.run_state
        resp = run.last_response
        schema = run.config.output_schema
        if schema is not None and resp is not None and not resp.tool_calls \
                and resp.stop_reason is not ModelStopReason.PAUSE_TURN:
            checked = self._check_output(resp, schema)
            if checked is not None:
                return checked
            if h.bus.wants(OutputPartial) or output_listener(h.session_id) is not None:
                await deliver_output(h.bus, OutputPartial(h.session_id, run.turn, schema.name,
                                                          run.metadata["output_data"], validated=True))
        decision = await h.chain.turn_decision(ctx)
        if decision is not None:
            name, d = decision
            if h.bus.wants(PolicyDecision) and isinstance(d, (Complete, Continue)):
                kind, why = ("complete", d.detail) if isinstance(d, Complete) else ("continue", d.reason)
                await h.bus.emit(PolicyDecision(h.session_id, run.turn, name, "post_turn", kind, why))
            if isinstance(d, Complete):
                followed = await self.controls.followups()
                if followed is not None:
                    return followed
                run.evidence.extend(d.evidence)
                verdict = f"{d.detail} (decided by {name})"
                h.turns.verdict = verdict
                return Stop(StopReason.COMPLETED, verdict, {"evidence_refs": d.evidence})
            if isinstance(d, Continue):
                if d.message is not None:
                    h.append(d.message)
                h.turns.end(verification=f"continue: {d.reason} (decided by {name})")
                return Move(Trigger.NEXT_TURN, f"{d.reason} (decided by {name})")
        if resp is None or resp.tool_calls or resp.stop_reason is ModelStopReason.PAUSE_TURN:
            h.turns.end()
            return Move(Trigger.NEXT_TURN, "tool results are in; continue" if resp and resp.tool_calls
                        else "model paused its turn; continue")
        followed = await self.controls.followups()
        if followed is not None:
            return followed
        if resp.stop_reason is ModelStopReason.MAX_TOKENS:
            return Stop(StopReason.COMPLETED, "the answer was cut at the output token limit (max_tokens); "
                        "it is partial — raise max_output_tokens for a full answer")
        return Stop(StopReason.COMPLETED, f"the model ended its turn ({resp.stop_reason.value}) with no tool calls")

    def _check_output(self, resp: MessageResponse, schema: Any) -> Outcome | None:
        """Check the answer against the output schema: ``None`` when it holds (the value is kept for
        the result); one repair turn on the first mismatch; a typed stop on the second."""
        h = self.h
        run = h.run_state
        parsed = parse_output(resp, schema)
        if parsed.error is None:
            run.metadata["output_data"] = parsed.value
            run.structured_repair = False
            return None
        h.record("output_invalid", {"error": parsed.error, "repair": not run.structured_repair})
        if not run.structured_repair:
            run.structured_repair = True
            h.append(UserMessage(repair_message(parsed)))
            h.turns.end(verification=f"output schema {schema.name!r} not met: {parsed.error}; one repair turn")
            return Move(Trigger.NEXT_TURN, "the answer does not match the output schema; asking once for a repair")
        return Stop(StopReason.FAILED_TERMINAL, f"the answer does not match the output schema {schema.name!r} "
                    f"after one repair turn: {parsed.error}",
                    {"error": {"kind": "structured_output_invalid", "message": parsed.error}})
