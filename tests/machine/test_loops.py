"""Loop detection in the engine (issue 23 item 2; seed 000 §5.4): a plain ``Agent()`` warns a model
that repeats its tool calls with the same results, then does what ``LoopConfig.then`` says; a repeat
counts only once its result is in (issue 19 item 6); the verdicts replay."""

from __future__ import annotations

from typing import Any

import pytest

from fsm_agent import (Agent, ConfigurationError, LoopConfig, MemoryStore, RunConfig, ScriptedProvider, StopReason,
                       tool)
from fsm_agent.loops import NOTICE_PREFIX
from fsm_agent.providers import tool_call_response
from fsm_agent.types import (AssistantMessage, Message, PolicyDecision, RunResult, TextBlock, ToolResultMessage,
                             ToolUseBlock, UserMessage)
from fsm_agent_middleware.loop_detection import LoopDetection

from .replay_kit import never_called, outcome_of, roundtrip

SID = "loops"


class Tools:
    """``status(job)`` and ``log(job)``: each answers from its own list of results, in order, and
    counts its runs."""

    def __init__(self, status: list[str], log: list[str] | None = None, check: list[str] | None = None) -> None:
        self.answers = {"status": list(status), "log": list(log or []), "check": list(check or [])}
        self.ran: list[str] = []

        def answer(name: str) -> str:
            self.ran.append(name)
            return self.answers[name].pop(0)

        @tool
        def status(job: str) -> str:
            """A job's status.

            Args:
                job: the job.
            """
            return answer("status")

        @tool
        def log(job: str) -> str:
            """A job's log.

            Args:
                job: the job.
            """
            return answer("log")

        @tool
        def check(job: str) -> str:
            """A job's checks.

            Args:
                job: the job.
            """
            return answer("check")

        self.tools = [status, log, check]


def call(cid: str, name: str = "status", job: str = "7") -> ToolUseBlock:
    return ToolUseBlock(cid, name, {"job": job})


def turn(*calls: ToolUseBlock) -> Any:
    return tool_call_response(*calls)


class Decisions:
    def __init__(self) -> None:
        self.seen: list[PolicyDecision] = []

    def on_policy_decision(self, event: PolicyDecision) -> None:
        self.seen.append(event)


async def run(script: list[Any], tools: Tools, config: RunConfig | None = None, **kw: Any
              ) -> tuple[RunResult, ScriptedProvider, Agent, Decisions]:
    provider = ScriptedProvider(script)
    seen = Decisions()
    agent = Agent(provider, tools=tools.tools, store=MemoryStore(), config=config, observers=[seen], **kw)
    result = await agent.run("watch job 7", session_id=SID)
    return result, provider, agent, seen


def notices(messages: tuple[Message, ...] | list[Message]) -> list[str]:
    return [m.text for m in messages if isinstance(m, UserMessage) and m.text.startswith(NOTICE_PREFIX)]


async def logged(agent: Agent) -> list[dict[str, Any]]:
    return [e.payload for e in await agent.store.read_events(SID, types=("loop_detected",))]


def warning(what: str, count: int, shown: str, after: str = "Repeating it will not change the result.") -> str:
    return (f"{NOTICE_PREFIX} Loop detected: you {what} {count} times in a row and got the same result every "
            f"time ({shown}). {after} Please try a different approach: use the results you already have, change "
            "the arguments, or give your final answer.")


STATUS = 'status {"job":"7"}'
LOG = 'log {"job":"7"}'
CHECK = 'check {"job":"7"}'


# -- the default: a warning, as the seed has it ---------------------------------------------------------------
async def test_a_plain_agent_warns_after_three_same_results_and_goes_on_warning() -> None:
    tools = Tools(["running"] * 4)
    script = [turn(call(f"c{i}")) for i in range(1, 5)] + ["I will wait"]
    result, provider, agent, seen = await run(script, tools)

    assert result.stop.reason is StopReason.COMPLETED and result.output == "I will wait"
    assert tools.ran == ["status"] * 4  # the seed's default never blocks
    first = warning(f"called {STATUS}", 3, "'running'")
    again = warning(f"called {STATUS}", 4, "'running'")
    assert [notices(r.messages) for r in provider.requests] == [[], [], [], [first], [again]]
    assert provider.requests[3].messages[-1] == UserMessage(first)  # the last thing the model reads
    assert notices(result.messages) == []  # in the context, not the transcript
    assert await logged(agent) == [
        {"action": "warn", "pattern": [STATUS], "length": 1, "count": 3, "then": "warn"},
        {"action": "warn", "pattern": [STATUS], "length": 1, "count": 4, "then": "warn"}]
    assert seen.seen == [PolicyDecision(SID, 3, "loop_detection", "PreTurn", "warn", first),
                         PolicyDecision(SID, 4, "loop_detection", "PreTurn", "warn", again)]


