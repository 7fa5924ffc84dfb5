"""PlanAct (issue 12, seed 004 §3): plan, act node by node, verify each node, replan what is left.

A **planner** turns the task into a typed :class:`~fsm_agent.types.Plan`: nodes with goals,
dependencies and acceptance checks. The model then works on one node at a time as ordinary turns
of the machine (tools, approvals, budgets and the ledger apply as usual). When it ends a turn
without tool calls, a **verifier** checks the node against its acceptance check; a failed check
makes a **replanner** rewrite the remaining plan (passed nodes stay, with their results). A Steer,
or a node that runs too many turns without an answer, also triggers a replan.

Phases:

* **PreTurn** — no plan yet: one planner call (schema-constrained, so it works on a small local
  model too), validated, then ``ctx.update_plan``; the first ready node starts. A goal version
  above the plan's (a Steer) → replan. The running node for more than ``max_turns_per_node``
  model calls → it fails as stale → replan. Then a short note about the current node is added to
  the system message of this call's context (rebuilt from the checkpointed plan at every PreTurn,
  so a resumed run sends the same note).
* **PostTurn** (a turn that ended without tool calls) — the current node is checked: a
  programmatic check (``checks[node.check]``, then ``check``) or, when none decides, a model
  grader. Passed → the node keeps the answer's summary; the next ready node starts and its
  instruction goes into the transcript (``Continue(message=UserMessage(...))``); all passed →
  ``Complete`` with each node's evidence. Failed → the node is logged failed, the replanner writes
  the remaining nodes, the first ready one starts → ``Continue`` with its instruction.
* After ``max_replans`` replans for failures (or staleness) since the run started or a person
  last stepped in (a Steer, a resume after the budget was spent), or a planner that gives no valid plan in ``plan_attempts`` calls, the run stops:
  WAITING_HUMAN (``on_exhausted="human"``, the default; a resume replans with a fresh budget)
  or FAILED_TERMINAL (``"fail"``), ``error.kind`` ``plan_failed`` or ``plan_invalid``.

The plan is in the run state, so it is in every checkpoint: a run paused mid-plan
(PAUSED_BUDGET, INTERRUPTED, WAITING_HUMAN) resumes at the node it was on, with no new planner
call. Each change is logged as ``plan_updated`` (the whole plan and the reason). Planner,
replanner and grader calls go through ``ctx.call_provider(..., account=True)``: their tokens and
cost count toward the run's usage and budgets. :func:`recorded_planner` answers those calls from a
session's log, for an offline replay. The full description: ``docs/planact.md``.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Optional, Union

import orjson
from attrs import evolve

from fsm_agent import (
    AssistantMessage,
    ScriptedProvider,
    Complete,
    ConfigurationError,
    Continue,
    InvalidPlanError,
    MessageRequest,
    Middleware,
    ModelStopReason,
    NodeStatus,
    OutputSchema,
    Plan,
    PlanNode,
    Provider,
    RunContext,
    StopReason,
    StopRun,
    SystemMessage,
    UserMessage,
    parse_output,
)
from fsm_agent.errors import ProviderError
from fsm_agent.providers import text_response
from fsm_agent.types import Replan, ReplanTrigger, nodes_from_output, plan_output_schema, structure

from .verifier import Verdict, parse_verdict

__all__ = [
    "GRADER_INSTRUCTIONS",
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
the model grader) decides."""

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
"""The model grader's system prompt."""

VERDICT_SCHEMA = OutputSchema("verdict", {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 300}},
    "required": ["ok", "reason"],
    "additionalProperties": False,
}, "whether the answer completes the step, and why")
"""The grader's answer: ``{"ok": bool, "reason": str}``."""

_FAILURE_TRIGGERS = (ReplanTrigger.FAILED, ReplanTrigger.STALE)


