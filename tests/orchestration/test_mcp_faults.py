"""MCP tools under injected faults: a killed server, a stopped HTTP server, a timeout, a cancelled run.

Each fault is real: ``SIGKILL`` to the stdio server's process while a call runs, a uvicorn server
(serving the SDK's own Streamable HTTP app on a loopback port) shut down mid-call, a Cancel sent to
the run while the server is still working. The server's own counters (``stats``) say what ran and
what it saw cancelled.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from mcp import StdioServerParameters

from fsm_agent import Agent, Cancel, ScriptedProvider, ToolProgress, ToolRegistry
from fsm_agent.orchestration.mcp import MCPToolset, mcp_tools
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore, SQLiteStore
from fsm_agent.tools import execute_tool_call
from fsm_agent.types import ToolUseBlock

from .mcp_server import State, build_server
from .test_mcp import STDIO, results, server_stats

DEADLINE = 20.0
"""Seconds a test waits for the server to report what it saw (generous: the machine is shared)."""


class OnProgress:
    """An observer that runs ``action`` once, at the first progress event of ``tool``."""

    def __init__(self, tool: str, action: Callable[[], Any]) -> None:
        self.tool, self.action, self.fired = tool, action, False
        self.events: list[ToolProgress] = []

    def on_tool_progress(self, event: ToolProgress) -> None:
        self.events.append(event)
        if event.tool == self.tool and not self.fired:
            self.fired = True
            self.action()


async def wait_for(probe: Callable[[], Any], what: str) -> Any:
    """Poll the async ``probe`` until it returns something truthy."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE
    while loop.time() < end:
        value = await probe()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


# -- a killed stdio server ------------------------------------------------------------------------

async def test_killing_the_stdio_server_mid_call_is_a_tool_error_and_the_run_goes_on() -> None:
    async with mcp_tools(STDIO, prefix="t") as ts:
        first_pid = (await server_stats(ts))["pid"]
        kill = OnProgress("t_slow_write", lambda: os.kill(first_pid, signal.SIGKILL))
        store = MemoryStore()
        provider = ScriptedProvider([tool_call_response(("t_slow_write", {"n": 50, "delay": 0.1})),
                                     tool_call_response(("t_add", {"a": 2, "b": 3})), "recovered"])
        result = await Agent(provider, tools=ts, observers=[kill], store=store).run("write", session_id="s-kill")

        assert kill.fired and result.stop.reason.value == "COMPLETED"
        [lost] = results(provider, 1)
        assert lost.is_error and lost.metadata == {"error": "mcp_connection_lost"}
        assert "was lost while tool 't_slow_write' was running" in lost.text
        assert "may or may not have taken effect: check before calling it again" in lost.text  # side effect
        assert "reopened for the next call" in lost.text
        [after] = results(provider, 2)
        assert after.text == "5" and not after.is_error  # the next call reconnected
        ledger = {e.tool: e.status.value for e in (await store.ledger("s-kill")).values()}
        assert ledger == {"t_slow_write": "failed", "t_add": "completed"}
        stats = await server_stats(ts)
        assert stats["pid"] != first_pid and ts.connections == 2
        assert stats["calls"] == {"add": 1}  # the side-effect call was not sent again to the new server


async def test_a_pure_call_that_lost_its_server_is_sent_once_more_to_a_new_one() -> None:
    async with mcp_tools(STDIO) as ts:
        first_pid = (await server_stats(ts))["pid"]
        kill = OnProgress("count", lambda: os.kill(first_pid, signal.SIGKILL))
        provider = ScriptedProvider([tool_call_response(("count", {"n": 3, "delay": 0.2})), "counted"])
        result = await Agent(provider, tools=ts, observers=[kill]).run("count")
        assert kill.fired and result.stop.reason.value == "COMPLETED"
        [answer] = results(provider, 1)
        assert answer.text == "count finished 3 steps" and not answer.is_error
        stats = await server_stats(ts)
        assert stats["pid"] != first_pid and stats["calls"] == {"count": 1} and ts.connections == 2


async def test_calls_after_an_idle_crash_share_one_reconnection_and_nothing_sent_is_lost() -> None:
    """The server died between calls: the SDK knows the connection is closed before anything is
    written, so even a side-effect call is sent on the new connection (it never reached the old one)."""
    async with mcp_tools(STDIO) as ts:
        os.kill((await server_stats(ts))["pid"], signal.SIGKILL)
        await wait_for(lambda: _true(not ts.connected), "the SDK to see the closed connection")
        registry = ToolRegistry(ts)
        calls = [ToolUseBlock(f"c{i}", "add", {"a": i, "b": 1}) for i in range(3)]
        calls.append(ToolUseBlock("c3", "delete_record", {"key": "k"}))
        answers = await asyncio.gather(*(execute_tool_call(c, registry) for c in calls))
        assert [a.text for a in answers] == ["1", "2", "3", "deleted k"]
        assert ts.connections == 2  # one reconnection for all four calls
        assert (await server_stats(ts))["calls"] == {"add": 3, "delete_record": 1}