async def test_a_repeat_counts_only_once_its_result_is_in() -> None:
    # polling: the same call whose answer changes is progress (issue 19 item 6), even when the
    # configured answer is to stop the run
    tools = Tools(["10%", "45%", "90%", "100%"])
    script = [turn(call(f"c{i}")) for i in range(1, 5)] + ["done"]
    result, provider, agent, _ = await run(script, tools, RunConfig(loop_detection=LoopConfig(then="stop")))
    assert result.stop.reason is StopReason.COMPLETED and tools.ran == ["status"] * 4
    assert [notices(r.messages) for r in provider.requests] == [[]] * 5 and await logged(agent) == []

    # three identical calls proposed together are not judged before their results are in
    tools = Tools(["running"] * 3)
    script = [turn(call("p1"), call("p2"), call("p3")), "done"]
    result, provider, agent, _ = await run(script, tools, RunConfig(loop_detection=LoopConfig(then="stop")))
    assert result.stop.reason is StopReason.COMPLETED and tools.ran == ["status"] * 3
    assert notices(provider.requests[1].messages) == [
        warning(f"called {STATUS}", 3, "'running'",
                "Repeating it will not change the result, and repeating it again ends the run.")]


async def test_a_new_user_input_starts_an_empty_history() -> None:
    history = [UserMessage("watch job 7"),
               AssistantMessage((call("c1"),)), ToolResultMessage("c1", "running", name="status"),
               AssistantMessage((call("c2"),)), ToolResultMessage("c2", "running", name="status"),
               AssistantMessage((TextBlock("still running"),)), UserMessage("and now?")]
    tools = Tools(["running"] * 2)
    provider = ScriptedProvider([turn(call("c3")), turn(call("c4")), "still running"])
    agent = Agent(provider, tools=tools.tools, store=MemoryStore())
    result = await agent.run(history, session_id=SID)
    assert result.stop.reason is StopReason.COMPLETED and tools.ran == ["status"] * 2
    assert [notices(r.messages) for r in provider.requests] == [[]] * 3

    # the same history without the new input: the third "running" makes a loop
    provider = ScriptedProvider([turn(call("c3")), "still running"])
    agent = Agent(provider, tools=Tools(["running"]).tools, store=MemoryStore())
    await agent.run(history[:5], session_id=SID)
    assert [len(notices(r.messages)) for r in provider.requests] == [0, 1]


# -- after the warning: block, stop ----------------------------------------------------------------------------
async def test_then_block_answers_a_call_that_goes_on_with_the_loop_without_running_it() -> None:
    tools = Tools(["running"] * 3)
    script = [turn(call(f"c{i}")) for i in range(1, 6)] + ["giving up"]
    result, provider, agent, seen = await run(script, tools, RunConfig(loop_detection=LoopConfig(then="block")))

    assert result.stop.reason is StopReason.COMPLETED and result.output == "giving up"
    assert tools.ran == ["status"] * 3  # the 4th and 5th proposals did not run
    blocked = (f"Not run: loop detected. {STATUS} came back 3 times in a row with the same result each time "
               "('running'), and you were warned; running it again will not change that. Use the results you "
               "already have, change the arguments or the approach, or give your final answer.")
    results = {m.tool_call_id: m for m in result.messages if isinstance(m, ToolResultMessage)}
    for cid in ("c4", "c5"):
        assert results[cid] == ToolResultMessage(cid, blocked, is_error=True, name="status",
                                                 metadata={"denied_by": "loop_detection"})
    assert provider.requests[4].messages[-2] == results["c4"]  # the model reads why
    warn = warning(f"called {STATUS}", 3, "'running'",
                   "Repeating it will not change the result, and it will not be run again.")
    assert [notices(r.messages) for r in provider.requests] == [[], [], [], [warn], [warn], [warn]]
    entry = {"pattern": [STATUS], "length": 1, "count": 3, "then": "block"}
    assert await logged(agent) == [{"action": "warn", **entry}, {"action": "block", **entry, "call_id": "c4"},
                                   {"action": "warn", **entry}, {"action": "block", **entry, "call_id": "c5"},
                                   {"action": "warn", **entry}]
    assert [(d.decision, d.hook, d.call.id if d.call else None) for d in seen.seen] == [
        ("warn", "PreTurn", None), ("deny", "MidTurn", "c4"), ("warn", "PreTurn", None), ("deny", "MidTurn", "c5"),
        ("warn", "PreTurn", None)]


