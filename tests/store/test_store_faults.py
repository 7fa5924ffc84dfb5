"""Store failures are typed (issue 8 §4): a failed operation raises StoreError naming the location,
the operation and the cause, says whether retrying may help, leaves nothing half-written and
leaves the store usable. Real conditions where the machine allows them (a read-only SQLite file, a
locked database, a full tmpfs, a read-only mount, a terminated PostgreSQL backend, a read-only
PostgreSQL database), and the FaultyStore test double for the rest."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time

import pytest

from mounts import mount_or_skip, umount

from fsm_agent.errors import LeaseLost, SessionExistsError, StoreError
from fsm_agent.store import (
    Checkpoint,
    ControlKind,
    ControlRecord,
    EventRecord,
    LedgerEntry,
    LedgerStatus,
    MemoryStore,
    SessionRecord,
    SQLiteStore,
    WriteBatch,
)
from fsm_agent.testing import FaultyStore, carries_ledger


def _events(sid: str, first: int, n: int, size: int = 10) -> tuple[EventRecord, ...]:
    return tuple(EventRecord(sid, first + i, "message", {"text": os.urandom(size // 2).hex()}) for i in range(n))


def _ledger(sid: str, call: str, status: LedgerStatus, effect: str = "side_effect") -> LedgerEntry:
    return LedgerEntry(sid, call, "send", {"to": "a"}, f"key-{call}", effect, status, 1)


async def _seed(store, sid: str = "early") -> None:
    await store.create_session(SessionRecord(sid, "Idle", goal="kept"))
    await store.write(WriteBatch(sid, _events(sid, 1, 2), Checkpoint(f"{sid}-c1", sid, 2, "PreTurn", {"turn": 0}),
                                 (_ledger(sid, "c1", LedgerStatus.COMPLETED),), state="PreTurn"))


async def _assert_intact(store, sid: str = "early") -> None:
    rec = await store.get_session(sid)
    assert rec is not None and rec.goal == "kept" and rec.last_seq == 2 and rec.state == "PreTurn"
    assert [e.seq for e in await store.read_events(sid)] == [1, 2]
    assert (await store.latest_checkpoint(sid)).checkpoint_id == f"{sid}-c1"
    assert set(await store.ledger(sid)) == {"c1"}


_mount = mount_or_skip


_umount = umount


# -- SQLite: real conditions ---------------------------------------------------------------------
async def test_sqlite_read_only_file_raises_a_permanent_store_error_and_still_reads(tmp_path) -> None:
    path = tmp_path / "sessions.db"
    rw = SQLiteStore(path)
    await _seed(rw)
    await rw.close()
    # As root chmod does not stop writes, so the file is opened read-only the way SQLite offers.
    ro = SQLiteStore(f"file:{path}?mode=ro")
    await _assert_intact(ro)
    with pytest.raises(StoreError) as info:
        await ro.write(WriteBatch("early", _events("early", 3, 1), state="Model"))
    err = info.value
    assert (err.operation, err.transient) == ("write", False)
    assert str(path) in str(err) and "attempt to write a readonly database" in str(err)
    assert isinstance(err.__cause__, sqlite3.OperationalError)
    for call in (ro.create_session(SessionRecord("new", "Idle")), ro.acquire_lease("early", "w1", 5),
                 ro.push_control(ControlRecord("early", ControlKind.INTERRUPT)),
                 ro.write(WriteBatch("early", state="Model"))):
        with pytest.raises(StoreError, match="readonly") as info:
            await call
        assert not info.value.transient
    await _assert_intact(ro)  # nothing half-written, and reads still work
    await ro.close()


async def test_sqlite_on_a_read_only_mount_fails_to_open_naming_the_path(tmp_path) -> None:
    src, view = tmp_path / "src", tmp_path / "view"
    src.mkdir()
    view.mkdir()
    store = SQLiteStore(src / "sessions.db")
    await _seed(store)
    await store.close()
    _mount("--bind", str(src), str(view))
    try:
        _mount("-o", "remount,bind,ro", str(view))
        with pytest.raises(StoreError) as info:
            SQLiteStore(view / "sessions.db")
        assert info.value.operation == "open" and not info.value.transient
        assert str(view / "sessions.db") in str(info.value) and "unable to open database file" in str(info.value)
        with pytest.raises(StoreError) as info:  # a new store in a directory that cannot be created
            SQLiteStore(view / "sub" / "sessions.db")
        assert "Read-only file system" in str(info.value) and not info.value.transient
    finally:
        _umount(view)


async def test_sqlite_locked_database_is_a_transient_store_error_and_nothing_is_half_written(tmp_path) -> None:
    path = tmp_path / "sessions.db"
    store = SQLiteStore(path, busy_timeout=0.1)
    await _seed(store)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    try:
        started = time.monotonic()
        with pytest.raises(StoreError) as info:
            await store.write(WriteBatch("early", _events("early", 3, 2), Checkpoint("c2", "early", 4, "MidTurn", {}),
                                         (_ledger("early", "c2", LedgerStatus.STARTED),), state="Model"))
        assert time.monotonic() - started < 5
        err = info.value
        assert err.transient and err.operation == "write" and str(path) in str(err)
        assert "database is locked" in err.cause and "retrying may help" in str(err)
        for call in (store.acquire_lease("early", "w1", 5), store.write(WriteBatch("early", state="Model")),
                     store.create_session(SessionRecord("other", "Idle")),
                     store.update_metadata("early", {"a": 1})):
            with pytest.raises(StoreError, match="database is locked") as info:
                await call
            assert info.value.transient
        await _assert_intact(store)  # WAL: reads go on while another connection writes
    finally:
        other.execute("ROLLBACK")
        other.close()
    # the lock is gone: the same write now succeeds
    await store.write(WriteBatch("early", _events("early", 3, 2), Checkpoint("c2", "early", 4, "MidTurn", {}),
                                 (_ledger("early", "c2", LedgerStatus.STARTED),), state="Model"))
    assert (await store.get_session("early")).last_seq == 4
    assert await store.acquire_lease("early", "w1", 5)
    await store.close()


async def test_sqlite_real_full_disk_is_a_permanent_store_error_and_earlier_sessions_still_read(tmp_path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    _mount("-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt))
    store = None
    try:
        path = mnt / "sessions.db"
        store = SQLiteStore(path)
        await _seed(store)
        await store.create_session(SessionRecord("filler", "Idle"))
        seq, err = 0, None
        for _ in range(200):  # 512 KiB cannot hold 200 x 20 KiB
            try:
                await store.write(WriteBatch("filler", _events("filler", seq + 1, 1, size=20_000),
                                             Checkpoint(f"f{seq}", "filler", seq + 1, "PreTurn", {"turn": seq})))
            except StoreError as exc:
                err = exc
                break
            seq += 1
        assert err is not None, "the tmpfs never filled up"
        assert seq > 0 and err.operation == "write" and not err.transient
        assert "database or disk is full" in err.cause and str(path) in str(err)
        assert isinstance(err.__cause__, sqlite3.OperationalError)
        assert "free space" in str(err)  # says what a person must do
        # the failed batch left nothing behind, and every earlier write is readable
        await _assert_intact(store)
        filler = await store.get_session("filler")
        assert filler.last_seq == seq
        assert [e.seq for e in await store.read_events("filler")] == list(range(1, seq + 1))
        assert (await store.latest_checkpoint("filler")).checkpoint_id == f"f{seq - 1}"
        # still usable: a lease (an UPDATE in place) and reads work, or fail as a typed error
        try:
            await store.acquire_lease("early", "w1", 5)
        except StoreError as exc:
            assert not exc.transient
        assert [s.session_id for s in await store.list_sessions()] in (["filler", "early"], ["early", "filler"])
    finally:
        if store is not None:
            await store.close()
        _umount(mnt)


async def test_sqlite_failed_batch_is_rolled_back_whole(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await _seed(store)
    # events and the ledger go in, then the checkpoint's id collides: the whole batch must vanish
    with pytest.raises(StoreError) as info:
        await store.write(WriteBatch("early", _events("early", 3, 2), Checkpoint("early-c1", "early", 4, "MidTurn", {}),
                                     (_ledger("early", "c9", LedgerStatus.STARTED),), state="Model"))
    assert not info.value.transient and "UNIQUE" in info.value.cause
    await _assert_intact(store)
    await store.write(WriteBatch("early", _events("early", 3, 1), state="Model"))  # usable afterwards
    assert (await store.get_session("early")).last_seq == 3
    await store.close()


def test_sqlite_unopenable_path_is_a_store_error(tmp_path) -> None:
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StoreError) as info:
        SQLiteStore(tmp_path / "dir.db")
    assert info.value.operation == "open" and not info.value.transient and str(tmp_path / "dir.db") in str(info.value)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 300)
    with pytest.raises(StoreError, match="not a database") as info:
        SQLiteStore(garbage)
    assert not info.value.transient


@pytest.mark.parametrize(("code", "transient"), [
    (5, True), (6, True), (517, True), (7, True),  # BUSY, LOCKED, BUSY_SNAPSHOT, NOMEM
    (13, False), (8, False), (14, False), (10, False), (11, False), (26, False), (3, False), (1, False),
])
def test_sqlite_classification(code: int, transient: bool) -> None:
    from fsm_agent.store.sqlite import is_transient

    exc = sqlite3.OperationalError("x")
    exc.sqlite_errorcode = code
    assert is_transient(exc) is transient


# -- every store ---------------------------------------------------------------------------------
async def test_an_existing_session_id_is_a_typed_error(store) -> None:
    await store.create_session(SessionRecord("s", "Idle", goal="first"))
    with pytest.raises(SessionExistsError) as info:
        await store.create_session(SessionRecord("s", "Idle", goal="second"))
    assert isinstance(info.value, KeyError) and info.value.session_id == "s" and "already exists" in str(info.value)
    assert (await store.get_session("s")).goal == "first"


# -- PostgreSQL: real conditions ---------------------------------------------------------------------
async def _admin(dsn: str):
    import asyncpg

    return await asyncpg.connect(dsn)


async def test_postgres_terminated_backend_is_transient_and_the_store_recovers(postgres_dsn) -> None:
    from fsm_agent.store import PostgresStore

    host = postgres_dsn.split("://", 1)[1].split("@", 1)[1]
    dsn = postgres_dsn.replace("postgresql://fsm@", "postgresql://fsm:hunter2@")  # trust auth ignores it
    store = PostgresStore(dsn, min_size=1, max_size=1)
    assert "hunter2" not in store.location and store.location == f"postgresql://fsm@{host}"
    await _seed(store)
    admin = await _admin(postgres_dsn)
    try:
        # 1. killed between calls: the pool notices and the next call simply works
        await admin.fetch("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        await asyncio.sleep(0.2)
        await _assert_intact(store)
        # 2. killed in the middle of a write (blocked on the session row another transaction holds)
        lock = await _admin(postgres_dsn)
        tx = lock.transaction()
        await tx.start()
        await lock.fetch("SELECT 1 FROM sessions WHERE session_id='early' FOR UPDATE")
        write = asyncio.create_task(store.write(WriteBatch(
            "early", _events("early", 3, 2), Checkpoint("c2", "early", 4, "MidTurn", {}),
            (_ledger("early", "c2", LedgerStatus.STARTED),), state="Model")))
        for _ in range(100):
            pid = await admin.fetchval("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                       "AND wait_event_type = 'Lock'")
            if pid:
                break
            await asyncio.sleep(0.05)
        assert pid, "the write never blocked on the row lock"
        await admin.fetch("SELECT pg_terminate_backend($1)", pid)
        with pytest.raises(StoreError) as info:
            await write
        await tx.rollback()
        await lock.close()
        err = info.value
        assert err.transient and err.operation == "write", err
        assert f"postgresql://fsm@{host}" in str(err) and "hunter2" not in str(err) and "hunter2" not in repr(err)
        assert "retrying may help" in str(err)
        await _assert_intact(store)  # nothing of the interrupted write is visible
        # 3. the next call recovers: the same write now commits
        await store.write(WriteBatch("early", _events("early", 3, 2), Checkpoint("c2", "early", 4, "MidTurn", {}),
                                     (_ledger("early", "c2", LedgerStatus.STARTED),), state="Model"))
        assert (await store.get_session("early")).last_seq == 4
        assert await store.acquire_lease("early", "w1", 5)
    finally:
        await admin.close()
        await store.close()


async def test_postgres_read_only_database_is_a_permanent_store_error(postgres_dsn) -> None:
    from fsm_agent.store import PostgresStore

    rw = PostgresStore(postgres_dsn)
    await _seed(rw)
    await rw.close()
    admin = await _admin(postgres_dsn)
    try:
        await admin.execute(f"ALTER DATABASE {postgres_dsn.rsplit('/', 1)[1]} SET default_transaction_read_only = on")
    finally:
        await admin.close()
    ro = PostgresStore(postgres_dsn)
    try:
        await _assert_intact(ro)  # an up-to-date schema is only read when the store opens
        with pytest.raises(StoreError) as info:
            await ro.write(WriteBatch("early", _events("early", 3, 1), state="Model"))
        err = info.value
        assert not err.transient and err.operation == "write" and "25006" in err.cause and "read-only" in err.cause
        with pytest.raises(StoreError) as info:
            await ro.acquire_lease("early", "w1", 5)
        assert not info.value.transient
        await _assert_intact(ro)
    finally:
        await ro.close()


async def test_postgres_failed_batch_is_rolled_back_whole(postgres_dsn) -> None:
    from fsm_agent.store import PostgresStore

    store = PostgresStore(postgres_dsn)
    try:
        await _seed(store)
        with pytest.raises(StoreError) as info:
            await store.write(WriteBatch("early", _events("early", 3, 2),
                                         Checkpoint("early-c1", "early", 4, "MidTurn", {}), state="Model"))
        assert not info.value.transient and "23505" in info.value.cause
        await _assert_intact(store)
        with pytest.raises(LeaseLost):  # fencing keeps its own type
            await store.write(WriteBatch("early", state="Model", expected_owner="nobody"))
    finally:
        await store.close()


async def test_postgres_unreachable_server_is_a_transient_store_error() -> None:
    from fsm_agent.local import free_port
    from fsm_agent.store import PostgresStore

    store = PostgresStore(f"postgresql://fsm:s3cret@127.0.0.1:{free_port()}/db")
    with pytest.raises(StoreError) as info:
        await store.get_session("s")
    err = info.value
    assert err.transient and err.operation == "connect" and "s3cret" not in str(err)
    assert isinstance(err.__cause__, OSError)


@pytest.mark.parametrize(("name", "transient"), [
    ("ConnectionDoesNotExistError", True), ("ConnectionFailureError", True), ("AdminShutdownError", True),
    ("CannotConnectNowError", True), ("TooManyConnectionsError", True), ("SerializationError", True),
    ("DeadlockDetectedError", True), ("QueryCanceledError", True), ("LockNotAvailableError", True),
    ("DiskFullError", False), ("ReadOnlySQLTransactionError", False), ("InsufficientPrivilegeError", False),
    ("UniqueViolationError", False), ("DataCorruptedError", False), ("DatabaseDroppedError", False),
])
def test_postgres_classification(name: str, transient: bool) -> None:
    asyncpg = pytest.importorskip("asyncpg")
    from fsm_agent.store.postgres import is_transient

    assert is_transient(getattr(asyncpg.exceptions, name)("x")) is transient
    assert is_transient(ConnectionRefusedError(111, "refused")) is True
    assert is_transient(asyncpg.InterfaceError("connection is closed")) is True
    assert is_transient(asyncpg.InterfaceError("cannot perform operation: another operation is in progress")) is False


@pytest.mark.parametrize(("dsn", "shown"), [
    ("postgresql://fsm:hunter2@db.example:5432/app", "postgresql://fsm@db.example:5432/app"),
    ("postgresql://fsm:p%40ss@h/app?sslmode=require&password=other", "postgresql://fsm@h/app?sslmode=require"),
    ("postgres://u:hunter2@h1:1,h2:2/d", "postgres://u@h1:1,h2:2/d"),
    ("host=h user=u password='hunter 2' dbname=app", "host=h user=u dbname=app"),
    ("postgresql://fsm@h/app", "postgresql://fsm@h/app"),
])
def test_postgres_location_never_shows_the_password(dsn: str, shown: str) -> None:
    from fsm_agent.store.postgres import PostgresStore

    store = PostgresStore(dsn)
    assert store.location == shown
    err = store._error("write", OSError(f"could not reach {dsn}"))
    for secret in ("hunter2", "hunter 2", "p%40ss", "p@ss", "other"):
        assert secret not in str(err)


# -- FaultyStore ---------------------------------------------------------------------------------------
async def test_faulty_store_fails_the_nth_write_without_storing_it() -> None:
    store = FaultyStore(MemoryStore())
    fault = store.fail("write", nth=2)
    await store.create_session(SessionRecord("s", "Idle"))
    await store.write(WriteBatch("s", _events("s", 1, 1)))
    with pytest.raises(StoreError) as info:
        await store.write(WriteBatch("s", _events("s", 2, 1)))
    assert not info.value.transient and info.value.operation == "write" and "injected" in info.value.cause
    assert (await store.get_session("s")).last_seq == 1  # not stored
    await store.write(WriteBatch("s", _events("s", 2, 1)))  # times=1: the next one passes
    assert store.calls["write"] == 3 and store.calls["create_session"] == 1 and fault.fired == 1
    assert [op for op, _ in store.failures] == ["write"]


async def test_faulty_store_fails_every_lease_for_a_while() -> None:
    store = FaultyStore(MemoryStore())
    await store.create_session(SessionRecord("s", "Idle"))
    store.fail("acquire_lease", for_seconds=0.3, transient=True)
    for _ in range(3):
        with pytest.raises(StoreError) as info:
            await store.acquire_lease("s", "w1", 5)
        assert info.value.transient
    await asyncio.sleep(0.35)
    assert await store.acquire_lease("s", "w1", 5)
    assert store.calls["acquire_lease"] == 4 and len(store.failures) == 3


async def test_faulty_store_predicate_and_lost_acknowledgement() -> None:
    store = FaultyStore(MemoryStore())
    await store.create_session(SessionRecord("s", "Idle"))
    store.fail("write", when=carries_ledger(LedgerStatus.STARTED, effect="side_effect"), after_commit=True,
               error=lambda: ConnectionResetError("ack lost"))
    await store.write(WriteBatch("s", ledger=(_ledger("s", "a", LedgerStatus.APPROVED),)))  # not matched
    await store.write(WriteBatch("s", ledger=(_ledger("s", "p", LedgerStatus.STARTED, effect="pure"),)))
    with pytest.raises(ConnectionResetError, match="ack lost"):
        await store.write(WriteBatch("s", ledger=(_ledger("s", "b", LedgerStatus.STARTED),)))
    assert (await store.ledger("s"))["b"].status is LedgerStatus.STARTED  # committed, though the caller was told no


async def test_faulty_store_passes_everything_else_through(tmp_path) -> None:
    inner = SQLiteStore(tmp_path / "s.db")
    store = FaultyStore(inner)
    assert store.location == inner.location and store.path == inner.path
    everything = store.fail("*", nth=1, times=None, error=RuntimeError("down"))
    with pytest.raises(RuntimeError):
        await store.get_session("s")
    everything.disarm()
    await _seed(store)
    await _assert_intact(store)
    with pytest.raises(SessionExistsError):
        await store.create_session(SessionRecord("early", "Idle"))
    with pytest.raises(ValueError, match="unknown store operation"):
        store.fail("wrte")
    store.fail("write", nth=1, times=None)
    store.clear()
    await store.write(WriteBatch("early", state="Model"))
    await store.close()
    assert store.calls["close"] == 1
