"""The review page in Chromium against a session that runs on Temporal: the server serves the log
the workers write, two tabs follow it live, an approval from the page resumes the workflow."""

from __future__ import annotations

import uuid
from pathlib import Path

from fsm_agent import Agent, ScriptedProvider
from fsm_agent.store import SQLiteStore
from fsm_agent.temporal import TemporalHost, create_worker
from fsm_agent_middleware.approval import HumanApproval
from tests.server.test_browser import browser, create_session, pay, review_two_tabs, scripted_agent, serving


async def test_two_tabs_approve_a_temporal_session(temporal_client, task_queue, tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    name = "tests.review:" + uuid.uuid4().hex[:6]
    worker_agent = scripted_agent(store)
    served = Agent(ScriptedProvider([]), tools=[pay], middleware=[HumanApproval("pay")], store=store,
                   host=TemporalHost(temporal_client, agent_name=name, task_queue=task_queue))
    async with create_worker(temporal_client, {name: worker_agent}, task_queue=task_queue), \
            serving(served, store) as base, browser() as tabs:
        await create_session(base, "tweb1", "pay 5")
        out = await review_two_tabs(tmp_path, base, "tweb1", "pay", 20_000, tabs, "temporal")
    log = await store.read_events("tweb1")
    assert out["last_seq"] == log[-1].seq and log[-1].type == "run_stopped"
    (resume,) = [e for e in log if e.type == "resume"]
    assert resume.payload["decisions"][out["call_id"]]["kind"] == "approve"
    assert (await temporal_client.get_workflow_handle("tweb1").describe()).status.name == "COMPLETED"
