"""PlanAct (issue 12, seed 004 §3): plan, act node by node, verify each node, replan what is left.

A **planner** turns the task into a typed :class:`~fsm_agent.types.Plan`: nodes with goals,
dependencies and acceptance checks. The model then works on one node at a time as ordinary turns
of the machine (tools, approvals, budgets and the ledger apply as usual). When it ends a turn
without tool calls, a **verifier** checks the node against its acceptance check; a failed check
makes a **replanner** rewrite the remaining plan (passed nodes stay, with their results). A Steer,
a Followup after the last node passed, or a node that runs too many turns without an answer, also
triggers a replan.

Phases:

* **PreTurn** — no plan yet: one planner call (schema-constrained, so it works on a small local
  model too), validated, then ``ctx.update_plan``; the first ready node starts. A goal version
  above the plan's (a Steer) → replan. No node running: a node failed and its replan did not
  happen (the run stopped first) → that replan now; the replans were spent and a person resumed
  → a replan with a fresh budget; every node passed and the user followed up → a replan for the
  followup. The running node for more than ``max_turns_per_node`` model calls → it fails as stale
  → replan. Then a short note about the current node is added to the system message of this
  call's context (rebuilt from the checkpointed plan at every PreTurn, so a resumed run sends the
  same note; the plan's texts in it are quoted).
* **PostTurn** (a turn that ended without tool calls) — the current node is checked: a
  programmatic check (``checks[node.check]``, then ``check``) or, when none decides, a model
  grader. Passed → the node keeps the answer's summary; the next ready node starts and its
  instruction goes into the transcript (``Continue(message=UserMessage(...))``); all passed →
  ``Complete`` with each node's evidence. Failed → the node is logged failed, the replanner writes
  the remaining nodes, the first ready one starts → ``Continue`` with its instruction.
* After ``max_replans`` replans for failures (or staleness) since the run started or a person
  last stepped in (a Steer, a Followup, a resume after the budget was spent), or a planner that
  gives no valid plan in ``plan_attempts`` calls, the run stops: WAITING_HUMAN
  (``on_exhausted="human"``, the default; a resume after spent replans replans with a fresh
  budget) or FAILED_TERMINAL (``"fail"``), ``error.kind`` ``plan_failed`` or ``plan_invalid``.

**What the planner, the replanner and the grader see** is what the model saw: the task is the
latest user request in this call's context (``ctx.messages``, after the ``redaction`` plugin
masked it: PlanAct is innermost and wrapped by ``redaction``), cut to :data:`MAX_GOAL_CHARS`;
the rest is the plan (written by the planner from that text) and the model's answers.

**Budgets.** Planner, replanner and grader calls go through ``ctx.call_provider(...,
account=True)``: their tokens and cost count toward the run's usage. Before each of them the
run's token, cost and wall-clock budgets (``RunConfig``) are checked: spent in PreTurn → the run
stops PAUSED_BUDGET; spent in PostTurn → the check (or the replan) waits, the run pauses
PAUSED_BUDGET at the next PreTurn, and a resume does it. These calls are not turns: the
iterations budget and the ``budget`` plugin's model-call count leave them out.

**Retries.** A call that fails with a retryable error is tried again (``retry``, a
:class:`~fsm_agent.providers.RetryPolicy`: backoff, the server's Retry-After, the wall clock);
the calls do not pass through ``wrap_model_call`` layers, so the ``retry`` plugin's retries and
fallbacks do not apply to them: give ``provider=FallbackProvider([...])`` for a fallback.

The plan is in the run state, so it is in every checkpoint: a run paused mid-plan
(PAUSED_BUDGET, INTERRUPTED, WAITING_HUMAN) resumes at the node it was on, with no new planner
call. Each change is logged as ``plan_updated`` (the whole plan and the reason).
:func:`recorded_planner` answers those calls from a session's log, for an offline replay. The full
description: ``docs/planact.md``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Optional, Union

import orjson
from attrs import evolve

from fsm_agent import (
    AssistantMessage,
    Complete,
    ConfigurationError,
    Continue,
    InvalidPlanError,
    MessageRequest,
    MessageResponse,
    Middleware,
    ModelRetry,
    ModelStopReason,
    NodeStatus,
    Ordering,
    OutputSchema,
    Plan,
    PlanNode,
    Provider,
    RetryPolicy,
    RunContext,
    ScriptedProvider,
    StopReason,
    StopRun,
    SystemMessage,
    UserMessage,
    parse_output,
)
from fsm_agent.errors import ProviderError
from fsm_agent.providers import text_response
from fsm_agent.types import ID_CHARS, Replan, ReplanTrigger, nodes_from_output, plan_output_schema, structure

from .verifier import VERDICT_SCHEMA, Verdict, grade

__all__ = [
    "GRADER_INSTRUCTIONS",
    "MAX_GOAL_CHARS",
    "MAX_PLAN_NODES",
    "PLANNER_EXAMPLE",
    "PLANNER_INSTRUCTIONS",
    "REPLANNER_EXAMPLE",
    "REPLANNER_INSTRUCTIONS",
    "VERDICT_SCHEMA",
    "NodeCheck",
    "PlanAct",
    "recorded_planner",
]

NodeCheck = Callable[[RunContext, PlanNode], Union[Verdict, None, Awaitable[Optional[Verdict]]]]
"""``(ctx, node) -> Verdict | None``, plain or async: a programmatic acceptance check of the
running node (``ctx.last_response`` holds the answer). ``None``: no opinion, the next check (or
the model grader) decides. Anything else, or an exception, stops the run FAILED_TERMINAL
(``error.kind`` ``plan_check_failed``)."""

MAX_GOAL_CHARS = 4000
"""The task as the planner and the replanner get it, and as :attr:`Plan.goal` keeps it, is cut to
this many characters (the plan is logged whole at each change)."""

MAX_PLAN_NODES = 30
"""The largest ``max_nodes`` PlanAct accepts."""

PLANNER_INSTRUCTIONS = (
    "Split the TASK into {min_nodes} to {max_nodes} steps, in order. Each step has an id (s1, s2 ...), a goal, "
    "depends_on (the ids of earlier steps it needs) and acceptance (what shows the step is done). "
    "Reply with JSON only."
)
"""The planner's system prompt (``{min_nodes}`` and ``{max_nodes}`` are filled in). Short, and with
no placeholder text a small model could copy: the example exchange shows the shape."""

PLANNER_EXAMPLE = (
    "TASK: Make a cup of tea and describe it.",
    '{"nodes": [{"id": "s1", "goal": "Boil water", "depends_on": [], "acceptance": "The water is boiling"}, '
    '{"id": "s2", "goal": "Put the tea in the hot water", "depends_on": ["s1"], "acceptance": "The tea is made"}, '
    '{"id": "s3", "goal": "Describe the tea", "depends_on": ["s2"], "acceptance": "A description of the tea"}]}',
)
"""One worked exchange (task, answer) sent before the real task: SmolLM2-135M copied the
placeholders of an inline example ("what to do") but adapts a worked one to its task."""

REPLANNER_INSTRUCTIONS = (
    "A step of the plan for the TASK went wrong. Write the steps still to do (1 to {max_nodes}), in order; "
    "do not repeat DONE steps, but a step may depend on them by id. Reply with JSON only."
)
"""The replanner's system prompt (``{max_nodes}`` is filled in)."""

