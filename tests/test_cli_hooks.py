"""``fsm-agent run --hooks FILE`` / ``--hook EVENT=COMMAND`` (docs/hooks.md): command hooks from the
command line, end to end against a recorded OpenAI-compatible server, kept with the session so that
a resume runs them again; ``serve`` takes the same flags."""

from __future__ import annotations

import asyncio
import configparser
import json
import sys
from pathlib import Path

import pytest

from fsm_agent.plugins import discover, load_plugin
from fsm_agent.store import SQLiteStore
from fsm_agent_middleware.command_hooks import CommandHookRan, CommandHooks
from test_cli import ANSWER, TOOL_TURN
from test_cli_first_user import cli, no_local_server, remote, served  # noqa: F401 - fixtures
from test_cli_run_guards import store_path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@pytest.fixture(autouse=True)
def _command_hooks_entry_point(tmp_path_factory, monkeypatch) -> None:
    """The ``command_hooks`` entry point as setup.cfg declares it, also where the installed metadata
    predates it (an editable install made before the plugin existed): a dist-info on ``sys.path``."""
    for name in ("FSM_AGENT_PROVIDER", "FSM_AGENT_BASE_URL", "FSM_AGENT_STORE", "FSM_AGENT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    declared = dict(line.split("=", 1) for line in cfg["options.entry_points"]["fsm_agent.middleware"].splitlines()
                    if "=" in line)
    value = {k.strip(): v.strip() for k, v in declared.items()}["command_hooks"]
    assert value == "fsm_agent_middleware.command_hooks:CommandHooks"
    if not any(p.name == "command_hooks" for p in discover()):
        site = tmp_path_factory.mktemp("site")
        info = site / "fsm_agent_command_hooks-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fsm-agent-command-hooks\nVersion: 0\n")
        (info / "entry_points.txt").write_text(f"[fsm_agent.middleware]\ncommand_hooks = {value}\n")
        monkeypatch.syspath_prepend(str(site))
    assert load_plugin("command_hooks") is CommandHooks


def events(session_id: str) -> list[dict]:
    async def go() -> list[dict]:
        store = SQLiteStore(store_path())
        try:
            return [e.payload for e in await store.read_events(session_id, types=(CommandHookRan.TAG,))]
        finally:
            await store.close()

    return asyncio.run(go())


def write_hooks(where: Path) -> Path:
    (where / "guard.py").write_text("import json, sys\ncall = json.load(sys.stdin)\n"
                                    "print(f\"{call['tool_name']} is off today\", file=sys.stderr)\nsys.exit(1)\n")
    (where / "audit.py").write_text("import sys\nwith open('audit.jsonl', 'a') as f:\n"
                                    "    f.write(sys.stdin.read() + '\\n')\n")
    path = where / "hooks.toml"
    path.write_text(f"""
[[before_tool_call]]
name = "guard"
command = ["{PY}", "guard.py"]
matcher = "calculator"
on_failure = "fail_closed"

[[after_model_call]]
name = "audit"
command = ["{PY}", "audit.py"]
""")
    return path


def audited(where: Path) -> list[dict]:
    log = where / "audit.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_run_with_a_hooks_file_denies_a_tool_the_model_then_hears_about(tmp_path) -> None:
    hooks = write_hooks(tmp_path)
    with served(TOOL_TURN, ANSWER) as (base, server):
        code, out, err = cli("run", "What is 17*23?", *remote(base), "--tool", "calculator", "--hooks", str(hooks),
                             "--session-id", "hooked")
    assert code == 0, err
    assert out.strip() == "17 * 23 = 391."
    assert "calculator is off today" in err  # the denied call as the CLI shows it
    tool_message = server.requests[1].json()["messages"][-1]
    assert tool_message["role"] == "tool" and tool_message["content"] == (
        "Tool call denied by policy (command_hooks): hook 'guard' denied the call: calculator is off today")
    assert [a["response"]["stop_reason"] for a in audited(tmp_path)] == ["tool_use", "end_turn"]
    assert [(e["hook"], e["event"], e["exit_code"], e["outcome"]) for e in events("hooked")] == [
        ("audit", "after_model_call", 0, "observed"), ("guard", "before_tool_call", 1, "denied"),
        ("audit", "after_model_call", 0, "observed")]


def test_a_denying_before_model_hook_on_the_command_line_stops_before_any_request(tmp_path, monkeypatch) -> None:
    (tmp_path / "gate.py").write_text("import sys\nprint('over the monthly budget', file=sys.stderr)\nsys.exit(1)\n")
    monkeypatch.chdir(tmp_path)  # --hook runs in the current directory
    with served(ANSWER) as (base, server):
        code, out, err = cli("run", "Hello", *remote(base), "--hook", f"before_model_call={PY} gate.py",
                             "--session-id", "gated")
    assert code == 7 and out == ""  # FAILED_TERMINAL
    assert (f"the model call was not made: before_model_call hook '{PY} gate.py' denied it: over the monthly "
            "budget") in err
    assert server.requests == []
    [ran] = events("gated")
    assert (ran["exit_code"], ran["outcome"], ran["stderr"]) == (1, "denied", "over the monthly budget\n")


def test_a_resume_runs_the_session_hooks_again(tmp_path) -> None:
    (tmp_path / "audit.py").write_text("import sys\nwith open('audit.jsonl', 'a') as f:\n"
                                       "    f.write(sys.stdin.read() + '\\n')\n")
    hooks = tmp_path / "hooks.json"
    hooks.write_text(json.dumps({"before_tool_call": [{"name": "check", "command": [PY, "audit.py"]}],
                                 "after_tool_call": [{"name": "audit", "command": [PY, "audit.py"]}]}))
    with served(TOOL_TURN, ANSWER) as (base, _):
        code, _, err = cli("run", "What is 17*23?", *remote(base), "--tool", "calculator", "--approve-tools",
                           "calculator", "--hooks", str(hooks), "--session-id", "paused")
        assert code == 3, err  # WAITING_HUMAN: the call was checked before a person is asked
        assert [a["event"] for a in audited(tmp_path)] == ["before_tool_call"]
        code, out, err = cli("resume", "paused", "--approve", "call_1", "--api-key", "k")
    assert code == 0, err
    _, after = audited(tmp_path)  # the person's decision is not checked again
    assert (after["event"], after["tool_name"], after["tool_response"]) == (
        "after_tool_call", "calculator", {"text": "391", "is_error": False})


@pytest.mark.parametrize(("flags", "says"), [
    (["--hooks", "missing.toml"], "missing.toml: cannot read the hooks file"),
    (["--hooks", "bad.toml"], "unknown key 'before_modell_call'"),
    (["--hook", "before_model_call"], "--hook 'before_model_call': write EVENT=COMMAND"),
])
def test_a_bad_hook_configuration_exits_2_before_anything_starts(no_local_server, tmp_path, monkeypatch, flags,
                                                                 says) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text('[[before_modell_call]]\ncommand = "true"\n')
    code, out, err = cli("run", "Hello", *flags)
    assert (code, out) == (2, "")
    assert err.startswith("fsm-agent: ") and says in err


def test_serve_takes_the_hooks_flags_and_refuses_them_with_agent(tmp_path) -> None:
    code, _, err = cli("serve", "--agent", "mymodule:agent", "--hooks", str(tmp_path / "hooks.toml"))
    assert code == 2
    assert "--hooks configure the agent the command line builds" in err
