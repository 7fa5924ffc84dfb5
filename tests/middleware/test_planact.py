"""PlanAct: a typed plan in the run state and the checkpoint, nodes run in dependency order as
ordinary turns, each node checked, a failed node replanned (passed nodes kept), bounded replans and
planner retries ending in typed stops, a Steer and a stale node replanning, and a run paused
mid-plan resuming at the node it was on without a new planner call (same agent, and a new Agent
on the same SQLite file).

The model is a :class:`World`: a ScriptedProvider routed by each request's role (the planner's,
replanner's and grader's requests carry their output schema's name), counting the calls of each
role. The end-to-end run on the real local model is ``tests/test_planact_local_llama.py``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from conftest import Recorder
from fsm_agent import (
    Agent,
    ConfigurationError,
    Decision,
    Interrupt,
    InvalidPlanError,
    MemoryStore,
    NodeStatus,
    Plan,
    PlanNode,
    PlanUpdated,
    ScriptedProvider,
    SQLiteStore,
    Steer,
    StopReason,
    SystemMessage,
    UserMessage,
    tool,
)
from fsm_agent.errors import AuthenticationError, ServerError
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.types import MessageRequest, Replan, ReplanTrigger, structure
from fsm_agent_middleware.approval import HumanApproval
from fsm_agent_middleware.planact import PlanAct
from fsm_agent_middleware.verifier import Verdict

PLAN = {"nodes": [
    {"id": "c", "goal": "Add the two numbers", "depends_on": ["a", "b"], "acceptance": "the sum is given"},
    {"id": "a", "goal": "Find the first number", "depends_on": [], "acceptance": "a number is given"},
    {"id": "b", "goal": "Find the second number", "depends_on": ["a"], "acceptance": "a number is given"},
]}
"""Written out of dependency order on purpose: the run must go a, b, c."""

_STEP = re.compile(r"Current step (\S+):")


def current_step(request: MessageRequest) -> str | None:
    """The node named in the plan note of an executor request's system message."""
    system = request.messages[0].text if request.messages and request.messages[0].role == "system" else ""
    m = _STEP.search(system)
    return m.group(1) if m else None


class World:
    """A scripted model in four roles, routed by the request: planner (output schema ``plan``),
    replanner (``replan``), grader (``verdict``) and executor (everything else).

    ``plans`` / ``replans``: answers in order (a dict is sent as JSON, a str as is, an exception
    raised); ``grade``: ``(request) -> (ok, reason)``; ``act``: ``(request, step) -> response``
    (default: a text answer naming the step)."""

    def __init__(self, plans: list[Any] = (), replans: list[Any] = (),  # type: ignore[assignment]
                 grade: Callable[[MessageRequest], tuple[bool, str]] | None = None,
                 act: Callable[[MessageRequest, str | None], Any] | None = None) -> None:
        self.plans = list(plans)
        self.replans = list(replans)
        self.grade = grade or (lambda r: (True, "looks right"))
        self.act = act or (lambda r, step: f"result of {step}")
        self.calls: Counter[str] = Counter()
        self.requests: dict[str, list[MessageRequest]] = {}
        self.steps: list[str | None] = []
        """The step named in each executor request, in order."""

    def provider(self) -> ScriptedProvider:
        return ScriptedProvider([self], repeat_last=True)

    def __call__(self, request: MessageRequest) -> Any:
        schema = request.output_schema.name if request.output_schema is not None else None
        role = {"plan": "planner", "replan": "replanner", "verdict": "grader"}.get(schema or "", "executor")
        self.calls[role] += 1
        self.requests.setdefault(role, []).append(request)
        if role in ("planner", "replanner"):
            queue = self.plans if role == "planner" else self.replans
            item = queue.pop(0) if len(queue) > 1 else queue[0]
            if isinstance(item, BaseException):
                raise item
            return text_response(item if isinstance(item, str) else orjson.dumps(item).decode())
        if role == "grader":
            ok, reason = self.grade(request)
            return text_response(orjson.dumps({"ok": ok, "reason": reason}).decode())
        step = current_step(request)
        self.steps.append(step)
        answer = self.act(request, step)
        return text_response(answer) if isinstance(answer, str) else answer


async def plan_events(store: Any, sid: str) -> list[tuple[str, Plan]]:
    return [(e.payload["reason"], structure(e.payload["plan"], Plan))
            for e in await store.read_events(sid, types=("plan_updated",))]


