"""Observers: watch a run, never change it (seed 004 §6: hooks observe, middleware decides).

An observer is any object with some of these methods (each optional), or a
plain callable that receives every event:

* ``on_transition(TransitionEvent)`` — every move of the machine;
* ``on_model_event(ModelStreamEvent)`` — text/thinking/tool-call deltas of the current model call;
* ``on_output_partial(OutputPartial)`` — with an output schema: the answer's JSON value as far as it
  has streamed, checked as far as it goes, then the value the final check accepted (not logged);
* ``on_model_retry(ModelRetry)`` — a failed model call is tried again (status, reason, the wait);
* ``on_tool_started(ToolStarted)`` / ``on_tool_finished(ToolFinished)``;
* ``on_budget_warning(BudgetWarning)``;
* ``on_approval_requested(ApprovalRequested)`` — tool calls wait for a person;
* ``on_plan_updated(PlanUpdated)`` — the run's plan changed (PlanAct);
* ``on_system_prompt_changed(SystemPromptChanged)`` — the session's model calls use a new system
  prompt from this turn on (the agent's prompt was set, or its prompt file changed);
* ``on_policy_decision(PolicyDecision)`` — a middleware denied, asked about, edited or answered a
  tool call, decided the turn, or stopped the run (naming the middleware);
* ``on_plugin_event(event)`` — an event a plugin emitted (``ctx.emit``) of a type not listed here
  (compaction's ``Compacted`` ...); only observers with this method receive them;
* ``on_event(event)`` — everything, after the specific method.

Methods may be sync or async. Observers run in registration order; an async
one is awaited before the next (so order holds), and the run waits for it:
keep observers quick. An observer that raises is logged (logger
``fsm_agent.hooks``) and the run goes on exactly as it would have.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

from .errors import ConfigurationError
from .types.events import (
    ApprovalRequested,
    BudgetWarning,
    ModelRetry,
    ModelStreamEvent,
    ObserverEvent,
    OutputPartial,
    PlanUpdated,
    PolicyDecision,
    SystemPromptChanged,
    ToolFinished,
    ToolProgress,
    ToolStarted,
    TransitionEvent,
    UsageRolledUp,
)

__all__ = ["HookBus", "Observer", "observers_muted"]

observers_muted: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "fsm_agent_observers_muted", default=None)
"""Set by a host that runs the engine again over history it already ran (a durable workflow replaying):
``() -> True`` while the observers have already seen what is being re-run, so they are told once."""

log = logging.getLogger("fsm_agent.hooks")

_METHOD = {
    TransitionEvent: "on_transition",
    ModelStreamEvent: "on_model_event",
    OutputPartial: "on_output_partial",
    ModelRetry: "on_model_retry",
    ToolStarted: "on_tool_started",
    ToolFinished: "on_tool_finished",
    BudgetWarning: "on_budget_warning",
    ApprovalRequested: "on_approval_requested",
    ToolProgress: "on_tool_progress",
    UsageRolledUp: "on_usage_rolled_up",
    PlanUpdated: "on_plan_updated",
    PolicyDecision: "on_policy_decision",
    SystemPromptChanged: "on_system_prompt_changed",
}


class Observer:
    """Optional base class: override the ``on_*`` methods you need (all default to doing nothing)."""

    def on_transition(self, event: TransitionEvent) -> Any: ...

    def on_model_event(self, event: ModelStreamEvent) -> Any: ...

    def on_output_partial(self, event: OutputPartial) -> Any: ...

    def on_model_retry(self, event: ModelRetry) -> Any: ...

    def on_tool_started(self, event: ToolStarted) -> Any: ...

    def on_tool_finished(self, event: ToolFinished) -> Any: ...

    def on_budget_warning(self, event: BudgetWarning) -> Any: ...

    def on_approval_requested(self, event: ApprovalRequested) -> Any: ...

    def on_tool_progress(self, event: ToolProgress) -> Any: ...

    def on_usage_rolled_up(self, event: UsageRolledUp) -> Any: ...

    def on_plan_updated(self, event: PlanUpdated) -> Any: ...

    def on_policy_decision(self, event: PolicyDecision) -> Any: ...

    def on_system_prompt_changed(self, event: SystemPromptChanged) -> Any: ...

    def on_plugin_event(self, event: Any) -> Any: ...


class HookBus:
    """Fans events out to observers, isolating their failures. Frozen once built."""

    __slots__ = ("_table", "_any", "_plugin", "observers")

    def __init__(self, observers: Iterable[Any] = ()) -> None:
        self.observers: tuple[Any, ...] = tuple(observers)
        self._table: dict[type, list[tuple[Any, Callable[..., Any]]]] = {t: [] for t in _METHOD}
        self._any = False
        self._plugin: list[tuple[Any, Callable[..., Any]]] = []
        """The ``on_plugin_event`` methods: events of the types not in the table go to them."""
        for obs in self.observers:
            found = False
            on_plugin = getattr(obs, "on_plugin_event", None)
            if on_plugin is not None and not _is_noop(obs, "on_plugin_event"):
                self._plugin.append((obs, on_plugin))
                found = True
            for etype, name in _METHOD.items():
                fn = getattr(obs, name, None)
                if fn is not None and not _is_noop(obs, name):
                    self._table[etype].append((obs, fn))
                    found = True
            on_event = getattr(obs, "on_event", None)
            if on_event is not None:
                for etype in _METHOD:
                    self._table[etype].append((obs, on_event))
                found = True
            if not found:
                if callable(obs):
                    for etype in _METHOD:
                        self._table[etype].append((obs, obs))
                else:
                    raise ConfigurationError(
                        f"observer {obs!r} has no on_* method and is not callable; see fsm_agent.hooks"
                    )
        self._any = any(self._table.values())

    def wants(self, event_type: type) -> bool:
        """Whether any observer listens to ``event_type`` (lets the driver skip building events)."""
        return bool(self._table.get(event_type))

    async def emit(self, event: ObserverEvent) -> None:
        """Deliver ``event``; never raises (except on cancellation)."""
        targets = self._table.get(type(event), self._plugin)
        if not targets:
            return
        muted = observers_muted.get()
        if muted is not None and muted():
            return
        for obs, fn in targets:
            try:
                result = fn(event)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - observers cannot change the run
                log.exception("observer %r failed on %s; ignored", obs, type(event).__name__)


def _is_noop(obs: Any, name: str) -> bool:
    """True when ``obs`` inherits :class:`Observer`'s do-nothing method for ``name``."""
    return isinstance(obs, Observer) and getattr(type(obs), name) is getattr(Observer, name)
