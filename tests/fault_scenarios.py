"""The fault scenarios, each returning its figures as a dict; tests/test_faults_*.py assert on them
and bench/faults.py repeats them and prints the table.

Every scenario drives the real OpenAI HTTP provider against a :class:`StrictServer` (for the run
and for every resume) and reports:

* ``duplicates`` — extra executions of a ``side_effect`` call (same idempotency key twice);
* ``reruns`` — extra executions of a ``pure`` / ``idempotent`` call (allowed: recorded);
* ``unanswered`` — tool calls without exactly one result in the final transcript;
* ``lies`` — results telling the model a call did not run (or was cancelled) when it ran;
* ``rejected`` — requests the strict server refused (HTTP 400);
* ``recovered`` — the session reached the terminal state the documentation promises
  (COMPLETED after resumes, or CANCELLED for a cancel);
* ``stops`` — every stop reason seen, in order.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from faults_common import act_tool, agent_for, audit, executions, finish, repair, stored_transcript  # noqa: E402

from fsm_agent import Agent, Middleware, StopReason  # noqa: E402
from fsm_agent.control import Cancel, Interrupt  # noqa: E402
from fsm_agent.errors import StopRun  # noqa: E402
from fsm_agent.testing.strict import StrictServer, calls, text  # noqa: E402

HERE = Path(__file__).parent
WORKER = HERE / "fault_worker.py"
KILL_POINTS = ("approved", "started", "effect", "completed")
APPROVALS = ("person", "none")
HOOKS = ("pre_turn", "wrap_model_call", "on_model_event", "on_tool_call", "wrap_tool_call", "post_turn")
HOOK_FAULTS = ("cancel", "stoprun", "error")
PHASES = ("PreTurn", "Model", "MidTurn", "PostTurn")


def _figures(keys: list[str], effect: str | dict[str, str], result_msgs: Any, sid: str, counter: Path,
             server: StrictServer, recovered: bool, stops: list[str], **extra: Any) -> dict[str, Any]:
    """Duplicates (side_effect) / reruns (pure, idempotent) from the counter's keys."""
    a = audit(result_msgs, sid, counter)
    extra_runs = sum(n - 1 for n in Counter(keys).values() if n > 1)
    side = effect == "side_effect" if isinstance(effect, str) else False
    return {"duplicates": extra_runs if side else 0, "reruns": 0 if side else extra_runs,
            "unanswered": a["unanswered"], "lies": len(a["lies"]), "lie_texts": a["lies"],
            "rejected": len(server.rejected), "rejections": list(server.rejected), "recovered": recovered,
            "stops": stops, "executions": len(keys), **extra}


def _approval() -> Middleware:
    from fsm_agent_middleware.approval import HumanApproval

    return HumanApproval(tools=["act"])


# -- 1. SIGKILL at every ledger step ----------------------------------------------------------------

async def _finish_on(agent: Any, sid: str, counter: Path) -> tuple[Any, Any]:
    """Another worker (``agent``) finishes session ``sid``; its provider is closed after."""
    try:
        return await finish(agent, sid, counter)
    finally:
        await agent.provider.aclose()


async def kill_cell(make_store: Callable[[], Any], store_url: str, workdir: Path, effect: str, approval: str,
                    point: str, sid: str) -> dict[str, Any]:
    """Kill a worker process at ``point`` of ``call_1``'s life, then resume in this process."""
    counter = workdir / f"{sid}.effects"
    server = StrictServer([calls(("call_1", "act", {"n": 1})), text("all done")])
    base = await server.start()
    mw = [_approval()] if approval == "person" else []
    stops: list[str] = []
    try:
        if approval == "person":
            store = make_store()
            agent = agent_for(base, store, [act_tool(effect, counter)], middleware=mw)
            first = await agent.run("do it", session_id=sid)
            stops.append(first.stop.reason.value)
            await agent.provider.aclose()
            await store.close()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(WORKER), store_url, base, str(counter), sid, effect, approval, point,
            "approve" if approval == "person" else "run",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        killed = proc.returncode == -signal.SIGKILL
        at_kill = len(executions(counter))
        await asyncio.sleep(0.6)  # the dead worker's lease (0.5 s) runs out
        store = make_store()
        agent = agent_for(base, store, [act_tool(effect, counter)], middleware=[_approval()] if mw else [])
        try:
            result, decisions = await finish(agent, sid, counter)
            stops += [result.stop.reason.value]
            transcript = await stored_transcript(store, sid)
        finally:
            await agent.provider.aclose()
            await store.close()
    finally:
        await server.close()
    keys = executions(counter)
    return _figures(keys, effect, transcript, sid, counter, server,
                    result.stop.reason is StopReason.COMPLETED and result.output == "all done", stops,
                    killed=killed, worker_stderr=err.decode()[-2000:] if not killed else "", at_kill=at_kill,
                    decisions=decisions)


