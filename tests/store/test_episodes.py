"""Episode stores (episodic memory): one suite, both backends (SQLite FTS5 and PostgreSQL full-text
search on the throwaway cluster), through the public API of fsm_agent.store."""

from __future__ import annotations

import sqlite3

import pytest

from fsm_agent.errors import ConfigurationError, StoreError
from fsm_agent.store import (
    Episode,
    EpisodeStep,
    PostgresEpisodeStore,
    SQLiteEpisodeStore,
    SQLiteStore,
    SessionRecord,
    open_episode_store,
)


@pytest.fixture(params=["sqlite", "postgres"])
async def episodes(request, tmp_path):
    if request.param == "sqlite":
        s = SQLiteEpisodeStore(tmp_path / "sessions.db")
    else:
        s = PostgresEpisodeStore(request.getfixturevalue("postgres_dsn"))
    yield s
    await s.close()


def ep(eid: str, goal: str, *, tenant: str = "acme", outcome: str = "COMPLETED", answer: str = "",
       steps: tuple[EpisodeStep, ...] = (), failures: tuple[str, ...] = (), at: float = 1000.0) -> Episode:
    return Episode(eid, tenant, eid, goal, outcome, answer=answer, steps=steps, failures=failures,
                   created_at=at, updated_at=at)


async def test_save_get_list_delete_per_tenant(episodes) -> None:
    a = await episodes.save(ep("s1", "Pay invoice 17", at=1000.0,
                               steps=(EpisodeStep("pay", '{"invoice":17}', "paid", True),)))
    await episodes.save(ep("s2", "Book a flight", at=1001.0))
    await episodes.save(ep("s3", "Other tenant's task", tenant="beta", at=1002.0))
    assert a.steps[0] == EpisodeStep("pay", '{"invoice":17}', "paid", True)
    assert await episodes.get("s1", tenant="acme") == a
    assert await episodes.get("s1", tenant="beta") is None  # another tenant's episode is not there for beta
    assert (await episodes.get("s3")).tenant == "beta"  # tenant=None: the operator's view
    assert [e.episode_id for e in await episodes.list_episodes(tenant="acme")] == ["s2", "s1"]
    assert [e.episode_id for e in await episodes.list_episodes()] == ["s3", "s2", "s1"]
    assert [e.episode_id for e in await episodes.list_episodes(tenant="acme", limit=1)] == ["s2"]
    assert await episodes.delete("s1", tenant="beta") is False
    assert await episodes.delete("s1", tenant="acme") is True
    assert await episodes.delete("s1", tenant="acme") is False
    assert await episodes.get("s1") is None
    assert await episodes.search("acme", "invoice") == []  # gone from the index too
    assert await episodes.delete_tenant("acme") == 1
    assert [e.episode_id for e in await episodes.list_episodes()] == ["s3"]


async def test_a_second_save_replaces_the_episode_and_keeps_when_it_was_made(episodes) -> None:
    await episodes.save(ep("s1", "Pay invoice 17", outcome="WAITING_HUMAN", at=1000.0))
    again = await episodes.save(ep("s1", "Pay invoice 17", outcome="COMPLETED", answer="paid on Monday", at=2000.0))
    assert (again.created_at, again.updated_at, again.outcome) == (1000.0, 2000.0, "COMPLETED")
    assert await episodes.get("s1") == again
    assert len(await episodes.list_episodes()) == 1
    hits = await episodes.search("acme", "monday")
    assert [h.episode.outcome for h in hits] == ["COMPLETED"]  # the index follows the replacement
    with pytest.raises(ConfigurationError, match="belongs to another tenant"):
        await episodes.save(ep("s1", "steal it", tenant="beta"))
    assert (await episodes.get("s1")).tenant == "acme"