REPLANNER_EXAMPLE = (
    "TASK: Make a cup of tea and describe it.\nWHY REPLAN: node s2 failed its check: no tea was used\n"
    "DONE:\n- s1: Boil water -> The water is boiling\nFAILED:\n- s2: Put the tea in the hot water "
    "(check: no tea was used)\nNOT STARTED:\n- s3: Describe the tea\nUse the ids s2, s3 and so on, in this order.",
    '{"nodes": [{"id": "s2", "goal": "Put a tea bag in the hot water", "depends_on": ["s1"], '
    '"acceptance": "The tea bag is in the water"}, '
    '{"id": "s3", "goal": "Describe the tea", "depends_on": ["s2"], "acceptance": "A description of the tea"}]}',
)
"""The replanner's worked exchange (see :data:`PLANNER_EXAMPLE`)."""

GRADER_INSTRUCTIONS = (
    "Decide whether the ANSWER does what the STEP asks, as DONE WHEN says. "
    'Reply with JSON only: "ok" (true or false) and "reason" (why, in a few words).'
)
"""The model grader's system prompt (the grader itself is the ``verifier`` plugin's
:func:`~fsm_agent_middleware.verifier.grade`, with :data:`VERDICT_SCHEMA` as the output schema)."""

_FAILURE_TRIGGERS = (ReplanTrigger.FAILED, ReplanTrigger.STALE)
_PERSON_TRIGGERS = (ReplanTrigger.RESUMED, ReplanTrigger.STEER, ReplanTrigger.FOLLOWUP)
_STALE = "no answer to check after "
"""How a stale node's verdict begins (a replan cut short is redone with the trigger it had)."""
_CHECK_NAME = re.compile(f"[{ID_CHARS}]{{1,64}}")
_RUNTIME_PROMPTS = ("Continue.", "Your previous answer was cut off before it finished;")
"""User messages the driver writes itself (``_no_prefill``): never taken for the task."""
_STEER = "New direction from the user: "
_ECHO_CHARS = 4000
"""An invalid planner answer is sent back (for the retry) cut to this many characters."""


class _BudgetSpent(Exception):  # noqa: N818 - a condition, caught inside the plugin
    def __init__(self, budget: str, detail: str) -> None:
        super().__init__(detail)
        self.budget, self.detail = budget, detail