# -- the plan type ---------------------------------------------------------------------------
def test_a_plan_reports_every_problem() -> None:
    plan = Plan("g", (PlanNode("a", "x", ("b",)), PlanNode("b", "y", ("a",)), PlanNode("d", "z", ("zz", "d")),
                      PlanNode("e", "v"), PlanNode("e", "w")))
    problems = plan.problems()
    assert problems == ["node id 'e' is used by more than one node", "node 'd' depends on unknown node 'zz'",
                        "node 'd' depends on itself", "dependency cycle: a -> b -> a"]
    with pytest.raises(InvalidPlanError) as info:
        plan.validate()
    assert isinstance(info.value, ValueError) and info.value.problems == tuple(problems)
    assert Plan("g", ()).problems() == ["the plan has no nodes"]
    two_running = Plan("g", (PlanNode("a", "x", status=NodeStatus.RUNNING), PlanNode("b", "y", status=NodeStatus.RUNNING)))
    assert two_running.problems() == ["2 nodes are running (a, b); at most one may run"]
    blocked = Plan("g", (PlanNode("a", "x", status=NodeStatus.SKIPPED), PlanNode("b", "y", ("a",))))
    assert blocked.problems() == ["open node 'b' depends on skipped node 'a', so it can never run"]


def test_dependency_order_ready_nodes_and_done() -> None:
    plan = Plan("g", [PlanNode(n["id"], n["goal"], n["depends_on"]) for n in PLAN["nodes"]]).validate()
    assert [n.id for n in plan.order()] == ["a", "b", "c"]
    assert [n.id for n in plan.ready()] == ["a"]
    plan = plan.start("a", turn=0).with_node("a", status=NodeStatus.PASSED)
    assert [n.id for n in plan.ready()] == ["b"] and not plan.done
    plan = plan.with_node("b", status=NodeStatus.PASSED).with_node("c", status=NodeStatus.PASSED)
    assert plan.done and plan.ready() == ()


