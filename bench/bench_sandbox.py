"""CodeAct sandboxes: start-up and per-call time, against plain ``python3 -I`` with no isolation.

Runtimes, each on this machine's ``/usr/bin/python3``:

* ``python3 -I`` — the floor: ``asyncio.create_subprocess_exec`` of ``python3 -I -c CODE``, output
  read through pipes, no isolation at all;
* ``subprocess`` — :class:`fsm_agent.sandbox.SubprocessSandbox` (setpriv to a dedicated uid, prlimit,
  the runner loads the seccomp filter, the work dir made and diffed);
* ``bubblewrap`` — :class:`fsm_agent.sandbox.BubblewrapSandbox` (setpriv, bwrap namespaces with
  seccomp, prlimit, the same runner and work dir);
* ``smolagents`` — its ``LocalPythonExecutor`` (an AST interpreter in the calling process, no
  isolation), when installed in the interpreter running this script; otherwise reported ABSENT.

Measured, in alternating rounds (the order rotates each round), medians over rounds:

* **start-up**: a new sandbox object's ``start()`` (its self-test run inside the sandbox, the bwrap
  feature probe, the seccomp program compiled by pyseccomp) — what a process pays before its first
  call; for the floor, one call;
* **per call**: ``run(code)`` for a trivial cell (``1 + 1``) and a CPU cell (a sum over 10^6
  squares), each ``--calls`` times in a row;
* **calls/s at concurrency 4**: 4 callers at once for ``--calls`` calls each (the sandboxes' uid
  pool holds 4 uids, so no call waits for a uid).

Run as root with the project's venv (it has pyseccomp; the sandboxes refuse to run without the
filter):

    .venv/bin/python bench/bench_sandbox.py            # 7 rounds × 10 calls
    .venv/bin/python bench/bench_sandbox.py --quick    # 3 rounds × 5 calls

Prints markdown tables and writes ``bench/results/sandbox-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # measure the tree this script sits in
sys.path.insert(0, str(HERE))

from _common import machine, median, rotate, say, spread, table, versions, write_results  # noqa: E402

from fsm_agent.sandbox import BubblewrapSandbox, Limits, SubprocessSandbox  # noqa: E402
from fsm_agent.sandbox import _seccomp, bubblewrap  # noqa: E402

PYTHON = "/usr/bin/python3"
TRIVIAL = "1 + 1"
CPU = "sum(i * i for i in range(1_000_000))"
UIDS = range(2_100_200_000, 2_100_200_008)

Runner = Callable[[str], Awaitable[Any]]


async def floor_run(code: str) -> Any:
    proc = await asyncio.create_subprocess_exec(PYTHON, "-I", "-c", f"print(repr({code}))",
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env={"PATH": "/usr/bin:/bin"})
    out, _ = await proc.communicate()
    return out


def smolagents_runner() -> tuple[Callable[[], Runner] | None, str]:
    try:
        from smolagents.local_python_executor import LocalPythonExecutor  # type: ignore[import-not-found]
    except ImportError as exc:
        return None, f"ABSENT — {exc}"

    def make() -> Runner:
        ex = LocalPythonExecutor(additional_authorized_imports=[])
        ex.send_tools({})

        async def run(code: str) -> Any:
            return ex(code)

        return run

    return make, "present"


class Bench:
    def __init__(self, workdir_root: str) -> None:
        self.root = workdir_root
        self.boxes: dict[str, Any] = {}

    def new(self, name: str) -> Any:
        if name == "subprocess":
            return SubprocessSandbox(uids=UIDS[4:], workdir_root=self.root, limits=Limits(wall_seconds=60))
        return BubblewrapSandbox(uids=UIDS[:4], workdir_root=self.root, limits=Limits(wall_seconds=60))

    async def startup(self, name: str) -> float:
        if name == "python3 -I":
            t0 = time.perf_counter()
            await floor_run(TRIVIAL)
            return time.perf_counter() - t0
        _seccomp._compile.cache_clear()  # what a fresh process pays
        bubblewrap._bwrap_features.cache_clear()
        box = self.new(name)
        t0 = time.perf_counter()
        await box.start()
        took = time.perf_counter() - t0
        self.boxes[name] = box
        return took

    def runner(self, name: str, smol: Callable[[], Runner] | None) -> Runner:
        if name == "python3 -I":
            return floor_run
        if name == "smolagents":
            assert smol is not None
            return smol()
        box = self.boxes[name]

        async def run(code: str) -> Any:
            r = await box.run(code)
            if not r.ok:
                raise RuntimeError(f"{name}: {r}")
            return r.return_value

        return run


async def per_call(run: Runner, code: str, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await run(code)
        times.append(time.perf_counter() - t0)
    return times


async def concurrent(run: Runner, calls: int, width: int = 4) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(per_call(run, TRIVIAL, calls) for _ in range(width)))
    return width * calls / (time.perf_counter() - t0)


async def main_async(args: argparse.Namespace) -> int:
    facts = machine()
    smol, smol_state = smolagents_runner()
    names = ["python3 -I", "subprocess", "bubblewrap"] + (["smolagents"] if smol else [])
    if not shutil.which("bwrap"):
        names.remove("bubblewrap")
        say("bubblewrap: ABSENT — bwrap is not installed")
    say(f"# sandbox start-up and per-call time: {args.rounds} rounds × {args.calls} calls; smolagents {smol_state}; "
        f"root={os.geteuid() == 0}; load average at start {facts['loadavg_at_start']}")
    root = tempfile.mkdtemp(prefix="fsm-bench-sandbox-", dir="/tmp")
    os.chmod(root, 0o755)
    bench = Bench(root)
    rows: list[dict[str, Any]] = []
    try:
        for name in names:  # warm-up: binaries and the interpreter in the page cache
            if name not in ("python3 -I", "smolagents"):
                await bench.startup(name)
            await per_call(bench.runner(name, smol), TRIVIAL, 2)
        for r in range(args.rounds):
            for name in rotate(names, r):
                row: dict[str, Any] = {"round": r, "runtime": name}
                row["startup_s"] = None if name == "smolagents" else await bench.startup(name)
                run = bench.runner(name, smol)
                row["trivial_s"] = median(await per_call(run, TRIVIAL, args.calls))
                row["cpu_s"] = median(await per_call(run, CPU, args.calls))
                row["calls_per_s_c4"] = await concurrent(run, args.calls)
                rows.append(row)
                say(f"  round {r} {name:<11} start-up {row['startup_s'] or 0:.3f} s, trivial {row['trivial_s'] * 1e3:.1f} "
                    f"ms, cpu cell {row['cpu_s'] * 1e3:.1f} ms, {row['calls_per_s_c4']:.1f} calls/s at 4")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    summary = []
    floor = {k: median([x[k] for x in rows if x["runtime"] == "python3 -I"]) for k in
             ("startup_s", "trivial_s", "cpu_s", "calls_per_s_c4")}
    for name in names:
        sel = [x for x in rows if x["runtime"] == name]
        s: dict[str, Any] = {"runtime": name}
        for k in ("startup_s", "trivial_s", "cpu_s", "calls_per_s_c4"):
            vals = [x[k] for x in sel if x[k] is not None]
            s[k] = median(vals) if vals else None
            s[k + "_spread"] = spread(vals) if vals else None
        s["trivial_ratio"] = s["trivial_s"] / floor["trivial_s"]
        s["cpu_ratio"] = s["cpu_s"] / floor["cpu_s"]
        s["startup_ratio"] = s["startup_s"] / floor["startup_s"] if s["startup_s"] else None
        s["throughput_ratio"] = s["calls_per_s_c4"] / floor["calls_per_s_c4"]
        summary.append(s)
    load_end = [round(x, 2) for x in os.getloadavg()]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    print(table(["runtime", "start-up ms", "× floor", "per call ms (1 + 1)", "× floor", "per call ms (10^6 squares)",
                 "× floor", "calls/s at 4", "× floor"],
                [[s["runtime"], ms(s["startup_s"]), s["startup_ratio"], ms(s["trivial_s"]), s["trivial_ratio"],
                  ms(s["cpu_s"]), s["cpu_ratio"], s["calls_per_s_c4"], s["throughput_ratio"]] for s in summary],
                title=f"sandbox cost against plain python3 -I (medians of {args.rounds} rounds × {args.calls} calls; "
                      f"load average {facts['loadavg_at_start']} → {load_end})"))
    if not smol:
        say(f"\nsmolagents' LocalPythonExecutor: {smol_state} (not measured)")
    path = write_results("sandbox", {"machine": facts, "loadavg_at_end": load_end,
                                     "versions": versions(("fsm-agent", "pyseccomp", "smolagents")),
                                     "bwrap": bubblewrap._bwrap_features(shutil.which("bwrap") or "")[0],
                                     "args": vars(args), "summary": summary, "rounds": rows})
    say(f"results: {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="calls per measurement")
    ap.add_argument("--quick", action="store_true", help="3 rounds × 5 calls: checks that it runs; do not cite")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls = 3, 5
    if os.geteuid() != 0:
        say("not root: the sandboxes cannot switch to their dedicated uids, and refuse to run by default")
        return 2
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
