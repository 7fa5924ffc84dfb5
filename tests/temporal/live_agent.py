"""An agent for the CLI test of live deltas on Temporal (built the same in the worker process and
the test): one streamed answer, which starts only once the file ``$FSM_TEST_GATE`` exists (the test
makes it when its SSE client is connected); the sessions in PostgreSQL at ``$FSM_TEST_STORE``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from fsm_agent import Agent, ScriptedProvider
from fsm_agent.store import PostgresStore

ANSWER = "Paris is the capital of France, on the Seine."


class FileGated(ScriptedProvider):
    """A ScriptedProvider whose streams wait for the file ``gate``."""

    def __init__(self, gate: Path) -> None:
        super().__init__([ANSWER], repeat_last=True, stream_delay=0.02, chunk_chars=4)
        self.gate = gate

    async def chat_stream(self, request: Any) -> Any:  # type: ignore[override]
        while not self.gate.exists():
            await asyncio.sleep(0.02)
        async for ev in super().chat_stream(request):
            yield ev


def agent() -> Agent:
    return Agent(FileGated(Path(os.environ["FSM_TEST_GATE"])), store=PostgresStore(os.environ["FSM_TEST_STORE"]))
