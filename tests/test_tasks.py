"""Task mode (issue 23 item 1; seed 000: ``run_task`` beside ``process_message``): a task definition
(goal, inputs, constraints, allowed tools, budget, output schema, acceptance checks) in, a task
result (outcome, validated output, checks and evidence, usage, cost, the stop) out, through the
public API: ``Agent.run_task`` / ``resume_task`` and the task file format."""

from __future__ import annotations

import textwrap
from typing import Any

import orjson
import pytest

from fsm_agent import (
    AcceptanceCheck,
    Agent,
    OutputSchema,
    Permissions,
    RunConfig,
    Scope,
    ScriptedProvider,
    SQLiteStore,
    StopReason,
    Task,
    TaskBudget,
    TaskDefinitionError,
    TaskOutcome,
    ToolUseBlock,
    UserMessage,
    tool,
)
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore
from fsm_agent.testing import EffectRecording

CITY = OutputSchema("city", {"type": "object", "properties": {"name": {"type": "string"},
                                                              "population": {"type": "integer"}},
                             "required": ["name", "population"], "additionalProperties": False})
LOOKED_UP: list[str] = []


@tool
def lookup_city(country: str) -> dict:
    """Look up the largest city of a country.

    Args:
        country: the country's name.
    """
    LOOKED_UP.append(country)
    return {"name": "Paris", "population": 2102650}


@tool
def send_mail(to: str) -> str:
    """Send a mail.

    Args:
        to: the address.
    """
    return "sent"


@pytest.fixture(autouse=True)
def _clear() -> None:
    LOOKED_UP.clear()


def city_task(**kw: Any) -> Task:
    base: dict[str, Any] = dict(
        goal="Find the largest city of the country given, and its population.", inputs={"country": "France"},
        constraints=["Use the lookup tool; do not answer from memory."], allowed_tools=["lookup_city"],
        budget=TaskBudget(max_iterations=6), output_schema=CITY,
        checks=[AcceptanceCheck.on_value("a real population", "output.population", gt=1_000_000),
                AcceptanceCheck.on_value("names a city", "output.name", matches="[A-Z][a-z]+")],
        name="largest-city")
    base.update(kw)
    return Task(**base)


def answer(name: str, population: int) -> str:
    return orjson.dumps({"name": name, "population": population}).decode()


LOOKUP = tool_call_response(ToolUseBlock("t1", "lookup_city", {"country": "France"}))


async def test_run_task_returns_the_outcome_validated_output_checks_evidence_usage_cost_and_stop() -> None:
    provider = ScriptedProvider([LOOKUP, answer("Paris", 2102650)])
    agent = Agent(provider, tools=[lookup_city, send_mail], store=MemoryStore())
    result = await agent.run_task(city_task())
    assert result.outcome is TaskOutcome.SUCCEEDED and result.ok
    assert result.output == {"name": "Paris", "population": 2102650}
    assert result.stop.reason is StopReason.COMPLETED
    assert [(c.name, c.ok) for c in result.checks] == [("a real population", True), ("names a city", True)]
    assert "check[a real population] passed: 'output.population' gt 1000000" in result.evidence
    assert result.usage.total_tokens == 30 and result.cost_usd is None or result.cost_usd >= 0
    assert result.run.tool_calls == 1 and LOOKED_UP == ["France"]
    # the first message states the task; the model is offered the allowed tools only, and asked for the schema
    first = provider.requests[0]
    prompt = first.messages[-1].text
    assert prompt.startswith("TASK: Find the largest city") and '"country": "France"' in prompt
    assert "- Use the lookup tool; do not answer from memory." in prompt and "- a real population" in prompt
    assert [t.name for t in first.tools] == ["lookup_city"]
    assert first.output_schema == CITY
    assert result.to_json()["outcome"] == "succeeded"


async def test_conversation_mode_is_unchanged() -> None:
    provider = ScriptedProvider(["plain answer"])
    result = await Agent(provider, tools=[lookup_city, send_mail]).run("hi")
    assert result.output == "plain answer" and provider.requests[0].output_schema is None
    assert len(provider.requests[0].tools) == 2 and provider.requests[0].messages == (UserMessage("hi"),)


async def test_a_failed_check_goes_back_to_the_model_and_a_repaired_answer_succeeds() -> None:
    provider = ScriptedProvider([answer("Paris", 5), answer("Paris", 2102650)])
    result = await Agent(provider, tools=[lookup_city]).run_task(city_task())
    assert result.outcome is TaskOutcome.SUCCEEDED and result.output["population"] == 2102650
    feedback = provider.requests[1].messages[-1].text
    assert feedback.startswith("Your answer did not pass the task's acceptance checks: a real population: "
                               "'output.population' is 5: not gt 1000000")


