"""Compaction's three invariants (docs/compaction.md), as property tests over generated valid
conversations (``fsm_agent.testing.conversations``), after every level:

1. **pairing** — every result follows its call, every call has exactly one result (the pending
   tail aside), ids unique per step; L1 and L3 keep every message and call id;
2. **a failed compaction changes nothing** — a fault-injecting summarizer: no record, the records
   and the view byte for byte as before, one failed attempt saying why;
3. **provenance** — a spy summarizer: a view that shrank by a summary implies a summarizer call
   whose input was exactly the removed range's view; the summary holds its output verbatim; a view
   rebuilt from the log's events equals the live view; nothing that had to be kept was lost.

And a sample of compacted contexts sent to the strict scripted server (HTTP 400 on any unpaired
call) is accepted every time.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Sequence
from typing import Any

import orjson
from attrs import evolve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


from fsm_agent import MessageRequest, OutputSchema
from fsm_agent.providers import ProviderConfig, create_provider
from fsm_agent.testing.conversations import Conversation, check_pairing, random_conversation
from fsm_agent.testing.strict import StrictServer, text
from fsm_agent.types import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolResultMessage,
    UserMessage,
    structure,
    unstructure,
)
from .test_compaction import _answer, _cancelled, _raises, _slow
from fsm_agent_middleware.compaction import (
    SUMMARY_PREFIX,
    Compacted,
    CompactionOptions,
    CompactionRecord,
    Essentials,
    SummarizerResult,
    apply_records,
    check_consistency,
    compact,
    render_summary,
    view_spans,
)

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
OPTIONS = CompactionOptions(min_summary_input_tokens=1, artifact_min_chars=4000, preview_chars=600,
                            summarizer_timeout=0.01, max_summary_tokens=4000)
SEEDS = st.integers(0, 2**64 - 1)
"""Conversations are drawn by seed (``random_conversation(Random(seed))``, as
``conversation_strategy`` does), so a failing example prints as a short seed."""


def conversation(seed: int) -> Conversation:
    return random_conversation(random.Random(seed))


def tokens(messages: Sequence[Message]) -> int:
    """A cheap stand-in for tiktoken (the counts are not what is under test here)."""
    return 3 + sum(4 + (len(m.text) + sum(len(orjson.dumps(c.input)) for c in getattr(m, "tool_calls", ()))) // 4
                   for m in messages)


def dumps(messages: Sequence[Message]) -> bytes:
    return orjson.dumps([unstructure(m, Message) for m in messages], option=orjson.OPT_SORT_KEYS)


def essentials(conv: Conversation) -> Essentials:
    return Essentials(conv.goal, 1, conv.prohibitions, conv.facts, conv.pending)


def shape(messages: Sequence[Message]) -> list[tuple[str, tuple[str, ...]]]:
    """Roles and call / result ids, in order."""
    out = []
    for m in messages:
        if isinstance(m, AssistantMessage):
            out.append(("assistant", tuple(c.id for c in m.tool_calls)))
        elif isinstance(m, ToolResultMessage):
            out.append(("tool", (m.tool_call_id,)))
        else:
            out.append((m.role, ()))
    return out


class Spy:
    """A faithful summarizer: states every fact and prohibition its input holds; records its inputs."""

    def __init__(self, conv: Conversation) -> None:
        self.conv = conv
        self.calls: list[tuple[tuple[Message, ...], dict[str, Any], str]] = []

    async def __call__(self, messages: Sequence[Message], schema: OutputSchema) -> Any:
        seen = " ".join(" ".join(m.text.split()) for m in messages).casefold()
        facts = [f for f in self.conv.facts if f.casefold() in seen]
        out = {"goal": self.conv.goal, "goal_version": 1, "decisions": [f"went through {len(messages)} messages"],
               "failures": [], "verified_facts": [{"fact": f, "evidence": "a tool result"} for f in facts],
               "prohibitions": [p for p in self.conv.prohibitions if p.casefold() in seen],
               "todos": ["go on"], "pending_actions": []}
        call_id = f"spy-{len(self.calls)}"
        self.calls.append((tuple(messages), out, call_id))
        return SummarizerResult(out, call_id)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- 1. pairing, after every level ---------------------------------------------------------------

@SETTINGS
@given(SEEDS)
def test_pairing_holds_after_every_level(seed: int) -> None:
    conv = conversation(seed)
    msgs, ess = list(conv.messages), essentials(conv)
    assert check_pairing(msgs) == []
    for level in ("L1", "L3", "L2"):
        out = run(compact(msgs, [], target=None, levels=(level,), summarizer=Spy(conv), essentials=ess,
                          options=OPTIONS, tokens=tokens))
        assert check_pairing(list(out.view)) == [], level
        if level != "L2":  # every message, call and id stays
            assert shape(out.view) == shape(msgs)
    # the whole escalation, with the fallback, checked after each record
    out = run(compact(msgs, [], target=1, hard_limit=1, summarizer=Spy(conv), essentials=ess, options=OPTIONS,
                      tokens=tokens))
    for k in range(1, len(out.records) + 1):
        view = apply_records(msgs, out.records[:k])
        assert check_pairing(view) == [], out.records[k - 1].level
        pending = {c.id for m in view if isinstance(m, AssistantMessage) for c in m.tool_calls}
        assert set(conv.pending) <= pending  # the pending tail is never compacted away


# -- 2. a failed compaction changes nothing ---------------------------------------------------------

# the fault-injecting summarizers of the unit tests (one place): raise, hang past the timeout,
# be cancelled, answer a fixed value
_raise, _hang, _cancel, _returns = _raises, _slow, _cancelled, _answer


_EMPTY = {"goal": "", "goal_version": 1, "decisions": [], "failures": [], "verified_facts": [], "prohibitions": [],
          "todos": [], "pending_actions": []}
FAULTS = {
    "raise": (_raise, "raised"),
    "timeout": (_hang, "timeout"),
    "cancel": (_cancel, "cancelled"),
    "empty": (_returns(_EMPTY), "empty"),
    "whitespace": (_returns({**_EMPTY, "goal": " \n ", "todos": ["\t"]}), "empty"),
    "over-budget": (_returns({**_EMPTY, "goal": "g", "decisions": ["word " * 400] * 40}), "over_budget"),
    "sorry": (_returns({**_EMPTY, "goal": "I'm sorry, I cannot help with summarising this."}), "error_text"),
    "error": (_returns({**_EMPTY, "goal": "Error: context window exceeded"}), "error_text"),
    "http-error": (_returns({**_EMPTY, "goal": "Error code: 429 - {'error': {'message': 'Rate limit reached for "
                                               "requests', 'type': 'requests', 'code': 'rate_limit_exceeded'}}"}),
                   "error_text"),
    "not-json": (_returns("The conversation was about invoices."), "invalid"),
    # a valid answer with the wrong goal version: rejected by the check (or, when the range is
    # shorter than even this summary, as over budget first)
    "version": (_returns({**_EMPTY, "goal": "g", "goal_version": 7}), ("inconsistent", "over_budget")),
}


@SETTINGS
@given(SEEDS, st.sampled_from(sorted(FAULTS)), st.booleans())
def test_a_failed_summary_changes_nothing(seed: int, fault: str, earlier: bool) -> None:
    conv = conversation(seed)
    msgs, ess = list(conv.messages), essentials(conv)
    records: list[CompactionRecord] = []
    if earlier:  # on top of L1 / L3 records already committed
        records = list(run(compact(msgs, [], target=None, levels=("L1", "L3"), essentials=ess, options=OPTIONS,
                                   tokens=tokens)).records)
    snapshot = orjson.dumps([unstructure(r) for r in records])
    before = dumps(apply_records(msgs, records))
    summarizer, reason = FAULTS[fault]
    out = run(compact(msgs, records, target=None, levels=("L2",), summarizer=summarizer, essentials=ess,
                      options=OPTIONS, tokens=tokens, fallback=False))
    assert out.committed == () and out.records == tuple(records)
    assert orjson.dumps([unstructure(r) for r in records]) == snapshot
    assert dumps(out.view) == before
    reasons = [a.failure.reason for a in out.attempts if a.failure]
    assert reasons == [] or (len(reasons) == 1 and reasons[0] in (reason if isinstance(reason, tuple) else (reason,)))
    assert not any(m.text.startswith(SUMMARY_PREFIX) and "summarised" in m.text for m in out.view)


# -- 3. provenance ------------------------------------------------------------------------------

def _from_log(records: Sequence[CompactionRecord]) -> list[CompactionRecord]:
    """The records as a resume reads them: each one's ``compaction`` event through the log's JSON."""
    out = []
    for k, r in enumerate(records):
        payload = orjson.loads(orjson.dumps(unstructure(Compacted("s", 1, "pre_turn", r, 2, 1, k))))
        out.append(structure(payload["record"], CompactionRecord))
    return out


@SETTINGS
@given(SEEDS, st.integers(1, 3))
def test_provenance_a_summary_comes_from_a_summarizer_call_over_the_range(seed: int, keep: int) -> None:
    conv = conversation(seed)
    msgs, ess = list(conv.messages), essentials(conv)
    spy = Spy(conv)
    options = evolve(OPTIONS, keep_last_turns=keep)
    out = run(compact(msgs, [], target=1, summarizer=spy, essentials=ess, options=options, tokens=tokens))
    summaries = [(k, r) for k, r in enumerate(out.records) if r.level == "L2"]
    assert len(summaries) == len(spy.calls) or any(a.failure for a in out.attempts)
    for (k, rec), (given_in, output, call_id) in zip(summaries, spy.calls, strict=False):
        before = view_spans(msgs, out.records[:k])
        removed = tuple(m for m, a, b in before if a >= rec.first and b <= rec.last and not isinstance(m, SystemMessage))
        assert given_in == removed  # the summarizer's input covered exactly what the summary removed
        assert rec.summarizer_call_id == call_id and rec.summary_output == output
        assert rec.summary == render_summary(output, first=rec.first, last=rec.last, call_id=call_id)
        assert rec.summary_sha256 == hashlib.sha256(rec.summary.encode()).hexdigest()
        after = view_spans(msgs, out.records[:k + 1])
        shown = [(m, a, b) for m, a, b in after if (a, b) == (rec.first, rec.last) and a != b or
                 (a == b == rec.first and isinstance(m, UserMessage) and m.text == rec.summary)]
        assert [m.text for m, _, _ in shown] == [rec.summary]
        # the removed messages are exactly the range: outside it, the view is unchanged
        assert [x for x in after if x[2] < rec.first or x[1] > rec.last] == \
            [x for x in before if x[2] < rec.first or x[1] > rec.last]
    # a view rebuilt from the log equals the live view, byte for byte
    assert dumps(apply_records(msgs, _from_log(out.records))) == dumps(out.view)
    # nothing that had to be kept was lost, and every record says what it kept
    assert check_consistency(msgs, list(out.view), ess) == []
    for r in out.records:
        assert set(r.kept) <= set(ess.items)


# -- the strict server -----------------------------------------------------------------------------

SAMPLE = 40


def _sample() -> list[tuple[Conversation, list[Message]]]:
    out = []
    for seed in range(SAMPLE):
        conv = random_conversation(random.Random(1000 + seed), reuse_ids=0.0, pending_tail=0.0, split_calls=0.0,
                                   big_results=0.4)
        msgs = list(conv.messages)
        view = list(run(compact(msgs, [], target=1, hard_limit=1, summarizer=Spy(conv), essentials=essentials(conv),
                                options=OPTIONS, tokens=tokens)).view)
        out.append((conv, view))
    return out


def _sendable(messages: list[Message]) -> tuple[Message, ...]:
    """As the driver sends a history: a user message asks to go on after a final assistant answer."""
    if isinstance(messages[-1], AssistantMessage) and not messages[-1].tool_calls:
        messages = [*messages, UserMessage("Continue.")]
    return tuple(messages)


async def test_a_sample_of_compacted_contexts_is_accepted_by_the_strict_server() -> None:
    sample = await asyncio.to_thread(_sample)
    assert sum(1 for _, v in sample if any(m.text.startswith(SUMMARY_PREFIX) for m in v)) >= SAMPLE // 2
    server = StrictServer([text("ok")])
    base = await server.start()
    provider = create_provider("openai", ProviderConfig(base_url=base, api_key="x", model="m"))
    try:
        for _, view in sample:
            await provider.chat(MessageRequest("m", _sendable(view)))
        assert server.rejected == [] and server.accepted == SAMPLE
        # a view that lost one result: the server refuses the call bare (tests/providers/
        # test_history_shapes.py), so the protocol module answers it with the error result every
        # protocol sends for a call with no recorded result, and the request is accepted
        _, view = next((c, v) for c, v in sample if any(isinstance(m, ToolResultMessage) for m in v))
        broken = [m for m in view if m is not next(x for x in view if isinstance(x, ToolResultMessage))]
        await provider.chat(MessageRequest("m", _sendable(broken)))
        assert server.rejected == [] and "No result was recorded for this call" in str(server.requests[-1])
    finally:
        await provider.aclose()
        await server.close()
