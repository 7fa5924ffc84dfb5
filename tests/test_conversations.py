"""fsm_agent.testing.conversations: the generator's output is always valid and deterministic, and
check_pairing catches each kind of violation."""

from __future__ import annotations

import random

import pytest
from attrs import evolve

from fsm_agent.testing import SUMMARY_PREFIX, Conversation, check_pairing, random_conversation
from fsm_agent.types import (
    AssistantMessage,
    SystemMessage,
    TextBlock,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
)

SEEDS = range(2000)


def _text(conv: Conversation) -> str:
    return "\n".join(m.text for m in conv.messages)


@pytest.fixture(scope="module")
def corpus() -> list[Conversation]:
    return [random_conversation(random.Random(s)) for s in SEEDS]


def test_every_generated_conversation_pairs(corpus: list[Conversation]) -> None:
    bad = {s: v for s, c in zip(SEEDS, corpus, strict=True) if (v := check_pairing(c.messages))}
    assert bad == {}


def test_without_reuse_ids_are_unique_in_the_whole_list() -> None:
    for s in range(300):
        c = random_conversation(random.Random(s), reuse_ids=0.0)
        assert check_pairing(c.messages, unique_ids="list") == [], s


def test_the_generator_covers_every_feature(corpus: list[Conversation]) -> None:
    seen = dict.fromkeys(("split", "shuffled", "reused", "cancelled", "interrupted", "big", "compacted",
                          "pending", "no_tools", "facts"), 0)
    for c in corpus:
        ms = c.messages
        seen["split"] += any(isinstance(a, AssistantMessage) and a.tool_calls and isinstance(b, AssistantMessage)
                             and b.tool_calls for a, b in zip(ms, ms[1:]))
        ids = [b.id for m in ms if isinstance(m, AssistantMessage) for b in m.tool_calls]
        seen["reused"] += len(ids) != len(set(ids))
        results = [m for m in ms if isinstance(m, ToolResultMessage)]
        order = {b.id: k for m in ms if isinstance(m, AssistantMessage) for k, b in enumerate(m.tool_calls)}
        seen["shuffled"] += any(order.get(a.tool_call_id, 0) > order.get(b.tool_call_id, 0)
                                for a, b in zip(results, results[1:]))
        seen["cancelled"] += any(r.text == "cancelled" and r.is_error for r in results)
        seen["interrupted"] += any(r.text.startswith("outcome unknown: interrupted") for r in results)
        seen["big"] += any(len(r.text) >= 5000 for r in results)
        seen["compacted"] += c.compacted
        seen["pending"] += bool(c.pending)
        seen["no_tools"] += not ids
        seen["facts"] += bool(c.facts)
    n = len(corpus)
    assert all(v > 0 for v in seen.values()), seen
    assert 0.05 * n < seen["compacted"] < 0.15 * n, seen
    assert 0.15 * n < seen["reused"] < 0.3 * n, seen


def test_shape_goal_prohibitions_facts_and_summary(corpus: list[Conversation]) -> None:
    for c in corpus[:500]:
        ms = c.messages
        assert isinstance(ms[0], SystemMessage) and isinstance(ms[1], UserMessage)
        assert c.goal in ms[1].text and all(p in ms[1].text for p in c.prohibitions)
        assert all(p.startswith("never ") for p in c.prohibitions)
        text = _text(c)
        assert len(set(c.facts)) == len(c.facts)
        for f in c.facts:
            assert text.count(f) == 1, (f, text.count(f))
        summaries = [m for m in ms if isinstance(m, UserMessage) and m.text.startswith(SUMMARY_PREFIX)]
        assert len(summaries) == c.compacted
        if c.compacted:
            assert ms[2] is summaries[0]
        if c.pending:
            tail_calls = [b.id for m in ms if isinstance(m, AssistantMessage) for b in m.tool_calls][-3:]
            assert set(c.pending) <= set(tail_calls)
            assert not isinstance(ms[-1], (UserMessage, SystemMessage))
            last = max(j for j, m in enumerate(ms) if isinstance(m, AssistantMessage))
            assert all(isinstance(m, ToolResultMessage) and m.tool_call_id not in c.pending for m in ms[last + 1:])


def test_big_results_are_5_to_60_kb() -> None:
    sizes = [len(m.text) for s in range(100) for m in random_conversation(random.Random(s), big_results=1.0).messages
             if isinstance(m, ToolResultMessage) and not m.is_error]
    assert sizes and min(sizes) >= 5000 and max(sizes) <= 61_000


def test_deterministic_per_seed() -> None:
    for s in (0, 1, 7, 123, 1999):
        assert random_conversation(random.Random(s)) == random_conversation(random.Random(s))
    assert random_conversation(random.Random(1)) != random_conversation(random.Random(2))


