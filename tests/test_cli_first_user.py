"""What a first user of the README's CLI ran into, each found before anything starts when it can be.

Every run here is in process (``main(argv, out=, err=)``). The model server is a ReplayServer on
its own thread's loop (``served``); a run that would start the embedded llama.cpp server has
``LocalLlamaServer`` made to fail the test (``no_local_server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_agent import SessionExistsError
from fsm_agent.cli import _build_parser, _hint, main
from fsm_agent.store import SQLiteStore
from fsm_agent.store.sessions import read_turns
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types.run import StopReason
from test_cli import ANSWER, TOOL_TURN, chunk
from test_cli_run_guards import LOCAL, PENDING, add_session, store_path

SLOW = b"".join(chunk({"content": "word "}) for _ in range(400)) + chunk({}, "stop") + b"data: [DONE]\n\n"
TOOL_TURN_2 = (chunk({"role": "assistant", "content": None, "tool_calls": [
    {"index": 0, "id": "call_2", "type": "function", "function": {"name": "calculator", "arguments": ""}}]})
    + chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"expression": "1 + 1"}'}}]})
    + chunk({}, "tool_calls", {"prompt_tokens": 60, "completion_tokens": 10}) + b"data: [DONE]\n\n")


@pytest.fixture(autouse=True)
def _no_provider(monkeypatch) -> None:
    for name in ("FSM_AGENT_PROVIDER", "FSM_AGENT_BASE_URL", "FSM_AGENT_STORE", "FSM_AGENT_MODEL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_local_server(monkeypatch) -> None:
    """Building (let alone starting) the embedded llama.cpp server fails the test."""
    def refuse(*a: object, **kw: object) -> None:
        raise AssertionError("the local llama.cpp server was reached")

    monkeypatch.setattr("fsm_agent.local.LocalLlamaServer.__init__", refuse)


@contextlib.contextmanager
def served(*bodies: bytes, **kw: object) -> Iterator[tuple[str, ReplayServer]]:
    """A ReplayServer answering ``bodies`` in order, on a loop of its own thread (main() runs its own)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    chunk_delay = kw.pop("chunk_delay", 0.0)
    server = ReplayServer([RecordedResponse(200, b, "text/event-stream", chunk_delay=chunk_delay)  # type: ignore[arg-type]
                           for b in bodies], **kw)  # type: ignore[arg-type]
    base = asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield base, server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def remote(base: str) -> list[str]:
    return ["--base-url", base, "--model", "m", "--api-key", "k", "--no-default-middleware"]


def turns(session_id: str) -> int:
    async def go() -> int:
        store = SQLiteStore(store_path())
        try:
            return len(await read_turns(store, session_id))
        finally:
            await store.close()

    return asyncio.run(go())


# -- 1. a store that cannot be opened --------------------------------------------------------
@pytest.mark.parametrize("location, cause", [
    ("postgresql://127.0.0.1:1/x", "ConnectionRefusedError"),
    ("/proc/nope/x.db", "FileNotFoundError"),
    ("/dev/null", "disk I/O error"),
])
def test_a_store_that_cannot_be_opened_is_exit_2_before_anything_starts(no_local_server, location, cause) -> None:
    code, out, err = cli("run", "What is 17*23?", "--store", location)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(f"fsm-agent: cannot open the session store {location}: "), err
    assert cause in err and "then resume" not in err
    assert "session" not in err.replace("session store", "")  # no session id for a session never stored


def test_resume_and_sessions_name_an_unreachable_store_too() -> None:
    for argv in (["resume", "s1"], ["sessions", "list"], ["control", "s1", "interrupt"]):
        code, _, err = cli(*argv, "--store", "postgresql://127.0.0.1:1/x")
        assert code == 2 and err.startswith("fsm-agent: cannot open the session store postgresql://127.0.0.1:1/x: ")


# -- 2. an empty task ----------------------------------------------------------------------
@pytest.mark.parametrize("task", ["", "   "])
def test_an_empty_task_is_a_usage_error(no_local_server, task) -> None:
    code, out, err = cli("run", task)
    assert (code, out) == (2, "")
    assert err.startswith("fsm-agent: the task is empty")


