"""A Temporal dev server for the tests of fsm_agent.temporal (DESIGN.md §7): the one `.ci/run`
started (``$FSM_AGENT_TEST_TEMPORAL``, host:port), else one started here on a free loopback port."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest


def _wait_for(target: str, timeout: float = 60.0) -> None:
    """Wait until the server at ``target`` (host:port) takes connections; fail saying so otherwise."""
    host, _, port = target.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                pytest.fail(f"FSM_AGENT_TEST_TEMPORAL={target}: no Temporal server answers there ({exc})")
            time.sleep(0.5)


@pytest.fixture(scope="session")
def temporal_target():
    given = os.environ.get("FSM_AGENT_TEST_TEMPORAL")
    if given:
        _wait_for(given)
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