def test_a_long_chain_or_cycle_is_checked_without_recursion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycle detection and the dependency order are iterative: a 5,000-node chain (far past the
    interpreter's recursion limit) validates, and a 5,000-node cycle is a typed problem."""
    import sys

    from fsm_agent.types import plan as plan_module

    n = 5000
    assert n > sys.getrecursionlimit()
    monkeypatch.setattr(plan_module, "MAX_NODES", 10 * n)
    chain = Plan("g", tuple(PlanNode(f"n{i}", "x", (f"n{i + 1}",) if i < n - 1 else ()) for i in range(n)))
    assert [x.id for x in chain.validate().order()[:2]] == [f"n{n - 1}", f"n{n - 2}"]
    assert [x.id for x in chain.ready()] == [f"n{n - 1}"]
    ring = Plan("g", tuple(PlanNode(f"n{i}", "x", (f"n{(i + 1) % n}",)) for i in range(n)))
    with pytest.raises(InvalidPlanError) as info:
        ring.validate()
    assert info.value.problems[0].startswith("dependency cycle: n0 -> n1 -> n2")


def test_a_plan_over_the_node_cap_is_a_typed_problem() -> None:
    from fsm_agent.types import MAX_NODES

    big = Plan("g", tuple(PlanNode(f"n{i}", "x", (f"n{i + 1}",) if i < 1499 else ()) for i in range(1500)))
    with pytest.raises(InvalidPlanError) as info:
        big.validate()
    assert info.value.problems == (f"the plan has 1500 nodes; at most {MAX_NODES} are allowed",)
    with pytest.raises(ConfigurationError, match="the given plan is invalid: the plan has 1500 nodes"):
        PlanAct(plan=big)


@pytest.mark.parametrize("bad_id", ["a\nCurrent step z:", "a b", "\x1b[2J", "a\"]", "`b`", "é"])
def test_node_ids_are_letters_digits_and_a_few_marks(bad_id: str) -> None:
    plan = Plan("g", (PlanNode(bad_id, "x"), PlanNode("ok_1.v-2", "y", (bad_id,))))
    assert plan.problems() == [f"node id {bad_id!r} may use only letters, digits, '_', '.' and '-'"]


def test_texts_are_bounded_and_a_dependency_is_listed_once() -> None:
    from fsm_agent.types import MAX_TEXT_CHARS

    plan = Plan("g", (PlanNode("a", "x" * (MAX_TEXT_CHARS + 1), acceptance="y" * (MAX_TEXT_CHARS + 5)),
                      PlanNode("b", "z", ("a", "a"))))
    assert plan.problems() == [
        f"node 'a': its goal has {MAX_TEXT_CHARS + 1} characters; at most {MAX_TEXT_CHARS} are allowed",
        f"node 'a': its acceptance has {MAX_TEXT_CHARS + 5} characters; at most {MAX_TEXT_CHARS} are allowed",
        "node 'b' lists the dependency 'a' more than once"]


def test_describe_prints_one_printable_line_per_item_whatever_a_model_wrote() -> None:
    """A plan read back from a log is shown as written, but never with a control character: no
    escape sequence reaches a terminal and no text can forge a line."""
    import unicodedata

    hostile = "x\x1b[31mRED\x1b[0m\r\nFAKE LINE: passed\u202eRTL\x07"
    plan = Plan(hostile, (PlanNode("a\x1b[2J", hostile, status=NodeStatus.FAILED, verdict=hostile, attempts=1),
                          PlanNode("b", "y", ("a\x1b[2J",))),
                history=(Replan(2, ReplanTrigger.FAILED, hostile, 1, "a\x1b[2J"),), version=2)
    lines = plan.describe()
    assert len(lines) == 5  # header, two nodes, one check, one replan
    for line in lines:
        assert not any(unicodedata.category(ch) in ("Cc", "Cf") for ch in line), repr(line)
    assert lines[1] == "  [failed ] a[2J: x[31mRED[0m FAKE LINE: passedRTL, 1 attempt"
    assert lines[2] == "            check: x[31mRED[0m FAKE LINE: passedRTL"


def test_a_replan_keeps_passed_nodes_skips_dropped_ones_and_carries_attempts() -> None:
    plan = Plan("g", (PlanNode("a", "x", status=NodeStatus.PASSED, result="42", attempts=1),
                      PlanNode("b", "y", ("a",), status=NodeStatus.FAILED, attempts=2),
                      PlanNode("c", "z", ("b",))))
    new = plan.replan((PlanNode("b", "y again", ("a",)), PlanNode("d", "w", ("b",))),
                      trigger=ReplanTrigger.FAILED, reason="b failed", turn=4, node="b").validate()
    assert new.version == 2 and new.replans == 1
    assert new.node("a") == plan.node("a")  # untouched, result kept
    assert new.node("b").status is NodeStatus.PENDING and new.node("b").attempts == 2 and new.node("b").goal == "y again"
    assert new.node("c").status is NodeStatus.SKIPPED
    assert new.history[0].dropped == ("c",) and new.history[0].added == ("b", "d") and new.history[0].node == "b"
    with pytest.raises(InvalidPlanError, match="'a' already passed"):
        plan.replan((PlanNode("a", "again"),), trigger=ReplanTrigger.FAILED, reason="r", turn=1)


def test_the_numbered_schema_admits_only_earlier_dependencies() -> None:
    import jsonschema

    from fsm_agent.types import plan_output_schema

    schema = plan_output_schema(min_nodes=2, max_nodes=3, ids=["s2", "s3", "s4"], done=["s1"], max_chars=50).schema

    def node(i: str, deps: list[str]) -> dict[str, Any]:
        return {"id": i, "goal": "g", "depends_on": deps, "acceptance": "a"}

    jsonschema.validate({"nodes": [node("s2", ["s1"]), node("s3", ["s2", "s1"])]}, schema)
    for bad in ({"nodes": [node("s2", [])]},  # too few
                {"nodes": [node("s2", ["s3"]), node("s3", [])]},  # a later dependency (a cycle would need one)
                {"nodes": [node("s2", ["s9"]), node("s3", [])]},  # unknown
                {"nodes": [node("s3", []), node("s2", [])]},  # ids out of order
                {"nodes": [node("s2", []), node("s3", []), node("s4", []), node("s5", [])]}):  # too many
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


# -- running a plan --------------------------------------------------------------------------
async def test_a_three_node_plan_runs_in_dependency_order_and_completes_with_evidence() -> None:
    world = World(plans=[PLAN])
    store = MemoryStore()
    rec = Recorder()
    result = await Agent(world.provider(), store=store, middleware=[PlanAct()], observers=[rec]).run("Add two numbers")
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert world.steps == ["a", "b", "c"]
    assert world.calls == Counter(planner=1, executor=3, grader=3)
    assert result.stop.detail == "plan v1: every node passed (3 nodes, 0 replans) (decided by planact)"
    refs = result.stop.evidence_refs
    assert [r for r in refs if r.startswith("plan:")] == ["plan:v1:a:passed", "plan:v1:b:passed", "plan:v1:c:passed"]
    assert sum(r.startswith("grader:scripted/") for r in refs) == 3
    # each node's instruction is in the transcript (the first is the task itself)
    users = [m.text for m in result.messages if isinstance(m, UserMessage)]
    assert users == ["Add two numbers", "Next step b: Find the second number\nDone when: a number is given",
                     "Next step c: Add the two numbers\nDone when: the sum is given"]
    final = (await plan_events(store, result.session_id))[-1][1]
    assert all(n.status is NodeStatus.PASSED and n.attempts == 1 for n in final.nodes)
    assert final.node("b").result == "result of b"
    ck = await store.latest_checkpoint(result.session_id)
    assert structure(ck.data["plan"], Plan) == final  # the checkpoint carries the plan
    # planner and grader calls are accounted to the run: 7 calls of 10+5 tokens
    assert result.usage.total_tokens == 7 * 15
    assert [e.reason for e in rec.of(PlanUpdated)] == [r for r, _ in await plan_events(store, result.session_id)]


async def test_a_node_failing_its_check_is_replanned_and_passed_nodes_keep_their_results() -> None:
    tries: Counter[str] = Counter()

    def check(ctx: Any, node: PlanNode) -> Verdict | None:
        tries[node.id] += 1
        if node.id == "b" and tries["b"] == 1:
            return Verdict(False, "the second number is missing", ("check:b:1",))
        return None  # the grader decides

    replan = {"nodes": [{"id": "b", "goal": "Look the second number up in the table", "depends_on": ["a"],
                         "acceptance": "a number from the table"},
                        {"id": "d", "goal": "Add and report", "depends_on": ["a", "b"], "acceptance": "the sum"}]}
    world = World(plans=[PLAN], replans=[replan])
    store = MemoryStore()
    result = await Agent(world.provider(), store=store, middleware=[PlanAct(check=check)]).run("Add two numbers")
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert world.steps == ["a", "b", "b", "d"]
    assert world.calls["planner"] == 1 and world.calls["replanner"] == 1
    events = await plan_events(store, result.session_id)
    reasons = [r for r, _ in events]
    failed_at = next(i for i, r in enumerate(reasons) if r.startswith("node b failed its check: the second number"))
    assert reasons[failed_at + 1].startswith("replanned to v2 (failed): node b failed its check")
    before, after = events[failed_at][1], events[failed_at + 1][1]
    assert before.version == 1 and before.node("b").status is NodeStatus.FAILED
    assert after.version == 2 and after.node("a") == before.node("a")  # the passed node, result and all
    assert after.node("a").result == "result of a"
    assert after.node("c").status is NodeStatus.SKIPPED and after.node("b").goal.startswith("Look")
    assert after.history[0].trigger is ReplanTrigger.FAILED and after.history[0].reason.endswith("number is missing")
    final = events[-1][1]
    assert final.node("b").attempts == 2 and final.node("b").status is NodeStatus.PASSED
    # the replanner was told what is done and what failed; the model was told why it goes back
    asked = world.requests["replanner"][0].messages[-1].text
    assert "DONE:\n- a: Find the first number -> result of a" in asked
    assert "FAILED:\n- b: Find the second number (check: the second number is missing)" in asked
    assert ("Step b did not pass its check: the second number is missing. The plan was revised.\n"
            "Next step b: Look the second number up in the table\nDone when: a number from the table") in [
        m.text for m in result.messages]


async def test_replans_are_bounded_then_the_run_waits_for_a_person_and_a_resume_replans_afresh() -> None:
    passing = {"on": False}

    def check(ctx: Any, node: PlanNode) -> Verdict | None:
        if node.id == "b" and not passing["on"]:
            return Verdict(False, "still wrong")
        return None

    redo = {"nodes": [{"id": "b", "goal": "Try b again", "depends_on": ["a"], "acceptance": "a number"},
                      {"id": "c", "goal": "Add", "depends_on": ["b"], "acceptance": "the sum"}]}
    world = World(plans=[PLAN], replans=[redo])
    store = MemoryStore()
    agent = Agent(world.provider(), store=store, middleware=[PlanAct(check=check, max_replans=1)])
    result = await agent.run("Add two numbers")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    assert result.stop.error["kind"] == "plan_failed" and result.stop.error["node"] == "b"
    assert "replan budget is spent (1 of 1" in result.stop.detail
    assert result.stop.required_decision.startswith("resume to replan")
    assert world.calls["replanner"] == 1 and world.steps == ["a", "b", "b"]
    stopped = (await plan_events(store, result.session_id))[-1][1]
    assert stopped.node("b").status is NodeStatus.FAILED and stopped.node("b").attempts == 2
    # a person resumes: one replan with a fresh budget, and the run finishes
    passing["on"] = True
    resumed = await agent.resume(result.session_id)
    assert resumed.stop.reason is StopReason.COMPLETED, resumed.stop.detail
    final = (await plan_events(store, result.session_id))[-1][1]
    assert [r.trigger for r in final.history] == [ReplanTrigger.FAILED, ReplanTrigger.RESUMED]
    assert world.calls["planner"] == 1


async def test_spent_replans_fail_the_run_when_configured() -> None:
    world = World(plans=[PLAN], replans=[PLAN])
    result = await Agent(world.provider(), middleware=[
        PlanAct(check=lambda ctx, node: Verdict(False, "never good"), max_replans=0, on_exhausted="fail")]).run("go")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["kind"] == "plan_failed" and result.stop.error["reasons"] == ["node a failed its check: never good"]
    assert world.calls["replanner"] == 0 and world.steps == ["a"]


# -- bad planner output ----------------------------------------------------------------------
BAD = {
    "cycle": {"nodes": [{"id": "a", "goal": "x", "depends_on": ["b"], "acceptance": "y"},
                        {"id": "b", "goal": "x", "depends_on": ["a"], "acceptance": "y"}]},
    "unknown dependency": {"nodes": [{"id": "a", "goal": "x", "depends_on": ["q"], "acceptance": "y"}]},
    "duplicate id": {"nodes": [{"id": "a", "goal": "x", "depends_on": [], "acceptance": "y"},
                               {"id": "a", "goal": "z", "depends_on": [], "acceptance": "y"}]},
    "schema violation": {"nodes": [{"id": "a", "goal": "x"}]},
    "not JSON": "First I will think about it.",
}
PROBLEM = {"cycle": "dependency cycle: a -> b -> a", "unknown dependency": "depends on unknown node 'q'",
           "duplicate id": "node id 'a' is used by more than one node", "schema violation": "'depends_on' is a required",
           "not JSON": "not JSON"}


@pytest.mark.parametrize("kind", sorted(BAD))
async def test_bad_planner_output_is_retried_with_the_problem_then_stops_typed(kind: str) -> None:
    world = World(plans=[BAD[kind]])
    result = await Agent(world.provider(), middleware=[PlanAct(plan_attempts=3)]).run("go")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    assert result.stop.error["kind"] == "plan_invalid" and PROBLEM[kind] in result.stop.detail
    assert world.calls == Counter(planner=3)  # bounded, and no executor turn ran
    retry = world.requests["planner"][1].messages
    assert retry[-1].text.startswith("That plan cannot be used: ") and PROBLEM[kind] in retry[-1].text


async def test_a_bad_plan_then_a_good_one_runs_and_failing_closed_is_an_option() -> None:
    world = World(plans=[BAD["cycle"], PLAN])
    result = await Agent(world.provider(), middleware=[PlanAct()]).run("go")
    assert result.stop.reason is StopReason.COMPLETED and world.steps == ["a", "b", "c"]
    world = World(plans=[BAD["cycle"]])
    result = await Agent(world.provider(), middleware=[PlanAct(on_exhausted="fail")]).run("go")
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.error["kind"] == "plan_invalid"
    assert world.calls["planner"] == 2


@pytest.mark.parametrize(("error", "stop"), [(ServerError("overloaded", status=503), StopReason.WAITING_HUMAN),
                                             (AuthenticationError("bad key", status=401), StopReason.FAILED_TERMINAL)])
async def test_a_failed_planner_call_is_a_typed_stop(error: Exception, stop: StopReason) -> None:
    world = World(plans=[error])
    result = await Agent(world.provider(), middleware=[PlanAct()]).run("go")
    assert result.stop.reason is stop and "the planner call failed" in result.stop.detail
    assert world.calls["executor"] == 0


# -- pause and resume mid-plan ---------------------------------------------------------------
async def test_a_budget_pause_mid_plan_resumes_at_the_same_node_without_planning_again() -> None:
    world = World(plans=[PLAN])
    store = MemoryStore()
    agent = Agent(world.provider(), store=store, middleware=[PlanAct()])
    paused = await agent.run("Add two numbers", max_iterations=2)
    assert paused.stop.reason is StopReason.PAUSED_BUDGET and world.steps == ["a", "b"]
    at_pause = (await plan_events(store, paused.session_id))[-1][1]
    assert at_pause.current is not None and at_pause.current.id == "c"
    result = await agent.resume(paused.session_id, max_iterations=10)
    assert result.stop.reason is StopReason.COMPLETED
    assert world.steps == ["a", "b", "c"] and world.calls["planner"] == 1


async def test_a_new_agent_on_the_same_sqlite_file_resumes_at_the_right_node(tmp_path: Any) -> None:
    """Process-independent: nothing but the store carries the plan across."""
    path = tmp_path / "sessions.db"
    first = World(plans=[PLAN])
    store = SQLiteStore(path)
    paused = await Agent(first.provider(), store=store, middleware=[PlanAct()]).run("Add two numbers",
                                                                                   max_iterations=1)
    await store.close()
    assert paused.stop.reason is StopReason.PAUSED_BUDGET and first.steps == ["a"]
    second = World(plans=[BAD["cycle"]])  # a planner call now would fail the run
    store = SQLiteStore(path)
    try:
        result = await Agent(second.provider(), store=store, middleware=[PlanAct()]).resume(
            paused.session_id, max_iterations=10)
        assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
        assert second.calls["planner"] == 0 and second.steps == ["b", "c"]
        final = (await plan_events(store, paused.session_id))[-1][1]
        assert [n.status for n in final.nodes] == [NodeStatus.PASSED] * 3 and final.version == 1
    finally:
        await store.close()


async def test_an_interrupt_mid_node_resumes_in_the_same_node() -> None:
    """Interrupted while node b's answer streams: the resumed run asks the model for b again (the
    cut answer is never checked), with no planner call."""
    import asyncio

    started = asyncio.Event()

    def act(request: MessageRequest, step: str | None) -> Any:
        if step == "b" and not started.is_set():
            started.set()
            return "word " * 300
        return f"result of {step}"

    world = World(plans=[PLAN], act=act)
    store = MemoryStore()
    agent = Agent(ScriptedProvider([world], repeat_last=True, stream_delay=0.01, chunk_chars=5), store=store,
                  middleware=[PlanAct()], control_poll=0.05)
    run = asyncio.ensure_future(agent.run("Add two numbers", session_id="i"))
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.sleep(0.2)
    await agent.control("i", Interrupt("stop"))
    stopped = await run
    assert stopped.stop.reason is StopReason.INTERRUPTED and world.steps == ["a", "b"]
    at_stop = (await plan_events(store, "i"))[-1][1]
    assert at_stop.current is not None and at_stop.current.id == "b" and at_stop.node("b").attempts == 0
    result = await agent.resume("i")
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert world.steps == ["a", "b", "b", "c"] and world.calls["planner"] == 1 and world.calls["grader"] == 3


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"{key}=7"


async def test_an_approval_mid_node_waits_and_resumes_in_the_same_node() -> None:
    """Tools and approvals apply inside a node as usual; a resume with the decision finishes the
    node's turn and the plan goes on."""

    def act(request: MessageRequest, step: str | None) -> Any:
        if step == "b" and request.messages[-1].role != "tool":
            return tool_call_response(("lookup", {"key": "second"}))
        return f"result of {step}"

    world = World(plans=[PLAN], act=act)
    store = MemoryStore()
    agent = Agent(world.provider(), tools=[lookup], store=store, middleware=[PlanAct(), HumanApproval(tools=["lookup"])])
    waiting = await agent.run("Add two numbers")
    assert waiting.stop.reason is StopReason.WAITING_HUMAN and world.steps == ["a", "b"]
    call_id = waiting.stop.pending_actions[0].call.id
    result = await agent.resume(waiting.session_id, decisions={call_id: Decision.approve()})
    assert result.stop.reason is StopReason.COMPLETED
    assert world.steps == ["a", "b", "b", "c"] and world.calls["planner"] == 1
    assert any(m.role == "tool" and m.text == "second=7" for m in result.messages)


# -- steer and stale -------------------------------------------------------------------------
async def test_a_steer_replans_the_remaining_nodes() -> None:
    steered = {"nodes": [{"id": "e", "goal": "Answer in French", "depends_on": ["a"], "acceptance": "French text"}]}
    world = World(plans=[PLAN], replans=[steered])
    store = MemoryStore()
    agent = Agent(world.provider(), store=store, middleware=[PlanAct(max_replans=0)])
    paused = await agent.run("Add two numbers", max_iterations=1)
    await agent.control(paused.session_id, Steer("answer in French"))
    result = await agent.resume(paused.session_id, max_iterations=10)
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert world.steps == ["a", "e"] and world.calls["replanner"] == 1
    final = (await plan_events(store, paused.session_id))[-1][1]
    assert final.goal_version == 2 and final.history[0].trigger is ReplanTrigger.STEER
    assert "answer in French" in final.history[0].reason
    assert {n.id: n.status.value for n in final.nodes} == {"a": "passed", "b": "skipped", "c": "skipped",
                                                           "e": "passed"}
    assert "answer in French" in world.requests["replanner"][0].messages[-1].text


async def test_a_node_that_runs_too_many_turns_is_stale_and_replanned() -> None:
    def act(request: MessageRequest, step: str | None) -> Any:
        if step == "b":
            return tool_call_response(("lookup", {"key": f"k{len(request.messages)}"}))
        return f"result of {step}"

    redo = {"nodes": [{"id": "f", "goal": "Guess the second number", "depends_on": ["a"], "acceptance": "a number"}]}
    world = World(plans=[PLAN], replans=[redo], act=act)
    store = MemoryStore()
    result = await Agent(world.provider(), tools=[lookup], store=store,
                         middleware=[PlanAct(max_turns_per_node=3)]).run("go")
    assert result.stop.reason is StopReason.COMPLETED, result.stop.detail
    assert world.steps == ["a", "b", "b", "b", "f"]
    final = (await plan_events(store, result.session_id))[-1][1]
    assert final.history[0].trigger is ReplanTrigger.STALE and final.history[0].node == "b"
    assert final.node("b").status is NodeStatus.SKIPPED
    assert "no answer to check after 3 model calls" in final.history[0].reason


# -- checks, options -------------------------------------------------------------------------
async def test_a_named_programmatic_check_decides_its_node_and_is_offered_to_the_planner() -> None:
    def has_number(ctx: Any, node: PlanNode) -> Verdict:
        """The answer holds a number."""
        ok = any(ch.isdigit() for ch in ctx.last_response.text)
        return Verdict(ok, "a number" if ok else "no number", (f"check:has_number:{node.id}",))

    plan = {"nodes": [{"id": "a", "goal": "Give a number", "depends_on": [], "acceptance": "a number",
                       "check": "has_number"},
                      {"id": "b", "goal": "Say thanks", "depends_on": ["a"], "acceptance": "thanks", "check": None}]}
    world = World(plans=[plan], act=lambda r, step: "7" if step == "a" else "thanks")
    result = await Agent(world.provider(), middleware=[PlanAct(checks={"has_number": has_number})]).run("go")
    assert result.stop.reason is StopReason.COMPLETED
    assert world.calls["grader"] == 1  # node b only
    assert "check:has_number:a" in result.stop.evidence_refs
    sent = world.requests["planner"][0]
    node_schema = sent.output_schema.schema["properties"]["nodes"]["items"]
    assert node_schema["properties"]["check"] == {"enum": ["has_number", None]}
    assert "has_number: The answer holds a number." in sent.messages[-1].text


async def test_a_given_plan_needs_no_planner_and_bad_options_are_refused() -> None:
    given = Plan("Add", (PlanNode("a", "first"), PlanNode("b", "second", ("a",))))
    world = World()
    result = await Agent(world.provider(), middleware=[PlanAct(plan=given, grade=False)]).run("Add")
    assert result.stop.reason is StopReason.COMPLETED and world.steps == ["a", "b"] and world.calls["planner"] == 0
    with pytest.raises(ConfigurationError, match="the given plan is invalid: node 'a' depends on itself"):
        PlanAct(plan=Plan("g", (PlanNode("a", "x", ("a",)),)))
    with pytest.raises(ConfigurationError, match="names checks that are not registered: \\['nope'\\]"):
        PlanAct(plan=Plan("g", (PlanNode("a", "x", check="nope"),)))
    with pytest.raises(ConfigurationError, match="on_exhausted must be 'human' or 'fail'"):
        PlanAct(on_exhausted="later")
    with pytest.raises(ConfigurationError, match="min_nodes <= max_nodes"):
        PlanAct(min_nodes=4, max_nodes=3)


async def test_the_numbered_form_is_what_the_planner_is_asked_for_when_set() -> None:
    plan = {"nodes": [{"id": "s1", "goal": "one", "depends_on": [], "acceptance": "done"},
                      {"id": "s2", "goal": "two", "depends_on": ["s1"], "acceptance": "done"}]}
    world = World(plans=[plan])
    result = await Agent(world.provider(), middleware=[PlanAct(numbered=True, max_nodes=3, grade=False)]).run("go")
    assert result.stop.reason is StopReason.COMPLETED and world.steps == ["s1", "s2"]
    nodes = world.requests["planner"][0].output_schema.schema["properties"]["nodes"]["anyOf"]
    assert [len(alt["prefixItems"]) for alt in nodes] == [1, 2, 3]
    assert [n["properties"]["id"] for n in nodes[-1]["prefixItems"]] == [{"const": "s1"}, {"const": "s2"},
                                                                        {"const": "s3"}]


async def test_update_plan_refuses_an_invalid_plan_or_a_version_going_back() -> None:
    ctx = Agent(ScriptedProvider([])).new_context([UserMessage("hi")])
    good = Plan("g", (PlanNode("a", "x"),), version=2)
    ctx.update_plan(good, "set")
    assert ctx.plan is good
    with pytest.raises(InvalidPlanError, match="depends on unknown node 'b'"):
        ctx.update_plan(Plan("g", (PlanNode("a", "x", ("b",)),), version=3), "bad")
    with pytest.raises(InvalidPlanError, match="version 1 is below the current plan's 2"):
        ctx.update_plan(Plan("g", (PlanNode("a", "x"),)), "older")
    assert ctx.plan is good
    with pytest.raises(AttributeError):
        ctx.plan = None  # type: ignore[misc]


def test_the_plugin_is_registered() -> None:
    from fsm_agent.plugins import load_plugin

    assert load_plugin("planact") is PlanAct


async def test_the_plan_note_is_rebuilt_in_the_system_message_each_turn() -> None:
    world = World(plans=[PLAN])
    await Agent(world.provider(), middleware=[PlanAct()]).run([SystemMessage("Be brief."), UserMessage("Add two numbers")])
    first = world.requests["executor"][0].messages[0].text
    assert first.startswith("Be brief.\n\nYou are following a plan. Current step a: Find the first number")
    third = world.requests["executor"][2].messages[0].text
    assert "Current step c: Add the two numbers" in third and "Steps already done: a, b." in third


async def test_an_offline_replay_answers_planner_replanner_and_grader_from_the_log() -> None:
    from fsm_agent.testing import replay_trajectory
    from fsm_agent_middleware.planact import recorded_planner

    def reject_b_once() -> Callable[[Any, PlanNode], Verdict | None]:
        tries: Counter[str] = Counter()

        def check(ctx: Any, node: PlanNode) -> Verdict | None:
            tries[node.id] += 1
            return Verdict(False, "no number") if node.id == "b" and tries["b"] == 1 else None

        return check

    redo = {"nodes": [{"id": "b", "goal": "Look b up", "depends_on": ["a"], "acceptance": "a number"},
                      {"id": "c", "goal": "Add", "depends_on": ["b"], "acceptance": "the sum"}]}
    world = World(plans=[PLAN], replans=[redo], grade=lambda r: (True, f"fine {len(r.messages[-1].text)}"))
    store = MemoryStore()
    recorded = await Agent(world.provider(), store=store, middleware=[PlanAct(check=reject_b_once())]).run(
        "Add two numbers", session_id="rec")
    assert recorded.stop.reason is StopReason.COMPLETED and world.calls["grader"] == 3
    events = await store.read_events("rec", types=("plan_updated",))
    again = Agent(ScriptedProvider([]), middleware=[PlanAct(provider=recorded_planner(events), check=reject_b_once())])
    report = await replay_trajectory(store, "rec", again)
    assert report.ok, report.summary()
    # the answers run out honestly, and an executor call is refused
    empty = recorded_planner([])
    from fsm_agent.errors import ProviderError

    with pytest.raises(ProviderError, match="no more 'plan' answers"):
        await empty.chat(world.requests["planner"][0])
    with pytest.raises(ProviderError, match="only PlanAct's planner, replanner and grader calls"):
        await empty.chat(world.requests["executor"][0])
