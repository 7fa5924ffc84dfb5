"""Three tool-level promises the orchestration patterns rest on, proven on the machine itself:

* a ``resumable`` tool cut in flight by an Interrupt keeps its call open, and the resumed run runs
  it again with the same idempotency key (the calls of its batch that finished are not run again);
* a tool that raises :class:`WaitForHuman` stops the run WAITING_HUMAN with its call pending; the
  person's decision reaches the re-run through ``ToolContext.decision``;
* on Cancel, ``on_compensate`` runs for any tool that has one, and a hook returning ``False``
  leaves the call as it was.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fsm_agent import Agent, Decision, ScriptedProvider, StopReason, ToolContext, tool
from fsm_agent.control import Cancel, Interrupt
from fsm_agent.errors import SuspendCall, WaitForHuman
from fsm_agent.providers import tool_call_response
from fsm_agent.store import LedgerStatus, MemoryStore


def store_ledger(store: MemoryStore) -> list[Any]:
    return [e for entries in store._ledger.values() for e in entries.values()]


def _agent(script: list[Any], tools: list[Any], store: MemoryStore) -> Agent:
    return Agent(ScriptedProvider(script), tools=tools, store=store, control_poll=0.02)


async def _wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_an_interrupted_resumable_call_runs_again_with_the_same_key_on_resume() -> None:
    keys: list[str] = []
    quick_runs: list[str] = []
    gate = asyncio.Event()

    @tool(effect="idempotent", resumable=True)
    async def long_job(name: str, ctx: ToolContext) -> str:
        """A job that continues where it stopped."""
        keys.append(ctx.idempotency_key)
        if len(keys) == 1:
            await gate.wait()  # the first attempt is cut here
        return f"{name} done"

    @tool
    def quick(x: int) -> int:
        """Quick."""
        quick_runs.append(str(x))
        return x + 1

    store = MemoryStore()
    agent = _agent([tool_call_response(("long_job", {"name": "j"}), ("quick", {"x": 1})), "all done"],
                   [long_job, quick], store)
    run = asyncio.ensure_future(agent.run("go", session_id="s"))
    await _wait_for(lambda: len(keys) == 1 and quick_runs)
    await asyncio.sleep(0.05)  # quick's result is recorded
    await agent.control("s", Interrupt("stop for now"))
    stopped = await run
    assert stopped.stop.reason is StopReason.INTERRUPTED
    assert "long_job left open, to continue on resume" in stopped.stop.detail
    assert [p.call.name for p in stopped.stop.pending_actions] == ["long_job"]  # quick has its result
    ledger = await store.ledger("s")
    assert {e.tool: e.status for e in ledger.values()} == {"long_job": LedgerStatus.STARTED,
                                                            "quick": LedgerStatus.COMPLETED}
    assert not any(m.role == "tool" for m in stopped.messages)  # nothing closed "outcome unknown"

    done = await agent.resume("s")
    assert done.stop.reason is StopReason.COMPLETED and done.output == "all done"
    assert len(keys) == 2 and keys[0] == keys[1]  # the same call, the same idempotency key
    assert quick_runs == ["1"]  # the finished call of the batch is not run again
    assert [m.text for m in done.messages if m.role == "tool"] == ["j done", "2"]


async def test_an_interrupt_leaves_open_only_the_resumable_calls_of_a_mixed_batch() -> None:
    """Review finding 4: one non-resumable call in the batch made the interrupt close every call,
    a resumable one too (its work was then started again under a new call)."""
    gate = asyncio.Event()
    runs: list[str] = []
    keys: list[str] = []

    @tool(effect="idempotent", resumable=True)
    async def resumable_job(ctx: ToolContext) -> str:
        """Resumable."""
        runs.append("r")
        keys.append(ctx.idempotency_key)
        await gate.wait()
        return "r done"

    @tool(effect="idempotent")
    async def plain_job() -> str:
        """Not resumable."""
        runs.append("p")
        await gate.wait()
        return "p done"

    store = MemoryStore()
    agent = _agent([tool_call_response(("resumable_job", {}), ("plain_job", {})), "ok"],
                   [resumable_job, plain_job], store)
    run = asyncio.ensure_future(agent.run("go", session_id="s"))
    await _wait_for(lambda: len(runs) == 2)
    await agent.control("s", Interrupt())
    stopped = await run
    assert stopped.stop.reason is StopReason.INTERRUPTED
    assert "resumable_job left open, to continue on resume; plain_job closed, outcome unknown" in stopped.stop.detail
    assert [p.call.name for p in stopped.stop.pending_actions] == ["resumable_job"]
    assert {e.tool: e.status for e in (await store.ledger("s")).values()} == {
        "resumable_job": LedgerStatus.STARTED, "plain_job": LedgerStatus.INTERRUPTED}

    gate.set()
    done = await agent.resume("s")
    assert done.stop.reason is StopReason.COMPLETED
    assert runs == ["r", "p", "r"] and keys[0] == keys[1]  # only the resumable call ran again, with its key
    results = {m.name: m for m in done.messages if m.role == "tool"}
    assert results["resumable_job"].text == "r done"
    assert results["plain_job"].is_error and "outcome is unknown" in results["plain_job"].text


async def test_a_tool_waiting_for_a_person_stops_the_run_and_gets_the_decision_on_resume() -> None:
    seen: list[Decision | None] = []
    others: list[int] = []

    @tool(effect="idempotent")
    async def ask_boss(question: str, ctx: ToolContext) -> str:
        """Needs a person."""
        seen.append(ctx.decision)
        if ctx.decision is None:
            raise WaitForHuman(f"the boss must answer {question!r}", reason="boss_needed")
        return f"boss says yes to {question}"

    @tool
    def count(n: int) -> int:
        """Count."""
        others.append(n)
        return n

    store = MemoryStore()
    agent = _agent([tool_call_response(("ask_boss", {"question": "raise?"}), ("count", {"n": 7})), "finished"],
                   [ask_boss, count], store)
    first = await agent.run("go", session_id="s")
    assert first.stop.reason is StopReason.WAITING_HUMAN
    (pending,) = first.stop.pending_actions
    assert (pending.call.name, pending.reason, pending.allowed_decisions) == (
        "ask_boss", "boss_needed", ("approve", "reject", "respond"))
    assert "the boss must answer 'raise?'" in first.stop.detail and first.stop.required_decision
    assert (await store.ledger("s"))[pending.call.id].status is LedgerStatus.STARTED

    again = await agent.resume("s")  # no decision: the call runs again and waits again
    assert again.stop.reason is StopReason.WAITING_HUMAN and seen == [None, None]

    done = await agent.resume("s", decisions={pending.call.id: Decision.approve()})
    assert done.stop.reason is StopReason.COMPLETED
    assert seen[-1] == Decision.approve()
    assert others == [7]  # the other call of the batch ran once
    assert [m.text for m in done.messages if m.role == "tool"] == ["boss says yes to raise?", "7"]


@pytest.mark.parametrize("decision", [Decision.approve(), Decision.respond("use the blue one"),
                                      Decision.reject("not today")])
async def test_every_kind_of_decision_but_reject_reaches_the_waiting_tool(decision: Decision) -> None:
    """A reject closes the waiting call without running the tool again (a tool that only asked
    "may I?" and ignores the decision would otherwise do it anyway: review nit)."""
    seen: list[Decision | None] = []

    @tool(effect="idempotent")
    async def ask(ctx: ToolContext) -> str:
        """Needs a person."""
        seen.append(ctx.decision)
        if ctx.decision is None:
            raise WaitForHuman("a person must decide")
        return f"the person said {ctx.decision.kind}: {ctx.decision.message}"

    store = MemoryStore()
    agent = _agent([tool_call_response(("ask", {})), "gave up"], [ask], store)
    first = await agent.run("go", session_id="s")
    call_id = first.stop.pending_actions[0].call.id
    done = await agent.resume("s", decisions={call_id: decision})
    assert done.stop.reason is StopReason.COMPLETED
    (result,) = [m for m in done.messages if m.role == "tool"]
    if decision.kind == "reject":
        assert seen == [None]  # not run again
        assert result.is_error and result.text == "A person rejected this tool call: not today"
        assert (await store.ledger("s"))[call_id].status is LedgerStatus.REJECTED
    else:
        assert seen == [None, decision]
        assert result.text == f"the person said {decision.kind}: {decision.message}"
    assert "waiting_calls" not in (await store.latest_checkpoint("s")).data["metadata"]


async def test_a_reject_reaches_a_waiting_tool_that_opts_in() -> None:
    seen: list[Decision | None] = []

    @tool(effect="idempotent")
    async def ask(ctx: ToolContext) -> str:
        """Passes the person's answer on."""
        seen.append(ctx.decision)
        if ctx.decision is None:
            raise WaitForHuman("a person must decide", run_on_reject=True)
        return f"passed on: {ctx.decision.kind}"

    store = MemoryStore()
    agent = _agent([tool_call_response(("ask", {})), "ok"], [ask], store)
    first = await agent.run("go", session_id="s")
    call_id = first.stop.pending_actions[0].call.id
    done = await agent.resume("s", decisions={call_id: Decision.reject("no")})
    assert seen == [None, Decision.reject("no")]
    assert [m.text for m in done.messages if m.role == "tool"] == ["passed on: reject"]


