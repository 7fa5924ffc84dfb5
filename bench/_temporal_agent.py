"""The agent of the Temporal fault campaign (bench/temporal_faults.py), built the same in every worker
process and in the harness: a model on a strict scripted server ($FAULTS_MODEL_URL), three tools
(one per declared effect) that append what they did to an fsync'd file ($FAULTS_EFFECTS), the session
store at $FAULTS_STORE. A tool whose name ends in ``_ok`` waits for a person's approval first."""

from __future__ import annotations

import asyncio
import os
import random

import orjson

from fsm_agent import Agent, RunConfig, ToolContext, create_provider, tool
from fsm_agent.providers import ProviderConfig
from fsm_agent.store import SQLiteStore
from fsm_agent_middleware.approval import HumanApproval


def _effect(kind: str, n: int, ctx: ToolContext) -> None:
    line = orjson.dumps({"session": ctx.session_id, "call": ctx.call_id, "key": ctx.idempotency_key, "kind": kind,
                         "n": n, "pid": os.getpid()}) + b"\n"
    fd = os.open(os.environ["FAULTS_EFFECTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


async def _act(kind: str, n: int, ctx: ToolContext) -> str:
    await asyncio.sleep(random.uniform(0.1, 0.6))  # a kill may land before the effect ...
    _effect(kind, n, ctx)
    await asyncio.sleep(random.uniform(0.1, 0.6))  # ... or after it, before the result is recorded
    return f"{kind} {n} done"


@tool(effect="pure")
async def act_pure(n: int, ctx: ToolContext) -> str:
    """Do pure work n."""
    return await _act("pure", n, ctx)


@tool(effect="idempotent")
async def act_idem(n: int, ctx: ToolContext) -> str:
    """Do idempotent work n (with the call's idempotency key)."""
    return await _act("idempotent", n, ctx)


@tool(effect="side_effect")
async def act_side(n: int, ctx: ToolContext) -> str:
    """Do side-effect work n."""
    return await _act("side_effect", n, ctx)


@tool(effect="side_effect")
async def act_side_ok(n: int, ctx: ToolContext) -> str:
    """Do side-effect work n, after a person's approval."""
    return await _act("side_effect", n, ctx)


def agent() -> Agent:
    provider = create_provider("openai-compatible", ProviderConfig(
        base_url=os.environ["FAULTS_MODEL_URL"], model="scripted", api_key="x"))
    return Agent(provider, tools=[act_pure, act_idem, act_side, act_side_ok],
                 middleware=[HumanApproval(tools=["act_side_ok"])], store=SQLiteStore(os.environ["FAULTS_STORE"]),
                 config=RunConfig(max_iterations=6, max_wall_clock=None))
