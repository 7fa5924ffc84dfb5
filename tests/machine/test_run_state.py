"""The run state is one typed value, checkpointed whole; the plugins' view cannot write it; the
promises of issue 8 that live in the driver (wall clock, goal version, ledger states, cost per
call, structured output)."""

from __future__ import annotations

import asyncio

import attrs
import orjson
import pytest

from fsm_agent import (Agent, Decision, Middleware, OutputSchema, Permissions, PermissionRequest, RunConfig, Scope,
                       ScriptedProvider, StopReason, Steer, tool)
from fsm_agent.control import Decision as _Decision
from fsm_agent.machine import RunState, TurnSettings
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.store import LedgerStatus, MemoryStore, SQLiteStore, read_turns
from fsm_agent.types import (
    NodeStatus,
    Plan,
    PlanNode,
    Replan,
    ReplanTrigger,
    ToolResultMessage,
    ToolUseBlock,
    Usage,
    UserMessage,
)
from fsm_agent.types.codec import structure, unstructure
from fsm_agent_middleware.approval import HumanApproval


def _non_default(cls: type) -> dict:
    """A value for every field of RunState that differs from its default."""
    call = ToolUseBlock("call_1", "echo", {"text": "x"})
    return {
        "config": RunConfig(max_iterations=7, max_wall_clock=12.5, max_tokens=999, max_cost_usd=1.5,
                            output_schema=OutputSchema("answer", {"type": "object"})),
        "state": "MidTurn",
        "turn": 3,
        "usage": Usage(11, 22, estimated=True),
        "cost_usd": None,
        "tool_calls_made": 4,
        "tool_call_counts": {"echo": 4},
        "pending_calls": [call],
        "decisions": {"call_1": _Decision.edit({"text": "y"})},
        "decided_results": {"call_2": ToolResultMessage("call_2", "done", name="echo")},
        "context_retry": True,
        "max_output_override": 77,
        "output_retry": True,
        "structured_repair": True,
        "evidence": ["seq:5"],
        "elapsed": 3.25,
        "goal_version": 4,
        "last_response": tool_call_response(("echo", {"text": "x"})),
        "cancel_confirmed": True,
        "transcript_len": 9,
        "turn_input_seq": 17,
        "metadata": {"plan": {"node": 2}},
        "plan": Plan("ship it", (PlanNode("a", "build", acceptance="tests pass", status=NodeStatus.PASSED, attempts=2,
                                          result="built", verdict="ok", evidence=("grader:1",), started_turn=1),
                                 PlanNode("b", "deploy", ("a",), check="deployed", status=NodeStatus.RUNNING)),
                     version=2, goal_version=3,
                     history=(Replan(2, ReplanTrigger.FAILED, "a failed", 2, "a", ("c",), ("b",)),)),
        "permissions": Permissions(["echo", "read_*"], [Scope.of("read_*", "path", under="/srv")]).narrow(
            Permissions(["echo"]), "narrowed"),
        "permission_request": PermissionRequest("perm_1", Permissions(["echo", "pay"]), "more"),
    }


def test_every_field_of_the_run_state_survives_a_checkpoint() -> None:
    values = _non_default(RunState)
    names = {f.name for f in attrs.fields(RunState)}
    assert set(values) == names, "a RunState field has no non-default value in this test"
    default = RunState()
    for name, value in values.items():
        assert getattr(default, name) != value, name
    state = RunState(**values)
    back = structure(unstructure(state), RunState)
    assert back == state


async def test_checkpoints_do_not_copy_the_ledger_or_grow_with_the_tool_results() -> None:
    """The ledger lives in the store's ledger table; a checkpoint copying it grew quadratically."""
    big = "x" * 20_000
    store = MemoryStore()
    script = [tool_call_response(("echo", {"text": big})) for _ in range(8)] + ["done"]
    result = await Agent(ScriptedProvider(script), tools=[echo], store=store).run("go")
    assert result.stop.reason is StopReason.COMPLETED and result.tool_calls == 8
    ck = await store.latest_checkpoint(result.session_id)
    size = len(orjson.dumps(ck.data))
    assert "ledger" not in ck.data and size < 2 * 20_000 + 5_000, size  # one response kept, not every result
    assert len(await store.ledger(result.session_id)) == 8


