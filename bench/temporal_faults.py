"""The fault campaign on Temporal (issue 21): real processes, SIGKILL at random points, counted effects.

A dev server on a file, two worker processes (``fsm-agent worker --temporal``), a strict scripted
model server on loopback (streamed answers, so a kill can land inside a model call), and tools of
each declared effect that append what they did to an fsync'd file (bench/_temporal_agent.py). For
each effect kind, sessions run while a killer SIGKILLs a worker at random moments (inside a model
call, inside a tool, between steps, inside an approval wait) and starts a new one; halfway through,
the Temporal server itself is restarted. The harness plays the person: it approves calls that ask,
and answers a call whose outcome is unknown (it checks the effects file, as an operator would).

Counted per kind: kills; sessions; sessions that never reached a stop (lost); effects per call.
Expected: a ``side_effect`` call ran exactly once, or ended "outcome unknown" and a person was
told (then it ran at most once); an ``idempotent`` call ran with one key; 0 lost sessions.

    python bench/temporal_faults.py                    # 25+ kills per kind (about 10-15 minutes)
    python bench/temporal_faults.py --kills 4 --sessions 6   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

AGENT = "bench._temporal_agent:agent"
KINDS = {"pure": "act_pure", "idempotent": "act_idem", "side_effect": "act_side"}


def model_script(messages: list[dict[str, Any]]) -> Any:
    """The model: the task names the tool and its number; after the tool's result, an answer."""
    from fsm_agent.testing.strict import calls, text

    user = next(m for m in messages if m.get("role") == "user")
    task = user["content"] if isinstance(user["content"], str) else user["content"][0]["text"]
    name, n = task.split()[1], int(task.split()[2])
    if any(m.get("role") == "assistant" for m in messages):
        return text(f"finished {name} {n}", pieces=6, chunk_delay=0.05)
    return calls((f"call_{n}", name, {"n": n}), delay=0.1)


class Workers:
    """Two worker processes; SIGKILL one and start another."""

    def __init__(self, env: dict[str, str], target: str, queue: str, n: int = 2) -> None:
        self.env, self.target, self.queue = env, target, queue
        self.procs = [self._start() for _ in range(n)]
        self.kills = 0

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "fsm_agent.cli", "worker", "--temporal", self.target,
                                 "--task-queue", self.queue, "--agent", AGENT], env=self.env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill_one(self) -> None:
        i = random.randrange(len(self.procs))
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait()
        self.kills += 1
        self.procs[i] = self._start()

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


async def drive(agent: Any, sid: str, task: str, told: set[str], effects: Path) -> str:
    """Run a session to its end, playing the person; returns its final stop reason."""
    from fsm_agent import Decision, StopReason

    result = await agent.run(task, session_id=sid)
    for _ in range(20):
        stop = result.stop
        if stop.reason is StopReason.WAITING_HUMAN:
            decisions = {}
            for p in stop.pending_actions:
                if p.reason == "unknown_outcome":
                    told.add(f"{sid}/{p.call.id}")
                    ran = any(e["session"] == sid and e["call"] == p.call.id for e in read_effects(effects))
                    decisions[p.call.id] = Decision.respond("it ran (checked by the operator)" if ran else
                                                            "it did not run; not retried (checked by the operator)")
                else:
                    await asyncio.sleep(random.uniform(0, 1.0))  # a kill may land inside the wait
                    decisions[p.call.id] = Decision.approve()
            result = await agent.resume(sid, decisions=decisions)
        elif stop.reason in (StopReason.INTERRUPTED, StopReason.FAILED_RETRYABLE):
            result = await agent.resume(sid)
        elif stop.reason is StopReason.PAUSED_BUDGET:
            result = await agent.resume(sid, max_iterations=12)
        else:
            return stop.reason.value
    return result.stop.reason.value


