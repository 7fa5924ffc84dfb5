"""A leader and N workers: the leader splits the task, the workers run the parts in parallel,
each in its own session with its own budget, and the leader merges and verifies their results
under a declared merge rule.

    team = Team(leader, worker, merge=quorum(2), max_workers=3, max_parallel=2,
                worker_limits={"max_iterations": 6}, retries=1, verify=cites_every_worker)
    result = await team.run("Compare the three offers")
    result.stop.reason, result.output, [w.stop for w in result.workers]

**One session for the leader.** The team runs as one session of the leader (its own config and
budget), whose turns are:

1. **the split**: a schema-constrained call. The first model call of the session is offered only
   the ``dispatch`` tool, with a forced tool choice, so the answer must be a ``dispatch`` call
   whose arguments match :func:`split_schema` (``{"subtasks": [{"task": str}, ...]}``, 1 to
   ``max_workers`` items). On a provider without native tool calls the constrained mode turns this
   into one JSON schema enforced by grammar (the local llama.cpp model). Arguments that break the
   schema are an error result and the split is asked again.
2. **the workers**: the ``dispatch`` call runs every subtask as a worker session linked
   ``worker`` to the leader's session and call (``worker<i>-<key>``; link metadata: ``index``,
   ``task``), at most ``max_parallel`` at a time, each with the worker agent's config and
   ``worker_limits``. Usage and cost of each worker roll up into the leader.
3. **the merge**: the call's result lists every worker (its stop and answer); the leader's next
   turns (the ``dispatch`` tool is no longer offered) write the merged answer.
4. **the verification**: ``verify(answer, outcomes)`` (optional) checks it; a failed check gets one
   more turn with the reason, then the team stops FAILED_TERMINAL (``verification_failed``).

An answer before the split (a forced call cut at the output token limit reads as text) does not
complete the team: the leader is asked again, within its own budget (PAUSED_BUDGET when it runs out).

**A worker's failure** (see also ``docs/multi-agent.md``):

* a worker that stops FAILED_RETRYABLE is resumed (its own session: nothing it did runs again) up
  to ``retries`` times;
* a worker that stops WAITING_HUMAN makes the leader stop WAITING_HUMAN (the ``dispatch`` call
  pending, reason ``workers_waiting``) once the others are done; the person's decision is applied
  to each waiting worker's pending calls when the leader is resumed;
* any other stop (PAUSED_BUDGET, FAILED_*, CANCELLED, INTERRUPTED from outside) is a failed
  outcome. The merge rule decides: it goes on with the outcomes it names (the failed ones are
  listed to the leader as not merged), or the team stops FAILED_TERMINAL with error kind
  ``merge_rule`` naming each failed worker and its stop.

Merge rules: :func:`all_succeed` (the default), :func:`quorum`, :func:`best_effort`, or any
callable ``(outcomes) -> MergeDecision``.

An Interrupt or Cancel of the leader's session reaches every running worker (cut; resumed with the
leader, or cancelled with it); a crash of the leader's process is recovered by resuming the leader:
the ``dispatch`` call runs again with the same key and finds every worker where it stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, Union

from attrs import evolve, frozen

from ..agent import Agent
from ..errors import ConfigurationError, StopRun, ToolError, WaitForHuman
from ..machine.context import RunContext
from ..middleware import Complete, Continue, Middleware, ModelCallNext, Ordering
from ..store.base import LinkKind
from ..tools.registry import Tool, ToolContext, ToolEffect
from ..types.messages import Message, ToolResultMessage, Usage, UserMessage
from ..types.requests import MessageRequest, MessageResponse
from ..types.run import RunResult, RunStop, StopReason
from ._child import Counted, _resume_when_free, cancel_child, drive_child, roll_up, stored_result
from .subagent import checked_limits, waiting_for

__all__ = [
    "DISPATCH",
    "MergeDecision",
    "MergeRule",
    "Team",
    "TeamResult",
    "WorkerOutcome",
    "all_succeed",
    "best_effort",
    "quorum",
    "split_schema",
]

DISPATCH = "dispatch"
"""The name of the leader's split tool."""


