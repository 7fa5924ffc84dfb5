"""Fault matrix, part 2 (in process, against the strict server): Task.cancel(), StopRun and a
fail-closed exception at every hook; Interrupt and Cancel (through agent.control, from the store)
in every phase. Afterwards no tool call is left without a result (a call that ran keeps its real
result, one in flight says outcome unknown, one never started says not run), the model is never
told a call that ran did not, and a resume (or a new run with the transcript) is accepted by the
strict server, with and without the repair plugin."""

from __future__ import annotations

import pytest

from fault_scenarios import HOOK_FAULTS, HOOKS, PHASES, control_fault, hook_fault
from fsm_agent.store import SQLiteStore


@pytest.mark.parametrize("with_repair", [False, True], ids=["bare", "repair"])
@pytest.mark.parametrize("fault", HOOK_FAULTS)
@pytest.mark.parametrize("hook", HOOKS)
async def test_fault_at_every_hook(tmp_path, hook: str, fault: str, with_repair: bool) -> None:
    db = str(tmp_path / "s.db")
    fig = await hook_fault(lambda: SQLiteStore(db), tmp_path, hook, fault, with_repair, "h1")
    assert fig["rejected"] == 0, fig["rejections"]
    assert fig["open_ok"], fig  # open calls only as the pending actions of a resumable stop
    assert fig["unanswered"] == 0 and fig["lies"] == 0, fig
    assert fig["duplicates"] == 0 and fig["recovered"], fig
    want = {"cancel": "INTERRUPTED", "stoprun": "INTERRUPTED", "error": "FAILED_TERMINAL"}[fault]
    assert fig["stops"][0] == want, fig
    if hook == "wrap_tool_call":  # call_a ran and keeps its result; call_b was cut: outcome unknown
        assert fig["unknown"] == 1 and fig["executions"] == 2, fig
    if hook == "on_tool_call" and fault != "cancel":  # neither call started
        assert fig["not_run"] == 2 and fig["executions"] == 0, fig


@pytest.mark.parametrize("compensate", [True, False], ids=["compensated", "uncompensated"])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kind", ["interrupt", "cancel"])
async def test_interrupt_and_cancel_in_every_phase(tmp_path, kind: str, phase: str, compensate: bool) -> None:
    db = str(tmp_path / "s.db")
    fig = await control_fault(lambda: SQLiteStore(db), tmp_path, kind, phase, compensate, "c1")
    assert fig["rejected"] == 0, fig["rejections"]
    assert fig["unanswered"] == 0 and fig["lies"] == 0 and fig["duplicates"] == 0, fig
    assert fig["recovered"], fig
    if kind == "cancel" and fig["executions"]:  # side effects happened: compensated, or a person confirms
        if compensate:
            assert fig["compensated"] == fig["executions"], fig
        else:
            assert fig["asked_person"] and fig["required"] == "confirm_cancel", fig