def test_a_checkpoint_written_before_the_plan_field_loads_without_a_plan() -> None:
    data = unstructure(RunState(turn=2))
    del data["plan"]
    assert structure(data, RunState) == RunState(turn=2)


def test_plugins_cannot_write_the_run_state() -> None:
    ctx = Agent(ScriptedProvider([])).new_context([UserMessage("hi")])
    for name in ("turn", "usage", "cost_usd", "tool_calls_made", "last_response", "pending_calls", "goal_version",
                 "context_retry", "config", "evidence", "plan"):
        with pytest.raises(AttributeError):
            setattr(ctx, name, getattr(ctx, name))
    with pytest.raises(TypeError):
        ctx.tool_call_counts["echo"] = 1  # type: ignore[index]
    ctx.messages = [UserMessage("rewritten")]  # the plugin's own
    ctx.settings.tools_enabled = False
    assert isinstance(ctx.settings, TurnSettings) and ctx.tools_enabled is False


async def test_the_wall_clock_cuts_a_model_call_in_flight_and_keeps_what_streamed() -> None:
    provider = ScriptedProvider(["one two three four five six seven eight"], stream_delay=0.15, chunk_chars=4)
    store = MemoryStore()
    result = await Agent(provider, store=store).run("count", max_wall_clock=0.5)
    assert result.stop.reason is StopReason.PAUSED_BUDGET and result.stop.budget == "wall_clock"
    assert 0.45 <= result.duration_s < 1.5  # cut at the budget, not when the answer would have ended
    partial = result.messages[-1]
    assert partial.provider_data == {"interrupted": True}
    assert "one two three four five six seven eight".startswith(partial.text) and partial.text
    assert result.usage.estimated
    resumed = await Agent(ScriptedProvider(["done"]), store=store).resume(result.session_id, max_wall_clock=30)
    assert resumed.stop.reason is StopReason.COMPLETED and resumed.output == "done"


@tool
def echo(text: str) -> str:
    """Echo the text."""
    return text


