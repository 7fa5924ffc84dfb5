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
   ``worker_limits`` (token and cost budgets capped at what the leader has left when it starts).
   Usage and cost of each worker roll up into the leader. A team splits once: a second
   ``dispatch`` call (in the same turn, or after a split ran workers) is denied.
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
  pending, reason ``workers_waiting``) once the others are done; the person's decision is passed
  on to each waiting worker's pending calls when the leader is resumed;
* a worker that stops INTERRUPTED (from outside: a control sent to its session, its agent
  drained), or whose session could not be driven (a store error, its lease held elsewhere), leaves
  the ``dispatch`` call open once the others are done: the leader stops INTERRUPTED (reason
  ``workers_interrupted`` / ``workers_not_driven``) and its resume continues every worker where
  it stopped;
* any other stop (PAUSED_BUDGET, FAILED_*, CANCELLED; a session id taken by another session) is a
  failed outcome. The merge rule decides: it goes on with the outcomes it names (the failed ones
  are listed to the leader as not merged), or the team stops FAILED_TERMINAL with error kind
  ``merge_rule`` naming each failed worker and its stop (also when the rule raises, or names a
  worker that did not complete).

A ``dispatch`` call that ran workers never leads to a second split: when it ends in an error other
than the merge rule's, the team stops FAILED_TERMINAL (``dispatch_failed``).

Merge rules: :func:`all_succeed` (the default), :func:`quorum`, :func:`best_effort`, or any
callable ``(outcomes) -> MergeDecision``.

An Interrupt or Cancel of the leader's session reaches every running worker (cut; resumed with the
leader, or cancelled with it); a crash of the leader's process is recovered by resuming the leader:
the ``dispatch`` call runs again with the same key and finds every worker where it stopped.
``Team.drain_on_signals()`` (or the leader agent's, which the team's leader is derived from)
interrupts the team's runs on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, Union

from attrs import evolve, frozen

from ..agent import Agent, drain_on_signals
from ..errors import ConfigurationError, SessionLinkError, StopRun, SuspendCall, ToolError, WaitForHuman
from ..context import RunContext
from ..middleware import Complete, Continue, Deny, Middleware, ModelCallNext, Ordering
from ..store.base import LinkKind, SessionLink
from ..tools.registry import Tool, ToolContext, ToolEffect
from ..types.content import ToolUseBlock
from ..types.messages import Message, ToolResultMessage, Usage, UserMessage
from ..types.requests import MessageRequest, MessageResponse
from ..types.run import RunResult, RunStop, StopReason
from ._child import (
    Counted,
    _resume_when_free,
    checked_limits,
    compensate_by_cancelling,
    drive_child,
    first_of_turn,
    forwardable,
    roll_up,
    stored_result,
    waiting_on,
)
from .links import child_session_id
from .result import PatternResult

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
    """Runs of the worker that ended FAILED_RETRYABLE, plus the one that ended as it stands (1 + the
    retries used), as its session's log has them."""

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
    """The indices of the outcomes to merge, each a worker that completed (the others are listed to
    the leader as not merged). When ``ok``, at least one."""
    detail: str = ""
    """Why, in words (the stop detail when the team fails)."""


class MergeRule(Protocol):
    """``(outcomes) -> MergeDecision``: decides whether the leader merges, and what. Called once per
    dispatch, when every worker is done; an exception it raises (or a decision naming a worker that
    did not complete) fails the team (``merge_rule``)."""

    def __call__(self, outcomes: Sequence[WorkerOutcome]) -> MergeDecision: ...


def _misfit(decision: Any, outcomes: Sequence[WorkerOutcome]) -> str:
    """What is wrong with a merge rule's decision ('' when nothing)."""
    if not isinstance(decision, MergeDecision):
        return f"returned {type(decision).__name__}, not a MergeDecision"
    done = {o.index for o in outcomes if o.ok}
    wrong = [i for i in decision.use if i not in done]
    if wrong:
        return f"named worker(s) {wrong} to merge, which did not complete (completed: {sorted(done) or 'none'})"
    if decision.ok and not decision.use:
        return "decided to merge, but named no worker to merge"
    return ""


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
class TeamResult(PatternResult):
    """How a team's run ended: a :class:`~fsm_agent.orchestration.result.PatternResult` whose top
    session is the leader's, whose answer is the leader's merged answer, and whose usage and cost
    count the leader and every worker; plus every worker's outcome."""

    workers: tuple[WorkerOutcome, ...]
    """Every worker, in split order, as it stands in the store."""


def _worker_id(ctx: ToolContext, index: int) -> str:
    return child_session_id(ctx, f"worker{index}")