async def test_checks_still_failing_after_the_repairs_fail_the_task() -> None:
    provider = ScriptedProvider([answer("paris", 5)], repeat_last=True)
    result = await Agent(provider, tools=[lookup_city]).run_task(city_task(max_repairs=1))
    assert result.outcome is TaskOutcome.FAILED and result.output is None
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.error["kind"] == "verification_failed"
    assert [(c.name, c.ok) for c in result.checks] == [("a real population", False), ("names a city", False)]
    assert len(provider.requests) == 2  # the answer and one repair
    assert result.answer == answer("paris", 5)


async def test_on_check_failure_human_waits_for_a_person() -> None:
    provider = ScriptedProvider([answer("paris", 5)], repeat_last=True)
    result = await Agent(provider).run_task(city_task(max_repairs=0, on_check_failure="human", allowed_tools=None))
    assert result.outcome is TaskOutcome.INCOMPLETE and result.stop.reason is StopReason.WAITING_HUMAN


async def test_allowed_tools_are_the_task_sessions_permissions() -> None:
    provider = ScriptedProvider([tool_call_response(ToolUseBlock("m1", "send_mail", {"to": "a@b.c"})), LOOKUP,
                                 answer("Paris", 2102650)])
    store = MemoryStore()
    result = await Agent(provider, tools=[lookup_city, send_mail], store=store).run_task(city_task())
    assert result.ok
    denied = [e.payload for e in await store.read_events(result.session_id) if e.type == "permission_denied"]
    assert denied == [{"call_id": "m1", "tool": "send_mail", "permission": "tools", "rule": "",
                       "detail": "tool 'send_mail' is not among the tools this session may call (lookup_city)"}]


async def test_the_tasks_permissions_narrow_the_callers_and_carry_argument_scopes() -> None:
    task = city_task(permissions=Permissions(scopes=[Scope.of("lookup_city", "country", **{"in": ["Italy"]})]))
    provider = ScriptedProvider([LOOKUP, answer("Paris", 2102650)])
    result = await Agent(provider, tools=[lookup_city, send_mail]).run_task(
        task, permissions=Permissions(tools=["lookup_city", "send_mail"]))
    assert LOOKED_UP == [] and result.ok  # the lookup was denied (France is outside the scope)
    assert [t.name for t in provider.requests[0].tools] == ["lookup_city"]


async def test_the_budget_pauses_the_task_and_resume_task_finishes_it() -> None:
    store = MemoryStore()
    agent = Agent(ScriptedProvider([LOOKUP, answer("Paris", 2102650)]), tools=[lookup_city], store=store)
    paused = await agent.run_task(city_task(budget=TaskBudget(max_iterations=1)))
    assert paused.outcome is TaskOutcome.INCOMPLETE and paused.stop.reason is StopReason.PAUSED_BUDGET
    done = await agent.resume_task(paused.session_id, max_iterations=3)  # the stored definition
    assert done.outcome is TaskOutcome.SUCCEEDED and done.output["name"] == "Paris"


async def test_a_task_session_resumed_by_a_plain_resume_elsewhere_still_runs_its_checks(tmp_path: Any) -> None:
    db = tmp_path / "t.db"
    first = Agent(ScriptedProvider([LOOKUP]), tools=[lookup_city], store=SQLiteStore(db))
    paused = await first.run_task(city_task(budget=TaskBudget(max_iterations=1)), session_id="t1")
    assert paused.stop.reason is StopReason.PAUSED_BUDGET
    provider = ScriptedProvider([answer("Paris", 7), answer("Paris", 2102650)])
    second = Agent(provider, tools=[lookup_city], store=SQLiteStore(db))  # knows nothing of the task
    run = await second.resume("t1", max_iterations=5)
    assert run.stop.reason is StopReason.COMPLETED and run.output_data == {"name": "Paris", "population": 2102650}
    assert "acceptance checks" in provider.requests[1].messages[-1].text  # the check sent the 7 back


async def test_python_checks_by_reference_and_by_callable() -> None:
    def short(answer: Any) -> tuple[bool, str]:
        return len(answer.text) < 200, "too long"

    task = city_task(checks=[AcceptanceCheck.python_ref("round", "task_checks:population_is_round"),
                             AcceptanceCheck.python_ref("named", "task_checks:mentions_the_city"),
                             AcceptanceCheck.function("short", short)])
    provider = ScriptedProvider([answer("Paris", 2102650), answer("Paris", 2102000)])
    result = await Agent(provider).run_task(task)
    assert result.ok and result.output["population"] == 2102000
    assert "round: population 2102650 is not rounded to thousands" in provider.requests[1].messages[-1].text
    assert {c.name for c in result.checks} == {"round", "named", "short"}


