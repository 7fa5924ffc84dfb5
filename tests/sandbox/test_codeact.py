"""CodeAct through a real Agent: the model's Python runs in the real sandboxes as an ordinary tool call.

The model is a ScriptedProvider (its tool calls are fixed); everything after it is real: the
Agent's loop, MidTurn, the ledger in a real store, approval and policy plugins, the sandbox
(setpriv, bwrap, seccomp, prlimit, CPython). A counting wrapper around the sandbox counts the runs,
so "it did not run" is a count, not an assumption.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import orjson
import pytest

from fsm_agent import Agent, ScriptedProvider, StopReason, ToolResultMessage
from fsm_agent.control import Decision
from fsm_agent.providers import tool_call_response
from fsm_agent.sandbox import (
    SESSION_METADATA_KEY,
    BubblewrapSandbox,
    CodeExecutionError,
    ExecutionResult,
    GuaranteeNotHeldError,
    Guarantees,
    Limits,
    SubprocessSandbox,
    codeact_tool,
    default_sandbox,
)
from fsm_agent.sandbox._local import LocalSandbox
from fsm_agent.store import LedgerStatus, MemoryStore
from fsm_agent.tools import ToolEffect
from fsm_agent_middleware.approval import HumanApproval
from fsm_agent_middleware.tool_policy import ToolPolicy

from .conftest import absence, build


class Counting:
    """A Sandbox that counts the runs of the real one it wraps."""

    def __init__(self, inner: LocalSandbox) -> None:
        self.inner = inner
        self.codes: list[str] = []
        self.limits = inner.limits
        self.required = inner.required
        self.keep_workdir = inner.keep_workdir

    @property
    def name(self) -> str:
        return self.inner.name

    async def start(self) -> Guarantees:
        return await self.inner.start()

    def guarantees(self) -> Guarantees:
        return self.inner.guarantees()

    async def run(self, code: str, *, files: Mapping[str, bytes | str] | None = None, timeout: float | None = None,
                  limits: Limits | None = None) -> ExecutionResult:
        self.codes.append(code)
        return await self.inner.run(code, files=files, timeout=timeout, limits=limits)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
def box(kind: str, reachable_dir: Any) -> Counting:
    return Counting(build(kind, workdir_root=reachable_dir, limits=Limits(cpu_seconds=1, wall_seconds=20)))


def results(messages: Any) -> list[ToolResultMessage]:
    return [m for m in messages if isinstance(m, ToolResultMessage)]


async def test_the_result_reaches_the_model_and_the_ledger_records_it(box: Counting, kind: str) -> None:
    store = MemoryStore()
    seen: list[Any] = []

    def answer(request: Any) -> str:
        seen.extend(m for m in request.messages if isinstance(m, ToolResultMessage))
        return "the answer is " + ", ".join(str(orjson.loads(m.text)["return_value"]) for m in seen)

    calls = tool_call_response(("run_python", {"code": "sum(i * i for i in range(10))"}),
                               ("run_python", {"code": "print('side')\nresult = [2 ** 10, 'x']"}))
    tool = codeact_tool(box, store=store)
    agent = Agent(ScriptedProvider([calls, answer]), tools=[tool], store=store)
    result = await agent.run("compute", session_id="s-ca")
    assert result.stop.reason is StopReason.COMPLETED
    assert result.output == "the answer is 285, [1024, 'x']"
    first, second = (orjson.loads(m.text) for m in seen)
    assert first == {"ok": True, "return_value": 285}
    assert second == {"ok": True, "stdout": "side\n", "return_value": [1024, "x"]}
    assert len(box.codes) == 2  # two calls of one turn, run concurrently on two uids
    ledger = await store.ledger("s-ca")
    assert {e.tool for e in ledger.values()} == {"run_python"}
    assert {e.status for e in ledger.values()} == {LedgerStatus.COMPLETED}
    # pure where nothing outside the thrown-away work dir can be written (bubblewrap; subprocess with Landlock)
    assert {e.effect for e in ledger.values()} == {"pure" if box.guarantees().filesystem_readonly else "side_effect"}
    assert sorted(e.arguments["code"] for e in ledger.values()) == sorted(c.input["code"] for c in calls.tool_calls)


async def test_the_guarantees_are_recorded_in_the_session(box: Counting, kind: str) -> None:
    store = MemoryStore()
    script = [tool_call_response(("run_python", {"code": "1"})), tool_call_response(("run_python", {"code": "2"})),
              "done"]
    result = await Agent(ScriptedProvider(script), tools=[codeact_tool(box, store=store)], store=store).run(
        "go", session_id="s-g")
    assert result.stop.reason is StopReason.COMPLETED
    record = await store.get_session("s-g")
    assert record is not None
    recorded = record.metadata[SESSION_METADATA_KEY]
    assert recorded == box.guarantees().to_json()
    assert recorded["sandbox"] == kind and recorded["uid_dropped"] is True and recorded["disk_quota"] is False
    messages = [e.payload["message"] for e in await store.read_events("s-g") if e.type == "tool_progress"]
    assert messages[0] == f"sandbox {box.guarantees().summary()}"  # once per session
    assert [m.split(" in ")[0] for m in messages[1:]] == ["ok", "ok"]


async def test_an_approval_gates_the_code_before_it_runs(box: Counting) -> None:
    store = MemoryStore()
    script = [tool_call_response(("run_python", {"code": "6 * 7"})), "it is 42"]
    agent = Agent(ScriptedProvider(script), tools=[codeact_tool(box)], middleware=[HumanApproval("run_python")],
                  store=store)
    result = await agent.run("go", session_id="s-ap")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    (pending,) = result.stop.pending_actions
    assert pending.call.input == {"code": "6 * 7"} and box.codes == []  # nothing ran
    result = await agent.resume("s-ap", decisions={pending.call.id: Decision.approve()})
    assert result.stop.reason is StopReason.COMPLETED and box.codes == ["6 * 7"]
    assert orjson.loads(results(result.messages)[0].text)["return_value"] == 42


async def test_a_rejected_call_never_runs(box: Counting) -> None:
    script = [tool_call_response(("run_python", {"code": "print('x')"})), "ok"]
    agent = Agent(ScriptedProvider(script), tools=[codeact_tool(box)], middleware=[HumanApproval("run_python")],
                  store=MemoryStore())
    result = await agent.run("go", session_id="s-rej")
    (pending,) = result.stop.pending_actions
    result = await agent.resume("s-rej", decisions={pending.call.id: Decision.reject("no code today")})
    assert result.stop.reason is StopReason.COMPLETED and box.codes == []
    (r,) = results(result.messages)
    assert r.is_error and "no code today" in r.text


async def test_a_policy_rule_on_the_code_denies_it(box: Counting) -> None:
    policy = ToolPolicy([{"tool": "run_python", "action": "deny", "when": [{"arg": "code", "contains": "subprocess"}],
                          "reason": "no subprocesses"}], default="allow")
    script = [tool_call_response(("run_python", {"code": "import subprocess"}), ("run_python", {"code": "1 + 1"})),
              "done"]
    result = await Agent(ScriptedProvider(script), tools=[codeact_tool(box)], middleware=[policy]).run("go")
    denied, allowed = results(result.messages)
    assert denied.is_error and "no subprocesses" in denied.text
    assert not allowed.is_error and orjson.loads(allowed.text)["return_value"] == 2
    assert box.codes == ["1 + 1"]


async def test_a_limit_hit_comes_back_as_a_tool_error_naming_the_limit(box: Counting) -> None:
    store = MemoryStore()
    script = [tool_call_response(("run_python", {"code": "while True:\n    pass"}),
                                 ("run_python", {"code": "x = 1\nraise ValueError('bad input ' + str(x))"})),
              "ok"]
    result = await Agent(ScriptedProvider(script), tools=[codeact_tool(box, store=store)], store=store).run(
        "go", session_id="s-lim")
    cpu, raised = results(result.messages)
    assert cpu.is_error and cpu.metadata == {"error": "limit_exceeded"}
    doc = orjson.loads(cpu.text)
    assert doc["ok"] is False and doc["limits_hit"] == ["cpu"] and "CPU time limit" in doc["limits_note"]
    assert doc["signal"] in ("SIGXCPU", "SIGKILL")
    assert raised.is_error and raised.metadata == {"error": "code_error"}
    doc = orjson.loads(raised.text)
    assert doc["error"] == {"type": "ValueError", "message": "bad input 1", "line": 2} and "limits_hit" not in doc
    assert "ValueError: bad input 1" in doc["stderr"]
    ledger = await store.ledger("s-lim")
    assert {e.status for e in ledger.values()} == {LedgerStatus.FAILED}
    assert issubclass(CodeExecutionError, Exception)


def test_the_effect_follows_the_guarantees(kind: str, reachable_dir: Any) -> None:
    sb = build(kind, workdir_root=reachable_dir)
    assert sb.guarantees().filesystem_readonly  # bubblewrap's mount namespace; subprocess: Landlock
    assert codeact_tool(sb).effect is ToolEffect.PURE
    if kind == "subprocess":  # without Landlock the host's /tmp is writable: a repeat may do something twice
        open_fs = build(kind, workdir_root=reachable_dir, landlock=False, required=())
        assert codeact_tool(open_fs).effect is ToolEffect.SIDE_EFFECT
    kept = build(kind, workdir_root=reachable_dir, keep_workdir=True)
    assert codeact_tool(kept).effect is ToolEffect.SIDE_EFFECT  # a kept work dir is state left behind
    assert codeact_tool(sb, effect="idempotent").effect is ToolEffect.IDEMPOTENT
    tool = codeact_tool(sb, name="python", limits=Limits(memory_bytes=256 * 1024 * 1024, wall_seconds=12))
    assert tool.name == "python" and tool.timeout == 22
    assert "256 MiB memory" in tool.description and "result" in tool.description
    assert tool.parameters["required"] == ["code"]


def test_a_required_guarantee_that_does_not_hold_fails_at_construction(kind: str, reachable_dir: Any) -> None:
    sb = build(kind, workdir_root=reachable_dir, required=("disk_quota",))
    with pytest.raises(GuaranteeNotHeldError, match="disk_quota"):
        codeact_tool(sb)


def test_default_sandbox_says_which(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "fsm_agent.sandbox")
    if absence("bubblewrap") is None:
        sb = default_sandbox(tmp_bytes=1 << 20)
        assert isinstance(sb, BubblewrapSandbox) and sb.name == "bubblewrap" and sb.tmp_bytes == 1 << 20
        assert "CodeAct sandbox: bubblewrap" in caplog.text
    caplog.clear()
    empty = os.path.join(os.path.dirname(__file__), "no-such-bin-dir")
    monkeypatch.setenv("PATH", empty)  # no bwrap on PATH
    sb = default_sandbox(tmp_bytes=1 << 20)
    assert isinstance(sb, SubprocessSandbox) and sb.name == "subprocess"
    assert "CodeAct sandbox: subprocess" in caplog.text and "ignores tmp_bytes" in caplog.text


async def test_fsm_agent_sessions_show_has_the_guarantees(box: Counting, kind: str, tmp_path: Any) -> None:
    """What a person sees: ``sessions show --json`` has them in the session's metadata, and the
    session log (``--events``) has the first call's ``tool_progress`` line."""
    import io

    from fsm_agent.cli import main
    from fsm_agent.store import SQLiteStore

    path = str(tmp_path / "sessions.db")
    store = SQLiteStore(path)
    script = [tool_call_response(("run_python", {"code": "40 + 2"})), "42"]
    result = await Agent(ScriptedProvider(script), tools=[codeact_tool(box, store=store)], store=store).run(
        "go", session_id="s-cli")
    assert result.stop.reason is StopReason.COMPLETED
    await store.close()

    def cli(*args: str) -> str:
        out = io.StringIO()
        assert main(["sessions", "show", "s-cli", "--store", path, *args], out=out, err=io.StringIO()) == 0
        return out.getvalue()

    shown = orjson.loads(await asyncio.to_thread(cli, "--json"))
    recorded = shown["session"]["metadata"][SESSION_METADATA_KEY]
    assert recorded["sandbox"] == kind and recorded["network_isolated"] is True
    assert recorded["reasons"]["disk_quota"].startswith("the work dir is on the host's disk")
    events = [orjson.loads(line) for line in (await asyncio.to_thread(cli, "--events")).splitlines()]
    progress = [e["payload"]["message"] for e in events if e["type"] == "tool_progress"]
    assert progress[0].startswith(f"sandbox {kind}: holds network_isolated")
