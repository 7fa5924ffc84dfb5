"""A worker process for the SIGKILL fault matrix: drives a session against the strict server and
kills itself with SIGKILL at one step of the tool call's ledger life.

    python tests/fault_worker.py STORE BASE_URL COUNTER SESSION EFFECT APPROVAL POINT ACTION

STORE: a SQLite path or a postgresql:// DSN. APPROVAL: ``person`` (the HumanApproval plugin asks
for ``act``) or ``none``. ACTION: ``run`` (a new session) or ``approve`` (resume the session
waiting for a person, approving ``call_1``). POINT, on the life of ``call_1``:

* ``approved`` — approved (by policy or a person, written or queued), just before ``started`` is
  committed (a pure call has no such write: at the tool's entry);
* ``started`` — ``started`` committed, inside the tool before its effect;
* ``effect`` — inside the tool right after its effect, before ``completed`` is recorded;
* ``completed`` — right after the write that carries ``completed`` committed.

Exit 0 and a JSON line when the run ends without reaching the point (a bug in the test).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))

from faults_common import act_tool, agent_for  # noqa: E402

from fsm_agent.control import Decision  # noqa: E402
from fsm_agent.store import LedgerStatus, PostgresStore, SQLiteStore, WriteBatch  # noqa: E402
from fsm_agent.testing import FaultyStore  # noqa: E402

STORE, BASE, COUNTER, SESSION, EFFECT, APPROVAL, POINT, ACTION = sys.argv[1:9]


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def carries(batch: WriteBatch, status: LedgerStatus) -> bool:
    return any(e.call_id == "call_1" and e.status is status for e in batch.ledger)


class KillingStore(FaultyStore):
    async def write(self, batch: WriteBatch) -> None:
        if POINT == "approved" and carries(batch, LedgerStatus.STARTED):
            die()
        await super().write(batch)
        if POINT == "completed" and carries(batch, LedgerStatus.COMPLETED):
            die()


def before(ctx) -> None:
    if POINT == "started" or (POINT == "approved" and EFFECT == "pure"):
        die()


def after(ctx) -> None:
    if POINT == "effect":
        die()


def approval() -> list:
    if APPROVAL != "person":
        return []
    from fsm_agent_middleware.approval import HumanApproval

    return [HumanApproval(tools=["act"])]


async def main() -> None:
    inner = PostgresStore(STORE) if STORE.startswith("postgresql://") else SQLiteStore(STORE)
    store = KillingStore(inner)
    agent = agent_for(BASE, store, [act_tool(EFFECT, Path(COUNTER), before=before, after=after)],
                      middleware=approval(), lease_ttl=float(os.environ.get("FAULT_LEASE_TTL", "0.5")),
                      control_poll=0.1)
    try:
        if ACTION == "run":
            result = await agent.run("do it", session_id=SESSION)
        else:
            result = await agent.resume(SESSION, decisions={"call_1": Decision.approve()})
    finally:
        await agent.provider.aclose()
    print(orjson.dumps({"reason": result.stop.reason.value, "detail": result.stop.detail}).decode())
    await inner.close()


asyncio.run(main())