async def test_search_ranks_by_shared_rare_terms_and_stems_words(episodes) -> None:
    await episodes.save(ep("mail", "Send the invoice emails to the customer", at=1000.0))
    await episodes.save(ep("tax", "Compute the tax of an invoice", at=1001.0))
    await episodes.save(ep("weather", "What is the weather in Paris", at=1002.0))
    await episodes.save(ep("other", "Email the invoice", tenant="beta", at=1003.0))
    hits = await episodes.search("acme", "Email the invoice to Ann")
    assert [h.episode.episode_id for h in hits] == ["mail", "tax"]  # "emailing" and "emails" stem to "email"
    assert hits[0].score > hits[1].score
    assert [h.episode.episode_id for h in await episodes.search("acme", "invoice", limit=1)] in (["mail"], ["tax"])
    assert [h.episode.episode_id for h in await episodes.search("acme", "invoice", exclude=["mail", "x"])] == ["tax"]
    assert await episodes.search("acme", "the of and") == []  # only common words: nothing to look for
    assert await episodes.search("acme", "") == []
    assert await episodes.search("acme", "'\"*) OR NOT (") == []  # punctuation never reaches the query syntax


async def test_the_goal_counts_more_than_the_steps(episodes) -> None:
    await episodes.save(ep("in_steps", "Prepare the quarterly report", at=1001.0,
                           steps=(EpisodeStep("fetch", '{"what":"refunds"}', "12 refunds"),)))
    await episodes.save(ep("in_goal", "List the refunds of March", at=1000.0))
    hits = await episodes.search("acme", "refunds")
    assert [h.episode.episode_id for h in hits] == ["in_goal", "in_steps"]


async def test_chinese_text_is_found_by_a_word_inside_it(episodes) -> None:
    await episodes.save(ep("zh", "设计长期记忆系统", answer="用情节记忆保存经验", at=1000.0))
    await episodes.save(ep("en", "Design a memory system", at=1001.0))
    assert [h.episode.episode_id for h in await episodes.search("acme", "记忆")] == ["zh"]
    assert [h.episode.episode_id for h in await episodes.search("acme", "保存经验的方法")] == ["zh"]
    assert [h.episode.episode_id for h in await episodes.search("acme", "memory")] == ["en"]


async def test_failures_and_outcomes_are_searchable(episodes) -> None:
    await episodes.save(ep("f", "Pay invoice 17", outcome="FAILED_TERMINAL",
                           failures=("pay failed: card declined",), at=1000.0))
    await episodes.save(ep("ok", "Pay invoice 18", at=1001.0))
    assert [h.episode.episode_id for h in await episodes.search("acme", "declined card")] == ["f"]


async def test_the_embedding_hook_finds_what_shares_no_word(request, tmp_path) -> None:
    concepts = {"car": (1.0, 0.0), "automobile": (1.0, 0.0), "vehicle": (0.9, 0.1), "cake": (0.0, 1.0),
                "dessert": (0.0, 1.0)}
    calls = []

    async def embed(text: str) -> list[float]:
        calls.append(text)
        v = [0.0, 0.0]
        for word in text.lower().split():
            x, y = concepts.get(word.strip(".,?"), (0.0, 0.0))
            v[0] += x
            v[1] += y
        return v if any(v) else [0.001, 0.001]

    for backend in ("sqlite", "postgres"):
        store = (SQLiteEpisodeStore(tmp_path / f"{backend}.db", embed=embed) if backend == "sqlite"
                 else PostgresEpisodeStore(request.getfixturevalue("postgres_dsn"), embed=embed))
        try:
            await store.save(ep("cars", "Wash the automobile", at=1000.0))
            await store.save(ep("cakes", "Bake a dessert", at=1001.0))
            hits = await store.search("acme", "vehicle")
            assert [h.episode.episode_id for h in hits][:1] == ["cars"], backend
            plain = SQLiteEpisodeStore(tmp_path / f"{backend}.db") if backend == "sqlite" else \
                PostgresEpisodeStore(store.dsn)
            assert await plain.search("acme", "vehicle") == []  # without the hook: words only
            await plain.close()
        finally:
            await store.close()
    assert "vehicle" in calls and any("Wash the automobile" in c for c in calls)