def read_effects(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


async def campaign(kind: str, *, kills: int, sessions: int, workdir: Path, heartbeat: float) -> dict[str, Any]:
    from temporalio.client import Client

    from fsm_agent.temporal import TemporalHost, Timeouts
    from fsm_agent.temporal.devserver import DevServer
    from fsm_agent.testing.strict import StrictServer

    server = DevServer(db=str(workdir / f"temporal-{kind}.db"))
    server.start()
    model = StrictServer(model_script)
    base = await model.start()
    effects = workdir / f"effects-{kind}.jsonl"
    env = {**os.environ, "FAULTS_MODEL_URL": base, "FAULTS_EFFECTS": str(effects),
           "FAULTS_STORE": str(workdir / f"store-{kind}.db"), "PYTHONPATH": str(ROOT)}
    os.environ.update({k: env[k] for k in ("FAULTS_MODEL_URL", "FAULTS_EFFECTS", "FAULTS_STORE")})
    queue = f"faults-{kind}-{os.getpid()}"
    workers = Workers(env, server.target, queue)
    import importlib

    agent_module = importlib.import_module("bench._temporal_agent")
    client_agent = agent_module.agent()
    client = await Client.connect(server.target)
    client_agent.host = TemporalHost(client, agent_name=AGENT, task_queue=queue,
                                     timeouts=Timeouts(heartbeat=heartbeat, model_call=60, tool=30))
    told: set[str] = set()
    stops: Counter[str] = Counter()
    lost = 0
    started = time.monotonic()
    tool = KINDS[kind]
    done = asyncio.Event()
    restarted = False

    async def killer() -> None:
        nonlocal restarted
        while workers.kills < kills and not done.is_set():
            await asyncio.sleep(random.uniform(0.5, 2.5))
            workers.kill_one()
            if not restarted and workers.kills >= kills // 2:
                restarted = True
                await asyncio.to_thread(server.restart)  # the Temporal server itself, mid-run

    async def one(i: int) -> None:
        nonlocal lost
        name = tool if kind != "side_effect" or i % 3 else "act_side_ok"  # every third side effect asks first
        try:
            stops[await asyncio.wait_for(drive(client_agent, f"{kind}-{i}", f"do {name} {i}", told, effects),
                                         timeout=600)] += 1
        except Exception as exc:  # noqa: BLE001 - a session that never reached a stop is what we count
            lost += 1
            stops[f"lost: {type(exc).__name__}: {str(exc)[:120]}"] += 1

    kill_task = asyncio.ensure_future(killer())
    n = 0
    while n < sessions or workers.kills < kills:
        batch = [one(n + j) for j in range(4)]
        n += 4
        await asyncio.gather(*batch)
    done.set()
    await kill_task
    workers.close()
    await model.close()
    server.close()
    # effects per call
    per_call: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in read_effects(effects):
        per_call[f"{e['session']}/{e['call']}"].append(e)
    duplicates = sum(1 for k, v in per_call.items() if len(v) > 1) if kind == "side_effect" else 0
    keys_per_call = {k: len({e["key"] for e in v}) for k, v in per_call.items()}
    return {"kind": kind, "kills": workers.kills, "sessions": n, "lost": lost, "stops": dict(stops),
            "calls": len(per_call), "executions": sum(len(v) for v in per_call.values()),
            "duplicate_side_effects": duplicates, "told_outcome_unknown": len(told),
            "calls_with_one_key": sum(1 for v in keys_per_call.values() if v == 1),
            "calls_with_two_keys": sum(1 for v in keys_per_call.values() if v > 1),
            "rejected_requests": len(model.rejected), "seconds": round(time.monotonic() - started, 1),
            "server_restarted": restarted}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| effect | kills | sessions | lost | calls | executions | duplicate side effects | told outcome unknown "
            "| calls with one key | rejected requests | seconds |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['kills']} | {r['sessions']} | {r['lost']} | {r['calls']} | {r['executions']} "
                     f"| {r['duplicate_side_effects']} | {r['told_outcome_unknown']} | {r['calls_with_one_key']} "
                     f"| {r['rejected_requests']} | {r['seconds']} |")
    return "\n".join(lines)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=26, help="kills per effect kind (default 26)")
    ap.add_argument("--sessions", type=int, default=24, help="at least this many sessions per kind")
    ap.add_argument("--heartbeat", type=float, default=2.0, help="activity heartbeat timeout, seconds")
    ap.add_argument("--kinds", default="pure,idempotent,side_effect")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fsm-tfaults-") as tmp:
        for kind in args.kinds.split(","):
            row = await campaign(kind, kills=args.kills, sessions=args.sessions, workdir=Path(tmp),
                                 heartbeat=args.heartbeat)
            print(orjson.dumps(row).decode(), flush=True)
            rows.append(row)
    print(table(rows))


if __name__ == "__main__":
    asyncio.run(main())
