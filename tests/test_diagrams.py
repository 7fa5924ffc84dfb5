"""Diagrams of a configured agent (its chains per phase) and of a run's path (from its event log)."""

from __future__ import annotations

import io
from pathlib import Path

import orjson

from fsm_agent import Agent, ScriptedProvider, tool
from fsm_agent.cli import main
from fsm_agent.diagrams import render_machine, trace_of
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.types import unstructure

AGENT_MODULE = '''
from fsm_agent import Agent, ScriptedProvider
from fsm_agent_middleware.loop_detection import LoopDetection
from fsm_agent_middleware.repair import MessageRepair
from fsm_agent_middleware.tool_policy import ToolPolicy
from fsm_agent_middleware.verifier import Verifier

agent = Agent(ScriptedProvider([]), middleware=[ToolPolicy.from_dict({"default": "allow", "rule": []}),
                                                MessageRepair(), LoopDetection(), Verifier(lambda ctx: True)])
'''


def test_diagram_of_a_configured_agent_shows_each_phase_chain(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "my_agents.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = io.StringIO()
    assert main(["diagram", "--agent", "my_agents:agent", "--stdout"], out=out, err=io.StringIO()) == 0
    text = out.getvalue()
    assert "note right of PreTurn" in text and "note right of MidTurn" in text and "note right of PostTurn" in text
    pre = text.split("note right of PreTurn")[1].split("end note")[0]
    assert "pre_turn: " in pre and "repair" in pre and "loop_detection" in pre
    mid = text.split("note right of MidTurn")[1].split("end note")[0]
    assert "on_tool_call: tool_policy" in mid
    assert "post_turn: verifier" in text
    err = io.StringIO()
    assert main(["diagram", "--agent", "my_agents:nope", "--stdout"], out=io.StringIO(), err=err) == 2
    assert "my_agents:nope" in err.getvalue()


@tool
def echo(text: str) -> str:
    """Echo."""
    return text


async def test_diagram_of_a_run_marks_the_path(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    await Agent(ScriptedProvider([tool_call_response(("echo", {"text": "a"})), "done"]), tools=[echo],
                store=store).run("go", session_id="t1")
    events = await store.read_events("t1")
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(orjson.dumps(unstructure(e)).decode() for e in events))
    moves = trace_of(path)
    assert moves == [("Idle", "start", "PreTurn"), ("PreTurn", "call_model", "Model"), ("Model", "tool_use", "MidTurn"),
                     ("MidTurn", "tools_done", "PostTurn"), ("PostTurn", "next_turn", "PreTurn"),
                     ("PreTurn", "call_model", "Model"), ("Model", "model_done", "PostTurn"),
                     ("PostTurn", "complete", "COMPLETED")]
    text = render_machine(trace=moves)
    assert 'PreTurn -->|"call_model #2, #6"| Model' in text
    assert 'PostTurn -->|"complete #8"| COMPLETED' in text
    assert 'PreTurn -->|"pause_budget"| PAUSED_BUDGET\n' in text  # not taken: unmarked
    assert "class COMPLETED,Idle,MidTurn,Model,PostTurn,PreTurn visited" in text
    out = io.StringIO()
    assert main(["diagram", "--trace", str(path)], out=out, err=io.StringIO()) == 0
    assert out.getvalue() == render_machine(trace=moves, title="events.jsonl")



ROOT = Path(__file__).resolve().parents[1]


def test_the_repository_is_found_from_the_package_not_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    from fsm_agent.diagrams import default_diagram_path, repository_root

    monkeypatch.chdir(tmp_path)
    assert repository_root() == ROOT
    assert default_diagram_path() == ROOT / "diagrams" / "agent_loop.mmd"


def test_diagram_check_from_another_directory_checks_the_repository_file(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "fsm_agent.cli", "diagram", "--check"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    committed = ROOT / "diagrams" / "agent_loop.mmd"
    if committed.read_text() == render_machine():  # whether it is stale is test_committed_diagram_matches_the_table's job
        assert (proc.returncode, proc.stderr) == (0, f"{committed} is up to date\n")
    else:
        assert proc.returncode == 1 and proc.stderr.startswith(f"{committed} differs from the transition table")
    assert list(tmp_path.iterdir()) == []


def test_diagram_writes_into_the_repository_wherever_it_runs(tmp_path: Path, monkeypatch) -> None:
    checkout, elsewhere = tmp_path / "checkout", tmp_path / "elsewhere"
    (checkout / "diagrams").mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.setattr("fsm_agent.diagrams.repository_root", lambda: checkout)  # never rewrite the real file
    monkeypatch.chdir(elsewhere)
    err = io.StringIO()
    assert main(["diagram"], out=io.StringIO(), err=err) == 0
    assert (checkout / "diagrams" / "agent_loop.mmd").read_text() == render_machine()
    assert err.getvalue() == f"wrote {checkout / 'diagrams' / 'agent_loop.mmd'}\n"
    assert list(elsewhere.iterdir()) == []


def test_an_installed_copy_needs_an_explicit_output(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("fsm_agent.diagrams.repository_root", lambda: None)
    monkeypatch.chdir(tmp_path)
    for argv in (["diagram"], ["diagram", "--check"]):
        err = io.StringIO()
        assert main(argv, out=io.StringIO(), err=err) == 2
        assert "not run from a checkout" in err.getvalue() and "give --output PATH" in err.getvalue()
    assert list(tmp_path.iterdir()) == []
    err = io.StringIO()
    assert main(["diagram", "--output", "diagrams/agent_loop.mmd"], out=io.StringIO(), err=err) == 0
    assert (tmp_path / "diagrams" / "agent_loop.mmd").read_text() == render_machine()
    assert err.getvalue() == f"wrote {tmp_path.resolve() / 'diagrams' / 'agent_loop.mmd'}\n"
