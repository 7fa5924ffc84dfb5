"""The memory plugin (episodic memory): an episode saved when a run ends, relevant ones recalled into
the next runs' context within a token share, recall in the event log, tenants kept apart, and the
whole thing surviving a record/replay. Through the public API, on a real SQLite FTS5 store (and the
PostgreSQL one where the backend matters)."""

from __future__ import annotations

import pytest

from fsm_agent import Agent, ConfigurationError, ScriptedProvider, StopReason, SystemMessage, tool
from fsm_agent.errors import AuthenticationError, StoreError
from fsm_agent.providers import tool_call_response
from fsm_agent.store import Episode, EpisodeStep, PostgresEpisodeStore, SQLiteEpisodeStore, SQLiteStore
from fsm_agent.testing import EffectRecording
from fsm_agent.types import MemoryRecalled, count_tokens, structure
from fsm_agent_middleware.memory import RECALL_HEADER, EpisodicMemory


@tool
def lookup_invoice(number: int) -> dict:
    """Look up an invoice."""
    return {"number": number, "amount": 420, "currency": "EUR"}


@tool
def pay_invoice(number: int) -> str:
    """Pay an invoice."""
    raise RuntimeError("card declined")


def system_texts(request) -> list[str]:
    return [m.text for m in request.messages if isinstance(m, SystemMessage)]


def memory_block(request) -> str | None:
    return next((t for t in system_texts(request) if t.startswith(RECALL_HEADER)), None)


async def test_an_episode_is_saved_when_a_run_ends_with_goal_outcome_steps_and_failures(tmp_path) -> None:
    memory = SQLiteEpisodeStore(tmp_path / "s.db")
    provider = ScriptedProvider([tool_call_response(("lookup_invoice", {"number": 17})),
                                 tool_call_response(("pay_invoice", {"number": 17})),
                                 "I could not pay invoice 17: the card was declined."])
    agent = Agent(provider, tools=[lookup_invoice, pay_invoice], middleware=[EpisodicMemory(memory)],
                  store=SQLiteStore(tmp_path / "s.db"))
    result = await agent.run("Pay invoice 17", session_id="pay-17", metadata={"tenant": "acme"})
    assert result.stop.reason is StopReason.COMPLETED
    [episode] = await memory.list_episodes()
    assert (episode.episode_id, episode.tenant, episode.session_id) == ("pay-17", "acme", "pay-17")
    assert episode.goal == "Pay invoice 17"
    assert episode.outcome == "COMPLETED" and "card was declined" in episode.answer
    assert [(s.tool, s.arguments, s.ok) for s in episode.steps] == [
        ("lookup_invoice", '{"number":17}', True), ("pay_invoice", '{"number":17}', False)]
    assert "420" in episode.steps[0].result and "card declined" in episode.steps[1].result
    assert len(episode.failures) == 1 and episode.failures[0].startswith("pay_invoice: ")
    assert (episode.turns, episode.tool_calls) == (3, 2)
    await memory.close()


async def test_a_failed_run_is_saved_with_what_failed(tmp_path) -> None:
    memory = SQLiteEpisodeStore(tmp_path / "m.db")
    provider = ScriptedProvider([AuthenticationError("bad key", provider="scripted", status=401)])
    result = await Agent(provider, middleware=[EpisodicMemory(memory)]).run("Summarize the report")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    [episode] = await memory.list_episodes(tenant="default")  # a session without a tenant
    assert episode.outcome == "FAILED_TERMINAL"
    assert episode.failures and episode.failures[-1].startswith("FAILED_TERMINAL (authentication): ")
    await memory.close()


async def test_save_on_limits_what_is_saved(tmp_path) -> None:
    memory = SQLiteEpisodeStore(tmp_path / "m.db")
    plugin = EpisodicMemory(memory, save_on=[StopReason.COMPLETED])
    await Agent(ScriptedProvider([AuthenticationError("x", provider="scripted", status=401)]),
                middleware=[plugin]).run("one")
    await Agent(ScriptedProvider(["ok"]), middleware=[plugin]).run("two")
    assert [e.goal for e in await memory.list_episodes()] == ["two"]
    await memory.close()