# -- 2. Task.cancel, StopRun and exceptions at every hook ----------------------------------------------
class _Saboteur(Middleware):
    """Fires one fault in one hook, at the point where something is at stake there."""

    name = "saboteur"

    def __init__(self, fault: str, holder: dict[str, Any]) -> None:
        self.fault, self.holder = fault, holder
        self.fired = False

    async def fire(self, *, linger: bool = True) -> None:
        self.fired = True
        if self.fault == "error":
            raise RuntimeError("the saboteur's hook failed (fail-closed)")
        if self.fault == "stoprun":
            raise StopRun(StopReason.INTERRUPTED, "stopped by the saboteur")
        self.holder["task"].cancel()
        if linger:
            await asyncio.sleep(5)  # the cancel lands here

    def fire_sync(self) -> None:
        self.fired = True
        if self.fault == "error":
            raise RuntimeError("the saboteur's hook failed (fail-closed)")
        if self.fault == "stoprun":
            raise StopRun(StopReason.INTERRUPTED, "stopped by the saboteur")
        self.holder["task"].cancel()


def _saboteur(hook: str, fault: str, holder: dict[str, Any]) -> Middleware:
    async def pre_turn(self: _Saboteur, ctx: Any) -> None:
        if ctx.turn == 1 and not self.fired:  # before the second model call: the tools have run
            await self.fire()

    async def wrap_model_call(self: _Saboteur, request: Any, call_next: Any, ctx: Any) -> Any:
        if ctx.turn == 2 and not self.fired:
            await self.fire()
        return await call_next(request)

    def on_model_event(self: _Saboteur, event: Any, ctx: Any) -> Any:
        if ctx.turn == 1 and not self.fired:  # while the tool calls stream
            self.fire_sync()
        return event

    def on_tool_call(self: _Saboteur, call: Any, ctx: Any) -> Any:
        if call.id == "call_b" and not self.fired:  # call_a is approved, nothing has started
            self.fire_sync()
        return None

    async def wrap_tool_call(self: _Saboteur, call: Any, call_next: Any, ctx: Any) -> Any:
        result = await call_next(call)
        if call.id == "call_b" and not self.fired:  # call_b ran; its result is not handed back
            await asyncio.sleep(0.05)  # call_a's result is recorded meanwhile
            await self.fire()
        return result

    def post_turn(self: _Saboteur, ctx: Any) -> Any:
        if ctx.turn == 1 and not self.fired:
            self.fire_sync()
        return None

    fns = {"pre_turn": pre_turn, "wrap_model_call": wrap_model_call, "on_model_event": on_model_event,
           "on_tool_call": on_tool_call, "wrap_tool_call": wrap_tool_call, "post_turn": post_turn}
    cls = type(f"Saboteur_{hook}", (_Saboteur,), {hook: fns[hook], "name": "saboteur"})
    return cls(fault, holder)  # type: ignore[no-any-return]


def _two_calls_script() -> list[Any]:
    return [calls(("call_a", "act", {"n": 1}), ("call_b", "act", {"n": 2})), text("all done")]