# -- 3. a second Ctrl-C ----------------------------------------------------------------------
def test_a_second_ctrl_c_while_draining_still_says_how_to_resume(monkeypatch) -> None:
    """The first SIGINT drains the run; the second lands while the drain writes its stop (the
    ``KeyboardInterrupt`` of the default SIGINT handler, raised inside the run)."""
    from fsm_agent.cli import _Printer

    on_event, write = _Printer.on_model_event, SQLiteStore.write
    sent: list[str] = []

    def first_signal(self, ev) -> None:
        on_event(self, ev)
        if not sent and getattr(ev.event, "text", None):
            sent.append("first")
            os.kill(os.getpid(), signal.SIGINT)  # the loop's handler: drain

    async def second_signal(self, batch) -> None:
        if sent == ["first"]:
            sent.append("second")
            raise KeyboardInterrupt  # Ctrl-C again, while the drain writes
        await write(self, batch)

    monkeypatch.setattr(_Printer, "on_model_event", first_signal)
    monkeypatch.setattr(SQLiteStore, "write", second_signal)
    with served(SLOW, ANSWER, chunk_sizes=[64], chunk_delay=0.01) as (base, _):
        code, out, err = cli("run", "talk", *remote(base), "--session-id", "twice")
        assert sent == ["first", "second"]
        assert code == 5, err
        assert err.endswith("fsm-agent: interrupted\nsession: twice (continue with: fsm-agent resume twice)\n"), err
        assert out.endswith("\n")
        monkeypatch.setattr(SQLiteStore, "write", write)
        code, _, err = cli("resume", "twice")  # the printed command works
        assert code == 0, err


def test_a_second_ctrl_c_after_the_stop_prints_the_stop_line(monkeypatch) -> None:
    from fsm_agent.cli import _AgentFactory

    aexit = _AgentFactory.__aexit__

    async def ctrl_c_while_stopping(self, *exc: object) -> None:  # e.g. while the local server stops
        await aexit(self, *exc)
        raise KeyboardInterrupt

    monkeypatch.setattr(_AgentFactory, "__aexit__", ctrl_c_while_stopping)
    with served(TOOL_TURN, ANSWER) as (base, _):
        code, out, err = cli("run", "What is 17*23?", "--tool", "calculator", "--approve-tools", "calculator",
                             *remote(base), "--session-id", "after-stop")
    assert code == 5
    assert "stop: WAITING_HUMAN — " in err and "pending: call_1 calculator" in err
    assert "session: after-stop (continue with: fsm-agent resume after-stop --approve call_1" in err
    assert "fsm-agent: interrupted\n" not in err


# -- 4. hints that fit the command -------------------------------------------------------------
def test_run_with_the_id_of_a_running_session_says_how_to_stop_it(no_local_server) -> None:
    add_session("busy", "Model")

    async def lease() -> None:
        store = SQLiteStore(store_path())
        try:
            assert await store.acquire_lease("busy", "host:42:abcd", 60)
        finally:
            await store.close()

    asyncio.run(lease())
    code, _, err = cli("run", "hi", "--session-id", "busy")
    assert code == 2
    assert "session 'busy' is running now (driven by worker host:42:abcd, lease until " in err
    assert "stop it with `fsm-agent control busy interrupt`" in err and "fsm-agent resume" not in err


def test_resume_local_model_message_names_resume_options(no_local_server, tmp_path) -> None:
    add_session("hosted", "INTERRUPTED", {"reason": "INTERRUPTED", "detail": "x"})

    async def to_openai() -> None:
        store = SQLiteStore(store_path())
        try:
            await store.update_metadata("hosted", {"cli": {**LOCAL, "provider": "openai"}})
        finally:
            await store.close()

    asyncio.run(to_openai())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    code, _, err = cli("resume", "hosted", "--local-model", str(gguf))
    assert code == 2
    assert "--provider" not in err and "--base-url" not in err
    assert "session hosted runs on the provider 'openai', which a resume keeps (leave out --local-model)" in err


def test_a_connection_failure_hint_says_only_what_resume_can_do(monkeypatch) -> None:
    async def no_wait(self, seconds: float) -> None:
        return None

    monkeypatch.setattr("fsm_agent.providers.base.RetryPolicy.wait", no_wait)
    base = "http://127.0.0.1:9/v1"  # discard port: refused
    code, _, err = cli("run", "hi", *remote(base), "--session-id", "down")
    assert code == 6, err
    assert "stop: FAILED_RETRYABLE" in err and "cannot connect to 127.0.0.1:9" in err
    assert "base URL right" not in err
    assert (f"session: down (continue with: fsm-agent resume down once {base} answers; a resume keeps the "
            "session's provider and base URL (a wrong URL needs a new run))") in err


def test_a_cut_tool_call_hint_names_the_resume_option() -> None:
    hint = _hint("s", StopReason.FAILED_RETRYABLE, [], None, {"kind": "output_truncated", "max_tokens": 64})
    assert hint == "fsm-agent resume s --max-output-tokens N (more than 64)"
    args = _build_parser().parse_args(["resume", "s", "--max-output-tokens", "128"])
    assert args.max_output_tokens == 128


def test_session_exists_error_does_not_promise_a_resume() -> None:
    exc = SessionExistsError("done")
    assert exc.session_id == "done" and isinstance(exc, KeyError)
    assert "resume" not in str(exc) and "'done' already exists" in str(exc)