async def seed(memory, tenant: str = "acme") -> None:
    await memory.save(Episode("old-pay", tenant, "old-pay", "Pay invoice 12 to ACME Corp", "FAILED_TERMINAL",
                              answer="Payment failed", failures=("pay_invoice: card declined",),
                              steps=(EpisodeStep("pay_invoice", '{"number":12}', "card declined", False),),
                              created_at=1.0, updated_at=1.0))
    await memory.save(Episode("old-weather", tenant, "old-weather", "What is the weather in Paris", "COMPLETED",
                              answer="Sunny", created_at=2.0, updated_at=2.0))


async def test_relevant_episodes_are_recalled_into_the_context_and_logged(tmp_path) -> None:
    memory = SQLiteEpisodeStore(tmp_path / "s.db")
    await seed(memory)
    provider = ScriptedProvider([tool_call_response(("lookup_invoice", {"number": 17})), "Paid."])
    store = SQLiteStore(tmp_path / "s.db")
    agent = Agent(provider, tools=[lookup_invoice], system_prompt="You pay invoices.",
                  middleware=[EpisodicMemory(memory, max_context_tokens=8000)], store=store)
    result = await agent.run("Pay invoice 17 to ACME Corp", session_id="new", metadata={"tenant": "acme"})
    assert result.stop.reason is StopReason.COMPLETED
    first, second = provider.requests
    block = memory_block(first)
    assert block is not None and "Goal: Pay invoice 12 to ACME Corp" in block and "card declined" in block
    assert "weather" not in block  # not relevant: not recalled
    assert system_texts(first)[0] == "You pay invoices."  # after the system prompt, before the conversation
    assert memory_block(second) == block  # kept for every model call of the run
    assert all(not isinstance(m, SystemMessage) or not m.text.startswith(RECALL_HEADER)
               for m in result.messages)  # the transcript of record is not changed
    [event] = await store.read_events("new", types=("memory_recalled",))
    p = event.payload
    assert (p["tenant"], p["episodes"], p["skipped"], p["error"]) == ("acme", ["old-pay"], [], None)
    assert p["budget"] == 800 and 0 < p["tokens"] <= 800 and p["tokens"] == count_tokens(block)
    assert p["query"] == "Pay invoice 17 to ACME Corp" and p["scores"][0] > 0
    await store.close()
    await memory.close()


async def test_recall_stays_within_the_token_share(tmp_path) -> None:
    memory = SQLiteEpisodeStore(tmp_path / "m.db")
    long = tuple(EpisodeStep("fetch", '{"page":%d}' % i, "invoice data " * 40) for i in range(8))
    for i in range(5):
        await memory.save(Episode(f"e{i}", "acme", f"e{i}", f"Reconcile invoice batch {i}", "COMPLETED",
                                  answer="invoice batch reconciled " * 20, steps=long, created_at=i, updated_at=i))
    events = []
    for window, share in ((4000, 0.1), (4000, 0.05), (20000, 0.5)):
        provider = ScriptedProvider(["ok"])
        plugin = EpisodicMemory(memory, limit=5, token_share=share, max_context_tokens=window, max_tokens=100_000)
        agent = Agent(provider, middleware=[plugin])
        result = await agent.run("Reconcile invoice batch 9", metadata={"tenant": "acme"})
        [logged] = await agent.store.read_events(result.session_id, types=(MemoryRecalled.TAG,))
        ev = structure(logged.payload, MemoryRecalled)
        events.append(ev)
        budget = int(window * share)
        block = memory_block(provider.requests[0])
        assert ev.budget == budget
        assert block is not None and count_tokens(block) <= budget and ev.tokens == count_tokens(block)
        assert len(ev.episodes) + len(ev.skipped) == 5
    assert len(events[0].episodes) < 5 and events[0].skipped  # 400 tokens: not every episode fits whole
    assert len(events[2].episodes) == 5 and not events[2].skipped  # 10,000 tokens: all of them
    # a budget too small for one whole episode: it is shown without its steps
    provider = ScriptedProvider(["ok"])
    await Agent(provider, middleware=[EpisodicMemory(memory, limit=1, max_tokens=60)]).run(
        "Reconcile invoice batch 9", metadata={"tenant": "acme"})
    block = memory_block(provider.requests[0])
    assert block is not None and "- fetch(" not in block and count_tokens(block) <= 60
    await memory.close()