async def test_a_graded_check_asks_a_grader_model_after_the_other_checks_pass() -> None:
    provider = ScriptedProvider([answer("Paris", 2102650), '{"ok": false, "reason": "no source is named"}',
                                 answer("Paris", 2102650), '{"ok": true, "reason": "fine"}'])
    task = city_task(checks=[AcceptanceCheck.on_value("a real population", "output.population", gt=1_000_000),
                             AcceptanceCheck.graded("sourced", "The answer names its source.")])
    result = await Agent(provider).run_task(task)
    assert result.ok
    grading = provider.requests[1].messages[-1].text
    assert "CRITERION TO JUDGE: The answer names its source." in grading
    assert "sourced: no source is named" in provider.requests[2].messages[-1].text
    assert any(e.startswith("grader:") for e in result.evidence)
    assert result.usage.total_tokens == 60  # the grader's calls count toward the task's usage


# -- the definition ---------------------------------------------------------------------------------------
TASK_TOML = textwrap.dedent('''
    name = "largest-city"
    goal = "Find the largest city of the country given and its population."
    constraints = ["Use the lookup tool; do not answer from memory."]
    allowed_tools = ["lookup_city"]

    [inputs]
    country = "France"

    [budget]
    max_iterations = 8
    max_cost_usd = 0.05

    [output_schema]
    name = "city"
    schema = { type = "object", properties = { name = { type = "string" }, population = { type = "integer" } }, required = ["name", "population"], additionalProperties = false }

    [[check]]
    name = "a real population"
    value = "output.population"
    gt = 1000000

    [[check]]
    name = "round"
    python = "task_checks:population_is_round"
''')


def test_a_task_file_loads_and_round_trips(tmp_path: Any) -> None:
    path = tmp_path / "task.toml"
    path.write_text(TASK_TOML)
    task = Task.from_file(path)
    assert task.goal.startswith("Find the largest city") and task.inputs == {"country": "France"}
    assert task.budget == TaskBudget(max_iterations=8, max_cost_usd=0.05) and task.output_schema == CITY
    assert [c.kind for c in task.checks] == ["value", "python"]
    assert Task.from_dict(task.to_dict()) == task
    as_json = tmp_path / "task.json"
    as_json.write_text(orjson.dumps(task.to_dict()).decode())
    assert Task.from_file(as_json) == task


def test_a_bad_task_definition_names_every_problem() -> None:
    with pytest.raises(TaskDefinitionError) as info:
        Task.from_dict({"goal": "", "inputs": [], "budget": {"max_iterations": 0, "tokens": 5},
                        "check": [{"name": "a", "value": "output.x", "gt": "big"}, {"name": "b"},
                                  {"name": "c", "python": "not a ref"}, {"name": "d", "function": "f"}],
                        "on_check_failure": "maybe", "colour": "red"}, source="t.toml")
    problems = "\n".join(info.value.problems)
    for expected in ("t.toml: unknown key 'colour'", "t.toml: 'inputs' has the wrong type",
                     "budget: 'max_iterations' must be a whole number above 0", "budget: unknown key 'tokens'",
                     "check 1: check 'a': 'gt' needs a number", "check 2: check 'b': give exactly one of",
                     "check 3: check 'c': 'python' must be \"module:function\"",
                     "a check given as a Python callable cannot be rebuilt",
                     "'goal' must say what to do", "'on_check_failure' must be \"fail\" or \"human\""):
        assert expected in problems, expected


async def test_a_task_run_replays_exactly() -> None:
    recording = EffectRecording()
    task = city_task(checks=[AcceptanceCheck.on_value("a real population", "output.population", gt=1_000_000),
                             AcceptanceCheck.graded("sourced", "The answer names its source.")])
    agent = Agent(ScriptedProvider([LOOKUP, answer("Paris", 2102650), '{"ok": true, "reason": "fine"}']),
                  tools=[lookup_city], store=MemoryStore(), config=RunConfig(max_iterations=10))
    recorded = await agent.run_task(task, session_id="rt", port=recording.record)
    replaying = Agent(ScriptedProvider([]), tools=[lookup_city], store=MemoryStore(),
                      config=RunConfig(max_iterations=10))
    replayed = await replaying.run_task(task, session_id="rt", port=recording.replay)
    recording.check()
    assert replayed == recorded and replayed.ok


async def test_checks_cannot_share_a_chain_with_planact() -> None:
    from fsm_agent import ChainError
    from fsm_agent_middleware.planact import PlanAct

    agent = Agent(ScriptedProvider(["x"]), middleware=[PlanAct()])
    with pytest.raises(ChainError, match="PlanAct completes a run"):
        await agent.run_task(city_task(allowed_tools=None))
