"""docs/writing-middleware.md holds: its Python blocks run as written, and its contracts match the code.

* Every ```python block runs, in order, in one namespace (a block may use what an earlier one
  defined). A block whose first line is ``# package/__init__.py`` (or ``# module.py``) is the
  file of that name: it is run as that module, so later blocks import it as a reader would. Each
  ``test_*`` function a block defines is called.
* The guide's table of legal ``StopRun`` reasons, and the "legal reasons here" of each hook's
  docstring, match what the transition table allows from each phase; and a run proves it: a
  ``StopRun`` with each reason, from each phase's hooks, ends with that reason when it is legal
  and fails closed (FAILED_TERMINAL) when it is not.
* The guide and the docstrings name every hook.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import fsm_agent.middleware as contract
from fsm_agent import TRANSITIONS, Agent, Middleware, ScriptedProvider, StopReason, StopRun
from fsm_agent.middleware import HOOKS
from fsm_agent.providers import tool_call_response
from fsm_agent.tools.demo import calculator

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-middleware.md"
TEXT = DOC.read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", TEXT, re.S | re.M)
_FILE = re.compile(r"#\s*([A-Za-z_][\w/]*)\.py\s*$")

PHASE_OF = {"pre_turn": "PreTurn", "wrap_model_call": "Model", "on_tool_call": "MidTurn",
            "wrap_tool_call": "MidTurn", "post_turn": "PostTurn"}
"""The hooks that run inside a phase, and that phase."""


def legal_stops(phase: str) -> set[StopReason]:
    """The stop reasons the transition table allows from ``phase``."""
    return {t.dest for t in TRANSITIONS if t.source.value == phase and isinstance(t.dest, StopReason)}


def _module_name(first_line: str) -> str | None:
    m = _FILE.fullmatch(first_line.strip())
    if m is None:
        return None
    name = m.group(1).replace("/", ".")
    return name.removesuffix(".__init__")


def test_the_guide_has_python_blocks() -> None:
    assert len(BLOCKS) >= 6


def test_every_python_block_runs_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    namespace: dict[str, Any] = {"__name__": "writing_middleware_md"}
    ran_tests = []
    for i, block in enumerate(BLOCKS):
        where = f"{DOC.name} python block {i + 1}"
        module = _module_name(block.splitlines()[0])
        if module is not None:  # the file of a package: import it as that module
            mod = types.ModuleType(module)
            exec(compile(block, f"{where} ({module})", "exec"), mod.__dict__)  # noqa: S102 - the guide's code
            monkeypatch.setitem(sys.modules, module, mod)
            continue
        before = set(namespace)
        exec(compile(block, where, "exec"), namespace)  # noqa: S102 - the guide's code
        for name in sorted(set(namespace) - before):
            if name.startswith("test_") and callable(namespace[name]):
                out = namespace[name]()
                if inspect.isawaitable(out):
                    asyncio.run(out)
                ran_tests.append(name)
    assert ran_tests, "the guide's testing section defines no test_* function"


def test_the_guide_names_every_hook() -> None:
    for hook in HOOKS:
        assert f"`{hook}(" in TEXT, f"docs/writing-middleware.md does not describe {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_contract_docstring(hook: str) -> None:
    doc = inspect.getdoc(getattr(Middleware, hook)) or ""
    for part in ("Returns:", "Raises:", "Not called:") if hook != "on_run_start" else ("Returns:", "Raises:"):
        assert part in doc, f"Middleware.{hook} docstring lacks {part!r}"
    assert contract.__doc__ and f"Middleware.{hook}" in contract.__doc__


def _reasons(text: str) -> set[StopReason]:
    return {StopReason(w) for w in re.findall(r"\b[A-Z][A-Z_]+[A-Z]\b", text) if w in StopReason.__members__}


@pytest.mark.parametrize("hook", sorted(PHASE_OF))
def test_docstring_legal_reasons_match_the_table(hook: str) -> None:
    doc = inspect.getdoc(getattr(Middleware, hook)) or ""
    m = re.search(r"legal reasons here: (.*?)\(", doc, re.S)
    assert m, f"Middleware.{hook} does not list the StopRun reasons legal where it runs"
    assert _reasons(m.group(1)) == legal_stops(PHASE_OF[hook])


@pytest.mark.parametrize("phase", sorted(set(PHASE_OF.values())))
def test_guide_table_of_legal_reasons_matches_the_table(phase: str) -> None:
    section = TEXT.split("## 2. Stopping a run", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith(f"| {phase} |")]
    assert len(rows) == 1, f"the guide's StopRun table has no single row for {phase}"
    assert _reasons(rows[0].split("|")[3]) == legal_stops(phase)


class _Stopper(Middleware):
    """Raises StopRun(reason) from one hook."""

    name = "stopper"

    def __init__(self, hook: str, reason: StopReason) -> None:
        self.hook, self.reason = hook, reason

    def _stop(self) -> None:
        raise StopRun(self.reason, f"stopped from {self.hook}")

    def pre_turn(self, ctx: Any) -> None:
        if self.hook == "pre_turn":
            self._stop()

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        if self.hook == "wrap_model_call":
            self._stop()
        return await call_next(request)

    def on_tool_call(self, call: Any, ctx: Any) -> None:
        if self.hook == "on_tool_call":
            self._stop()

    async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
        if self.hook == "wrap_tool_call":
            self._stop()
        return await call_next(call)

    def post_turn(self, ctx: Any) -> None:
        if self.hook == "post_turn":
            self._stop()


@pytest.mark.parametrize("reason", list(StopReason), ids=lambda r: r.value)
@pytest.mark.parametrize("hook", sorted(PHASE_OF))
async def test_stoprun_ends_with_its_reason_where_legal_and_fails_closed_elsewhere(hook: str,
                                                                                  reason: StopReason) -> None:
    agent = Agent(ScriptedProvider([tool_call_response(("calculator", {"expression": "2+2"})), "4"]),
                  tools=[calculator], middleware=[_Stopper(hook, reason)])
    result = await agent.run("2+2?")
    if reason in legal_stops(PHASE_OF[hook]):
        assert result.stop.reason is reason, result.stop.detail
    else:
        assert result.stop.reason is StopReason.FAILED_TERMINAL
        assert "fails closed" in result.stop.detail
    answered = {getattr(m, "tool_call_id", None) for m in result.messages}
    calls = [c.id for m in result.messages if m.role == "assistant" for c in m.tool_calls]
    assert set(calls) <= answered, "a tool call was left without a result"