async def test_a_bad_embedding_is_a_clear_error(tmp_path) -> None:
    store = SQLiteEpisodeStore(tmp_path / "m.db", embed=lambda text: [float("nan")])
    with pytest.raises(ConfigurationError, match="NaN"):
        await store.save(ep("s", "x"))
    store.embed = lambda text: "not a vector"
    with pytest.raises(ConfigurationError, match="sequence of floats"):
        await store.save(ep("s", "x"))
    await store.close()
    with pytest.raises(ConfigurationError, match="embed must be a function"):
        SQLiteEpisodeStore(tmp_path / "m.db", embed=42)


@pytest.mark.parametrize("call", [
    lambda s: s.search("", "x"), lambda s: s.search("acme", "x", limit=0), lambda s: s.search("acme", 42),
    lambda s: s.list_episodes(limit=True), lambda s: s.get("", tenant="acme"), lambda s: s.delete("s", tenant="a\nb"),
    lambda s: s.save({"goal": "x"}), lambda s: s.delete_tenant(""),
])
async def test_bad_arguments_are_configuration_errors(call, tmp_path) -> None:
    store = SQLiteEpisodeStore(tmp_path / "m.db")
    with pytest.raises(ConfigurationError):
        await call(store)
    await store.close()


def test_an_episode_checks_its_fields() -> None:
    with pytest.raises(ConfigurationError, match="tenant"):
        Episode("s", "", "s", "goal", "COMPLETED")
    with pytest.raises(ConfigurationError, match="episode id"):
        Episode("", "acme", "s", "goal", "COMPLETED")
    with pytest.raises(ConfigurationError, match="EpisodeStep"):
        Episode("s", "acme", "s", "goal", "COMPLETED", steps=("a step",))
    with pytest.raises(TypeError):
        Episode("s", "acme", "s", 42, "COMPLETED")


async def test_the_tables_sit_beside_the_session_store_and_survive_a_reopen(tmp_path) -> None:
    path = tmp_path / "sessions.db"
    sessions = SQLiteStore(path)
    await sessions.create_session(SessionRecord("s1", "Idle", goal="g"))
    store = open_episode_store(path)
    assert isinstance(store, SQLiteEpisodeStore) and store.schema_version() == 1
    await store.save(ep("s1", "Pay invoice 17"))
    await store.close()
    again = open_episode_store(str(path), create=False)
    assert [e.episode_id for e in await again.list_episodes()] == ["s1"]
    assert (await sessions.get_session("s1")).goal == "g"  # the session store is untouched
    await again.close()
    await sessions.close()
    with pytest.raises(ConfigurationError, match="no store at"):
        open_episode_store(tmp_path / "missing.db", create=False)
    assert isinstance(open_episode_store("postgresql://u@127.0.0.1:1/db"), PostgresEpisodeStore)


async def test_a_read_only_file_fails_with_a_store_error_naming_it(tmp_path) -> None:
    path = tmp_path / "m.db"
    store = SQLiteEpisodeStore(path)
    await store.save(ep("s1", "Pay invoice 17"))
    await store.close()
    ro = SQLiteEpisodeStore(f"file:{path}?mode=ro")
    assert [e.episode_id for e in await ro.list_episodes()] == ["s1"]  # reads work
    with pytest.raises(StoreError) as caught:
        await ro.save(ep("s2", "more"))
    assert str(path) in str(caught.value) and "memory save" in str(caught.value)
    assert not caught.value.transient
    assert isinstance(caught.value.__cause__, sqlite3.Error)
    await ro.close()


async def test_an_unreachable_postgres_is_a_store_error_without_the_password() -> None:
    store = PostgresEpisodeStore("postgresql://fsm:s3cret-pw@127.0.0.1:1/nope")
    with pytest.raises(StoreError) as caught:
        await store.list_episodes()
    assert "s3cret-pw" not in str(caught.value) and caught.value.transient
