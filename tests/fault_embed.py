"""An embedding process for the SIGTERM matrix: runs a session inside
``async with agent.drain_on_signals()`` and lingers in PHASE (touching READY when it is there)
until a signal arrives. Prints the result's stop as JSON.

    python tests/fault_embed.py DB BASE_URL COUNTER SESSION PHASE READY
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).parent))

from faults_common import act_tool, agent_for  # noqa: E402

from fsm_agent import Middleware  # noqa: E402
from fsm_agent.store import SQLiteStore  # noqa: E402

DB, BASE, COUNTER, SESSION, PHASE, READY = sys.argv[1:7]


async def linger(phase: str) -> None:
    if phase == PHASE and not Path(READY).exists():
        Path(READY).touch()
        await asyncio.sleep(3)


class Linger(Middleware):
    async def pre_turn(self, ctx: Any) -> None:
        await linger("PreTurn")

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        await linger("Model")
        return await call_next(request)

    async def post_turn(self, ctx: Any) -> Any:
        if ctx.turn == 1:
            await linger("PostTurn")
        return None


async def main() -> None:
    store = SQLiteStore(DB)
    agent = agent_for(BASE, store, [act_tool("side_effect", Path(COUNTER), after=lambda ctx: linger("MidTurn"))],
                      middleware=[Linger()], stream=True)
    async with agent.drain_on_signals():
        result = await agent.run("do it", session_id=SESSION)
    await agent.provider.aclose()
    rec = await store.get_session(SESSION)
    print(orjson.dumps({"reason": result.stop.reason.value, "detail": result.stop.detail,
                        "lease_owner": rec.lease_owner}).decode())
    await store.close()


asyncio.run(main())
