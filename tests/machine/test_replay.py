"""A run replays from its recorded effects (issue 20, item 3).

Each scenario is recorded live (real concurrency: parallel tools finishing in different orders, a
control sent from outside while a tool or a stream runs, a 429 with Retry-After served over HTTP),
then replayed by a fresh agent of the same configuration with a provider that is never called and
an empty store. :func:`replay_kit.roundtrip` checks: no divergence, the same results, the same
requests, and the recording's event log equal byte for byte to what the live store holds.
"""

from __future__ import annotations

import asyncio
import copy
import pickle
import random
from typing import Any

import pytest
from attrs import evolve

from fsm_agent import Agent, MemoryStore, Middleware, RunConfig, ScriptedProvider, StopReason, StopRun, tool
from fsm_agent.control import Decision
from fsm_agent.errors import ReplayDivergence
from fsm_agent.prompt import prompt_digest
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.testing import EffectRecording
from fsm_agent.testing.effects import _dumps
from fsm_agent.types import RunResult, TextBlock, ToolUseBlock, UserMessage

from .replay_kit import Outcome, committed_writes, never_called, outcome_of, roundtrip

SID = "s-replay"


def _slow_tool(delays: dict[int, float]) -> Any:
    @tool
    async def slow(n: int) -> str:
        """Wait a little, then answer.

        Args:
            n: which call.
        """
        await asyncio.sleep(delays.get(n, 0.0))
        return f"result {n}"

    return slow


def _three_calls() -> list[Any]:
    return [tool_call_response(*(ToolUseBlock(f"c{n}", "slow", {"n": n}) for n in range(3)), text="On it."),
            "all three done"]


