"""A leader and N workers: the forced, schema-constrained split, bounded parallel workers in linked
sessions with their own budgets, the merge rules with failing workers, retries, verification,
WAITING_HUMAN, interrupt, cancel and resume (ScriptedProvider; links on every store)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fsm_agent import Agent, Decision, Middleware, ScriptedProvider, StopReason, ToolContext, tool
from fsm_agent.control import Cancel, Interrupt
from fsm_agent.errors import ConfigurationError, ProviderError
from fsm_agent.middleware import AskApproval
from fsm_agent.orchestration.team import (
    DISPATCH,
    MergeDecision,
    Team,
    WorkerOutcome,
    all_succeed,
    best_effort,
    quorum,
)
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.store import LedgerStatus, MemoryStore
from fsm_agent.types import MessageRequest, ToolResultMessage


def split(*tasks: str) -> Any:
    return tool_call_response((DISPATCH, {"subtasks": [{"task": t} for t in tasks]}))


def task_of(request: MessageRequest) -> str:
    return next(m.text for m in request.messages if m.role == "user")


class Workers:
    """A worker provider answering by subtask: ``fail:<...>`` fails for good, ``flaky:<...>`` fails
    retryably once, ``tool:<...>`` calls the ``work`` tool first, anything else answers at once."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: dict[str, int] = {}
        self.provider = ScriptedProvider([self.answer], repeat_last=True, delay=delay)

    def answer(self, request: MessageRequest) -> Any:
        task = task_of(request)
        self.calls[task] = self.calls.get(task, 0) + 1
        if task.startswith("fail:"):
            return ProviderError("this part cannot be done", retryable=False)
        if task.startswith("flaky:") and self.calls[task] == 1:
            return ProviderError("overloaded", retryable=True)
        if task.startswith("slowflaky:"):  # a tool call (usage), then a retryable failure, then an answer
            if self.calls[task] == 1:
                return tool_call_response(("noop", {}))
            if self.calls[task] == 2:
                return ProviderError("overloaded", retryable=True)
        last = request.messages[-1]
        if task.startswith("tool:") and not isinstance(last, ToolResultMessage):
            return tool_call_response(("work", {"what": task}))
        return text_response(f"result of {task}")


async def test_split_workers_merge_in_one_leader_session_with_links_and_roll_up(store) -> None:
    leader_p = ScriptedProvider([split("a", "b", "c"), "a+b+c merged"])
    workers = Workers()
    team = Team(Agent(leader_p, system_prompt="Lead well.", store=store), Agent(workers.provider, store=store),
                max_workers=3)
    result = await team.run("do abc", session_id="L")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "a+b+c merged"
    assert result.stop.detail == "merged 3 of 3 worker result(s) under all_succeed() (decided by team)"
    assert result.stop.evidence_refs == tuple(f"worker:{w.session_id}" for w in result.workers)

    # the split is the session's first call, forced to the dispatch tool; the merge turn no longer offers it
    first, second = leader_p.requests
    assert [t.name for t in first.tools] == [DISPATCH] and first.tool_choice == "required"
    assert first.tools[0].parameters["properties"]["subtasks"]["maxItems"] == 3
    assert first.messages[0].text.startswith("You lead a team of workers.") and "Lead well." in first.messages[0].text
    assert DISPATCH not in [t.name for t in second.tools]
    report = [m.text for m in second.messages if m.role == "tool"][0]
    assert "[worker 1] MERGE (COMPLETED) b\nresult of b" in report

    links = await store.children("L")
    assert [(x.kind, x.metadata["index"], x.metadata["task"]) for x in links] == [
        ("worker", 0, "a"), ("worker", 1, "b"), ("worker", 2, "c")]
    assert len({x.call_id for x in links}) == 1
    assert [w.session_id for w in result.workers] == [x.child_id for x in links]
    assert all(w.ok and w.output == f"result of {w.task}" for w in result.workers)
    # usage: the leader's 2 calls and the workers' 3, in the leader's session
    assert result.usage.input_tokens == 50
    assert sum(w.usage.input_tokens for w in result.workers) == 30


