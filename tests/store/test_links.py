"""Parent/child session links (migration 3): one suite over every store, and old databases gaining
the table cleanly."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from pathlib import Path

import pytest

from fsm_agent.store import LinkKind, SessionLink, SessionRecord, SQLiteStore
from fsm_agent.store import sqlite as sqlite_store
from fsm_agent.store.sessions import descendants

FIXTURE_V1 = Path(__file__).parents[1] / "data" / "sessions_v1.sqlite"


async def test_links_are_written_once_and_queried_both_ways(store) -> None:
    await store.create_session(SessionRecord("p", "Idle"))
    await store.create_session(SessionRecord("other", "Idle"))
    first = SessionLink("c1", "p", LinkKind.AGENT_TOOL.value, "call_1", {"tool": "researcher"}, created_at=100.0)
    assert await store.link_session(first) == (first, True)
    # the child id is unique: a second link for it (another parent, another call) changes nothing
    again, created = await store.link_session(SessionLink("c1", "other", "worker", None, created_at=200.0))
    assert not created and again == first
    await store.link_session(SessionLink("c0", "p", "handoff", created_at=50.0))
    await store.link_session(SessionLink("remote-task-9", "p", LinkKind.REMOTE.value, "call_2",
                                         {"url": "http://peer/a2a"}, created_at=150.0))
    assert [x.child_id for x in await store.children("p")] == ["c0", "c1", "remote-task-9"]
    assert await store.children("other") == [] and await store.children("unknown") == []
    assert await store.parent("c1") == first
    assert (await store.parent("remote-task-9")).metadata == {"url": "http://peer/a2a"}
    assert await store.parent("p") is None and await store.parent("nope") is None


async def test_a_link_needs_a_known_parent_and_sane_ids(store) -> None:
    await store.create_session(SessionRecord("p", "Idle"))
    with pytest.raises(KeyError, match="unknown parent session ghost"):
        await store.link_session(SessionLink("c", "ghost", "agent_tool"))
    with pytest.raises(ValueError, match="its own parent"):
        await store.link_session(SessionLink("p", "p", "agent_tool"))
    with pytest.raises(ValueError, match="non-empty kind"):
        await store.link_session(SessionLink("c", "p", ""))
    assert await store.children("p") == [] and await store.parent("c") is None


async def test_racing_writers_store_exactly_one_link(store) -> None:
    await store.create_session(SessionRecord("a", "Idle"))
    await store.create_session(SessionRecord("b", "Idle"))
    results = await asyncio.gather(*(store.link_session(SessionLink("c", parent, "worker", str(i)))
                                     for i, parent in enumerate(["a", "b"] * 5)))
    assert sum(created for _, created in results) == 1
    kept = await store.parent("c")
    assert all(r[0] == kept for r in results)
    assert len(await store.children("a")) + len(await store.children("b")) == 1


async def test_descendants_walk_the_tree_breadth_first(store) -> None:
    for sid in ("root", "a", "b", "a1"):
        await store.create_session(SessionRecord(sid, "Idle"))
    await store.link_session(SessionLink("a", "root", "worker", created_at=1.0))
    await store.link_session(SessionLink("b", "root", "worker", created_at=2.0))
    await store.link_session(SessionLink("a1", "a", "agent_tool", "call_1", created_at=3.0))
    tree = await descendants(store, "root")
    assert [(x.parent_id, x.child_id) for x in tree] == [("root", "a"), ("root", "b"), ("a", "a1")]
    assert await descendants(store, "b") == []


async def test_link_child_refuses_a_link_that_closes_a_cycle(store) -> None:
    """Review nit: C -> A closing A -> B -> C was accepted on every store."""
    from fsm_agent.errors import SessionLinkError
    from fsm_agent.orchestration.links import link_child

    for sid in ("A", "B", "C", "D"):
        await store.create_session(SessionRecord(sid, "Idle"))
    await link_child(store, "A", "B", "agent_tool", call_id="c1")
    await link_child(store, "B", "C", "worker", call_id="c2")
    with pytest.raises(SessionLinkError, match="'A' is an ancestor of session 'C'"):
        await link_child(store, "C", "A", "handoff", call_id="c3")
    with pytest.raises(SessionLinkError, match="was started by session 'A'"):  # B has its parent
        await link_child(store, "C", "B", "handoff", call_id="c4")
    assert await store.parent("A") is None
    await link_child(store, "C", "D", "handoff", call_id="c5")  # no cycle: fine
    assert [x.child_id for x in await descendants(store, "A")] == ["B", "C", "D"]


async def test_session_tree_cuts_only_the_link_that_closes_a_loop(store) -> None:
    """Review nit: a node with one already-seen child lost all its children. A loop can only be
    written around link_child (straight into the store)."""
    from fsm_agent.orchestration.links import session_tree

    for sid in ("A", "B", "C", "D"):
        await store.create_session(SessionRecord(sid, "Idle"))
    await store.link_session(SessionLink("B", "A", "agent_tool", created_at=1.0))
    await store.link_session(SessionLink("A", "B", "agent_tool", created_at=2.0))  # a loop, by hand
    await store.link_session(SessionLink("C", "B", "agent_tool", created_at=3.0))
    await store.link_session(SessionLink("D", "C", "agent_tool", created_at=4.0))
    tree = await session_tree(store, "A")
    (b,) = tree.children
    assert [k.session_id for k in b.children] == ["C"] and b.truncated  # A cut, C kept
    assert [k.session_id for k in b.children[0].children] == ["D"]


def _tables(path: Path) -> set[str]:
    con = sqlite3.connect(path)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        con.close()


async def test_a_v1_sqlite_database_migrates_to_links_and_keeps_its_sessions(tmp_path) -> None:
    path = tmp_path / "v1.sqlite"
    shutil.copy(FIXTURE_V1, path)
    assert "session_links" not in _tables(path)
    store = SQLiteStore(path)
    try:
        assert store.schema_version() == len(sqlite_store.MIGRATIONS) == 3
        assert {s.session_id for s in await store.list_sessions()} == {"v1-waiting", "v1-completed", "v1-paused"}
        await store.link_session(SessionLink("child", "v1-waiting", "agent_tool", "call_v1"))
        assert [x.child_id for x in await store.children("v1-waiting")] == ["child"]
    finally:
        await store.close()
    reopened = SQLiteStore(path)  # already current: opened without migrating again
    try:
        assert (await reopened.parent("child")).parent_id == "v1-waiting"
    finally:
        await reopened.close()


async def test_a_version_2_sqlite_database_gains_the_table(tmp_path) -> None:
    path = tmp_path / "v2.sqlite"
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
    for version, script in enumerate(sqlite_store.MIGRATIONS[:2], 1):
        for stmt in script.split(";"):
            if stmt.strip():
                con.execute(stmt)
        con.execute("INSERT INTO schema_migrations VALUES (?, 0)", (version,))
    con.execute("INSERT INTO sessions VALUES ('old', 'COMPLETED', 'g', 1, NULL, '{}', 0, 0, 0, NULL, NULL)")
    con.close()
    store = SQLiteStore(path)
    try:
        assert store.schema_version() == 3
        assert (await store.get_session("old")).state == "COMPLETED"
        assert (await store.link_session(SessionLink("kid", "old", "handoff")))[1]
    finally:
        await store.close()


async def test_a_version_2_postgres_database_gains_the_table(postgres_dsn) -> None:
    asyncpg = pytest.importorskip("asyncpg")
    from fsm_agent.store import PostgresStore
    from fsm_agent.store import postgres as pg_store

    con = await asyncpg.connect(postgres_dsn)
    try:
        await con.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
                          "applied_at DOUBLE PRECISION NOT NULL)")
        for version, script in enumerate(pg_store.MIGRATIONS[:2], 1):
            await con.execute(script)
            await con.execute("INSERT INTO schema_migrations VALUES ($1, 0)", version)
        await con.execute("INSERT INTO sessions VALUES ('old', 'COMPLETED', 'g', 1, NULL, '{}', 0, 0, 0, NULL, NULL)")
    finally:
        await con.close()
    store = PostgresStore(postgres_dsn)
    try:
        assert await store.schema_version() == len(pg_store.MIGRATIONS) == 3
        assert (await store.get_session("old")).state == "COMPLETED"
        assert (await store.link_session(SessionLink("kid", "old", "handoff", metadata={"n": 1})))[1]
        assert (await store.parent("kid")).metadata == {"n": 1}
    finally:
        await store.close()
