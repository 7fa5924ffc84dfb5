"""Budget: finer run budgets, soft-threshold warnings and an optional wrap-up turn.

**How the work is split with the core.** The driver checks the budgets of
:class:`~fsm_agent.RunConfig` at every PreTurn, *before* any middleware runs,
in seed 000's order (shutdown → iterations → wall clock → tokens → cost), and
ends the run PAUSED_BUDGET. That check is the hard backstop: no warning, no
wrap-up. This middleware does not repeat it. It

* adds the budgets the core does not have: model calls, tool calls (in total
  and per tool), input tokens and output tokens;
* may set its own iterations / wall-clock / total-token / cost limits. They
  only matter when lower than the core's (the core checks first); a limit the
  core shadows is logged (logger ``fsm_agent.middleware.budget``) at run start;
* emits one :class:`~fsm_agent.types.BudgetWarning` per budget (``ctx.emit``)
  when usage reaches ``soft_threshold`` of its limit: its own budgets, and
  with ``warn_core=True`` the core's too (against the lower limit when both
  are set), so the core's budgets get a warning without being checked twice;
* with ``wrap_up=True``, turns the stop into one last model call with tools
  disabled (``ctx.settings.tools_enabled = False``) and an instruction to answer with
  what the model has (appended to ``ctx.messages`` only, never to the
  transcript). If the model answers, the run completes (``post_turn`` returns
  :class:`~fsm_agent.Complete` naming the budget); if it still wants to go
  on (tool calls, which are denied, or a paused turn) the next PreTurn stops
  PAUSED_BUDGET. The wrap-up call is one model call beyond the limit that
  triggered it, and the core's own limits still apply to it.

Budgets, their ``budget`` name (``RunStop.budget``, ``BudgetWarning.budget``),
unit and source (all checked at PreTurn with ``used >= limit``, in this order):

=================  ==================  ==================================================
``iterations``     model calls         ``ctx.turn`` (driver model calls, whole session)
``model_calls``    model calls         ``wrap_model_call`` entries in this run (Budget sits
                                       inside RetryFallback: its retries count; calls made
                                       with ``ctx.call_provider`` bypass the chain and don't)
``tool_calls``     tool calls          ``ctx.tool_calls_made`` (executed calls, session)
``wall_clock``     seconds             ``ctx.elapsed`` (session)
``tokens``         tokens              ``ctx.usage.total_tokens`` (input + output)
``input_tokens``   tokens              ``ctx.usage.input_tokens``
``output_tokens``  tokens              ``ctx.usage.output_tokens``
``cost``           USD                 ``ctx.cost_usd`` (unenforceable while ``None``:
                                       a model had no price; logged once per run)
=================  ==================  ==================================================

Tool-call limits are also enforced in **MidTurn**: a call that would go over
``max_tool_calls`` or its ``max_calls_per_tool`` entry gets ``Deny(reason)``
(the model sees an error result; the tool does not run). Calls of the same
turn are counted as they are allowed, so parallel calls cannot overshoot. A
per-tool limit only denies (other tools stay usable; its warning and reason
use the name ``tool_calls:<tool>``); the total limit also pauses the run at
the next PreTurn (or starts the wrap-up turn).

Stop detail: ``"<budget> budget exhausted: <used> of <limit> <unit> used"``,
e.g. ``"model_calls budget exhausted: 2 of 2 model calls used"``; token
budgets add ``" (partly estimated)"`` when a count was estimated.

State (model calls, which budgets were warned, the wrap-up) lives in
``ctx.state(self)`` and is reset at each run start: a resumed run counts its
model calls from zero and may warn again. Session totals (iterations, tool
calls, tokens, cost, wall clock) come from the checkpointed context.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fsm_agent import (
    Complete,
    ConfigurationError,
    Deny,
    Middleware,
    ModelStopReason,
    Ordering,
    RunContext,
    StopReason,
    StopRun,
    ToolUseBlock,
    UserMessage,
)
from fsm_agent.types import BudgetWarning, MessageRequest, MessageResponse

__all__ = ["DEFAULT_WRAP_UP_MESSAGE", "Budget"]

log = logging.getLogger("fsm_agent.middleware.budget")

DEFAULT_WRAP_UP_MESSAGE = (
    "The {budget} budget of this run is used up ({detail}). Tools are now disabled. "
    "Answer now with what you have so far, and say briefly what is left undone."
)
"""Wrap-up instruction; ``{budget}`` and ``{detail}`` are filled in."""

_UNITS = {
    "iterations": "model calls", "model_calls": "model calls", "tool_calls": "tool calls",
    "wall_clock": "s", "tokens": "tokens", "input_tokens": "input tokens",
    "output_tokens": "output tokens", "cost": "USD",
}
_OPTION = {name: f"max_{name}" for name in _UNITS} | {"tokens": "max_total_tokens", "cost": "max_cost_usd"}
_CORE = {"iterations": "max_iterations", "wall_clock": "max_wall_clock", "tokens": "max_tokens",
         "cost": "max_cost_usd"}


def _fmt(name: str, value: float) -> str:
    if name == "cost":
        return f"{value:.4f}"
    if name == "wall_clock":
        return f"{value:.1f}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _limit(option: str, value: Any, *, integer: bool) -> Any:
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < 0:
        kind = "an integer" if integer else "a number"
        raise ConfigurationError(f"Budget: {option} must be {kind} >= 0 or None, not {value!r}")
    return value


class Budget(Middleware):
    """Run budgets beyond the core's, with warnings and an optional wrap-up turn.

    Args (all keyword-only; ``None`` = no limit):
        max_iterations: driver model calls in the session (set it below
            ``RunConfig.max_iterations``, or the core stops first, without wrap-up).
        max_model_calls: model calls through this middleware in this run.
        max_tool_calls: executed tool calls in the session.
        max_calls_per_tool: ``{tool name: calls}``; over it, a call is denied.
        max_input_tokens / max_output_tokens / max_total_tokens: tokens.
        max_cost_usd: USD.
        max_wall_clock: seconds.
        soft_threshold: fraction of a limit in (0, 1] at which a
            ``BudgetWarning`` is emitted once per budget; ``None``: no warnings.
        warn_core: also warn for ``RunConfig``'s iterations, wall clock, tokens, cost.
        wrap_up: when a limit is reached, one more call with tools disabled.
        wrap_up_message: the instruction for that call (``{budget}``, ``{detail}``).

    Raises:
        ConfigurationError: a negative or non-numeric limit, or a threshold outside (0, 1].
    """

    name = "budget"

    ordering = Ordering(wrapped_by=("tool_activation", "tool_policy", "approval", "retry"))

    def __init__(
        self,
        *,
        max_iterations: int | None = None,
        max_model_calls: int | None = None,
        max_tool_calls: int | None = None,
        max_calls_per_tool: Mapping[str, int] | None = None,
        max_input_tokens: int | None = None,
        max_output_tokens: int | None = None,
        max_total_tokens: int | None = None,
        max_cost_usd: float | None = None,
        max_wall_clock: float | None = None,
        soft_threshold: float | None = 0.8,
        warn_core: bool = True,
        wrap_up: bool = False,
        wrap_up_message: str = DEFAULT_WRAP_UP_MESSAGE,
    ) -> None:
        given = {"iterations": max_iterations, "model_calls": max_model_calls, "tool_calls": max_tool_calls,
                 "wall_clock": max_wall_clock, "tokens": max_total_tokens, "input_tokens": max_input_tokens,
                 "output_tokens": max_output_tokens, "cost": max_cost_usd}
        self.limits: dict[str, float | None] = {
            name: _limit(_OPTION[name], value, integer=name not in ("wall_clock", "cost"))
            for name, value in given.items()
        }
        """Own limit per budget name, in check order (``None``: not set here)."""
        self.max_calls_per_tool: dict[str, int] = {
            str(k): _limit(f"max_calls_per_tool[{k!r}]", v, integer=True) for k, v in (max_calls_per_tool or {}).items()
        }
        if soft_threshold is not None and (isinstance(soft_threshold, bool) or not 0 < soft_threshold <= 1):
            raise ConfigurationError(f"Budget: soft_threshold must be in (0, 1] or None, not {soft_threshold!r}")
        self.soft_threshold = soft_threshold
        self.warn_core = warn_core
        self.wrap_up = wrap_up
        self.wrap_up_message = wrap_up_message

    def __repr__(self) -> str:
        opts = [f"{_OPTION[n]}={v!r}" for n, v in self.limits.items() if v is not None]
        if self.max_calls_per_tool:
            opts.append(f"max_calls_per_tool={self.max_calls_per_tool!r}")
        opts += [f"soft_threshold={self.soft_threshold!r}", f"warn_core={self.warn_core!r}",
                 f"wrap_up={self.wrap_up!r}"]
        return f"Budget({', '.join(opts)})"

    # -- bookkeeping ---------------------------------------------------------------
    def _state(self, ctx: RunContext) -> dict[str, Any]:
        st = ctx.state(self)
        if not st:
            st.update(model_calls=0, warned=set(), wrap=None, turn=-1, reserved={}, reserved_total=0,
                      cost_unknown_logged=False)
        return st

    def _used(self, name: str, ctx: RunContext, st: dict[str, Any]) -> float | None:
        u = ctx.usage
        used: dict[str, float | None] = {
            "iterations": ctx.turn, "model_calls": st["model_calls"], "tool_calls": ctx.tool_calls_made,
            "wall_clock": ctx.elapsed, "tokens": u.total_tokens, "input_tokens": u.input_tokens,
            "output_tokens": u.output_tokens, "cost": ctx.cost_usd,
        }
        return used[name]

    def detail(self, name: str, used: float, limit: float, *, estimated: bool = False, unit: str | None = None) -> str:
        """The stop detail: ``"<name> budget exhausted: <used> of <limit> <unit> used"``."""
        est = " (partly estimated)" if estimated and name.endswith("tokens") else ""
        lim = f"{limit:g}" if name == "wall_clock" else _fmt(name, limit)
        return f"{name} budget exhausted: {_fmt(name, used)} of {lim} {unit or _UNITS[name]} used{est}"

    def _warn(self, ctx: RunContext, st: dict[str, Any], name: str, used: float | None, limit: float | None) -> None:
        if self.soft_threshold is None or used is None or limit is None or name in st["warned"]:
            return
        if used >= self.soft_threshold * limit:
            st["warned"].add(name)
            ctx.emit(BudgetWarning(ctx.session_id, ctx.turn, name, used, limit))

    # -- hooks -----------------------------------------------------------------------
    def on_run_start(self, ctx: RunContext) -> None:
        ctx.state(self).clear()
        for name, option in _CORE.items():
            own, core = self.limits[name], getattr(ctx.config, option)
            if own is not None and core is not None and own >= core:
                log.warning("Budget %s=%r is not below RunConfig.%s=%r: the core stops the run first, "
                            "without this middleware's wrap-up", _OPTION[name], own, option, core)

    def pre_turn(self, ctx: RunContext) -> None:
        st = self._state(ctx)
        hit: tuple[str, str] | None = None
        for name, own in self.limits.items():
            used = self._used(name, ctx, st)
            if used is None:  # cost with an unpriced model
                if own is not None and not st["cost_unknown_logged"]:
                    st["cost_unknown_logged"] = True
                    log.warning("cost budget of %s USD cannot be enforced: a model of this run has no known price",
                                own)
                continue
            core = getattr(ctx.config, _CORE[name]) if self.warn_core and name in _CORE else None
            self._warn(ctx, st, name, used, min((x for x in (own, core) if x is not None), default=None))
            if hit is None and own is not None and used >= own:
                hit = name, self.detail(name, used, own, estimated=ctx.usage.estimated)
        if st["wrap"] is not None:
            name, detail = st["wrap"]
            raise StopRun(StopReason.PAUSED_BUDGET,
                          f"{detail}; after the wrap-up turn (tools disabled) the model still wanted to continue",
                          budget=name)
        if hit is None:
            return
        if not self.wrap_up:
            raise StopRun(StopReason.PAUSED_BUDGET, hit[1], budget=hit[0])
        st["wrap"] = hit
        ctx.settings.tools_enabled = False
        ctx.messages.append(UserMessage(self.wrap_up_message.format(budget=hit[0], detail=hit[1])))

    async def wrap_model_call(self, request: MessageRequest, call_next: Any, ctx: RunContext) -> MessageResponse:
        self._state(ctx)["model_calls"] += 1
        response: MessageResponse = await call_next(request)
        return response

    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Deny | None:
        st = self._state(ctx)
        if st["wrap"] is not None:
            return Deny(f"tools are disabled in the wrap-up turn ({st['wrap'][1]}); answer with what you have")
        if st["turn"] != ctx.turn:  # calls allowed earlier in this turn have not run yet: count them here
            st.update(turn=ctx.turn, reserved={}, reserved_total=0)
        per_tool = self.max_calls_per_tool.get(call.name)
        used_tool = ctx.tool_call_counts.get(call.name, 0) + st["reserved"].get(call.name, 0)
        if per_tool is not None and used_tool >= per_tool:
            name = f"tool_calls:{call.name}"
            return Deny(self.detail(name, used_tool, per_tool, unit=f"{call.name} calls")
                        + f"; do not call {call.name} again in this run")
        total = self.limits["tool_calls"]
        used_total = ctx.tool_calls_made + st["reserved_total"]
        if total is not None and used_total >= total:
            return Deny(self.detail("tool_calls", used_total, total) + "; no more tool calls in this run")
        st["reserved"][call.name] = st["reserved"].get(call.name, 0) + 1
        st["reserved_total"] += 1
        self._warn(ctx, st, f"tool_calls:{call.name}", used_tool + 1, per_tool)
        self._warn(ctx, st, "tool_calls", used_total + 1, total)
        return None

    def post_turn(self, ctx: RunContext) -> Complete | None:
        wrap = self._state(ctx)["wrap"]
        resp = ctx.last_response
        if wrap is None or resp is None or resp.tool_calls or resp.stop_reason is ModelStopReason.PAUSE_TURN:
            return None
        return Complete(detail=f"answered in the wrap-up turn ({wrap[1]})")