async def test_a_suspended_call_stops_the_run_interrupted_and_runs_again_on_resume() -> None:
    runs: list[str] = []
    others: list[int] = []

    @tool(effect="idempotent")
    async def remote(ctx: ToolContext) -> str:
        """Cannot finish before something else happened."""
        runs.append(ctx.idempotency_key)
        if len(runs) == 1:
            raise SuspendCall("the remote side stopped; resume to continue it", reason="remote_paused")
        return "finished"

    @tool
    def count(n: int) -> int:
        """Count."""
        others.append(n)
        return n

    store = MemoryStore()
    agent = _agent([tool_call_response(("remote", {}), ("count", {"n": 3})), "done"], [remote, count], store)
    first = await agent.run("go", session_id="s")
    assert first.stop.reason is StopReason.INTERRUPTED and first.stop.resumable
    (pending,) = first.stop.pending_actions
    assert (pending.call.name, pending.reason) == ("remote", "remote_paused")
    assert "the remote side stopped; resume to continue it (left open, to run again on resume)" in first.stop.detail
    assert {e.tool: e.status for e in (await store.ledger("s")).values()} == {
        "remote": LedgerStatus.STARTED, "count": LedgerStatus.COMPLETED}

    done = await agent.resume("s")
    assert done.stop.reason is StopReason.COMPLETED
    assert len(runs) == 2 and runs[0] == runs[1] and others == [3]
    assert [m.text for m in done.messages if m.role == "tool"] == ["finished", "3"]