async def test_parallelism_is_bounded() -> None:
    store = MemoryStore()
    running, peak = [0], [0]

    @tool
    async def work(what: str) -> str:
        """Work."""
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1
        return what

    workers = Workers()
    team = Team(Agent(ScriptedProvider([split(*(f"tool:{i}" for i in range(5))), "merged"]), store=store),
                Agent(workers.provider, tools=[work], store=store), max_workers=5, max_parallel=2)
    result = await team.run("go")
    assert result.stop.reason is StopReason.COMPLETED and len(result.workers) == 5
    assert peak[0] == 2


async def test_a_split_that_breaks_the_schema_is_asked_again() -> None:
    store = MemoryStore()
    leader_p = ScriptedProvider([tool_call_response((DISPATCH, {"subtasks": []})), split("x", "y", "z", "w"),
                                 split("x"), "merged x"])
    team = Team(Agent(leader_p, store=store), Agent(Workers().provider, store=store), max_workers=3)
    result = await team.run("go", session_id="L")
    assert result.stop.reason is StopReason.COMPLETED and [w.task for w in result.workers] == ["x"]
    errors = [m for m in result.result.messages if m.role == "tool" and m.is_error]
    assert [e.metadata["error"] for e in errors] == ["invalid_arguments", "invalid_arguments"]
    assert "should be non-empty" in errors[0].text and "is too long" in errors[1].text
    assert all(r.tool_choice == "required" for r in leader_p.requests[:3])


@pytest.mark.parametrize(("rule", "stop", "merged"), [
    (all_succeed(), StopReason.FAILED_TERMINAL, None),
    (quorum(2), StopReason.COMPLETED, [0, 2]),
    (quorum(3), StopReason.FAILED_TERMINAL, None),
    (best_effort(), StopReason.COMPLETED, [0, 2]),
])
async def test_merge_rules_with_a_failing_worker(store, rule: Any, stop: StopReason, merged: list[int] | None) -> None:
    leader_p = ScriptedProvider([split("a", "fail:b", "c"), "merged what we have"])
    team = Team(Agent(leader_p, store=store), Agent(Workers().provider, store=store), merge=rule, max_workers=3)
    result = await team.run("go", session_id="L")
    assert result.stop.reason is stop
    assert [w.stop for w in result.workers] == [StopReason.COMPLETED, StopReason.FAILED_TERMINAL,
                                                 StopReason.COMPLETED]
    if merged is None:
        assert result.stop.error["kind"] == "merge_rule"
        assert f"{rule!r} not met: 2 of 3 workers completed; failed: worker 1 FAILED_TERMINAL" in result.stop.detail
        assert len(leader_p.requests) == 1  # the team stopped at the merge rule: no merge turn
    else:
        report = [m.text for m in leader_p.requests[1].messages if m.role == "tool"][0]
        assert report.startswith("3 worker(s) ran; merged: 0, 2.")
        assert "[worker 1] NOT MERGED (FAILED_TERMINAL) fail:b\nfailed:" in report
        assert "[worker 0] MERGE" in report and "[worker 2] MERGE" in report
        # the stop counts what was merged, and its evidence is the merged workers only
        assert result.stop.detail.startswith(f"merged 2 of 3 worker result(s) under {rule!r}")
        assert result.stop.evidence_refs == tuple(f"worker:{result.workers[i].session_id}" for i in merged)


async def test_a_custom_merge_rule_sees_every_outcome() -> None:
    store = MemoryStore()
    seen: list[list[WorkerOutcome]] = []

    def only_first(outcomes: Any) -> MergeDecision:
        seen.append(list(outcomes))
        return MergeDecision(True, (0,), "only the first counts")

    team = Team(Agent(ScriptedProvider([split("a", "fail:b"), "a alone"]), store=store),
                Agent(Workers().provider, store=store), merge=only_first)
    result = await team.run("go")
    assert result.stop.reason is StopReason.COMPLETED
    assert [(o.index, o.stop) for o in seen[0]] == [(0, StopReason.COMPLETED), (1, StopReason.FAILED_TERMINAL)]
    assert len(seen) == 1  # asked once
    assert "under test_a_custom_merge_rule_sees_every_outcome.<locals>.only_first" in result.stop.detail
    assert "<function" not in result.stop.detail and "<function" not in repr(team)


