"""A worker process for the crash tests: runs (or resumes) a session with a side-effecting tool and
kills itself with SIGKILL at the point named on the command line.

    python tests/crash_worker.py DB COUNTER run  SESSION MODE RECONCILE
    python tests/crash_worker.py DB COUNTER resume SESSION [approve|respond]

The tool ``charge`` appends its idempotency key to COUNTER: the number of lines is the number of
times the side effect happened. Prints the run's stop reason as JSON on stdout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import orjson

from fsm_agent import Agent, Middleware, ScriptedProvider, ToolContext, tool
from fsm_agent.control import Decision
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.tools import RUN_AGAIN
from fsm_agent.types import ToolFinished, ToolUseBlock

DB, COUNTER, ACTION, SESSION = sys.argv[1:5]
MODE = sys.argv[5] if ACTION == "run" else ""
RECONCILE = (sys.argv[6] == "reconcile") if ACTION == "run" else Path(COUNTER + ".reconcile").exists()


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@tool(effect="side_effect")
def charge(amount: int, ctx: ToolContext) -> str:
    """Charge the card."""
    if MODE == "after_start_before_effect":
        die()
    with open(COUNTER, "a") as f:
        f.write(ctx.idempotency_key + "\n")
        f.flush()
        os.fsync(f.fileno())
    if MODE == "after_effect":
        die()
    return f"charged {amount}"


if RECONCILE:
    @charge.on_reconcile
    def _reconcile(arguments: dict, ctx: ToolContext) -> Any:
        done = Path(COUNTER).read_text().split() if Path(COUNTER).exists() else []
        return f"charged {arguments['amount']}" if ctx.idempotency_key in done else RUN_AGAIN


class CrashPoints(Middleware):
    def on_tool_call(self, call: Any, ctx: Any) -> None:
        if MODE == "before_start":
            die()

    async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
        result = await call_next(call)
        if MODE == "after_completion_before_record":
            die()
        return result


class DieOnFinish:
    def on_tool_finished(self, ev: ToolFinished) -> None:
        if MODE == "after_ledger_completed":
            die()


async def main() -> None:
    store = SQLiteStore(DB)
    if ACTION == "run":
        Path(COUNTER + ".reconcile").touch() if RECONCILE else None
        provider = ScriptedProvider([tool_call_response(ToolUseBlock("call_charge", "charge", {"amount": 10})),
                                     "Charged 10."])
    else:
        provider = ScriptedProvider(["Charged 10."])
    agent = Agent(provider, tools=[charge], middleware=[CrashPoints()], observers=[DieOnFinish()], store=store,
                  lease_ttl=float(os.environ.get("CRASH_LEASE_TTL", "1.0")), control_poll=0.2)
    if ACTION == "run":
        result = await agent.run("charge 10", session_id=SESSION)
    else:
        decisions = {}
        if len(sys.argv) > 5:
            decisions["call_charge"] = Decision.approve() if sys.argv[5] == "approve" else Decision.respond("charged 10")
        result = await agent.resume(SESSION, decisions=decisions)
    out = {"reason": result.stop.reason.value, "detail": result.stop.detail,
           "pending": [p.reason for p in result.stop.pending_actions],
           "tool_results": [m.text for m in result.messages if m.role == "tool"]}
    print(orjson.dumps(out).decode())
    await store.close()


asyncio.run(main())