@pytest.mark.parametrize("hook_result", [None, False])
async def test_cancel_runs_the_compensation_hook_of_any_tool(hook_result: Any) -> None:
    compensated: list[str] = []

    @tool(effect="idempotent")
    def book(what: str) -> str:
        """Book."""
        return f"booked {what}"

    @book.on_compensate
    def _undo(arguments: dict[str, Any], result: Any, ctx: ToolContext) -> Any:
        compensated.append(arguments["what"])
        return hook_result

    store = MemoryStore()
    gate = asyncio.Event()

    waiting = asyncio.Event()

    @tool
    async def wait() -> str:
        """Wait."""
        waiting.set()
        await gate.wait()
        return "x"

    agent = _agent([tool_call_response(("book", {"what": "room"})), tool_call_response(("wait", {})), "no"],
                   [book, wait], store)
    run = asyncio.ensure_future(agent.run("go", session_id="s"))
    await asyncio.wait_for(waiting.wait(), 5)
    await agent.control("s", Cancel())
    result = await run
    assert result.stop.reason is StopReason.CANCELLED and compensated == ["room"]
    status = next(e.status for e in (await store.ledger("s")).values() if e.tool == "book")
    assert status is (LedgerStatus.COMPLETED if hook_result is False else LedgerStatus.REJECTED)


