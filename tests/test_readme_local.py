"""The README shows, on the embedded default model (SmolLM2-135M), only what that model can do.

SmolLM2-135M cannot use tools, so no command the README runs on the default model enables one,
and the tool examples name the model they need. The ``llama`` test runs the Quick start's command
and every ``fsm-agent run`` line of the command-line section's first block (the default-model block)
as a new user would, and checks that each ends COMPLETED with an answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

NEEDS_MORE_THAN_SMOLLM2 = ("--tool", "--approve-tools", "--policy", "--provider", "--base-url", "--local-model",
                           "--model", "--api-key")


def _blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", text, re.S)


def quick_start_run() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    first = _blocks(section)[0]
    return shlex.split(first.split("&&")[-1].strip(), comments=True)


def default_model_runs() -> list[list[str]]:
    """The ``fsm-agent run`` lines of the command-line section's first block, as argv lists."""
    section = README.split("## The command line", 1)[1].split("\n## ", 1)[0]
    block = _blocks(section)[0]
    runs = [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("fsm-agent run ")]
    assert runs, "the default-model block has no `fsm-agent run` line"
    return runs


def test_default_model_examples_ask_nothing_it_cannot_do() -> None:
    for argv in [quick_start_run(), *default_model_runs()]:
        assert argv[:2] == ["fsm-agent", "run"], argv
        used = [a for a in argv if a.split("=", 1)[0] in NEEDS_MORE_THAN_SMOLLM2]
        assert not used, f"{shlex.join(argv)} is shown on the default model but uses {used}"


def test_every_tool_example_names_a_model_that_can_use_tools() -> None:
    lines = [ln for b in _blocks(README) for ln in b.splitlines()]
    tool_lines = [ln for ln in lines if ln.startswith("fsm-agent run ") and "--tool " in ln]
    assert tool_lines
    first = tool_lines[0]
    assert "--local-model" in first and "calculator" in first, first   # the first tool example says which model
    assert re.search(r"0\.5B\+\s+instruct model such as Qwen2\.5-0\.5B-Instruct", README)
    # the later tool lines sit under `export FSM_AGENT_LOCAL_MODEL=...` in the same block
    block = next(b for b in _blocks(README) if first in b)
    export = block.index("export FSM_AGENT_LOCAL_MODEL=")
    for ln in tool_lines[1:]:
        assert ln in block and block.index(ln) > export, ln


@pytest.mark.llama
async def test_readme_default_model_commands_run(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FSM_AGENT_PROVIDER", "FSM_AGENT_BASE_URL", "FSM_AGENT_LOCAL_MODEL", "FSM_AGENT_MODEL")}
    env["FSM_AGENT_STORE"] = str(tmp_path / "sessions.db")
    for argv in [quick_start_run(), *default_model_runs()]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fsm_agent.cli", *argv[1:], env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out_b, err_b = await asyncio.wait_for(proc.communicate(), 240)
        out, err = out_b.decode(), err_b.decode()
        shown = shlex.join(argv)
        assert proc.returncode == 0, f"{shown}\n{err}"
        assert "Traceback" not in err, shown
        assert "using the embedded local model (SmolLM2-135M via llama.cpp)" in err, shown
        if "--json" in argv:
            result = json.loads(out)
            assert result["stop"]["reason"] == "COMPLETED" and result["output"].strip(), shown
        else:
            assert "stop: COMPLETED" in err and out.strip() and out.strip() != "(the model gave no text)", shown
