"""A worker: claims queued runs from PostgreSQL and carries them out, on any host.

    worker = Worker(agent, PostgresStore("postgresql://…"), concurrency=4)
    await worker.run_forever()          # until worker.stop()

or from a shell: ``fsm-agent worker --store postgresql://… --agent myapp.agents:support``
(:mod:`fsm_agent.cli.worker`).

Each claim takes a job of the ``run_queue`` table with ``SELECT … FOR UPDATE SKIP LOCKED``, so
two workers never claim the same job; the claim lasts the agent's ``lease_ttl`` seconds and is
renewed while the run goes on. The job is carried out with
:func:`fsm_agent.server.runs.execute`; the session's lease fences the run as everywhere else, so
a job whose session another worker drives is given back (:class:`~fsm_agent.server.runs.Busy`)
and tried again later. A worker that dies (SIGKILL, a lost host) leaves its claims to expire;
another worker then claims the job again and resumes the session, which recovers it once the
dead worker's session lease expired, with the usual guarantees (a completed tool call never runs
again; one found started is reconciled by its tool or put to a person).

Controls (steer, interrupt, cancel) need nothing here: a server replica stores them and the
driver polls the store while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any, TextIO

from ..agent import Agent
from ..errors import ConfigurationError, StoreError
from ..store.base import Store
from ..store.postgres import QUEUE_CHANNEL, PostgresStore, QueuedRun
from ..types.codec import structure, unstructure
from ..types.run import RunResult, StopReason
from .queue import PgListener, PgLiveDeltas, postgres_of
from .runs import Busy, RunRequest, drain_tasks, execute

__all__ = ["STOP_REASON", "Worker"]

log = logging.getLogger("fsm_agent.server")

STOP_REASON = "worker stopping"
"""The interrupt reason of runs cut by :meth:`Worker.stop`; their jobs go back to the queue."""


class Worker:
    """Claims runs from the queue and carries them out.

    Args:
        agent: drives every run. Its ``worker_id`` names the claims and leases, its ``lease_ttl``
            is the claim's lifetime. Its ``store`` is set to ``store`` (wrapped to learn the last
            committed seq of each session when ``live_deltas`` is on, and the agent then gets a
            :class:`~fsm_agent.server.queue.PgLiveDeltas` observer).
        store: the PostgreSQL store of the queue and the sessions (or a wrapper of one).
        concurrency: jobs carried out at once (>= 1).
        poll: seconds between claims when no ``NOTIFY fsm_queue`` wakes the worker (> 0).
        busy_delay: seconds before a job whose session is busy elsewhere is tried again.
        max_attempts: claims after which a job that keeps failing (an exception out of the run, or
            a worker that died with it) is dropped, logged as an error.
        live_deltas: publish model-stream deltas live (``NOTIFY fsm_live``).
        drain_timeout: seconds :meth:`stop` waits for interrupted runs to end before cancelling them.

    Raises:
        ValueError: ``concurrency`` < 1, ``poll`` <= 0, ``max_attempts`` < 1.
        TypeError: ``store`` is not (a wrapper of) a PostgresStore.
    """

    def __init__(self, agent: Agent, store: Store, *, concurrency: int = 4, poll: float = 1.0,
                 busy_delay: float = 1.0, max_attempts: int = 10, live_deltas: bool = True,
                 drain_timeout: float = 30.0) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {concurrency}")
        if not poll > 0:
            raise ValueError(f"poll must be > 0 seconds, not {poll}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {max_attempts}")
        self.pg = postgres_of(store)
        self.agent = agent
        self.concurrency, self.poll, self.busy_delay = concurrency, poll, busy_delay
        self.max_attempts, self.drain_timeout = max_attempts, drain_timeout
        self.live: PgLiveDeltas | None = None
        if live_deltas:
            self.live = PgLiveDeltas.attach(agent, store)
        else:
            agent.store = store
        self.completed = 0
        """Jobs finished (deleted from the queue) by this worker."""
        self._claimed: dict[str, QueuedRun] = {}
        self._pending: dict[str, list[QueuedRun]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._stopping = False
        self._running = False

    @property
    def worker_id(self) -> str:
        """The claims' and leases' owner name (the agent's ``worker_id``)."""
        return self.agent.worker_id

    @property
    def running(self) -> int:
        """Jobs claimed and not yet done."""
        return len(self._claimed)

    async def run_forever(self) -> None:
        """Claim and carry out jobs until :meth:`stop`; then interrupt or finish the runs in
        progress and give back the claims of jobs not done.

        Raises:
            RuntimeError: already running.
            StoreError: PostgreSQL could not be reached at the start.
        """
        if self._running:
            raise RuntimeError("this worker is running already")
        loop = asyncio.get_running_loop()
        listener = PgListener(self.pg, {QUEUE_CHANNEL: lambda _payload: self._wake.set()},
                              on_connect=lambda _again: self._wake.set())
        await listener.start()
        self._running = True
        renew_every = max(0.05, min(self.poll, self.agent.lease_ttl / 3))
        next_renew = loop.time() + renew_every
        try:
            while not self._stop.is_set():
                self._wake.clear()
                free = self.concurrency - len(self._claimed)
                if free > 0:
                    await self._claim(free)
                wait = min(self.poll, max(0.0, next_renew - loop.time()))
                if wait > 0 and not self._wake.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait)
                if loop.time() >= next_renew:
                    next_renew = loop.time() + renew_every
                    await self._renew()
        finally:
            await listener.close()
            await self._drain()
            if self.live is not None:
                await self.live.aclose()
            self._running = False

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopping

    async def stop(self, *, interrupt: bool = True) -> None:
        """Stop claiming. ``interrupt``: cut the runs in progress now (each ends INTERRUPTED with
        its checkpoint, resumable, and its job goes back to the queue for another worker);
        otherwise let them finish. Returns at once; :meth:`run_forever` returns when they ended
        (after at most ``drain_timeout`` seconds: then the runs left are cancelled)."""
        self.request_stop(interrupt=interrupt)

    def request_stop(self, *, interrupt: bool = True) -> None:
        """:meth:`stop`, callable from a signal handler (no await)."""
        self._stopping = True
        self._stop.set()
        self._wake.set()
        if interrupt:
            self.interrupt_runs()

    def interrupt_runs(self) -> None:
        """Interrupt every run this worker's agent drives in this process (see :meth:`stop`)."""
        self.agent.interrupt_all(f"{STOP_REASON} ({self.worker_id})")

    def cancel_runs(self) -> None:
        """Cancel the tasks of the runs in progress (each records INTERRUPTED and its job goes back
        to the queue): the hard way out, when interrupted runs take too long to end."""
        for task in list(self._tasks.values()):
            task.cancel()

    # -- claims -----------------------------------------------------------------------------
    async def _claim(self, free: int) -> None:
        try:
            jobs = await self.pg.claim_runs(self.worker_id, self.agent.lease_ttl, free)
        except (StoreError, OSError) as exc:
            log.warning("worker %s: claiming runs failed: %s", self.worker_id, exc)
            return
        for job in jobs:
            self._claimed[job.job_id] = job
            queue = self._pending.setdefault(job.session_id, [])
            queue.append(job)
            if job.session_id not in self._tasks:
                self._tasks[job.session_id] = asyncio.get_running_loop().create_task(
                    self._session(job.session_id), name=f"fsm-worker-{job.session_id}")

    async def _renew(self) -> None:
        ids = list(self._claimed)
        if not ids:
            return
        try:
            held = await self.pg.renew_claims(self.worker_id, ids, self.agent.lease_ttl)
        except (StoreError, OSError) as exc:
            log.warning("worker %s: renewing claims failed: %s", self.worker_id, exc)
            return
        for lost in set(ids) - held:
            log.warning("worker %s: the claim of job %s expired and went to another worker", self.worker_id, lost)

    async def _session(self, sid: str) -> None:
        """Carry out the claimed jobs of one session, in order."""
        try:
            queue = self._pending[sid]
            while queue and not self._stopping:
                job = queue[0]
                await self._carry(job)
                queue.pop(0)
                self._claimed.pop(job.job_id, None)
        finally:
            left = self._pending.pop(sid, [])  # before any await: a later claim for sid starts a new task
            self._tasks.pop(sid, None)
            if self.live is not None:
                self.live.forget(sid)
            for job in left:  # stopping (or cancelled): not carried out here
                self._claimed.pop(job.job_id, None)
                await self._give_back(job, 0.0, count_attempt=False)
            self._wake.set()  # a slot is free

    async def _carry(self, job: QueuedRun) -> None:
        try:
            request: RunRequest = structure(job.payload, RunRequest)
        except Exception as exc:  # noqa: BLE001 - a job no version of this code can read
            log.error("worker %s: job %s has a malformed request (%s); dropped", self.worker_id, job.job_id, exc)
            await self._finish(job)
            return
        try:
            result = await execute(self.agent, request)
        except Busy as exc:
            log.info("worker %s: session %s is busy (%s); job %s again in %.1f s", self.worker_id, job.session_id,
                     exc, job.job_id, self.busy_delay)
            await self._give_back(job, self.busy_delay, count_attempt=False)
            return
        except asyncio.CancelledError:
            # stop() gave up waiting: the run recorded INTERRUPTED; another worker resumes it
            await asyncio.shield(self._give_back(job, 0.0, count_attempt=False))
            raise
        except Exception:  # noqa: BLE001 - keep serving; the failure is logged and in the session's log
            if job.attempts >= self.max_attempts:
                log.exception("worker %s: job %s of session %s failed on attempt %d of %d; dropped",
                              self.worker_id, job.job_id, job.session_id, job.attempts, self.max_attempts)
                await self._finish(job)
            else:
                delay = min(60.0, self.busy_delay * 2 ** job.attempts)
                log.exception("worker %s: job %s of session %s failed (attempt %d); again in %.1f s",
                              self.worker_id, job.job_id, job.session_id, job.attempts, delay)
                await self._give_back(job, delay)
            return
        if self._stopping and _cut_by_stop(result):
            # another worker continues it: a resume of this interrupt (a plain retry of the job would
            # find the session stopped INTERRUPTED, which is resumed only when someone asks)
            await self._hand_over(job)
        else:
            await self._finish(job)

    async def _hand_over(self, job: QueuedRun) -> None:
        try:
            request = RunRequest(job.session_id, "resume")
            await self.pg.enqueue_run(uuid.uuid4().hex, job.session_id, request.kind, unstructure(request))
        except (StoreError, OSError) as exc:
            log.warning("worker %s: could not hand session %s over (%s); it stays INTERRUPTED, resumable",
                        self.worker_id, job.session_id, exc)
        await self._finish(job, count=False)

    async def _finish(self, job: QueuedRun, *, count: bool = True) -> None:
        try:
            await self.pg.finish_run(job.job_id, self.worker_id)
            self.completed += count
        except (StoreError, OSError) as exc:  # the claim expires; the job runs again (harmless: execute checks)
            log.warning("worker %s: could not delete finished job %s: %s", self.worker_id, job.job_id, exc)

    async def _give_back(self, job: QueuedRun, delay: float, *, count_attempt: bool = True) -> None:
        try:
            await self.pg.release_run(job.job_id, self.worker_id, delay, count_attempt=count_attempt)
        except (StoreError, OSError) as exc:  # the claim expires on its own
            log.warning("worker %s: could not give back job %s: %s", self.worker_id, job.job_id, exc)

    async def _drain(self) -> None:
        await drain_tasks(list(self._tasks.values()), self.drain_timeout)

    def __repr__(self) -> str:
        return f"Worker({self.worker_id!r}, running={self.running}, completed={self.completed})"


def _cut_by_stop(result: RunResult | None) -> bool:
    return (result is not None and result.stop.reason is StopReason.INTERRUPTED
            and STOP_REASON in (result.stop.detail or ""))
