"""Persistence: fsm_agent's SQLite and PostgreSQL stores vs LangGraph's SQLite and Postgres checkpointers.

Both sides run the same kind of session: one user message, N tool turns (the model asks for one
``get_weather`` call per turn, with different arguments each time), then a final answer; the model
is a local fake (fsm_agent: ``ScriptedProvider``; LangGraph: a ``BaseChatModel`` subclass in a
``StateGraph`` of a model node and a ``ToolNode``, checkpointing every step), so only the runtime and
its persistence cost time.

Measured, for each backend (SQLite file; PostgreSQL: a throwaway cluster started here as in
tests/conftest.py, with the server's default durability (fsync on), or ``--pg-dsn``):

* **write latency** — every persistence call of the runs, timed around the store's own method:
  fsm_agent ``Store.write`` (one transaction: events, checkpoint, ledger, session row); those that
  carry a checkpoint are "checkpoint writes". LangGraph ``aput`` (a checkpoint) and ``aput_writes``
  (a task's pending writes). p50/p95 over all runs of all sizes; calls per turn; persistence time
  per turn; for fsm_agent also events/s (log events appended per second of write time).
* **resume** — a session paused after 100 tool turns (fsm_agent: ``max_iterations=100`` →
  PAUSED_BUDGET; LangGraph: the graph compiled with ``interrupt_before=["model"]``, so every
  invoke stops before the next model call), then, with a new store / checkpointer connection:
  *load* (fsm_agent ``load_session``: checkpoint + transcript rebuilt from the log; LangGraph
  ``aget_state``) and *resume one turn* (fsm_agent ``Agent.resume(..., max_iterations=+1)`` →
  one turn → PAUSED_BUDGET again; LangGraph ``ainvoke(None)`` → one turn → interrupted again).
  Medians of ``--resumes`` resumes (each adds one turn).
* **size growth** — a fresh database per size (10, 50, 100, 200 turns) holding that one session:
  SQLite file bytes (after a WAL checkpoint) and the stored payload bytes per table; PostgreSQL
  ``pg_total_relation_size`` of the tables minus the empty schema. Bytes per turn = the slope
  between the two largest sizes.

Durability is the same on both sides: SQLite in WAL mode with ``synchronous=NORMAL`` (fsm_agent's
default; LangGraph's saver connection is set to the same), PostgreSQL the server's defaults.
Runs alternate between the two runtimes (the order rotates per size).

    python bench/bench_store.py              # sizes 10, 50, 100, 200; about 2-4 minutes
    python bench/bench_store.py --quick      # sizes 10, 50, 100; fewer resumes
    python bench/bench_store.py --pg-dsn postgresql://user@host:5432/postgres   # an existing server
    python bench/bench_store.py --no-postgres
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # measure the tree this script sits in
sys.path.insert(0, str(HERE))

from _common import machine, median, pct, rotate, say, table, versions, write_results  # noqa: E402

TASK = "Get the weather for a long list of cities, one at a time."


def get_weather(city: str) -> str:
    """Current weather for a city.

    Args:
        city: the city name.
    """
    return f"{city}: 21 C, light wind"


class Timings:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def add(self, kind: str, seconds: float, **extra: Any) -> None:
        self.calls.append({"kind": kind, "s": seconds, **extra})

    def of(self, kind: str) -> list[float]:
        return [c["s"] for c in self.calls if c["kind"] == kind]


# ============================================================================ PostgreSQL
def _pg_bin(name: str) -> str | None:
    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A throwaway PostgreSQL cluster (tests/conftest.py's recipe): initdb and pg_ctl as the
    ``postgres`` user when run as root, trust auth, a free loopback port, default durability."""

    def __init__(self) -> None:
        initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if not initdb or not pg_ctl:
            raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) not found: install the Debian package "
                               "'postgresql', or pass --pg-dsn")
        self.pg_ctl = pg_ctl
        self.root = tempfile.mkdtemp(prefix="fsm-bench-pg-", dir="/tmp")
        self.data = os.path.join(self.root, "data")
        os.chmod(self.root, 0o755)
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.port = _free_port()
        subprocess.run([*self.as_user, initdb, "-D", self.data, "-A", "trust", "-U", "fsm"], check=True,
                       capture_output=True)
        subprocess.run([*self.as_user, pg_ctl, "-D", self.data, "-w", "-l", os.path.join(self.root, "log"), "-o",
                        f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1", "start"],
                       check=True, capture_output=True)
        self.dsn = f"postgresql://fsm@127.0.0.1:{self.port}"

    def stop(self) -> None:
        subprocess.run([*self.as_user, self.pg_ctl, "-D", self.data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


async def new_database(base_dsn: str) -> str:
    """A fresh, empty database on the server of ``base_dsn`` (its database part is replaced)."""
    import asyncpg

    root = base_dsn.rsplit("/", 1)[0] if base_dsn.count("/") > 2 else base_dsn
    name = "b_" + uuid.uuid4().hex[:12]
    con = await asyncpg.connect(root + "/postgres")
    try:
        await con.execute(f"CREATE DATABASE {name}")
    finally:
        await con.close()
    return f"{root}/{name}"


async def pg_table_bytes(dsn: str) -> dict[str, int]:
    import asyncpg

    con = await asyncpg.connect(dsn)
    try:
        rows = await con.fetch("SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n "
                               "ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'")
        return {r[0]: int(r[1]) for r in rows}
    finally:
        await con.close()


def sqlite_file_bytes(path: str) -> int:
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        con.close()
    return sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))


def sqlite_payload_bytes(path: str, columns: dict[str, tuple[str, ...]]) -> dict[str, int]:
    con = sqlite3.connect(path)
    try:
        out = {}
        for tbl, cols in columns.items():
            expr = " + ".join(f"COALESCE(length({c}), 0)" for c in cols)
            out[tbl] = int(con.execute(f"SELECT COALESCE(SUM({expr}), 0) FROM {tbl}").fetchone()[0])
        return out
    finally:
        con.close()


FSM_COLUMNS = {"events": ("payload", "event_id", "turn_id", "type", "session_id"), "checkpoints": ("data",),
               "ledger": ("arguments", "result", "idempotency_key", "call_id", "session_id"), "sessions": ("metadata", "stop")}
LG_COLUMNS = {"checkpoints": ("checkpoint", "metadata", "checkpoint_id", "thread_id"),
              "writes": ("value", "channel", "task_id", "checkpoint_id", "thread_id")}


# ============================================================================ fsm_agent
class FsmSide:
    name = "fsm_agent"

    def __init__(self) -> None:
        from fsm_agent import Agent, RunConfig, tool
        from fsm_agent.providers import ScriptedProvider, text_response, tool_call_response
        from fsm_agent.store.sessions import load_session

        self.Agent, self.RunConfig, self.load_session = Agent, RunConfig, load_session
        self.ScriptedProvider, self.text_response, self.tool_call_response = ScriptedProvider, text_response, tool_call_response
        self.tool = tool(get_weather)

    def provider(self, turns: int | None) -> Any:
        """Tool calls while fewer than ``turns`` results are in the request (forever when None), then text."""
        def answer(request: Any) -> Any:
            done = sum(1 for m in request.messages if type(m).__name__ == "ToolResultMessage")
            if turns is not None and done >= turns:
                return self.text_response("All cities done.")
            return self.tool_call_response(("get_weather", {"city": f"city-{done}"}))

        return self.ScriptedProvider([answer], repeat_last=True)

    async def store(self, backend: str, where: str) -> Any:
        if backend == "sqlite":
            from fsm_agent.store import SQLiteStore

            return SQLiteStore(where)
        from fsm_agent.store import PostgresStore

        s = PostgresStore(where)
        await s.pool()
        return s

    @staticmethod
    def timed(store: Any, t: Timings) -> Any:
        orig = store.write

        async def write(batch: Any) -> None:
            t0 = time.perf_counter()
            await orig(batch)
            t.add("checkpoint write" if batch.checkpoint is not None else "other write", time.perf_counter() - t0,
                  events=len(batch.events), ledger=len(batch.ledger))

        store.write = write
        return store

    def agent(self, store: Any, turns: int | None, max_iterations: int) -> Any:
        return self.Agent(self.provider(turns), tools=[self.tool], store=store,
                          config=self.RunConfig(max_iterations=max_iterations, stream=False, max_wall_clock=None))

    async def run(self, backend: str, where: str, turns: int, t: Timings) -> dict[str, Any]:
        store = self.timed(await self.store(backend, where), t)
        try:
            t0 = time.perf_counter()
            res = await self.agent(store, turns, turns + 5).run(TASK)
            wall = time.perf_counter() - t0
            assert res.stop.reason.value == "COMPLETED", res.stop
            assert res.tool_calls == turns, res.tool_calls
        finally:
            await store.close()
        return {"wall": wall}

    async def baseline(self, turns: int) -> float:
        """Wall seconds of the same run with the in-memory store (fsm_agent always journals)."""
        t0 = time.perf_counter()
        res = await self.agent(None, turns, turns + 5).run(TASK)
        assert res.stop.reason.value == "COMPLETED", res.stop
        return time.perf_counter() - t0

    async def size(self, backend: str, where: str) -> dict[str, Any]:
        if backend == "sqlite":
            return {"bytes": sqlite_file_bytes(where), "tables": sqlite_payload_bytes(where, FSM_COLUMNS)}
        return {"tables": await pg_table_bytes(where)}

    async def empty(self, backend: str, where: str) -> None:
        s = await self.store(backend, where)
        await s.close()

    async def resume(self, backend: str, where: str, turns: int, resumes: int) -> dict[str, list[float]]:
        store = await self.store(backend, where)
        try:
            res = await self.agent(store, None, turns).run(TASK)
            assert res.stop.reason.value == "PAUSED_BUDGET", res.stop
            sid = res.session_id
        finally:
            await store.close()
        load, one = [], []
        for r in range(resumes):
            store = await self.store(backend, where)
            try:
                t0 = time.perf_counter()
                loaded = await self.load_session(store, sid)
                load.append(time.perf_counter() - t0)
                assert loaded is not None and len(loaded.transcript) >= 2 * turns
                agent = self.agent(store, None, turns)
                t0 = time.perf_counter()
                res = await agent.resume(sid, max_iterations=turns + r + 1)
                one.append(time.perf_counter() - t0)
                assert res.stop.reason.value == "PAUSED_BUDGET", res.stop
            finally:
                await store.close()
        return {"load": load, "resume_one_turn": one}


# ============================================================================ LangGraph
class LangGraphSide:
    name = "LangGraph"

    def __init__(self) -> None:
        from langchain_core.language_models import BaseChatModel
        from langchain_core.messages import AIMessage, HumanMessage
        from langchain_core.outputs import ChatGeneration, ChatResult
        from langchain_core.tools import tool as lc_tool
        from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: F401
        from langgraph.prebuilt import ToolNode, tools_condition

        self.HumanMessage = HumanMessage
        self.StateGraph, self.MessagesState, self.START = StateGraph, MessagesState, START
        self.ToolNode, self.tools_condition = ToolNode, tools_condition
        self.tool = lc_tool(get_weather)

        class FakeToolModel(BaseChatModel):
            """Asks for one get_weather call per turn until `turns` results are in (forever when None)."""

            turns: int | None = None

            @property
            def _llm_type(self) -> str:
                return "bench-fake-tools"

            def _answer(self, messages: list[Any]) -> ChatResult:
                done = sum(1 for m in messages if m.type == "tool")
                if self.turns is not None and done >= self.turns:
                    msg = AIMessage(content="All cities done.")
                else:
                    msg = AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": f"city-{done}"},
                                                             "id": "call_" + uuid.uuid4().hex[:24], "type": "tool_call"}])
                return ChatResult(generations=[ChatGeneration(message=msg)])

            def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any) -> ChatResult:
                return self._answer(messages)

            async def _agenerate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                                 **kw: Any) -> ChatResult:
                return self._answer(messages)

        self.FakeToolModel = FakeToolModel

    def graph(self, saver: Any, turns: int | None, interrupt: bool) -> Any:
        model = self.FakeToolModel(turns=turns)

        async def call_model(state: Any) -> dict[str, Any]:
            return {"messages": [await model.ainvoke(state["messages"])]}

        b = self.StateGraph(self.MessagesState)
        b.add_node("model", call_model)
        b.add_node("tools", self.ToolNode([self.tool]))
        b.add_edge(self.START, "model")
        b.add_conditional_edges("model", self.tools_condition)
        b.add_edge("tools", "model")
        return b.compile(checkpointer=saver, interrupt_before=["model"] if interrupt else None)

    async def saver(self, backend: str, where: str, t: Timings | None, stack: Any) -> Any:
        if backend == "sqlite":
            import aiosqlite
            from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver as Base

            conn = await stack.enter_async_context(aiosqlite.connect(where))
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute("PRAGMA synchronous=NORMAL")  # the same durability as fsm_agent's SQLite store
            cls = _timed_saver(Base, t)
            saver = cls(conn)
        else:
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver as Base
            from psycopg import AsyncConnection
            from psycopg.rows import dict_row

            conn = await stack.enter_async_context(await AsyncConnection.connect(
                where, autocommit=True, prepare_threshold=0, row_factory=dict_row))
            saver = _timed_saver(Base, t)(conn)
        await saver.setup()
        return saver

    async def run(self, backend: str, where: str, turns: int, t: Timings) -> dict[str, Any]:
        from contextlib import AsyncExitStack

        async with AsyncExitStack() as stack:
            saver = await self.saver(backend, where, t, stack)
            g = self.graph(saver, turns, interrupt=False)
            cfg = {"configurable": {"thread_id": uuid.uuid4().hex}, "recursion_limit": 2 * turns + 20}
            t0 = time.perf_counter()
            out = await g.ainvoke({"messages": [self.HumanMessage(TASK)]}, cfg, durability="sync")
            wall = time.perf_counter() - t0
            n_tool = sum(1 for m in out["messages"] if m.type == "tool")
            assert n_tool == turns, n_tool
        return {"wall": wall}

    async def baseline(self, turns: int) -> float:
        """Wall seconds of the same run with no checkpointer."""
        g = self.graph(None, turns, interrupt=False)
        t0 = time.perf_counter()
        out = await g.ainvoke({"messages": [self.HumanMessage(TASK)]}, {"recursion_limit": 2 * turns + 20})
        assert sum(1 for m in out["messages"] if m.type == "tool") == turns
        return time.perf_counter() - t0

    async def size(self, backend: str, where: str) -> dict[str, Any]:
        if backend == "sqlite":
            return {"bytes": sqlite_file_bytes(where), "tables": sqlite_payload_bytes(where, LG_COLUMNS)}
        return {"tables": await pg_table_bytes(where)}

    async def empty(self, backend: str, where: str) -> None:
        from contextlib import AsyncExitStack

        async with AsyncExitStack() as stack:
            await self.saver(backend, where, None, stack)

    async def resume(self, backend: str, where: str, turns: int, resumes: int) -> dict[str, list[float]]:
        from contextlib import AsyncExitStack

        tid = uuid.uuid4().hex
        cfg = {"configurable": {"thread_id": tid}, "recursion_limit": 50}
        async with AsyncExitStack() as stack:
            g = self.graph(await self.saver(backend, where, None, stack), None, interrupt=True)
            await g.ainvoke({"messages": [self.HumanMessage(TASK)]}, cfg, durability="sync")  # stops before the model
            for _ in range(turns):
                await g.ainvoke(None, cfg, durability="sync")
        load, one = [], []
        for _ in range(resumes):
            async with AsyncExitStack() as stack:
                g = self.graph(await self.saver(backend, where, None, stack), None, interrupt=True)
                t0 = time.perf_counter()
                state = await g.aget_state(cfg)
                load.append(time.perf_counter() - t0)
                assert len(state.values["messages"]) >= 2 * turns
                t0 = time.perf_counter()
                await g.ainvoke(None, cfg, durability="sync")
                one.append(time.perf_counter() - t0)
        return {"load": load, "resume_one_turn": one}