def split_schema(max_workers: int, max_task_chars: int = 600) -> dict[str, Any]:
    """The JSON Schema of a split: ``{"subtasks": [{"task": str}, ...]}`` with 1 to ``max_workers``
    subtasks of 1 to ``max_task_chars`` characters (bounded, so that a small model under a grammar
    cannot run on until its output limit)."""
    return {
        "type": "object",
        "properties": {"subtasks": {
            "type": "array", "minItems": 1, "maxItems": max_workers,
            "description": f"1 to {max_workers} independent parts of the task, one per worker.",
            "items": {"type": "object", "additionalProperties": False, "required": ["task"],
                      "properties": {"task": {"type": "string", "minLength": 1, "maxLength": max_task_chars,
                                              "description": "The part, with all a worker needs to know."}}},
        }},
        "required": ["subtasks"],
        "additionalProperties": False,
    }


@frozen
class WorkerOutcome:
    """How one worker's part ended."""

    index: int
    """The subtask's position in the split (from 0)."""
    task: str
    """The subtask."""
    session_id: str
    stop: StopReason
    detail: str
    """The worker's stop detail."""
    output: str
    """Its last answer ('' when none)."""
    output_data: Any = None
    """Its structured answer, when the worker agent has an output schema."""
    usage: Usage = Usage()
    cost_usd: float | None = 0.0
    attempts: int = 1
    """Runs of the worker in this dispatch (1 + the retries used)."""

    @property
    def ok(self) -> bool:
        """The worker completed."""
        return self.stop is StopReason.COMPLETED


@frozen
class MergeDecision:
    """A merge rule's verdict on the outcomes."""

    ok: bool
    """Merge (``True``) or fail the team (``False``)."""
    use: tuple[int, ...] = ()
    """The indices of the outcomes to merge (the others are listed to the leader as not merged)."""
    detail: str = ""
    """Why, in words (the stop detail when the team fails)."""


class MergeRule(Protocol):
    """``(outcomes) -> MergeDecision``: decides whether the leader merges, and what."""

    def __call__(self, outcomes: Sequence[WorkerOutcome]) -> MergeDecision: ...


def _failed(outcomes: Sequence[WorkerOutcome]) -> str:
    return ", ".join(f"worker {o.index} {o.stop.value}" for o in outcomes if not o.ok) or "none"


@frozen(repr=False)
class _Quorum:
    k: int
    name: str

    def __call__(self, outcomes: Sequence[WorkerOutcome]) -> MergeDecision:
        done = tuple(o.index for o in outcomes if o.ok)
        need = min(self.k, len(outcomes)) if self.name != "all_succeed" else len(outcomes)
        if len(done) >= max(need, 1):
            return MergeDecision(True, done, f"{len(done)} of {len(outcomes)} workers completed ({self!r})")
        return MergeDecision(False, done, f"{self!r} not met: {len(done)} of {len(outcomes)} workers completed; "
                                          f"failed: {_failed(outcomes)}")

    def __repr__(self) -> str:
        return f"quorum({self.k})" if self.name == "quorum" else f"{self.name}()"


def all_succeed() -> MergeRule:
    """Merge only when every worker completed (the default)."""
    return _Quorum(0, "all_succeed")


def quorum(k: int) -> MergeRule:
    """Merge the completed workers when at least ``k`` completed (all of them, when there are fewer
    than ``k`` subtasks).

    Raises:
        ConfigurationError: ``k`` < 1.
    """
    if k < 1:
        raise ConfigurationError(f"quorum(k) needs k >= 1, not {k}")
    return _Quorum(k, "quorum")


def best_effort() -> MergeRule:
    """Merge whatever completed, as long as one worker did."""
    return _Quorum(1, "best_effort")


Verify = Callable[[str, Sequence[WorkerOutcome]], Union[str, None, Awaitable[Union[str, None]]]]
"""``verify(answer, outcomes)``: ``None`` when the merged answer is good, else what is wrong with it."""


@frozen
class TeamResult:
    """How a team's run ended."""

    session_id: str
    """The leader's session: the team's handle (resume it, send it controls)."""
    stop: RunStop
    output: str
    """The merged answer."""
    output_data: Any
    usage: Usage
    """Tokens of the leader and every worker."""
    cost_usd: float | None
    """USD of the leader and every worker; ``None`` when a price was unknown."""
    workers: tuple[WorkerOutcome, ...]
    """Every worker, in split order, as it stands in the store."""
    result: RunResult
    """The leader session's own :class:`RunResult`."""


