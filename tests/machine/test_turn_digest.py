"""The context hash of a turn is ``sha256(orjson.dumps(unstructure(request)))`` whatever way the
conversation changed since the turn before (grown, rewritten by a plugin, cut by compaction, tools
changed): the recorder carries the hash state over the messages two requests share, so it must
never carry a stale one."""

from __future__ import annotations

import hashlib

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_agent.machine.journal import Journal
from fsm_agent.machine.live import LivePort
from fsm_agent.machine.state import RunState
from fsm_agent.machine.turns import TurnRecorder
from fsm_agent.store.memory import MemoryStore
from fsm_agent.types import AssistantMessage, MessageRequest, SystemMessage, ToolDefinition, UserMessage
from fsm_agent.types.codec import unstructure

POOL = [SystemMessage("sys"), UserMessage("hi"), AssistantMessage("hello"), UserMessage('a "messages":[] b'),
        UserMessage("x" * 50), UserMessage("ünï")]
TOOLS = (ToolDefinition("t", "a tool", {"type": "object", "properties": {}}),)


def full(request: MessageRequest) -> str:
    return hashlib.sha256(orjson.dumps(unstructure(request))).hexdigest()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, len(POOL) - 1), max_size=8), st.booleans(),
                          st.sampled_from(["m", 'm"x', ""]), st.one_of(st.none(), st.integers(1, 99))),
                min_size=1, max_size=6))
def test_each_turns_hash_is_the_whole_requests_hash(turns: list) -> None:
    rec = TurnRecorder(Journal(LivePort(MemoryStore()), "s", 1), RunState(), "s")
    grown: list = []
    for picks, tools, model, max_tokens in turns:
        # half the time the conversation grows by the picked messages (same objects: the carried state is
        # used), else it is replaced by them (a rewrite: the state must not be reused)
        messages = grown + [POOL[i] for i in picks] if len(picks) % 2 else [POOL[i] for i in picks]
        grown = messages
        request = MessageRequest(model, tuple(messages), tools=TOOLS if tools else (), max_tokens=max_tokens)
        assert rec.digest(request) == full(request)