class PlanAct(Middleware):
    """Plan, act node by node, verify each node, replan the rest (see the module doc).

    Args:
        provider: the model for the planner, replanner and grader calls; ``None``: the run's. A
            :class:`~fsm_agent.providers.FallbackProvider` gives these calls a fallback.
        checks: programmatic checks by name (names of letters, digits, ``_``, ``.``, ``-``, at most
            64 characters); the planner may name one per node (the schema offers exactly these
            names), and ``node.check`` selects it.
        check: a programmatic check asked about every node that names none (or whose named check
            returned ``None``); ``None`` from it defers to the grader.
        grade: ask the model grader when no programmatic check decided; ``False``: such a node
            passes once the model answers it.
        plan: a plan to start from instead of calling the planner (validated here, and it must have
            a node ready to run; used as given, with the run's goal version).
        min_nodes: fewest nodes the planner may write (``minItems``; the replanner may write 1).
        max_nodes: most nodes the planner or the replanner may write (at most :data:`MAX_PLAN_NODES`).
        max_replans: replans for failed or stale nodes allowed since the run started, or since a
            person last stepped in (a Steer, a Followup, or a resume after this budget was spent);
            a Steer's or a Followup's replan does not count.
        max_turns_per_node: model calls a node may take before it counts as stale (``None``: no
            limit).
        plan_attempts: planner (or replanner) calls for one plan, when an answer breaks the
            schema or the plan's rules (the problems are sent back each time).
        grade_attempts: grader calls for one verdict, when a reply cannot be read.
        on_exhausted: ``"human"`` (WAITING_HUMAN, the default) or ``"fail"`` (FAILED_TERMINAL) when
            the replans or the planner's attempts are spent.
        max_tokens: output tokens of each planner, replanner and grader answer.
        temperature: of those calls (default 0; ``None``: the server's default), 0 to 2.
        retry: how a planner, replanner or grader call that failed with a retryable error is tried
            again (attempts in all, backoff, the server's Retry-After, bounded by the wall clock);
            ``None``: not retried (the provider's own HTTP retries still apply). Its jitter and its
            waits are the run's (``ctx.random``, ``ctx.sleep``) unless it names its own ``rng`` / ``sleep``.
        max_chars: ``maxLength`` of each string in the plan schema; ``"auto"``: 100 for the
            ``llamacpp`` profile (its grammar enforces it; a small model otherwise runs on until
            the output limit cuts the JSON), none elsewhere (the plan rules still bound goals to
            :data:`~fsm_agent.types.MAX_TEXT_CHARS`).
        numbered: ask for the numbered plan form (node ids ``s1``, ``s2`` ... by position, each
            node depending only on earlier or passed ones: see
            :func:`~fsm_agent.types.plan_output_schema`), so a grammar-constrained server cannot
            return an unknown dependency or a cycle; ``"auto"``: for the ``llamacpp`` profile
            (SmolLM2-135M invents dependencies otherwise), free ids elsewhere.
        examples: send the worked example exchange (:data:`PLANNER_EXAMPLE`,
            :data:`REPLANNER_EXAMPLE`) before the real request.
        planner_instructions, replanner_instructions, grader_instructions: the system prompts.

    Raises:
        ConfigurationError: a bad option (a value of the wrong type or out of range, a check that
            is not callable or whose name is not a plain name, ``plan`` that breaks the plan rules,
            names a check that is not registered, or has no node ready to run).

    In a chain PlanAct is innermost, inside ``loop_detection``, ``repair`` and ``redaction``: its
    PreTurn runs after theirs (it plans from the masked context), and its PostTurn decides first.
    The ``verifier`` plugin cannot be in the same chain (``ChainError``).
    """

    name = "planact"
    ordering = Ordering(position="innermost", wrapped_by=("loop_detection", "repair", "redaction"),
                        conflicts={"verifier": "PlanAct checks each node itself and completes the run when the "
                                               "last node passes; a Verifier would judge the same answers as the "
                                               "task's (put whole-task checks in PlanAct's check=)"})

    def __init__(self, *, provider: Provider | None = None, checks: Mapping[str, NodeCheck] | None = None,
                 check: NodeCheck | None = None, grade: bool = True, plan: Plan | None = None,
                 min_nodes: int = 1, max_nodes: int = 6, max_replans: int = 3, max_turns_per_node: int | None = 10,
                 plan_attempts: int = 2, grade_attempts: int = 2, on_exhausted: str = "human",
                 max_tokens: int = 600, temperature: float | None = 0.0,
                 retry: RetryPolicy | None = RetryPolicy(max_attempts=2),
                 max_chars: int | str | None = "auto", numbered: bool | str = "auto", examples: bool = True,
                 planner_instructions: str = PLANNER_INSTRUCTIONS,
                 replanner_instructions: str = REPLANNER_INSTRUCTIONS,
                 grader_instructions: str = GRADER_INSTRUCTIONS) -> None:
        if on_exhausted not in ("human", "fail"):
            raise ConfigurationError(f"PlanAct: on_exhausted must be 'human' or 'fail', not {on_exhausted!r}")
        for what, n, least in (("min_nodes", min_nodes, 1), ("max_nodes", max_nodes, 1),
                               ("max_replans", max_replans, 0), ("plan_attempts", plan_attempts, 1),
                               ("grade_attempts", grade_attempts, 1), ("max_tokens", max_tokens, 1)):
            if not _integer(n) or n < least:
                raise ConfigurationError(f"PlanAct: {what} must be an integer of at least {least}, not {n!r}")
        if not min_nodes <= max_nodes <= MAX_PLAN_NODES:
            raise ConfigurationError(f"PlanAct: need 1 <= min_nodes <= max_nodes <= {MAX_PLAN_NODES} "
                                     f"(got {min_nodes}, {max_nodes})")
        if max_turns_per_node is not None and (not _integer(max_turns_per_node) or max_turns_per_node < 1):
            raise ConfigurationError(f"PlanAct: max_turns_per_node must be an integer of at least 1 (or None), "
                                     f"not {max_turns_per_node!r}")
        if max_chars not in ("auto", None) and not (_integer(max_chars) and int(max_chars) >= 20):
            raise ConfigurationError(f"PlanAct: max_chars must be 'auto', None or at least 20, not {max_chars!r}")
        if numbered not in ("auto", True, False):
            raise ConfigurationError(f"PlanAct: numbered must be 'auto', True or False, not {numbered!r}")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or not 0 <= temperature <= 2):
            raise ConfigurationError(f"PlanAct: temperature must be a number from 0 to 2 (or None), "
                                     f"not {temperature!r}")
        for what, flag in (("grade", grade), ("examples", examples)):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"PlanAct: {what} must be True or False, not {flag!r}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigurationError(f"PlanAct: retry must be a RetryPolicy or None, not {type(retry).__name__}")
        if provider is not None and not callable(getattr(provider, "chat", None)):
            raise ConfigurationError(f"PlanAct: provider must be a Provider (or None: the run's), not "
                                     f"{type(provider).__name__}")
        for what, text in (("planner_instructions", planner_instructions),
                           ("replanner_instructions", replanner_instructions),
                           ("grader_instructions", grader_instructions)):
            if not isinstance(text, str) or not text.strip():
                raise ConfigurationError(f"PlanAct: {what} must be a non-empty string")
        if checks is not None and not isinstance(checks, Mapping):
            raise ConfigurationError(f"PlanAct: checks must be a mapping of name -> check, not {type(checks).__name__}")
        self.checks: dict[str, NodeCheck] = dict(checks or {})
        for name, fn in self.checks.items():
            if not isinstance(name, str) or not _CHECK_NAME.fullmatch(name):
                raise ConfigurationError(f"PlanAct: the check name {name!r} must be 1 to 64 letters, digits, '_', "
                                         "'.' or '-' (the planner is told the names)")
            if not callable(fn):
                raise ConfigurationError(f"PlanAct: the check {name!r} must be callable (ctx, node) -> Verdict | None, "
                                         f"not {type(fn).__name__}")
        if check is not None and not callable(check):
            raise ConfigurationError(f"PlanAct: check must be callable (ctx, node) -> Verdict | None, not "
                                     f"{type(check).__name__}")
        self.provider = provider
        self.check = check
        self.grade = grade
        if plan is not None:
            if not isinstance(plan, Plan):
                raise ConfigurationError(f"PlanAct: plan must be a Plan, not {type(plan).__name__}")
            try:
                plan.validate()
            except InvalidPlanError as exc:
                raise ConfigurationError(f"PlanAct: the given plan is invalid: {'; '.join(exc.problems)}") from exc
            unknown = sorted({n.check for n in plan.nodes if n.check is not None} - set(self.checks))
            if unknown:
                raise ConfigurationError(f"PlanAct: the given plan names checks that are not registered: {unknown}; "
                                         "pass them in checks={name: callable}")
            if not plan.ready() and plan.current is None:
                states = ", ".join(f"{n.id}: {n.status.value}" for n in plan.nodes)
                raise ConfigurationError(f"PlanAct: the given plan has no node ready to run ({states}); give a plan "
                                         "with a pending node whose dependencies passed")
        self.plan = plan
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.max_replans = max_replans
        self.max_turns_per_node = max_turns_per_node
        self.plan_attempts = plan_attempts
        self.grade_attempts = grade_attempts
        self.on_exhausted = on_exhausted
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.retry = retry
        self.max_chars = max_chars
        self.numbered = numbered
        self.examples = examples
        self.planner_instructions = planner_instructions
        self.replanner_instructions = replanner_instructions
        self.grader_instructions = grader_instructions

    def __repr__(self) -> str:
        who = "run's own" if self.provider is None else f"{self.provider.name}:{self.provider.model}"
        return (f"PlanAct(provider={who!r}, checks={sorted(self.checks)}, max_nodes={self.max_nodes}, "
                f"max_replans={self.max_replans}, on_exhausted={self.on_exhausted!r})")

    # -- PreTurn ---------------------------------------------------------------------------
    async def pre_turn(self, ctx: RunContext) -> None:  # async: the chain awaits it
        """Make the plan (first turn), replan on a Steer, a Followup or a stale node, redo a replan
        a stop cut short, and put the current node in front of the model.

        Raises:
            StopRun: PAUSED_BUDGET when the run's token, cost or wall-clock budget is spent before a
                planner or replanner call; WAITING_HUMAN or FAILED_TERMINAL when no valid plan comes
                in ``plan_attempts`` calls, when the replans are spent, or when a planner call fails
                (WAITING_HUMAN for a retryable provider error, so a resume can try again).
        """
        try:
            plan = await self._prepare(ctx)
        except _BudgetSpent as spent:
            raise StopRun(StopReason.PAUSED_BUDGET, f"{spent.detail} (before a planact call)",
                          budget=spent.budget) from None
        self._note(ctx, plan)

    async def _prepare(self, ctx: RunContext) -> Plan:
        plan = ctx.plan
        if plan is None:
            return await self._first_plan(ctx)
        if plan.goal_version < ctx.goal_version:
            return await self._replan(ctx, plan, ReplanTrigger.STEER,
                                      f"the goal changed (goal version {ctx.goal_version}): {_steer_text(ctx)}", None)
        current = plan.current
        if current is None:
            return await self._restart(ctx, plan)
        if (self.max_turns_per_node is not None and current.started_turn is not None
                and ctx.turn - current.started_turn >= self.max_turns_per_node):
            reason = (f"{_STALE}{ctx.turn - current.started_turn} model calls "
                      f"(max_turns_per_node={self.max_turns_per_node})")
            plan = plan.with_node(current.id, status=NodeStatus.FAILED, attempts=current.attempts + 1, verdict=reason)
            ctx.update_plan(plan, f"node {current.id} is stale: {reason}")
            return await self._replan(ctx, plan, ReplanTrigger.STALE, f"node {current.id} is stale: {reason}",
                                      current.id)
        return plan

    async def _first_plan(self, ctx: RunContext) -> Plan:
        goal = _clip(_task(ctx), MAX_GOAL_CHARS, collapse=False)
        if self.plan is not None:
            plan = evolve(self.plan, goal_version=ctx.goal_version)
            how = "the given plan"
        else:
            request = self._planner_request(ctx, goal)
            schema = self._schema(ctx, "plan", self.min_nodes)

            def build(value: Any) -> Plan:
                return Plan(goal, nodes_from_output(value), goal_version=ctx.goal_version).validate()

            plan = await self._ask(ctx, request, schema, build, "planner")
            how = "the planner"
        current = plan.current
        if current is not None:  # a given plan with a node running: it goes on from there
            plan = plan.start(current.id, turn=ctx.turn)
            ctx.update_plan(plan, f"planned by {how}: {len(plan.nodes)} nodes; node {current.id} started")
            return plan
        first = plan.ready()[0]  # a valid planner answer has a ready node; a given plan was checked for one
        plan = plan.start(first.id, turn=ctx.turn)
        ctx.update_plan(plan, f"planned by {how}: {len(plan.nodes)} nodes; node {first.id} started")
        return plan

    async def _restart(self, ctx: RunContext, plan: Plan) -> Plan:
        """No node is running. A failed node whose replan did not happen (the run stopped first: a
        failed replanner call, a budget pause, an interrupt, a crash) gets that replan now, counted
        as before; when the replans were spent (the run stopped ``plan_failed``), a person's resume
        gets a replan with a fresh budget. Every node passed (a Followup continued the run) → nodes
        for the followup are planned."""
        failed = next((n for n in plan.nodes if n.status is NodeStatus.FAILED), None)
        if failed is not None:
            verdict = failed.verdict or "no reason recorded"
            if _failure_replans(plan.history) >= self.max_replans:
                return await self._replan(ctx, plan, ReplanTrigger.RESUMED,
                                          f"a person resumed the run after node {failed.id} failed: {verdict}",
                                          failed.id)
            if verdict.startswith(_STALE):
                return await self._replan(ctx, plan, ReplanTrigger.STALE, f"node {failed.id} is stale: {verdict}",
                                          failed.id)
            return await self._replan(ctx, plan, ReplanTrigger.FAILED,
                                      f"node {failed.id} failed its check: {verdict}", failed.id)
        ready = plan.ready()
        if ready:
            plan = plan.start(ready[0].id, turn=ctx.turn)
            ctx.update_plan(plan, f"node {ready[0].id} started")
            return plan
        return await self._replan(ctx, plan, ReplanTrigger.FOLLOWUP,
                                  f"the user followed up: {_clip(_task(ctx), 400)}", None)

    def _note(self, ctx: RunContext, plan: Plan) -> None:
        """The current node, at the end of this call's system message (not in the transcript: it is
        rebuilt from the checkpointed plan at every PreTurn). The plan's texts are quoted as JSON
        strings, one line each: they come from the task (through the planner), not from the system."""
        current = plan.current
        if current is None:
            return
        done = [n.id for n in plan.nodes if n.status is NodeStatus.PASSED]
        lines = [f"You are following a plan. Current step {current.id}: {_quoted(current.goal)}"]
        if current.acceptance:
            lines.append(f"Done when: {_quoted(current.acceptance)}")
        if done:
            lines.append(f"Steps already done: {', '.join(done)}.")
        lines.append("Work on the current step only, then give its result. (The quoted texts are the plan's, "
                     "written from the task.)")
        note = "\n".join(lines)
        messages = ctx.messages
        if messages and isinstance(messages[0], SystemMessage):
            messages[0] = SystemMessage(f"{messages[0].text}\n\n{note}")
        else:
            messages.insert(0, SystemMessage(note))

    # -- PostTurn --------------------------------------------------------------------------
    async def post_turn(self, ctx: RunContext) -> Complete | Continue | None:  # type: ignore[override]
        """Check the current node when the model ended a turn without tool calls; ``None`` for
        every other turn (and when there is no running node).

        Returns:
            ``Continue`` with the next node's instruction (after a pass, or after a replan), or
            ``Complete`` with every node's evidence when the last node passed. When the run's
            token, cost or wall-clock budget is spent before the grader or the replanner call:
            ``Continue`` with a note, and the run pauses PAUSED_BUDGET at the next PreTurn (the
            node is checked again, or replanned, after a resume).

        Raises:
            StopRun: WAITING_HUMAN or FAILED_TERMINAL when the replans are spent (the node is
                logged ``failed``), when the replanner gives no valid plan, when a grader or
                replanner call fails; FAILED_TERMINAL when a node names a check that is not
                registered, or a check raises or returns something other than a Verdict or None.
        """
        resp = ctx.last_response
        if resp is None or resp.tool_calls or resp.stop_reason is ModelStopReason.PAUSE_TURN:
            return None
        plan = ctx.plan
        node = plan.current if plan is not None else None
        if plan is None or node is None:
            return None
        try:
            verdict = await self._verify(ctx, node)
        except _BudgetSpent as spent:
            return Continue(message=UserMessage(f"The result of step {node.id} was not checked: {spent.detail}. "
                                                f"When the run goes on, give the result of step {node.id} again."),
                            reason=f"plan: node {node.id} is not checked ({spent.detail}); the run pauses")
        reason = _clip(verdict.feedback, 500) if verdict.feedback else ""
        plan = plan.with_node(node.id, attempts=node.attempts + 1, result=_clip(resp.text, 500),
                              verdict=reason or ("passed" if verdict.ok else "failed"), evidence=verdict.evidence)
        if verdict.ok:
            plan = plan.with_node(node.id, status=NodeStatus.PASSED)
            ready = plan.ready()
            if not ready:
                if not plan.done:  # pragma: no cover - a valid plan with open nodes always has a ready one
                    raise StopRun(StopReason.FAILED_TERMINAL, f"planact: node {node.id} passed but no node is ready")
                ctx.update_plan(plan, f"node {node.id} passed: {reason or 'the check passed'}; every node passed")
                evidence = tuple(e for n in plan.order() if n.status is NodeStatus.PASSED
                                 for e in (f"plan:v{plan.version}:{n.id}:passed", *n.evidence))
                passed = sum(n.status is NodeStatus.PASSED for n in plan.nodes)
                return Complete(evidence=evidence, detail=f"plan v{plan.version}: every node passed ({passed} "
                                f"node{'' if passed == 1 else 's'}, {plan.replans} replan"
                                f"{'' if plan.replans == 1 else 's'})")
            plan = plan.start(ready[0].id, turn=ctx.turn)
            ctx.update_plan(plan, f"node {node.id} passed: {reason or 'the check passed'}; node {ready[0].id} started")
            return Continue(message=UserMessage(self._instruction(plan, ready[0])),
                            reason=f"plan: node {node.id} passed; next node {ready[0].id}")
        reason = reason or "the check failed without a reason"
        plan = plan.with_node(node.id, status=NodeStatus.FAILED)
        ctx.update_plan(plan, f"node {node.id} failed its check: {reason}")
        try:
            plan = await self._replan(ctx, plan, ReplanTrigger.FAILED, f"node {node.id} failed its check: {reason}",
                                      node.id)
        except _BudgetSpent as spent:
            return Continue(message=UserMessage(f"Step {node.id} did not pass its check: {reason}. The plan is "
                                                "revised when the run goes on."),
                            reason=f"plan: node {node.id} failed its check; the replan waits ({spent.detail})")
        current = plan.current
        assert current is not None  # _replan starts a node
        return Continue(message=UserMessage(self._instruction(plan, current, failed=(node.id, reason))),
                        reason=f"plan: node {node.id} failed its check; replanned to v{plan.version}, "
                               f"next node {current.id}")

    def _instruction(self, plan: Plan, node: PlanNode, failed: tuple[str, str] | None = None) -> str:
        """The user message that moves the model to ``node`` (kept in the transcript)."""
        lines = []
        if failed is not None:
            lines.append(f"Step {failed[0]} did not pass its check: {failed[1]}. The plan was revised.")
        lines.append(f"Next step {node.id}: {node.goal}")
        if node.acceptance:
            lines.append(f"Done when: {node.acceptance}")
        return "\n".join(lines)

    # -- verification ----------------------------------------------------------------------
    async def _verify(self, ctx: RunContext, node: PlanNode) -> Verdict:
        if node.check is not None:
            named = self.checks.get(node.check)
            if named is None:
                raise StopRun(StopReason.FAILED_TERMINAL,
                              f"planact: node {node.id} names the check {node.check!r}, which is not registered "
                              f"(registered: {sorted(self.checks) or 'none'}); pass it in PlanAct(checks=...)",
                              error={"kind": "plan_check_unknown", "message": f"unknown check {node.check!r}"})
            verdict = await _ask_check(named, node.check, ctx, node)
            if verdict is not None:
                return verdict
        if self.check is not None:
            verdict = await _ask_check(self.check, "check", ctx, node)
            if verdict is not None:
                return verdict
        if not self.grade:
            return Verdict(True, "answered (no check decided and grading is off)")
        return await self._grade(ctx, node)

    async def _grade(self, ctx: RunContext, node: PlanNode) -> Verdict:
        answer = ctx.last_response.text if ctx.last_response is not None else ""
        provider = self.provider or ctx.provider
        request = MessageRequest(
            model=provider.model or "",
            messages=(SystemMessage(self.grader_instructions),
                      UserMessage(f"STEP: {node.goal}\nDONE WHEN: {node.acceptance or node.goal}\n\n"
                                  f"ANSWER:\n{_clip(answer, 4000, collapse=False)}")),
            max_tokens=min(self.max_tokens, 200), temperature=self.temperature, output_schema=VERDICT_SCHEMA)

        async def call(req: MessageRequest) -> MessageResponse:
            return await self._call(ctx, req, "grader")

        return await grade(request, call, provider=provider, attempts=self.grade_attempts, who="planact",
                           subject=f"on node {node.id}", records=ctx.state(self).setdefault("grader_calls", []))

    # -- planner and replanner ---------------------------------------------------------------
    def _schema(self, ctx: RunContext, name: str, min_nodes: int, plan: Plan | None = None) -> OutputSchema:
        ids, done = self._ids(ctx, plan)
        return plan_output_schema(name=name, min_nodes=min_nodes, max_nodes=self.max_nodes, checks=sorted(self.checks),
                                  max_chars=self._max_chars(ctx), ids=ids, done=done)

    def _small(self, ctx: RunContext) -> bool:
        """The model is served by llama.cpp (the ``llamacpp`` profile): grammar-constrained, small."""
        profile = getattr(self.provider or ctx.provider, "profile", None)
        return getattr(profile, "name", None) == "llamacpp"

    def _max_chars(self, ctx: RunContext) -> int | None:
        if self.max_chars == "auto":
            return 100 if self._small(ctx) else None
        return self.max_chars if isinstance(self.max_chars, int) else None

    def _ids(self, ctx: RunContext, plan: Plan | None) -> tuple[list[str] | None, list[str]]:
        """(ids for the numbered form or ``None``, ids of passed nodes): new nodes take the lowest
        ``s<k>`` ids no passed node holds."""
        if not (self.numbered is True or (self.numbered == "auto" and self._small(ctx))):
            return None, []
        passed = [n.id for n in plan.nodes if n.status is NodeStatus.PASSED] if plan is not None else []
        ids: list[str] = []
        k = 0
        while len(ids) < self.max_nodes:
            k += 1
            if f"s{k}" not in passed:
                ids.append(f"s{k}")
        return ids, passed

    def _context_lines(self, ctx: RunContext) -> list[str]:
        lines = []
        if len(ctx.tools):
            lines.append("TOOLS: " + "; ".join(f"{d.name}: {_clip(d.description, 80)}"
                                               for d in ctx.tools.definitions(None)))
        if self.checks:
            lines.append("CHECKS (a step may name one in \"check\", or null): " + "; ".join(
                f"{name}: {_clip(_doc(fn), 80)}" for name, fn in sorted(self.checks.items())))
        return lines

    def _planner_request(self, ctx: RunContext, goal: str) -> MessageRequest:
        provider = self.provider or ctx.provider
        body = "\n".join([f"TASK: {goal}", *self._context_lines(ctx)])
        system = self.planner_instructions.format(min_nodes=self.min_nodes, max_nodes=self.max_nodes)
        return MessageRequest(model=provider.model or "", messages=self._messages(system, PLANNER_EXAMPLE, body),
                              max_tokens=self.max_tokens, temperature=self.temperature)

    def _messages(self, system: str, example: tuple[str, str], body: str) -> tuple[Any, ...]:
        shown = (UserMessage(example[0]), AssistantMessage(example[1])) if self.examples else ()
        return (SystemMessage(system), *shown, UserMessage(body))

    def _replanner_request(self, ctx: RunContext, plan: Plan, reason: str, ids: list[str] | None) -> MessageRequest:
        provider = self.provider or ctx.provider
        done = [f"- {n.id}: {_clip(n.goal, 120)} -> {_clip(n.result or 'done', 160)}"
                for n in plan.nodes if n.status is NodeStatus.PASSED]
        failed = [f"- {n.id}: {_clip(n.goal, 120)} (check: {_clip(n.verdict or 'failed', 160)})"
                  for n in plan.nodes if n.status is NodeStatus.FAILED]
        left = [f"- {n.id}: {_clip(n.goal, 120)}" for n in plan.order() if n.status.open]
        lines = [f"TASK: {plan.goal}", f"WHY REPLAN: {_clip(reason, 400)}"]
        lines += ["DONE:", *done] if done else ["DONE: nothing yet"]
        lines += ["FAILED:", *failed] if failed else []
        lines += ["NOT STARTED:", *left] if left else []
        lines += self._context_lines(ctx)
        if ids is not None:
            lines.append(f"Use the ids {', '.join(ids[:3])} and so on, in this order.")
        system = self.replanner_instructions.format(max_nodes=self.max_nodes)
        return MessageRequest(model=provider.model or "",
                              messages=self._messages(system, REPLANNER_EXAMPLE, "\n".join(lines)),
                              max_tokens=self.max_tokens, temperature=self.temperature)

    async def _replan(self, ctx: RunContext, plan: Plan, trigger: ReplanTrigger, reason: str,
                      node: str | None) -> Plan:
        """Rewrite the remaining nodes (or stop when the replans are spent); the first ready node
        starts. The plan passed in is already logged."""
        if trigger in _FAILURE_TRIGGERS:
            spent = _failure_replans(plan.history)
            if spent >= self.max_replans:
                self._exhausted(plan, node, reason, spent)
        request = self._replanner_request(ctx, plan, reason, self._ids(ctx, plan)[0])
        schema = self._schema(ctx, "replan", 1, plan)

        def build(value: Any) -> Plan:
            return plan.replan(nodes_from_output(value), trigger=trigger, reason=reason, turn=ctx.turn, node=node,
                               goal_version=ctx.goal_version).validate()

        new = await self._ask(ctx, request, schema, build, "replanner")
        first = new.ready()[0]
        new = new.start(first.id, turn=ctx.turn)
        record = new.history[-1]
        ctx.update_plan(new, f"replanned to v{new.version} ({trigger.value}): {_clip(reason, 300)}; "
                             f"dropped {list(record.dropped)}, wrote {list(record.added)}; node {first.id} started")
        return new

    def _exhausted(self, plan: Plan, node: str | None, reason: str, spent: int) -> None:
        failed = [n for n in plan.nodes if n.status is NodeStatus.FAILED]
        detail = (f"planact: {reason}, and the replan budget is spent ({spent} of {self.max_replans} replans for "
                  f"failed or stale nodes)")
        evidence = tuple(e for n in failed for e in (f"plan:v{plan.version}:{n.id}:failed", *n.evidence))
        error = {"kind": "plan_failed", "message": detail, "node": node,
                 "reasons": [r.reason for r in plan.history if r.trigger in _FAILURE_TRIGGERS] + [reason]}
        if self.on_exhausted == "fail":
            raise StopRun(StopReason.FAILED_TERMINAL, detail, evidence_refs=evidence, error=error)
        raise StopRun(StopReason.WAITING_HUMAN, detail, evidence_refs=evidence, error=error,
                      required_decision="resume to replan with a fresh budget (a Steer first gives new direction), "
                                        "or cancel")

    async def _ask(self, ctx: RunContext, request: MessageRequest, schema: OutputSchema,
                   build: Callable[[Any], Plan], role: str) -> Plan:
        """A schema-constrained planner (or replanner) call, its answer built into a valid plan; the
        problems go back to the model, up to ``plan_attempts`` calls."""
        request = evolve(request, output_schema=schema)
        messages = list(request.messages)
        problem = ""
        for _ in range(self.plan_attempts):
            response = await self._call(ctx, evolve(request, messages=tuple(messages)), role)
            parsed = parse_output(response, schema)
            if parsed.ok:
                try:
                    return build(parsed.value)
                except InvalidPlanError as exc:
                    problem = "; ".join(exc.problems)
            else:
                problem = parsed.error or "the answer does not match the schema"
            calls = ctx.state(self).setdefault("invalid", [])
            calls.append({"role": role, "problem": problem, "raw": parsed.raw[:2000]})
            if parsed.raw.strip():
                messages.append(AssistantMessage(_clip(parsed.raw, _ECHO_CHARS, collapse=False)))
            messages.append(UserMessage(f"That plan cannot be used: {_clip(problem, 600)}\n"
                                        "Reply again with only the corrected JSON."))
        detail = (f"planact: the {role} gave no valid plan in {self.plan_attempts} call(s); "
                  f"last problem: {_clip(problem, 500)}")
        error = {"kind": "plan_invalid", "message": detail, "role": role}
        if self.on_exhausted == "fail":
            raise StopRun(StopReason.FAILED_TERMINAL, detail, error=error)
        raise StopRun(StopReason.WAITING_HUMAN, detail, error=error,
                      required_decision=f"resume to ask the {role} again (a Steer first can clarify the task), or cancel")

    async def _call(self, ctx: RunContext, request: MessageRequest, role: str) -> MessageResponse:
        """One planner, replanner or grader call: the run's budgets are checked first, and a
        retryable failure is tried again under ``retry``.

        Raises:
            _BudgetSpent: the run's token, cost or wall-clock budget is spent (the caller decides
                the stop: PAUSED_BUDGET in PreTurn, a deferred check or replan in PostTurn).
            StopRun: the call failed for good (WAITING_HUMAN when the error is retryable).
        """
        attempt = 0
        while True:
            spent = _spent_budget(ctx)
            if spent is not None:
                raise _BudgetSpent(*spent)
            attempt += 1
            try:
                return await ctx.call_provider(request, provider=self.provider, account=True)
            except ProviderError as exc:
                # chance and waits through the run's context, so that a replay of the run waits alike
                wait = (self.retry.delay(exc, attempt, ctx.random if self.retry.rng is None else None,
                                         remaining=ctx.remaining_wall_clock) if self.retry is not None else None)
                if wait is None:
                    stop = StopReason.WAITING_HUMAN if exc.retryable else StopReason.FAILED_TERMINAL
                    raise StopRun(stop, f"planact: the {role} call failed: {exc}", error=exc.to_info(),
                                  required_decision=f"resume to call the {role} again" if exc.retryable else None
                                  ) from exc
                name = getattr(self.provider or ctx.provider, "name", "?")
                ctx.emit(ModelRetry(ctx.session_id, ctx.turn, attempt, exc.status, exc.kind, exc.message[:2000], wait,
                                    server_hint=exc.retry_after is not None, provider=exc.provider or name,
                                    layer="planact"))
                assert self.retry is not None
                await (ctx.sleep(wait) if self.retry.sleep is None else self.retry.wait(wait))


