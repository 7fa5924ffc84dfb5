"""The loop's states and the transition table, as plain data (DESIGN.md §3).

Both the running machine (:mod:`.definition`) and the diagram
(:mod:`fsm_agent.diagrams`) are built from :data:`TRANSITIONS`; nothing else
defines a transition.
"""

from __future__ import annotations

import enum

from attrs import frozen

from ..types.run import StopReason

__all__ = ["PHASES", "STATES", "TERMINALS", "TRANSITIONS", "Phase", "State", "Transition", "Trigger"]


class Phase(str, enum.Enum):
    """The non-terminal states: ``Idle`` and the four loop phases."""

    IDLE = "Idle"
    PRE_TURN = "PreTurn"
    MODEL = "Model"
    MID_TURN = "MidTurn"
    POST_TURN = "PostTurn"


State = Phase | StopReason
"""Any state of the machine: a :class:`Phase` or a terminal :class:`StopReason`."""

PHASES: tuple[Phase, ...] = (Phase.PRE_TURN, Phase.MODEL, Phase.MID_TURN, Phase.POST_TURN)
TERMINALS: tuple[StopReason, ...] = tuple(StopReason)
STATES: tuple[Phase | StopReason, ...] = (*Phase, *StopReason)


class Trigger(str, enum.Enum):
    """Every trigger of the machine. Names are public: they appear in events and diagrams."""

    START = "start"
    CALL_MODEL = "call_model"
    PAUSE_BUDGET = "pause_budget"
    WAIT_HUMAN = "wait_human"
    INTERRUPT = "interrupt"
    CANCEL = "cancel"
    TOOL_USE = "tool_use"
    MODEL_DONE = "model_done"
    RETRY_CONTEXT = "retry_context"
    RETRY_OUTPUT = "retry_output"
    FAIL_RETRYABLE = "fail_retryable"
    FAIL_TERMINAL = "fail_terminal"
    TOOLS_DONE = "tools_done"
    NEXT_TURN = "next_turn"
    COMPLETE = "complete"
    RESUME = "resume"
    RESUME_TOOLS = "resume_tools"


@frozen
class Transition:
    """One row of the table: ``trigger`` moves ``source`` to ``dest`` ``when`` the guard holds."""

    trigger: Trigger
    source: Phase | StopReason
    dest: Phase | StopReason
    when: str
    """The guard, in words (the driver evaluates it; the diagram prints it)."""


_P, _S, _T = Phase, StopReason, Trigger

TRANSITIONS: tuple[Transition, ...] = (
    Transition(_T.START, _P.IDLE, _P.PRE_TURN, "start"),
    Transition(_T.CALL_MODEL, _P.PRE_TURN, _P.MODEL, "budget ok, no pending control, context built"),
    Transition(_T.PAUSE_BUDGET, _P.PRE_TURN, _S.PAUSED_BUDGET, "a budget is exhausted"),
    Transition(_T.WAIT_HUMAN, _P.PRE_TURN, _S.WAITING_HUMAN, "PreTurn middleware needs a human"),
    Transition(_T.FAIL_TERMINAL, _P.PRE_TURN, _S.FAILED_TERMINAL, "a fail-closed middleware failed"),
    Transition(_T.TOOL_USE, _P.MODEL, _P.MID_TURN, "model stop reason tool_use"),
    Transition(_T.MODEL_DONE, _P.MODEL, _P.POST_TURN, "end_turn, stop_sequence, max_tokens, pause_turn"),
    Transition(_T.RETRY_CONTEXT, _P.MODEL, _P.PRE_TURN, "context length exceeded: re-trim and retry once"),
    Transition(_T.RETRY_OUTPUT, _P.MODEL, _P.PRE_TURN,
               "a tool call was cut off by the output limit: discard the turn, retry once with a larger limit"),
    Transition(_T.PAUSE_BUDGET, _P.MODEL, _S.PAUSED_BUDGET, "the wall clock ran out during the call"),
    Transition(_T.FAIL_TERMINAL, _P.MODEL, _S.FAILED_TERMINAL, "content_filtered, refusal, non-retryable error"),
    Transition(_T.FAIL_RETRYABLE, _P.MODEL, _S.FAILED_RETRYABLE, "retryable error after retries are spent"),
    Transition(_T.WAIT_HUMAN, _P.MID_TURN, _S.WAITING_HUMAN, "a tool call needs approval"),
    Transition(_T.TOOLS_DONE, _P.MID_TURN, _P.POST_TURN, "all tool calls have results"),
    Transition(_T.FAIL_TERMINAL, _P.MID_TURN, _S.FAILED_TERMINAL, "a fail-closed middleware failed"),
    Transition(_T.NEXT_TURN, _P.POST_TURN, _P.PRE_TURN, "continue"),
    Transition(_T.COMPLETE, _P.POST_TURN, _S.COMPLETED, "verifier (or end_turn with no verifier) says done"),
    Transition(_T.WAIT_HUMAN, _P.POST_TURN, _S.WAITING_HUMAN, "verifier asks a human"),
    Transition(_T.FAIL_TERMINAL, _P.POST_TURN, _S.FAILED_TERMINAL, "a fail-closed middleware failed"),
    *(Transition(_T.INTERRUPT, p, _S.INTERRUPTED, "interrupt control event") for p in PHASES),
    *(Transition(_T.CANCEL, p, _S.CANCELLED, "cancel control event") for p in PHASES),
    *(
        Transition(_T.RESUME, s, _P.PRE_TURN, "resume with a decision / more budget")
        for s in (_S.WAITING_HUMAN, _S.PAUSED_BUDGET, _S.INTERRUPTED, _S.FAILED_RETRYABLE)
    ),
    Transition(_T.RESUME_TOOLS, _S.WAITING_HUMAN, _P.MID_TURN, "resume with decisions on pending tool calls"),
    Transition(_T.RESUME_TOOLS, _S.INTERRUPTED, _P.MID_TURN, "resume tool calls left unfinished"),
)
"""The transition table. Order is the order of the diagram."""
