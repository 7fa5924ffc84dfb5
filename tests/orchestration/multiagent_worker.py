"""A worker process for the multi-agent fault tests: runs (or resumes) one of the three patterns on
an SQLite store, with a side-effecting ``send`` tool in the child sessions.

    python tests/orchestration/multiagent_worker.py DB DIR run    PATTERN SESSION
    python tests/orchestration/multiagent_worker.py DB DIR resume PATTERN SESSION

PATTERN is ``agent_tool``, ``handoff`` or ``team``. The children send to ``ann`` and then to
``bob`` (the team: one worker each). ``send`` appends the recipient to ``DIR/effects`` (one line
per side effect that happened); in a ``run``, the send to ``bob`` writes ``DIR/ready`` and then
blocks, so the test can kill this process there, or interrupt the session through the store.
Its ``on_reconcile`` hook reads ``DIR/effects`` (did the cut send happen?). Every model is a
scripted function of the request, so a resumed run in another process answers the same way.
Prints the stop as JSON on stdout.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson

from fsm_agent import Agent, ScriptedProvider, ToolContext, tool
from fsm_agent.orchestration.handoff import Handoffs
from fsm_agent.orchestration.subagent import agent_tool
from fsm_agent.orchestration.team import DISPATCH, Team
from fsm_agent.providers import text_response, tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.tools import RUN_AGAIN
from fsm_agent.types import MessageRequest, ToolResultMessage

DB, DIR, ACTION, PATTERN, SESSION = sys.argv[1:6]
EFFECTS, READY = Path(DIR) / "effects", Path(DIR) / "ready"
PKG = {"goal": "mail ann and bob", "verified_facts": ["both want the report"], "open_actions": ["mail ann", "mail bob"],
       "summary": "triage found who needs the report"}


def results(request: MessageRequest) -> int:
    return sum(isinstance(m, ToolResultMessage) for m in request.messages)


def user_text(request: MessageRequest) -> str:
    return next(m.text for m in request.messages if m.role == "user")


@tool(effect="side_effect")
async def send(to: str, ctx: ToolContext) -> str:
    """Send the report."""
    if ACTION == "run" and to == "bob":
        READY.write_text(ctx.session_id)
        await asyncio.sleep(3600)
    with EFFECTS.open("a") as f:
        f.write(to + "\n")
    return f"sent to {to}"


@send.on_reconcile
def _reconcile(arguments: dict[str, Any], ctx: ToolContext) -> Any:
    done = EFFECTS.read_text().split() if EFFECTS.exists() else []
    return f"sent to {arguments['to']}" if arguments["to"] in done else RUN_AGAIN


def child_script(request: MessageRequest) -> Any:
    """The child: send to ann, then to bob, then answer (a worker: send to its one recipient)."""
    n = results(request)
    task = user_text(request)
    if task in ("mail ann", "mail bob"):  # a team worker: one recipient
        return tool_call_response(("send", {"to": task[5:]})) if n == 0 else text_response(f"{task}: done")
    if n < 2:
        return tool_call_response(("send", {"to": ["ann", "bob"][n]}))
    return text_response("both sent")


def parent_script(request: MessageRequest) -> Any:
    if results(request):
        return text_response("parent done")
    if PATTERN == "agent_tool":
        return tool_call_response(("mailer", {"task": "mail ann and bob"}))
    if PATTERN == "handoff":
        return tool_call_response(("handoff_to_mailer", PKG))
    return tool_call_response((DISPATCH, {"subtasks": [{"task": "mail ann"}, {"task": "mail bob"}]}))


async def main() -> None:
    store = SQLiteStore(DB)
    opts: dict[str, Any] = {"store": store, "lease_ttl": 1.5, "control_poll": 0.05}
    child = Agent(ScriptedProvider([child_script], repeat_last=True), tools=[send], **opts)
    parent = Agent(ScriptedProvider([parent_script], repeat_last=True), **opts)
    try:
        if PATTERN == "agent_tool":
            parent = Agent(parent.provider, tools=[agent_tool(child, name="mailer", description="Mail.")], **opts)
            result: Any = await (parent.run("send the report", session_id=SESSION) if ACTION == "run"
                                 else parent.resume(SESSION))
            stop, output = result.stop, result.output
        elif PATTERN == "handoff":
            chain = Handoffs({"triage": parent, "mailer": child}, routes={"triage": ["mailer"]})
            result = await (chain.run("send the report", start="triage", session_id=SESSION) if ACTION == "run"
                            else chain.resume(SESSION))
            stop, output = result.stop, result.output
        else:
            team = Team(parent, child, max_parallel=2)
            result = await (team.run("send the report", session_id=SESSION) if ACTION == "run"
                            else team.resume(SESSION))
            stop, output = result.stop, result.output
        print(orjson.dumps({"stop": stop.reason.value, "detail": stop.detail, "output": output,
                            "input_tokens": result.usage.input_tokens}).decode(), flush=True)
    finally:
        await store.close()


asyncio.run(main())