async def hook_fault(make_store: Callable[[], Any], workdir: Path, hook: str, fault: str, with_repair: bool,
                     sid: str, effect: str = "side_effect") -> dict[str, Any]:
    """One fault in one hook during a run with two parallel calls; then resume (or, after a
    non-resumable stop, a new run with the stored transcript), with or without ``repair``."""
    counter = workdir / f"{sid}.effects"
    server = StrictServer(_two_calls_script())
    base = await server.start()
    store = make_store()
    holder: dict[str, Any] = {}
    extra = [repair()] if with_repair else []
    stops: list[str] = []
    agent = agent_for(base, store, [act_tool(effect, counter)], middleware=[*extra, _saboteur(hook, fault, holder)],
                      stream=True)
    try:
        task = holder["task"] = asyncio.ensure_future(agent.run("do both", session_id=sid))
        cancelled = False
        try:
            first = await task
            stop = first.stop
        except asyncio.CancelledError:
            cancelled = True
            rec = await store.get_session(sid)
            from fsm_agent.types import RunStop
            from fsm_agent.types.codec import structure

            stop = structure(rec.stop, RunStop)
        stops.append(stop.reason.value)
        stopped = await stored_transcript(store, sid)
        pending = {p.call.id for p in stop.pending_actions}
        a = audit(stopped, sid, counter)
        # a call left open is allowed only as a pending action of a resumable stop (it runs on resume)
        open_calls = [c for c in a["calls"] if sum(1 for m in stopped if getattr(m, "tool_call_id", None) == c) != 1]
        open_ok = all(c in pending for c in open_calls) and (not open_calls or stop.resumable)
        lies_at_stop = len(a["lies"])
        await agent.provider.aclose()
        agent2 = agent_for(base, store, [act_tool(effect, counter)], middleware=[repair()] if with_repair else [],
                           stream=True)
        try:
            if stop.resumable:
                final, _ = await finish(agent2, sid, counter)
                transcript = await stored_transcript(store, sid)
            else:
                final = await agent2.run(stopped, session_id=sid + "-again")
                transcript = list(final.messages)
            stops.append(final.stop.reason.value)
        finally:
            await agent2.provider.aclose()
    finally:
        await store.close()
        await server.close()
    keys = executions(counter)
    sid_for_audit = sid if stop.resumable else sid + "-again"
    fig = _figures(keys, effect, transcript, sid, counter, server,
                   final.stop.reason is StopReason.COMPLETED, stops, cancelled=cancelled, open_at_stop=open_calls,
                   open_ok=open_ok, lies_at_stop=lies_at_stop, unknown=a["unknown"], not_run=a["not_run"],
                   fired=True)
    if sid_for_audit != sid:  # the new run's own calls (none are made) are audited under its id
        fig["lies"] += len(audit(transcript, sid_for_audit, counter)["lies"])
    fig["lies"] += lies_at_stop
    return fig


# -- 3. Interrupt and Cancel in every phase ----------------------------------------------------------------
class _Sender(Middleware):
    """Sends a control event through the store while the run is in ``phase`` (first tool turn)."""

    name = "sender"

    def __init__(self, phase: str, send: Callable[[], Any]) -> None:
        self.phase, self.send = phase, send
        self.sent = False

    async def _go(self) -> None:
        if not self.sent:
            self.sent = True
            await self.send()

    async def pre_turn(self, ctx: Any) -> None:
        if self.phase == "PreTurn":
            await self._go()

    def on_model_event(self, event: Any, ctx: Any) -> Any:
        if self.phase == "Model" and not self.sent:
            self.sent = True
            asyncio.ensure_future(self.send())
        return event

    async def post_turn(self, ctx: Any) -> Any:
        if self.phase == "PostTurn" and ctx.turn == 1:
            await self._go()
        return None