@pytest.mark.parametrize("task", ["flaky:a", "slowflaky:a"])
async def test_a_retryable_failure_resumes_the_same_worker_session(task: str) -> None:
    store = MemoryStore()
    workers = Workers()
    team = Team(Agent(ScriptedProvider([split(task), "merged"]), store=store),
                Agent(workers.provider, tools=[tool(lambda: "ok", name="noop")], store=store), retries=1)
    result = await team.run("go", session_id="L")
    assert result.stop.reason is StopReason.COMPLETED
    (w,) = result.workers
    assert w.ok and w.output == f"result of {task}" and workers.calls[task] == (2 if task == "flaky:a" else 3)
    assert w.attempts == 2  # 1 + the retry used (was always 1)
    assert len(await store.children("L")) == 1
    assert [e.type for e in await store.read_events(w.session_id, types=("resume",))] == ["resume"]
    # the worker's usage over both attempts is rolled up once: the leader's 2 calls plus the worker's
    worker_usage = w.usage.input_tokens
    assert worker_usage > 0 and result.usage.input_tokens == 20 + worker_usage
    rolled = await store.read_events("L", types=("usage_rolled_up",))
    assert sum(e.payload["usage"]["input_tokens"] for e in rolled) == worker_usage


async def test_without_retries_a_retryable_failure_is_a_failed_outcome() -> None:
    store = MemoryStore()
    team = Team(Agent(ScriptedProvider([split("flaky:a")]), store=store), Agent(Workers().provider, store=store),
                retries=0)
    result = await team.run("go")
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.error["kind"] == "merge_rule"
    assert result.workers[0].stop is StopReason.FAILED_RETRYABLE and result.workers[0].attempts == 1


@pytest.mark.parametrize("passes_on", [1, 2, None])
async def test_the_merged_answer_is_verified(passes_on: int | None) -> None:
    store = MemoryStore()
    checks: list[str] = []

    def verify(answer: str, outcomes: Any) -> str | None:
        checks.append(answer)
        if passes_on is not None and len(checks) >= passes_on:
            return None
        return "it must mention every worker"

    leader_p = ScriptedProvider([split("a", "b"), "a only", "a and b"])
    team = Team(Agent(leader_p, store=store), Agent(Workers().provider, store=store), verify=verify)
    result = await team.run("go")
    if passes_on is None:
        assert result.stop.reason is StopReason.FAILED_TERMINAL
        assert result.stop.error["kind"] == "verification_failed" and checks == ["a only", "a and b"]
    else:
        assert result.stop.reason is StopReason.COMPLETED and result.stop.detail.endswith("verified (decided by team)")
        assert result.output == ["a only", "a and b"][passes_on - 1]
    if passes_on != 1:
        feedback = leader_p.requests[2].messages[-1]
        assert feedback.role == "user" and "does not pass the check: it must mention every worker" in feedback.text


class AskForWork(Middleware):
    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        return AskApproval("work needs a person") if call.name == "work" else None


async def test_a_worker_waiting_for_a_person_makes_the_leader_wait(store) -> None:
    done: list[str] = []

    @tool(effect="side_effect")
    def work(what: str) -> str:
        """Work."""
        done.append(what)
        return what

    workers = Workers()
    team = Team(Agent(ScriptedProvider([split("a", "tool:b"), "merged"]), store=store),
                Agent(workers.provider, tools=[work], middleware=[AskForWork()], store=store))
    first = await team.run("go", session_id="L")
    assert first.stop.reason is StopReason.WAITING_HUMAN
    (pending,) = first.stop.pending_actions
    assert (pending.call.name, pending.reason) == (DISPATCH, "workers_waiting")
    assert 'work({"what":"tool:b"}) [work needs a person]' in first.stop.detail
    assert [w.stop for w in first.workers] == [StopReason.COMPLETED, StopReason.WAITING_HUMAN] and done == []
    result = await team.resume("L", decisions={pending.call.id: Decision.approve()})
    assert result.stop.reason is StopReason.COMPLETED and done == ["tool:b"]
    assert workers.calls == {"a": 1, "tool:b": 2}  # worker a was not run again