async def test_nothing_fits_nothing_is_put_in_but_the_recall_is_logged(tmp_path) -> None:
    memory = SQLiteEpisodeStore(tmp_path / "s.db")
    await seed(memory)
    provider = ScriptedProvider(["ok"])
    store = SQLiteStore(tmp_path / "s.db")
    await Agent(provider, middleware=[EpisodicMemory(memory, max_tokens=10)], store=store).run(
        "Pay invoice 17", session_id="s", metadata={"tenant": "acme"})
    assert memory_block(provider.requests[0]) is None
    [event] = await store.read_events("s", types=("memory_recalled",))
    assert event.payload["episodes"] == [] and event.payload["skipped"] == ["old-pay"]
    assert event.payload["tokens"] == 0 and event.payload["budget"] == 10
    await store.close()
    await memory.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_tenants_never_see_each_others_episodes(backend, request, tmp_path) -> None:
    memory = SQLiteEpisodeStore(tmp_path / "m.db") if backend == "sqlite" else \
        PostgresEpisodeStore(request.getfixturevalue("postgres_dsn"))
    await seed(memory, tenant="beta")
    provider = ScriptedProvider(["ok"], repeat_last=True)
    plugin = EpisodicMemory(memory)
    await Agent(provider, middleware=[plugin]).run("Pay invoice 12 to ACME Corp", metadata={"tenant": "acme"})
    assert memory_block(provider.requests[0]) is None
    await Agent(provider, middleware=[plugin]).run("Pay invoice 12 to ACME Corp", metadata={"tenant": "beta"})
    assert "Pay invoice 12" in memory_block(provider.requests[1])
    assert sorted(e.tenant for e in await memory.list_episodes()) == ["acme", "beta", "beta", "beta"]
    await Agent(provider, middleware=[EpisodicMemory(memory, tenant="acme")]).run(
        "Pay invoice 12 to ACME Corp", metadata={"tenant": "beta"})  # a fixed tenant wins
    assert "Pay invoice 12" in memory_block(provider.requests[2])  # acme's own episode from the first run
    await memory.close()


async def test_a_resumed_session_replaces_its_episode_and_never_recalls_itself(tmp_path) -> None:
    memory = SQLiteEpisodeStore(tmp_path / "s.db")
    from fsm_agent import Decision
    from fsm_agent_middleware.approval import HumanApproval

    provider = ScriptedProvider([tool_call_response(("lookup_invoice", {"number": 17})), "Invoice 17 is 420 EUR."])
    agent = Agent(provider, tools=[lookup_invoice], store=SQLiteStore(tmp_path / "s.db"),
                  middleware=[EpisodicMemory(memory), HumanApproval(tools=["lookup_invoice"])])
    first = await agent.run("Look up invoice 17", session_id="s17")
    assert first.stop.reason is StopReason.WAITING_HUMAN
    [waiting] = await memory.list_episodes()
    assert waiting.outcome == "WAITING_HUMAN"
    call_id = first.stop.pending_actions[0].call.id
    done = await agent.resume("s17", decisions={call_id: Decision.approve()})
    assert done.stop.reason is StopReason.COMPLETED
    [final] = await memory.list_episodes()
    assert (final.outcome, final.created_at) == ("COMPLETED", waiting.created_at)
    assert final.updated_at >= waiting.updated_at and [s.tool for s in final.steps] == ["lookup_invoice"]
    assert all(memory_block(r) is None for r in provider.requests)  # its own episode is not a memory
    await memory.close()