def _timed_saver(base: type, t: Timings | None) -> type:
    """A subclass of LangGraph's saver ``base`` that times ``aput`` and ``aput_writes``."""

    class Timed(base):  # type: ignore[misc, valid-type]
        async def aput(self, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            r = await super().aput(*a, **k)
            if t is not None:
                t.add("checkpoint write", time.perf_counter() - t0)
            return r

        async def aput_writes(self, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            r = await super().aput_writes(*a, **k)
            if t is not None:
                t.add("other write", time.perf_counter() - t0)
            return r

    Timed.__name__ = "Timed" + base.__name__
    return Timed


# ================================================================================ main
async def bench_backend(backend: str, sides: list[Any], sizes: list[int], resumes: int, resume_turns: int,
                        pg_dsn: str | None, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {s.name: {"runs": {}, "timings": [], "sizes": {}, "empty": None, "resume": None}
                           for s in sides}
    timings = {s.name: Timings() for s in sides}

    async def place(side: Any, label: str) -> str:
        if backend == "sqlite":
            return os.path.join(tmp, f"{side.name}-{label}-{uuid.uuid4().hex[:6]}.db")
        assert pg_dsn is not None
        return await new_database(pg_dsn)

    for side in sides:  # the empty schema (baseline for PostgreSQL sizes)
        where = await place(side, "empty")
        await side.empty(backend, where)
        out[side.name]["empty"] = await side.size(backend, where)
    for i, n in enumerate(sizes):
        for side in rotate(sides, i):
            where = await place(side, str(n))
            t = timings[side.name]
            before = len(t.calls)
            run = await side.run(backend, where, n, t)
            calls = t.calls[before:]
            run["persist_calls"] = len(calls)
            run["persist_s"] = sum(c["s"] for c in calls)
            run["events"] = sum(c.get("events", 0) for c in calls)
            out[side.name]["runs"][n] = run
            out[side.name]["sizes"][n] = await side.size(backend, where)
            say(f"  {backend}: {side.name} {n} turns: {run['wall']:.2f} s, {len(calls)} persistence calls "
                f"({run['persist_s']:.2f} s)")
    n = max(sizes)
    for side in sides:
        out[side.name]["baseline"] = []
    for r in range(3):  # runs without persistence, for the persistence overhead per turn
        for side in rotate(sides, r):
            out[side.name]["baseline"].append(await side.baseline(n))
    for i, side in enumerate(rotate(sides, 1)):
        where = await place(side, "resume")
        out[side.name]["resume"] = await side.resume(backend, where, resume_turns, resumes)
        say(f"  {backend}: {side.name} resume after {resume_turns} turns: load "
            f"{median(out[side.name]['resume']['load']) * 1e3:.1f} ms, one turn "
            f"{median(out[side.name]['resume']['resume_one_turn']) * 1e3:.1f} ms")
    for side in sides:
        out[side.name]["timings"] = timings[side.name].calls
    return out


def total_bytes(backend: str, size: dict[str, Any], empty: dict[str, Any] | None) -> int:
    if backend == "sqlite":
        return int(size["bytes"])
    base = sum((empty or {}).get("tables", {}).values()) if empty else 0
    return int(sum(size["tables"].values()) - base)


def report(results: dict[str, Any], sizes: list[int], resume_turns: int) -> list[str]:
    out = []
    for backend, per in results["backends"].items():
        if "error" in per:
            continue
        names = list(per)
        base = names[0]
        rows = []
        summary = {}
        for name in names:
            d = per[name]
            tm = d["timings"]
            ck = [c["s"] for c in tm if c["kind"] == "checkpoint write"]
            other = [c["s"] for c in tm if c["kind"] == "other write"]
            allw = ck + other
            turns = sum(sizes)
            persist = sum(allw)
            events = sum(c.get("events", 0) for c in tm)
            big = d["runs"][max(sizes)]
            base_turn = median(d["baseline"]) / max(sizes)
            summary[name] = {"ck_p50": pct(ck, 50), "ck_p95": pct(ck, 95), "per_turn": persist / turns}
            rows.append([name, len(ck), pct(ck, 50) * 1e3, pct(ck, 95) * 1e3, len(other),
                         pct(other, 50) * 1e3 if other else None, pct(other, 95) * 1e3 if other else None,
                         len(allw) / turns, persist / turns * 1e3, (events / persist) if events else None,
                         big["wall"] / max(sizes) * 1e3, base_turn * 1e3, (big["wall"] / max(sizes) - base_turn) * 1e3])
        b = summary[base]
        for r, name in zip(rows, names):
            r.insert(4, f"{summary[name]['ck_p50'] / b['ck_p50']:.2f}×")
            r.insert(10, f"{summary[name]['per_turn'] / b['per_turn']:.2f}×")
        out.append(table(["runtime", "checkpoint writes", "p50 ms", "p95 ms", "p50 vs fsm_agent", "other writes",
                          "p50 ms", "p95 ms", "persist calls/turn", "persist ms/turn", "vs fsm_agent", "events/s",
                          f"run ms/turn ({max(sizes)} turns)", "same, no persistence", "difference"],
                         rows, title=f"{backend}: write latency ({'+'.join(map(str, sizes))} turns of runs)"))
        rows = []
        r0 = per[base]["resume"]
        for name in names:
            r = per[name]["resume"]
            if not r:
                continue
            rows.append([name, median(r["load"]) * 1e3, f"{median(r['load']) / median(r0['load']):.2f}×",
                         median(r["resume_one_turn"]) * 1e3,
                         f"{median(r['resume_one_turn']) / median(r0['resume_one_turn']):.2f}×", len(r["load"])])
        out.append(table(["runtime", "load ms", "vs fsm_agent", "resume one turn ms", "vs fsm_agent", "resumes"], rows,
                         title=f"{backend}: resume a session paused after {resume_turns} tool turns (medians)"))
        rows = []
        for name in names:
            d = per[name]
            row: list[Any] = [name]
            tb = [total_bytes(backend, d["sizes"][n], d["empty"]) for n in sizes]
            row += [x / 1024 for x in tb]
            slope = (tb[-1] - tb[-2]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 else float("nan")
            row.append(slope)
            if backend == "sqlite":
                pay = sum(d["sizes"][max(sizes)]["tables"].values())
                row.append(pay / 1024)
            rows.append(row)
        hdr = ["runtime"] + [f"{n} turns KiB" for n in sizes] + ["bytes/turn (slope)"]
        if backend == "sqlite":
            hdr.append(f"payload KiB at {max(sizes)}")
        for name, row in zip(names, rows):
            row.insert(len(sizes) + 2, f"{row[len(sizes) + 1] / rows[0][len(sizes) + 1]:.2f}×")
        hdr.insert(len(sizes) + 2, "vs fsm_agent")
        what = "file bytes after a WAL checkpoint" if backend == "sqlite" else "pg_total_relation_size of the tables − empty schema"
        out.append(table(hdr, rows, title=f"{backend}: store size of one session ({what})"))
    return out


async def amain(args: argparse.Namespace) -> int:
    sizes = [10, 50, 100] if args.quick else [10, 50, 100, 200]
    resumes = args.resumes or (3 if args.quick else 7)
    resume_turns = 100
    results: dict[str, Any] = {"machine": machine(), "versions": versions(), "sizes": sizes, "resumes": resumes,
                               "resume_turns": resume_turns, "backends": {}, "absent": {}}
    sides: list[Any] = [FsmSide()]
    try:
        sides.append(LangGraphSide())
    except ImportError as exc:
        results["absent"]["LangGraph"] = f"langgraph / langchain-core not importable: {exc}"
        say(f"LangGraph ABSENT — {exc}; measuring fsm_agent alone")
    cluster = None
    tmp = tempfile.mkdtemp(prefix="fsm-bench-store-")
    try:
        backends = ["sqlite"]
        pg_dsn = args.pg_dsn
        if not args.no_postgres:
            missing = []
            for mod in ("asyncpg",):
                try:
                    __import__(mod)
                except ImportError:
                    missing.append(mod)
            if missing:
                results["absent"]["postgres"] = f"{', '.join(missing)} not importable"
                say(f"PostgreSQL ABSENT — {', '.join(missing)} not importable (pip install asyncpg)")
            elif pg_dsn is None:
                try:
                    cluster = Cluster()
                    pg_dsn = cluster.dsn
                    say(f"started a throwaway PostgreSQL cluster on port {cluster.port}")
                except Exception as exc:  # noqa: BLE001
                    results["absent"]["postgres"] = str(exc)
                    say(f"PostgreSQL ABSENT — {exc}")
            if pg_dsn is not None:
                backends.append("postgres")
        for backend in backends:
            bs = sides
            if backend == "postgres":
                bs = []
                for s in sides:
                    if s.name == "LangGraph":
                        try:
                            import langgraph.checkpoint.postgres.aio  # noqa: F401
                            import psycopg  # noqa: F401
                        except ImportError as exc:
                            results["absent"]["LangGraph postgres"] = str(exc)
                            say(f"LangGraph Postgres checkpointer ABSENT — {exc}")
                            continue
                    bs.append(s)
            say(f"{backend} ...")
            t0 = time.perf_counter()
            try:
                results["backends"][backend] = await bench_backend(backend, bs, sizes, resumes, resume_turns, pg_dsn, tmp)
            except Exception as exc:  # noqa: BLE001
                results["backends"][backend] = {"error": f"{type(exc).__name__}: {exc}"}
                say(f"{backend} FAILED — {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            say(f"  ({backend} took {time.perf_counter() - t0:.0f} s)")
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for t in report(results, sizes, resume_turns):
        say(t)
    say("\nNumbers from a shared, noisy 2-core machine: compare the ratios of one run, not absolute figures.")
    path = write_results("store", results)
    say(f"results: {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description="Persistence: fsm_agent stores vs LangGraph checkpointers")
    ap.add_argument("--quick", action="store_true", help="sizes 10, 50, 100 and 3 resumes")
    ap.add_argument("--resumes", type=int, help="resumes of the 100-turn session (default 7; --quick 3)")
    ap.add_argument("--pg-dsn", help="use this PostgreSQL server (a database is created per run) instead of a "
                                     "throwaway cluster, e.g. postgresql://user@127.0.0.1:5432")
    ap.add_argument("--no-postgres", action="store_true", help="SQLite only")
    args = ap.parse_args()
    return asyncio.run(amain(args))


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"(bench_store took {time.perf_counter() - t0:.0f} s)")
    sys.exit(rc)
