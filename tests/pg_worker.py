"""A worker process for tests/server/test_workers_pg.py: ``fsm-agent worker`` (the CLI handler of
fsm_agent.server.worker) over a PostgreSQL DSN, with an agent whose scripted model acts on the
session's task:

    python tests/pg_worker.py DSN DIR [--concurrency N]

* ``charge``: calls ``charge(amount=10)`` (a side effect), then answers "charged".
* ``pay``: calls ``pay(amount=5)`` (a side effect a person must approve), then answers "paid".
* ``gate``: calls ``wait_gate()`` (idempotent; waits until DIR/go exists), then answers with a text
  streamed in small deltas.

``charge`` and ``pay`` append ``<idempotency key> <pid>`` to DIR/effects for each real execution
(fsynced: a SIGKILL right after keeps it); ``charge`` then waits while DIR/hold exists. Their
reconcile step reads DIR/effects, so a call found started after a crash is settled, not run
again. ``wait_gate`` appends ``<session id> <pid>`` to DIR/gate when it starts.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from fsm_agent import Agent, ScriptedProvider, ToolContext, tool  # noqa: E402
from fsm_agent.providers import tool_call_response  # noqa: E402
from fsm_agent.tools import RUN_AGAIN  # noqa: E402
from fsm_agent.types import MessageRequest, ToolResultMessage, ToolUseBlock, UserMessage  # noqa: E402

DIR = Path(os.environ.get("PG_WORKER_DIR", "."))
FINAL_TEXT = "the gate is open and everything is done"


def _record(name: str, line: str) -> None:
    with open(DIR / name, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _done(key: str) -> bool:
    path = DIR / "effects"
    return path.exists() and any(ln.split()[0] == key for ln in path.read_text().splitlines() if ln.strip())


@tool(effect="side_effect")
async def charge(amount: int, ctx: ToolContext) -> str:
    """Charge the card.

    Args:
        amount: in cents.
    """
    _record("effects", f"{ctx.idempotency_key} {os.getpid()}")
    while (DIR / "hold").exists():
        await asyncio.sleep(0.05)
    return f"charged {amount}"


@charge.on_reconcile
def _charge_reconcile(arguments: dict[str, Any], ctx: ToolContext) -> Any:
    return f"charged {arguments['amount']}" if _done(ctx.idempotency_key) else RUN_AGAIN


@tool(effect="side_effect")
def pay(amount: int, ctx: ToolContext) -> str:
    """Pay the invoice (a person approves).

    Args:
        amount: in cents.
    """
    _record("effects", f"{ctx.idempotency_key} {os.getpid()}")
    return f"paid {amount}"


@pay.on_reconcile
def _pay_reconcile(arguments: dict[str, Any], ctx: ToolContext) -> Any:
    return f"paid {arguments['amount']}" if _done(ctx.idempotency_key) else RUN_AGAIN


@tool(effect="idempotent")  # not pure: its "started" is committed before it runs
async def wait_gate(ctx: ToolContext) -> str:
    """Wait until the gate opens."""
    _record("gate", f"{ctx.session_id} {os.getpid()}")
    while not (DIR / "go").exists():
        await asyncio.sleep(0.05)
    return "open"


def answer(request: MessageRequest) -> Any:
    """The model: the first user message names the script; tool results say how far it got."""
    task = next((m.text for m in request.messages if isinstance(m, UserMessage)), "")
    done = sum(isinstance(m, ToolResultMessage) for m in request.messages)
    if task.startswith("charge"):
        return tool_call_response(ToolUseBlock("call_charge", "charge", {"amount": 10})) if not done else "charged"
    if task.startswith("pay"):
        return tool_call_response(ToolUseBlock("call_pay", "pay", {"amount": 5})) if not done else "paid"
    if task.startswith("gate"):
        return tool_call_response(ToolUseBlock("call_gate", "wait_gate", {})) if not done else FINAL_TEXT
    return "nothing to do"


def build() -> Agent:
    """The agent the workers (and the test's server replicas) use."""
    from fsm_agent_middleware.approval import HumanApproval

    provider = ScriptedProvider([answer], repeat_last=True, chunk_chars=4, stream_delay=0.02)
    return Agent(provider, tools=[charge, pay, wait_gate], middleware=[HumanApproval(tools=["pay"])],
                 lease_ttl=float(os.environ.get("PG_WORKER_LEASE_TTL", "1.0")), control_poll=0.1)


if __name__ == "__main__":
    import argparse

    from fsm_agent.cli.worker import add_worker_command

    dsn, DIR_ARG, *rest = sys.argv[1:]
    os.environ["PG_WORKER_DIR"] = DIR_ARG
    parser = argparse.ArgumentParser(prog="pg_worker")
    add_worker_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["worker", "--store", dsn, "--agent", "pg_worker:build", "--poll", "0.5", *rest])
    sys.exit(args.handler(args, sys.stdout, sys.stderr))
