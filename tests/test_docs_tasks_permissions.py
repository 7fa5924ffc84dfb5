"""docs/permissions.md and docs/tasks.md: their file-format examples load, and decide and run as the
pages say."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from fsm_agent import Permissions, Task, TaskBudget
from fsm_agent.task import __doc__ as TASK_DOC

DOCS = Path(__file__).resolve().parents[1] / "docs"


def toml_blocks(page: str) -> list[str]:
    return re.findall(r"```toml\n(.+?)```", (DOCS / page).read_text(), re.S)


def permissions_example() -> Permissions:
    (block,) = toml_blocks("permissions.md")
    return Permissions.from_dict(tomllib.loads(block), source="docs/permissions.md")


@pytest.mark.parametrize(("tool", "arguments", "allowed"), [
    ("read_file", {"path": "/srv/data/report.txt"}, True),
    ("read_file", {"path": "/srv/data/../../etc/passwd"}, False),
    ("fetch", {"url": "https://api.example.com/v1"}, True),
    ("fetch", {"url": "https://example.com@evil.org/"}, False),
    ("pay", {"amount": 40}, True),            # currency is optional
    ("pay", {"amount": 40, "currency": "GBP"}, False),
    ("pay", {"amount": 400, "currency": "EUR"}, False),
    ("shell", {"command": "ls"}, False),
])
def test_the_permissions_example_decides_as_the_page_says(tool: str, arguments: dict, allowed: bool) -> None:
    assert permissions_example().allows(tool, arguments) is allowed


def test_the_task_file_examples_load() -> None:
    (block,) = toml_blocks("tasks.md")
    task = Task.from_dict(tomllib.loads(block), source="docs/tasks.md")
    assert task.name == "largest-city" and task.budget == TaskBudget(8, 120, None, 0.05)
    assert [c.kind for c in task.checks] == ["value", "grader"] and task.output_schema is not None
    assert task.session_permissions() is not None
    assert not task.session_permissions().allows("lookup_city", {"country": "Spain"})  # type: ignore[union-attr]
    module_example = TASK_DOC.split("::", 1)[1].split('"""', 1)[0]
    loaded = Task.from_dict(tomllib.loads(re.sub(r"(?m)^    ", "", module_example)), source="fsm_agent.task")
    assert [c.kind for c in loaded.checks] == ["value", "grader", "python"]