async def test_a_side_effect_hook_that_undoes_nothing_asks_for_confirmation() -> None:
    @tool(effect="side_effect")
    def send(to: str) -> str:
        """Send."""
        return "sent"

    send.on_compensate(lambda arguments, result, ctx: False)
    gate = asyncio.Event()

    waiting = asyncio.Event()

    @tool
    async def wait() -> str:
        """Wait."""
        waiting.set()
        await gate.wait()
        return "x"

    store = MemoryStore()
    agent = _agent([tool_call_response(("send", {"to": "ann"})), tool_call_response(("wait", {})), "no"],
                   [send, wait], store)
    run = asyncio.ensure_future(agent.run("go", session_id="s"))
    await asyncio.wait_for(waiting.wait(), 5)
    await agent.control("s", Cancel())
    result = await run
    assert result.stop.reason is StopReason.WAITING_HUMAN and result.stop.required_decision == "confirm_cancel"


async def test_a_call_left_open_by_an_interrupt_is_closed_and_compensated_by_a_later_cancel() -> None:
    gate = asyncio.Event()
    compensated: list[Any] = []

    @tool(effect="idempotent", resumable=True)
    async def job(ctx: ToolContext) -> str:
        """Job."""
        await gate.wait()
        return "done"

    job.on_compensate(lambda arguments, result, ctx: compensated.append(result))
    store = MemoryStore()
    agent = _agent([tool_call_response(("job", {})), "never"], [job], store)
    run = asyncio.ensure_future(agent.run("go", session_id="s"))
    await _wait_for(lambda: any(e.status is LedgerStatus.STARTED for e in store_ledger(store)))
    await agent.control("s", Interrupt())
    assert (await run).stop.reason is StopReason.INTERRUPTED
    await agent.control("s", Cancel("never mind"))
    result = await agent.resume("s")
    assert result.stop.reason is StopReason.CANCELLED
    (entry,) = (await store.ledger("s")).values()
    assert entry.status is LedgerStatus.REJECTED  # compensated
    assert compensated and "outcome is unknown" in compensated[0]["content"][0]["text"]


async def test_a_compensation_hook_may_ask_for_the_confirmation_of_the_cancel() -> None:
    """A hook that cannot undo its call before a person confirms (a sub-agent whose own cancel waits
    for one) raises WaitForHuman: the run stops WAITING_HUMAN confirm_cancel naming it, and the
    person's confirmation reaches the hook (``ctx.decision`` approve)."""
    seen: list[Decision | None] = []
    gate = asyncio.Event()
    waiting = asyncio.Event()

    @tool(effect="idempotent")
    def delegate(what: str) -> str:
        """Delegate."""
        return f"delegated {what}"

    @delegate.on_compensate
    def _undo(arguments: dict[str, Any], result: Any, ctx: ToolContext) -> bool:
        seen.append(ctx.decision)
        if ctx.decision is None:
            raise WaitForHuman("the helper's cancel waits for a person: send(bob) cannot be undone")
        return True

    @tool
    async def wait() -> str:
        """Wait."""
        waiting.set()
        await gate.wait()
        return "x"

    store = MemoryStore()
    agent = _agent([tool_call_response(("delegate", {"what": "mail"})), tool_call_response(("wait", {})), "no"],
                   [delegate, wait], store)
    run = asyncio.ensure_future(agent.run("go", session_id="s"))
    await asyncio.wait_for(waiting.wait(), 5)
    await agent.control("s", Cancel("stop"))
    first = await run
    assert first.stop.reason is StopReason.WAITING_HUMAN and first.stop.required_decision == "confirm_cancel"
    assert "delegate(" in first.stop.detail and "send(bob) cannot be undone" in first.stop.detail
    done = await agent.resume("s", confirm_cancel=True)
    assert done.stop.reason is StopReason.CANCELLED
    assert seen == [None, Decision.approve()]
    entry = next(e for e in (await store.ledger("s")).values() if e.tool == "delegate")
    assert entry.status is LedgerStatus.REJECTED