async def control_fault(make_store: Callable[[], Any], workdir: Path, kind: str, phase: str, compensate: bool,
                        sid: str) -> dict[str, Any]:
    """Interrupt or Cancel (``agent.control``, through the store) in ``phase`` of the first turn (two
    side-effect calls; in MidTurn the control lands while ``call_b`` runs, after its effect)."""
    counter, comp = workdir / f"{sid}.effects", workdir / f"{sid}.compensated"
    script = [calls(("call_a", "act", {"n": 1}), ("call_b", "act", {"n": 2}), text="Doing both. " * 5, pieces=10,
                    chunk_delay=0.03), text("all done")]
    server = StrictServer(script)
    base = await server.start()
    store = make_store()
    ref: list[Agent] = []

    async def send() -> None:
        await ref[0].control(sid, Interrupt("stop now") if kind == "interrupt" else Cancel("never mind"))

    async def slow_b(ctx: Any) -> None:
        if ctx.call_id == "call_b" and phase == "MidTurn" and not os.path.exists(f"{counter}.sent"):
            Path(f"{counter}.sent").touch()
            await send()
            await asyncio.sleep(3)  # the watcher cuts it here

    def tools() -> list[Any]:
        return [act_tool("side_effect", counter, after=slow_b, compensated=comp if compensate else None)]

    agent = agent_for(base, store, tools(), middleware=[_Sender(phase, send)], stream=True)
    ref.append(agent)
    stops: list[str] = []
    try:
        first = await agent.run("do both", session_id=sid)
        stops.append(first.stop.reason.value)
        stopped = await stored_transcript(store, sid)
        lies_at_stop = len(audit(stopped, sid, counter)["lies"])
        await agent.provider.aclose()
        agent2 = agent_for(base, store, tools())
        try:
            if first.stop.reason is StopReason.CANCELLED:
                final = first
            else:
                final, _ = await finish(agent2, sid, counter, confirm_cancel=False)
                stops.append(final.stop.reason.value)
            transcript = await stored_transcript(store, sid)
        finally:
            await agent2.provider.aclose()
    finally:
        await store.close()
        await server.close()
    keys = executions(counter)
    want = StopReason.COMPLETED if kind == "interrupt" else StopReason.CANCELLED
    compensated = comp.read_text().split() if comp.exists() else []
    # a cancel undoes every side effect that happened: compensated, or confirmed by a person first
    undone = (sorted(compensated) == sorted(set(keys))) if kind == "cancel" and compensate else True
    asked = "WAITING_HUMAN" in stops
    fig = _figures(keys, "side_effect", transcript, sid, counter, server,
                   final.stop.reason is want and undone, stops, compensated=len(compensated),
                   asked_person=asked, detail=first.stop.detail, required=first.stop.required_decision)
    fig["lies"] += lies_at_stop
    return fig


# -- 4. Failing store writes ---------------------------------------------------------------------------------
STORE_WRITE_STATUSES = ("approved", "started", "completed")


async def store_write_fault(make_inner: Callable[[], Any], workdir: Path, status: str, after_commit: bool,
                            sid: str) -> dict[str, Any]:
    """The write that carries ``status`` for a side-effect call fails (before it is stored, or after:
    a lost acknowledgement): the run ends FAILED_RETRYABLE with the typed store error, and resumes
    (the fault gone) finish with the effect done once."""
    from fsm_agent.store import LedgerStatus
    from fsm_agent.testing import FaultyStore, carries_ledger

    counter = workdir / f"{sid}.effects"
    server = StrictServer([calls(("call_1", "act", {"n": 1})), text("all done")])
    base = await server.start()
    inner = make_inner()
    store = FaultyStore(inner)
    person = status == "approved"  # an approval is written on its own only when a person gives it
    mw = [_approval()] if person else []
    stops: list[str] = []
    try:
        agent = agent_for(base, store, [act_tool("side_effect", counter)], middleware=mw)
        fault = store.fail("write", when=carries_ledger(LedgerStatus(status), tool="act"), after_commit=after_commit)
        try:
            if person:
                first = await agent.run("do it", session_id=sid)
                stops.append(first.stop.reason.value)
                from fsm_agent.control import Decision

                failed = await agent.resume(sid, decisions={"call_1": Decision.approve()})
            else:
                failed = await agent.run("do it", session_id=sid)
        finally:
            await agent.provider.aclose()
        stops.append(failed.stop.reason.value)
        err = failed.stop.error or {}
        typed = (failed.stop.reason is StopReason.FAILED_RETRYABLE and err.get("kind") == "store"
                 and bool(err.get("location")) and err.get("location") in failed.stop.detail + err.get("message", ""))
        store.clear()
        final, decisions = await _finish_on(agent_for(base, store, [act_tool("side_effect", counter)], middleware=mw),
                                            sid, counter)
        stops.append(final.stop.reason.value)
        transcript = await stored_transcript(store, sid)
    finally:
        await inner.close()
        await server.close()
    return _figures(executions(counter), "side_effect", transcript, sid, counter, server,
                    final.stop.reason is StopReason.COMPLETED, stops, typed_error=typed, error=err,
                    fired=fault.fired, decisions=decisions)