def test_options_are_honoured() -> None:
    for s in range(100):
        c = random_conversation(random.Random(s), turns=(2, 2), steps=(1, 1), parallel=(3, 3), split_calls=0.0,
                                cancelled=0.0, interrupted=0.0, compacted=0.0, pending_tail=0.0, facts=False)
        users = [m for m in c.messages if isinstance(m, UserMessage)]
        calls = [m for m in c.messages if isinstance(m, AssistantMessage) and m.tool_calls]
        assert len(users) == 2 and len(calls) == 2 and all(len(m.tool_calls) == 3 for m in calls)
        assert c.facts == () and c.pending == ()
    with pytest.raises(ValueError):
        random_conversation(random.Random(0), turns=(3, 1))
    with pytest.raises(ValueError):
        random_conversation(random.Random(0), parallel=(0, 2))


# -- check_pairing on hand-made bad inputs ---------------------------------------------------

S, U = SystemMessage("sys"), UserMessage("go")


def A(*ids: str, text: str = "") -> AssistantMessage:  # noqa: N802
    return AssistantMessage(((TextBlock(text),) if text else ()) + tuple(ToolUseBlock(i, "t") for i in ids))


def R(i: str) -> ToolResultMessage:  # noqa: N802
    return ToolResultMessage(i, "ok")


def test_valid_hand_made_histories() -> None:
    assert check_pairing([]) == []
    assert check_pairing([S, U, A("a", "b"), R("b"), R("a"), A(text="done")]) == []
    # split across two assistant messages, results after the second
    assert check_pairing([S, U, A("a"), A("b"), R("a"), R("b"), A(text="x")]) == []
    # reused id in a later step: allowed by default, not with unique_ids="list"
    reused = [S, U, A("call_0"), R("call_0"), A("call_0"), R("call_0"), U]
    assert check_pairing(reused) == []
    assert len(check_pairing(reused, unique_ids="list")) == 1
    # pending tail: unanswered calls of the last step, partly answered
    assert check_pairing([S, U, A("a", "b"), R("a")]) == []
    assert check_pairing([S, U, A("a")]) == []
    # a system message between a call and its result is ignored
    assert check_pairing([U, A("a"), S, R("a")]) == []


@pytest.mark.parametrize(("messages", "needle"), [
    ([U, R("a")], "does not follow its call"),                          # orphan result, no call
    ([U, R("a"), A("a")], "does not follow its call"),                  # result before its call
    ([U, A("a"), R("a"), R("a")], "second result"),                     # duplicate result
    ([U, A("a"), U, R("a")], "has no result before message 2 (user)"),  # result after a user message
    ([U, A("a"), A(text="x")], "has no result before message 2 (assistant)"),  # call unanswered, not tail
    ([U, A("a"), R("a"), A("b"), U], "'b'"),                            # unanswered in a later step
    ([U, A("a", "a"), R("a"), R("a")], "used twice in one step"),       # duplicate id in one step
    ([U, A("a"), A("a"), R("a")], "used twice in one step"),            # ... across a split
    ([U, A("a", "b"), R("a"), U, R("b")], "does not follow its call"),  # late result for a closed step
])
def test_check_pairing_catches(messages: list, needle: str) -> None:
    violations = check_pairing(messages)
    assert any(needle in v for v in violations), violations


def test_check_pairing_catches_each_edit_of_a_generated_history(corpus: list[Conversation]) -> None:
    """Dropping any one result (not of the pending tail), or one call turn, breaks pairing (given the
    pending ids: without them, a dropped result between two call turns of the last step looks like
    calls split across two messages, left pending)."""
    n = 0
    for c in corpus[:200]:
        ms = list(c.messages)
        for j, m in enumerate(ms):
            if isinstance(m, ToolResultMessage):
                later = [x for x in ms[j + 1:] if not isinstance(x, (ToolResultMessage, SystemMessage))]
                if later:  # not the tail step: its call is now unanswered before the next message
                    assert check_pairing(ms[:j] + ms[j + 1:], pending=c.pending), (j, m.tool_call_id)
                    n += 1
            if isinstance(m, AssistantMessage) and m.tool_calls and j + 1 < len(ms) \
                    and isinstance(ms[j + 1], ToolResultMessage) \
                    and not {b.id for b in m.tool_calls} <= set(c.pending):
                assert check_pairing(ms[:j] + ms[j + 1:], pending=c.pending), j
                n += 1
    assert n > 500


def test_pending_option_catches_a_dropped_tail_result() -> None:
    assert check_pairing([U, A("a", "b"), R("a")], pending={"b"}) == []
    assert check_pairing([U, A("a", "b")], pending={"b"}) != []
    for s in range(300):
        c = random_conversation(random.Random(s))
        assert check_pairing(c.messages, pending=c.pending) == [], s


def test_unique_ids_option_is_checked() -> None:
    with pytest.raises(ValueError):
        check_pairing([], unique_ids="turn")  # type: ignore[arg-type]


def test_evolve_keeps_conversation_frozen() -> None:
    c = random_conversation(random.Random(5))
    with pytest.raises(AttributeError):
        c.goal = "x"  # type: ignore[misc]
    assert evolve(c, goal="x").goal == "x"