async def test_then_stop_ends_the_run_with_a_typed_stop_before_the_call_runs() -> None:
    tools = Tools(["running"] * 3)
    script = [turn(call(f"c{i}")) for i in range(1, 5)] + ["never asked"]
    result, provider, agent, seen = await run(script, tools, RunConfig(loop_detection=LoopConfig(then="stop")))

    assert tools.ran == ["status"] * 3 and len(provider.requests) == 4
    detail = (f"loop detected: {STATUS} came back 3 times in a row with the same result each time ('running'); "
              "after a warning the model proposed it again, so the run was stopped before spending its budget")
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.stop.detail == detail
    assert result.stop.error == {"kind": "loop_detected", "pattern": [STATUS], "count": 3, "call_id": "c4"}
    entry = {"pattern": [STATUS], "length": 1, "count": 3, "then": "stop"}
    assert await logged(agent) == [{"action": "warn", **entry}, {"action": "stop", **entry, "call_id": "c4"}]
    assert [(d.decision, d.hook, d.stop_reason) for d in seen.seen] == [
        ("warn", "PreTurn", None), ("stop", "MidTurn", "FAILED_TERMINAL")]


async def test_patterns_of_two_calls() -> None:
    tools = Tools(["running"] * 3, log=["no new lines"] * 3)
    pairs = [[call(f"s{i}"), call(f"l{i}", "log")] for i in range(1, 5)]
    script = [turn(c) for pair in pairs for c in pair] + ["done"]
    result, provider, agent, _ = await run(script, tools, RunConfig(loop_detection=LoopConfig(then="block")))

    assert tools.ran == ["status", "log"] * 3 and result.stop.reason is StopReason.COMPLETED
    warn = warning(f"repeated the sequence {STATUS} -> {LOG}", 3, "'running'; 'no new lines'",
                   "Repeating it will not change the result, and it will not be run again.")
    assert [len(notices(r.messages)) for r in provider.requests[:6]] == [0] * 6
    assert notices(provider.requests[6].messages) == [warn]
    denied = [m.tool_call_id for m in result.messages if isinstance(m, ToolResultMessage) and m.is_error]
    assert denied == ["s4", "l4"]


async def test_patterns_of_three_calls_proposed_together() -> None:
    tools = Tools(["running"] * 3, log=["no new lines"] * 3, check=["2 failing"] * 4)
    rounds = [turn(call(f"s{i}"), call(f"l{i}", "log"), call(f"k{i}", "check")) for i in range(1, 4)]
    # the 4th response: a check first breaks the pattern, so all three of its calls run
    script = [*rounds, turn(call("k4", "check"), call("s4"), call("l4", "log")), "done"]
    tools.answers["status"].append("running")
    tools.answers["log"].append("no new lines")
    result, provider, agent, _ = await run(script, tools, RunConfig(loop_detection=LoopConfig(then="block")))

    assert result.stop.reason is StopReason.COMPLETED and len(tools.ran) == 12
    warn = warning(f"repeated the sequence {STATUS} -> {LOG} -> {CHECK}", 3, "'running'; 'no new lines'; '2 failing'",
                   "Repeating it will not change the result, and it will not be run again.")
    assert [notices(r.messages) for r in provider.requests] == [[], [], [], [warn], []]
    assert [e["action"] for e in await logged(agent)] == ["warn"]

    # the same response in the loop's order is blocked whole
    tools = Tools(["running"] * 3, log=["no new lines"] * 3, check=["2 failing"] * 3)
    script = [*rounds, turn(call("s4"), call("l4", "log"), call("k4", "check")), "done"]
    result, _, agent, _ = await run(script, tools, RunConfig(loop_detection=LoopConfig(then="block")))
    assert len(tools.ran) == 9
    assert [e.get("call_id") for e in await logged(agent) if e["action"] == "block"] == ["s4", "l4", "k4"]


