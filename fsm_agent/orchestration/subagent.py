"""An agent called as a tool: the parent's model delegates a task, the sub-agent runs it in its own
session (linked to the parent's call) with its own budget, and its stop reason comes back as a
typed tool result.

    researcher = Agent(provider, tools=[search], system_prompt="You research.", store=store)
    ask = agent_tool(researcher, name="researcher", description="Research a question.",
                     limits={"max_iterations": 8, "max_cost_usd": 0.05})
    lead = Agent(provider, tools=[ask], store=store)          # the same store: the link lives there
    result = await lead.run("Compare A and B")                # result.usage includes the researcher's

The contract (``docs/multi-agent.md``):

* **Input**: the tool's arguments (default ``{"task": str}``), rendered to the sub-agent's first
  user message. The sub-agent sees that message and its own system prompt, never the parent's
  transcript.
* **Session**: ``child_session_id(ctx, name)``, derived from the call's idempotency key, linked
  ``agent_tool`` to the parent session and call before it starts. The same call always finds the
  same child: a parent resumed after an interrupt or a crash resumes that child (or takes its
  result), never starts a second one. A session under that id that the call did not start is never
  taken over: the call gets an error result (``sub_agent_session_conflict``).
* **Budget**: the sub-agent's own :class:`~fsm_agent.RunConfig` with ``limits`` over it, its token
  and cost budgets capped at what the parent's run has left when the child starts; its usage
  and cost roll up into the parent (``ToolContext.add_usage``) when it stops or is cut, so the
  parent's token and cost budgets count them from then on.
* **Output**, by the sub-agent's stop (:data:`STOP_RESULTS`):

  ==================  =========================================================================
  COMPLETED           the answer text, or with ``output_schema`` the structured answer as JSON
  WAITING_HUMAN       the parent stops WAITING_HUMAN too, this call pending (reason
                      ``sub_agent_waiting``, naming the calls that really wait, nested waits
                      followed down); the person's decision (the kinds those calls accept, of
                      approve / reject / respond) is passed on to them, and it goes on
  PAUSED_BUDGET       an error result (``sub_agent_paused_budget``): the budget that ran out and
                      the partial answer
  FAILED_RETRYABLE    an error result (``sub_agent_failed_retryable``): a transient failure
  FAILED_TERMINAL     an error result (``sub_agent_failed_terminal``)
  CANCELLED           an error result (``sub_agent_cancelled``): cancelled from outside
  INTERRUPTED         an error result (``sub_agent_interrupted``): interrupted from outside (an
                      interrupt of the *parent* instead leaves the call open, see below)
  ==================  =========================================================================

* **Effects**: ``idempotent`` and ``resumable``: running the call again with the same key
  continues the same child, whose own ledger keeps its side effects once. An Interrupt of the
  parent cuts the child (it stops INTERRUPTED at its checkpoint) and leaves the call open; the
  parent's resume runs it again, which resumes the child. A Cancel of the parent cancels the child
  (``on_compensate``: the child applies the Cancel under its own rules: compensation hooks, or a
  person's confirmation, which the parent then waits for too). A child that finished is not undone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ..agent import Agent
from ..errors import SessionLinkError, ToolError
from ..store.base import LinkKind
from ..tools.registry import Tool, ToolContext, ToolEffect
from ..types.run import StopReason
from ..types.structured import OutputSchema
from ._child import checked_limits, child_answer, compensate_by_cancelling, drive_child
from .links import child_session_id

__all__ = ["STOP_RESULTS", "TASK_PARAMETERS", "agent_tool"]

TASK_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"task": {"type": "string", "minLength": 1, "maxLength": 2000, "description": (
        "The task for the sub-agent, with everything it needs to know: it does not see this conversation.")}},
    "required": ["task"],
    "additionalProperties": False,
}
"""The default arguments of an agent tool: one ``task`` string (1 to 2,000 characters: bounded, so that
a small model writing under a grammar cannot run on until its output limit)."""

STOP_RESULTS: Mapping[StopReason, str] = {
    StopReason.COMPLETED: "the answer (text, or the structured answer as JSON)",
    StopReason.WAITING_HUMAN: "WaitForHuman: the parent stops WAITING_HUMAN with the call pending",
    StopReason.PAUSED_BUDGET: "error result sub_agent_paused_budget",
    StopReason.FAILED_RETRYABLE: "error result sub_agent_failed_retryable",
    StopReason.FAILED_TERMINAL: "error result sub_agent_failed_terminal",
    StopReason.CANCELLED: "error result sub_agent_cancelled",
    StopReason.INTERRUPTED: "error result sub_agent_interrupted",
}
"""What a sub-agent's stop becomes for its caller (see the module docstring)."""


