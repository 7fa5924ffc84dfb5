"""An agent called as a tool: its own linked session, its own budget, usage and cost rolled up, each
stop reason mapped to a typed tool result, and nothing done twice when the parent is interrupted,
cancelled or resumed (ScriptedProvider; the links on every store)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fsm_agent import Agent, Decision, Middleware, ScriptedProvider, StopReason, ToolContext, tool
from fsm_agent.control import Cancel, Interrupt
from fsm_agent.errors import ConfigurationError, ProviderError, ResumeError, SessionLinkError
from fsm_agent.middleware import AskApproval
from fsm_agent.orchestration.links import link_child
from fsm_agent.orchestration.subagent import agent_tool
from fsm_agent.pricing import PRICES, Price, register_price
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.store import LedgerStatus, MemoryStore, SessionRecord
from fsm_agent.types import OutputSchema, Usage


@pytest.fixture(autouse=True)
def _prices():
    register_price("parent-model", Price(1.0, 2.0))
    register_price("child-model", Price(10.0, 20.0))
    yield
    PRICES.pop("parent-model", None)
    PRICES.pop("child-model", None)


def p_call(*calls: tuple[str, dict[str, Any]]) -> Any:
    return tool_call_response(*calls, model="parent-model")


def p_text(text: str) -> Any:
    return text_response(text, model="parent-model")


def c_call(*calls: tuple[str, dict[str, Any]]) -> Any:
    return tool_call_response(*calls, model="child-model")


def c_text(text: str) -> Any:
    return text_response(text, model="child-model")


PARENT_CALL = Usage(10, 5)
COST_PARENT_CALL = (10 * 1.0 + 5 * 2.0) / 1e6
COST_CHILD_CALL = (10 * 10.0 + 5 * 20.0) / 1e6


class Effects:
    """A side-effect tool that counts what it did, and can be held mid-call."""

    def __init__(self, hold: str | None = None) -> None:
        self.done: list[str] = []
        self.hold = hold
        """Sends to this recipient wait for ``release`` (``None``: every send does)."""
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()

    def tool(self) -> Any:
        @tool(effect="side_effect")
        async def send(to: str) -> str:
            """Send a message."""
            if self.hold is None or to == self.hold:
                self.entered.set()
                await self.release.wait()
            self.done.append(to)
            return f"sent to {to}"

        return send


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_the_child_runs_linked_in_its_own_session_and_its_usage_and_cost_roll_up(store) -> None:
    child_provider = ScriptedProvider([c_call(("lookup", {"q": "x"})), c_text("child answer")])

    @tool
    def lookup(q: str) -> str:
        """Look up."""
        return f"found {q}"

    child = Agent(child_provider, tools=[lookup], system_prompt="You research.", store=store)
    researcher = agent_tool(child, name="researcher", description="Research a question.")
    parent = Agent(ScriptedProvider([p_call(("researcher", {"task": "find x"})), p_text("final")]),
                   tools=[researcher], system_prompt="You lead.", store=store)
    result = await parent.run("do the thing", session_id="p")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "final"
    assert [m.text for m in result.messages if m.role == "tool"] == ["child answer"]

    (link,) = await store.children("p")
    call_id = result.messages[2].tool_calls[0].id
    assert (link.kind, link.call_id, link.metadata) == ("agent_tool", call_id, {"tool": "researcher"})
    assert link.child_id.startswith("researcher-") and await store.parent(link.child_id) == link
    rec = await store.get_session(link.child_id)
    assert rec.state == "COMPLETED" and rec.goal == "find x"
    # a real boundary: the child saw its own system prompt and the task, nothing of the parent's
    first = child_provider.requests[0].messages
    assert [(m.role, m.text) for m in first] == [("system", "You research."), ("user", "find x")]

    # usage and cost: the parent's two calls plus the child's two, rolled up once
    assert result.usage.input_tokens == 4 * 10 and result.usage.output_tokens == 4 * 5
    assert result.cost_usd == pytest.approx(2 * COST_PARENT_CALL + 2 * COST_CHILD_CALL)
    rolled = await store.read_events("p", types=("usage_rolled_up",))
    assert len(rolled) == 1 and rolled[0].payload["child_session_id"] == link.child_id
    assert rolled[0].payload["usage"]["input_tokens"] == 20
    assert rolled[0].payload["cost_usd"] == pytest.approx(2 * COST_CHILD_CALL)


async def test_the_child_budget_is_its_own() -> None:
    store = MemoryStore()
    child_provider = ScriptedProvider([c_call(("lookup", {"q": "a"})), c_call(("lookup", {"q": "b"}))])

    @tool
    def lookup(q: str) -> str:
        """Look up."""
        return q

    child = Agent(child_provider, tools=[lookup], store=store)
    ask = agent_tool(child, name="helper", description="Help.", limits={"max_iterations": 1})
    parent = Agent(ScriptedProvider([p_call(("helper", {"task": "t"})), p_text("went on without it")]),
                   tools=[ask], store=store, config=__import__("fsm_agent").RunConfig(max_iterations=3))
    result = await parent.run("go", session_id="p")
    assert result.stop.reason is StopReason.COMPLETED and result.turns == 2
    (tool_msg,) = [m for m in result.messages if m.role == "tool"]
    assert tool_msg.is_error and tool_msg.metadata["error"] == "sub_agent_paused_budget"
    assert "stopped PAUSED_BUDGET: iterations budget exhausted: 1 of 1" in tool_msg.text
    assert len(child_provider.requests) == 1  # the child stopped at its own limit
    child_id = (await store.children("p"))[0].child_id
    assert (await store.get_session(child_id)).state == "PAUSED_BUDGET"
    # the parent's budget counts the child's usage: its own 2 calls + the child's 1
    assert result.usage.input_tokens == 30


def test_bad_limits_are_refused_when_the_tool_is_made() -> None:
    child = Agent(ScriptedProvider([]))
    with pytest.raises(ConfigurationError, match="unknown limit.*max_iteration"):
        agent_tool(child, name="x", description="x", limits={"max_iteration": 3})
    with pytest.raises(ConfigurationError, match="max_iterations must be at least 1"):
        agent_tool(child, name="x", description="x", limits={"max_iterations": 0})


async def _stop_child_from_outside(kind: str) -> Any:
    store = MemoryStore()
    holder: list[Agent] = []

    @tool
    async def step(ctx: ToolContext) -> str:
        """A step during which someone stops the child session from outside."""
        await holder[0].control(ctx.session_id, Cancel("stopped by ops") if kind == "cancel" else Interrupt("ops"))
        await asyncio.sleep(5)
        return "never"

    child = Agent(ScriptedProvider([c_call(("step", {})), c_text("unreached")]), tools=[step], store=store,
                  control_poll=0.02)
    holder.append(child)
    return child, store


@pytest.mark.parametrize(("stop", "kind", "says"), [
    ("paused", "sub_agent_paused_budget", "Give it a smaller task"),
    ("retryable", "sub_agent_failed_retryable", "may work if called again later"),
    ("terminal", "sub_agent_failed_terminal", "will fail the same way"),
    ("cancelled", "sub_agent_cancelled", "cancelled from outside"),
    ("interrupted", "sub_agent_interrupted", "interrupted from outside"),
])
async def test_each_failing_stop_becomes_a_typed_error_result(stop: str, kind: str, says: str) -> None:
    store = MemoryStore()
    limits: dict[str, Any] = {}
    if stop == "paused":
        child = Agent(ScriptedProvider([c_call(("noop", {}))]), tools=[tool(lambda: "x", name="noop")], store=store)
        limits = {"max_iterations": 1}
    elif stop == "retryable":
        child = Agent(ScriptedProvider([ProviderError("overloaded, try later", retryable=True)]), store=store)
    elif stop == "terminal":
        child = Agent(ScriptedProvider([ProviderError("bad request", retryable=False)]), store=store)
    else:
        child, store = await _stop_child_from_outside("cancel" if stop == "cancelled" else "interrupt")
    ask = agent_tool(child, name="helper", description="Help.", limits=limits)
    parent = Agent(ScriptedProvider([p_call(("helper", {"task": "t"})), p_text("handled")]), tools=[ask],
                   store=store)
    result = await parent.run("go", session_id="p")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "handled"
    (tool_msg,) = [m for m in result.messages if m.role == "tool"]
    assert tool_msg.is_error and tool_msg.metadata["error"] == kind
    assert says in tool_msg.text and "(session helper-" in tool_msg.text
    ledger = await store.ledger("p")
    assert [e.status for e in ledger.values()] == [LedgerStatus.FAILED]


async def test_a_completed_structured_child_answers_with_json() -> None:
    store = MemoryStore()
    schema = OutputSchema("city", {"type": "object", "properties": {"name": {"type": "string"}},
                                   "required": ["name"], "additionalProperties": False})
    child = Agent(ScriptedProvider([c_text('{"name": "Paris"}')]), store=store)
    ask = agent_tool(child, name="geo", description="Geography.", output_schema=schema)
    parent = Agent(ScriptedProvider([p_call(("geo", {"task": "capital of France"})), p_text("Paris it is")]),
                   tools=[ask], store=store)
    result = await parent.run("go", session_id="p")
    assert [m.text for m in result.messages if m.role == "tool"] == ['{"name":"Paris"}']


class AskForSend(Middleware):
    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        return AskApproval("sending needs a person") if call.name == "send" else None


@pytest.mark.parametrize("decision", [Decision.approve(), Decision.reject("not to Bob")])
async def test_a_child_waiting_for_a_person_stops_the_parent_too(store, decision: Decision) -> None:
    effects = Effects()
    child_provider = ScriptedProvider([c_call(("send", {"to": "bob"})), c_text("child done")])
    child = Agent(child_provider, tools=[effects.tool()], middleware=[AskForSend()], store=store)
    ask = agent_tool(child, name="mailer", description="Mail.")
    parent = Agent(ScriptedProvider([p_call(("mailer", {"task": "mail bob"})), p_text("parent done")]),
                   tools=[ask], store=store)
    first = await parent.run("go", session_id="p")
    assert first.stop.reason is StopReason.WAITING_HUMAN
    (pending,) = first.stop.pending_actions
    assert (pending.call.name, pending.reason) == ("mailer", "sub_agent_waiting")
    assert 'send({"to":"bob"}) [sending needs a person]' in first.stop.detail
    child_id = (await store.children("p"))[0].child_id
    assert (await store.get_session(child_id)).state == "WAITING_HUMAN"

    again = await parent.resume("p")  # no decision: still waiting, nothing sent
    assert again.stop.reason is StopReason.WAITING_HUMAN and effects.done == []

    done = await parent.resume("p", decisions={pending.call.id: decision})
    assert done.stop.reason is StopReason.COMPLETED and done.output == "parent done"
    assert effects.done == (["bob"] if decision.kind == "approve" else [])
    child_tool_results = [m.text for m in (await __import__("fsm_agent").store.load_session(store, child_id)).transcript
                          if m.role == "tool"]
    assert child_tool_results == (["sent to bob"] if decision.kind == "approve"
                                  else ["A person rejected this tool call: not to Bob"])
    assert (await store.get_session(child_id)).state == "COMPLETED"
    assert len(child_provider.requests) == 2


async def test_an_interrupt_of_the_parent_cuts_the_child_and_the_resume_continues_it(store) -> None:
    effects = Effects(hold="bob")
    effects.release.clear()
    child_provider = ScriptedProvider([c_call(("send", {"to": "ann"})), c_call(("send", {"to": "bob"})),
                                       c_text("both sent")])
    child = Agent(child_provider, tools=[effects.tool()], store=store, control_poll=0.02)
    ask = agent_tool(child, name="mailer", description="Mail.")
    parent_provider = ScriptedProvider([p_call(("mailer", {"task": "mail ann and bob"})), p_text("parent done")])
    parent = Agent(parent_provider, tools=[ask], store=store, control_poll=0.02)
    run = asyncio.ensure_future(parent.run("go", session_id="p"))
    await asyncio.wait_for(effects.entered.wait(), 10)  # the child is inside its second send
    await parent.control("p", Interrupt("stop for now"))
    stopped = await run
    assert stopped.stop.reason is StopReason.INTERRUPTED
    assert "mailer left open, to continue on resume" in stopped.stop.detail
    child_id = (await store.children("p"))[0].child_id
    assert (await store.get_session(child_id)).state == "INTERRUPTED"
    assert effects.done == ["ann"]
    rolled = await store.read_events("p", types=("usage_rolled_up",))
    assert [e.payload["usage"]["input_tokens"] for e in rolled] == [20]  # the child's 2 calls so far

    effects.release.set()
    done = await parent.resume("p")
    assert done.stop.reason is StopReason.COMPLETED and done.output == "parent done"
    # the cut send had an unknown outcome: the child's model was told, and nothing ran twice
    assert effects.done == ["ann"]
    assert len(child_provider.requests) == 3 and len(parent_provider.requests) == 2
    assert [m.text for m in done.messages if m.role == "tool"] == ["both sent"]
    assert (await store.children("p"))[0].child_id == child_id and len(await store.children("p")) == 1
    # usage: parent 2 calls + child 3 calls, the child's counted once across the two roll-ups
    assert done.usage.input_tokens == 50
    rolled = await store.read_events("p", types=("usage_rolled_up",))
    assert [e.payload["usage"]["input_tokens"] for e in rolled] == [20, 10]


async def _async(value: Any) -> Any:
    return value


async def test_cancelling_the_parents_task_interrupts_the_child_and_a_resume_finishes_it() -> None:
    store = MemoryStore()
    effects = Effects()
    effects.release.clear()
    child_provider = ScriptedProvider([c_call(("send", {"to": "ann"})), c_text("sent")])
    child = Agent(child_provider, tools=[effects.tool()], store=store)
    parent = Agent(ScriptedProvider([p_call(("mailer", {"task": "mail ann"})), p_text("ok")]),
                   tools=[agent_tool(child, name="mailer", description="Mail.")], store=store)
    run = asyncio.ensure_future(parent.run("go", session_id="p"))
    await asyncio.wait_for(effects.entered.wait(), 10)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert (await store.get_session("p")).state == "INTERRUPTED"
    child_id = (await store.children("p"))[0].child_id
    assert (await store.get_session(child_id)).state == "INTERRUPTED"
    done = await parent.resume("p")
    assert done.stop.reason is StopReason.COMPLETED and effects.done == []  # the cut send is not run again
    assert (await store.get_session(child_id)).state == "COMPLETED"


async def test_a_cancel_of_the_parent_cancels_the_running_child_and_compensates_its_side_effects(store) -> None:
    compensated: list[dict[str, Any]] = []
    effects = Effects()
    send = effects.tool()
    send.on_compensate(lambda arguments, result, ctx: compensated.append(arguments))
    gate = asyncio.Event()
    waiting = asyncio.Event()

    @tool
    async def think() -> str:
        """Think for a long time."""
        waiting.set()
        await gate.wait()
        return "thought"

    child = Agent(ScriptedProvider([c_call(("send", {"to": "ann"})), c_call(("think", {})), c_text("never")]),
                  tools=[send, think], store=store, control_poll=0.02)
    parent = Agent(ScriptedProvider([p_call(("mailer", {"task": "mail ann"})), p_text("never")]),
                   tools=[agent_tool(child, name="mailer", description="Mail.")], store=store, control_poll=0.02)
    run = asyncio.ensure_future(parent.run("go", session_id="p"))
    await asyncio.wait_for(waiting.wait(), 10)
    await parent.control("p", Cancel("the user changed their mind"))
    result = await run
    assert result.stop.reason is StopReason.CANCELLED
    child_id = (await store.children("p"))[0].child_id
    assert (await store.get_session(child_id)).state == "CANCELLED"
    assert effects.done == ["ann"] and compensated == [{"to": "ann"}]
    (entry,) = (await store.ledger("p")).values()
    assert entry.status is LedgerStatus.REJECTED  # the parent's call: compensated by cancelling the child


async def test_a_cancel_sent_while_parent_and_child_are_stopped_reaches_the_child() -> None:
    store = MemoryStore()
    effects = Effects()
    effects.release.clear()
    child = Agent(ScriptedProvider([c_call(("send", {"to": "ann"})), c_text("never")]), tools=[effects.tool()],
                  store=store, control_poll=0.02)
    parent = Agent(ScriptedProvider([p_call(("mailer", {"task": "mail ann"})), p_text("never")]),
                   tools=[agent_tool(child, name="mailer", description="Mail.")], store=store, control_poll=0.02)
    run = asyncio.ensure_future(parent.run("go", session_id="p"))
    await asyncio.wait_for(effects.entered.wait(), 10)
    await parent.control("p", Interrupt())
    assert (await run).stop.reason is StopReason.INTERRUPTED
    child_id = (await store.children("p"))[0].child_id
    await parent.control("p", Cancel("no longer needed"))  # queued: the parent is stopped
    result = await parent.resume("p")
    child_rec = await store.get_session(child_id)
    # the child's send was cut in flight (outcome unknown) and has no compensation: it asks a person,
    # and so does the parent, naming the child's call (review finding 10: the parent said CANCELLED)
    assert child_rec.state == "WAITING_HUMAN" and child_rec.stop["required_decision"] == "confirm_cancel"
    assert result.stop.reason is StopReason.WAITING_HUMAN and result.stop.required_decision == "confirm_cancel"
    assert f"session {child_id}" in result.stop.detail and "send(" in result.stop.detail
    assert effects.done == []
    confirmed = await parent.resume("p", confirm_cancel=True)  # the person's confirmation reaches the child
    assert confirmed.stop.reason is StopReason.CANCELLED
    assert (await store.get_session(child_id)).state == "CANCELLED" and effects.done == []
    (entry,) = (await store.ledger("p")).values()
    assert entry.status is LedgerStatus.REJECTED


async def test_a_child_id_taken_by_another_parent_is_a_typed_error() -> None:
    store = MemoryStore()
    for sid in ("a", "b"):
        await store.create_session(SessionRecord(sid, "Idle"))
    await link_child(store, "a", "kid", "agent_tool", call_id="c1")
    assert (await link_child(store, "a", "kid", "agent_tool", call_id="c1")).parent_id == "a"  # idempotent
    with pytest.raises(SessionLinkError, match="started by session 'a' by call c1"):
        await link_child(store, "b", "kid", "agent_tool", call_id="c1")
    with pytest.raises(SessionLinkError):
        await link_child(store, "a", "kid", "agent_tool", call_id="c2")


async def test_a_link_that_cannot_be_written_starts_no_child() -> None:
    from fsm_agent.testing import FaultyStore

    store = FaultyStore(MemoryStore())
    store.fail("link_session", transient=True)
    child_provider = ScriptedProvider([c_text("never")])
    child = Agent(child_provider, store=store)
    parent = Agent(ScriptedProvider([p_call(("helper", {"task": "t"})), p_call(("helper", {"task": "t"})),
                                     p_text("done")]),
                   tools=[agent_tool(child, name="helper", description="Help.")], store=store)
    result = await parent.run("go", session_id="p")
    assert result.stop.reason is StopReason.COMPLETED
    first, second = [m for m in result.messages if m.role == "tool"]
    assert first.is_error and "StoreError" in first.text and "link_session failed" in first.text
    assert second.text == "never"  # the next call links and runs its child
    assert len(child_provider.requests) == 1 and len(await store.children("p")) == 1
    assert store.calls["link_session"] == 2


async def test_an_interrupt_leaves_the_child_open_though_another_call_of_the_batch_is_not_resumable(store) -> None:
    """Review finding 4: a plain tool in flight next to the agent tool made the interrupt close both;
    the parent's model then called the sub-agent again: a second child, every effect again."""
    effects = Effects(hold="bob")
    effects.release.clear()
    child_provider = ScriptedProvider([c_call(("send", {"to": "ann"})), c_call(("send", {"to": "bob"})),
                                       c_text("both sent")])
    child = Agent(child_provider, tools=[effects.tool()], store=store, control_poll=0.02)
    gate = asyncio.Event()

    @tool
    async def lookup(q: str) -> str:
        """A slow read."""
        await gate.wait()
        return "x"

    def parent_script(request: Any) -> Any:
        results = [m for m in request.messages if m.role == "tool"]
        if not results:
            return p_call(("mailer", {"task": "mail ann and bob"}), ("lookup", {"q": "z"}))
        mailer = [m for m in results if m.name == "mailer"]
        if mailer and mailer[-1].is_error and len(mailer) == 1:  # would delegate again after an error
            return p_call(("mailer", {"task": "mail ann and bob"}))
        return p_text("done")

    parent = Agent(ScriptedProvider([parent_script], repeat_last=True),
                   tools=[agent_tool(child, name="mailer", description="Mail."), lookup], store=store,
                   control_poll=0.02)
    run = asyncio.ensure_future(parent.run("go", session_id="p"))
    await asyncio.wait_for(effects.entered.wait(), 10)
    await parent.control("p", Interrupt("pause"))
    stopped = await run
    assert stopped.stop.reason is StopReason.INTERRUPTED
    assert "mailer left open, to continue on resume; lookup closed, outcome unknown" in stopped.stop.detail
    effects.release.set()
    gate.set()
    done = await parent.resume("p")
    assert done.stop.reason is StopReason.COMPLETED and done.output == "done"
    assert effects.done == ["ann"]  # bob's send was cut in flight (outcome unknown): nothing twice
    assert len(await store.children("p")) == 1 and len(child_provider.requests) == 3
    results = {m.name: m for m in done.messages if m.role == "tool"}
    assert results["mailer"].text == "both sent" and "outcome is unknown" in results["lookup"].text