def _rule_name(rule: Any) -> str:
    """A merge rule as the texts name it: ``quorum(2)``, or a callable's name (``my_rule``)."""
    if isinstance(rule, _Quorum):
        return repr(rule)
    return str(getattr(rule, "__qualname__", None) or getattr(rule, "__name__", None) or type(rule).__name__)


async def _attempts(agent: Agent, session_id: str, stop: StopReason) -> int:
    failed = sum(1 for ev in await agent.store.read_events(session_id, types=("transition",))
                 if ev.payload.get("to") == StopReason.FAILED_RETRYABLE.value)
    return failed + (0 if stop is StopReason.FAILED_RETRYABLE else 1)


async def _outcome(agent: Agent, index: int, task: str, result: RunResult) -> WorkerOutcome:
    return WorkerOutcome(index, task, result.session_id, result.stop.reason, result.stop.detail, result.output,
                         result.output_data, result.usage, result.cost_usd,
                         await _attempts(agent, result.session_id, result.stop.reason))


_HEADER = re.compile(r"\A\d+ worker\(s\) ran; merged: (none|\d+(?:, \d+)*)\.")
"""The first line of a ``dispatch`` result, which names the merged workers (read back at completion)."""


def _report(outcomes: Sequence[WorkerOutcome], decision: MergeDecision, limit: int = 1500) -> str:
    """The ``dispatch`` result: a first line naming the merged workers (:data:`_HEADER`), the rule's
    detail, then each worker; the leader is asked to merge only when the rule merges."""
    merged = ", ".join(str(i) for i in decision.use) if decision.ok else ""
    detail = decision.detail.strip().rstrip(".")
    lines = [f"{len(outcomes)} worker(s) ran; merged: {merged or 'none'}." + (f" {detail}." if detail else "")
             + (" Merge the results marked MERGE into one answer to the original task." if merged else "")]
    for o in outcomes:
        mark = "MERGE" if decision.ok and o.index in decision.use else "NOT MERGED"
        head = f"[worker {o.index}] {mark} ({o.stop.value}) {o.task}"
        if o.ok:
            text = o.output.strip()
            lines.append(f"{head}\n{text[:limit]}{'...' if len(text) > limit else ''}")
        else:
            lines.append(f"{head}\nfailed: {o.detail[:300]}")
    return "\n\n".join(lines)


class _TeamControl(Middleware):
    """Forces the split as the first call (and allows one split), hides ``dispatch`` once it ran,
    fails the team when the merge rule refuses or a dispatch that ran workers failed, and verifies
    the merged answer."""

    name = "team"
    ordering = Ordering(position="innermost")

    def __init__(self, team: Team) -> None:
        self.team = team

    async def _split(self, ctx: RunContext) -> SessionLink | None:
        """The link of the first worker of the session's split, ``None`` before any worker started."""
        return next((x for x in await self.team.store.children(ctx.session_id) if x.kind == LinkKind.WORKER.value),
                    None)

    async def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Deny | None:  # type: ignore[override]
        if call.name != DISPATCH:
            return None
        first = first_of_turn(ctx, (DISPATCH,))
        if first is not None and first.id != call.id:
            return Deny(f"only one split per team: {DISPATCH} was called first in this turn ({first.id})")
        split = await self._split(ctx)
        if split is not None and split.call_id != call.id:
            return Deny(f"the task was split already (call {split.call_id}) and its workers ran: merge their results")
        return None

    async def wrap_model_call(self, request: MessageRequest, call_next: ModelCallNext,
                              ctx: RunContext) -> MessageResponse:
        if await self._split(ctx) is not None:
            request = evolve(request, tools=tuple(t for t in request.tools if t.name != DISPATCH))
        else:
            request = evolve(request, tools=tuple(t for t in request.tools if t.name == DISPATCH),
                             tool_choice="required")
        return await call_next(request)

    async def post_turn(self, ctx: RunContext) -> Complete | Continue | None:  # type: ignore[override]
        resp = ctx.last_response
        if resp is None:
            return None
        call = first_of_turn(ctx, (DISPATCH,))
        result = None if call is None else next((m for m in reversed(ctx.transcript)
                                                 if isinstance(m, ToolResultMessage) and m.tool_call_id == call.id), None)
        if result is not None and result.is_error:
            kind = (result.metadata or {}).get("error")
            if kind == "merge_rule":
                raise StopRun(StopReason.FAILED_TERMINAL.value, f"the merge rule failed the team: {result.text[:600]}",
                              error={"kind": "merge_rule", "message": result.text[:2000]})
            split = await self._split(ctx)
            if split is not None and call is not None and split.call_id == call.id:
                # its workers ran: splitting again would run them a second time
                raise StopRun(StopReason.FAILED_TERMINAL.value,
                              f"the dispatch that ran the workers failed: {result.text[:600]}",
                              error={"kind": "dispatch_failed", "message": result.text[:2000]})
        if resp.tool_calls:
            return None
        split = await self._split(ctx)
        if split is None:
            # the split is required: an answer instead of it (a forced call cut at the output limit
            # reads as text) does not complete the team; the leader's budget bounds the asking
            cut = resp.stop_reason.value == "max_tokens"
            why = "was cut at the output token limit" if cut else "was not a dispatch call"
            return Continue(UserMessage(f"Your last answer {why}. Split the task with the dispatch tool first: "
                                        "short subtasks, one per worker."), reason=f"no split yet: the answer {why}")
        outcomes = await self.team.outcomes(ctx.session_id)
        merged = _merged(ctx, split.call_id, outcomes)
        evidence = tuple(f"worker:{o.session_id}" for o in outcomes if o.index in merged)
        done = (f"merged {len(merged)} of {len(outcomes)} worker result(s) under {_rule_name(self.team.merge)}")
        if self.team.verify is None:
            return Complete(evidence, done)
        verdict = self.team.verify(resp.message.text, outcomes)
        if asyncio.iscoroutine(verdict) or isinstance(verdict, Awaitable):
            verdict = await verdict
        if verdict is None:
            return Complete(evidence, f"{done}; verified")
        state = ctx.state(self)
        if not state.get("repaired"):
            state["repaired"] = True
            return Continue(UserMessage(f"The merged answer does not pass the check: {verdict}. Answer again, "
                                        "merging the workers' results."), reason=f"verification failed: {verdict}")
        raise StopRun(StopReason.FAILED_TERMINAL.value, f"the merged answer failed verification twice: {verdict}",
                      error={"kind": "verification_failed", "message": str(verdict)[:2000]})


