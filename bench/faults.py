"""Fault injection figures: the scenarios of tests/test_faults_*.py, repeated, as one table.

Every run drives the real OpenAI HTTP provider against the strict scripted server
(fsm_agent.testing.strict: HTTP 400 for an unpaired tool call, a prefill ...), for the run and
for every resume. Columns: runs; duplicates (extra executions of a side_effect call); reruns
(extra executions of pure / idempotent calls, allowed); unanswered (tool calls without exactly one
result in the final transcript); lies (results telling the model a call that ran did not);
rejected (requests refused by the strict server); recovered (runs that reached the documented end:
COMPLETED after resumes, CANCELLED for a cancel).

    python bench/faults.py                 # 25 random SIGKILL cells per store, every other scenario x3
    python bench/faults.py --kills 5 --repeat 1 --no-postgres
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from _common import machine, say, table, write_results  # noqa: E402
from fault_scenarios import (  # noqa: E402
    APPROVALS, HOOK_FAULTS, HOOKS, KILL_POINTS, PHASES, STORE_WRITE_STATUSES, control_fault, full_disk, hook_fault,
    kill_cell, lease_fault, peek_fault, sigterm_embedded, store_write_fault)
from faults_common import EFFECTS  # noqa: E402

from fsm_agent.store import PostgresStore, SQLiteStore  # noqa: E402


def start_postgres() -> tuple[str, Callable[[], None]] | None:
    """A throwaway cluster as tests/conftest.py starts one; ``None`` when PostgreSQL is not installed."""
    import glob
    import os

    from fsm_agent.local import free_port

    def find(name: str) -> str | None:
        return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)

    initdb, pg_ctl = find("initdb"), find("pg_ctl")
    if not initdb or not pg_ctl:
        return None
    root = tempfile.mkdtemp(prefix="fsm-pg-", dir="/tmp")
    os.chmod(root, 0o755)
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port, data = free_port(), os.path.join(root, "data")
    subprocess.run([*as_user, initdb, "-D", data, "-A", "trust", "-U", "fsm", "--no-sync"], check=True, capture_output=True)
    subprocess.run([*as_user, pg_ctl, "-D", data, "-w", "-l", os.path.join(root, "log"), "-o",
                    f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start"], check=True,
                   capture_output=True)

    def stop() -> None:
        subprocess.run([*as_user, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)

    return f"postgresql://fsm@127.0.0.1:{port}", stop


def new_pg_db(base: str) -> str:
    import uuid

    name = "f_" + uuid.uuid4().hex[:12]
    psql = shutil.which("psql") or "psql"
    subprocess.run([psql, f"{base}/postgres", "-q", "-c", f"CREATE DATABASE {name}"], check=True, capture_output=True)
    return f"{base}/{name}"


class Tally:
    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}

    def add(self, scenario: str, fig: dict[str, Any] | None, error: str | None = None) -> None:
        r = self.rows.setdefault(scenario, {"runs": 0, "duplicates": 0, "reruns": 0, "unanswered": 0, "lies": 0,
                                            "rejected": 0, "recovered": 0, "errors": []})
        r["runs"] += 1
        if fig is None:
            r["errors"].append(error)
            return
        for k in ("duplicates", "reruns", "unanswered", "lies", "rejected"):
            r[k] += fig[k]
        r["recovered"] += bool(fig["recovered"])


async def guarded(tally: Tally, scenario: str, run: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    try:
        tally.add(scenario, await run())
    except Exception as exc:  # noqa: BLE001 - a crash of the scenario is a figure too
        tally.add(scenario, None, f"{type(exc).__name__}: {exc}")


async def main(args: argparse.Namespace) -> None:
    tally = Tally()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="fsm-faults-"))
    pg = None if args.no_postgres else start_postgres()
    n = 0

    def nid(prefix: str) -> str:
        nonlocal n
        n += 1
        return f"{prefix}{n}"

    started = time.monotonic()
    try:
        backends = [("sqlite", None)] + ([("postgres", pg[0])] if pg else [])
        for name, base in backends:
            for _ in range(args.kills):
                point, approval, effect = rng.choice(KILL_POINTS), rng.choice(APPROVALS), rng.choice(EFFECTS)
                sid = nid("k")
                url = str(work / f"{sid}.db") if base is None else new_pg_db(base)
                make = (lambda u=url: SQLiteStore(u)) if base is None else (lambda u=url: PostgresStore(u))
                await guarded(tally, f"SIGKILL at a random ledger step, {name} ({effect})",
                              lambda: kill_cell(make, url, work, effect, approval, point, sid))
        for _ in range(args.repeat):
            for hook in HOOKS:
                for fault in HOOK_FAULTS:
                    for rep in (False, True):
                        sid = nid("h")
                        db = str(work / f"{sid}.db")
                        await guarded(tally, f"{fault} at a hook ({len(HOOKS)} hooks, ± repair)",
                                      lambda: hook_fault(lambda: SQLiteStore(db), work, hook, fault, rep, sid))
            for kind in ("interrupt", "cancel"):
                for phase in PHASES:
                    for comp in (True, False):
                        sid = nid("c")
                        db = str(work / f"{sid}.db")
                        await guarded(tally, f"{kind} in every phase (± compensation)",
                                      lambda: control_fault(lambda: SQLiteStore(db), work, kind, phase, comp, sid))
            for status in STORE_WRITE_STATUSES:
                for lost in (False, True):
                    sid = nid("w")
                    db = str(work / f"{sid}.db")
                    await guarded(tally, "failed ledger write (each status, ± lost ack)",
                                  lambda: store_write_fault(lambda: SQLiteStore(db), work, status, lost, sid))
            sid = nid("l")
            db = str(work / f"{sid}.db")
            await guarded(tally, "lease renewal failing > 2/3 TTL, another worker takes over",
                          lambda: lease_fault(lambda: SQLiteStore(db), work, sid))
            sid = nid("p")
            db = str(work / f"{sid}.db")
            await guarded(tally, "transient peek_controls failures, then Interrupt",
                          lambda: peek_fault(lambda: SQLiteStore(db), work, sid))
            for phase in PHASES:
                sid = nid("t")
                await guarded(tally, "SIGTERM in every phase (drain_on_signals)",
                              lambda: sigterm_embedded(work, phase, sid))
            mnt = work / nid("disk")
            mnt.mkdir()
            if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(mnt)],
                              capture_output=True).returncode == 0:
                try:
                    await guarded(tally, "real full disk (tmpfs), space freed, resume",
                                  lambda: full_disk(mnt, work, "d", lambda: subprocess.run(
                                      ["mount", "-o", "remount,size=64m", str(mnt)], check=True)))
                finally:
                    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
            else:
                say("full disk: skipped (mounting a tmpfs needs root)")
    finally:
        if pg:
            pg[1]()
        shutil.rmtree(work, ignore_errors=True)
    rows = [(s, r["runs"], r["duplicates"], r["unanswered"], r["rejected"], r["lies"], r["reruns"],
             f"{r['recovered']}/{r['runs']}") for s, r in tally.rows.items()]
    say(table(["scenario", "runs", "duplicates", "unanswered calls", "rejected requests", "lies", "reruns (allowed)",
               "recovered"], rows, title=f"Fault injection ({time.monotonic() - started:.0f} s)"))
    for s, r in tally.rows.items():
        for e in r["errors"]:
            say(f"  error in {s}: {e}")
    path = write_results("faults", {"machine": machine(), "args": vars(args), "rows": tally.rows})
    say(f"\nresults: {path}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=25, help="random SIGKILL cells per store (default 25)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of every other scenario (default 3)")
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--no-postgres", action="store_true")
    asyncio.run(main(p.parse_args()))