@pytest.mark.parametrize("squatter_state", ["COMPLETED", "INTERRUPTED"])
async def test_a_session_squatting_the_child_id_is_never_taken_over(store, squatter_state: str) -> None:
    """Review finding 5: a session created under the id the parent's call derives was taken as the
    child (its answer returned, or its transcript resumed with the child's tools)."""
    from fsm_agent.tools.execution import idempotency_key

    squat = f"researcher-{idempotency_key('p', 'call_fixed')[:20]}"
    gate = asyncio.Event()

    @tool
    async def wait_a_bit() -> str:
        """Wait."""
        await gate.wait()
        return "x"

    squatter = Agent(ScriptedProvider([c_call(("wait_a_bit", {})), c_text("ANSWER OF ANOTHER SESSION")]),
                     tools=[wait_a_bit], store=store, control_poll=0.02)
    if squatter_state == "COMPLETED":
        gate.set()
        await squatter.run("something else entirely", session_id=squat)
    else:
        run = asyncio.ensure_future(squatter.run("SQUATTER'S TASK", session_id=squat))
        await asyncio.sleep(0.2)
        await squatter.control(squat, Interrupt())
        await run
    assert (await store.get_session(squat)).state == squatter_state
    child_provider = ScriptedProvider([c_text("real answer")])
    child = Agent(child_provider, store=store)
    from fsm_agent.types import ToolUseBlock
    parent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("call_fixed", "researcher", {"task": "2+2?"}),
                                                        model="parent-model"), p_text("final")]),
                   tools=[agent_tool(child, name="researcher", description="r")], store=store)
    result = await parent.run("go", session_id="p")
    assert result.stop.reason is StopReason.COMPLETED
    (msg,) = [m for m in result.messages if m.role == "tool"]
    assert msg.is_error and msg.metadata["error"] == "sub_agent_session_conflict"
    assert f"session {squat!r} exists already and was not started by session 'p' by call call_fixed" in msg.text
    assert child_provider.requests == []  # nothing ran in it
    assert (await store.get_session(squat)).state == squatter_state