async def test_without_reconnect_a_lost_server_stays_unavailable() -> None:
    async with mcp_tools(STDIO, reconnect=False) as ts:
        pid = (await server_stats(ts))["pid"]
        registry = ToolRegistry(ts)
        call = asyncio.ensure_future(execute_tool_call(ToolUseBlock("c1", "slow_write", {"n": 50, "delay": 0.1}),
                                                       registry))
        await wait_for(lambda: _started(ts, "slow_write"), "the server to start the call")
        os.kill(pid, signal.SIGKILL)
        first = await call
        assert first.is_error and first.metadata == {"error": "mcp_connection_lost"}
        assert "unavailable for the rest of the run" in first.text
        second = await execute_tool_call(ToolUseBlock("c2", "add", {"a": 1, "b": 1}), registry)
        assert second.metadata == {"error": "mcp_unavailable"} and "reconnecting is off" in second.text
        assert ts.connections == 1


async def _started(ts: MCPToolset, tool: str) -> bool:
    return tool in (await server_stats(ts))["started"]


# -- timeouts and cancellation --------------------------------------------------------------------

@pytest.fixture(params=["in_process", "stdio"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, State | None]]:
    """A server target and, in process, its state (over stdio the state is read with ``stats``)."""
    if request.param == "in_process":
        srv, state = build_server()
        yield srv, state
    else:
        yield STDIO, None


async def cancelled_on_server(ts: MCPToolset, state: State | None) -> list[str]:
    if state is not None:
        return list(state.cancelled)
    return list((await server_stats(ts))["cancelled"])


async def test_a_call_past_its_timeout_is_cancelled_on_the_server(served: tuple[Any, State | None]) -> None:
    server, state = served
    async with mcp_tools(server, timeout=0.5) as ts:
        provider = ScriptedProvider([tool_call_response(("slow_write", {"n": 100, "delay": 0.05})), "too slow"])
        result = await Agent(provider, tools=ts).run("write")
        assert result.stop.reason.value == "COMPLETED"
        [answer] = results(provider, 1)
        assert answer.is_error and answer.metadata == {"error": "timeout"}
        assert "did not answer within 0.5 s, so the request was cancelled on the server" in answer.text
        assert "may have taken effect before it was cancelled" in answer.text  # slow_write is a side effect
        assert await wait_for(lambda: cancelled_on_server(ts, state), "the server to see the cancel") == ["slow_write"]


async def test_cancelling_the_run_cancels_the_call_on_the_server(served: tuple[Any, State | None]) -> None:
    server, state = served
    async with mcp_tools(server) as ts:
        store = MemoryStore()
        provider = ScriptedProvider([tool_call_response(("count", {"n": 200, "delay": 0.05})), "never"])
        agent = Agent(provider, tools=ts, store=store)
        cancel = OnProgress("count", lambda: asyncio.ensure_future(agent.control("s-c", Cancel("stop counting"))))
        agent.hooks = type(agent.hooks)([cancel])
        result = await asyncio.wait_for(agent.run("count", session_id="s-c"), DEADLINE)
        assert cancel.fired and result.stop.reason.value == "CANCELLED"
        assert await wait_for(lambda: cancelled_on_server(ts, state), "the server to see the cancel") == ["count"]
        assert len(cancel.events) < 200  # it did not run to the end
        [entry] = (await store.ledger("s-c")).values()
        assert entry.status.value == "interrupted"


# -- Streamable HTTP ------------------------------------------------------------------------------

class HttpServer:
    """The SDK's Streamable HTTP app for a fresh test server, served by uvicorn on a loopback port."""

    def __init__(self) -> None:
        self.mcp, self.state = build_server("fsm-test-http")
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/mcp"
        config = uvicorn.Config(self.mcp.streamable_http_app(), log_level="warning", lifespan="on")
        self.uvicorn = uvicorn.Server(config)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.uvicorn.serve(sockets=[self.sock]))
        await wait_for(lambda: _true(self.uvicorn.started), "uvicorn to start")

    async def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self.task is not None:
            await asyncio.wait({self.task}, timeout=DEADLINE)
        self.sock.close()


async def _true(value: bool) -> bool:
    return value


