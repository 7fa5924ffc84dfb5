"""Fault matrix, part 3: failing store writes. FaultyStore fails the write that carries each ledger
status (before it is stored, and after: a lost acknowledgement); lease renewal fails for longer
than 2/3 of the TTL; peek_controls fails transiently; and one real full disk (a small tmpfs)."""

from __future__ import annotations

import subprocess

import pytest

from mounts import mount_or_skip

from fault_scenarios import STORE_WRITE_STATUSES, full_disk, lease_fault, peek_fault, store_write_fault
from fsm_agent.store import SQLiteStore


@pytest.mark.parametrize("after_commit", [False, True], ids=["not-stored", "lost-ack"])
@pytest.mark.parametrize("status", STORE_WRITE_STATUSES)
async def test_failed_ledger_write_ends_failed_retryable_and_resumes(tmp_path, status: str, after_commit: bool) -> None:
    db = str(tmp_path / "s.db")
    fig = await store_write_fault(lambda: SQLiteStore(db), tmp_path, status, after_commit, "w1")
    assert fig["fired"] == 1, fig
    assert fig["typed_error"], fig["error"]
    assert fig["rejected"] == 0 and fig["unanswered"] == 0 and fig["lies"] == 0, fig
    assert fig["duplicates"] == 0 and fig["executions"] == 1 and fig["recovered"], fig


async def test_lease_renewal_failing_stops_driving_before_it_expires_and_another_worker_finishes(tmp_path) -> None:
    db = str(tmp_path / "s.db")
    fig = await lease_fault(lambda: SQLiteStore(db), tmp_path, "l1")
    assert fig["stops"][0] == "FAILED_RETRYABLE" and fig["error_kind"] == "lease", fig
    assert fig["stopped_after"] < fig["ttl"], fig  # stopped driving before the lease could expire
    assert fig["duplicates"] == 0 and fig["executions"] == 1, fig
    assert fig["rejected"] == 0 and fig["unanswered"] == 0 and fig["lies"] == 0 and fig["recovered"], fig


async def test_transient_peek_failures_do_not_kill_the_watcher(tmp_path) -> None:
    db = str(tmp_path / "s.db")
    fig = await peek_fault(lambda: SQLiteStore(db), tmp_path, "p1")
    assert fig["peek_failures"] > 0, fig
    assert fig["stops"] == ["INTERRUPTED", "COMPLETED"] and fig["reacted_s"] < 2, fig
    assert fig["rejected"] == 0 and fig["unanswered"] == 0 and fig["recovered"], fig


_mount = mount_or_skip


async def test_real_full_disk_fails_retryable_with_the_path_and_resumes_after_space_is_freed(tmp_path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    _mount("-t", "tmpfs", "-o", "size=640k", "tmpfs", str(mnt))
    try:
        fig = await full_disk(mnt, tmp_path, "d1",
                              lambda: subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    assert fig["stops"][0] == "FAILED_RETRYABLE" and fig["typed_error"], fig["error"]
    assert fig["rejected"] == 0 and fig["unanswered"] == 0 and fig["recovered"], fig