async def test_a_steer_raises_the_goal_version_in_the_record_and_the_checkpoint(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    seen: list[int] = []

    class Watch(Middleware):
        def pre_turn(self, ctx):  # type: ignore[no-untyped-def]
            seen.append(ctx.goal_version)

    agent = Agent(ScriptedProvider([tool_call_response(("echo", {"text": "a"})), "done"]), tools=[echo],
                  store=store, middleware=[Watch(), HumanApproval(tools=["echo"])])
    waiting = await agent.run("go", session_id="g")
    assert waiting.stop.reason is StopReason.WAITING_HUMAN
    await agent.control("g", Steer("use French"))
    result = await agent.resume("g", decisions={waiting.stop.pending_actions[0].call.id: Decision.approve()})
    assert result.stop.reason is StopReason.COMPLETED
    assert seen == [1, 2]
    rec = await store.get_session("g")
    assert rec.goal_version == 2
    ck = await store.latest_checkpoint("g")
    assert ck.data["goal_version"] == 2
    events = [e.type for e in await store.read_events("g")]
    assert "goal_changed" in events


async def test_a_persons_respond_is_recorded_as_responded() -> None:
    store = MemoryStore()
    agent = Agent(ScriptedProvider([tool_call_response(("echo", {"text": "a"})), "done"]), tools=[echo],
                  store=store, middleware=[HumanApproval(tools=["echo"])])
    waiting = await agent.run("go", session_id="r")
    call_id = waiting.stop.pending_actions[0].call.id
    result = await agent.resume("r", decisions={call_id: Decision.respond("a person's answer")})
    assert result.stop.reason is StopReason.COMPLETED
    entry = (await store.ledger("r"))[call_id]
    assert entry.status is LedgerStatus.RESPONDED and entry.result["content"][0]["text"] == "a person's answer"


async def test_each_model_call_event_carries_its_cost_and_context() -> None:
    store = MemoryStore()
    provider = ScriptedProvider([tool_call_response(("echo", {"text": "a"}), model="gpt-4o-mini"),
                                 text_response("done", model="gpt-4o-mini", usage=Usage(1000, 100))])
    result = await Agent(provider, tools=[echo], store=store).run("go")
    calls = [e.payload for e in await store.read_events(result.session_id) if e.type == "model_call"]
    from fsm_agent.pricing import cost_usd

    assert [c["cost_usd"] for c in calls] == [cost_usd("gpt-4o-mini", Usage(10, 5)),
                                              cost_usd("gpt-4o-mini", Usage(1000, 100))]
    assert all(c["cost_usd"] > 0 for c in calls)
    assert result.cost_usd == pytest.approx(sum(c["cost_usd"] for c in calls))
    turns = await read_turns(store, result.session_id)
    assert [t.context.hash for t in turns] == [c["context"]["hash"] for c in calls]
    assert [t.model_call["cost_usd"] for t in turns] == [c["cost_usd"] for c in calls]


SCHEMA = OutputSchema("city", {"type": "object", "properties": {"name": {"type": "string"},
                                                                "population": {"type": "integer"}},
                               "required": ["name", "population"], "additionalProperties": False})


async def test_an_answer_that_breaks_the_output_schema_gets_one_repair_turn() -> None:
    provider = ScriptedProvider(['{"name": "Paris", "population": "two million"}',
                                 '{"name": "Paris", "population": 2100000}'])
    result = await Agent(provider).run("Largest city of France?", output_schema=SCHEMA)
    assert result.stop.reason is StopReason.COMPLETED
    assert result.output_data == {"name": "Paris", "population": 2100000}
    assert len(provider.requests) == 2
    assert all(r.output_schema == SCHEMA for r in provider.requests)
    repair = provider.requests[1].messages[-1]
    assert repair.role == "user" and "population" in repair.text and "integer" in repair.text


async def test_an_answer_that_breaks_the_schema_twice_is_a_typed_stop() -> None:
    provider = ScriptedProvider(["Paris, about two million", '{"name": "Paris"}', "never asked"])
    result = await Agent(provider).run("Largest city of France?", output_schema=SCHEMA)
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["kind"] == "structured_output_invalid"
    assert "population" in result.stop.error["message"]
    assert len(provider.requests) == 2 and result.output_data is None


async def test_tool_calls_then_a_structured_answer() -> None:
    provider = ScriptedProvider([tool_call_response(("echo", {"text": "Lyon"})),
                                 '```json\n{"name": "Lyon", "population": 520000}\n```'])
    result = await Agent(provider, tools=[echo]).run("Echo Lyon, then answer.", output_schema=SCHEMA)
    assert result.stop.reason is StopReason.COMPLETED
    assert result.output_data == {"name": "Lyon", "population": 520000}


@pytest.mark.llama
async def test_structured_output_on_the_local_model(local_provider) -> None:
    schema = OutputSchema("colour", {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20}},
                                     "required": ["colour"], "additionalProperties": False})
    result = await Agent(local_provider).run("Name one colour of the French flag.", output_schema=schema,
                                             max_output_tokens=100)
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert isinstance(result.output_data, dict) and isinstance(result.output_data["colour"], str)
    assert result.output_data["colour"].strip()


async def test_task_cancel_during_the_call_keeps_the_stream_and_records_interrupted() -> None:
    store = MemoryStore()
    provider = ScriptedProvider(["alpha beta gamma delta " * 20], stream_delay=0.05, chunk_chars=6)
    task = asyncio.ensure_future(Agent(provider, store=store).run("go", session_id="c"))
    await asyncio.sleep(0.6)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    rec = await store.get_session("c")
    assert rec.state == "INTERRUPTED" and rec.stop["resumable"] and rec.lease_owner is None
    loaded = [e.payload["message"] for e in await store.read_events("c") if e.type == "message"]
    assert loaded[-1]["provider_data"] == {"interrupted": True} and loaded[-1]["content"][0]["text"]


async def test_a_cost_budget_on_a_model_without_a_price_warns_once(caplog) -> None:
    import logging

    store = MemoryStore()
    provider = ScriptedProvider([tool_call_response(("echo", {"text": "a"}), model="no-such-model"),
                                 text_response("done", model="no-such-model")])
    with caplog.at_level(logging.WARNING, logger="fsm_agent.driver"):
        result = await Agent(provider, tools=[echo], store=store).run("go", max_cost_usd=0.01)
    assert result.stop.reason is StopReason.COMPLETED and result.cost_usd is None
    warnings = [e.payload for e in await store.read_events(result.session_id) if e.type == "warning"]
    assert [w["kind"] for w in warnings] == ["cost_unknown"] and warnings[0]["model"] == "no-such-model"
    assert sum("cannot be enforced" in r.getMessage() for r in caplog.records) == 1