def _worker_id(ctx: ToolContext, index: int) -> str:
    return f"worker{index}-{ctx.idempotency_key[:20]}"


def _outcome(index: int, task: str, result: RunResult, attempts: int) -> WorkerOutcome:
    return WorkerOutcome(index, task, result.session_id, result.stop.reason, result.stop.detail, result.output,
                         result.output_data, result.usage, result.cost_usd, attempts)


def _report(outcomes: Sequence[WorkerOutcome], decision: MergeDecision, limit: int = 1500) -> str:
    lines = [f"{len(outcomes)} worker(s) ran: {decision.detail}. Merge the results marked MERGE into one answer "
             "to the original task."]
    for o in outcomes:
        head = f"[worker {o.index}] {'MERGE' if o.index in decision.use else 'NOT MERGED'} ({o.stop.value}) {o.task}"
        if o.ok:
            text = o.output.strip()
            lines.append(f"{head}\n{text[:limit]}{'...' if len(text) > limit else ''}")
        else:
            lines.append(f"{head}\nfailed: {o.detail[:300]}")
    return "\n\n".join(lines)


class _TeamControl(Middleware):
    """Forces the split as the first call, hides ``dispatch`` once it ran, fails the team when the
    merge rule refuses, and verifies the merged answer."""

    name = "team"
    ordering = Ordering(position="innermost")

    def __init__(self, team: Team) -> None:
        self.team = team

    @staticmethod
    def _dispatched(ctx: RunContext) -> bool:
        return any(isinstance(m, ToolResultMessage) and m.name == DISPATCH and not m.is_error for m in ctx.transcript)

    async def wrap_model_call(self, request: MessageRequest, call_next: ModelCallNext,
                              ctx: RunContext) -> MessageResponse:
        if self._dispatched(ctx):
            request = evolve(request, tools=tuple(t for t in request.tools if t.name != DISPATCH))
        else:
            request = evolve(request, tools=tuple(t for t in request.tools if t.name == DISPATCH),
                             tool_choice="required")
        return await call_next(request)

    async def post_turn(self, ctx: RunContext) -> Complete | Continue | None:  # type: ignore[override]
        resp = ctx.last_response
        if resp is None:
            return None
        for call in resp.tool_calls:
            if call.name != DISPATCH:
                continue
            result = next((m for m in reversed(ctx.transcript)
                           if isinstance(m, ToolResultMessage) and m.tool_call_id == call.id), None)
            if result is not None and result.is_error and (result.metadata or {}).get("error") == "merge_rule":
                raise StopRun(StopReason.FAILED_TERMINAL.value, f"the merge rule failed the team: {result.text[:600]}",
                              error={"kind": "merge_rule", "message": result.text[:2000]})
        if resp.tool_calls:
            return None
        if not self._dispatched(ctx):
            # the split is required: an answer instead of it (a forced call cut at the output limit
            # reads as text) does not complete the team; the leader's budget bounds the asking
            cut = resp.stop_reason.value == "max_tokens"
            why = "was cut at the output token limit" if cut else "was not a dispatch call"
            return Continue(UserMessage(f"Your last answer {why}. Split the task with the dispatch tool first: "
                                        "short subtasks, one per worker."), reason=f"no split yet: the answer {why}")
        outcomes = await self.team.outcomes(ctx.session_id)
        evidence = tuple(f"worker:{o.session_id}" for o in outcomes)
        if self.team.verify is None:
            return Complete(evidence, f"merged {len(outcomes)} worker result(s) under {self.team.merge!r}")
        verdict = self.team.verify(resp.message.text, outcomes)
        if asyncio.iscoroutine(verdict) or isinstance(verdict, Awaitable):
            verdict = await verdict
        if verdict is None:
            return Complete(evidence, f"merged {len(outcomes)} worker result(s) under {self.team.merge!r}; verified")
        state = ctx.state(self)
        if not state.get("repaired"):
            state["repaired"] = True
            return Continue(UserMessage(f"The merged answer does not pass the check: {verdict}. Answer again, "
                                        "merging the workers' results."), reason=f"verification failed: {verdict}")
        raise StopRun(StopReason.FAILED_TERMINAL.value, f"the merged answer failed verification twice: {verdict}",
                      error={"kind": "verification_failed", "message": str(verdict)[:2000]})