@pytest.fixture
async def http_server() -> AsyncIterator[HttpServer]:
    server = HttpServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_over_streamable_http_calls_progress_and_headers_work(http_server: HttpServer) -> None:
    seen = OnProgress("count", lambda: None)
    async with mcp_tools(http_server.url, headers={"X-Caller": "fsm-agent-test"}) as ts:
        provider = ScriptedProvider([tool_call_response(("add", {"a": 20, "b": 22}), ("count", {"n": 2, "delay": 0.01}),
                                                        ("whoami", {})), "done"])
        result = await Agent(provider, tools=ts, observers=[seen]).run("go")
    assert result.stop.reason.value == "COMPLETED"
    assert [r.text for r in results(provider, 1)] == ["42", "count finished 2 steps", "fsm-agent-test"]
    assert [(e.progress, e.total) for e in seen.events] == [(1.0, 2.0), (2.0, 2.0)]
    assert http_server.state.calls == {"add": 1, "count": 1, "whoami": 1}


async def test_over_streamable_http_cancelling_the_run_cancels_the_call(http_server: HttpServer) -> None:
    async with mcp_tools(http_server.url) as ts:
        provider = ScriptedProvider([tool_call_response(("count", {"n": 200, "delay": 0.05})), "never"])
        agent = Agent(provider, tools=ts)
        agent.hooks = type(agent.hooks)([OnProgress("count", lambda: asyncio.ensure_future(
            agent.control("s-h", Cancel())))])
        result = await asyncio.wait_for(agent.run("count", session_id="s-h"), DEADLINE)
        assert result.stop.reason.value == "CANCELLED"
        assert await wait_for(lambda: _true(http_server.state.cancelled == ["count"]), "the server to see the cancel")


async def test_a_http_server_killed_mid_call_fails_the_call_not_the_run() -> None:
    """The SDK's transport tears down its task group when the HTTP connection breaks: the session's
    own task takes that, and the run that made the call only gets an error result."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    proc = await asyncio.create_subprocess_exec(sys.executable, STDIO[1], "--http-fd", str(sock.fileno()),
                                                pass_fds=(sock.fileno(),))
    sock.close()  # the server process holds it now
    try:
        async with mcp_tools(url, prefix="t", connect_timeout=DEADLINE) as ts:
            kill = OnProgress("t_slow_write", proc.kill)
            provider = ScriptedProvider([tool_call_response(("t_slow_write", {"n": 100, "delay": 0.05})),
                                         tool_call_response(("t_add", {"a": 1, "b": 1})), "the server is gone"])
            result = await asyncio.wait_for(Agent(provider, tools=ts, observers=[kill]).run("write"), DEADLINE)
            assert kill.fired and result.stop.reason.value == "COMPLETED"
            [lost] = results(provider, 1)
            assert lost.is_error and lost.metadata == {"error": "mcp_connection_lost"}, lost.text
            assert "may or may not have taken effect" in lost.text
            [after] = results(provider, 2)
            assert after.is_error and after.metadata == {"error": "mcp_unavailable"}, after.text
            assert "reconnecting failed" in after.text and "could not connect" in after.text
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


# -- a crash of the agent's process mid-call, then a resume ----------------------------------------

WORKER = Path(__file__).with_name("mcp_crash_worker.py")


@pytest.mark.parametrize(("tool", "effect"), [("slow_write", "side_effect"), ("count", "pure")])
async def test_after_a_crash_mid_call_a_resume_reruns_a_pure_mcp_call_and_never_a_side_effect(
        tmp_path: Path, tool: str, effect: str) -> None:
    db, journal = tmp_path / "sessions.db", tmp_path / "server-calls.txt"
    proc = await asyncio.create_subprocess_exec(sys.executable, str(WORKER), str(db), "s-crash", tool, str(journal),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), DEADLINE * 3)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    assert journal.read_text().split() == [tool]  # the server had begun the call
    await asyncio.sleep(0.6)  # the dead worker's lease (0.5 s) runs out

    params = StdioServerParameters(command=sys.executable, args=[STDIO[1]],
                                   env={"FSM_MCP_TEST_JOURNAL": str(journal)})
    store = SQLiteStore(str(db))
    try:
        async with mcp_tools(params) as ts:
            assert ts[tool].effect.value == effect
            # a pure turn is not checkpointed before its calls (repeating them is harmless): the resume
            # asks the model again, which calls the tool again
            provider = ScriptedProvider([tool_call_response((tool, {"n": 1, "delay": 0.01})),
                                         "finished after the resume"])
            result = await Agent(provider, tools=ts, store=store).resume("s-crash")
            entries = list((await store.ledger("s-crash")).values())
    finally:
        await store.close()
    if effect == "pure":
        assert result.stop.reason.value == "COMPLETED" and result.output == "finished after the resume"
        assert journal.read_text().split() == [tool, tool]
        assert [e.status.value for e in entries] == ["completed"]
    else:  # it may have happened: a person decides, and the server never sees it twice
        assert result.stop.reason.value == "WAITING_HUMAN", result.stop
        assert journal.read_text().split() == [tool]
        assert provider.requests == []
        [pending] = result.stop.pending_actions
        assert (pending.call.name, pending.reason) == (tool, "unknown_outcome")
        assert [(e.effect, e.status.value) for e in entries] == [("side_effect", "started")]