def agent_tool(
    agent: Agent,
    *,
    name: str,
    description: str,
    limits: Mapping[str, Any] | None = None,
    output_schema: OutputSchema | None = None,
    parameters: dict[str, Any] | None = None,
    task: Callable[[dict[str, Any]], str] | None = None,
    timeout: float | None = None,
) -> Tool:
    """A tool that runs ``agent`` as a sub-agent in its own linked session.

    Args:
        agent: the sub-agent. Its store must be the parent's (the link, the child's session and the
            parent's log of rolled-up usage are read together).
        name: the tool's name (``^[a-zA-Z0-9_-]{1,64}$``); also the prefix of the child session ids.
        description: what the parent's model reads about the sub-agent.
        limits: :class:`~fsm_agent.RunConfig` fields for the sub-agent's runs (``max_iterations``,
            ``max_wall_clock`` seconds, ``max_tokens``, ``max_cost_usd`` USD ...), over its own config.
            Its ``max_tokens`` and ``max_cost_usd`` are further capped at what the parent's run has
            left when the sub-agent starts.
        output_schema: the sub-agent's answer must match it (its run's ``output_schema``); the tool
            result is then the answer as JSON.
        parameters: the tool's JSON Schema (default: one required ``task`` string).
        task: renders the arguments to the sub-agent's first message (default: the ``task``
            argument, or the arguments as JSON).
        timeout: seconds one call may take (default ``None``: the sub-agent's own wall-clock budget
            bounds it). A timeout cuts the child (INTERRUPTED) and the call fails.

    Raises:
        ConfigurationError: a limit that is no RunConfig field, or a bad value for one.
        ToolDefinitionError: an invalid name or parameter schema.
    """
    run_limits = checked_limits(agent, limits, f"agent_tool {name!r}")
    if output_schema is not None:
        run_limits["output_schema"] = output_schema

    def render(arguments: dict[str, Any]) -> str:
        if task is not None:
            return task(arguments)
        if set(arguments) == {"task"} and isinstance(arguments["task"], str):
            return arguments["task"]
        return orjson.dumps(arguments).decode()

    async def call(_fsm_context: ToolContext, **arguments: Any) -> str:
        ctx = _fsm_context
        child_id = child_session_id(ctx, name)
        ctx.report_progress(0, None, f"sub-agent {name!r} runs in session {child_id}")
        try:
            result = await drive_child(
                agent, child_id, render(arguments), parent_id=ctx.session_id, kind=LinkKind.AGENT_TOOL.value,
                call_id=ctx.call_id, link_metadata={"tool": name}, limits=run_limits, decision=ctx.decision, ctx=ctx)
        except SessionLinkError as e:
            raise ToolError(f"Sub-agent {name!r} could not start: {e}", kind="sub_agent_session_conflict") from e
        ctx.report_progress(1, 1, f"sub-agent {name!r} stopped {result.stop.reason.value}")
        return await child_answer(agent, result, label=f"sub-agent {name!r} (session {child_id})",
                                  prefix="sub_agent", structured=output_schema is not None)

    t = Tool(call, name=name, description=description, parameters=parameters or TASK_PARAMETERS, timeout=timeout,
             effect=ToolEffect.IDEMPOTENT, resumable=True)
    compensate_by_cancelling(t, lambda arguments, ctx: [(agent, child_session_id(ctx, name))],
                             "the parent session was cancelled")
    return t
