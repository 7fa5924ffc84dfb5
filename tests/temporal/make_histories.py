"""Record the workflow histories tests/temporal/test_history_replay.py replays (run it when a change to
the engine is meant to change them, and say so in the release notes: runs in flight on old workers
need the old code; see docs/temporal.md, "Upgrading workers").

    python tests/temporal/make_histories.py
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


async def main() -> None:
    from temporalio.client import Client

    from fsm_agent import Agent, Decision, ScriptedProvider
    from fsm_agent.temporal import TemporalHost, create_worker
    from fsm_agent.temporal.devserver import DevServer
    from tests.temporal.history_agents import AGENTS

    out = HERE / "histories"
    out.mkdir(exist_ok=True)
    with DevServer() as server:
        client = await Client.connect(server.target)
        agents = {name: make() for name, make in AGENTS.items()}
        async with create_worker(client, agents, task_queue="histories"):
            name = "history:trip"
            starter = Agent(ScriptedProvider([]), store=agents[name].store,
                            host=TemporalHost(client, agent_name=name, task_queue="histories"))
            first = await starter.run("Plan a trip", session_id="trip")
            call = first.stop.pending_actions[0].call.id
            await starter.resume("trip", decisions={call: Decision.approve()})
            history = await client.get_workflow_handle("trip").fetch_history()
            (out / "trip.json").write_text(history.to_json())
    print(f"wrote {out / 'trip.json'}")


if __name__ == "__main__":
    asyncio.run(main())
