"""A Temporal dev server for the tests of fsm_agent.temporal (DESIGN.md §7): the one `.ci/run`
started (``$FSM_AGENT_TEST_TEMPORAL``, host:port), else one started here on a free loopback port."""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture(scope="session")
def temporal_target():
    given = os.environ.get("FSM_AGENT_TEST_TEMPORAL")
    if given:
        yield given
        return
    from fsm_agent.temporal.devserver import DevServer

    with DevServer() as server:
        yield server.target


@pytest.fixture
async def temporal_client(temporal_target):
    from temporalio.client import Client

    return await Client.connect(temporal_target)


@pytest.fixture
def task_queue() -> str:
    return "fsm-test-" + uuid.uuid4().hex[:8]