async def test_an_interrupt_of_the_leader_cuts_the_workers_and_the_resume_finishes_them(store) -> None:
    effects: list[str] = []
    entered, release = asyncio.Event(), asyncio.Event()

    @tool(effect="side_effect")
    async def work(what: str) -> str:
        """Work."""
        if what == "tool:slow":
            entered.set()
            await release.wait()
        effects.append(what)
        return what

    workers = Workers()
    leader_p = ScriptedProvider([split("tool:quick", "tool:slow"), "merged"])
    leader = Agent(leader_p, store=store, control_poll=0.02)
    team = Team(leader, Agent(workers.provider, tools=[work], store=store, control_poll=0.02))
    run = asyncio.ensure_future(team.run("go", session_id="L"))
    await asyncio.wait_for(entered.wait(), 10)
    while effects != ["tool:quick"] or not any(w.stop is StopReason.COMPLETED for w in await team.outcomes("L")):
        await asyncio.sleep(0.02)
    await leader.control("L", Interrupt("pause the team"))
    stopped = await run
    assert stopped.stop.reason is StopReason.INTERRUPTED and "dispatch left open" in stopped.stop.detail
    assert [w.stop for w in stopped.workers] == [StopReason.COMPLETED, StopReason.INTERRUPTED]
    release.set()
    result = await team.resume("L")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "merged"
    assert effects == ["tool:quick"]  # the quick worker is not run again; the cut call is outcome-unknown
    assert workers.calls == {"tool:quick": 2, "tool:slow": 2} and len(leader_p.requests) == 2
    assert len(await store.children("L")) == 2


async def test_a_cancel_of_the_leader_cancels_every_running_worker() -> None:
    store = MemoryStore()
    entered: list[str] = []

    @tool
    async def work(what: str) -> str:
        """Work."""
        entered.append(what)
        await asyncio.sleep(30)
        return what

    leader = Agent(ScriptedProvider([split("tool:a", "tool:b")]), store=store, control_poll=0.02)
    team = Team(leader, Agent(Workers().provider, tools=[work], store=store, control_poll=0.02))
    run = asyncio.ensure_future(team.run("go", session_id="L"))
    while len(entered) < 2:
        await asyncio.sleep(0.02)
    await leader.control("L", Cancel("stop everything"))
    result = await run
    assert result.stop.reason is StopReason.CANCELLED
    assert [w.stop for w in result.workers] == [StopReason.CANCELLED, StopReason.CANCELLED]
    (entry,) = (await store.ledger("L")).values()
    assert entry.status is LedgerStatus.REJECTED


def test_bad_team_configurations_are_refused() -> None:
    leader = Agent(ScriptedProvider([]))
    with pytest.raises(ConfigurationError, match="share the leader's store"):
        Team(leader, Agent(ScriptedProvider([])))
    with pytest.raises(ConfigurationError, match="at least one worker"):
        Team(leader, [])
    with pytest.raises(ConfigurationError, match="quorum"):
        quorum(0)
    with pytest.raises(ConfigurationError, match="max_parallel"):
        Team(leader, Agent(ScriptedProvider([]), store=leader.store), max_parallel=0)
    assert repr(quorum(2)) == "quorum(2)" and repr(all_succeed()) == "all_succeed()"


async def test_an_answer_before_the_split_does_not_complete_the_team() -> None:
    store = MemoryStore()
    leader_p = ScriptedProvider(["I will just answer", split("a"), "merged a"])
    team = Team(Agent(leader_p, store=store), Agent(Workers().provider, store=store))
    result = await team.run("go")
    assert result.stop.reason is StopReason.COMPLETED and [w.task for w in result.workers] == ["a"]
    nudge = leader_p.requests[1].messages[-1]
    assert nudge.role == "user" and "was not a dispatch call. Split the task with the dispatch tool" in nudge.text

    stubborn = Team(Agent(ScriptedProvider(["no"], repeat_last=True), store=store), Agent(Workers().provider, store=store))
    paused = await stubborn.run("go", max_iterations=2)
    assert paused.stop.reason is StopReason.PAUSED_BUDGET and paused.workers == ()