# -- 5. a resume that would stop again at once ----------------------------------------------
def test_resume_waiting_human_without_a_decision_is_refused_before_the_server(no_local_server) -> None:
    add_session("wait", "WAITING_HUMAN", PENDING)
    code, out, err = cli("resume", "wait")
    assert (code, out) == (2, "")
    assert "session wait is waiting for a decision on 1 tool call(s)" in err
    assert 'call_1 calculator({"expression":"17 * 23"}) allows approve, reject: --approve call_1 | --reject call_1' in err
    assert turns("wait") == 0


def test_resume_paused_budget_needs_a_budget_above_what_is_used(monkeypatch) -> None:
    with served(TOOL_TURN, TOOL_TURN_2, ANSWER) as (base, server):
        code, _, err = cli("run", "What is 17*23?", "--tool", "calculator", *remote(base), "--max-iterations", "2",
                           "--session-id", "paused")
        assert code == 4, err
        before = turns("paused")

        async def refuse(self) -> None:
            raise AssertionError("the agent was built for a resume that should have been refused")

        with monkeypatch.context() as m:
            m.setattr("fsm_agent.cli._AgentFactory.__aenter__", refuse)
            code, _, err = cli("resume", "paused")
            assert code == 2
            assert ("session paused is paused: its iterations budget is exhausted (2 model call(s) of 2 used); "
                    "raise it with --budget iterations=N, N above 2") in err
            code, _, err = cli("resume", "paused", "--budget", "iterations=1")
            assert code == 2 and "--budget iterations=1 would lower the budget (now 2)" in err
            code, _, err = cli("resume", "paused", "--budget", "iterations=2")
            assert code == 2 and "--budget iterations=2 is not above what session paused has used already" in err
            code, _, err = cli("resume", "paused", "--budget", "iterations=-1")
            assert code == 2 and "--budget iterations must be a whole number of at least 1, not -1" in err
            assert "max_iterations" not in err
        assert turns("paused") == before and len(server.requests) == 2
        code, out, err = cli("resume", "paused", "--budget", "iterations=5", "--max-output-tokens", "77")
        assert code == 0, err
        assert server.requests[-1].json()["max_tokens"] == 77


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "0"], "--timeout must be a positive number, not 0"),
    (["--max-iterations", "0"], "--max-iterations must be a whole number of at least 1, not 0"),
    (["--max-output-tokens", "-5"], "--max-output-tokens must be a whole number of at least 1, not -5"),
])
def test_bad_run_limits_use_the_cli_names(no_local_server, argv, message) -> None:
    code, _, err = cli("run", "hi", *argv)
    assert code == 2 and err == f"fsm-agent: {message}\n"


# -- 6. --approve-tools takes one value -----------------------------------------------------
def test_approve_tools_before_the_task_leaves_the_task_alone() -> None:
    with served(TOOL_TURN) as (base, _):
        code, _, err = cli("run", "--approve-tools", "calculator", "What is 17*23?", "--tool", "calculator",
                           *remote(base), "--session-id", "ask")
    assert code == 3, err
    assert "pending: call_1 calculator" in err


def test_approve_tools_takes_a_comma_list_or_repeats() -> None:
    parse = _build_parser().parse_args
    assert parse(["run", "t", "--approve-tools", "calculator,clock"]).approve_tools == ["calculator", "clock"]
    assert parse(["run", "--approve-tools", "a", "--approve-tools", "b", "t"]).approve_tools == ["a", "b"]
    assert parse(["run", "--approve-tools", "a", "t"]).task == "t"


def test_an_empty_approve_tools_name_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _build_parser().parse_args(["run", "t", "--approve-tools", "calculator,"])
    assert exc.value.code == 2 and "no empty names" in capsys.readouterr().err


# -- 9. argparse names the subcommands; an empty trace ---------------------------------------
@pytest.mark.parametrize("argv, names", [
    (["sessions"], "{list,show}"), (["middleware"], "{list}"),
    ([], "{run,task,resume,sessions,control,serve,worker,diagram,decode,middleware,memory}"),
])
def test_a_missing_subcommand_is_named(capsys, argv, names) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"the following arguments are required: {names}" in err
    assert "_command" not in err


def test_an_empty_trace_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "events.jsonl"
    empty.write_text("")
    code, out, err = cli("diagram", "--trace", str(empty), "--stdout")
    assert (code, out) == (2, "")
    assert f"--trace {empty} holds no transition events" in err


def test_the_docs_show_the_one_value_form() -> None:
    root = Path(__file__).resolve().parents[1]
    policy = (root / "docs" / "policy.md").read_text()
    assert "--approve-tools NAME [NAME ...]" not in policy and "--approve-tools calculator,clock" in policy
    assert "--approve-tools calculator,clock" in (root / "README.md").read_text()
