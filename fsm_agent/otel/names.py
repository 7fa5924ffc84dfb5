"""The names fsm_agent adds to the GenAI conventions: span attributes, span events, metrics, and the
session-metadata keys that carry a trace across segments and hosts. Chosen once: dashboards and
alerts are written against them. (The conventions' own names come from
``opentelemetry.semconv._incubating.attributes.gen_ai_attributes``; none is repeated here.)"""

from __future__ import annotations

__all__ = [
    "COST_USD", "EV_APPROVAL", "EV_BUDGET", "EV_COMPACTION", "EV_COMPACTION_FAILED", "EV_DECISION", "EV_PLAN",
    "EV_PLUGIN", "EV_RETRY", "EV_TRANSITION", "META_LINK", "META_PARENT", "METRIC_COST", "METRIC_STOPS",
    "METRIC_TOOL_CALLS", "OUTCOMES", "PHASE", "SEGMENT", "STOP_DETAIL", "STOP_ERROR", "STOP_REASON",
    "STOP_RESUMABLE", "TOOL_DECISION", "TOOL_EFFECT", "TOOL_OUTCOME", "TURN",
]

# -- span attributes ------------------------------------------------------------------------------
STOP_REASON = "fsm_agent.stop.reason"
"""invoke_agent: how the segment ended (a :class:`~fsm_agent.StopReason` value: ``COMPLETED``,
``WAITING_HUMAN`` ...)."""
STOP_RESUMABLE = "fsm_agent.stop.resumable"
"""invoke_agent: whether the session can be resumed from this stop."""
STOP_ERROR = "fsm_agent.stop.error"
"""invoke_agent: the stop's error kind, when it carries one (``rate_limited``, ``middleware`` ...)."""
STOP_DETAIL = "fsm_agent.stop.detail"
"""invoke_agent: the stop's detail in words (only with content capture on: it may quote the model)."""
SEGMENT = "fsm_agent.segment"
"""invoke_agent: ``start``, ``resume`` or ``recovered`` (a worker that died is taken over)."""
COST_USD = "fsm_agent.cost_usd"
"""invoke_agent: the session's cost so far in USD (absent when unknown)."""
TURN = "fsm_agent.turn"
"""chat, execute_tool, decision events: the turn number (1-based; 0 before the first model call)."""
PHASE = "fsm_agent.phase"
"""chat: the machine state a plugin's side call was made in (``PreTurn``, ``PostTurn`` ...: a
summarizer, a planner, a grader); absent on the Model phase's own call."""
TOOL_EFFECT = "fsm_agent.tool.effect"
"""execute_tool: the tool's effect kind: ``pure``, ``idempotent``, ``side_effect`` (``unknown``: no such tool)."""
TOOL_OUTCOME = "fsm_agent.tool.outcome"
"""execute_tool: the ledger outcome, one of :data:`OUTCOMES`."""
TOOL_DECISION = "fsm_agent.tool.decision"
"""execute_tool: the person's decision that let this call run (``approve``, ``edit``), when there was one."""

OUTCOMES = ("completed", "failed", "denied", "rejected", "responded", "outcome_unknown", "waiting_human",
            "suspended")
"""Values of :data:`TOOL_OUTCOME`: ran to a result (``completed``) or an error result (``failed``);
did not run because a policy denied it (``denied``), a person rejected it (``rejected``), or a policy
or a person answered it (``responded``); cut while running, so it may or may not have taken effect
(``outcome_unknown``); left open by its tool for a person (``waiting_human``) or to run again on
resume (``suspended``)."""

# -- span events (on the invoke_agent span) -------------------------------------------------------
EV_TRANSITION = "fsm_agent.transition"
"""The machine moved: ``fsm_agent.transition.from``, ``.trigger``, ``.to`` (and ``.reason`` with
content capture on)."""
EV_DECISION = "fsm_agent.decision"
"""A middleware decided: ``fsm_agent.middleware`` (its name), ``fsm_agent.decision`` (``deny``,
``ask``, ``edit``, ``respond``, ``complete``, ``continue``, ``stop``), ``fsm_agent.decision.hook``,
the tool's name and call id for tool decisions, ``fsm_agent.stop.reason`` for a stop, and
``fsm_agent.decision.reason`` with content capture on."""
EV_APPROVAL = "fsm_agent.approval_requested"
"""Tool calls wait for a person: ``fsm_agent.pending.count``, ``.tools``, ``.call_ids``, ``.reasons``."""
EV_BUDGET = "fsm_agent.budget_warning"
"""A budget crossed its soft threshold: ``fsm_agent.budget``, ``fsm_agent.budget.used``, ``.limit``."""
EV_RETRY = "fsm_agent.retry"
"""A failed model call is tried again: ``fsm_agent.retry.attempt``, ``error.type``,
``http.response.status_code``, ``fsm_agent.retry.delay_s`` (the wait used), ``fsm_agent.retry.server_hint``
(``True``: that wait is the server's ``Retry-After``), ``fsm_agent.retry.layer`` (``provider``: an
HTTP attempt, an event of its ``chat`` span; ``retry`` or a plugin's name: a whole call again, an
event of the ``invoke_agent`` span, each attempt its own ``chat`` span)."""
EV_COMPACTION = "fsm_agent.compaction"
"""A compaction was committed: ``fsm_agent.compaction.level``, ``.trigger``, ``.tokens_before``,
``.tokens_after``, ``.first``, ``.last`` (the message range), ``.edits``."""
EV_COMPACTION_FAILED = "fsm_agent.compaction.failed"
"""A compaction attempt changed nothing: ``fsm_agent.compaction.level``, ``.trigger``, ``.reason``, ``.tokens``."""
EV_PLAN = "fsm_agent.plan_updated"
"""The plan changed: ``fsm_agent.plan.version``, ``.nodes``, ``.done`` (nodes passed)."""
EV_PLUGIN = "fsm_agent.plugin_event"
"""Another event a plugin emitted: ``fsm_agent.event.type`` (its log type)."""

# -- metrics (besides the conventions' gen_ai.client.token.usage and gen_ai.client.operation.duration)
METRIC_COST = "fsm_agent.run.cost"
"""Counter, USD: what each run segment cost (attributes ``gen_ai.agent.name``, ``fsm_agent.stop.reason``)."""
METRIC_TOOL_CALLS = "fsm_agent.tool.calls"
"""Counter, ``{call}``: tool calls by ``gen_ai.tool.name`` and :data:`TOOL_OUTCOME`."""
METRIC_STOPS = "fsm_agent.run.stops"
"""Counter, ``{stop}``: run segments by :data:`STOP_REASON`, :data:`STOP_RESUMABLE` and ``gen_ai.agent.name``."""

# -- session metadata ---------------------------------------------------------------------------
META_LINK = "otel_link"
"""Session metadata: ``{"traceparent": ...}`` of the last segment that stopped resumable; the next
segment's span links to it (across processes and hosts: it lives in the store)."""
META_PARENT = "otel_parent"
"""Session metadata: ``{"traceparent": ..., "tracestate": ...}`` of the caller that asked for the next
run (the HTTP server stores the request's W3C trace context); that segment continues the caller's
trace, and the key is cleared when it stops."""
