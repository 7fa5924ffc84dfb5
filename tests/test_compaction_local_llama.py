"""Compaction end to end on the real local llama.cpp model: SmolLM2-135M served with a
2,048-token window (the window the model was trained with; a server of its own, so that the
prompts stay short enough for a 2-core CI machine).

A task whose transcript grows to several times the window: every turn must call ``read_page``
(``tool_choice="required"``), and each page is about 600 tokens. Without compaction the third call
would overflow the window. With the ``compaction`` plugin the run goes to its iteration
budget without a context-length failure, the log keeps every page, and the goal and the
prohibitions are in the last context the model was sent. The model is tiny: what is checked is the
runtime, not the model's judgement (the summary it writes may be rejected by the consistency check,
in which case the labelled deterministic fallback keeps the context in budget).
"""

from __future__ import annotations

from typing import Any

import pytest

from fsm_agent import Agent, Middleware, RunConfig, StopReason, tool
from fsm_agent.store import MemoryStore
from fsm_agent.types import count_message_tokens
from fsm_agent_middleware.compaction import Compaction

pytestmark = pytest.mark.llama

GOAL = "Collect the quarterly figures from the archive pages and report the total."
PROHIBITION = "Never delete any archive page."
WINDOW = 2048


@tool
def read_page(n: int) -> str:
    """Read one archive page."""
    rows = "\n".join(f"row {i}: account {1000 + i} moved {i * 7 % 997}.{i % 100:02d} EUR on day {i % 28 + 1}"
                     for i in range(30))
    return f"archive page {n}\n{rows}\nend of page {n}"


class LastRequest(Middleware):
    """Keeps the messages of every model request as sent (inside the compaction plugin)."""

    name = "last_request"

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        self.requests.append(request)
        return await call_next(request)


@pytest.fixture(scope="module")
def small_window_server():
    """A llama.cpp server of its own with a 2,048-token window."""
    from fsm_agent.local import LocalLlamaServer

    with LocalLlamaServer(ctx_size=WINDOW) as server:
        yield server


@pytest.fixture
async def patient_provider(small_window_server):
    """The local model, with room for a slow first token on a busy 2-core machine."""
    from fsm_agent import create_provider
    from fsm_agent.providers import ProviderConfig

    provider = create_provider("llamacpp", ProviderConfig(base_url=small_window_server.base_url,
                                                          first_token_timeout=300.0))
    yield provider
    await provider.aclose()


@pytest.mark.timeout(900)
async def test_a_task_several_windows_long_finishes_and_keeps_its_goal_and_prohibitions(patient_provider) -> None:
    spy = LastRequest()
    store = MemoryStore()
    agent = Agent(patient_provider, tools=[read_page], store=store,
                  middleware=[Compaction(max_context_tokens=WINDOW, output_reserve_tokens=150, trigger_tokens=0.6,
                                         target_tokens=0.4, max_summary_tokens=300, store=store), spy],
                  config=RunConfig(tool_choice="required", temperature=0.0, max_iterations=14,
                                   max_output_tokens=120, max_wall_clock=900,
                                   # the core loop notice is added after compaction: with it this 2k-window
                                   # run overflows (an open defect, see the issue 23 note); this test is compaction's
                                   loop_detection=None))
    result = await agent.run(f"{GOAL} {PROHIBITION} Read the pages one by one with read_page.")
    assert result.stop.reason is StopReason.PAUSED_BUDGET, (result.stop.reason, result.stop.detail, result.stop.error)
    assert result.stop.budget == "iterations"
    transcript_tokens = count_message_tokens(list(result.messages))
    assert transcript_tokens > 3 * WINDOW, transcript_tokens  # the task outgrew the window several times
    events = await store.read_events(result.session_id)
    types = [e.type for e in events]
    assert "compaction" in types
    assert not any(e.type == "model_call" and e.payload.get("stop_reason") == "error" for e in events)
    last = spy.requests[-1]
    sent = "\n".join(m.text for m in last.messages if hasattr(m, "text"))
    assert GOAL in sent and PROHIBITION in sent
    assert len([r for r in spy.requests if r.tools]) == 14  # the run's own calls (not the summarizer's)
    for req in spy.requests:  # every call fitted the window (as the server counted it: it answered)
        assert count_message_tokens(list(req.messages)) < WINDOW