async def lease_fault(make_inner: Callable[[], Any], workdir: Path, sid: str, ttl: float = 0.9) -> dict[str, Any]:
    """Lease renewal fails for longer than 2/3 of the TTL while a side-effect call runs: the worker
    stops driving before its lease expires; another worker takes over once it has, and finishes."""
    from fsm_agent.testing import FaultyStore

    counter = workdir / f"{sid}.effects"
    server = StrictServer([calls(("call_1", "act", {"n": 1})), text("all done")])
    base = await server.start()
    inner = make_inner()
    store = FaultyStore(inner)

    async def slow(ctx: Any) -> None:
        await asyncio.sleep(5)

    stops: list[str] = []
    try:
        agent = agent_for(base, store, [act_tool("side_effect", counter, after=slow)], lease_ttl=ttl,
                          worker_id="w1")
        store.fail("acquire_lease", nth=2, for_seconds=30.0, transient=True)  # every renewal fails
        t0 = time.monotonic()
        try:
            first = await agent.run("do it", session_id=sid)
        finally:
            await agent.provider.aclose()
        stopped_after = time.monotonic() - t0
        stops.append(first.stop.reason.value)
        kind = (first.stop.error or {}).get("kind")
        store.clear()
        await asyncio.sleep(max(0.0, ttl - stopped_after) + 0.1)  # the lease runs out
        final, decisions = await _finish_on(agent_for(base, inner, [act_tool("side_effect", counter)], worker_id="w2"),
                                            sid, counter)
        stops.append(final.stop.reason.value)
        transcript = await stored_transcript(inner, sid)
    finally:
        await inner.close()
        await server.close()
    return _figures(executions(counter), "side_effect", transcript, sid, counter, server,
                    final.stop.reason is StopReason.COMPLETED, stops, stopped_after=stopped_after, ttl=ttl,
                    error_kind=kind, decisions=decisions)


async def peek_fault(make_inner: Callable[[], Any], workdir: Path, sid: str) -> dict[str, Any]:
    """``peek_controls`` fails (transiently) for 0.8 s while a slow answer streams; an Interrupt sent
    after that still stops the run, and it resumes."""
    from fsm_agent.testing import FaultyStore

    server = StrictServer([text("word " * 60, pieces=60, chunk_delay=0.05), text("all done")])
    base = await server.start()
    inner = make_inner()
    store = FaultyStore(inner)
    stops: list[str] = []
    try:
        agent = agent_for(base, store, [], stream=True)
        fault = store.fail("peek_controls", for_seconds=0.8, transient=True)
        task = asyncio.ensure_future(agent.run("talk", session_id=sid))
        await asyncio.sleep(1.2)
        await agent.control(sid, Interrupt("enough"))
        t = time.monotonic()
        first = await task
        reacted = time.monotonic() - t
        stops.append(first.stop.reason.value)
        final, _ = await finish(agent, sid, None)
        stops.append(final.stop.reason.value)
        await agent.provider.aclose()
        transcript = await stored_transcript(inner, sid)
    finally:
        await inner.close()
        await server.close()
    return _figures([], "pure", transcript, sid, workdir / "none", server,
                    first.stop.reason is StopReason.INTERRUPTED and final.stop.reason is StopReason.COMPLETED, stops,
                    peek_failures=fault.fired, reacted_s=reacted)