# -- parallel tools ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False])
async def test_parallel_tools_finishing_in_random_orders_replay(stream: bool) -> None:
    delays = {n: random.uniform(0.0, 0.05) for n in range(3)}

    def build(live: bool) -> Agent:
        provider = ScriptedProvider(_three_calls()) if live else never_called()
        return Agent(provider, tools=[_slow_tool(delays)], store=MemoryStore(), config=RunConfig(stream=stream))

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("do three things", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    assert rt.results[0].stop.reason is StopReason.COMPLETED and rt.results[0].output == "all three done"


# -- an approval wait and its resume -------------------------------------------------------------------------
async def test_approval_wait_and_resume_replay() -> None:
    from fsm_agent_middleware.approval import HumanApproval

    delays = {0: 0.03, 1: 0.0, 2: 0.01}

    def build(live: bool) -> Agent:
        provider = ScriptedProvider(_three_calls()) if live else never_called()
        return Agent(provider, tools=[_slow_tool(delays)], store=MemoryStore(), middleware=[HumanApproval(tools=["slow"])],
                     config=RunConfig(stream=True))

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        first = await outcome_of(agent.run("do three things", session_id=SID, port=port))
        decisions = {"c0": Decision.approve(), "c1": Decision.reject("not this one"),
                     "c2": Decision.edit({"n": 7})}
        second = await outcome_of(agent.resume(SID, decisions=decisions, port=port))
        return [first, second]

    rt = await roundtrip(build, drive, SID)
    first, second = rt.results
    assert first.stop.reason is StopReason.WAITING_HUMAN and len(first.stop.pending_actions) == 3
    assert second.stop.reason is StopReason.COMPLETED


# -- controls sent from outside while a stream or a tool runs ------------------------------------------------
def _control(kind: str, text: str = "") -> Any:
    from fsm_agent.control import Cancel, Followup, Interrupt, Steer

    return {"interrupt": Interrupt, "cancel": Cancel, "steer": Steer, "followup": Followup}[kind](text or kind)


class _SendOnStream:
    """An observer of the live agent: sends a control through the store once the answer streams."""

    def __init__(self, agent_ref: list[Agent], kind: str) -> None:
        self.agent_ref, self.kind, self.sent = agent_ref, kind, False

    def on_model_event(self, event: Any) -> None:
        if not self.sent and event.phase == "Model":
            self.sent = True
            asyncio.ensure_future(self.agent_ref[0].control(SID, _control(self.kind)))


@pytest.mark.parametrize("kind", ["interrupt", "cancel", "steer", "followup"])
async def test_a_control_sent_while_the_answer_streams_replays(kind: str) -> None:
    ref: list[Agent] = []

    def build(live: bool) -> Agent:
        provider = (ScriptedProvider(["word " * 40, "second answer", "third answer"], stream_delay=0.005,
                                     chunk_chars=5) if live else never_called())
        agent = Agent(provider, store=MemoryStore(), config=RunConfig(stream=True), control_poll=0.01,
                      observers=[_SendOnStream(ref, kind)] if live else [])
        ref[:] = [agent]
        return agent

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        out = [await outcome_of(agent.run("talk", session_id=SID, port=port))]
        if out[0].result is not None and out[0].result.stop.resumable:
            out.append(await outcome_of(agent.resume(SID, port=port)))
        return out

    rt = await roundtrip(build, drive, SID)
    first = rt.results[0].stop.reason
    assert first is {"interrupt": StopReason.INTERRUPTED, "cancel": StopReason.CANCELLED,
                     "steer": StopReason.COMPLETED, "followup": StopReason.COMPLETED}[kind]
    assert rt.results[-1].stop.reason in (StopReason.COMPLETED, StopReason.CANCELLED)


@pytest.mark.parametrize("kind", ["interrupt", "cancel", "steer", "followup"])
async def test_a_control_sent_while_a_tool_runs_replays(kind: str) -> None:
    ref: list[Agent] = []
    compensated: list[int] = []

    def build(live: bool) -> Agent:
        @tool(effect="side_effect")
        async def act(n: int) -> str:
            """Do something with a side effect.

            Args:
                n: which thing.
            """
            if n == 1:
                await ref[0].control(SID, _control(kind))
                await asyncio.sleep(0.2)  # the control watch cuts it here (interrupt, cancel)
            return f"done {n}"

        @act.on_compensate
        def undo(arguments: dict, result: Any, ctx: Any) -> None:
            compensated.append(arguments["n"])

        script = [tool_call_response(ToolUseBlock("a0", "act", {"n": 0}), ToolUseBlock("a1", "act", {"n": 1})),
                  "finished", "after the follow-up"]
        agent = Agent(ScriptedProvider(script) if live else never_called(), tools=[act], store=MemoryStore(),
                      config=RunConfig(stream=True), control_poll=0.01)
        ref[:] = [agent]
        return agent

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        out = [await outcome_of(agent.run("act twice", session_id=SID, port=port))]
        for _ in range(3):
            last = out[-1].result
            if last is None or not last.stop.resumable:
                break
            decisions = {p.call.id: Decision.respond("done 1") for p in last.stop.pending_actions}
            out.append(await outcome_of(agent.resume(SID, decisions=decisions or None,
                                                     confirm_cancel=last.stop.required_decision == "confirm_cancel",
                                                     port=port)))
        return out

    rt = await roundtrip(build, drive, SID)
    reasons = [r.stop.reason for r in rt.results]
    if kind == "cancel":
        assert reasons[-1] is StopReason.CANCELLED and compensated, reasons
    else:
        assert reasons[-1] is StopReason.COMPLETED, reasons


# -- the fault suite: a fault in every hook (tests/fault_scenarios.py, hook_fault) ----------------------------
HOOKS = ("pre_turn", "wrap_model_call", "on_model_event", "on_tool_call", "wrap_tool_call", "post_turn")


class _Saboteur(Middleware):
    """Fires one fault (cancel the run's task, StopRun, an exception) in one hook, where something is at
    stake there (as tests/fault_scenarios.py does), waiting only through ``ctx.sleep``."""

    name = "saboteur"

    def __init__(self, hook: str, fault: str, holder: dict[str, Any]) -> None:
        self.hook, self.fault, self.holder = hook, fault, holder
        self.fired = False

    def _fire_sync(self) -> None:
        self.fired = True
        if self.fault == "error":
            raise RuntimeError("the saboteur's hook failed (fail-closed)")
        if self.fault == "stoprun":
            raise StopRun(StopReason.INTERRUPTED, "stopped by the saboteur")
        self.holder["task"].cancel()

    async def _fire(self, ctx: Any) -> None:
        self._fire_sync()
        await ctx.sleep(5)  # the cancel lands here

    async def pre_turn(self, ctx: Any) -> None:
        if self.hook == "pre_turn" and ctx.turn == 1 and not self.fired:  # the tools have run
            await self._fire(ctx)

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        if self.hook == "wrap_model_call" and ctx.turn == 2 and not self.fired:
            await self._fire(ctx)
        return await call_next(request)

    def on_model_event(self, event: Any, ctx: Any) -> Any:
        if self.hook == "on_model_event" and ctx.turn == 1 and not self.fired:  # while the calls stream
            self._fire_sync()
        return event

    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        if self.hook == "on_tool_call" and call.id == "call_b" and not self.fired:
            self._fire_sync()
        return None

    async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
        result = await call_next(call)
        if self.hook == "wrap_tool_call" and call.id == "call_b" and not self.fired:
            await ctx.sleep(0.05)  # call_a's result is recorded meanwhile
            await self._fire(ctx)
        return result

    def post_turn(self, ctx: Any) -> Any:
        if self.hook == "post_turn" and ctx.turn == 1 and not self.fired:
            self._fire_sync()
        return None


def _act_tool(delays: dict[int, float], done: list[int], compensated: list[int] | None = None,
              effect: str = "side_effect") -> Any:
    @tool(effect=effect)
    async def act(n: int) -> str:
        """Do the thing once.

        Args:
            n: which thing.
        """
        await asyncio.sleep(delays.get(n, 0.0))
        done.append(n)
        return f"done {n}"

    if compensated is not None:
        @act.on_compensate
        def undo(arguments: dict, result: Any, ctx: Any) -> None:
            compensated.append(arguments["n"])

    return act


def _two_calls(**kw: Any) -> list[Any]:
    return [tool_call_response(ToolUseBlock("call_a", "act", {"n": 1}), ToolUseBlock("call_b", "act", {"n": 2}),
                               text="Doing both.", **kw), "all done"]


class _Person:
    """Decides as a careful person would (as faults_common.finish): a call of unknown outcome that ran
    is answered with its result, every other call approved. What the live run was told is given again,
    in order, to its replay (the tools do not run in a replay: what ran is the live world's)."""

    def __init__(self, done: list[int]) -> None:
        self.done = done
        self.made: list[dict[str, Decision]] = []
        self.given = 0

    def decide(self, stop: Any, live: bool) -> dict[str, Decision]:
        if not live:
            self.given += 1
            return self.made[self.given - 1]
        decisions = {p.call.id: (Decision.respond(f"done {p.call.input['n']}")
                                 if p.reason == "unknown_outcome" and p.call.input.get("n") in self.done
                                 else Decision.approve())
                     for p in stop.pending_actions if stop.required_decision != "confirm_cancel"}
        self.made.append(decisions)
        return decisions


async def _finish(agent: Agent, port: Any, out: list[Outcome], person: _Person, live: bool, *,
                  max_resumes: int = 4) -> None:
    """Resume until the session is terminal, with ``person``'s decisions."""
    person.given = 0
    decisions: dict[str, Decision] = {}
    confirm = False
    for _ in range(max_resumes):
        last = out[-1]
        if last.result is not None:
            stop = last.result.stop
            if not stop.resumable and stop.required_decision != "confirm_cancel":
                return
            if stop.required_decision == "confirm_cancel":
                confirm = True
            decisions = person.decide(stop, live)
        elif not last.error or not last.error.startswith("CancelledError"):
            return
        out.append(await outcome_of(agent.resume(SID, decisions=decisions or None, confirm_cancel=confirm,
                                                 port=port)))


@pytest.mark.parametrize("fault", ["cancel", "stoprun", "error"])
@pytest.mark.parametrize("hook", HOOKS)
async def test_a_fault_in_each_hook_replays(hook: str, fault: str) -> None:
    holder: dict[str, Any] = {}
    done: list[int] = []
    person = _Person(done)
    delays = {1: 0.01, 2: 0.0}

    def build(live: bool) -> Agent:
        provider = ScriptedProvider(_two_calls(), stream_delay=0.001, chunk_chars=4) if live else never_called()
        return Agent(provider, tools=[_act_tool(delays, done)], store=MemoryStore(),
                     middleware=[_Saboteur(hook, fault, holder)], config=RunConfig(stream=True), control_poll=0.01)

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        if live:
            done.clear()
        task = holder["task"] = asyncio.ensure_future(agent.run("do both", session_id=SID, port=port))
        out = [await outcome_of(task)]
        await _finish(agent, port, out, person, live)
        return out

    rt = await roundtrip(build, drive, SID)
    if fault == "cancel":
        assert rt.live[0].error is not None and rt.live[0].error.startswith("CancelledError")
    else:
        assert rt.live[0].result is not None
        first = rt.live[0].result.stop.reason
        assert first is (StopReason.INTERRUPTED if fault == "stoprun" else StopReason.FAILED_TERMINAL)


# -- the fault suite: Interrupt / Cancel / Steer / Followup in each phase (control_fault) ----------------------
PHASES = ("PreTurn", "Model", "MidTurn", "PostTurn")


class _Outside:
    """The outside world of the live run: sends one control through the store when the run reaches
    ``phase`` of the first tool turn (an observer: never part of a replay). In MidTurn the tool sends it
    while it runs (see the scenario)."""

    def __init__(self, agent_ref: list[Agent], kind: str, phase: str) -> None:
        self.agent_ref, self.kind, self.phase, self.sent = agent_ref, kind, phase, False

    async def send(self) -> None:
        if not self.sent:
            self.sent = True
            await self.agent_ref[0].control(SID, _control(self.kind))

    async def on_transition(self, event: Any) -> None:
        if self.phase in ("PreTurn", "PostTurn") and event.to_state == self.phase and event.turn <= 1:
            await self.send()

    def on_model_event(self, event: Any) -> None:
        if self.phase == "Model" and event.phase == "Model" and not self.sent:
            asyncio.ensure_future(self.send())


@pytest.mark.parametrize("kind", ["interrupt", "cancel", "steer", "followup"])
@pytest.mark.parametrize("phase", PHASES)
async def test_a_control_in_each_phase_replays(phase: str, kind: str) -> None:
    ref: list[Agent] = []
    done: list[int] = []
    person = _Person(done)
    compensated: list[int] = []

    def build(live: bool) -> Agent:
        outside = _Outside(ref, kind, phase)

        @tool(effect="side_effect")
        async def act(n: int) -> str:
            """Do the thing once.

            Args:
                n: which thing.
            """
            done.append(n)
            if n == 2 and phase == "MidTurn":
                await outside.send()
                await asyncio.sleep(0.3)  # the control watch cuts it here
            return f"done {n}"

        @act.on_compensate
        def undo(arguments: dict, result: Any, ctx: Any) -> None:
            compensated.append(arguments["n"])

        provider = (ScriptedProvider(_two_calls(), stream_delay=0.002, chunk_chars=2, repeat_last=True) if live
                    else never_called())
        agent = Agent(provider, tools=[act], store=MemoryStore(), config=RunConfig(stream=True), control_poll=0.01,
                      observers=[outside] if live else [])
        ref[:] = [agent]
        return agent

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        if live:
            done.clear()
        out = [await outcome_of(agent.run("do both", session_id=SID, port=port))]
        await _finish(agent, port, out, person, live)
        return out

    rt = await roundtrip(build, drive, SID)
    first, last = rt.results[0].stop, rt.results[-1].stop
    if kind == "cancel":
        assert last.reason is StopReason.CANCELLED, [r.stop for r in rt.results]
        if phase in ("MidTurn", "PostTurn"):  # a side effect had happened: it was compensated
            assert compensated, [r.stop for r in rt.results]
    else:
        assert last.reason is StopReason.COMPLETED, [r.stop for r in rt.results]
    if kind == "interrupt":
        assert first.reason is StopReason.INTERRUPTED
    texts = " ".join(m.text for r in rt.results for m in r.messages if hasattr(m, "text"))
    if kind in ("steer", "followup"):
        assert kind in texts  # the control's text reached the conversation


# -- the main paths ----------------------------------------------------------------------------------------------
SUMMARY = {"goal": "read the files", "goal_version": 1, "decisions": ["read the files in order"], "failures": [],
           "verified_facts": [{"fact": "every file has 60 lines", "evidence": "read_file 0"}],
           "prohibitions": ["never delete files"], "todos": ["report"], "pending_actions": []}


async def test_an_l2_compaction_with_its_summarizer_call_replays() -> None:
    import orjson

    from fsm_agent.providers import ProviderCapabilities
    from fsm_agent.types import Usage, estimate_request_tokens
    from fsm_agent_middleware.compaction import Compaction

    @tool
    def read_file(path: str) -> str:
        """Read a file.

        Args:
            path: the file.
        """
        return "\n".join(f"line {i} of {path}: " + "x" * 60 for i in range(60))

    summaries: list[Any] = []
    reads: list[Any] = []

    def model(request: Any) -> Any:
        tokens = Usage(estimate_request_tokens(request), 5)
        if request.output_schema is not None:  # the summarizer's call (through ctx.call_provider)
            summaries.append(request)
            return text_response(orjson.dumps(SUMMARY).decode(), usage=tokens)
        n = len(reads)
        reads.append(request)
        if n < 9:
            return tool_call_response(ToolUseBlock(f"read_{n}", "read_file", {"path": str(n)}), usage=tokens)
        return text_response("read them all", usage=tokens)

    def build(live: bool) -> Agent:
        caps = ProviderCapabilities(context_window=12000)
        provider = ScriptedProvider([model], repeat_last=True, capabilities=caps) if live else never_called()
        provider._caps = caps
        return Agent(provider, tools=[read_file], store=MemoryStore(),
                     middleware=[Compaction(levels=("L2",), min_summary_input_tokens=100)])

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("Read the files 0 to 8.\nConstraints:\n- never delete files",
                                           session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    assert rt.results[0].stop.reason is StopReason.COMPLETED
    assert summaries, "no summarizer call was made"
    assert any(r.output_schema is not None for r in rt.live_requests)
    compactions = [e for e in rt.recording.events if e["type"] == "compaction"]
    assert compactions and all(e["payload"]["record"]["level"] == "L2" for e in compactions)


PLAN = {"nodes": [{"id": "a", "goal": "Find the first number", "depends_on": [], "acceptance": "a number"},
                  {"id": "b", "goal": "Find the second number", "depends_on": ["a"], "acceptance": "a number"}]}
REPLAN = {"nodes": [{"id": "b", "goal": "Look the second number up in the table", "depends_on": ["a"],
                     "acceptance": "a number from the table"}]}


async def test_a_planact_replan_replays() -> None:
    import orjson

    from fsm_agent_middleware.planact import PlanAct
    from fsm_agent_middleware.verifier import Verdict

    def build(live: bool) -> Agent:
        tries: dict[str, int] = {}

        def check(ctx: Any, node: Any) -> Any:
            tries[node.id] = tries.get(node.id, 0) + 1
            if node.id == "b" and tries["b"] == 1:
                return Verdict(False, "the second number is missing", ("check:b:1",))
            return Verdict(True, "fine", (f"check:{node.id}",))

        def model(request: Any) -> Any:
            schema = request.output_schema.name if request.output_schema is not None else None
            if schema == "plan":
                return text_response(orjson.dumps(PLAN).decode())
            if schema == "replan":
                return text_response(orjson.dumps(REPLAN).decode())
            return text_response(f"answer {len(request.messages)}")

        provider = ScriptedProvider([model], repeat_last=True) if live else never_called()
        return Agent(provider, store=MemoryStore(), middleware=[PlanAct(check=check)])

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("Add two numbers", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    assert rt.results[0].stop.reason is StopReason.COMPLETED, rt.results[0].stop.detail
    reasons = [e["payload"]["reason"] for e in rt.recording.events if e["type"] == "plan_updated"]
    assert any(r.startswith("replanned to v2 (failed)") for r in reasons), reasons


async def test_a_planner_call_retried_after_a_429_replays() -> None:
    """PlanAct retries its planner's failed call (Retry-After) through the context's timers."""
    import orjson

    from fsm_agent.errors import RateLimitError
    from fsm_agent_middleware.planact import PlanAct

    def build(live: bool) -> Agent:
        failed: list[int] = []

        def model(request: Any) -> Any:
            schema = request.output_schema.name if request.output_schema is not None else None
            if schema == "plan":
                if not failed:
                    failed.append(1)
                    raise RateLimitError("slow down", status=429, headers={"retry-after": "0.04"})
                return text_response(orjson.dumps(PLAN).decode())
            if schema == "verdict":
                return text_response(orjson.dumps({"ok": True, "reason": "fine"}).decode())
            return text_response(f"answer {len(request.messages)}")

        provider = ScriptedProvider([model], repeat_last=True) if live else never_called()
        return Agent(provider, store=MemoryStore(), middleware=[PlanAct()])

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("Add two numbers", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    assert rt.results[0].stop.reason is StopReason.COMPLETED, rt.results[0].stop.detail
    retries = [e["payload"] for e in rt.recording.events if e["type"] == "model_retry"]
    assert [(r["layer"], r["status"], r["delay_s"]) for r in retries] == [("planact", 429, 0.04)]
    assert 0.04 in [e.args["delay"] for e in rt.recording.segments[0].effects if e.kind == "call_later"]


async def test_a_sub_agent_replays() -> None:
    from fsm_agent.orchestration.subagent import agent_tool

    def build(live: bool) -> Agent:
        store = MemoryStore()
        child = Agent(ScriptedProvider(["the child's answer"]) if live else never_called(), store=store,
                      system_prompt="You research.")
        ask = agent_tool(child, name="researcher", description="Research a question.",
                         limits={"max_iterations": 4})
        script = [tool_call_response(ToolUseBlock("ask_1", "researcher", {"task": "find it"})), "the lead's answer"]
        return Agent(ScriptedProvider(script) if live else never_called(), tools=[ask], store=store)

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("Delegate it", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    result = rt.results[0]
    assert result.stop.reason is StopReason.COMPLETED and result.output == "the lead's answer"
    assert any("the child's answer" in getattr(m, "text", "") for m in result.messages)
    assert result.usage.total_tokens == 3 * 15  # the child's call rolled up (a tool report, replayed)


async def test_a_structured_output_repair_replays() -> None:
    from fsm_agent.types import OutputSchema

    schema = OutputSchema("answer", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})

    def build(live: bool) -> Agent:
        provider = ScriptedProvider(['{"n": "three"}', '{"n": 3}']) if live else never_called()
        return Agent(provider, store=MemoryStore(), config=RunConfig(output_schema=schema))

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("Count them", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    result = rt.results[0]
    assert result.stop.reason is StopReason.COMPLETED and result.output_data == {"n": 3}
    assert [e["type"] for e in rt.recording.events].count("output_invalid") == 1


async def test_a_budget_pause_and_its_resume_replay() -> None:
    def build(live: bool) -> Agent:
        script = [tool_call_response(ToolUseBlock(f"c{n}", "slow", {"n": n})) for n in range(3)] + ["finished"]
        provider = ScriptedProvider(script) if live else never_called()
        return Agent(provider, tools=[_slow_tool({})], store=MemoryStore(), config=RunConfig(max_iterations=2))

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        first = await outcome_of(agent.run("work", session_id=SID, port=port))
        second = await outcome_of(agent.resume(SID, max_iterations=10, port=port))
        return [first, second]

    rt = await roundtrip(build, drive, SID)
    first, second = rt.results
    assert first.stop.reason is StopReason.PAUSED_BUDGET
    assert second.stop.reason is StopReason.COMPLETED and second.output == "finished"


def _chat_completion(message: dict[str, Any], finish: str) -> bytes:
    import orjson

    return orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                         "choices": [{"index": 0, "message": {"role": "assistant", **message},
                                      "finish_reason": finish}],
                         "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}})


async def test_a_retry_after_429_over_http_replays() -> None:
    import orjson

    from fsm_agent import create_provider
    from fsm_agent.providers import ProviderConfig
    from fsm_agent.testing import RecordedResponse, ReplayServer

    call = {"tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "slow", "arguments": orjson.dumps({"n": 1}).decode()}}],
            "content": None}
    limited = orjson.dumps({"error": {"message": "Rate limit reached", "type": "rate_limit_exceeded"}})
    server = ReplayServer([RecordedResponse(429, limited, headers={"retry-after": "0.05"}),
                           RecordedResponse(200, _chat_completion(call, "tool_calls")),
                           RecordedResponse(429, limited, headers={"retry-after": "0.02"}),
                           RecordedResponse(200, _chat_completion({"content": "all done"}, "stop"))])
    base = await server.start()

    def build(live: bool) -> Agent:
        provider = create_provider("openai", ProviderConfig(base_url=base if live else "http://127.0.0.1:9",
                                                            api_key="x", model="m"))
        return Agent(provider, tools=[_slow_tool({1: 0.01})], store=MemoryStore())

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        try:
            return [await outcome_of(agent.run("use the tool", session_id=SID, port=port))]
        finally:
            await agent.provider.aclose()

    try:
        rt = await roundtrip(build, drive, SID)
    finally:
        await server.close()
    assert rt.results[0].stop.reason is StopReason.COMPLETED and rt.results[0].output == "all done"
    assert len(server.requests) == 4
    retries = [e for e in rt.recording.events if e["type"] == "model_retry"]
    assert [(e["payload"]["status"], e["payload"]["delay_s"]) for e in retries] == [(429, 0.05), (429, 0.02)]


# -- the fault suite: a store write failing (store_write_fault) ---------------------------------------------------
@pytest.mark.parametrize("after_commit", [False, True], ids=["lost-write", "lost-ack"])
@pytest.mark.parametrize("status", ["approved", "started", "completed"])
async def test_a_failing_store_write_replays(status: str, after_commit: bool) -> None:
    from fsm_agent.store import LedgerStatus
    from fsm_agent.testing import FaultyStore, carries_ledger
    from fsm_agent_middleware.approval import HumanApproval

    done: list[int] = []
    person = _Person(done)
    asked = status == "approved"  # an approval is written on its own only when a person gives it
    faulty: list[Any] = []

    def build(live: bool) -> Agent:
        store: Any = MemoryStore()
        if live:
            store = FaultyStore(store)
            faulty[:] = [store]
        script = [tool_call_response(ToolUseBlock("call_1", "act", {"n": 1})), "all done"]
        return Agent(ScriptedProvider(script) if live else never_called(), tools=[_act_tool({}, done)], store=store,
                     middleware=[HumanApproval(tools=["act"])] if asked else [])

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        if live:
            faulty[0].fail("write", when=carries_ledger(LedgerStatus(status), tool="act"), after_commit=after_commit)
        out = [await outcome_of(agent.run("do it", session_id=SID, port=port))]
        if asked:
            out.append(await outcome_of(agent.resume(SID, decisions={"call_1": Decision.approve()}, port=port)))
        if live:
            faulty[0].clear()
        await _finish(agent, port, out, person, live)
        return out

    def written(rec: Any) -> list[Any]:
        # a lost acknowledgement: the write is stored although it raised; otherwise it stored nothing
        return rec.events if after_commit else committed_writes(rec)

    rt = await roundtrip(build, drive, SID, written=written)
    stops = [o.result.stop for o in rt.live if o.result is not None]
    failed = stops[1] if asked else stops[0]
    assert failed.reason is StopReason.FAILED_RETRYABLE and (failed.error or {}).get("kind") == "store"
    assert stops[-1].reason is StopReason.COMPLETED
    assert faulty[0].failures


# -- the fault suite: the resume after a worker was killed at each ledger point (kill_cell) ---------------------
@pytest.mark.parametrize("approval", ["none", "person"])
@pytest.mark.parametrize("point", ["approved", "started", "effect", "completed"])
async def test_the_resume_after_a_kill_at_each_ledger_point_replays(point: str, approval: str, tmp_path: Any) -> None:
    """A worker process is killed (SIGKILL) at one step of a side-effect call's ledger life (after a
    person approved it, or with no approval); the resume in this process is recorded and replayed."""
    import sys
    from pathlib import Path

    from faults_common import act_tool, agent_for, executions, provider

    from fsm_agent.store import SQLiteStore
    from fsm_agent.testing.strict import StrictServer, calls, text
    from fsm_agent_middleware.approval import HumanApproval

    worker = Path(__file__).resolve().parents[1] / "fault_worker.py"
    db, counter = tmp_path / "sessions.db", tmp_path / "effects"
    server = StrictServer([calls(("call_1", "act", {"n": 1})), text("all done")])
    base = await server.start()
    stores: list[Any] = []

    def middleware() -> list[Any]:
        return [HumanApproval(tools=["act"])] if approval == "person" else []

    try:
        if approval == "person":  # the run that asks the person, before the worker that approves and dies
            store = SQLiteStore(db)
            asking = agent_for(base, store, [act_tool("side_effect", counter)], middleware=middleware())
            assert (await asking.run("do it", session_id=SID)).stop.reason is StopReason.WAITING_HUMAN
            await asking.provider.aclose()
            await store.close()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(worker), str(db), base, str(counter), SID, "side_effect", approval, point,
            "approve" if approval == "person" else "run", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == -9, err.decode()[-2000:]
        await asyncio.sleep(0.6)  # the dead worker's lease (0.5 s) runs out
        killed_at = (await _last_seq(db))

        def build(live: bool) -> Agent:
            store: Any = SQLiteStore(db) if live else MemoryStore()
            stores.append(store)
            agent = agent_for(base, store, [act_tool("side_effect", counter)], middleware=middleware())
            if not live:
                agent.provider = provider("http://127.0.0.1:9")  # never called
            return agent

        made: list[dict[str, Decision]] = []  # the person's decisions in the live run, given again in the replay

        async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
            res: list[Outcome] = []
            decisions: dict[str, Decision] | None = None
            given = iter(list(made))
            try:
                for _ in range(3):
                    res.append(await outcome_of(agent.resume(SID, decisions=decisions, port=port)))
                    r = res[-1].result
                    if r is None or r.stop.reason is not StopReason.WAITING_HUMAN:
                        break
                    if live:
                        ran = bool(executions(counter))
                        decisions = {p.call.id: Decision.respond("done 1") if ran and p.reason == "unknown_outcome"
                                     else Decision.approve() for p in r.stop.pending_actions}
                        made.append(decisions)
                    else:
                        decisions = next(given)
            finally:
                await agent.provider.aclose()
            return res

        rt = await roundtrip(build, drive, SID, since_seq=lambda: killed_at)
    finally:
        for s in stores:
            await s.close()
        await server.close()
    assert rt.results[-1].stop.reason is StopReason.COMPLETED
    assert any(e["type"] == "recovered" for e in rt.recording.events)
    assert len(executions(counter)) == 1


async def _last_seq(db: Any) -> int:
    from fsm_agent.store import SQLiteStore

    store = SQLiteStore(db)
    try:
        rec = await store.get_session(SID)
        assert rec is not None
        return rec.last_seq
    finally:
        await store.close()


# -- a changed effect, a changed prompt or plugin: ReplayDivergence at the first effect it changes ---------------
class _Note(Middleware):
    """A plugin that adds a note to the context of each model call."""

    name = "note"

    def __init__(self, text: str) -> None:
        self.text = text

    async def pre_turn(self, ctx: Any) -> None:
        ctx.messages = [*ctx.messages, UserMessage(self.text)]


def _base_agent(live: bool, *, system_prompt: str = "You are careful.", note: str = "Note: be brief.",
                ref: list[Agent] | None = None) -> Agent:
    """Two parallel calls; while the second runs, a Steer is sent through the store; then the answer."""

    @tool
    async def slow(n: int) -> str:
        """Wait a little, then answer.

        Args:
            n: which call.
        """
        if n == 2 and ref:
            await ref[0].control(SID, _control("steer", "Steer: mind the totals"))
        await asyncio.sleep(0.01 * n)
        return f"result {n}"

    script = [tool_call_response(ToolUseBlock("c1", "slow", {"n": 1}), ToolUseBlock("c2", "slow", {"n": 2})),
              "the final answer"]
    agent = Agent(ScriptedProvider(script) if live else never_called(), tools=[slow], store=MemoryStore(),
                  system_prompt=system_prompt, middleware=[_Note(note)], config=RunConfig(stream=True))
    if ref is not None:
        ref[:] = [agent]
    return agent


async def _recorded_base() -> tuple[EffectRecording, RunResult]:
    rec = EffectRecording()
    ref: list[Agent] = []
    result = await _base_agent(True, ref=ref).run("Add the results", session_id=SID, port=rec.record)
    assert result.stop.reason is StopReason.COMPLETED
    assert any("Steer: mind the totals" in m.text for m in result.messages if isinstance(m, UserMessage))
    return rec, result


def _copy(rec: EffectRecording) -> EffectRecording:
    return EffectRecording(copy.deepcopy(rec.segments))


def _holds(obj: Any, pred: Any) -> bool:
    """Whether ``pred`` holds for any leaf of the JSON-like ``obj``."""
    if isinstance(obj, dict):
        return any(_holds(v, pred) for v in obj.values())
    if isinstance(obj, list):
        return any(_holds(v, pred) for v in obj)
    return bool(pred(obj))


def _first_using(rec: EffectRecording, after: int, pred: Any) -> int:
    """The first effect after ``after`` whose arguments hold a leaf for which ``pred`` holds."""
    effects = rec.segments[0].effects
    return next(j for j in range(after + 1, len(effects)) if _holds(effects[j].args, pred))


def _done(rec: EffectRecording, i: int) -> int:
    """The position of effect ``i``'s result among the segment's arrivals."""
    return next(k for k, (what, j, _) in enumerate(rec.segments[0].arrivals) if what == "done" and j == i)


def _change_result(rec: EffectRecording, i: int, change: Any) -> None:
    """Replace effect ``i``'s recorded result by ``change(result)``."""
    arrivals = rec.segments[0].arrivals
    k = _done(rec, i)
    kind, value = pickle.loads(arrivals[k][2])
    arrivals[k] = ("done", i, _dumps((kind, change(value))))


async def _diverges(rec: EffectRecording, agent: Agent | None = None) -> ReplayDivergence:
    agent = agent or _base_agent(False)
    with pytest.raises(ReplayDivergence) as info:
        await agent.run("Add the results", session_id=SID, port=rec.replay)
        rec.check()
    return info.value


def _index(rec: EffectRecording, kind: str, pred: Any = lambda args: True) -> int:
    return next(i for i, e in enumerate(rec.segments[0].effects) if e.kind == kind and pred(e.args))


async def test_the_base_recording_replays_exactly() -> None:
    rec, live = await _recorded_base()
    replayed = await _base_agent(False).run("Add the results", session_id=SID, port=rec.replay)
    rec.check()
    assert replayed == live


async def test_a_changed_tool_result_diverges_where_the_result_is_first_written() -> None:
    rec, _ = await _recorded_base()
    changed = _copy(rec)
    i = _index(changed, "run_tool", lambda a: a["call"]["id"] == "c1")
    _change_result(changed, i, lambda r: evolve(r, content=(TextBlock("result 999"),)))
    want = _first_using(rec, i, lambda leaf: leaf == "result 1")
    div = await _diverges(changed)
    assert div.index == want and rec.segments[0].effects[want].kind == "store.write"
    assert div.difference.endswith("message.content[0].text"), div.difference


async def test_a_changed_model_response_diverges_where_the_answer_is_first_written() -> None:
    rec, _ = await _recorded_base()
    changed = _copy(rec)
    i = [j for j, e in enumerate(changed.segments[0].effects) if e.kind == "call_model"][-1]
    _change_result(changed, i, lambda r: evolve(r, message=evolve(r.message, content=(TextBlock("another"),))))
    want = _first_using(rec, i, lambda leaf: leaf == "the final answer")
    div = await _diverges(changed)
    assert div.index == want and rec.segments[0].effects[want].kind == "store.write"
    assert div.difference.endswith("message.content[0].text"), div.difference


async def test_a_changed_clock_value_diverges_where_it_is_first_used() -> None:
    rec, _ = await _recorded_base()
    effects = rec.segments[0].effects
    # a wall-clock reading that a later write carries (an event's timestamp)
    i = next(j for j, e in enumerate(effects) if e.kind == "now" and any(
        e2.kind == "store.write" and _holds(e2.args, lambda leaf, v=e.value: leaf == v) for e2 in effects[j + 1:]))
    changed = _copy(rec)
    changed.segments[0].effects[i].value += 1.5
    want = _first_using(rec, i, lambda leaf: leaf == effects[i].value)
    div = await _diverges(changed)
    assert div.index == want
    assert div.difference.endswith(("ts", "created_at", "updated_at")), div.difference


async def test_a_changed_monotonic_reading_diverges_at_the_deadline_it_sets() -> None:
    rec, _ = await _recorded_base()
    effects = rec.segments[0].effects
    timer = _index(rec, "call_later")  # the wall-clock deadline of the first model call
    i = max(j for j in range(timer) if effects[j].kind == "monotonic")
    changed = _copy(rec)
    changed.segments[0].effects[i].value -= 7.0
    div = await _diverges(changed)
    assert div.index == timer and div.difference == "delay", (div.index, timer, div)


async def test_a_changed_control_diverges_where_the_control_is_logged() -> None:
    rec, _ = await _recorded_base()
    i = next(j for j, e in enumerate(rec.segments[0].effects) if e.kind == "store.take_controls"
             and "steer" in e.args["a"][1] and _taken(rec, j))
    changed = _copy(rec)
    _change_result(changed, i, lambda taken: [evolve(c, text="Steer: ignore the totals") for c in taken])
    want = _first_using(rec, i, lambda leaf: leaf == "Steer: mind the totals")
    div = await _diverges(changed)
    assert div.index == want and rec.segments[0].effects[want].kind == "store.write"
    assert div.difference.endswith("text"), div.difference


def _taken(rec: EffectRecording, i: int) -> bool:
    kind, value = pickle.loads(rec.segments[0].arrivals[_done(rec, i)][2])
    return kind == "ok" and bool(value)


async def test_a_control_not_taken_diverges_at_once() -> None:
    rec, _ = await _recorded_base()
    i = next(j for j, e in enumerate(rec.segments[0].effects) if e.kind == "store.take_controls" and _taken(rec, j))
    changed = _copy(rec)
    _change_result(changed, i, lambda taken: [])
    div = await _diverges(changed)
    assert i < div.index <= _first_using(rec, i, lambda leaf: leaf == "Steer: mind the totals")


async def test_a_changed_system_prompt_diverges_at_its_first_read() -> None:
    # The agent's prompt is read through the port as the session starts (docs/system-prompt.md); the
    # read names the prompt the agent was configured with, so another one diverges there, at once.
    rec, _ = await _recorded_base()
    want = _index(rec, "system_prompt")
    assert want == 0 and rec.segments[0].effects[want].args == {"source": f"code:{prompt_digest('You are careful.')}"}
    div = await _diverges(rec, _base_agent(False, system_prompt="You are reckless."))
    assert div.index == want and div.difference == "source", div.difference
    assert (div.expected or "").startswith("system_prompt(") and (div.actual or "").startswith("system_prompt(")


async def test_a_changed_plugin_diverges_at_the_first_request_it_changes() -> None:
    rec, _ = await _recorded_base()
    want = _index(rec, "call_model")
    div = await _diverges(rec, _base_agent(False, note="Note: be thorough."))
    assert div.index == want
    assert div.difference.startswith("request.messages["), div.difference


async def test_a_replay_that_stops_early_or_runs_on_is_named() -> None:
    rec, _ = await _recorded_base()
    cut = _copy(rec)
    del cut.segments[0].effects[-3:]
    with pytest.raises(ReplayDivergence) as info:
        await _base_agent(False).run("Add the results", session_id=SID, port=cut.replay)
    assert info.value.expected is None and info.value.index == len(cut.segments[0].effects)
    await _base_agent(False).run("Add the results", session_id=SID, port=rec.replay)
    with pytest.raises(ReplayDivergence) as more:  # a second segment the recording does not have
        await _base_agent(False).resume(SID, port=rec.replay)
    assert more.value.difference == "the recording has 1 segment(s)" and "segment (#2)" in str(more.value)


async def test_a_run_cut_from_outside_does_not_hang_its_replay() -> None:
    """The caller cancels the live run's task while a tool runs (not an effect of the run): its replay
    cannot know, and raises ReplayDivergence naming the tool call it would wait for forever."""
    rec = EffectRecording()
    live = Agent(ScriptedProvider(_three_calls()), tools=[_slow_tool({0: 5.0, 1: 5.0, 2: 5.0})], store=MemoryStore())
    task = asyncio.ensure_future(live.run("do three things", session_id=SID, port=rec.record))
    while not any(e.kind == "run_tool" for e in (rec.segments[0].effects if rec.segments else ())):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    replay = Agent(never_called(), tools=[_slow_tool({})], store=MemoryStore())
    with pytest.raises(ReplayDivergence) as info:
        await asyncio.wait_for(replay.run("do three things", session_id=SID, port=rec.replay), 60)
    div = info.value
    assert rec.segments[0].effects[div.index].kind == "run_tool"
    assert "never answered" in (div.expected or "") and "cut" in div.difference


# -- save and load; determinism ------------------------------------------------------------------------------
async def test_a_saved_recording_loads_and_replays(tmp_path: Any) -> None:
    rec, live = await _recorded_base()
    path = tmp_path / "run.effects"
    rec.save(path)
    loaded = EffectRecording.load(path)
    assert loaded.requests == rec.requests and loaded.events == rec.events
    replayed = await _base_agent(False).run("Add the results", session_id=SID, port=loaded.replay)
    loaded.check()
    assert replayed == live


async def _noise(stop: asyncio.Event) -> None:
    """Random event-loop traffic beside a replay."""
    while not stop.is_set():
        await asyncio.sleep(random.choice((0, 0, 0.001, 0.003)))


@pytest.mark.parametrize("attempt", range(3))
async def test_replays_of_parallel_tools_in_a_random_order_are_deterministic(attempt: int) -> None:
    """Each live run's tools finish in a random order; each of its replays (five, beside random event-loop
    traffic) ends with the same result, the same requests and the same log."""
    delays = {n: random.uniform(0.0, 0.03) for n in range(3)}
    rec = EffectRecording()
    live = await Agent(ScriptedProvider(_three_calls()), tools=[_slow_tool(delays)], store=MemoryStore(),
                       config=RunConfig(stream=True)).run("do three things", session_id=SID, port=rec.record)
    order = [r.tool_call_id for r in live.messages if r.role == "tool"]
    assert sorted(order) == ["c0", "c1", "c2"]
    for _ in range(5):
        copy_ = _copy(rec)
        stop = asyncio.Event()
        noise = [asyncio.ensure_future(_noise(stop)) for _ in range(3)]
        try:
            replayed = await Agent(never_called(), tools=[_slow_tool({})], store=MemoryStore(),
                                   config=RunConfig(stream=True)).run("do three things", session_id=SID,
                                                                      port=copy_.replay)
            copy_.check()
        finally:
            stop.set()
            await asyncio.gather(*noise)
        assert replayed == live
        assert [r.tool_call_id for r in replayed.messages if r.role == "tool"] == order


async def test_the_retry_plugin_waiting_out_a_retry_after_replays() -> None:
    """The ``retry`` plugin's own retry (Retry-After 429, then a server error with a backoff) waits and
    draws its jitter through the context, so its replay waits on the recorded timers."""
    from fsm_agent.errors import RateLimitError, ServerError
    from fsm_agent_middleware.retry import RetryFallback

    def build(live: bool) -> Agent:
        script: list[Any] = [RateLimitError("slow down", status=429, headers={"retry-after": "0.05"}),
                             ServerError("try again", status=503), "answered on the third try"]
        return Agent(ScriptedProvider(script) if live else never_called(), store=MemoryStore(),
                     middleware=[RetryFallback(max_attempts=3, initial_delay=0.01, max_delay=0.05)])

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("answer", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)
    assert rt.results[0].output == "answered on the third try"
    retries = [e["payload"] for e in rt.recording.events if e["type"] == "model_retry"]
    assert [(r["layer"], r["status"]) for r in retries] == [("retry", 429), ("retry", 503)]
    assert retries[0]["delay_s"] == 0.05 and 0.01 <= retries[1]["delay_s"] <= 0.05
    waits = [e.args["delay"] for e in rt.recording.segments[0].effects if e.kind == "call_later"]
    assert 0.05 in waits and retries[1]["delay_s"] in waits  # the waits are the port's timers


# -- the fault suite: the lease lost while a tool runs; the control watch failing for a while --------------------
async def test_a_lease_that_cannot_be_renewed_replays() -> None:
    """Every lease renewal fails while a side-effect call runs: the worker stops driving before its lease
    expires (the watch tells the run: a callback, replayed), and a resume finishes."""
    from fsm_agent.testing import FaultyStore

    done: list[int] = []
    person = _Person(done)
    faulty: list[Any] = []

    def build(live: bool) -> Agent:
        store: Any = MemoryStore()
        if live:
            store = FaultyStore(store)
            faulty[:] = [store]
        script = [tool_call_response(ToolUseBlock("call_1", "act", {"n": 1})), "all done"]
        return Agent(ScriptedProvider(script) if live else never_called(), tools=[_act_tool({1: 3.0}, done)],
                     store=store, lease_ttl=0.6, control_poll=0.05, worker_id="w1")

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        if live:
            faulty[0].fail("acquire_lease", nth=2, for_seconds=30.0, transient=True)  # every renewal fails
        out = [await outcome_of(agent.run("do it", session_id=SID, port=port))]
        if live:
            faulty[0].clear()
            await asyncio.sleep(0.7)  # the lease runs out
        await _finish(agent, port, out, person, live)
        return out

    rt = await roundtrip(build, drive, SID)
    first = rt.results[0].stop
    assert first.reason is StopReason.FAILED_RETRYABLE and (first.error or {}).get("kind") == "lease"
    assert rt.results[-1].stop.reason is StopReason.COMPLETED
    assert any(what == "lost" for what, _, _ in rt.recording.segments[0].arrivals)


async def test_an_interrupt_seen_after_the_control_watch_failed_for_a_while_replays() -> None:
    """``peek_controls`` fails (transiently) while a slow answer streams; an Interrupt sent after that
    still stops the run, and it resumes."""
    from fsm_agent.testing import FaultyStore

    faulty: list[Any] = []
    ref: list[Agent] = []

    class Outside:
        def __init__(self) -> None:
            self.events = 0

        def on_model_event(self, event: Any) -> None:
            self.events += 1
            if self.events == 40:  # the watch has failed a few times by now
                asyncio.ensure_future(ref[0].control(SID, _control("interrupt", "enough")))

    def build(live: bool) -> Agent:
        store: Any = MemoryStore()
        if live:
            store = FaultyStore(store)
            faulty[:] = [store]
        provider = (ScriptedProvider(["word " * 200, "all done"], stream_delay=0.005, chunk_chars=5) if live
                    else never_called())
        agent = Agent(provider, store=store, config=RunConfig(stream=True), control_poll=0.02,
                      observers=[Outside()] if live else [])
        ref[:] = [agent]
        return agent

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        if live:
            faulty[0].fail("peek_controls", for_seconds=0.15, transient=True)
        out = [await outcome_of(agent.run("talk", session_id=SID, port=port))]
        out.append(await outcome_of(agent.resume(SID, port=port)))
        return out

    rt = await roundtrip(build, drive, SID)
    assert [r.stop.reason for r in rt.results] == [StopReason.INTERRUPTED, StopReason.COMPLETED]
    assert faulty[0].failures