async def test_a_child_without_a_known_price_says_the_parent_cost_budget_no_longer_applies() -> None:
    """Review finding 6 (b): the parent's cost budget silently stopped applying."""
    store = MemoryStore()
    child = Agent(ScriptedProvider([text_response("child done", model="unpriced-model")]), store=store)
    parent = Agent(ScriptedProvider([p_call(("helper", {"task": "t"})), p_text("p")]),
                   tools=[agent_tool(child, name="helper", description="h")], store=store)
    result = await parent.run("go", session_id="p", max_cost_usd=0.5)
    assert result.stop.reason is StopReason.COMPLETED and result.cost_usd is None
    (warning,) = [e.payload for e in await store.read_events("p", types=("warning",))]
    child_id = (await store.children("p"))[0].child_id
    assert warning["kind"] == "cost_unknown" and warning["child_session_id"] == child_id
    assert "cost budget ($0.5) cannot be enforced" in warning["message"]


async def test_a_child_budget_is_capped_at_what_the_parent_has_left() -> None:
    """Review finding 6 (a): a parent with $0.15 reached $0.70 through a child whose own budget was $1."""
    register_price("big-model", Price(1.0, 1.0))
    try:
        store = MemoryStore()
        big = Usage(100_000, 0)  # $0.10 a call
        child_provider = ScriptedProvider([tool_call_response(("noop", {}), usage=big, model="big-model")] * 5
                                          + [text_response("child done", usage=big, model="big-model")])
        child = Agent(child_provider, tools=[tool(lambda: "ok", name="noop")], store=store)
        parent = Agent(ScriptedProvider([tool_call_response(("helper", {"task": "t"}), usage=Usage(50_000, 0),
                                                            model="big-model"), p_text("p")]),
                       tools=[agent_tool(child, name="helper", description="h", limits={"max_cost_usd": 1.0})],
                       store=store)
        result = await parent.run("go", session_id="p", max_cost_usd=0.15)
        child_id = (await store.children("p"))[0].child_id
        child_rec = await store.get_session(child_id)
        assert child_rec.state == "PAUSED_BUDGET" and "of $0.1000 used" in child_rec.stop["detail"]
        assert len(child_provider.requests) == 1  # $0.05 + one child call reach the parent's $0.15
        assert result.stop.reason is StopReason.PAUSED_BUDGET and result.cost_usd == pytest.approx(0.15)
    finally:
        PRICES.pop("big-model", None)


