"""Live ``delta`` frames carry the answer, not a plugin's side call.

A model-graded verifier asks the run's own (streaming) provider for a verdict from PostTurn
through ``ctx.call_provider``; its JSON streams to observers too, marked with the phase it was
made in (``ModelStreamEvent.phase``). The server's live frames (and the A2A answer chunks built
from them) must carry only the Model phase's text.
"""

from __future__ import annotations

import orjson

from fsm_agent import Agent, ModelStreamEvent, ScriptedProvider
from fsm_agent.server.notify import LiveDeltas, Notifier, NotifyingStore
from fsm_agent.store import MemoryStore
from fsm_agent_middleware.verifier import ModelGrader, Verifier

VERDICT = '{"ok": true, "reason": "GRADER-SAYS-FINE"}'


class Phases:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def on_model_event(self, event: ModelStreamEvent) -> None:
        text = getattr(event.event, "text", None)
        if text:
            self.seen.append((event.phase, text))


async def test_a_graders_stream_is_marked_and_kept_out_of_the_live_deltas() -> None:
    notifier = Notifier()
    sub = notifier.subscribe("s-live")
    phases = Phases()
    agent = Agent(ScriptedProvider(["THE-ANSWER", VERDICT]), middleware=[Verifier(ModelGrader())],
                  observers=[LiveDeltas(notifier), phases], store=NotifyingStore(MemoryStore(), notifier))
    result = await agent.run("say it", session_id="s-live")
    assert result.stop.reason.value == "COMPLETED" and result.output == "THE-ANSWER"

    # both calls streamed to observers, each marked with its phase
    by_phase: dict[str, str] = {}
    for phase, text in phases.seen:
        by_phase[phase] = by_phase.get(phase, "") + text
    assert by_phase.get("Model") == "THE-ANSWER"
    assert "GRADER-SAYS-FINE" in by_phase.get("PostTurn", "")

    # only the answer became a live delta frame
    frames = [frame for _, frame in sub.live if frame.startswith(b"event: delta\n")]
    texts = "".join(orjson.loads(f.split(b"data: ", 1)[1].split(b"\n", 1)[0])["text"] for f in frames)
    assert texts == "THE-ANSWER"
