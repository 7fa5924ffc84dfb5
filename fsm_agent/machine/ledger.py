"""The tool-call ledger of a run: each call's state (proposed → approved → started → completed |
failed | ...), written before the step it names, and the tools' recovery hooks.

A state is written at once (durably) for calls with effects (``idempotent``, ``side_effect``) and
with the next commit for ``pure`` ones, which a crash can only make run again. The ledger by call
id is the store's (loaded at a resume) plus what this run wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import evolve

from ..control import Decision
from ..errors import WaitForHuman
from ..store.base import LedgerEntry, LedgerStatus
from ..tools.execution import idempotency_key, result_blocks
from ..tools.registry import RUN_AGAIN, ToolContext, ToolEffect, ToolRegistry
from ..types.content import ToolUseBlock
from ..types.messages import ToolResultMessage
from .journal import Journal, ledger_entry
from .port import EffectPort
from .state import RunState
from .turns import TurnRecorder

__all__ = ["ToolLedger"]


class ToolLedger:
    """The ledger of one run segment (see the module doc).

    Args:
        entries: the session's ledger by call id, as the store has it (a resume).
    """

    __slots__ = ("entries", "tools", "run", "journal", "turns", "port", "session_id")

    def __init__(self, entries: Mapping[str, LedgerEntry], *, tools: ToolRegistry, run: RunState,
                 journal: Journal | None, turns: TurnRecorder, port: EffectPort, session_id: str) -> None:
        self.entries: dict[str, LedgerEntry] = dict(entries)
        self.tools = tools
        self.run = run
        self.journal = journal
        self.turns = turns
        self.port = port
        self.session_id = session_id

    def get(self, call_id: str) -> LedgerEntry | None:
        return self.entries.get(call_id)

    def effect(self, call: ToolUseBlock) -> ToolEffect:
        tool = self.tools.get(call.name)
        return tool.effect if tool is not None else ToolEffect.PURE

    def all_pure(self, calls: list[ToolUseBlock]) -> bool:
        return all(self.effect(c) is ToolEffect.PURE for c in calls)

    async def record(self, call: ToolUseBlock, status: LedgerStatus, result: ToolResultMessage | None = None,
                     *, durable: bool | None = None) -> None:
        """Record ``call`` in ``status`` (see the module doc for when it is written; ``durable`` forces it)."""
        effect = self.effect(call)
        j = self.journal
        entry = ledger_entry(self.session_id, self.run.turn, call, status, effect=effect.value, result=result,
                             now=self.port.now(), forms=j.forms if j is not None else None)
        self.entries[call.id] = entry
        self.turns.observe(call, status, result)
        if j is None:
            return
        j.record("tool_call", {"call_id": call.id, "tool": call.name, "status": status.value}, self.run.turn)
        await j.ledger(entry, durable=effect is not ToolEffect.PURE if durable is None else durable)

    def tool_context(self, call_id: str, name: str, turn: int, decision: Decision | None = None) -> ToolContext:
        sid = self.session_id
        return ToolContext(call_id, idempotency_key(sid, call_id), sid, turn, name, None, decision)

    async def reconcile(self, call: ToolUseBlock) -> Any:
        """A side-effect call found started but unfinished: ask its tool what happened. Returns the
        result to record, :data:`~fsm_agent.tools.RUN_AGAIN`, or ``None`` (unknown: a person decides)."""
        tool = self.tools.get(call.name)
        if tool is None or tool.reconcile is None:
            return None
        outcome = await self.port.tool_hook(tool, "reconcile", (dict(call.input),),
                                            self.tool_context(call.id, call.name, self.run.turn))
        if outcome is None or outcome is RUN_AGAIN:
            return outcome
        return ToolResultMessage(call.id, result_blocks(outcome), name=call.name, metadata={"reconciled": True})

    def compensable(self, entry: LedgerEntry) -> bool:
        """Whether the tool of ``entry`` has an ``on_compensate`` hook."""
        tool = self.tools.get(entry.tool)
        return tool is not None and tool.compensate is not None

    async def compensate(self, entry: LedgerEntry, *, confirmed: bool = False) -> bool:
        """Run the tool's ``on_compensate`` for a call that happened (or may have); ``True`` when it was
        compensated (the ledger then says ``rejected``), ``False`` without a hook or when the hook
        returned ``False`` (nothing undone: the entry stays as it was). ``confirmed``: a person
        confirmed the cancel (the hook's ``ToolContext.decision`` is then ``approve``).

        Raises:
            WaitForHuman: the hook cannot undo the call before a person confirms the cancel (a
                sub-agent's cancel waits for its own confirmation); never when ``confirmed``.
        """
        tool = self.tools.get(entry.tool)
        if tool is None or tool.compensate is None:
            return False
        ctx = self.tool_context(entry.call_id, entry.tool, entry.turn, Decision.approve() if confirmed else None)
        try:
            out = await self.port.tool_hook(tool, "compensate", (entry.arguments, entry.result), ctx)
        except WaitForHuman:
            if not confirmed:
                raise
            out = False  # asked again after the person confirmed: nothing more can be done
        if out is False:
            return False
        compensated = evolve(entry, status=LedgerStatus.REJECTED, updated_at=self.port.now())
        self.entries[entry.call_id] = compensated
        if self.journal is not None:
            self.journal.record("compensated", {"call_id": entry.call_id, "tool": entry.tool,
                                                "was": entry.status.value}, self.run.turn)
            await self.journal.ledger(compensated)
        return True