def recorded_planner(events: Sequence[Any]) -> Provider:
    """A provider that answers PlanAct's planner, replanner and grader calls as a recorded session's
    did, for an offline replay (``fsm_agent.testing.replay_trajectory`` serves the recorded
    executor answers but not the calls made through ``ctx.call_provider``): pass
    ``PlanAct(provider=recorded_planner(events), ...)`` to the replaying agent, with the same checks.

    ``events``: the session's ``plan_updated`` events (``EventRecord`` objects, or their ``type`` /
    ``payload`` dicts), in log order. Each role gets its recorded answers in order: the plan the
    planner wrote, the nodes each replan wrote, and each verdict the grader gave (a check whose node
    evidence names a ``grader:`` reference). A planner answer the recording rejected is not in the
    log, so the replay's planner answers right the first time. Past the end of a role's answers, a
    call fails with a non-retryable :class:`~fsm_agent.errors.ProviderError` (the replay stops
    FAILED_TERMINAL, saying so).
    """
    answers: dict[str, list[Any]] = {"plan": [], "replan": [], "verdict": []}
    for ev in events:
        kind = ev["type"] if isinstance(ev, Mapping) else ev.type
        payload = ev["payload"] if isinstance(ev, Mapping) else ev.payload
        if kind != "plan_updated":
            continue
        plan: Plan = structure(payload["plan"], Plan)
        reason: str = payload["reason"]
        if reason.startswith("planned by the planner"):
            answers["plan"].append(list(plan.nodes))
        elif reason.startswith("replanned to"):
            added = plan.history[-1].added
            answers["replan"].append([plan.node(i) for i in added])
        for node in plan.nodes:
            if (reason.startswith((f"node {node.id} passed:", f"node {node.id} failed its check:"))
                    and any(e.startswith("grader:") for e in node.evidence)):
                ok = reason.startswith(f"node {node.id} passed:")
                answers["verdict"].append({"ok": ok, "reason": node.verdict or ""})

    def answer(request: MessageRequest) -> Any:
        schema = request.output_schema
        name = schema.name if schema is not None else ""
        if name not in answers:
            raise ProviderError("recorded_planner answers only PlanAct's planner, replanner and grader calls, not "
                                f"{'an answer schema ' + repr(name) if name else 'an executor call'}",
                                provider="recorded-planact")
        if not answers[name]:
            raise ProviderError(f"the recording holds no more {name!r} answers", provider="recorded-planact")
        item = answers[name].pop(0)
        if name == "verdict":
            return text_response(orjson.dumps(item).decode())
        with_check = schema is not None and b'"check"' in orjson.dumps(schema.schema)
        nodes = [{"id": n.id, "goal": n.goal, "depends_on": list(n.depends_on), "acceptance": n.acceptance,
                  **({"check": n.check} if with_check else {})} for n in item]
        return text_response(orjson.dumps({"nodes": nodes}).decode())

    provider = ScriptedProvider([answer], repeat_last=True, model="recorded-planact")
    provider.name = "recorded-planact"
    return provider