TEAM_PROMPT = ("You lead a team of workers. First split the task into independent parts with the dispatch tool, one "
               "part per worker, each with everything its worker needs to know. Then merge the workers' results "
               "into one answer to the task.")


class Team:
    """A leader, its workers and a merge rule (see the module docstring).

    Args:
        leader: splits, merges (its own config, tools and middleware, plus the team's).
        workers: the worker agent, or several (subtask ``i`` goes to ``workers[i % len(workers)]``).
            Every agent shares the leader's store.
        merge: a :class:`MergeRule` (default :func:`all_succeed`).
        max_workers: most subtasks in a split.
        max_parallel: most workers running at once.
        worker_limits: :class:`~fsm_agent.RunConfig` fields over each worker's config (its budget).
        retries: resumes of a worker that stopped FAILED_RETRYABLE, per dispatch.
        verify: ``verify(answer, outcomes) -> None | str`` (may be async): checks the merged answer.
        instructions: put before the leader's system prompt (default :data:`TEAM_PROMPT`).
        max_task_chars: longest subtask, in characters (the split's schema bounds it).

    Raises:
        ConfigurationError: no worker, agents with different stores, a bad limit, ``max_workers``
            or ``max_parallel`` < 1, ``retries`` < 0.
    """

    def __init__(self, leader: Agent, workers: Agent | Sequence[Agent], *, merge: MergeRule | None = None,
                 max_workers: int = 4, max_parallel: int = 2, worker_limits: Mapping[str, Any] | None = None,
                 retries: int = 1, verify: Verify | None = None, instructions: str = TEAM_PROMPT,
                 max_task_chars: int = 600) -> None:
        pool = [workers] if isinstance(workers, Agent) else list(workers)
        if not pool:
            raise ConfigurationError("a team needs at least one worker agent")
        if any(w.store is not leader.store for w in pool):
            raise ConfigurationError("the workers must share the leader's store (the links and sessions are read "
                                     "together)")
        if max_workers < 1 or max_parallel < 1:
            raise ConfigurationError(f"max_workers and max_parallel must be at least 1 (got {max_workers}, "
                                     f"{max_parallel})")
        if max_task_chars < 1:
            raise ConfigurationError(f"max_task_chars must be at least 1, not {max_task_chars}")
        if retries < 0:
            raise ConfigurationError(f"retries must not be negative, not {retries}")
        self.workers = pool
        self.merge: MergeRule = merge or all_succeed()
        self.max_workers = max_workers
        self.max_parallel = max_parallel
        self.max_task_chars = max_task_chars
        self.worker_limits = checked_limits(pool[0], worker_limits, "Team worker_limits")
        self.retries = retries
        self.verify = verify
        self.store = leader.store
        prompt = "\n\n".join(p for p in (instructions, leader.system_prompt) if p)
        self.leader = Agent(leader.provider, tools=[*leader.tools, self._dispatch_tool()], system_prompt=prompt,
                            middleware=[*leader.middleware, _TeamControl(self)], observers=leader.hooks.observers,
                            config=leader.config, store=leader.store, worker_id=leader.worker_id,
                            lease_ttl=leader.lease_ttl, control_poll=leader.control_poll)

    def __repr__(self) -> str:
        return (f"Team(workers={len(self.workers)}, merge={self.merge!r}, max_workers={self.max_workers}, "
                f"max_parallel={self.max_parallel}, retries={self.retries})")

    def _worker(self, index: int) -> Agent:
        return self.workers[index % len(self.workers)]

    async def _run_worker(self, ctx: ToolContext, index: int, task: str, gate: asyncio.Semaphore,
                          counted: Counted) -> WorkerOutcome:
        async with gate:
            agent = self._worker(index)
            child = _worker_id(ctx, index)
            result = await drive_child(agent, child, task, parent_id=ctx.session_id, kind=LinkKind.WORKER.value,
                                       call_id=ctx.call_id, link_metadata={"index": index, "task": task},
                                       limits=self.worker_limits, decision=ctx.decision, ctx=ctx, counted=counted)
            attempts = 1
            while result.stop.reason is StopReason.FAILED_RETRYABLE and attempts <= self.retries:
                attempts += 1
                ctx.report_progress(index, None, f"worker {index} failed retryably; attempt {attempts}")
                result = await _resume_when_free(agent, child)
                await roll_up(ctx, agent, child, counted, result)
            return _outcome(index, task, result, attempts)

    def _dispatch_tool(self) -> Tool:
        async def dispatch(_fsm_context: ToolContext, subtasks: list[dict[str, Any]]) -> str:
            ctx = _fsm_context
            tasks = [str(s["task"]).strip() for s in subtasks]
            blank = [i for i, t in enumerate(tasks) if not t]
            if blank:
                raise ToolError(f"subtask(s) {blank} are blank; split the task again", kind="invalid_split")
            gate = asyncio.Semaphore(self.max_parallel)
            counted: Counted = {}
            async with asyncio.TaskGroup() as group:  # a failure (or a cancel) stops every worker
                running = [group.create_task(self._run_worker(ctx, i, t, gate, counted)) for i, t in enumerate(tasks)]
            outcomes = [r.result() for r in running]
            waiting = [o for o in outcomes if o.stop is StopReason.WAITING_HUMAN]
            if waiting:
                parts = []
                for o in waiting:
                    found = await stored_result(self._worker(o.index), o.session_id)
                    parts.append(f"worker {o.index} (session {o.session_id}): "
                                 + (waiting_for(found.stop) if found is not None else o.detail))
                raise WaitForHuman("workers wait for a person: " + "; ".join(parts) + ". Approve to let them go on, "
                                   "reject or respond to answer their pending calls with your message",
                                   reason="workers_waiting", allowed_decisions=("approve", "reject", "respond"))
            decision = self.merge(outcomes)
            if not decision.ok:
                raise ToolError(decision.detail + "\n\n" + _report(outcomes, decision, 300), kind="merge_rule")
            return _report(outcomes, decision)

        t = Tool(dispatch, name=DISPATCH, description=(
            "Split the task into independent parts, one per worker; the workers run them in parallel and their "
            "results come back here."), parameters=split_schema(self.max_workers, self.max_task_chars), timeout=None,
            effect=ToolEffect.IDEMPOTENT, resumable=True)

        @t.on_compensate
        async def _cancel(arguments: dict[str, Any], result: Any, ctx: ToolContext) -> bool:
            stops = [await cancel_child(self._worker(i), _worker_id(ctx, i), "the leader was cancelled")
                     for i in range(len(arguments.get("subtasks") or ()))]
            return all(s in (None, StopReason.CANCELLED, StopReason.COMPLETED) for s in stops) and \
                any(s is StopReason.CANCELLED for s in stops)

        return t

    async def outcomes(self, session_id: str) -> tuple[WorkerOutcome, ...]:
        """The workers of the leader's session ``session_id``, as the store has them, in split order
        (the last split when the leader split more than once)."""
        links = [x for x in await self.store.children(session_id) if x.kind == LinkKind.WORKER.value]
        if not links:
            return ()
        last_call = links[-1].call_id
        out = []
        for link in sorted((x for x in links if x.call_id == last_call), key=lambda x: int(x.metadata.get("index", 0))):
            index = int(link.metadata.get("index", 0))
            found = await stored_result(self._worker(index), link.child_id)
            if found is not None:
                out.append(_outcome(index, str(link.metadata.get("task", "")), found, 1))
        return tuple(out)

    async def run(self, task: str | Message | Sequence[Message], *, session_id: str | None = None,
                  **limits: Any) -> TeamResult:
        """Run the team on ``task`` (``limits``: RunConfig fields for the leader's run).

        Raises:
            SessionExistsError: ``session_id`` exists (use :meth:`resume`).
            ConfigurationError: a bad limit.
        """
        return await self._result(await self.leader.run(task, session_id=session_id, metadata={"team": True},
                                                        **limits))

    async def resume(self, session_id: str, **kwargs: Any) -> TeamResult:
        """Resume the team whose leader session is ``session_id`` (``Agent.resume`` arguments:
        ``decisions`` for a ``dispatch`` call waiting on workers, raised limits ...). Finished
        workers are not run again; cut or crashed ones continue.

        Raises:
            ResumeError: the session cannot be resumed.
        """
        return await self._result(await self.leader.resume(session_id, **kwargs))

    async def _result(self, result: RunResult) -> TeamResult:
        return TeamResult(result.session_id, result.stop, result.output, result.output_data, result.usage,
                          result.cost_usd, await self.outcomes(result.session_id), result)
