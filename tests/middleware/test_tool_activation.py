"""ToolActivation: at most max_active tools are offered per turn, the least recently used is evicted,
always_on tools stay, a called tool becomes most recent, the activate_tool meta-tool brings an evicted
tool back, idle tools are evicted at the tick, and more than 25 offered tools log one warning."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from fsm_agent import (
    Agent,
    ConfigurationError,
    Middleware,
    RunConfig,
    ScriptedProvider,
    StopReason,
    Tool,
    ToolResultMessage,
)
from fsm_agent.providers import tool_call_response
from fsm_agent.tools.demo import calculator, clock
from fsm_agent_middleware.budget import Budget
from fsm_agent_middleware.tool_activation import ToolActivation
from fsm_agent_middleware.tool_policy import ToolPolicy

NAMES = ["one", "two", "three", "four", "five"]


def make_tool(name: str) -> Tool:
    def fn() -> str:
        return f"{name} ran"

    return Tool(fn, name=name, description=f"Tool {name}.\nMore text.")


TOOLS = [make_tool(n) for n in NAMES]


def offered(request: Any) -> list[str]:
    return [t.name for t in request.tools]


def results(result: Any) -> list[tuple[str, bool]]:
    return [(m.text, m.is_error) for m in result.messages if isinstance(m, ToolResultMessage)]


async def run(script: list[Any], activation: ToolActivation, *more: Any, tools: Any = TOOLS,
              **cfg: Any) -> tuple[Any, ScriptedProvider]:
    provider = ScriptedProvider(script)
    result = await Agent(provider, tools=tools, middleware=[activation, *more], config=RunConfig(**cfg)).run("go")
    return result, provider


def call(tool_name: str, **args: Any) -> Any:
    return tool_call_response((tool_name, args))


async def test_first_turn_offers_always_on_plus_the_first_registered_and_the_meta_tool() -> None:
    _, provider = await run(["done"], ToolActivation(3, always_on=["four"]))
    (request,) = provider.requests
    assert offered(request) == ["one", "two", "four", "activate_tool"]
    meta = request.tools[-1]
    assert meta.description == ("Activate a tool that is not offered right now; you can call it from your next "
                                "step. Inactive tools: three (Tool three.); five (Tool five.).")
    assert meta.parameters == {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "enum": ["three", "five"], "description": "the tool to activate"}}}


async def test_lru_eviction_and_reactivation_by_the_meta_tool() -> None:
    script = [call("two"), call("activate_tool", name="five"), call("one"), call("activate_tool", name="three"),
              call("five"), "done"]
    result, provider = await run(script, ToolActivation(3, always_on=["four"]))
    assert result.stop.reason is StopReason.COMPLETED
    assert [offered(r) for r in provider.requests] == [
        ["one", "two", "four", "activate_tool"],    # two slots, filled in registration order: one, two
        ["one", "two", "four", "activate_tool"],    # two was called: most recent is two, then one
        ["two", "four", "five", "activate_tool"],   # five activated: one, the least recently used, evicted
        ["one", "four", "five", "activate_tool"],   # one (inactive) was called directly: it ran; two evicted
        ["one", "three", "four", "activate_tool"],  # three activated: five evicted
        ["three", "four", "five", "activate_tool"],  # five called directly: one evicted
    ]
    enums = [r.tools[-1].parameters["properties"]["name"]["enum"] for r in provider.requests]
    assert enums == [["three", "five"], ["three", "five"], ["one", "three"], ["two", "three"], ["two", "five"],
                     ["one", "two"]]
    assert results(result) == [
        ("two ran", False), ("Tool 'five' is active from your next step.", False), ("one ran", False),
        ("Tool 'three' is active from your next step.", False), ("five ran", False)]


async def test_always_on_tools_are_never_evicted_and_a_direct_call_reactivates() -> None:
    script = [call("three"), call("five"), call("four"), "done"]
    result, provider = await run(script, ToolActivation(3, always_on=["four"]))
    assert [offered(r) for r in provider.requests] == [
        ["one", "two", "four", "activate_tool"],
        ["one", "three", "four", "activate_tool"],   # three (inactive) ran and is now most recent; two evicted
        ["three", "four", "five", "activate_tool"],  # five ran; one evicted
        ["three", "four", "five", "activate_tool"],  # four is always on: calling it evicts nothing
    ]
    assert results(result) == [("three ran", False), ("five ran", False), ("four ran", False)]


async def test_meta_tool_answers_unknown_and_already_active_names() -> None:
    script = [call("activate_tool", name="six"), call("activate_tool", name="four"),
              call("activate_tool", name="one"), "done"]
    result, _ = await run(script, ToolActivation(3, always_on=["four"]))
    assert results(result) == [
        ("Unknown tool 'six'; tools you can activate: three, five.", True),
        ("Tool 'four' is already active.", False),
        ("Tool 'one' is already active.", False),
    ]
    assert result.tool_calls == 0  # answered by the middleware; nothing ran


async def test_meta_tool_call_is_answered_before_a_deny_by_default_policy() -> None:
    policy = ToolPolicy([{"tool": "t*", "action": "allow"}], default="deny")
    activation = ToolActivation(2)
    agent = Agent(ScriptedProvider([]), tools=TOOLS, middleware=[policy, Budget(max_tool_calls=1), activation])
    assert [m.middleware_name for m in agent.middleware] == ["tool_activation", "tool_policy", "budget"]
    script = [call("activate_tool", name="three"), call("three"), "done"]
    result, _ = await run(script, activation, policy, Budget(max_tool_calls=1))
    assert results(result) == [("Tool 'three' is active from your next step.", False), ("three ran", False)]


async def test_idle_tools_are_evicted_at_the_tick() -> None:
    script = [call("one"), call("one"), call("one"), "done"]
    _, provider = await run(script, ToolActivation(None, max_idle_turns=2), tools=TOOLS[:3])
    assert [offered(r) for r in provider.requests] == [
        ["one", "two", "three"],
        ["one", "two", "three"],
        ["one", "activate_tool"],  # two and three: 2 completed turns without a call
        ["one", "activate_tool"],
    ]


async def test_wrap_up_turn_gets_no_meta_tool() -> None:
    script = [call("one"), "answer"]
    result, provider = await run(script, ToolActivation(2), Budget(max_model_calls=1, wrap_up=True))
    assert result.stop.reason is StopReason.COMPLETED
    assert offered(provider.requests[0]) == ["one", "two", "activate_tool"]
    assert provider.requests[1].tools == ()


async def test_more_than_25_offered_tools_log_one_warning_per_run(caplog: pytest.LogCaptureFixture) -> None:
    """Seed 000 §5.2.5: the loop warns on a run's first call when more than 25 tools are offered."""
    many = [make_tool(f"t{i}") for i in range(30)]
    agent = Agent(ScriptedProvider([call("t1"), "done", "again"]), tools=many, middleware=[ToolActivation(None)])
    with caplog.at_level(logging.WARNING, logger="fsm_agent.driver"):
        first = await agent.run("go")  # two model calls, one warning
        second = await agent.run("go again")
    warnings = [r.getMessage() for r in caplog.records if r.name == "fsm_agent.driver"]
    assert warnings == [
        f"session {first.session_id}: 30 tools are offered to the model (more than 25); most models choose worse "
        "from long tool lists: offer fewer (tool_activation, a deny policy)",
        f"session {second.session_id}: 30 tools are offered to the model (more than 25); most models choose worse "
        "from long tool lists: offer fewer (tool_activation, a deny policy)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fsm_agent.driver"):
        _, provider = await run(["done"], ToolActivation(), tools=many)  # the default bound: 25
    assert caplog.records == [] and len(provider.requests[0].tools) == 26


