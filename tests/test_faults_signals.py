"""Fault matrix, part 4: SIGTERM in every phase to an embedding process that opted in with
``async with agent.drain_on_signals()``: it ends INTERRUPTED with its lease released and is
resumed at once, against the strict server (``fsm-agent run`` itself: tests/test_cli_signals.py)."""

from __future__ import annotations

import pytest

from fault_scenarios import PHASES, sigterm_embedded


@pytest.mark.parametrize("phase", PHASES)
async def test_sigterm_in_every_phase_drains_an_embedding_process(tmp_path, phase: str) -> None:
    fig = await sigterm_embedded(tmp_path, phase, "t1")
    assert fig["exit"] == 0 and fig["stops"][0] == "INTERRUPTED", fig
    assert fig["lease_released"], fig
    assert fig["rejected"] == 0 and fig["unanswered"] == 0 and fig["lies"] == 0 and fig["duplicates"] == 0, fig
    assert fig["recovered"], fig