# -- helpers ---------------------------------------------------------------------------------
def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def _ask_check(check: NodeCheck, name: str, ctx: RunContext, node: PlanNode) -> Verdict | None:
    """Ask a programmatic check; one that raises, or answers with something other than a Verdict or
    None, stops the run FAILED_TERMINAL with ``error.kind`` ``plan_check_failed``."""
    try:
        verdict = check(ctx, node)
        if inspect.isawaitable(verdict):
            verdict = await verdict
    except StopRun:
        raise
    except Exception as exc:  # noqa: BLE001 - a check's failure is typed, not a crash of the plugin
        detail = f"planact: the check {name!r} raised on node {node.id}: {type(exc).__name__}: {exc}"
        raise StopRun(StopReason.FAILED_TERMINAL, detail,
                      error={"kind": "plan_check_failed", "message": detail, "check": name, "node": node.id}) from exc
    if verdict is not None and not isinstance(verdict, Verdict):
        detail = (f"planact: the check {name!r} returned {type(verdict).__name__} on node {node.id}; a check returns "
                  "a Verdict, or None to leave the node to the next check")
        raise StopRun(StopReason.FAILED_TERMINAL, detail,
                      error={"kind": "plan_check_failed", "message": detail, "check": name, "node": node.id})
    return verdict


