"""docs/memory.md holds: its Python blocks run as written, in order, in one namespace, and what they
print is what the comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "memory.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)


def test_the_guide_has_python_blocks() -> None:
    assert len(BLOCKS) >= 5


def test_every_python_block_runs_in_order_and_prints_what_it_says() -> None:
    namespace: dict[str, Any] = {"__name__": "memory_md"}
    printed: list[str] = []
    said_all: list[str] = []
    for i, block in enumerate(BLOCKS):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"{DOC.name} python block {i + 1}", "exec"), namespace)  # noqa: S102 - the guide's code
        printed += out.getvalue().splitlines()
        for said in re.findall(r"^print\(.*\)\s+# (.*)$", block, re.M):
            said_all.append(said)
            assert said in printed, (said, printed)
    assert len(said_all) >= 5


def test_the_guide_names_every_option_of_the_plugin() -> None:
    import inspect

    from fsm_agent_middleware.memory import EpisodicMemory

    text = DOC.read_text()
    for name in inspect.signature(EpisodicMemory).parameters:
        assert f"`{name}`" in text, name