# -- off, a plugin that handles loops, the options ------------------------------------------------------------
async def test_loop_detection_none_turns_it_off() -> None:
    tools = Tools(["running"] * 5)
    script = [turn(call(f"c{i}")) for i in range(1, 6)] + ["done"]
    result, provider, agent, seen = await run(script, tools, RunConfig(loop_detection=None))
    assert result.stop.reason is StopReason.COMPLETED and tools.ran == ["status"] * 5
    assert [notices(r.messages) for r in provider.requests] == [[]] * 6
    assert await logged(agent) == [] and seen.seen == []


async def test_the_plugin_takes_over_and_the_model_is_warned_once() -> None:
    tools = Tools(["running"] * 3)
    script = [turn(call(f"c{i}")) for i in range(1, 5)] + ["done"]
    result, provider, agent, _ = await run(script, tools, RunConfig(loop_detection=LoopConfig(then="stop")),
                                           middleware=[LoopDetection()])
    # the plugin's escalation (the 4th proposal denied, by the plugin), its one warning, no engine events
    assert result.stop.reason is StopReason.COMPLETED and tools.ran == ["status"] * 3
    assert [len(notices(r.messages)) for r in provider.requests] == [0, 0, 0, 1, 0]
    assert [(m.metadata or {}).get("denied_by") for m in result.messages
            if isinstance(m, ToolResultMessage) and m.is_error] == ["loop_detection"]
    assert await logged(agent) == []


@pytest.mark.parametrize(("kw", "words"), [
    ({"then": "ask"}, "use 'warn', 'block' or 'stop'"),
    ({"repeats": 1}, "at least 2 repetitions"),
    ({"pattern_lengths": ()}, "one or more whole numbers"),
    ({"pattern_lengths": (0, 1)}, "one or more whole numbers"),
    ({"window": 8}, "at least 9 calls"),
])
def test_bad_options_are_refused_with_what_to_do(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        LoopConfig(**kw)


def test_the_defaults_are_the_seeds() -> None:
    assert RunConfig().loop_detection == LoopConfig(window=12, pattern_lengths=(1, 2, 3), repeats=3, then="warn")
    assert LoopConfig(pattern_lengths=[3, 1, 1]).pattern_lengths == (1, 3)


# -- replay ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("then", ["warn", "block", "stop"])
async def test_loop_detection_replays(then: str) -> None:
    def build(live: bool) -> Agent:
        tools = Tools(["running"] * 5)
        provider = ScriptedProvider([turn(call(f"c{i}")) for i in range(1, 6)] + ["done"]) if live else never_called()
        return Agent(provider, tools=tools.tools, store=MemoryStore(),
                     config=RunConfig(loop_detection=LoopConfig(then=then)))  # type: ignore[arg-type]

    async def drive(agent: Agent, port: Any, live: bool) -> list[Any]:
        return [await outcome_of(agent.run("watch job 7", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    stop = rt.results[0].stop
    assert stop.reason is (StopReason.FAILED_TERMINAL if then == "stop" else StopReason.COMPLETED)
    assert sum(bool(notices(r.messages)) for r in rt.replayed_requests) == {"warn": 3, "block": 3, "stop": 1}[then]


# -- the guide ---------------------------------------------------------------------------------------------------
def test_the_guides_python_blocks_run_and_print_what_they_say() -> None:
    import contextlib
    import io
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "loops.md"
    blocks = re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M)
    assert len(blocks) == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "loops.md python block", "exec"), {"__name__": "loops_md"})  # noqa: S102
    assert out.getvalue().splitlines() == ["True loop_detected"]
