"""Runtime overhead per model call, sessions/s at 200 concurrent sessions, peak RSS and import time:
fsm_agent vs the floor (a hand-written aiohttp + orjson loop), the openai SDK hand loop, LangChain v1
``create_agent`` and pydantic-ai, all against one zero-latency fake server (bench/fake_server.py,
its own process).

The task (DESIGN.md §8): 1 user message, 3 rounds of one tool call, a final answer = 4 model calls.
Runtimes and their pass-through middleware are defined in bench/_runtimes.py.

1. **Import time** — each probe in a fresh interpreter (``-c``), timed inside it around the import
   statements only; probes alternate; one untimed warm-up each; medians.
2. **Overhead per model call** — one long-lived worker process per family of runtimes (fsm_agent's
   four share one, LangChain's three another ...: no family's modules or garbage slow another's), driven in alternating rounds (the order rotates each round) after a
   warm-up round; each round runs ``--tasks`` tasks one after another. Per round:
   ``overhead per call = (worker wall time − server handler time) / model calls``, the server time
   read from the server's ``/stats`` before and after the round; also the worker's CPU time per call
   (less sensitive to other load). Medians over rounds; ratios against the floor of the same run.
   The server's request count is checked: every runtime must make exactly 4 calls per task, and
   every pass-through hook must fire (15 per middleware per task).
   Streaming: each runtime streams and hands every delta to the caller (fsm_agent: an observer;
   LangChain: ``astream(stream_mode="messages")``; pydantic-ai: ``run_stream_events``). The extra
   CPU of a streamed task over a plain one, per SSE event the task received, is reported as
   "stream CPU µs/SSE event".
3. **Sessions/s at 200 concurrent, peak RSS** — for each runtime, alternating rounds, a fresh
   process: warm-up, then waves of 200 sessions started together until ``--conc-seconds`` have
   passed; sessions/s = sessions / elapsed; peak RSS = the process's ``ru_maxrss`` at the end
   (imports + 200 live sessions). The server's CPU share during the waves is shown: near 100 %
   means the server, not the runtime, set the pace (then the figure is a lower bound).

    python bench/bench_overhead.py              # about 4-5 minutes
    python bench/bench_overhead.py --quick      # about 1 minute
    python bench/bench_overhead.py --profile fsm:default [--stream]   # cProfile one runtime's tasks
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # measure the tree this script sits in (fsm_agent, middleware)
sys.path.insert(0, str(HERE))

from _common import machine, median, rotate, say, spread, table, versions, write_results  # noqa: E402

ALL_RUNTIMES = ("floor", "openai-sdk", "fsm:0", "fsm:otel", "fsm:5", "fsm:20", "fsm:default", "langchain:0", "langchain:5",
                "langchain:20", "pydantic-ai:0", "pydantic-ai:5", "pydantic-ai:20")
CONC_RUNTIMES = ("floor", "openai-sdk", "fsm:0", "fsm:default", "langchain:0", "pydantic-ai:0")
QUICK_CONC_RUNTIMES = ("floor", "fsm:default", "langchain:0", "pydantic-ai:0")
PEERS = ("langchain:0", "pydantic-ai:0")

IMPORT_PROBES = (
    ("floor: aiohttp + orjson", "import aiohttp, orjson"),
    ("fsm_agent", "import fsm_agent"),
    ("fsm_agent + chat provider + default middleware + SQLite",
     "import fsm_agent; from fsm_agent.providers.openai_chat import OpenAIChatProvider; "
     "import fsm_agent_middleware.repair, middleware.loop_detection; from fsm_agent.store import SQLiteStore"),
    ("openai", "import openai"),
    ("langchain: create_agent + ChatOpenAI", "from langchain.agents import create_agent; "
     "from langchain_openai import ChatOpenAI"),
    ("pydantic-ai: Agent + OpenAIChatModel", "from pydantic_ai import Agent; "
     "from pydantic_ai.models.openai import OpenAIChatModel; from pydantic_ai.providers.openai import OpenAIProvider"),
)

BUDGET = {"overhead_x_floor": 3.0, "sse_cpu_us": 30.0, "sessions_x_best_peer": 10.0, "rss_x_best_peer": 0.5,
          "import_s": 0.4}


# ================================================================================== helpers
def server_stats(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url + "/stats", timeout=30) as r:
        return json.loads(r.read())


def start_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, str(HERE / "fake_server.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=str(HERE))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        raise RuntimeError(f"fake server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def stop(proc: subprocess.Popen[str]) -> None:
    try:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=10)
    except Exception:  # noqa: BLE001
        proc.kill()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for k in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):
        env.pop(k, None)
    env["LANGSMITH_TRACING"] = "false"
    return env


# ============================================================================ worker processes
async def _worker_main(family: str, base_url: str) -> None:
    """Long-lived latency worker for one family of runtimes (``fsm``, ``langchain`` ...): JSON commands on
    stdin, one JSON answer per line on stdout."""
    import _runtimes

    runtimes: dict[tuple[str, bool], Any] = {}
    loop = asyncio.get_running_loop()
    out = sys.stdout
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        stream, name = bool(cmd["stream"]), cmd["name"]
        try:
            rt = runtimes.get((name, stream))
            if rt is None:
                rt = runtimes[name, stream] = _runtimes.make(name, base_url, stream)
            gc.collect()
            h0, texts_ok, deltas = _runtimes.HOOK_CALLS[0], True, 0
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(cmd["tasks"]):
                text, d = await rt.run_task()
                deltas += d
                texts_ok = texts_ok and text.startswith("Paris is sunny")
            await rt.settle()  # fsm:otel: the round's spans and metrics exported, inside the window
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            reply = {"wall": wall, "cpu": cpu, "hooks": _runtimes.HOOK_CALLS[0] - h0, "deltas": deltas,
                     "text_ok": texts_ok}
        except _runtimes.Unavailable as exc:
            reply = {"unavailable": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator
            reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for rt in runtimes.values():
        await rt.close()


async def _conc_main(name: str, base_url: str, concurrency: int, min_seconds: float, stream: bool) -> dict[str, Any]:
    """Fresh process: warm up, then waves of `concurrency` sessions until `min_seconds` have passed."""
    import _runtimes

    try:
        rt = _runtimes.make(name, base_url, stream)
    except _runtimes.Unavailable as exc:
        return {"unavailable": str(exc)}
    loop = asyncio.get_running_loop()
    for _ in range(2):
        await rt.run_task()
    await asyncio.gather(*(rt.run_task() for _ in range(min(20, concurrency))))
    s0 = await loop.run_in_executor(None, server_stats, base_url)
    gc.collect()
    sessions, c0, t0 = 0, time.process_time(), time.perf_counter()
    while True:
        results = await asyncio.gather(*(rt.run_task() for _ in range(concurrency)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await rt.close()
            return {"error": f"{len(errors)} of {concurrency} sessions failed; first: {type(errors[0]).__name__}: "
                             f"{errors[0]}"}
        sessions += concurrency
        if time.perf_counter() - t0 >= min_seconds:
            break
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    s1 = await loop.run_in_executor(None, server_stats, base_url)
    await rt.close()
    return {"sessions": sessions, "elapsed": elapsed, "sessions_per_s": sessions / elapsed, "cpu": cpu,
            "waves": sessions // concurrency, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "server_cpu_share": (s1["cpu_s"] - s0["cpu_s"]) / elapsed,
            "server_requests": s1["requests"] - s0["requests"]}


def family(name: str) -> str:
    return name.split(":", 1)[0]


class Worker:
    """One process per family of runtimes (fsm:0/5/20/default share one; LangChain's share another ...),
    so that no family's imports and garbage slow another family's runtime."""

    def __init__(self, name: str, base_url: str) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(HERE / "bench_overhead.py"), "--worker", name,
                                      "--base-url", base_url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=str(HERE), env=child_env())
        self.dead: str | None = None

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        if self.dead:
            return {"error": self.dead}
        try:
            self.proc.stdin.write(json.dumps({"cmd": "run", **cmd}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.dead = f"worker {self.name} died (exit code {self.proc.poll()})"
            return {"error": self.dead}
        return json.loads(line)

    def close(self) -> None:
        try:
            assert self.proc.stdin
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=20)
        except Exception:  # noqa: BLE001
            self.proc.kill()


# ============================================================================== phases
def measure_imports(reps: int, warmup: bool = True) -> dict[str, Any]:
    code = ("import time, sys\nt = time.perf_counter()\n{stmt}\nprint(time.perf_counter() - t)\n")
    out: dict[str, Any] = {}
    samples: dict[str, list[float]] = {label: [] for label, _ in IMPORT_PROBES}
    absent: dict[str, str] = {}
    first = 0 if warmup else 1
    for r in range(first, reps + 1):  # round 0 is the warm-up (writes .pyc files, fills the page cache)
        for label, stmt in rotate(list(IMPORT_PROBES), r):
            if label in absent:
                continue
            p = subprocess.run([sys.executable, "-c", code.format(stmt=stmt.replace("; ", "\n"))], capture_output=True,
                               text=True, cwd=str(HERE.parent), env=child_env())
            if p.returncode != 0:
                absent[label] = (p.stderr.strip().splitlines() or ["failed"])[-1]
                continue
            if r:
                samples[label].append(float(p.stdout.strip()))
    for label, _ in IMPORT_PROBES:
        out[label] = {"samples": samples[label], "median_s": median(samples[label]) if samples[label] else None,
                      "absent": absent.get(label)}
    return out


def measure_latency(names: list[str], base_url: str, rounds: int, tasks: int, modes: list[bool],
                    calls_per_task: int, sse_per_task: int) -> dict[str, Any]:
    """Round 0 warms up; in each later round every runtime (in a rotated order) runs ``tasks`` plain
    tasks and ``tasks`` streamed ones back to back (which first alternates), so the two modes of a
    runtime are measured close together and their difference is paired."""
    fams = {family(n): Worker(family(n), base_url) for n in names}
    workers = {n: fams[family(n)] for n in names}
    res: dict[str, Any] = {n: {"plain": [], "stream": [], "absent": None, "error": None} for n in names}
    try:
        for r in range(rounds + 1):  # round 0: warm-up, not recorded
            for n in rotate(names, r):
                for stream in (modes if r % 2 else modes[::-1]):
                    key = "stream" if stream else "plain"
                    if res[n]["absent"] or res[n]["error"]:
                        continue
                    s0 = server_stats(base_url)
                    reply = workers[n].ask(name=n, stream=stream, tasks=tasks if r else max(2, tasks // 2))
                    s1 = server_stats(base_url)
                    if "unavailable" in reply:
                        res[n]["absent"] = reply["unavailable"]
                        say(f"  {n}: ABSENT — {reply['unavailable']}")
                        continue
                    if "error" in reply:
                        res[n]["error"] = reply["error"]
                        say(f"  {n} ({key}): FAILED — {reply['error']}\n{reply.get('trace', '')}")
                        continue
                    if not r:
                        continue
                    reqs = s1["requests"] - s0["requests"]
                    server = s1["handler_s"] - s0["handler_s"]
                    calls = tasks * calls_per_task
                    res[n][key].append({
                        "round": r, "wall_per_task": reply["wall"] / tasks, "server_per_task": server / tasks,
                        "overhead_per_call": (reply["wall"] - server) / calls, "cpu_per_call": reply["cpu"] / calls,
                        "cpu_per_task": reply["cpu"] / tasks, "requests_per_task": reqs / tasks,
                        "hooks_per_task": reply["hooks"] / tasks, "deltas_per_task": reply["deltas"] / tasks,
                        "text_ok": reply["text_ok"], "sse_per_task": sse_per_task if stream else 0})
            say(f"  latency: round {r}/{rounds} done" + (" (warm-up)" if not r else ""))
    finally:
        for w in fams.values():
            w.close()
    return res


def measure_concurrency(names: list[str], base_url: str, rounds: int, concurrency: int, seconds: float,
                        stream: bool) -> dict[str, Any]:
    res: dict[str, Any] = {n: {"runs": [], "absent": None, "error": None} for n in names}
    for r in range(rounds):
        for n in rotate(names, r):
            if res[n]["absent"] or res[n]["error"]:
                continue
            p = subprocess.run([sys.executable, str(HERE / "bench_overhead.py"), "--conc-worker", n, "--base-url",
                                base_url, "--concurrency", str(concurrency), "--conc-seconds", str(seconds)]
                               + (["--stream"] if stream else []), capture_output=True, text=True, cwd=str(HERE),
                               env=child_env(), timeout=600)
            try:
                reply = json.loads(p.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                reply = {"error": f"exit {p.returncode}: {p.stderr.strip()[-500:]}"}
            if "unavailable" in reply:
                res[n]["absent"] = reply["unavailable"]
            elif "error" in reply:
                res[n]["error"] = reply["error"]
                say(f"  {n} (200 concurrent): FAILED — {reply['error']}")
            else:
                res[n]["runs"].append(reply)
                say(f"  concurrency round {r + 1}/{rounds}: {n}: {reply['sessions_per_s']:.1f} sessions/s, "
                    f"peak RSS {reply['peak_rss_mb']:.0f} MB, server CPU {reply['server_cpu_share'] * 100:.0f} %")
    return res


# =============================================================================== report
def ratio(a: float | None, b: float | None) -> str:
    if not a or not b or a != a or b != b:
        return "—"
    return f"{a / b:.2f}×"


def report(data: dict[str, Any], names: list[str], calls_per_task: int) -> list[str]:
    out: list[str] = []
    lat = data["latency"]
    # ---- overhead per call
    rows = []
    summary: dict[str, Any] = {}
    for key in ("plain", "stream"):
        floor = lat.get("floor", {}).get(key) or []
        f_over = median([x["overhead_per_call"] for x in floor]) if floor else None
        f_cpu = median([x["cpu_per_call"] for x in floor]) if floor else None
        for n in names:
            rr = lat[n][key]
            if lat[n]["absent"]:
                rows.append([n, key, "ABSENT", "", "", "", "", "", "", lat[n]["absent"][:60]])
                continue
            if not rr:
                if lat[n]["error"]:
                    rows.append([n, key, "FAILED", "", "", "", "", "", "", lat[n]["error"][:60]])
                continue
            over = median([x["overhead_per_call"] for x in rr])
            cpu = median([x["cpu_per_call"] for x in rr])
            wall = median([x["wall_per_task"] for x in rr])
            reqs = median([x["requests_per_task"] for x in rr])
            hooks = median([x["hooks_per_task"] for x in rr])
            ok = all(x["text_ok"] for x in rr) and abs(reqs - calls_per_task) < 1e-9
            summary.setdefault(n, {})[key] = {"overhead_ms": over * 1e3, "cpu_ms": cpu * 1e3, "wall_task_ms": wall * 1e3,
                                              "spread": spread([x["overhead_per_call"] for x in rr]),
                                              "ratio_vs_floor": over / f_over if f_over else None,
                                              "cpu_ratio_vs_floor": cpu / f_cpu if f_cpu else None, "same_work": ok}
            sp = spread([x["overhead_per_call"] for x in rr])
            rows.append([n, key, over * 1e3, ratio(over, f_over), f"±{sp * 100:.0f}%" if sp == sp else "—",
                         cpu * 1e3, ratio(cpu, f_cpu), wall * 1e3, f"{reqs:g}/{hooks:g}", "ok" if ok else "NOT THE SAME WORK"])
    out.append(table(["runtime", "mode", "overhead ms/call", "vs floor", "±IQR/2", "client CPU ms/call", "CPU vs floor",
                      "wall ms/task", "calls/hooks per task", "check"], rows,
                     title=f"Overhead per model call ((wall − server time) / calls; medians of {data['config']['rounds']} "
                           f"alternating rounds × {data['config']['tasks']} tasks)"))
    # ---- tracing on against off (issue 22: at most +10 % CPU per call)
    rows = []
    for key in ("plain", "stream"):
        on, off = lat.get("fsm:otel", {}).get(key) or [], lat.get("fsm:0", {}).get(key) or []
        off_by_round = {x["round"]: x["cpu_per_call"] for x in off}
        ratios = [x["cpu_per_call"] / off_by_round[x["round"]] for x in on if x["round"] in off_by_round]
        if ratios:
            r = median(ratios)
            summary.setdefault("fsm:otel", {})[f"cpu_vs_fsm0_{key}"] = r
            rows.append([key, median([x["cpu_per_call"] for x in off]) * 1e3, median([x["cpu_per_call"] for x in on]) * 1e3,
                         f"{(r - 1) * 100:+.1f} %", f"±{spread(ratios) * 100:.0f}%", "met" if r <= 1.10 else "MISSED"])
    if rows:
        out.append(table(["mode", "fsm:0 CPU ms/call", "fsm:otel CPU ms/call", "tracing on vs off (median of rounds)",
                          "±IQR/2", "≤ +10 %"], rows,
                         title="Tracing on against off: client CPU per model call, same process, same rounds "
                               "(fsm:otel = fsm:0 + batch OTLP/HTTP export to a loopback sink process)"))
    # ---- streaming CPU per SSE event
    rows = []
    for n in names:
        p, s = lat[n]["plain"], lat[n]["stream"]
        if not p or not s:
            continue
        sse = s[0]["sse_per_task"]
        plain_by_round = {x["round"]: x["cpu_per_task"] for x in p}
        diffs = [x["cpu_per_task"] - plain_by_round[x["round"]] for x in s if x["round"] in plain_by_round]
        extra = median(diffs) / sse
        summary.setdefault(n, {})["stream_cpu_us_per_sse_event"] = extra * 1e6
        summary[n]["deltas_per_task"] = median([x["deltas_per_task"] for x in s])
        rows.append([n, sse, summary[n]["deltas_per_task"], extra * 1e6])
    if rows:
        out.append(table(["runtime", "SSE events/task", "deltas seen by caller/task", "stream CPU µs/SSE event"], rows,
                         title="Streaming: median over rounds of (client CPU per streamed task − per plain task of "
                               "the same round) / SSE events per task"))
    # ---- concurrency
    conc = data.get("concurrency") or {}
    rows = []
    peer_sps = {n: median([x["sessions_per_s"] for x in conc[n]["runs"]]) for n in PEERS if conc.get(n, {}).get("runs")}
    peer_rss = {n: median([x["peak_rss_mb"] for x in conc[n]["runs"]]) for n in PEERS if conc.get(n, {}).get("runs")}
    best_sps = max(peer_sps.values()) if peer_sps else None
    best_rss = min(peer_rss.values()) if peer_rss else None
    f_sps = median([x["sessions_per_s"] for x in conc["floor"]["runs"]]) if conc.get("floor", {}).get("runs") else None
    for n, v in conc.items():
        if v["absent"]:
            rows.append([n, "ABSENT", "", "", "", "", "", v["absent"][:60]])
            continue
        if not v["runs"]:
            rows.append([n, "FAILED", "", "", "", "", "", (v["error"] or "")[:60]])
            continue
        sps = median([x["sessions_per_s"] for x in v["runs"]])
        rss = median([x["peak_rss_mb"] for x in v["runs"]])
        scpu = median([x["server_cpu_share"] for x in v["runs"]])
        summary.setdefault(n, {}).update({"sessions_per_s": sps, "peak_rss_mb": rss})
        rows.append([n, sps, ratio(sps, f_sps), ratio(sps, best_sps), rss, ratio(rss, best_rss), f"{scpu * 100:.0f} %",
                     f"{len(v['runs'])} run(s)"])
    if rows:
        out.append(table(["runtime", "sessions/s", "vs floor", "vs best peer", "peak RSS MB", "RSS vs best peer",
                          "server CPU", "runs"], rows,
                         title=f"{data['config']['concurrency']} concurrent sessions "
                               f"({'streamed' if data['config']['conc_stream'] else 'non-streamed'}; fresh process per "
                               f"run; medians)"))
    # ---- imports
    imp = data.get("imports") or {}
    rows = []
    f_imp = imp.get(IMPORT_PROBES[0][0], {}).get("median_s")
    for label, v in imp.items():
        if v["absent"]:
            rows.append([label, "ABSENT", "", v["absent"][:70]])
        else:
            rows.append([label, v["median_s"], ratio(v["median_s"], f_imp), f"{len(v['samples'])} fresh interpreter(s)"])
    if rows:
        out.append(table(["import", "seconds", "vs floor", "note"], rows, title="Import time (medians)"))
    # ---- budget
    rows = []
    fd = summary.get("fsm:default", {})
    for key in ("plain", "stream"):
        x = fd.get(key, {}).get("ratio_vs_floor")
        rows.append([f"overhead/call, default middleware + SQLite, {key}", f"≤ {BUDGET['overhead_x_floor']:g}× floor",
                     f"{x:.2f}× floor" if x else "—", "—" if x is None else ("met" if x <= BUDGET["overhead_x_floor"] else "MISSED")])
    x = fd.get("stream_cpu_us_per_sse_event")
    rows.append(["CPU per streamed SSE event (fsm:default, in the runtime)", f"≤ {BUDGET['sse_cpu_us']:g} µs",
                 f"{x:.1f} µs" if x is not None else "—", "—" if x is None else ("met" if x <= BUDGET["sse_cpu_us"] else "MISSED")])
    sps = fd.get("sessions_per_s")
    if sps and best_sps:
        rows.append([f"sessions/s at {data['config']['concurrency']} concurrent (fsm:default)",
                     f"≥ {BUDGET['sessions_x_best_peer']:g}× best peer", f"{sps / best_sps:.1f}× ({sps:.0f} vs {best_sps:.0f})",
                     "met" if sps / best_sps >= BUDGET["sessions_x_best_peer"] else "MISSED"])
    rss = fd.get("peak_rss_mb")
    if rss and best_rss:
        rows.append(["peak RSS (fsm:default)", f"≤ {BUDGET['rss_x_best_peer']:g}× best peer",
                     f"{rss / best_rss:.2f}× ({rss:.0f} vs {best_rss:.0f} MB)",
                     "met" if rss / best_rss <= BUDGET["rss_x_best_peer"] else "MISSED"])
    x = imp.get("fsm_agent", {}).get("median_s")
    if x:
        rows.append(["import fsm_agent", f"≤ {BUDGET['import_s']:g} s (2× DESIGN's 0.20 s floor)",
                     f"{x:.2f} s ({ratio(x, f_imp)} this run's floor)", "met" if x <= BUDGET["import_s"] else "MISSED"])
    out.append(table(["DESIGN §8 budget", "target", "this run", "verdict"], rows, title="Budget check (this run)"))
    data["summary"] = summary
    return out


# =============================================================================== profile
def _group(path: str, func: str) -> str:
    """A coarse owner for a profiled function: fsm_agent module, repo middleware, third-party package,
    stdlib package, or (for C functions) what the call does."""
    if path == "~":
        f = func
        if "sqlite3" in f:
            return "sqlite3 (C)"
        if "socket" in f or "epoll" in f or "select" in f:
            return "socket / epoll (C)" if "epoll" not in f else "epoll wait (idle: server time)"
        if "urandom" in f:
            return "os.urandom (uuid4)"
        if "orjson" in f:
            return "orjson (C)"
        return "builtins (C)"
    p = path.replace("\\", "/")
    repo = str(HERE.parent).replace("\\", "/") + "/"
    if p.startswith(repo):  # this tree: fsm_agent/…, middleware/…, bench/…
        return p[len(repo):].rsplit(".py", 1)[0]
    if "site-packages/" in p:
        return p.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    if "/lib/python3" in p:
        rest = p.split("/lib/python3", 1)[1].split("/", 1)[1]
        return "stdlib " + rest.split("/", 1)[0].removesuffix(".py")
    return p


def by_package(st: Any, tasks: int) -> str:
    """Own (tottime) profile time summed by owner, per task."""
    totals: dict[str, float] = {}
    for (path, _line, func), (_cc, _nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        g = _group(path, func)
        totals[g] = totals.get(g, 0.0) + tt
    total = sum(totals.values())
    rows = [[g, t / tasks * 1e3, f"{t / total * 100:.1f} %"] for g, t in sorted(totals.items(), key=lambda kv: -kv[1])[:30]]
    return table(["owner", "own ms/task (under cProfile)", "share"], rows, title="Own time by owner")


async def _profile(name: str, stream: bool, tasks: int, concurrency: int) -> None:
    """cProfile ``tasks`` sequential tasks of ``name`` (``concurrency`` 1), or ``tasks`` tasks run
    ``concurrency`` at a time."""
    import cProfile
    import pstats

    import _runtimes

    server, base = start_server()
    try:
        rt = _runtimes.make(name, base, stream)
        for _ in range(3):
            await rt.run_task()
        prof = cProfile.Profile()
        gc.disable()  # with the collector on, cProfile charges its pauses to whatever was running
        t0 = time.perf_counter()
        prof.enable()
        done = 0
        while done < tasks:
            n = min(concurrency, tasks - done)
            if n == 1:
                await rt.run_task()
            else:
                await asyncio.gather(*(rt.run_task() for _ in range(n)))
            done += n
        prof.disable()
        wall = time.perf_counter() - t0
        gc.enable()
        await rt.close()
        st = pstats.Stats(prof)
        say(by_package(st, tasks))
        say(f"cProfile of {tasks} tasks of {name} ({'stream' if stream else 'plain'}, {concurrency} at a time): "
            f"{wall / tasks * 1e3:.1f} ms/task under the profiler; sorted by own time:")
        st.sort_stats("tottime").print_stats(35)
        say("sorted by cumulative time:")
        st.sort_stats("cumulative").print_stats(45)
    finally:
        stop(server)


# ================================================================================== main
def main() -> int:
    ap = argparse.ArgumentParser(description="Per-call overhead, 200-session throughput, RSS and import time")
    ap.add_argument("--quick", action="store_true", help="a short run (about 1 minute)")
    ap.add_argument("--runtimes", help=f"comma-separated subset of: {', '.join(ALL_RUNTIMES)}")
    ap.add_argument("--rounds", type=int, help="latency rounds after a warm-up round (default 7; --quick 2)")
    ap.add_argument("--tasks", type=int, help="tasks per runtime per mode per latency round (default 6; --quick 2)")
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--conc-seconds", type=float, help="least seconds of waves per concurrency run (default 2; --quick 1)")
    ap.add_argument("--conc-rounds", type=int, help="concurrency rounds per runtime (default 2; --quick 1)")
    ap.add_argument("--conc-stream", action="store_true", help="stream in the concurrency phase")
    ap.add_argument("--import-reps", type=int, help="fresh interpreters per import probe (default 5 after a warm-up one; --quick 1, no warm-up)")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: imports,latency,stream,concurrency")
    ap.add_argument("--profile", metavar="RUNTIME",
                    help="cProfile RUNTIME's tasks instead of benchmarking (--tasks N, default 50; --stream; "
                         "--concurrency C to run them C at a time)")
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--conc-worker", help=argparse.SUPPRESS)
    ap.add_argument("--base-url", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        asyncio.run(_worker_main(args.worker, args.base_url))
        return 0
    if args.conc_worker:
        try:
            r = asyncio.run(_conc_main(args.conc_worker, args.base_url, args.concurrency, args.conc_seconds or 2.0,
                                       args.stream))
        except Exception as exc:  # noqa: BLE001
            r = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(r), flush=True)
        return 0
    if args.profile:
        asyncio.run(_profile(args.profile, args.stream, args.tasks or 50,
                             args.concurrency if "--concurrency" in sys.argv else 1))
        return 0

    q = args.quick
    rounds = args.rounds or (2 if q else 7)
    tasks = args.tasks or (2 if q else 6)
    conc_rounds = args.conc_rounds or (1 if q else 2)
    conc_seconds = args.conc_seconds or (1.0 if q else 2.0)
    import_reps = args.import_reps or (1 if q else 5)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    names = [n.strip() for n in args.runtimes.split(",")] if args.runtimes else list(ALL_RUNTIMES)
    if "floor" not in names:
        names.insert(0, "floor")

    import fake_server

    data: dict[str, Any] = {"machine": machine(), "versions": versions(), "config": {
        "rounds": rounds, "tasks": tasks, "concurrency": args.concurrency, "conc_rounds": conc_rounds,
        "conc_seconds": conc_seconds, "conc_stream": args.conc_stream, "import_reps": import_reps,
        "calls_per_task": fake_server.CALLS_PER_TASK, "sse_events_per_streamed_task": fake_server.SSE_EVENTS_PER_TASK,
        "runtimes": names}, "budget": BUDGET}
    say(f"bench_overhead on {data['machine']['cpus']} CPUs, load average {data['machine']['loadavg_at_start']} at start; "
        f"runtimes: {', '.join(names)}")
    if not ("imports" in skip):
        t = time.perf_counter()
        say("imports ...")
        data["imports"] = measure_imports(import_reps, warmup=not q)
        say(f"  imports took {time.perf_counter() - t:.0f} s")
    server, base = start_server()
    try:
        if "latency" not in skip:
            modes = [False] + ([] if "stream" in skip else [True])
            say(f"latency: {rounds} rounds × {tasks} tasks per runtime per mode ...")
            t = time.perf_counter()
            data["latency"] = measure_latency(names, base, rounds, tasks, modes, fake_server.CALLS_PER_TASK,
                                              fake_server.SSE_EVENTS_PER_TASK)
            say(f"  latency took {time.perf_counter() - t:.0f} s")
        else:
            data["latency"] = {n: {"plain": [], "stream": [], "absent": None, "error": None} for n in names}
        if "concurrency" not in skip:
            cn = [n for n in (QUICK_CONC_RUNTIMES if q else CONC_RUNTIMES) if n in names]
            say(f"concurrency: {args.concurrency} concurrent sessions, ≥ {conc_seconds:g} s per run, {conc_rounds} round(s) ...")
            t = time.perf_counter()
            data["concurrency"] = measure_concurrency(cn, base, conc_rounds, args.concurrency, conc_seconds,
                                                      args.conc_stream)
            say(f"  concurrency took {time.perf_counter() - t:.0f} s")
        stats = server_stats(base)
        data["server_bad_requests"] = stats["bad"]
    finally:
        stop(server)
    data["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    for t in report(data, names, fake_server.CALLS_PER_TASK):
        say(t)
    say(f"\nload average at start {data['machine']['loadavg_at_start']}, at end {data['machine']['loadavg_at_end']} "
        f"on {data['machine']['cpus']} CPUs: a shared, noisy machine; trust ratios of the same run over absolute figures.")
    path = write_results("overhead", data)
    say(f"results: {path}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    if not any(a in sys.argv for a in ("--worker", "--conc-worker")):
        print(f"(bench_overhead took {time.perf_counter() - t0:.0f} s)")
    sys.exit(rc)