def _spent_budget(ctx: RunContext) -> tuple[str, str] | None:
    """(budget, detail) of the first spent RunConfig budget that a planact call would run past
    (wall clock, tokens, cost: the driver's checks and texts), or ``None``."""
    cfg = ctx.config
    if cfg.max_wall_clock is not None and ctx.elapsed > cfg.max_wall_clock:
        return "wall_clock", f"wall-clock budget exhausted: {ctx.elapsed:.1f} s of {cfg.max_wall_clock:g} s used"
    usage = ctx.usage
    if cfg.max_tokens is not None and usage.total_tokens >= cfg.max_tokens:
        est = " (partly estimated)" if usage.estimated else ""
        return "tokens", f"token budget exhausted: {usage.total_tokens} of {cfg.max_tokens} tokens used{est}"
    cost = ctx.cost_usd
    if cfg.max_cost_usd is not None and cost is not None and cost >= cfg.max_cost_usd:
        return "cost", f"cost budget exhausted: ${cost:.4f} of ${cfg.max_cost_usd:.4f} used"
    return None


def _failure_replans(history: Sequence[Replan]) -> int:
    """Replans for failed or stale nodes since a person last stepped in (a resume after the
    budget was spent, a Steer, a Followup)."""
    count = 0
    for r in history:
        if r.trigger in _PERSON_TRIGGERS:
            count = 0
        elif r.trigger in _FAILURE_TRIGGERS:
            count += 1
    return count