def _merged(ctx: RunContext, call_id: str | None, outcomes: Sequence[WorkerOutcome]) -> set[int]:
    """The workers the dispatch ``call_id`` merged, as its result's first line names them (every
    completed worker when that result is not found)."""
    result = next((m for m in ctx.transcript if isinstance(m, ToolResultMessage) and m.tool_call_id == call_id
                   and not m.is_error), None)
    found = _HEADER.match(result.text) if result is not None else None
    if found is None:
        return {o.index for o in outcomes if o.ok}
    return set() if found.group(1) == "none" else {int(x) for x in found.group(1).split(", ")}


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
        self.leader = leader.derive(tools=[self._dispatch_tool()], middleware=[_TeamControl(self)],
                                    system_prompt=prompt)
        """The leader as the team runs it: the given agent with the ``dispatch`` tool, the team's
        middleware and prompt (:meth:`Agent.derive`: draining the given agent drains the team too)."""

    def __repr__(self) -> str:
        return (f"Team(workers={len(self.workers)}, merge={_rule_name(self.merge)}, max_workers={self.max_workers}, "
                f"max_parallel={self.max_parallel}, retries={self.retries})")

    def interrupt_all(self, reason: str) -> int:
        """Interrupt every run of the team's leader in this process (:meth:`Agent.interrupt_all`):
        each team stops INTERRUPTED, its running workers cut with it, and :meth:`resume` continues
        them. Returns how many leader runs were interrupted."""
        return self.leader.interrupt_all(reason)

    @contextlib.asynccontextmanager
    async def drain_on_signals(self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
                               ) -> AsyncIterator[None]:
        """:meth:`Agent.drain_on_signals` for the team: each of ``signals`` interrupts the team's runs
        in this process (:meth:`interrupt_all`), workers included."""
        async with drain_on_signals(self.interrupt_all, signals):
            yield

    def _worker(self, index: int) -> Agent:
        return self.workers[index % len(self.workers)]

    async def _run_worker(self, ctx: ToolContext, index: int, task: str, gate: asyncio.Semaphore,
                          counted: Counted) -> WorkerOutcome:
        async with gate:
            agent = self._worker(index)
            child = _worker_id(ctx, index)
            try:
                result = await drive_child(agent, child, task, parent_id=ctx.session_id, kind=LinkKind.WORKER.value,
                                           call_id=ctx.call_id, link_metadata={"index": index, "task": task},
                                           limits=self.worker_limits, decision=ctx.decision, ctx=ctx, counted=counted)
            except SessionLinkError as e:  # its id is another session's: nothing ran, and retrying cannot help
                return WorkerOutcome(index, task, child, StopReason.FAILED_TERMINAL, str(e), "", attempts=0)
            retried = 0
            while result.stop.reason is StopReason.FAILED_RETRYABLE and retried < self.retries:
                retried += 1
                ctx.report_progress(index, None, f"worker {index} failed retryably; retry {retried}")
                result = await _resume_when_free(agent, child)
                await roll_up(ctx, agent, child, counted, result)
            return await _outcome(agent, index, task, result)

    def _dispatch_tool(self) -> Tool:
        async def dispatch(_fsm_context: ToolContext, subtasks: list[dict[str, Any]]) -> str:
            ctx = _fsm_context
            tasks = [str(s["task"]).strip() for s in subtasks]
            blank = [i for i, t in enumerate(tasks) if not t]
            if blank:
                raise ToolError(f"subtask(s) {blank} are blank; split the task again", kind="invalid_split")
            gate = asyncio.Semaphore(self.max_parallel)
            counted: Counted = {}
            # every worker runs to its stop, whatever another one does; a cancel of the call cancels them all
            ran = await asyncio.gather(*(self._run_worker(ctx, i, t, gate, counted) for i, t in enumerate(tasks)),
                                       return_exceptions=True)
            for r in ran:
                if isinstance(r, BaseException) and not isinstance(r, Exception):
                    raise r
            broken = [(i, r) for i, r in enumerate(ran) if isinstance(r, Exception)]
            if broken:
                raise SuspendCall("worker session(s) could not be driven: " + "; ".join(
                    f"worker {i} ({_worker_id(ctx, i)}): {type(e).__name__}: {e}" for i, e in broken)
                    + ". Every worker stays where it stopped; resume the team to continue them",
                    reason="workers_not_driven")
            outcomes = [r for r in ran if isinstance(r, WorkerOutcome)]
            await self._wait_or_suspend(outcomes)
            try:
                decision = self.merge(outcomes)
                problem = _misfit(decision, outcomes)
            except Exception as e:  # noqa: BLE001 - the rule's failure is the team's, typed
                decision, problem = MergeDecision(False), f"raised {type(e).__name__}: {e}"
            if problem:
                raise ToolError(f"the merge rule {_rule_name(self.merge)} {problem}\n\n"
                                + _report(outcomes, MergeDecision(False), 300), kind="merge_rule")
            if not decision.ok:
                raise ToolError(decision.detail + "\n\n" + _report(outcomes, decision, 300), kind="merge_rule")
            return _report(outcomes, decision)

        t = Tool(dispatch, name=DISPATCH, description=(
            "Split the task into independent parts, one per worker; the workers run them in parallel and their "
            "results come back here."), parameters=split_schema(self.max_workers, self.max_task_chars), timeout=None,
            effect=ToolEffect.IDEMPOTENT, resumable=True)
        compensate_by_cancelling(t, lambda arguments, ctx: [
            (self._worker(i), _worker_id(ctx, i)) for i in range(len(arguments.get("subtasks") or ()))],
            "the leader was cancelled")
        return t

    async def _wait_or_suspend(self, outcomes: Sequence[WorkerOutcome]) -> None:
        """Raise WaitForHuman when workers wait for a person, SuspendCall when workers were
        interrupted from outside (the call stays open; the leader's resume continues them)."""
        waiting = [o for o in outcomes if o.stop is StopReason.WAITING_HUMAN]
        if waiting:
            parts, stops = [], []
            for o in waiting:
                found = await stored_result(self._worker(o.index), o.session_id)
                stop = found.stop if found is not None else RunStop(StopReason.WAITING_HUMAN, o.detail)
                stops.append(stop)
                parts.append(f"worker {o.index} (session {o.session_id}): "
                             + await waiting_on(self.store, o.session_id, stop))
            allowed = forwardable(stops)
            raise WaitForHuman(f"workers wait for a person: {'; '.join(parts)}. The decision ({', '.join(allowed)}) "
                               "is passed on to each call they wait on", reason="workers_waiting",
                               allowed_decisions=allowed, run_on_reject=True)
        cut = [o for o in outcomes if o.stop is StopReason.INTERRUPTED]
        if cut:
            raise SuspendCall("worker(s) interrupted from outside: " + "; ".join(
                f"worker {o.index} (session {o.session_id}): {o.detail[:200]}" for o in cut)
                + ". Resume the team to continue them (the others keep their results)", reason="workers_interrupted")

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
                out.append(await _outcome(self._worker(index), index, str(link.metadata.get("task", "")), found))
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
        return TeamResult.from_run(result, workers=await self.outcomes(result.session_id))