class AskBeforeSend(Middleware):
    def __init__(self, allowed: tuple[str, ...] = ("approve", "edit", "reject", "respond")) -> None:
        self.allowed = allowed

    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        return AskApproval("needs a person", allowed_decisions=self.allowed) if call.name == "send" else None


async def test_a_nested_wait_names_the_call_that_really_waits_and_the_decision_reaches_it(store) -> None:
    """Review finding 8: the top session said it waited on `inner(...) [sub_agent_waiting]`."""
    effects = Effects(hold="nobody")
    grandchild = Agent(ScriptedProvider([c_call(("send", {"to": "zed"})), c_text("gc done")]),
                       tools=[effects.tool()], middleware=[AskBeforeSend()], store=store)
    middle = Agent(ScriptedProvider([c_call(("inner", {"task": "mail zed"})), c_text("mid done")]),
                   tools=[agent_tool(grandchild, name="inner", description="i")], store=store)
    top = Agent(ScriptedProvider([p_call(("outer", {"task": "delegate"})), p_text("top done")]),
                tools=[agent_tool(middle, name="outer", description="o")], store=store)
    first = await top.run("go", session_id="t")
    assert first.stop.reason is StopReason.WAITING_HUMAN
    mid_id = (await store.children("t"))[0].child_id
    gc_id = (await store.children(mid_id))[0].child_id
    assert (f"sub-agent 'outer' (session {mid_id}) waits for a person: inner → session {gc_id}: "
            f'send({{"to":"zed"}}) [needs a person]') in first.stop.detail
    (pending,) = first.stop.pending_actions
    done = await top.resume("t", decisions={pending.call.id: Decision.approve()})
    assert done.stop.reason is StopReason.COMPLETED and effects.done == ["zed"]


async def test_a_decision_the_waiting_child_does_not_accept_is_refused_at_the_resume(store) -> None:
    """Review finding 9: a respond to a child call allowing only approve / reject was dropped, and the
    parent waited again without a word."""
    effects = Effects(hold="nobody")
    child = Agent(ScriptedProvider([c_call(("send", {"to": "bob"})), c_text("child done")]),
                  tools=[effects.tool()], middleware=[AskBeforeSend(("approve", "reject"))], store=store)
    parent = Agent(ScriptedProvider([p_call(("mailer", {"task": "mail bob"})), p_text("parent done")]),
                   tools=[agent_tool(child, name="mailer", description="m")], store=store)
    first = await parent.run("go", session_id="p")
    (pending,) = first.stop.pending_actions
    assert pending.allowed_decisions == ("approve", "reject")
    with pytest.raises(ResumeError, match="allows approve, reject, not 'respond'"):
        await parent.resume("p", decisions={pending.call.id: Decision.respond("use fax instead")})
    done = await parent.resume("p", decisions={pending.call.id: Decision.reject("no mail")})
    assert done.stop.reason is StopReason.COMPLETED and effects.done == []