class SideEffects:
    """A worker provider whose every subtask makes one side-effect call, counted."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.provider = ScriptedProvider([self.answer], repeat_last=True)

        @tool(effect="side_effect")
        def send(to: str) -> str:
            """Send."""
            self.done.append(to)
            return f"sent to {to}"

        self.tool = send

    def answer(self, request: MessageRequest) -> Any:
        if not isinstance(request.messages[-1], ToolResultMessage):
            return tool_call_response(("send", {"to": task_of(request)}))
        return text_response(f"{task_of(request)} done")


async def test_two_dispatch_calls_in_one_turn_run_the_workers_once(store) -> None:
    """Review finding 1: both calls ran, each with its own set of workers: every effect twice."""
    effects = SideEffects()
    twice = tool_call_response((DISPATCH, {"subtasks": [{"task": "ann"}, {"task": "bob"}]}),
                               (DISPATCH, {"subtasks": [{"task": "ann"}, {"task": "bob"}]}))
    team = Team(Agent(ScriptedProvider([twice, "merged"]), store=store),
                Agent(effects.provider, tools=[effects.tool], store=store))
    result = await team.run("mail ann and bob", session_id="L")
    assert result.stop.reason is StopReason.COMPLETED
    assert sorted(effects.done) == ["ann", "bob"] and len(await store.children("L")) == 2
    second = [m for m in result.result.messages if m.role == "tool"][1]
    assert second.is_error and "only one split per team" in second.text and second.metadata["denied_by"] == "team"


async def test_a_merge_rule_that_raises_ends_the_team_and_never_splits_again() -> None:
    """Review finding 2: the error result made the leader split again: new workers, every effect twice."""
    store = MemoryStore()
    effects = SideEffects()
    asked: list[int] = []

    def broken(outcomes: Any) -> MergeDecision:
        asked.append(len(outcomes))
        raise KeyError("oops in my merge rule")

    leader_p = ScriptedProvider([split("ann", "bob")], repeat_last=True)
    team = Team(Agent(leader_p, store=store), Agent(effects.provider, tools=[effects.tool], store=store), merge=broken)
    result = await team.run("go", session_id="L")
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.error["kind"] == "merge_rule"
    assert "the merge rule test_a_merge_rule_that_raises_ends_the_team_and_never_splits_again.<locals>.broken raised "\
        "KeyError: 'oops in my merge rule'" in result.stop.detail
    assert sorted(effects.done) == ["ann", "bob"] and asked == [2]
    assert len(await store.children("L")) == 2 and len(leader_p.requests) == 1


@pytest.mark.parametrize(("decision", "says"), [
    (MergeDecision(True, (1,), "take b"), "named worker(s) [1] to merge, which did not complete"),
    (MergeDecision(True, (5,), "take f"), "named worker(s) [5] to merge"),
    (MergeDecision(True, (), "take none"), "named no worker to merge"),
])
async def test_a_merge_decision_naming_a_worker_it_cannot_merge_fails_the_team(decision: MergeDecision,
                                                                             says: str) -> None:
    store = MemoryStore()
    team = Team(Agent(ScriptedProvider([split("a", "fail:b"), "merged"]), store=store),
                Agent(Workers().provider, store=store), merge=lambda outcomes: decision)
    result = await team.run("go", session_id="L")
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.error["kind"] == "merge_rule"
    assert says in result.stop.detail


async def test_a_dispatch_that_ran_workers_and_failed_otherwise_is_never_split_again() -> None:
    """Any error result of the dispatch call that started workers (here: a middleware around the
    tool turns its result into an error) ends the team typed instead of a second split."""
    store = MemoryStore()
    effects = SideEffects()

    class Breaks(Middleware):
        async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
            result = await call_next(call)
            if call.name == DISPATCH:
                from attrs import evolve
                return evolve(result, is_error=True, metadata={"error": "exception"})
            return result

    leader_p = ScriptedProvider([split("ann", "bob")], repeat_last=True)
    team = Team(Agent(leader_p, middleware=[Breaks()], store=store),
                Agent(effects.provider, tools=[effects.tool], store=store))
    result = await team.run("go", session_id="L")
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.error["kind"] == "dispatch_failed"
    assert sorted(effects.done) == ["ann", "bob"] and len(leader_p.requests) == 1


async def test_a_worker_that_cannot_be_driven_leaves_the_dispatch_open(store) -> None:
    """Review finding 2 (a worker raising through the dispatch): its siblings finish, the leader stops
    INTERRUPTED with the call open, and the resume continues the workers: nothing runs twice."""
    from fsm_agent.errors import SessionBusyError

    effects = SideEffects()
    worker = Agent(effects.provider, tools=[effects.tool], store=store)
    real_run = worker.run
    failures = [SessionBusyError("worker session held elsewhere")]

    async def flaky_run(task: Any, **kw: Any) -> Any:
        if task == "bob" and failures:
            raise failures.pop()
        return await real_run(task, **kw)

    worker.run = flaky_run  # type: ignore[method-assign]
    leader_p = ScriptedProvider([split("ann", "bob"), "merged"])
    team = Team(Agent(leader_p, store=store), worker)
    first = await team.run("go", session_id="L")
    assert first.stop.reason is StopReason.INTERRUPTED and first.stop.resumable
    (pending,) = first.stop.pending_actions
    assert (pending.call.name, pending.reason) == (DISPATCH, "workers_not_driven")
    assert "SessionBusyError: worker session held elsewhere" in first.stop.detail
    assert effects.done == ["ann"]
    done = await team.resume("L")
    assert done.stop.reason is StopReason.COMPLETED and done.output == "merged"
    assert sorted(effects.done) == ["ann", "bob"] and len(await store.children("L")) == 2
    assert len(leader_p.requests) == 2


async def test_a_worker_interrupted_from_outside_leaves_the_dispatch_open() -> None:
    store = MemoryStore()
    holder: list[Agent] = []
    stopped_once: list[str] = []

    @tool(effect="idempotent")
    async def work(what: str, ctx: ToolContext) -> str:
        """Work."""
        if what == "tool:b" and not stopped_once:
            stopped_once.append(ctx.session_id)
            await holder[0].control(ctx.session_id, Interrupt("ops pause"))
            await asyncio.sleep(5)
        return what

    workers = Workers()
    worker = Agent(workers.provider, tools=[work], store=store, control_poll=0.02)
    holder.append(worker)
    leader_p = ScriptedProvider([split("a", "tool:b"), "merged"])
    team = Team(Agent(leader_p, store=store), worker)
    first = await team.run("go", session_id="L")
    assert first.stop.reason is StopReason.INTERRUPTED
    assert [p.reason for p in first.stop.pending_actions] == ["workers_interrupted"]
    assert [w.stop for w in first.workers] == [StopReason.COMPLETED, StopReason.INTERRUPTED]
    done = await team.resume("L")
    assert done.stop.reason is StopReason.COMPLETED and [w.stop for w in done.workers] == [StopReason.COMPLETED] * 2
    assert workers.calls["a"] == 1 and len(leader_p.requests) == 2


@pytest.mark.parametrize("how", ["the given leader", "the team"])
async def test_draining_the_leader_given_to_the_team_interrupts_the_team(how: str) -> None:
    """Review finding 7: the team ran a copy of the leader, which the given leader's
    drain_on_signals / interrupt_all did not reach (the workers were then drained alone: FAILED_TERMINAL)."""
    store = MemoryStore()
    entered: list[str] = []

    @tool(effect="idempotent")
    async def work(what: str) -> str:
        """Work."""
        entered.append(what)
        await asyncio.sleep(5)
        return what

    leader = Agent(ScriptedProvider([split("tool:a", "tool:b"), "merged"]), store=store)
    team = Team(leader, Agent(Workers().provider, tools=[work], store=store))
    run = asyncio.ensure_future(team.run("go", session_id="L"))
    while len(entered) < 2:
        await asyncio.sleep(0.02)
    assert (leader.interrupt_all("drained") if how == "the given leader" else team.interrupt_all("drained")) == 1
    stopped = await asyncio.wait_for(run, 10)
    assert stopped.stop.reason is StopReason.INTERRUPTED and "drained" in stopped.stop.detail
    assert [w.stop for w in stopped.workers] == [StopReason.INTERRUPTED] * 2
    done = await team.resume("L")
    assert done.stop.reason is StopReason.COMPLETED and len(await store.children("L")) == 2


async def test_team_drain_on_signals_interrupts_the_team_on_sigterm() -> None:
    import os
    import signal

    store = MemoryStore()
    entered = asyncio.Event()

    @tool(effect="idempotent")
    async def work(what: str) -> str:
        """Work."""
        entered.set()
        await asyncio.sleep(5)
        return what

    team = Team(Agent(ScriptedProvider([split("tool:a"), "merged"]), store=store),
                Agent(Workers().provider, tools=[work], store=store))

    async def kill() -> None:
        await entered.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    killer = asyncio.ensure_future(kill())
    async with team.drain_on_signals():
        result = await asyncio.wait_for(team.run("go", session_id="L"), 10)
    await killer
    assert result.stop.reason is StopReason.INTERRUPTED and "received SIGTERM" in result.stop.detail