async def full_disk(mnt: Path, workdir: Path, sid: str, free: Callable[[], None]) -> dict[str, Any]:
    """A real full disk (a small tmpfs at ``mnt``) during a run: FAILED_RETRYABLE with the typed store
    error naming the path; ``free()`` makes room and a resume finishes."""
    from fsm_agent import tool
    from fsm_agent.store import SQLiteStore

    @tool(effect="idempotent")
    def fetch(n: int) -> str:
        """Fetch a page.

        Args:
            n: which page.
        """
        return f"page {n}: " + "x" * 20_000

    def script(messages: list[dict[str, Any]]) -> Any:
        k = sum(1 for m in messages if m.get("role") == "assistant")
        return calls((f"call_{k}", "fetch", {"n": k})) if k < 20 else text("all done")

    server = StrictServer(script)
    base = await server.start()
    path = mnt / "sessions.db"
    stops: list[str] = []
    try:
        store = SQLiteStore(path)
        agent = agent_for(base, store, [fetch], max_iterations=60)
        try:
            first = await agent.run("read everything", session_id=sid)
        finally:
            await agent.provider.aclose()
        stops.append(first.stop.reason.value)
        err = first.stop.error or {}
        typed = (first.stop.reason is StopReason.FAILED_RETRYABLE and err.get("kind") == "store"
                 and str(path) in (err.get("location") or "") and "full" in err.get("message", ""))
        await store.close()
        free()
        store = SQLiteStore(path)
        # The same worker resumes once space is freed: its lease could not be released while the disk
        # was full (a release is a write), so another worker would have to wait for the lease to expire.
        agent2 = agent_for(base, store, [fetch], max_iterations=60, worker_id=agent.worker_id)
        try:
            final, _ = await finish(agent2, sid, None)
        finally:
            await agent2.provider.aclose()
        stops.append(final.stop.reason.value)
        transcript = await stored_transcript(store, sid)
        await store.close()
    finally:
        await server.close()
    return _figures([], "idempotent", transcript, sid, workdir / "none", server,
                    final.stop.reason is StopReason.COMPLETED and final.output == "all done", stops,
                    typed_error=typed, error=err)


# -- 5. SIGTERM in every phase ---------------------------------------------------------------------------------
async def sigterm_embedded(workdir: Path, phase: str, sid: str) -> dict[str, Any]:
    """SIGTERM to a process that runs ``agent.run`` inside ``async with agent.drain_on_signals()``
    while it is in ``phase``: INTERRUPTED, lease released, resumed at once (no lease wait) here."""
    import orjson

    from fsm_agent.store import SQLiteStore

    counter, ready, db = workdir / f"{sid}.effects", workdir / f"{sid}.ready", workdir / f"{sid}.db"
    server = StrictServer([calls(("call_1", "act", {"n": 1})), text("all done")])
    base = await server.start()
    stops: list[str] = []
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "fault_embed.py"), str(db), base, str(counter), sid, phase, str(ready),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        for _ in range(300):
            if ready.exists():
                break
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        got = orjson.loads(out.splitlines()[-1]) if out.strip() else {"reason": None, "detail": err.decode()[-1500:]}
        stops.append(str(got["reason"]))
        store = SQLiteStore(db)
        final, decisions = await _finish_on(agent_for(base, store, [act_tool("side_effect", counter)]),
                                            sid, counter)  # at once: no wait for a lease
        stops.append(final.stop.reason.value)
        transcript = await stored_transcript(store, sid)
        await store.close()
    finally:
        await server.close()
    return _figures(executions(counter), "side_effect", transcript, sid, counter, server,
                    got["reason"] == "INTERRUPTED" and final.stop.reason is StopReason.COMPLETED, stops,
                    exit=proc.returncode, lease_released=got.get("lease_owner", "?") is None,
                    detail=got.get("detail"))
