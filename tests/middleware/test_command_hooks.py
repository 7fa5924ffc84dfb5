"""Command hooks (seed 000's HookExecutor): real commands run before and after each model call and
tool call, with the event as JSON on stdin, a timeout that kills the hook's process group, exit 1 of
a before-hook denying, and each hook's failure policy. Through the public API, with small Python
scripts as the hooks."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from fsm_agent import Agent, ConfigurationError, RunConfig, ScriptedProvider, StopReason, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.testing import EffectRecording
from fsm_agent.types import ToolUseBlock
from fsm_agent_middleware.command_hooks import CommandHook, CommandHookRan, CommandHooks

PY = sys.executable


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return {"2+2": "4", "6*7": "42"}.get(expression, "?")


@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


class Events:
    """An observer keeping the command-hook events (plugin events)."""

    def __init__(self) -> None:
        self.ran: list[CommandHookRan] = []

    def on_plugin_event(self, event: object) -> None:
        if isinstance(event, CommandHookRan):
            self.ran.append(event)


def script(tmp_path: Path, name: str, body: str) -> Path:
    """A hook script that first appends its JSON input to ``<name>.jsonl`` (one line per run)."""
    path = tmp_path / f"{name}.py"
    log = tmp_path / f"{name}.jsonl"
    path.write_text("import json, os, subprocess, sys, time\n"
                    "data = json.loads(sys.stdin.read())\n"
                    f"with open({str(log)!r}, 'a') as f:\n"
                    "    f.write(json.dumps(data) + '\\n')\n" + body)
    return path


def seen(tmp_path: Path, name: str) -> list[dict]:
    log = tmp_path / f"{name}.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def hook(event: str, path: Path, **options: object) -> CommandHook:
    return CommandHook.from_dict(event, {"command": [PY, str(path)], "name": path.stem, **options})


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie nobody reaped yet is dead)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def killed(pid_file: Path) -> bool:
    """Whether the process whose pid is in ``pid_file`` is dead, or dies within 10 s (a SIGKILL sent
    to its group is delivered asynchronously)."""
    pid = int(pid_file.read_text())
    for _ in range(1000):
        if not alive(pid):
            return True
        time.sleep(0.01)
    return False


def never_called(request):
    raise AssertionError("the model was called")


def calc(expression: str, call_id: str = "call_1") -> ToolUseBlock:
    return ToolUseBlock(call_id, "calculator", {"expression": expression})


TOOL_THEN_ANSWER = [tool_call_response(calc("2+2")), "2+2 is 4."]


# -- what a hook gets ----------------------------------------------------------------------------
async def test_a_before_model_hook_gets_the_call_as_json_on_stdin(tmp_path) -> None:
    gate = script(tmp_path, "gate", "")
    agent = Agent(ScriptedProvider(["Paris."]), tools=[calculator], system_prompt="Be brief.",
                  middleware=[CommandHooks([hook("before_model_call", gate)])])
    result = await agent.run("Capital of France?", session_id="s1", metadata={"tenant": "acme"})
    assert result.stop.reason is StopReason.COMPLETED and result.output == "Paris."
    [got] = seen(tmp_path, "gate")
    assert got["event"] == "before_model_call" and got["hook"] == "gate"
    assert (got["session_id"], got["turn"], got["tenant"]) == ("s1", 1, "acme")
    assert (got["model"], got["provider"], got["message_count"], got["tools"]) == ("scripted", "scripted", 2,
                                                                                   ["calculator"])
    assert got["last_message"] == {"role": "user", "text": "Capital of France?"}
    assert "messages" not in got  # the whole conversation only when the hook asks for it


async def test_include_messages_puts_the_whole_conversation_in_the_json(tmp_path) -> None:
    audit = script(tmp_path, "audit", "")
    agent = Agent(ScriptedProvider(["Paris."]),
                  middleware=[CommandHooks([hook("after_model_call", audit, include_messages=True)])])
    await agent.run("Capital of France?")
    [got] = seen(tmp_path, "audit")
    assert [(m["role"], m["content"][0]["text"]) for m in got["messages"]] == [
        ("user", "Capital of France?"), ("assistant", "Paris.")]


async def test_an_after_model_hook_observes_the_response(tmp_path) -> None:
    audit = script(tmp_path, "audit", "")
    events = Events()
    agent = Agent(ScriptedProvider(TOOL_THEN_ANSWER), tools=[calculator],
                  middleware=[CommandHooks([hook("after_model_call", audit)])], observers=[events])
    result = await agent.run("2+2?")
    assert result.stop.reason is StopReason.COMPLETED
    first, second = seen(tmp_path, "audit")
    assert first["event"] == "after_model_call" and first["turn"] == 1
    assert first["response"]["stop_reason"] == "tool_use"
    assert first["response"]["tool_calls"] == [{"id": "call_1", "name": "calculator", "input": {"expression": "2+2"}}]
    assert first["response"]["usage"]["input_tokens"] == 10 and first["duration_s"] >= 0
    assert second["response"]["text"] == "2+2 is 4." and second["response"]["tool_calls"] == []
    assert [e.outcome for e in events.ran] == ["observed", "observed"]


async def test_a_tool_hook_gets_the_call_and_an_after_tool_hook_its_result(tmp_path) -> None:
    before = script(tmp_path, "before", "")
    after = script(tmp_path, "after", "")
    agent = Agent(ScriptedProvider(TOOL_THEN_ANSWER), tools=[calculator],
                  middleware=[CommandHooks([hook("before_tool_call", before), hook("after_tool_call", after)])])
    result = await agent.run("2+2?")
    assert result.tool_calls == 1 and result.output == "2+2 is 4."
    [b] = seen(tmp_path, "before")
    assert (b["event"], b["tool_name"], b["tool_call_id"], b["tool_input"]) == (
        "before_tool_call", "calculator", "call_1", {"expression": "2+2"})
    [a] = seen(tmp_path, "after")
    assert a["event"] == "after_tool_call" and a["tool_response"] == {"text": "4", "is_error": False}


# -- exit 1: deny ---------------------------------------------------------------------------------
async def test_exit_1_before_the_model_call_stops_the_run_and_the_model_is_never_called(tmp_path) -> None:
    gate = script(tmp_path, "gate", "print('monthly budget spent', file=sys.stderr)\nsys.exit(1)\n")
    events = Events()
    agent = Agent(ScriptedProvider([never_called]), middleware=[CommandHooks([hook("before_model_call", gate)])],
                  observers=[events])
    result = await agent.run("Hello")
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.output == ""
    assert result.stop.detail == ("the model call was not made: before_model_call hook 'gate' denied it: "
                                  "monthly budget spent")
    assert result.stop.error == {"kind": "hook_denied", "hook": "gate", "event": "before_model_call",
                                 "message": "monthly budget spent"}
    [ran] = events.ran
    assert (ran.hook, ran.event, ran.exit_code, ran.outcome) == ("gate", "before_model_call", 1, "denied")
    assert ran.stderr == "monthly budget spent\n"


async def test_exit_1_before_a_tool_call_denies_it_with_the_stderr_reason_the_model_sees(tmp_path) -> None:
    guard = script(tmp_path, "guard", "print('no arithmetic on Sundays', file=sys.stderr)\nsys.exit(1)\n")
    provider = ScriptedProvider([tool_call_response(calc("6*7"), ToolUseBlock("call_2", "weather", {"city": "Oslo"})),
                                 "I could not compute it."])
    agent = Agent(provider, tools=[calculator, weather],
                  middleware=[CommandHooks([hook("before_tool_call", guard, matcher=["calc*"])])])
    result = await agent.run("6*7, and the weather in Oslo?")
    assert result.stop.reason is StopReason.COMPLETED
    results = {m.tool_call_id: m for m in result.messages if m.role == "tool"}
    denied = results["call_1"]
    assert denied.is_error
    assert denied.text == ("Tool call denied by policy (command_hooks): hook 'guard' denied the call: "
                           "no arithmetic on Sundays")
    assert results["call_2"].text == "sunny in Oslo" and not results["call_2"].is_error  # not matched: not hooked
    assert [g["tool_name"] for g in seen(tmp_path, "guard")] == ["calculator"]
    assert result.tool_calls == 1
    # the model saw the reason in its next request
    assert any(m.role == "tool" and m.text == denied.text for m in provider.requests[1].messages)


async def test_exit_1_of_an_after_hook_is_a_failure_not_a_denial(tmp_path) -> None:
    audit = script(tmp_path, "audit", "sys.exit(1)\n")
    events = Events()
    agent = Agent(ScriptedProvider(["Paris."]), middleware=[CommandHooks([hook("after_model_call", audit)])],
                  observers=[events])
    result = await agent.run("Capital of France?")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "Paris."  # fail_open, the default
    [ran] = events.ran
    assert (ran.outcome, ran.failure) == ("failed_open", "exited with 1 (exit 1 denies only in a before-hook)")


# -- timeouts and failures -----------------------------------------------------------------------
HANG = ("child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "open(os.path.join(os.path.dirname(__file__), 'child.pid'), 'w').write(str(child.pid))\n"
        "print('stuck on the network', file=sys.stderr, flush=True)\n"
        "time.sleep(120)\n")


async def test_a_hanging_hook_is_killed_at_its_timeout_with_its_children_and_fails_open(tmp_path) -> None:
    slow = script(tmp_path, "slow", HANG)
    events = Events()
    agent = Agent(ScriptedProvider(["Paris."]),
                  middleware=[CommandHooks([hook("before_model_call", slow, timeout=0.5)])], observers=[events])
    result = await agent.run("Capital of France?")
    assert result.stop.reason is StopReason.COMPLETED and result.output == "Paris."
    [ran] = events.ran
    assert (ran.exit_code, ran.outcome, ran.on_failure) == (None, "failed_open", "fail_open")
    assert ran.failure == "timed out after 0.5 s; its process group was killed"
    assert ran.stderr == "stuck on the network\n"
    assert killed(tmp_path / "child.pid")  # the hook's own child was killed too


async def test_a_hanging_hook_that_fails_closed_stops_the_run_before_the_model_call(tmp_path) -> None:
    slow = script(tmp_path, "slow", HANG)
    agent = Agent(ScriptedProvider([never_called]),
                  middleware=[CommandHooks([hook("before_model_call", slow, timeout=0.5, on_failure="fail_closed")])])
    result = await agent.run("Capital of France?")
    assert result.stop.reason is StopReason.FAILED_TERMINAL
    assert result.stop.detail == ("the model call was not made: before_model_call hook 'slow' failed (timed out "
                                  "after 0.5 s; its process group was killed) and fails closed: stuck on the network")
    assert result.stop.error["kind"] == "hook_failed" and result.stop.error["hook"] == "slow"
    assert killed(tmp_path / "child.pid")


async def test_a_run_cut_by_its_wall_clock_kills_the_hook_it_waits_for(tmp_path) -> None:
    slow = script(tmp_path, "slow", HANG)
    agent = Agent(ScriptedProvider([never_called]),
                  middleware=[CommandHooks([hook("before_model_call", slow, timeout=60)])])
    result = await agent.run("Capital of France?", config=RunConfig(max_wall_clock=1.0))
    assert result.stop.reason is StopReason.PAUSED_BUDGET and result.stop.budget == "wall_clock"
    assert killed(tmp_path / "child.pid")


@pytest.mark.parametrize(("body", "shell", "code", "failure"), [
    ("print('disk full', file=sys.stderr)\nsys.exit(2)\n", False, 2, "exited with 2"),
    ("import signal\nprint('disk full', file=sys.stderr, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n", False,
     -9, "killed by signal 9"),
    (None, False, 127, "'/nonexistent/hook-binary' not found: No such file or directory (exit code 127)"),
    (None, True, 127, "exited with 127"),
], ids=["exit-2", "signal", "missing-command", "missing-command-in-a-shell"])
@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
async def test_a_crashing_before_tool_hook_follows_its_failure_policy(tmp_path, body, shell, code, failure,
                                                                       policy) -> None:
    if body is not None:
        crash = hook("before_tool_call", script(tmp_path, "crash", body), on_failure=policy)
    elif shell:
        crash = CommandHook.from_dict("before_tool_call", {"command": "/nonexistent/hook-binary --check",
                                                           "shell": True, "name": "crash", "on_failure": policy})
    else:
        crash = CommandHook.from_dict("before_tool_call", {"command": ["/nonexistent/hook-binary"], "name": "crash",
                                                           "on_failure": policy})
    events = Events()
    agent = Agent(ScriptedProvider(TOOL_THEN_ANSWER), tools=[calculator], middleware=[CommandHooks([crash])],
                  observers=[events])
    result = await agent.run("2+2?")
    assert result.stop.reason is StopReason.COMPLETED
    [ran] = events.ran
    assert (ran.exit_code, ran.failure, ran.outcome) == (code, failure, f"failed_{policy.split('_')[1]}")
    [tool_result] = [m for m in result.messages if m.role == "tool"]
    if policy == "fail_open":
        assert (tool_result.text, result.tool_calls) == ("4", 1)
    else:
        said = ": disk full" if body is not None else (": " + ran.stderr.strip() if shell else "")
        assert tool_result.is_error and result.tool_calls == 0
        assert tool_result.text == ("Tool call denied by policy (command_hooks): hook 'crash' failed "
                                    f"({failure}) and fails closed{said}")


async def test_a_failing_after_tool_hook_that_fails_closed_keeps_the_result_and_stops_before_the_next_call(
        tmp_path) -> None:
    audit = script(tmp_path, "audit", "print('audit log unreachable', file=sys.stderr)\nsys.exit(3)\n")
    agent = Agent(ScriptedProvider([tool_call_response(calc("2+2")), never_called]),
                  tools=[calculator],
                  middleware=[CommandHooks([hook("after_tool_call", audit, on_failure="fail_closed")])])
    result = await agent.run("2+2?")
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.tool_calls == 1
    assert [m.text for m in result.messages if m.role == "tool"] == ["4"]  # the tool ran: its result is kept
    assert result.stop.detail == ("the tool 'calculator' ran (its result is kept) and the run stops: after_tool_call "
                                  "hook 'audit' failed (exited with 3) and fails closed: audit log unreachable")
    assert result.stop.error == {"kind": "hook_failed", "hook": "audit", "event": "after_tool_call",
                                 "message": "audit log unreachable", "failure": "exited with 3"}


async def test_a_failing_after_model_hook_that_fails_closed_stops_without_using_the_answer(tmp_path) -> None:
    audit = script(tmp_path, "audit", "sys.exit(4)\n")
    agent = Agent(ScriptedProvider(TOOL_THEN_ANSWER), tools=[calculator],
                  middleware=[CommandHooks([hook("after_model_call", audit, on_failure="fail_closed")])])
    result = await agent.run("2+2?")
    assert result.stop.reason is StopReason.FAILED_TERMINAL and result.tool_calls == 0
    assert result.stop.detail.startswith("the model's answer is not used and the run stops: after_model_call hook "
                                         "'audit' failed (exited with 4)")


async def test_hooks_of_an_event_run_in_order_and_the_first_denial_ends_the_round(tmp_path) -> None:
    one = script(tmp_path, "one", "")
    two = script(tmp_path, "two", "print('two says no', file=sys.stderr)\nsys.exit(1)\n")
    three = script(tmp_path, "three", "")
    agent = Agent(ScriptedProvider([never_called]), middleware=[CommandHooks(
        [hook("before_model_call", one), hook("before_model_call", two), hook("before_model_call", three)])])
    result = await agent.run("Hello")
    assert "hook 'two' denied it: two says no" in result.stop.detail
    assert (len(seen(tmp_path, "one")), len(seen(tmp_path, "two")), len(seen(tmp_path, "three"))) == (1, 1, 0)


# -- output, input -------------------------------------------------------------------------------
async def test_a_chatty_hook_is_read_to_the_end_and_its_output_capped(tmp_path) -> None:
    chatty = script(tmp_path, "chatty", "sys.stdout.write('o' * 2_000_000)\nsys.stderr.write('e' * 2_000_000)\n"
                                        "sys.exit(1)\n")
    agent = Agent(ScriptedProvider([never_called]), middleware=[
        CommandHooks([hook("before_model_call", chatty)], max_output_bytes=100)])
    result = await agent.run("Hello")
    assert result.stop.error["message"] == "e" * 100  # exit 1 was seen: the pipes never filled up


async def test_a_hook_that_does_not_read_its_input_still_decides(tmp_path) -> None:
    quick = tmp_path / "quick.py"
    quick.write_text("import sys\nprint('not today', file=sys.stderr)\nsys.exit(1)\n")  # never reads stdin
    agent = Agent(ScriptedProvider([never_called]), middleware=[CommandHooks(
        [CommandHook.from_dict("before_model_call", {"command": [PY, str(quick)], "include_messages": True})])])
    result = await agent.run("x" * 3_000_000)  # far more than a pipe holds
    assert result.stop.error["kind"] == "hook_denied" and result.stop.error["message"] == "not today"


# -- the log, replay -----------------------------------------------------------------------------
async def test_every_hook_run_is_in_the_session_log(tmp_path) -> None:
    before = script(tmp_path, "before", "")
    guard = script(tmp_path, "guard", "print('no', file=sys.stderr)\nsys.exit(1)\n")
    agent = Agent(ScriptedProvider(TOOL_THEN_ANSWER), tools=[calculator],
                  middleware=[CommandHooks([hook("before_model_call", before), hook("before_tool_call", guard)])])
    result = await agent.run("2+2?", session_id="logged")
    logged = await agent.store.read_events("logged", types=(CommandHookRan.TAG,))
    assert [(e.payload["hook"], e.payload["event"], e.payload["exit_code"], e.payload["outcome"], e.payload["tool"])
            for e in logged] == [("before", "before_model_call", 0, "allowed", None),
                                 ("guard", "before_tool_call", 1, "denied", "calculator"),
                                 ("before", "before_model_call", 0, "allowed", None)]
    assert all(e.payload["duration_s"] >= 0 for e in logged)
    assert result.stop.reason is StopReason.COMPLETED


async def test_a_replay_does_not_run_the_hooks_again(tmp_path) -> None:
    before = script(tmp_path, "before", "")
    guard = script(tmp_path, "guard", "print('no arithmetic', file=sys.stderr)\nsys.exit(1)\n")
    after = script(tmp_path, "after", "")

    def hooks() -> CommandHooks:
        return CommandHooks([hook("before_model_call", before), hook("before_tool_call", guard),
                             hook("after_model_call", after)])

    recording = EffectRecording()
    live = Agent(ScriptedProvider(TOOL_THEN_ANSWER), tools=[calculator], middleware=[hooks()])
    result = await live.run("2+2?", session_id="r", port=recording.record)
    runs = (len(seen(tmp_path, "before")), len(seen(tmp_path, "guard")), len(seen(tmp_path, "after")))
    assert runs == (2, 1, 2)
    assert [e.args["method"] for e in recording.segments[0].effects if e.kind == "plugin_effect"] == ["run_hook"] * 5

    replay = Agent(ScriptedProvider([never_called], repeat_last=True), tools=[calculator], middleware=[hooks()])
    again = await replay.run("2+2?", session_id="r", port=recording.replay)
    recording.check()
    assert again == result
    assert (len(seen(tmp_path, "before")), len(seen(tmp_path, "guard")), len(seen(tmp_path, "after"))) == runs


# -- configuration -------------------------------------------------------------------------------
HOOKS_TOML = """
version = 1

