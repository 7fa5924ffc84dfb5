"""The README's commands are the ones CI runs, and its diagram is the table's."""

from __future__ import annotations

import re
from pathlib import Path

from fsm_agent.diagrams import render_machine

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", README, re.S)


def test_readme_has_the_two_commands_and_ci_runs_the_test_one() -> None:
    install_run, test = commands()[0], commands()[1]
    assert "fsm-agent run" in install_run and ".[local]" in install_run
    assert "pytest" in test
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci.splitlines()


def test_readme_embeds_the_rendered_diagram() -> None:
    block = re.search(r"```mermaid\n(.+?)```", README, re.S)
    assert block is not None
    assert block.group(1) == render_machine()
