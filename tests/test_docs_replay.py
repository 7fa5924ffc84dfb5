"""docs/replay.md holds: its Python blocks run as written, in order, in one namespace (each
``test_*`` function a block defines is called), and what they print is what the comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "replay.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)


def test_the_guide_has_python_blocks() -> None:
    assert len(BLOCKS) >= 4


def test_every_python_block_runs_in_order_and_prints_what_it_says() -> None:
    namespace: dict[str, Any] = {"__name__": "replay_md"}
    ran: list[str] = []
    printed: list[str] = []
    for i, block in enumerate(BLOCKS):
        before = set(namespace)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"{DOC.name} python block {i + 1}", "exec"), namespace)  # noqa: S102 - the guide's code
            for name in sorted(set(namespace) - before):
                if name.startswith("test_") and callable(namespace[name]):
                    namespace[name]()
                    ran.append(name)
        printed += out.getvalue().splitlines()
        # the comment after a print says what it prints
        for said in re.findall(r"^print\(.*\)\s+# (.*)$", block, re.M):
            assert said in printed, (said, printed)
    assert ran == ["test_the_invoice_run_still_replays"]
    divergence = namespace["divergence"]
    assert divergence.index == next(i for i, e in enumerate(namespace["recording"].segments[0].effects)
                                    if e.kind == "system_prompt")  # the prompt is read first