[[before_tool_call]]
name = "guard"
command = ["{py}", "guard.py"]
matcher = "calc*"
timeout = 2.5
on_failure = "fail_closed"

[[after_model_call]]
command = "{py} audit.py --quiet"
"""


def write_hooks(tmp_path: Path) -> None:
    (tmp_path / "guard.py").write_text("import sys\nprint('relative paths work', file=sys.stderr)\nsys.exit(1)\n")
    (tmp_path / "audit.py").write_text("import sys\nsys.stdin.read()\nopen('audited', 'a').write(sys.argv[1])\n")


@pytest.mark.parametrize("kind", ["toml", "json"])
async def test_a_hooks_file_runs_its_hooks_in_its_own_directory(tmp_path, kind, monkeypatch) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    write_hooks(conf)
    if kind == "toml":
        (conf / "hooks.toml").write_text(HOOKS_TOML.format(py=PY))
        path = conf / "hooks.toml"
    else:
        path = conf / "hooks.json"
        path.write_text(json.dumps({"version": 1, "before_tool_call": [
            {"name": "guard", "command": [PY, "guard.py"], "matcher": "calc*", "timeout": 2.5,
             "on_failure": "fail_closed"}], "after_model_call": [{"command": f"{PY} audit.py --quiet"}]}))
    monkeypatch.chdir(tmp_path)  # not the file's directory
    hooks = CommandHooks.from_file(path)
    assert [(h.event, h.name, h.timeout, h.on_failure, h.matcher) for h in hooks.hooks] == [
        ("before_tool_call", "guard", 2.5, "fail_closed", ("calc*",)),
        ("after_model_call", f"{PY} audit.py --quiet", 5.0, "fail_open", ())]
    agent = Agent(ScriptedProvider(TOOL_THEN_ANSWER), tools=[calculator], middleware=[hooks])
    result = await agent.run("2+2?")
    assert [m.text for m in result.messages if m.role == "tool"] == [
        "Tool call denied by policy (command_hooks): hook 'guard' denied the call: relative paths work"]
    assert (conf / "audited").read_text() == "--quiet--quiet"


def test_the_command_line_form_splits_like_a_shell_without_one() -> None:
    h = CommandHook.parse("before_tool_call=python3 'my hook.py' --strict")
    assert (h.event, h.command, h.shell, h.timeout, h.on_failure, h.cwd) == (
        "before_tool_call", ("python3", "my hook.py", "--strict"), False, 5.0, "fail_open", None)
    assert CommandHook.parse("before_llm_call=true").event == "before_model_call"  # the seed's name


@pytest.mark.parametrize(("text", "says"), [
    ('[[before_model]]\ncommand = "true"\n', "unknown key 'before_model'"),
    ('version = 2\n', "version 2 is not supported"),
    ('before_model_call = "true"\n', "before_model_call is a list of hooks"),
    ('[[before_model_call]]\ntimeout = 3\n', "command is required"),
    ('[[before_model_call]]\ncommand = "true"\ntimeout = 0\n', "timeout is seconds"),
    ('[[before_model_call]]\ncommand = "true"\non_failure = "ignore"\n', "on_failure is 'fail_open' or 'fail_closed'"),
    ('[[before_model_call]]\ncommand = "true"\nmatcher = "calc*"\n', "matcher picks tools; before_model_call is not"),
    ('[[before_tool_call]]\ncommand = "true"\nmatcher = "Edit|Write"\n', "patterns are globs"),
    ('[[before_tool_call]]\ncommand = ["sh", "-c", "true"]\nshell = true\n', "with shell = true, command is one"),
    ('[[before_tool_call]]\ncommand = "true"\ninclude_messages = true\n', "include_messages is for the model"),
    ('[[before_tool_call]]\ncommand = "true"\nretries = 3\n', "unknown key(s) 'retries'"),
    ('[[before_tool_call]]\ncommand = "true"\nenv = { A = 1 }\n', "env is a table of strings"),
    ('[[before_tool_call]]\ncommand = "python3 \'unclosed"\n', "cannot be split into arguments"),
    ('[[before_tool_call]\n', "invalid TOML"),
])
def test_a_bad_hooks_file_is_a_configuration_error_naming_the_problem(tmp_path, text, says) -> None:
    path = tmp_path / "hooks.toml"
    path.write_text(text)
    with pytest.raises(ConfigurationError) as info:
        CommandHooks.from_file(path)
    assert says in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(("spec", "says"), [
    ("python3 hook.py", "write EVENT=COMMAND"),
    ("before_everything=true", "unknown hook event 'before_everything'"),
    ("before_tool_call=  ", "command is empty"),
])
def test_a_bad_command_line_hook_is_a_configuration_error(spec, says) -> None:
    with pytest.raises(ConfigurationError, match="--hook") as info:
        CommandHook.parse(spec)
    assert says in str(info.value)


def test_a_missing_hooks_file_is_a_configuration_error(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read the hooks file"):
        CommandHooks.from_file(tmp_path / "nope.toml")


# -- the docs ------------------------------------------------------------------------------------
DOCS = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"


def test_the_docs_example_file_loads_as_described(tmp_path) -> None:
    text = DOCS.read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "hooks.toml").write_text(example)
    hooks = CommandHooks.from_file(tmp_path / "hooks.toml")
    assert [(h.event, h.name, h.on_failure, h.shell, h.matcher, h.cwd) for h in hooks.hooks] == [
        ("before_model_call", "budget-gate", "fail_closed", False, (), str(tmp_path)),
        ("before_tool_call", "no-prod-paths", "fail_closed", False, ("write_file", "shell*"), str(tmp_path)),
        ("after_model_call", "audit", "fail_open", False, (), str(tmp_path)),
        ("after_tool_call", "notify-send 'a tool ran'", "fail_open", True, (), str(tmp_path))]
    assert hooks.hooks[2].command == ("python3", "audit.py", "--to", "/var/log/agent-audit.jsonl")
    assert "(docs/hooks.md)" in (DOCS.parents[1] / "README.md").read_text()