def _user_texts(ctx: RunContext) -> list[str]:
    """The user messages of this call's context (masked, when the ``redaction`` plugin runs), latest
    first, without the continuation prompts the runtime writes itself."""
    return [m.text for m in reversed(ctx.messages)
            if isinstance(m, UserMessage) and m.text.strip() and not m.text.startswith(_RUNTIME_PROMPTS)]


def _task(ctx: RunContext) -> str:
    """The task: the latest user request the model sees (a chat history's last question, a followup)."""
    return next(iter(_user_texts(ctx)), "")


def _steer_text(ctx: RunContext) -> str:
    """The latest Steer's direction as the model sees it (else the latest user message)."""
    texts = _user_texts(ctx)
    text = next((t[len(_STEER):] for t in texts if t.startswith(_STEER)), texts[0] if texts else "")
    return _clip(text.split("\nKeep what has already been verified")[0], 400)


def _clip(text: str, limit: int, *, collapse: bool = True) -> str:
    """``text`` cut to ``limit`` characters (the last one then ``…``); ``collapse``: runs of
    whitespace made one space first (for one-line prompts and summaries; an answer shown to the
    grader keeps its lines)."""
    if collapse:
        text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _quoted(text: str) -> str:
    """A plan text as one JSON string literal: quoted, its line breaks and quotes escaped."""
    return orjson.dumps(_clip(text, 1000, collapse=False)).decode()


def _doc(fn: Any) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.strip().splitlines()[0] if doc.strip() else getattr(fn, "__name__", "check")
