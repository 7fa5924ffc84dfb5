"""A plugin's own I/O as an effect of the run (``ctx.plugin_effect``), and the session's metadata in
the plugin's view (``ctx.metadata``): recorded live, answered from the recording in a replay."""

from __future__ import annotations

import pytest

from fsm_agent import Agent, ConfigurationError, Middleware, ScriptedProvider, StopReason, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.store import QUEUED, MemoryStore, SessionRecord
from fsm_agent.testing import EffectRecording

from .replay_kit import never_called


class Lookup(Middleware):
    """Asks its own service once per run (through the run's effects) and puts the answer in the context."""

    name = "lookup"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.seen_metadata: list[dict] = []

    async def fetch(self, tenant: str, query: str) -> dict:
        self.calls.append((tenant, query))
        return {"tenant": tenant, "answer": f"{len(self.calls)} call(s) so far"}

    async def pre_turn(self, ctx) -> None:
        self.seen_metadata.append(dict(ctx.metadata))
        st = ctx.state(self)
        if "got" not in st:
            st["got"] = await ctx.plugin_effect(self, "fetch", ctx.metadata.get("tenant", "none"), "q")
        from fsm_agent import SystemMessage

        ctx.messages.insert(0, SystemMessage(f"service says: {st['got']['answer']}"))


async def test_plugin_effect_is_recorded_live_and_replayed_without_calling_the_plugin() -> None:
    live_plugin = Lookup()
    live = Agent(ScriptedProvider(["done"]), middleware=[live_plugin])
    recording = EffectRecording()
    result = await live.run("hi", session_id="s1", metadata={"tenant": "acme"}, port=recording.record)
    assert result.stop.reason is StopReason.COMPLETED
    assert live_plugin.calls == [("acme", "q")]
    effects = [e for e in recording.segments[0].effects if e.kind == "plugin_effect"]
    assert [e.args for e in effects] == [{"plugin": "lookup", "method": "fetch", "args": ["acme", "q"]}]

    replay_plugin = Lookup()
    replay = Agent(never_called(), middleware=[replay_plugin], store=MemoryStore())
    again = await replay.run("hi", session_id="s1", metadata={"tenant": "acme"}, port=recording.replay)
    recording.check()
    assert replay_plugin.calls == []  # answered from the recording
    assert again.output == result.output
    assert recording.requests[0]["messages"][0]["content"][0]["text"] == "service says: 1 call(s) so far"


async def test_metadata_reaches_the_plugins_on_run_resume_and_a_queued_session() -> None:
    @tool
    def ping() -> str:
        """Ping."""
        return "pong"

    plugin = Lookup()
    store = MemoryStore()
    agent = Agent(ScriptedProvider([tool_call_response(("ping", {})), "a", "b"]), tools=[ping], middleware=[plugin],
                  store=store)
    r = await agent.run("hi", session_id="s", metadata={"tenant": "acme", "user": "ann"}, max_iterations=1)
    assert r.stop.reason is StopReason.PAUSED_BUDGET
    plugin.seen_metadata.clear()
    await agent.resume("s", max_iterations=5)
    assert plugin.seen_metadata == [{"tenant": "acme", "user": "ann"}]
    # a session a server created QUEUED with its tenant: the run that adopts it sees the stored metadata
    await store.create_session(SessionRecord("q", QUEUED, goal="x", metadata={"tenant": "beta", "task": "x"}))
    await agent.run("x", session_id="q")
    assert plugin.seen_metadata[-1] == {"tenant": "beta", "task": "x"}
    assert plugin.calls[-1] == ("beta", "q")


async def test_metadata_is_read_only_for_plugins() -> None:
    class Writer(Middleware):
        def pre_turn(self, ctx) -> None:
            ctx.metadata["tenant"] = "other"

    r = await Agent(ScriptedProvider(["a"]), middleware=[Writer()]).run("hi", metadata={"tenant": "acme"})
    assert r.stop.reason is StopReason.FAILED_TERMINAL
    assert "does not support item assignment" in r.stop.detail


@pytest.mark.parametrize("case", ["no_method", "dunder", "not_in_chain"])
async def test_a_bad_plugin_effect_is_a_clear_configuration_error(case: str) -> None:
    outsider = Lookup()

    class Bad(Middleware):
        name = "bad"

        async def pre_turn(self, ctx) -> None:
            if case == "no_method":
                await ctx.plugin_effect(self, "nothing_here")
            elif case == "dunder":
                await ctx.plugin_effect(self, "__init__")
            else:
                await ctx.plugin_effect(outsider, "fetch", "t", "q")

    r = await Agent(ScriptedProvider(["a"]), middleware=[Bad()]).run("hi")
    assert r.stop.reason is StopReason.FAILED_TERMINAL
    assert r.stop.error["kind"] == "middleware" and r.stop.error["hook"] == "pre_turn"
    assert "ConfigurationError: ctx.plugin_effect" in r.stop.detail
    assert {"no_method": "has no method 'nothing_here'", "dunder": "has no method '__init__'",
            "not_in_chain": "is not a middleware of this run's chain"}[case] in r.stop.detail
    assert outsider.calls == []


async def test_a_context_no_driver_runs_calls_the_method_itself() -> None:
    plugin = Lookup()
    ctx = Agent(ScriptedProvider(["a"]), middleware=[plugin]).new_context([])
    assert await ctx.plugin_effect(plugin, "fetch", "t", "q") == {"tenant": "t", "answer": "1 call(s) so far"}
    with pytest.raises(ConfigurationError):
        await ctx.plugin_effect(plugin, "missing")
