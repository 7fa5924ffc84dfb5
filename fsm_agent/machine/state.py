"""The run state: everything the driver carries from one phase to the next, as one typed value.

:class:`RunState` is checkpointed whole: a checkpoint's data is ``unstructure(state)`` and a
restore is ``structure(data, RunState)`` through the one converter (:mod:`fsm_agent.types.codec`).
There is no hand-kept list of keys to drift out of step with the fields; a field added here is
saved and restored by construction (a test round-trips every field).

The tool-call ledger is not part of it: its durable home is the store's ledger table, written
before each step it names, so a checkpoint never copies it (a copy in every checkpoint would grow
the store quadratically with the tool results). The driver holds the ledger beside the state.

Plugins never see this object: they get a :class:`~fsm_agent.context.RunContext`, a
read-only view of it plus the things a plugin may write (``messages``, :class:`TurnSettings`,
and the plan through ``ctx.update_plan``).
"""

from __future__ import annotations

from typing import Any

from attrs import define, field

from ..control import Decision
from ..permissions import PermissionRequest, Permissions
from ..types.content import ToolUseBlock
from ..types.messages import ToolResultMessage, Usage
from ..types.plan import Plan
from ..types.requests import MessageResponse
from ..config import RunConfig
from .phases import Phase

__all__ = ["RunState"]


@define
class RunState:
    """Everything the driver carries across phases, checkpointed whole (schema version 2)."""

    config: RunConfig = field(factory=RunConfig)
    """Budgets and settings of the run (raised budgets on a resume land here)."""
    state: str = Phase.IDLE.value
    """The machine state's name when the state was saved (a phase or a StopReason)."""
    turn: int = 0
    """Model calls started in this session (1-based once the first call starts)."""
    usage: Usage = Usage()
    """Tokens over the session (``estimated`` once any call reported none)."""
    cost_usd: float | None = 0.0
    """USD over the session; ``None`` once a call had no known price."""
    tool_calls_made: int = 0
    """Tool calls executed over the session."""
    tool_call_counts: dict[str, int] = field(factory=dict)
    """Executed calls per tool name."""
    pending_calls: list[ToolUseBlock] = field(factory=list)
    """The last model response's tool calls that have no result yet."""
    decisions: dict[str, Decision] = field(factory=dict)
    """A person's decisions on pending calls, by call id, not yet written to the ledger."""
    decided_results: dict[str, ToolResultMessage] = field(factory=dict)
    """Results of the current MidTurn's calls settled before the run stopped to wait for a person."""
    context_retry: bool = False
    """The context-length recovery (re-trim and retry once, case B20) was used for this call."""
    max_output_override: int | None = None
    """A lowered ``max_tokens`` for the next call (context-length recovery); tokens."""
    output_retry: bool = False
    """The one retry with a larger output limit after a tool call was cut off by it was used."""
    structured_repair: bool = False
    """The one repair turn for an answer that broke the output schema was used."""
    evidence: list[str] = field(factory=list)
    """Evidence references gathered (verifier records, event seqs)."""
    elapsed: float = 0.0
    """Wall-clock seconds spent by earlier runs of this session (resumes)."""
    goal_version: int = 1
    """Incremented by each Steer."""
    last_response: MessageResponse | None = None
    """The last model response, or ``None`` before the first."""
    cancel_confirmed: bool = False
    """A person confirmed a cancel whose side effects have no compensation."""
    transcript_len: int = 0
    """Messages in the transcript when the state was saved."""
    turn_input_seq: int | None = None
    """Seq of the event that started the current turn (the user message, a tool result, a control)."""
    metadata: dict[str, Any] = field(factory=dict)
    """JSON-safe data of later capabilities (plans, compaction) that ride the checkpoint."""
    plan: Plan | None = None
    """The run's plan (PlanAct), or ``None`` when no plugin made one; written only through
    ``ctx.update_plan``. Checkpoints older than this field load with ``None``."""
    permissions: Permissions | None = None
    """The session's permissions (tools and argument scopes), checked by the engine at PreTurn and
    for every tool call; ``None``: no limit (every tool; sessions made before permissions existed
    load with ``None``). Only a person changes them: narrowed by a ``Restrict`` control, widened
    by approving a ``RequestPermissions``."""
    permission_request: PermissionRequest | None = None
    """A request to widen :attr:`permissions` that waits for a person's decision, or ``None``."""