async def test_bad_registry_fails_the_run_at_the_first_pre_turn() -> None:
    result, _ = await run(["done"], ToolActivation(3, always_on=["nope"]))
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.detail == (
        "middleware 'tool_activation' failed in pre_turn: ConfigurationError: ToolActivation: always_on names "
        "unregistered tool(s) 'nope' (registered: one, two, three, four, five)")
    result, _ = await run(["done"], ToolActivation(3, activation_tool="two"))
    assert result.stop.detail.endswith("a registered tool is already named 'two'; pass activation_tool='another_name'")


@pytest.mark.parametrize("args,kw,message", [
    ((0,), {}, "ToolActivation: max_active must be an integer >= 1 or None, not 0"),
    ((True,), {}, "ToolActivation: max_active must be an integer >= 1 or None, not True"),
    ((2,), {"always_on": ["a", "b"]},
     "ToolActivation: max_active=2 leaves no slot beyond the 2 always_on tool(s); raise it or shorten always_on"),
    ((5,), {"max_idle_turns": 0}, "ToolActivation: max_idle_turns must be an integer >= 1 or None, not 0"),
])
def test_invalid_options(args: tuple[Any, ...], kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as exc:
        ToolActivation(*args, **kw)
    assert str(exc.value) == message


def test_repr_shows_the_options() -> None:
    assert repr(ToolActivation(4, always_on="calculator", max_idle_turns=3)) == (
        "ToolActivation(max_active=4, always_on=['calculator'], max_idle_turns=3, "
        "activation_tool='activate_tool')")


# -- the real local model ------------------------------------------------------------------------


@pytest.mark.llama
async def test_llama_sees_only_the_active_tools(local_provider: Any) -> None:
    seen: list[Any] = []

    class Spy(Middleware):
        async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
            seen.append(request)
            return await call_next(request)

    weather, translate = make_tool("weather"), make_tool("translate")
    cfg = RunConfig(tool_choice="required", temperature=0.0, max_output_tokens=100, max_iterations=2)
    # Spy is listed after ToolActivation, so it sees each request with the meta-tool added
    result = await Agent(local_provider, tools=[calculator, clock, weather, translate],
                         middleware=[ToolActivation(2, always_on=["calculator"]), Spy()], config=cfg).run(
        "Use the calculator to compute 17 * 23.")
    assert result.stop.reason is StopReason.PAUSED_BUDGET and result.turns == 2
    assert [offered(r) for r in seen][0] == ["calculator", "clock", "activate_tool"]
    first_call = result.messages[1].tool_calls[0]  # the constrained grammar only admits offered tools
    assert first_call.name in {"calculator", "clock", "activate_tool"}
    if first_call.name == "activate_tool":
        assert first_call.input["name"] in {"weather", "translate"}
        expected = ["calculator", first_call.input["name"], "activate_tool"]
    else:
        expected = ["calculator", "clock", "activate_tool"]
    assert sorted(offered(seen[1])) == sorted(expected)
