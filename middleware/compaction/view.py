"""The view: the context the provider sees, rebuilt from the transcript and the records
(:func:`apply_records`, :func:`view_spans`); and how the transcript reads (its steps, who wrote
a message, its text), which every level plans by.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from attrs import evolve

from fsm_agent import SystemMessage, ToolResultMessage, UserMessage
from fsm_agent.types import AssistantMessage, Message, TextBlock, UserImageMessage
from fsm_agent.types import pairing_problems as _pairing_problems

from .records import CompactionRecord, ContentEdit


# -- reading the transcript --------------------------------------------------------------------

def _message_text(m: Message) -> str:
    if isinstance(m, AssistantMessage):
        calls = " ".join(f"{c.name} {orjson.dumps(c.input).decode()}" for c in m.tool_calls)
        return f"{m.text} {calls}" if calls else m.text
    return m.text


def _context_text(messages: Sequence[Message]) -> str:
    return "\n".join(_message_text(m) for m in messages)


_USER = (UserMessage, UserImageMessage)


def _persons(m: Message) -> bool:
    """A tool result a person wrote: the message of a rejection or the answer given for a call
    (``metadata["decision"]`` ``reject`` / ``respond``). Read for constraints like a user message;
    L1 and L3 never edit it."""
    return isinstance(m, ToolResultMessage) and (m.metadata or {}).get("decision") in ("reject", "respond")


def _step_starts(messages: Sequence[Message]) -> list[int]:
    """Indices where a step (a maximal run of assistant messages, system messages ignored) starts."""
    out: list[int] = []
    prev: Message | None = None
    for i, m in enumerate(messages):
        if isinstance(m, SystemMessage):
            continue
        if isinstance(m, AssistantMessage) and not isinstance(prev, AssistantMessage):
            out.append(i)
        prev = m
    return out


def _ages(messages: Sequence[Message]) -> list[int]:
    """Per index, how many steps start after it (the newest step's results: 0)."""
    starts = set(_step_starts(messages))
    out = [0] * len(messages)
    age = 0
    for i in range(len(messages) - 1, -1, -1):
        out[i] = age
        if i in starts:
            age += 1
    return out


def pairing_problems(messages: Sequence[Message]) -> list[str]:
    """Pairing violations in ``messages`` (:func:`fsm_agent.types.pairing_problems`, ids distinct
    within a step; a pending tail allowed)."""
    return _pairing_problems(messages)


# -- the view --------------------------------------------------------------------------------------

def _effective_l2(records: Sequence[CompactionRecord]) -> list[CompactionRecord]:
    """The L2 records in force: a later range that contains an earlier one supersedes it.

    Raises:
        ValueError: two L2 ranges overlap without one containing the other.
    """
    active: list[CompactionRecord] = []
    for r in records:
        if r.level != "L2":
            continue
        kept = []
        for a in active:
            if r.first <= a.first and a.last <= r.last:
                continue  # superseded
            if a.last < r.first or r.last < a.first:
                kept.append(a)
                continue
            raise ValueError(f"L2 ranges m{a.first}-m{a.last} and m{r.first}-m{r.last} overlap")
        active = sorted([*kept, r], key=lambda x: x.first)
    return active


def _edited(m: ToolResultMessage, e: ContentEdit) -> ToolResultMessage:
    rest = tuple(b for b in m.content if not isinstance(b, TextBlock))
    return evolve(m, content=(TextBlock(e.text), *rest), metadata={**(m.metadata or {}), "compacted": e.kind})


def view_spans(transcript: Sequence[Message], records: Sequence[CompactionRecord]
               ) -> list[tuple[Message, int, int]]:
    """The view with, for each message, the transcript range it stands for: ``(message, first,
    last)`` (``first == last`` except for a summary message).

    Raises:
        ValueError: a record does not fit ``transcript`` (an index out of range, an edit of a
            message that is not the tool result it names, overlapping summaries).
    """
    n = len(transcript)
    summaries = {r.first: r for r in _effective_l2(records)}
    edits: dict[int, ContentEdit] = {}
    for r in records:
        if r.last >= n or r.first < 0:
            raise ValueError(f"{r.level} record m{r.first}-m{r.last} is outside a transcript of {n} messages")
        for e in r.edits:
            edits[e.index] = e
    out: list[tuple[Message, int, int]] = []
    i = 0
    while i < n:
        s = summaries.get(i)
        if s is not None:
            out.extend((transcript[j], j, j) for j in range(s.first, s.last + 1)
                       if isinstance(transcript[j], SystemMessage))
            out.append((UserMessage(s.summary or ""), s.first, s.last))
            i = s.last + 1
            continue
        m = transcript[i]
        edit = edits.get(i)
        if edit is not None:
            if not isinstance(m, ToolResultMessage) or m.tool_call_id != edit.call_id:
                raise ValueError(f"edit of m{i} names tool result {edit.call_id!r}, but m{i} is not that result")
            m = _edited(m, edit)
        out.append((m, i, i))
        i += 1
    return out


def apply_records(transcript: Sequence[Message], records: Sequence[CompactionRecord]) -> list[Message]:
    """THE view: the context the provider sees, rebuilt from the transcript and the records.

    Deterministic: the same transcript and records always give equal messages (byte-identical in
    their stored form), so a view rebuilt from the log equals the live one. L1 / L3 edits replace
    the text of the tool results they name (non-text blocks, the call id, ``is_error`` and the
    name stay; ``metadata["compacted"]`` says how). An L2 record in force replaces its range with
    the system messages in it (kept) and one user message holding the summary.

    Raises:
        ValueError: a record does not fit ``transcript`` (see :func:`view_spans`).
    """
    if not records:
        return list(transcript)
    return [m for m, _, _ in view_spans(transcript, records)]


def _current(transcript: Sequence[Message], records: Sequence[CompactionRecord]
             ) -> tuple[set[int], dict[int, ContentEdit]]:
    """(indices hidden by a summary in force, the edit in force per index)."""
    hidden: set[int] = set()
    for r in _effective_l2(records):
        hidden.update(range(r.first, r.last + 1))
    edits: dict[int, ContentEdit] = {}
    for r in records:
        for e in r.edits:
            edits[e.index] = e
    return hidden, edits
