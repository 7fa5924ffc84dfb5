"""docs/policy.md: its example is a valid policy that decides as the page says."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from fsm_agent import Allow, AskApproval, Deny
from fsm_agent_middleware.tool_policy import PolicyError, ToolPolicy

DOC = (Path(__file__).resolve().parents[1] / "docs" / "policy.md").read_text()


def example() -> ToolPolicy:
    blocks = re.findall(r"```toml\n(.+?)```", DOC, re.S)
    assert len(blocks) == 1
    return ToolPolicy.from_dict(tomllib.loads(blocks[0]), source="docs/policy.md")


@pytest.mark.parametrize(("tool", "arguments", "decision"), [
    ("read_file", {"path": "/srv/report.txt"}, Allow),
    ("read_file", {"path": "/etc/passwd"}, Deny),
    ("pay", {"amount": 40, "currency": "EUR"}, Allow),
    ("pay", {"amount": 400, "currency": "EUR"}, AskApproval),
    ("shell", {"command": "ls"}, Deny),
    ("calculator", {"expression": "1+1"}, Allow),
])
def test_the_example_decides_as_the_page_says(tool: str, arguments: dict, decision: type) -> None:
    assert isinstance(example().decide(tool, arguments), decision)


def test_details_the_page_states() -> None:
    policy = example()
    ask = policy.decide("pay", {"amount": 400, "currency": "EUR"})
    assert isinstance(ask, AskApproval) and tuple(ask.allowed_decisions) == ("approve", "reject")
    shell = policy.decide("shell", {})
    assert isinstance(shell, Deny) and "shell commands are not allowed" in shell.reason
    with pytest.raises(PolicyError) as info:
        ToolPolicy.from_dict({"rule": [{"tool": "x", "action": "allow"}, {"tool": "y", "action": "permit"}]},
                             source="policy.toml")
    assert "policy.toml: rule 2: 'action' must be one of allow, deny, ask, not 'permit'" in info.value.problems