class PlanAct(Middleware):
    """Plan, act node by node, verify each node, replan the rest (see the module doc).

    Args:
        provider: the model for the planner, replanner and grader calls; ``None``: the run's.
        checks: programmatic checks by name; the planner may name one per node (the schema offers
            exactly these names), and ``node.check`` selects it.
        check: a programmatic check asked about every node that names none (or whose named check
            returned ``None``); ``None`` from it defers to the grader.
        grade: ask the model grader when no programmatic check decided; ``False``: such a node
            passes once the model answers it.
        plan: a plan to start from instead of calling the planner (validated here; used as given,
            with the run's goal version).
        min_nodes: fewest nodes the planner may write (``minItems``; the replanner may write 1).
        max_nodes: most nodes the planner or the replanner may write.
        max_replans: replans for failed or stale nodes allowed since the run started, or since a
            person last stepped in (a Steer, or a resume after this budget was spent); a Steer's
            replan does not count.
        max_turns_per_node: model calls a node may take before it counts as stale (``None``: no
            limit).
        plan_attempts: planner (or replanner) calls for one plan, when an answer breaks the
            schema or the plan's rules (the problems are sent back each time).
        grade_attempts: grader calls for one verdict, when a reply cannot be read.
        on_exhausted: ``"human"`` (WAITING_HUMAN, the default) or ``"fail"`` (FAILED_TERMINAL) when
            the replans or the planner's attempts are spent.
        max_tokens: output tokens of each planner, replanner and grader answer.
        temperature: of those calls (default 0).
        max_chars: ``maxLength`` of each string in the plan schema; ``"auto"``: 100 for the
            ``llamacpp`` profile (its grammar enforces it; a small model otherwise runs on until
            the output limit cuts the JSON), none elsewhere.
        numbered: ask for the numbered plan form (node ids ``s1``, ``s2`` ... by position, each
            node depending only on earlier or passed ones: see
            :func:`~fsm_agent.types.plan_output_schema`), so a grammar-constrained server cannot
            return an unknown dependency or a cycle; ``"auto"``: for the ``llamacpp`` profile
            (SmolLM2-135M invents dependencies otherwise), free ids elsewhere.
        examples: send the worked example exchange (:data:`PLANNER_EXAMPLE`,
            :data:`REPLANNER_EXAMPLE`) before the real request.
        planner_instructions, replanner_instructions, grader_instructions: the system prompts.

    Raises:
        ConfigurationError: a bad option (``on_exhausted``, a count below its minimum, ``plan``
            that breaks the plan rules, ``plan`` naming a check that is not registered).
    """

    name = "planact"

    def __init__(self, *, provider: Provider | None = None, checks: Mapping[str, NodeCheck] | None = None,
                 check: NodeCheck | None = None, grade: bool = True, plan: Plan | None = None,
                 min_nodes: int = 1, max_nodes: int = 6, max_replans: int = 3, max_turns_per_node: int | None = 10,
                 plan_attempts: int = 2, grade_attempts: int = 2, on_exhausted: str = "human",
                 max_tokens: int = 600, temperature: float | None = 0.0, max_chars: int | str | None = "auto",
                 numbered: bool | str = "auto", examples: bool = True,
                 planner_instructions: str = PLANNER_INSTRUCTIONS,
                 replanner_instructions: str = REPLANNER_INSTRUCTIONS,
                 grader_instructions: str = GRADER_INSTRUCTIONS) -> None:
        if on_exhausted not in ("human", "fail"):
            raise ConfigurationError(f"PlanAct: on_exhausted must be 'human' or 'fail', not {on_exhausted!r}")
        if not 1 <= min_nodes <= max_nodes:
            raise ConfigurationError(f"PlanAct: need 1 <= min_nodes <= max_nodes (got {min_nodes}, {max_nodes})")
        for what, n, least in (("max_replans", max_replans, 0), ("plan_attempts", plan_attempts, 1),
                               ("grade_attempts", grade_attempts, 1), ("max_tokens", max_tokens, 1)):
            if n < least:
                raise ConfigurationError(f"PlanAct: {what} must be at least {least}, not {n}")
        if max_turns_per_node is not None and max_turns_per_node < 1:
            raise ConfigurationError(f"PlanAct: max_turns_per_node must be at least 1 (or None), not {max_turns_per_node}")
        if max_chars != "auto" and max_chars is not None and (not isinstance(max_chars, int) or max_chars < 20):
            raise ConfigurationError(f"PlanAct: max_chars must be 'auto', None or at least 20, not {max_chars!r}")
        if numbered not in ("auto", True, False):
            raise ConfigurationError(f"PlanAct: numbered must be 'auto', True or False, not {numbered!r}")
        self.provider = provider
        self.checks: dict[str, NodeCheck] = dict(checks or {})
        self.check = check
        self.grade = grade
        if plan is not None:
            try:
                plan.validate()
            except InvalidPlanError as exc:
                raise ConfigurationError(f"PlanAct: the given plan is invalid: {'; '.join(exc.problems)}") from exc
            unknown = sorted({n.check for n in plan.nodes if n.check is not None} - set(self.checks))
            if unknown:
                raise ConfigurationError(f"PlanAct: the given plan names checks that are not registered: {unknown}; "
                                         "pass them in checks={name: callable}")
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
        """Make the plan (first turn), replan on a Steer or a stale node, and put the current node
        in front of the model.

        Raises:
            StopRun: WAITING_HUMAN or FAILED_TERMINAL when no valid plan comes in ``plan_attempts``
                calls, when the replans are spent, or when a planner call fails (WAITING_HUMAN
                for a retryable provider error, so a resume can try again).
        """
        plan = ctx.plan
        if plan is None:
            plan = await self._first_plan(ctx)
        elif plan.goal_version < ctx.goal_version:
            plan = await self._replan(ctx, plan, ReplanTrigger.STEER,
                                      f"the goal changed (goal version {ctx.goal_version}): {_last_user_text(ctx)}",
                                      None)
        elif (current := plan.current) is None:
            plan = await self._restart(ctx, plan)
        elif (self.max_turns_per_node is not None and current.started_turn is not None
              and ctx.turn - current.started_turn >= self.max_turns_per_node):
            reason = (f"no answer to check after {ctx.turn - current.started_turn} model calls "
                      f"(max_turns_per_node={self.max_turns_per_node})")
            plan = plan.with_node(current.id, status=NodeStatus.FAILED, attempts=current.attempts + 1, verdict=reason)
            ctx.update_plan(plan, f"node {current.id} is stale: {reason}")
            plan = await self._replan(ctx, plan, ReplanTrigger.STALE, f"node {current.id} is stale: {reason}",
                                      current.id)
        self._note(ctx, plan)

    async def _first_plan(self, ctx: RunContext) -> Plan:
        goal = _goal(ctx)
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
        ready = plan.ready()
        if not ready:  # a given plan whose nodes all passed: nothing left to steer
            ctx.update_plan(plan, f"planned by {how}: {len(plan.nodes)} nodes, none left to run")
            return plan
        plan = plan.start(ready[0].id, turn=ctx.turn)
        ctx.update_plan(plan, f"planned by {how}: {len(plan.nodes)} nodes; node {ready[0].id} started")
        return plan

    async def _restart(self, ctx: RunContext, plan: Plan) -> Plan:
        """No node is running: a run resumed after its replans were spent (a failed node) gets a
        replan with a fresh budget; otherwise the next ready node starts."""
        failed = next((n for n in plan.nodes if n.status is NodeStatus.FAILED), None)
        if failed is not None:
            return await self._replan(ctx, plan, ReplanTrigger.RESUMED,
                                      f"a person resumed the run after node {failed.id} failed: "
                                      f"{failed.verdict or 'no reason recorded'}", failed.id)
        ready = plan.ready()
        if not ready:
            return plan  # every node passed (a followup keeps the run going): nothing to steer
        plan = plan.start(ready[0].id, turn=ctx.turn)
        ctx.update_plan(plan, f"node {ready[0].id} started")
        return plan

    def _note(self, ctx: RunContext, plan: Plan) -> None:
        """The current node, at the end of this call's system message (not in the transcript: it is
        rebuilt from the checkpointed plan at every PreTurn)."""
        current = plan.current
        if current is None:
            return
        done = [n.id for n in plan.nodes if n.status is NodeStatus.PASSED]
        lines = [f"You are following a plan. Current step {current.id}: {current.goal}"]
        if current.acceptance:
            lines.append(f"Done when: {current.acceptance}")
        if done:
            lines.append(f"Steps already done: {', '.join(done)}.")
        lines.append("Work on the current step only, then give its result.")
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
            ``Complete`` with every node's evidence when the last node passed.

        Raises:
            StopRun: WAITING_HUMAN or FAILED_TERMINAL when the replans are spent (the node is
                logged ``failed``), when the replanner gives no valid plan, when a grader or
                replanner call fails, or when a node names a check that is not registered.
        """
        resp = ctx.last_response
        if resp is None or resp.tool_calls or resp.stop_reason is ModelStopReason.PAUSE_TURN:
            return None
        plan = ctx.plan
        node = plan.current if plan is not None else None
        if plan is None or node is None:
            return None
        verdict = await self._verify(ctx, node)
        plan = plan.with_node(node.id, attempts=node.attempts + 1, result=_clip(resp.text, 500),
                              verdict=verdict.feedback or ("passed" if verdict.ok else "failed"),
                              evidence=verdict.evidence)
        if verdict.ok:
            plan = plan.with_node(node.id, status=NodeStatus.PASSED)
            ready = plan.ready()
            if not ready:
                if not plan.done:  # pragma: no cover - a valid plan with open nodes always has a ready one
                    raise StopRun(StopReason.FAILED_TERMINAL, f"planact: node {node.id} passed but no node is ready")
                ctx.update_plan(plan, f"node {node.id} passed: {verdict.feedback or 'the check passed'}; "
                                      "every node passed")
                evidence = tuple(e for n in plan.order() if n.status is NodeStatus.PASSED
                                 for e in (f"plan:v{plan.version}:{n.id}:passed", *n.evidence))
                passed = sum(n.status is NodeStatus.PASSED for n in plan.nodes)
                return Complete(evidence=evidence, detail=f"plan v{plan.version}: every node passed ({passed} "
                                f"node{'' if passed == 1 else 's'}, {plan.replans} replan"
                                f"{'' if plan.replans == 1 else 's'})")
            plan = plan.start(ready[0].id, turn=ctx.turn)
            ctx.update_plan(plan, f"node {node.id} passed: {verdict.feedback or 'the check passed'}; "
                                  f"node {ready[0].id} started")
            return Continue(message=UserMessage(self._instruction(plan, ready[0])),
                            reason=f"plan: node {node.id} passed; next node {ready[0].id}")
        reason = verdict.feedback or "the check failed without a reason"
        plan = plan.with_node(node.id, status=NodeStatus.FAILED)
        ctx.update_plan(plan, f"node {node.id} failed its check: {reason}")
        plan = await self._replan(ctx, plan, ReplanTrigger.FAILED, f"node {node.id} failed its check: {reason}",
                                  node.id)
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
            verdict = await _ask_check(named, ctx, node)
            if verdict is not None:
                return verdict
        if self.check is not None:
            verdict = await _ask_check(self.check, ctx, node)
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
                                  f"ANSWER:\n{_clip(answer, 4000)}")),
            max_tokens=min(self.max_tokens, 200), temperature=self.temperature, output_schema=VERDICT_SCHEMA)
        raw = ""
        for _ in range(self.grade_attempts):
            response = await self._call(ctx, request, "grader")
            raw = response.text
            parsed = parse_output(response, VERDICT_SCHEMA)
            found: tuple[bool, str] | None = None
            if parsed.ok and isinstance(parsed.value, dict):
                found = bool(parsed.value["ok"]), str(parsed.value["reason"])
            else:
                found = parse_verdict(raw)
            if found is not None:
                ok, reason = found
                who = f"{response.provider or provider.name}/{response.model or request.model}"
                return Verdict(ok, reason, (f"grader:{who}:{response.id}",))
        raise StopRun(StopReason.FAILED_TERMINAL,
                      f"planact: the grader gave no readable verdict on node {node.id} in {self.grade_attempts} "
                      f"attempt(s); last reply: {raw[:300]!r}", error={"kind": "verifier_unreadable", "message": raw[:2000]})

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
                messages.append(AssistantMessage(parsed.raw))
            messages.append(UserMessage(f"That plan cannot be used: {_clip(problem, 600)}\n"
                                        "Reply again with only the corrected JSON."))
        detail = (f"planact: the {role} gave no valid plan in {self.plan_attempts} call(s); "
                  f"last problem: {_clip(problem, 500)}")
        error = {"kind": "plan_invalid", "message": detail, "role": role}
        if self.on_exhausted == "fail":
            raise StopRun(StopReason.FAILED_TERMINAL, detail, error=error)
        raise StopRun(StopReason.WAITING_HUMAN, detail, error=error,
                      required_decision=f"resume to ask the {role} again (a Steer first can clarify the task), or cancel")

    async def _call(self, ctx: RunContext, request: MessageRequest, role: str) -> Any:
        try:
            return await ctx.call_provider(request, provider=self.provider, account=True)
        except ProviderError as exc:
            stop = StopReason.WAITING_HUMAN if exc.retryable else StopReason.FAILED_TERMINAL
            raise StopRun(stop, f"planact: the {role} call failed: {exc}", error=exc.to_info(),
                          required_decision=f"resume to call the {role} again" if exc.retryable else None) from exc


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
async def _ask_check(check: NodeCheck, ctx: RunContext, node: PlanNode) -> Verdict | None:
    verdict = check(ctx, node)
    if inspect.isawaitable(verdict):
        verdict = await verdict
    if verdict is not None and not isinstance(verdict, Verdict):
        raise TypeError(f"a PlanAct check returned {type(verdict).__name__}, not a Verdict or None")
    return verdict


def _failure_replans(history: Sequence[Replan]) -> int:
    """Replans for failed or stale nodes since a person last stepped in (a resume after the
    budget was spent, a Steer)."""
    count = 0
    for r in history:
        if r.trigger in (ReplanTrigger.RESUMED, ReplanTrigger.STEER):
            count = 0
        elif r.trigger in _FAILURE_TRIGGERS:
            count += 1
    return count


def _goal(ctx: RunContext) -> str:
    """The task: the first user message of the transcript."""
    return next((m.text for m in ctx.transcript if isinstance(m, UserMessage)), "")


def _last_user_text(ctx: RunContext) -> str:
    return _clip(next((m.text for m in reversed(ctx.transcript) if isinstance(m, UserMessage)), ""), 400)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _doc(fn: Any) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.strip().splitlines()[0] if doc.strip() else getattr(fn, "__name__", "check")
