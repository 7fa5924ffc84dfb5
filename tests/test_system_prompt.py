"""System prompt hot reload (issue 23 item 6; docs/system-prompt.md).

The agent's system prompt changes while runs go on, from code (``Agent.set_system_prompt``) or from
a watched ``PromptFile``; the next PreTurn's model call sees it, the session log holds a
``system_prompt_changed`` event with its version and digest, a replay reproduces the same requests,
a resumed session takes the current prompt unless it pinned its own, and a session that brought its
own system message keeps it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from fsm_agent import (Agent, MemoryStore, PromptFile, PromptSnapshot, RunConfig, ScriptedProvider, StopReason,
                       SystemMessage, SystemPromptChanged, UserMessage, tool)
from fsm_agent.errors import ConfigurationError
from fsm_agent.plugins import load_plugin
from fsm_agent.prompt import prompt_digest
from fsm_agent.providers import tool_call_response
from fsm_agent.types import ToolUseBlock
from machine.replay_kit import Outcome, never_called, outcome_of, roundtrip

SID = "s-prompt"


def _systems(request: Any) -> list[str]:
    """The system messages of one model request, in order."""
    return [m.text for m in request.messages if isinstance(m, SystemMessage)]


def _script(*answers: str) -> list[Any]:
    """One call of ``change`` (its argument ``to``), then the final answer."""
    return [tool_call_response(ToolUseBlock("c1", "change", {"to": "v2"})), *answers]


def _changing_tool(effect: Any) -> Any:
    """The tool ``change(to)``, which calls ``effect(to)``."""

    @tool
    def change(to: str) -> str:
        """Change the system prompt.

        Args:
            to: the new prompt.
        """
        effect(to)
        return "changed"

    return change


class _Seen:
    def __init__(self) -> None:
        self.events: list[SystemPromptChanged] = []

    def on_system_prompt_changed(self, event: SystemPromptChanged) -> None:
        self.events.append(event)


async def _changes(agent: Agent, session_id: str = SID) -> list[dict[str, Any]]:
    return [e.payload for e in await agent.store.read_events(session_id, types=("system_prompt_changed",))]


# -- a change from code ------------------------------------------------------------------------------------
async def test_a_prompt_set_during_a_run_reaches_the_next_model_call_and_the_log() -> None:
    ref: list[Agent] = []
    provider = ScriptedProvider(_script("done"))
    seen = _Seen()
    agent = Agent(provider, tools=[_changing_tool(lambda to: ref[0].set_system_prompt(to))], system_prompt="v1",
                  store=MemoryStore(), observers=[seen])
    ref.append(agent)
    assert agent.current_system_prompt() == PromptSnapshot(1, "v1", prompt_digest("v1"), "code")

    result = await agent.run("hello", session_id=SID)

    assert result.stop.reason is StopReason.COMPLETED and result.output == "done"
    assert [_systems(r) for r in provider.requests] == [["v1"], ["v2"]]
    assert provider.requests[1].messages[0] == SystemMessage("v2")
    # the transcript keeps the message the session started with; the log says what changed and when
    assert result.messages[0] == SystemMessage("v1")
    want = {"session_id": SID, "turn": 1, "version": 2, "digest": prompt_digest("v2"), "text": "v2",
            "source": "code", "previous_digest": prompt_digest("v1")}
    assert await _changes(agent) == [{**want, "type": "system_prompt_changed"}]
    assert seen.events == [SystemPromptChanged(**want)]
    assert agent.system_prompt == "v2" and agent.current_system_prompt().version == 2


async def test_a_changed_prompt_leaves_the_context_plugins_build_from_the_transcript_alone(caplog: Any) -> None:
    # The prompt is put in place after the PreTurn middleware: compaction, which rebuilds the context
    # from the transcript's own messages, still runs (it skips a run whose ctx.messages it does not know).
    ref: list[Agent] = []
    provider = ScriptedProvider(_script("done"))
    store = MemoryStore()
    agent = Agent(provider, tools=[_changing_tool(lambda to: ref[0].set_system_prompt(to))], system_prompt="v1",
                  store=store, middleware=[load_plugin("compaction")(store=store)])
    ref.append(agent)
    with caplog.at_level(logging.WARNING, logger="fsm_agent.middleware.compaction"):
        result = await agent.run("hello", session_id=SID)
    assert result.stop.reason is StopReason.COMPLETED
    assert [_systems(r) for r in provider.requests] == [["v1"], ["v2"]]
    assert [r.getMessage() for r in caplog.records if r.name == "fsm_agent.middleware.compaction"] == []


async def test_setting_the_same_text_changes_nothing() -> None:
    agent = Agent(ScriptedProvider(["a"]), system_prompt="same")
    assert agent.set_system_prompt("same") == 1
    assert agent.set_system_prompt("other") == 2
    agent.system_prompt = "same"  # the property's setter is set_system_prompt
    assert agent.current_system_prompt() == PromptSnapshot(3, "same", prompt_digest("same"), "code")


def test_setters_in_threads_and_a_reader_see_whole_versions() -> None:
    agent = Agent(ScriptedProvider([]), system_prompt="t0")
    texts = [f"t{n}" for n in range(8)]

    def setter(k: int) -> None:
        for i in range(300):
            agent.set_system_prompt(texts[(k + i) % len(texts)])

    seen: list[PromptSnapshot] = []
    threads = [threading.Thread(target=setter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        seen.append(agent.current_system_prompt())
    for t in threads:
        t.join()
    seen.append(agent.current_system_prompt())
    assert all(s.digest == prompt_digest(s.text) and s.text in texts for s in seen)  # never a torn snapshot
    assert [s.version for s in seen] == sorted(s.version for s in seen)  # versions only go up
    by_version = {s.version: s.text for s in seen}
    assert all(by_version[s.version] == s.text for s in seen)  # one text per version


async def test_a_prompt_set_on_an_agent_without_one_is_put_first_and_none_takes_it_away() -> None:
    ref: list[Agent] = []
    provider = ScriptedProvider([tool_call_response(ToolUseBlock("c1", "change", {"to": "added"})),
                                 tool_call_response(ToolUseBlock("c2", "change", {"to": ""})), "done"])
    agent = Agent(provider, tools=[_changing_tool(lambda to: ref[0].set_system_prompt(to or None))],
                  store=MemoryStore())
    ref.append(agent)
    result = await agent.run("hello", session_id=SID)
    assert result.stop.reason is StopReason.COMPLETED
    assert [_systems(r) for r in provider.requests] == [[], ["added"], []]
    assert provider.requests[1].messages[0] == SystemMessage("added")
    assert [(c["version"], c["text"]) for c in await _changes(agent)] == [(2, "added"), (3, None)]


async def test_a_derived_agent_follows_the_prompt_of_the_agent_it_came_from() -> None:
    base = Agent(ScriptedProvider(["a"]), system_prompt="base")
    same, own = base.derive(), base.derive(system_prompt="own")
    base.set_system_prompt("changed")
    assert (same.system_prompt, own.system_prompt) == ("changed", "own")


# -- a watched file -----------------------------------------------------------------------------------------
async def test_a_prompt_file_changed_on_disk_reaches_the_next_model_call(tmp_path: Path) -> None:
    path = tmp_path / "prompt.md"
    path.write_text("  You are terse.\n")
    provider = ScriptedProvider(_script("done"))
    agent = Agent(provider, tools=[_changing_tool(lambda to: path.write_text("You are verbose.\n"))],
                  system_prompt=PromptFile(path), store=MemoryStore())

    result = await agent.run("hello", session_id=SID)

    assert result.stop.reason is StopReason.COMPLETED
    assert [_systems(r) for r in provider.requests] == [["You are terse."], ["You are verbose."]]
    assert await _changes(agent) == [{
        "session_id": SID, "turn": 1, "version": 2, "digest": prompt_digest("You are verbose."),
        "text": "You are verbose.", "source": f"file:{path.resolve()}", "previous_digest": prompt_digest("You are terse."),
        "type": "system_prompt_changed"}]


async def test_a_file_that_cannot_be_read_later_keeps_the_last_text(tmp_path: Path, caplog: Any) -> None:
    path = tmp_path / "prompt.md"
    path.write_text("kept")
    provider = ScriptedProvider(_script("done"))
    agent = Agent(provider, tools=[_changing_tool(lambda to: path.unlink())], system_prompt=PromptFile(path),
                  store=MemoryStore())
    with caplog.at_level(logging.WARNING, logger="fsm_agent.prompt"):
        result = await agent.run("hello", session_id=SID)
    assert result.stop.reason is StopReason.COMPLETED
    assert [_systems(r) for r in provider.requests] == [["kept"], ["kept"]]
    assert await _changes(agent) == []
    assert any(str(path) in r.getMessage() and "stays as last read" in r.getMessage() for r in caplog.records)


def test_a_bad_prompt_file_is_a_configuration_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.md"
    with pytest.raises(ConfigurationError, match="cannot read the system prompt file .*missing.md"):
        Agent(ScriptedProvider([]), system_prompt=PromptFile(missing))

    latin = tmp_path / "latin.md"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ConfigurationError, match="is not utf-8 text"):
        Agent(ScriptedProvider([]), system_prompt=PromptFile(latin))
    assert Agent(ScriptedProvider([]), system_prompt=PromptFile(latin, encoding="latin-1")).system_prompt == "caf\xe9"

    big = tmp_path / "big.md"
    big.write_text("x" * 11)
    with pytest.raises(ConfigurationError, match="has 11 bytes, more than max_bytes=10"):
        Agent(ScriptedProvider([]), system_prompt=PromptFile(big, max_bytes=10))
    with pytest.raises(ConfigurationError, match="max_bytes must be positive"):
        PromptFile(big, max_bytes=0)

    agent = Agent(ScriptedProvider([]), system_prompt="stays")
    with pytest.raises(ConfigurationError, match="cannot read the system prompt file"):
        agent.set_system_prompt(PromptFile(missing))
    with pytest.raises(ConfigurationError, match="a str, a PromptFile or None, not int"):
        agent.set_system_prompt(3)  # type: ignore[arg-type]
    assert agent.current_system_prompt() == PromptSnapshot(1, "stays", prompt_digest("stays"), "code")


# -- sessions that keep their prompt ------------------------------------------------------------------------
async def test_a_session_bringing_its_own_system_message_is_never_overwritten() -> None:
    ref: list[Agent] = []
    provider = ScriptedProvider(_script("done"))
    agent = Agent(provider, tools=[_changing_tool(lambda to: ref[0].set_system_prompt(to))], system_prompt="v1",
                  store=MemoryStore())
    ref.append(agent)
    result = await agent.run([SystemMessage("mine"), UserMessage("hello")], session_id=SID)
    assert result.stop.reason is StopReason.COMPLETED
    assert [_systems(r) for r in provider.requests] == [["mine"], ["mine"]]
    assert await _changes(agent) == []


async def test_a_pinned_session_keeps_the_prompt_it_started_with() -> None:
    ref: list[Agent] = []
    provider = ScriptedProvider(_script("done"))
    agent = Agent(provider, tools=[_changing_tool(lambda to: ref[0].set_system_prompt(to))], system_prompt="v1",
                  store=MemoryStore(), config=RunConfig(pin_system_prompt=True))
    ref.append(agent)
    result = await agent.run("hello", session_id=SID)
    assert result.stop.reason is StopReason.COMPLETED
    assert [_systems(r) for r in provider.requests] == [["v1"], ["v1"]]
    assert await _changes(agent) == [] and agent.system_prompt == "v2"


# -- resume ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pin", [False, True])
async def test_a_resumed_session_uses_the_current_prompt_unless_pinned(pin: bool) -> None:
    provider = ScriptedProvider([tool_call_response(ToolUseBlock("c1", "change", {"to": "unused"})), "done"])
    agent = Agent(provider, tools=[_changing_tool(lambda to: None)], system_prompt="v1", store=MemoryStore(),
                  config=RunConfig(max_iterations=1, pin_system_prompt=pin))
    first = await agent.run("hello", session_id=SID)
    assert first.stop.reason is StopReason.PAUSED_BUDGET

    agent.set_system_prompt("v2")  # between the segments, as an operator would
    done = await agent.resume(SID, max_iterations=5)

    assert done.stop.reason is StopReason.COMPLETED and done.output == "done"
    assert [_systems(r) for r in provider.requests] == [["v1"], ["v1" if pin else "v2"]]
    changes = await _changes(agent)
    assert [(c["version"], c["text"], c["turn"]) for c in changes] == ([] if pin else [(2, "v2", 1)])


async def test_a_new_agent_resuming_a_session_gives_it_its_prompt() -> None:
    # A worker restarted with another prompt: the session (not pinned) continues with the new one.
    script = [tool_call_response(ToolUseBlock("c1", "change", {"to": "unused"})), "done"]
    store = MemoryStore()
    old = Agent(ScriptedProvider(script[:1]), tools=[_changing_tool(lambda to: None)], system_prompt="old",
                store=store, config=RunConfig(max_iterations=1))
    assert (await old.run("hello", session_id=SID)).stop.reason is StopReason.PAUSED_BUDGET
    provider = ScriptedProvider(script[1:])
    new = Agent(provider, tools=[_changing_tool(lambda to: None)], system_prompt="new", store=store)
    done = await new.resume(SID, max_iterations=5)
    assert done.stop.reason is StopReason.COMPLETED
    assert [_systems(r) for r in provider.requests] == [["new"]]
    assert [(c["version"], c["text"], c["previous_digest"]) for c in await _changes(new)] == [
        (1, "new", prompt_digest("old"))]


# -- replay ---------------------------------------------------------------------------------------------------
async def test_a_run_and_its_resume_with_prompt_changes_replay_the_same_requests(tmp_path: Path) -> None:
    path = tmp_path / "prompt.md"
    path.write_text("first")

    def build(live: bool) -> Agent:
        script = [tool_call_response(ToolUseBlock("c1", "change", {"to": "second"})),
                  tool_call_response(ToolUseBlock("c2", "change", {"to": "third"})), "finished"]
        return Agent(ScriptedProvider(script) if live else never_called(), system_prompt=PromptFile(path),
                     tools=[_changing_tool(lambda to: path.write_text(to))], store=MemoryStore(),
                     config=RunConfig(max_iterations=2))

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        first = await outcome_of(agent.run("work", session_id=SID, port=port))
        if live:
            path.write_text("fourth")  # changed while the session waits to be resumed
        second = await outcome_of(agent.resume(SID, max_iterations=10, port=port))
        return [first, second]

    rt = await roundtrip(build, drive, SID)  # the replaying agent's file holds "fourth" all along

    first, second = rt.results
    assert first.stop.reason is StopReason.PAUSED_BUDGET
    assert second.stop.reason is StopReason.COMPLETED and second.output == "finished"
    assert [_systems(r) for r in rt.live_requests] == [["first"], ["second"], ["fourth"]]
    assert [_systems(r) for r in rt.replayed_requests] == [["first"], ["second"], ["fourth"]]
    logged = [e for e in rt.recording.events if e["type"] == "system_prompt_changed"]
    assert [(e["payload"]["version"], e["payload"]["text"]) for e in logged] == [(2, "second"), (3, "fourth")]


async def test_a_prompt_set_from_code_replays_though_nothing_sets_it_in_the_replay() -> None:
    def build(live: bool) -> Agent:
        ref: list[Agent] = []
        agent = Agent(ScriptedProvider(_script("done")) if live else never_called(), system_prompt="v1",
                      tools=[_changing_tool(lambda to: ref[0].set_system_prompt(to))], store=MemoryStore())
        ref.append(agent)
        return agent

    async def drive(agent: Agent, port: Any, live: bool) -> list[Outcome]:
        return [await outcome_of(agent.run("hello", session_id=SID, port=port))]

    rt = await roundtrip(build, drive, SID)  # the replay runs no tool: its agent's prompt stays "v1"
    assert [_systems(r) for r in rt.replayed_requests] == [["v1"], ["v2"]]
    reads = [e for e in rt.recording.segments[0].effects if e.kind == "system_prompt"]
    assert [e.args for e in reads] == [{"source": f"code:{prompt_digest('v1')}"}] * 2