async def test_a_store_that_fails_leaves_the_run_without_memory_and_says_why(tmp_path) -> None:
    class Locked(SQLiteEpisodeStore):
        async def search(self, tenant, query, **kw):
            raise StoreError(self.location, "memory search", "database is locked", transient=True)

    broken = Locked(tmp_path / "m.db")
    await seed(broken)
    provider = ScriptedProvider(["ok"])
    store = SQLiteStore(tmp_path / "s.db")
    result = await Agent(provider, middleware=[EpisodicMemory(broken)], store=store).run(
        "Pay invoice 12", session_id="s", metadata={"tenant": "acme"})
    assert result.stop.reason is StopReason.COMPLETED and result.output == "ok"
    [event] = await store.read_events("s", types=("memory_recalled",))
    assert event.payload["episodes"] == [] and "memory search failed: database is locked" in event.payload["error"]
    assert [e.episode_id for e in await broken.list_episodes()] == ["s", "old-weather", "old-pay"]  # saved anyway
    await store.close()
    await broken.close()


async def test_memory_survives_a_record_and_replay(tmp_path) -> None:
    memory = SQLiteEpisodeStore(tmp_path / "live.db")
    await seed(memory)
    live_provider = ScriptedProvider([tool_call_response(("lookup_invoice", {"number": 12})), "It is 420 EUR."])
    live = Agent(live_provider, tools=[lookup_invoice], middleware=[EpisodicMemory(memory)],
                 store=SQLiteStore(tmp_path / "live.db"))
    recording = EffectRecording()
    result = await live.run("Pay invoice 12 to ACME Corp", session_id="r", metadata={"tenant": "acme"},
                            port=recording.record)
    kinds = [(e.args["method"]) for e in recording.segments[0].effects if e.kind == "plugin_effect"]
    assert kinds == ["recall_episodes", "save_episode"]
    assert await memory.get("r") is not None

    empty = SQLiteEpisodeStore(tmp_path / "replay.db")  # a replay touches no store: this one stays empty

    def boom(request):
        raise AssertionError("a replay called the provider")

    replay = Agent(ScriptedProvider([boom], repeat_last=True), tools=[lookup_invoice],
                   middleware=[EpisodicMemory(empty)], store=SQLiteStore(tmp_path / "replay.db"))
    again = await replay.run("Pay invoice 12 to ACME Corp", session_id="r", metadata={"tenant": "acme"},
                             port=recording.replay)
    recording.check()
    assert again == result
    assert "Pay invoice 12 to ACME Corp" in recording.requests[0]["messages"][0]["content"][0]["text"]
    assert await empty.list_episodes() == []
    await memory.close()
    await empty.close()


@pytest.mark.parametrize("kwargs", [{"token_share": 0}, {"token_share": 0.9}, {"token_share": True},
                                    {"limit": 0}, {"max_tokens": -1}, {"max_context_tokens": 0}, {"tenant": ""},
                                    {"store": 42}])
def test_bad_options_are_configuration_errors(kwargs) -> None:
    with pytest.raises(ConfigurationError):
        EpisodicMemory(**kwargs)


async def test_the_default_store_sits_beside_the_cli_session_store(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FSM_AGENT_STORE", str(tmp_path / "sessions.db"))
    plugin = EpisodicMemory()
    await Agent(ScriptedProvider(["ok"]), middleware=[plugin]).run("Remember me")
    assert [e.goal for e in await SQLiteEpisodeStore(tmp_path / "sessions.db").list_episodes()] == ["Remember me"]
    await plugin.aclose()
