"""Compaction (issue 11, seed 004 §8): a *view* over the append-only log, never a deletion.

The session log keeps every original message. A compaction is a :class:`CompactionRecord`,
written to the session log as a ``compaction`` event; the context of the next model call is
rebuilt from the transcript plus the records (:func:`apply_records`). Resume, replay and the review
page still see the whole history; a failed attempt commits nothing and writes one
``compaction.failed`` event.

**Levels**, escalated in the order L1 → L3 → L2 (cheap and lossless first, the summary last), and
only while the context is still over its target:

* **L1** (:func:`plan_l1`): fold runs of repeated lines inside a tool result, fold a tool result
  that repeats a later one word for word, shrink old tool results to a preview. Only the content
  of tool results changes: every message, call and call id stays, so pairs stay intact by
  construction. Tools in ``exclude_tools`` are never touched.
* **L3** (:func:`plan_l3`): a large tool result (file content, diff, query dump) is moved out of
  the context and replaced by a reference, ``[artifact m12: 48,113 chars of read_file output ...
  load_artifact("m12") ...]`` and a short head. ``m12`` is the message's index in the transcript;
  the built-in tool (:meth:`Compaction.artifact_tool`) loads it back from the session store.
* **L2** (:func:`plan_l2_range` + :func:`summarize_l2`): old turns become one user message that
  starts with :data:`SUMMARY_PREFIX` and holds a structured summary with fixed sections (goal and
  goal version, decisions, failures, verified facts with evidence, prohibitions, open to-dos,
  pending actions), written by the model through a schema-constrained call (:data:`SUMMARY_SCHEMA`),
  so it works on the local llama.cpp model too. It cuts only at unit boundaries (a user message, or
  a run of assistant messages with all their tool results), keeps the system messages, the first
  user message (the task) and the newest ``keep_last_turns`` steps. A later summary supersedes an
  earlier one: its range starts where the earlier one did, and its input holds the earlier summary.
  What the user stated as a constraint in the range is copied into the summary by the runtime
  itself, word for word, not left to the model: each sentence of a user message, Steer, Followup
  or a person's answer to a call that reads as a constraint (never, do not, don't, must, only,
  avoid ... in many languages; ``_constraints.py``), and the whole message when the reader cannot
  read a sentence of it (another language, another script).

Wherever a fact, prohibition or other must-keep item (:class:`Essentials`) sits inside a result
L1 or L3 shrinks, the line holding it is kept verbatim next to the preview.

**Engine** (pure module-level functions; the bench and the tests call them directly):

=================================  =========================================================
:func:`apply_records`              THE view: ``(transcript, records) -> list[Message]``,
                                   deterministic; the same inputs give equal messages.
:func:`plan_l1` / :func:`plan_l3`  ``-> CompactionRecord | None`` (``None``: nothing to do).
:func:`plan_l2_range`              the transcript range an L2 summary would replace, or ``None``.
:func:`summarize_l2`               ``async``; one summarizer call -> a :class:`CompactionRecord`;
                                   raises :class:`CompactionFailed` on every summarizer fault.
:func:`check_consistency`          ``(before, after, essentials) -> list[str]``: what was lost
                                   (goal version, prohibitions, verified facts, pending actions,
                                   pairing); empty when nothing was.
:func:`compact`                    ``async``; the escalation (and the labelled deterministic
                                   fallback) over all of the above; returns every attempt.
:func:`count_tokens`               the provider's reported input tokens of the last call plus a
                                   tiktoken count of what differs since (tiktoken alone without a
                                   report).
:func:`extract_essentials`         the default must-keep items of a context.
:func:`recorded_summarizer`        answers as a recorded session's summarizer did (offline
                                   replay).
=================================  =========================================================

Records reference messages by their index in the transcript: index ``k`` is the ``k``-th
``message`` event of the session log (0-based), which is how a resume rebuilds the transcript.

**Failure changes nothing.** The summarizer may raise, time out, be cancelled, or return an
invalid, empty, whitespace-only, over-budget or error-looking answer ("I'm sorry, I cannot ...",
"Error: ..."); a summary that loses an essential item, or any edit that breaks pairing, is
rejected by :func:`check_consistency`. In every case no record is committed, the next context is
the same as before, and one ``compaction.failed`` event says why. Only when the context is still
over the hard limit does the plugin fall back to a deterministic L1 / L3 edit with tighter
settings, labelled ``fallback=True``. It never invents a summary.

**The plugin** (:class:`Compaction`, entry point ``compaction``) runs the engine at three
triggers: **PreTurn** (the next call would exceed the trigger budget: compact down to the target),
**MidTurn** (a tool returned more than ``midturn_chars``: an L3 — or L1 — edit local to that result,
committed at the next PreTurn; the log keeps the tool's real output), **PostTurn** (off by
default: refresh the long-term summary every ``refresh_every`` steps). A context-length error from
the provider makes the driver re-run PreTurn once with ``ctx.context_retry`` set: the plugin then
compacts harder (to ``retry_ratio`` of the current size, with the fallback) before that one retry.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar, Union

import orjson
from attrs import evolve, field, frozen

from fsm_agent import (
    ContextLengthExceededError,
    FailurePolicy,
    MessageRequest,
    MessageResponse,
    Middleware,
    Ordering,
    OutputSchema,
    Provider,
    RunContext,
    StopRun,
    SystemMessage,
    Tool,
    ToolContext,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
    parse_output,
)
from fsm_agent.errors import RunError
from fsm_agent.store import Store
from fsm_agent.types import (
    AssistantMessage,
    Message,
    TextBlock,
    UserImageMessage,
    count_message_tokens,
    estimate_request_tokens,
    structure,
    unstructure,
)
from fsm_agent.types import pairing_problems as _pairing_problems

from .constraints import fold, holds
from .constraints import key as item_key
from .constraints import read as read_constraints

__all__ = [
    "Attempt", "Compacted", "Compaction", "CompactionFailed", "CompactionFailedEvent", "CompactionOptions",
    "CompactionOutcome", "CompactionRecord", "ContentEdit", "Essentials", "LEVELS", "ProviderSummarizer",
    "SUMMARY_PREFIX", "SUMMARY_SCHEMA", "Summarizer", "SummarizerResult", "TRIGGERS", "apply_records",
    "bounded_schema", "check_consistency", "compact", "count_tokens", "extract_essentials",
    "pairing_problems", "plan_l1", "plan_l2_range", "plan_l3", "recorded_summarizer", "render_summary",
    "summarize_l2", "view_spans",
]

log = logging.getLogger("fsm_agent.middleware.compaction")

SUMMARY_PREFIX = "[compacted summary]"
"""How the text of a summary message starts (the same prefix ``fsm_agent.testing.conversations``
uses for histories that were compacted before)."""

LEVELS: tuple[str, ...] = ("L1", "L3", "L2")
"""The levels in escalation order (cheap and lossless first, the summary last)."""

TRIGGERS: tuple[str, ...] = ("pre_turn", "mid_turn", "post_turn", "context_error")
"""Every trigger the plugin knows (``post_turn`` is off by default)."""

ARTIFACT_TOOL = "load_artifact"
"""Default name of the load-back tool; its results are never compacted."""

_SECTIONS: tuple[tuple[str, str], ...] = (
    ("decisions", "Decisions"),
    ("failures", "Failures"),
    ("verified_facts", "Verified facts"),
    ("prohibitions", "Prohibitions"),
    ("todos", "Open to-dos"),
    ("pending_actions", "Pending actions"),
)

_STRINGS = {"type": "array", "items": {"type": "string"}}
SUMMARY_SCHEMA = OutputSchema(
    "compaction_summary",
    {
        "type": "object",
        "properties": {
            "goal": {"type": "string"},
            "goal_version": {"type": "integer"},
            "decisions": _STRINGS,
            "failures": _STRINGS,
            "verified_facts": {
                "type": "array",
                "items": {"type": "object",
                          "properties": {"fact": {"type": "string"}, "evidence": {"type": "string"}},
                          "required": ["fact", "evidence"], "additionalProperties": False},
            },
            "prohibitions": _STRINGS,
            "todos": _STRINGS,
            "pending_actions": _STRINGS,
        },
        "required": ["goal", "goal_version", "decisions", "failures", "verified_facts", "prohibitions",
                     "todos", "pending_actions"],
        "additionalProperties": False,
    },
    description="A summary of earlier turns of an agent's conversation, in fixed sections.",
)
"""The schema of the L2 summary: every section required (strict mode, so llama.cpp's grammar and
OpenAI's strict structured output both enforce it)."""


# -- records ----------------------------------------------------------------------------------

@frozen
class ContentEdit:
    """L1 / L3: the text the view shows instead of one tool result's text blocks."""

    index: int
    """Transcript index of the tool result (the ``index``-th ``message`` event)."""
    call_id: str
    """Its ``tool_call_id`` (checked when the edit is applied: the call and its id stay)."""
    kind: str
    """``dedupe`` (repeated lines folded), ``fold`` (identical to a later result), ``preview``
    (head of an old result) or ``artifact`` (moved out; L3)."""
    text: str
    """The replacement text (the result's non-text blocks are kept)."""
    original_chars: int
    """Characters of the result's text in the transcript."""
    original_sha256: str
    """sha256 of the result's text in the transcript (hex)."""


@frozen
class CompactionRecord:
    """One committed compaction: what the ``compaction`` event of the session log holds."""

    level: str
    """``L1``, ``L2`` or ``L3``."""
    first: int
    """First transcript index covered (inclusive)."""
    last: int
    """Last transcript index covered (inclusive)."""
    covered_sha256: str
    """sha256 of the covered transcript messages (their stored JSON forms): ties the record to the
    log it was made from; a resume drops a record whose range no longer matches."""
    edits: tuple[ContentEdit, ...] = ()
    """L1 / L3: the content edits, by index."""
    summary: str | None = None
    """L2: the text of the summary message that replaces the range (starts with
    :data:`SUMMARY_PREFIX`), the summarizer's output rendered by :func:`render_summary`."""
    summary_sha256: str | None = None
    """L2: sha256 of ``summary`` (hex)."""
    summary_output: dict[str, Any] | None = None
    """L2: the summarizer's structured output, as it returned it."""
    summarizer_call_id: str | None = None
    """L2: the summarizer call's id (the provider response id for the default summarizer)."""
    summarizer_input_sha256: str | None = None
    """L2: sha256 of the messages given to the summarizer (their stored JSON forms)."""
    summarizer_input_messages: int = 0
    """L2: how many messages the summarizer was given."""
    kept: tuple[str, ...] = ()
    """Must-keep items (prohibitions, facts, goal, pending call ids) the new text still holds
    within the covered range."""
    constraints: tuple[str, ...] = ()
    """L2: the constraints the runtime itself copied into the summary, word for word (the user's
    sentences read as constraints in the range, and must-keep prohibitions found there that the
    summarizer's own ``prohibitions`` do not hold); see :func:`summarize_l2`."""
    verbatim: tuple[int, ...] = ()
    """L2: transcript indices of the user messages the runtime copied into the summary whole (it
    could not read them with confidence)."""
    fallback: bool = False
    """A deterministic edit made because the summary failed and the context was still over the
    hard limit (tighter L1 / L3 settings); labelled so in the log and the event."""
    reason: str = ""
    """Why it was made, in words (``over target: 9,812 > 6,000 tokens`` ...)."""


@frozen
class Essentials:
    """What no compaction may lose (the consistency check's reference)."""

    goal: str | None = None
    """The task, as stated (checked as text, when present before)."""
    goal_version: int | None = None
    """The run's goal version (``ctx.goal_version``): a new summary must state it."""
    prohibitions: tuple[str, ...] = ()
    """Things never to do, each checked as text."""
    facts: tuple[str, ...] = ()
    """Verified facts, each checked as text."""
    pending: tuple[str, ...] = ()
    """Call ids of pending actions (calls without a result yet)."""
    verbatim: tuple[str, ...] = ()
    """Texts that must stay whole (user messages the default reader could not read with
    confidence), each checked as text."""

    @property
    def items(self) -> tuple[str, ...]:
        """The text items (goal, prohibitions, facts)."""
        return tuple(x for x in ((self.goal,) if self.goal else ()) + self.prohibitions + self.facts if x.strip())


@frozen
class SummarizerResult:
    """What a summarizer may return instead of a bare mapping: the output and its call's id."""

    output: Mapping[str, Any]
    call_id: str | None = None


Summarizer = Callable[[Sequence[Message], OutputSchema], Awaitable[Union[Mapping[str, Any], SummarizerResult]]]
"""``await summarizer(messages, schema)``: the structured summary of ``messages`` (a mapping that
matches ``schema``, or a :class:`SummarizerResult`). Any exception, a timeout or a cancellation is
a failed attempt (``StopRun`` passes through)."""


class CompactionFailed(RunError):
    """A compaction attempt failed; nothing was committed.

    Attributes:
        reason: ``raised``, ``timeout``, ``cancelled``, ``invalid``, ``empty``, ``error_text``,
            ``over_budget`` or ``inconsistent``.
        detail: what happened, in words.
        level: the level attempted.
    """

    def __init__(self, reason: str, detail: str, *, level: str = "L2") -> None:
        super().__init__(f"{level} compaction failed ({reason}): {detail}")
        self.reason = reason
        self.detail = detail
        self.level = level


# -- events ------------------------------------------------------------------------------------

@frozen
class Compacted:
    """A compaction was committed (session log type ``compaction``)."""

    TAG: ClassVar[str] = "compaction"
    session_id: str
    turn: int
    trigger: str
    """``pre_turn``, ``mid_turn``, ``post_turn`` or ``context_error``."""
    record: CompactionRecord
    tokens_before: int
    """Tokens of the context before (reported + tiktoken, see :func:`count_tokens`)."""
    tokens_after: int
    """Tokens of the context after."""
    seq: int
    """0-based position of this record among the session's committed records."""


@frozen
class CompactionFailedEvent:
    """A compaction attempt failed and changed nothing (session log type ``compaction.failed``)."""

    TAG: ClassVar[str] = "compaction.failed"
    session_id: str
    turn: int
    trigger: str
    level: str
    reason: str
    """See :class:`CompactionFailed`."""
    detail: str
    tokens: int
    """Tokens of the (unchanged) context."""


# -- small helpers -------------------------------------------------------------------------------

def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _messages_sha(messages: Sequence[Message]) -> str:
    h = hashlib.sha256()
    for m in messages:
        h.update(orjson.dumps(unstructure(m, Message), option=orjson.OPT_SORT_KEYS))
        h.update(b"\n")
    return h.hexdigest()


def _norm(text: str) -> str:
    return fold(text)


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


# -- keeping must-keep lines ------------------------------------------------------------------------

def _excerpts(text: str, items: Sequence[str], *, width: int = 160) -> list[str]:
    """Short verbatim excerpts of ``text`` holding each of ``items`` found in it."""
    out: list[str] = []
    low = text.lower()
    aligned = len(low) == len(text)
    for item in items:
        key = item.strip()
        if not key:
            continue
        at = low.find(key.lower()) if aligned else -1
        if at < 0:
            if _norm(key) in _norm(text):  # found across whitespace: keep the item itself
                out.append(key)
            continue
        start = text.rfind("\n", 0, at) + 1
        end = text.find("\n", at + len(key))
        end = len(text) if end < 0 else end
        if end - start > 2 * width + len(key):
            start, end = max(start, at - width), min(end, at + len(key) + width)
        snippet = text[start:end].strip()
        if snippet not in out:
            out.append(snippet)
    return out


def _head(text: str, chars: int) -> str:
    if len(text) <= chars:
        return text
    cut = text.rfind("\n", 0, chars)
    return text[: cut if cut >= chars * 0.7 else chars]


def _kept_in(text: str, items: Sequence[str]) -> tuple[str, ...]:
    n = _norm(text)
    return tuple(i for i in items if _norm(i).rstrip(".") and _norm(i).rstrip(".") in n)


# -- L1 --------------------------------------------------------------------------------------------

@frozen
class CompactionOptions:
    """Settings of the levels (the plugin builds one from its options; the bench passes its own)."""

    keep_last_turns: int = 2
    """Steps (runs of assistant messages) whose results L1 never previews and L2 never summarizes."""
    preview_chars: int = 1500
    """L1: characters an old tool result keeps as its preview."""
    fold_min_chars: int = 200
    """L1: results at least this long that repeat a later result word for word are folded."""
    repeat_min: int = 3
    """L1: runs of at least this many identical consecutive lines are folded to one."""
    dedupe_min_chars: int = 500
    """L1: results shorter than this are left as they are by the line folding."""
    exclude_tools: tuple[str, ...] = (ARTIFACT_TOOL,)
    """Tools whose results no level edits (L2 still summarizes their old turns)."""
    artifact_min_chars: int = 8000
    """L3: tool results at least this long (in the view) are moved out."""
    artifact_keep_last_turns: int = 1
    """L3: steps whose results stay in place (the MidTurn trigger ignores this)."""
    artifact_preview_chars: int = 400
    """L3: characters of head kept next to the reference."""
    load_hint: bool = True
    """L1 previews name the load-back call too (set when the load-back tool is offered)."""
    keep_first_user: bool = True
    """L2 never summarizes the first user message (the task)."""
    max_summary_tokens: int = 2000
    """L2: a summary longer than this (tiktoken) is over budget and rejected."""
    min_summary_input_tokens: int = 600
    """L2: no summary is attempted of less than this (it would not pay)."""
    summarizer_timeout: float | None = 120.0
    """L2: seconds the summarizer may take (``None``: no limit)."""
    fallback_preview_chars: int = 300
    """Fallback L1: preview size (all results older than the newest step)."""
    fallback_artifact_min_chars: int = 2000
    """Fallback L3: results at least this long are moved out, the newest step's included."""
    artifact_tool: str = ARTIFACT_TOOL
    """The load-back tool's name, as references spell it."""

    def __attrs_post_init__(self) -> None:
        if self.keep_last_turns < 1 or self.preview_chars < 0 or self.artifact_min_chars < 1 \
                or self.repeat_min < 2 or self.max_summary_tokens < 1 or self.artifact_keep_last_turns < 0:
            raise ValueError("compaction options out of range: keep_last_turns >= 1, repeat_min >= 2, "
                             "sizes >= 0, artifact_min_chars and max_summary_tokens >= 1")


_REPEAT_NOTE = "[L1: the line above repeats {n} more time{s}]"


def _dedupe_lines(text: str, repeat_min: int) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        j = i
        while j + 1 < len(lines) and lines[j + 1] == lines[i]:
            j += 1
        run = j - i + 1
        out.append(lines[i])
        if run >= repeat_min:
            out.append(_REPEAT_NOTE.format(n=run - 1, s="" if run == 2 else "s"))
        else:
            out.extend(lines[i + 1:j + 1])
        i = j + 1
    return "\n".join(out)


def _preview(m: ToolResultMessage, index: int, text: str, chars: int, items: Sequence[str], *,
             label: str, hint: str | None) -> str:
    head = _head(text, chars)
    kept = _excerpts(text[len(head):], items)
    omitted = len(text) - len(head)
    where = f"; {hint} loads it back" if hint else "; the full result is in the session log"
    note = (f"[... {label}: {omitted:,} of {len(text):,} characters of this {m.name or 'tool'} result "
            f"(m{index}) omitted{where}"
            + ("; lines holding facts to keep follow" if kept else "") + "]")
    return "\n".join([head, note, *kept]) if head else "\n".join([note, *kept])


def plan_l1(transcript: Sequence[Message], records: Sequence[CompactionRecord] = (), *,
            options: CompactionOptions = CompactionOptions(), keep: Sequence[str] = (),
            indices: Collection[int] | None = None, fallback: bool = False, reason: str = "",
            keep_last_turns: int | None = None, preview_chars: int | None = None) -> CompactionRecord | None:
    """Plan an L1 edit of ``transcript`` as ``records`` already show it; ``None`` when it would
    change nothing.

    Per tool result in view (not hidden by a summary, tool not excluded): runs of identical lines
    are folded; a result whose text equals a later one's (``fold_min_chars`` or longer) becomes a
    pointer to the later one; a result older than ``keep_last_turns`` steps and longer than
    ``preview_chars`` becomes its head plus a note, followed by the lines holding ``keep`` items.
    ``indices`` limits the edit to those results (whatever their age). An edit is made only when
    it shortens the text.
    """
    keep_turns = options.keep_last_turns if keep_last_turns is None else keep_last_turns
    chars = options.preview_chars if preview_chars is None else preview_chars
    hidden, done = _current(transcript, records)
    ages = _ages(transcript)
    exclude = set(options.exclude_tools)
    candidates = [i for i, m in enumerate(transcript)
                  if isinstance(m, ToolResultMessage) and i not in hidden and m.name not in exclude
                  and not _persons(m) and (indices is None or i in indices)
                  and (i not in done or done[i].kind in ("dedupe", "preview"))]
    # identical results (as in the transcript): all but the last one point to the last one
    last_of: dict[tuple[str | None, str], int] = {}
    for i in candidates:
        m = transcript[i]
        assert isinstance(m, ToolResultMessage)
        if len(m.text) >= options.fold_min_chars:
            last_of[(m.name, m.text)] = i
    hint = f'{options.artifact_tool}("m{{}}")' if options.load_hint else None
    edits: list[ContentEdit] = []
    for i in candidates:
        m = transcript[i]
        assert isinstance(m, ToolResultMessage)
        original = m.text
        cur = done[i].text if i in done else original
        new, kind = original, ""
        later = last_of.get((m.name, original))
        if later is not None and later != i and not _kept_in(original, keep):
            other = transcript[later]
            assert isinstance(other, ToolResultMessage)
            new, kind = (f"[L1: identical to the later result of call {other.tool_call_id} (m{later}), "
                         f"{len(original):,} characters]"), "fold"
        else:
            if len(original) >= options.dedupe_min_chars:
                folded = _dedupe_lines(original, options.repeat_min)
                if len(folded) < len(original):
                    new, kind = folded, "dedupe"
            if (ages[i] >= keep_turns or indices is not None) and len(new) > chars + 200:
                new = _preview(m, i, new, chars, keep, label="L1 preview",
                               hint=hint.format(i) if hint else None)
                kind = "preview"
        if kind and len(new) < len(cur):
            edits.append(ContentEdit(i, m.tool_call_id, kind, new, len(original), _sha(original)))
    return _record("L1", transcript, edits, keep, fallback, reason)


def _record(level: str, transcript: Sequence[Message], edits: list[ContentEdit], keep: Sequence[str],
            fallback: bool, reason: str) -> CompactionRecord | None:
    if not edits:
        return None
    first, last = edits[0].index, edits[-1].index
    kept = tuple(dict.fromkeys(k for e in edits for k in _kept_in(e.text, keep)))
    return CompactionRecord(level, first, last, _messages_sha(transcript[first:last + 1]), tuple(edits),
                            kept=kept, fallback=fallback, reason=reason)


# -- L3 --------------------------------------------------------------------------------------------

def plan_l3(transcript: Sequence[Message], records: Sequence[CompactionRecord] = (), *,
            options: CompactionOptions = CompactionOptions(), keep: Sequence[str] = (),
            indices: Collection[int] | None = None, fallback: bool = False, reason: str = "",
            min_chars: int | None = None, keep_last_turns: int | None = None) -> CompactionRecord | None:
    """Plan an L3 edit: every tool result in view whose text is ``min_chars`` or longer, older
    than ``keep_last_turns`` steps (any age for ``indices``), is replaced by a reference
    (``[artifact m<k>: N chars of <tool> output ... load_artifact("m<k>") ...]``), a short head and
    the lines holding ``keep`` items. ``None`` when there is none."""
    floor = options.artifact_min_chars if min_chars is None else min_chars
    keep_turns = options.artifact_keep_last_turns if keep_last_turns is None else keep_last_turns
    hidden, done = _current(transcript, records)
    ages = _ages(transcript)
    exclude = set(options.exclude_tools)
    edits: list[ContentEdit] = []
    for i, m in enumerate(transcript):
        if not isinstance(m, ToolResultMessage) or i in hidden or m.name in exclude or _persons(m):
            continue
        if indices is not None and i not in indices:
            continue
        if indices is None and ages[i] < keep_turns:
            continue
        if i in done and done[i].kind == "artifact":
            continue
        cur = done[i].text if i in done else m.text
        if len(cur) < floor:
            continue
        original = m.text
        head = _head(original, options.artifact_preview_chars)
        kept = _excerpts(original[len(head):], keep)
        text = "\n".join([
            f"[artifact m{i}: {len(original):,} chars of {m.name or 'tool'} output (call {m.tool_call_id}), moved "
            f"out of the context — {options.artifact_tool}(\"m{i}\") loads it back]",
            head, *(["[lines of it holding facts to keep:]", *kept] if kept else [])])
        if len(text) < len(cur):
            edits.append(ContentEdit(i, m.tool_call_id, "artifact", text, len(original), _sha(original)))
    return _record("L3", transcript, edits, keep, fallback, reason)


# -- L2 --------------------------------------------------------------------------------------------

def plan_l2_range(transcript: Sequence[Message], records: Sequence[CompactionRecord] = (), *,
                  options: CompactionOptions = CompactionOptions(), keep_last_turns: int | None = None
                  ) -> tuple[int, int] | None:
    """The transcript range ``(first, last)`` an L2 summary would replace now, or ``None``.

    It starts after the leading system messages and the first user message (``keep_first_user``),
    or where the summary in force starts (the new one supersedes it), and ends before the newest
    ``keep_last_turns`` steps (and the user message right before them): a unit boundary, so no
    call is ever separated from its results, and the pending tail always stays. ``None`` when the
    range would hold nothing that is not summarized already.
    """
    keep_turns = options.keep_last_turns if keep_last_turns is None else keep_last_turns
    n = len(transcript)
    head = 0
    while head < n and isinstance(transcript[head], SystemMessage):
        head += 1
    if options.keep_first_user and head < n and isinstance(transcript[head], _USER):
        head += 1
    starts = _step_starts(transcript)
    if len(starts) < keep_turns:
        return None
    tail = starts[-keep_turns] if keep_turns > 0 else n
    j = tail - 1
    while j >= head and isinstance(transcript[j], SystemMessage):
        j -= 1
    if j >= head and isinstance(transcript[j], _USER):
        tail = j
    active = _effective_l2(records)
    first = min([head, *(r.first for r in active if r.first < tail)])
    last = tail - 1
    if last < first:
        return None
    if any(r.first < tail <= r.last for r in active):
        return None  # the tail would cut a summary in force (keep_last_turns grew): leave it
    hidden = {k for r in active for k in range(r.first, r.last + 1)}
    if not any(k not in hidden and not isinstance(transcript[k], SystemMessage) for k in range(first, last + 1)):
        return None
    return first, last


_ERROR_START = re.compile(
    r"^\s*(?:\[error\]|error\s*(?::|-|\(|\d{3}\b|code\b|occurred|while|calling|from\b|response\b|status\b)"
    r"|(?:[\w.]+(?:error|exception))\s*:|exception\b|traceback\b|http\s*\d{3}\b|status(?: code)?\s*\d{3}\b"
    r"|i'?m sorry|i am sorry|sorry[,!.]|apologies|i (?:cannot|can't|can not|am unable|'m unable|am not able)"
    r"|as an ai\b|unable to\b|failed to (?:summari[sz]e|generate|produce))", re.I)
_NO_SUMMARY = re.compile(r"(?:could ?n[o']t|can ?n[o']t|unable to|failed to|not able to)\s+summari[sz]", re.I)
"""The summarizer saying it did not summarise: refused in every section, the failures included."""
_ERROR_ANYWHERE = re.compile(
    r"(?:could ?n[o']t|can ?n[o']t|unable to|failed to|not able to)\s+summari[sz]"  # "could not summarise"
    r"|traceback \(most recent call last\)|\berror code:?\s*\d{3}\b"
    r"|[{,]\s*['\"]error['\"]\s*:\s*[{'\"]", re.I)  # a serialized error object: {'error': {...}}


def _check_output(out: Any, schema: OutputSchema) -> dict[str, Any]:
    """The summarizer's output as a dict, or :class:`CompactionFailed` (invalid, empty, error text)."""
    if not isinstance(out, Mapping):
        raise CompactionFailed("invalid", f"the summarizer returned {type(out).__name__}, not an object")
    props = schema.schema.get("properties", {})
    missing = [k for k in schema.schema.get("required", ()) if k not in out]
    if missing:
        raise CompactionFailed("invalid", f"the summary lacks the section(s) {', '.join(missing)}")
    extra = [str(k)[:40] for k in out if k not in props]
    if extra:  # the schema allows no other keys (and a record stores the output as given)
        raise CompactionFailed("invalid", f"the summary has section(s) the schema does not allow: {', '.join(extra)}")
    value = dict(out)
    strings: list[tuple[str, str]] = []
    for key, spec in props.items():
        v = value.get(key)
        if key == "goal_version":
            if isinstance(v, bool) or not isinstance(v, int):
                raise CompactionFailed("invalid", f"goal_version must be an integer, not {v!r}")
            continue
        if spec.get("type") == "string":
            if not isinstance(v, str):
                raise CompactionFailed("invalid", f"{key} must be a string")
            strings.append((key, v))
            continue
        if not isinstance(v, list):
            raise CompactionFailed("invalid", f"{key} must be a list")
        for item in v:
            if key == "verified_facts":
                if not (isinstance(item, Mapping) and set(item) <= {"fact", "evidence"}
                        and isinstance(item.get("fact"), str) and isinstance(item.get("evidence"), str)):
                    raise CompactionFailed("invalid", "each verified fact is {fact, evidence}, two strings")
                strings.append((key, item["fact"]))
                strings.append(("evidence", item["evidence"]))
            elif isinstance(item, str):
                strings.append((key, item))
            else:
                raise CompactionFailed("invalid", f"{key} must hold strings")
    if not any(s.strip() for k, s in strings if k != "evidence"):
        raise CompactionFailed("empty", "the summary is empty or whitespace only")
    for key, s in strings:
        if key != "failures" and _ERROR_START.match(s):
            raise CompactionFailed("error_text", f"the summary's {key} reads like an error or a refusal: {s[:120]!r}")
        if (key != "failures" and _ERROR_ANYWHERE.search(s)) or _NO_SUMMARY.search(s):
            raise CompactionFailed("error_text", f"the summary's {key} holds an error or a refusal: {s[:120]!r}")
    return value


CARRIED_HEADING = "Constraints, kept word for word by the runtime:"
"""In a summary, the line before the constraints the runtime copied (``- `` items; an item's
later lines are indented by two spaces)."""
VERBATIM_HEADING = "Messages kept word for word by the runtime (they may state constraints it could not read):"
"""In a summary, the line before the user messages the runtime copied whole (each one a
``[m<k>, <n> lines]`` line, then its ``n`` lines as they were)."""
_BLOCK = re.compile(r"^\[m(\d+), (\d+) lines?\]$")


def _carried_lines(constraints: Sequence[str], verbatim: Sequence[tuple[int, str]]) -> list[str]:
    lines: list[str] = []
    if constraints:
        lines.append(CARRIED_HEADING)
        for item in constraints:
            head, *rest = item.split("\n")
            lines.append(f"- {head}")
            lines.extend(f"  {r}" for r in rest)
    if verbatim:
        lines.append(VERBATIM_HEADING)
        for index, text in verbatim:
            body = text.split("\n")
            lines.append(f"[m{index}, {len(body)} line{'' if len(body) == 1 else 's'}]")
            lines.extend(body)
    return lines


@frozen
class _Parts:
    """A summary message's text, taken apart (:func:`_summary_parts`)."""

    constraints: tuple[str, ...]
    verbatim: tuple[tuple[int, str], ...]
    model: str
    """The rest: the summarizer's sections (or the whole text after the first line, for a summary
    this module did not write)."""


def _summary_parts(text: str) -> _Parts:
    """The runtime's parts of a summary (they follow its first line, with exact line counts, so
    nothing the model or a user wrote can be taken for them) and the rest."""
    lines = text.split("\n")
    i = 1
    constraints: list[str] = []
    if i < len(lines) and lines[i] == CARRIED_HEADING:
        i += 1
        while i < len(lines) and lines[i].startswith("- "):
            item = [lines[i][2:]]
            i += 1
            while i < len(lines) and lines[i].startswith("  "):
                item.append(lines[i][2:])
                i += 1
            constraints.append("\n".join(item))
    verbatim: list[tuple[int, str]] = []
    if i < len(lines) and lines[i] == VERBATIM_HEADING:
        i += 1
        while i < len(lines):
            found = _BLOCK.match(lines[i])
            if found is None or i + 1 + int(found.group(2)) > len(lines):
                break
            n = int(found.group(2))
            verbatim.append((int(found.group(1)), "\n".join(lines[i + 1:i + 1 + n])))
            i += 1 + n
    return _Parts(tuple(constraints), tuple(verbatim), "\n".join(lines[i:]))


_TITLES = frozenset(f"{title}:" for _, title in _SECTIONS)


def _summary_prohibitions(model: str) -> list[str]:
    """The prohibitions the summarizer wrote: the items of its ``Prohibitions:`` section."""
    out: list[list[str]] = []
    inside = False
    for line in model.split("\n"):
        if line in _TITLES:
            inside = line == "Prohibitions:"
        elif inside and line.startswith("- "):
            out.append([line[2:]])
        elif inside and out:
            out[-1].append(line)
    return [t for t in ("\n".join(x).strip() for x in out) if t and t != "(none)"]


def render_summary(output: Mapping[str, Any], *, first: int, last: int, call_id: str | None,
                   constraints: Sequence[str] = (), verbatim: Sequence[tuple[int, str]] = ()) -> str:
    """The text of the summary message: :data:`SUMMARY_PREFIX` and where it comes from; then what
    the runtime carries word for word, ``constraints`` (after :data:`CARRIED_HEADING`) and the
    ``(index, text)`` messages of ``verbatim`` (after :data:`VERBATIM_HEADING`); then each section
    of ``output`` (verbatim, in the schema's order)."""
    source = " ".join(str(call_id).split()) if call_id else ""
    lines = [f"{SUMMARY_PREFIX} Messages m{first}-m{last} of this session, summarised"
             + (f" (summarizer call {source})." if source else "."),
             *_carried_lines(constraints, verbatim),
             f"Goal (version {output.get('goal_version')}): {str(output.get('goal', '')).strip()}"]
    for key, title in _SECTIONS:
        items = output.get(key) or []
        lines.append(f"{title}:")
        if not items:
            lines.append("- (none)")
        for item in items:
            if key == "verified_facts":
                ev = str(item.get("evidence", "")).strip()
                lines.append(f"- {str(item.get('fact', '')).strip()}" + (f" (evidence: {ev})" if ev else ""))
            else:
                lines.append(f"- {str(item).strip()}")
    return "\n".join(lines)


async def _call(summarizer: Summarizer, messages: Sequence[Message], schema: OutputSchema,
                timeout: float | None) -> Any:
    try:
        if timeout is None:
            return await summarizer(messages, schema)
        async with asyncio.timeout(timeout) as deadline:
            answer = await summarizer(messages, schema)
        if deadline.expired():  # it swallowed the cancellation and answered late: still a timeout
            raise TimeoutError
        return answer
    except TimeoutError as exc:
        raise CompactionFailed("timeout", f"the summarizer did not answer within {timeout} s"
                               if timeout is not None else f"the summarizer timed out: {exc}") from exc
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the run itself is being cancelled: not ours to swallow
        raise CompactionFailed("cancelled", "the summarizer call was cancelled") from None
    except (CompactionFailed, StopRun):
        raise
    except Exception as exc:  # noqa: BLE001 - every summarizer fault is a failed attempt
        raise CompactionFailed("raised", f"the summarizer raised {type(exc).__name__}: {str(exc)[:300]}") from exc


_OURS = re.compile(rf"^{re.escape(SUMMARY_PREFIX)} Messages m\d+-m\d+ of this session, summarised")


def _ours(m: Message) -> _Parts | None:
    """A summary this module rendered, taken apart; ``None`` for any other message (a message that
    only starts with :data:`SUMMARY_PREFIX`, a summary from elsewhere, is read like a user's)."""
    if not (isinstance(m, UserMessage) and _OURS.match(m.text)):
        return None
    parts = _summary_parts(m.text)
    return parts if parts.model.startswith("Goal (version ") else None


def _said(messages: Sequence[Message]) -> str:
    """What the user side said (system and user messages, summaries included), folded."""
    return fold("\n".join(m.text for m in messages if isinstance(m, (SystemMessage, UserMessage))))


def _carry(spans: Sequence[tuple[Message, int, int]], first: int, last: int, carry: Sequence[str],
           written: Sequence[str]) -> tuple[list[str], list[tuple[int, str]]]:
    """What the runtime copies into a summary of ``[first, last]`` itself, word for word:
    ``(constraints, [(index, text), ...] of whole messages)``.

    Read from the range: each user message's constraint sentences (:mod:`._constraints`), or the
    whole message when the reader cannot read a sentence of it; what an earlier summary there
    carried, and the prohibitions its summarizer wrote; and each item of ``carry`` the range's text
    holds. Left out: what a system or user message that stays in the view holds, and what the new
    summarizer's own ``written`` prohibitions hold word for word (the next summary reads those)."""
    inside = [(m, a) for m, a, b in spans if a >= first and b <= last and not isinstance(m, SystemMessage)]
    stays = _said([m for m, a, b in spans if not (a >= first and b <= last) or isinstance(m, SystemMessage)])
    constraints: list[str] = []
    blocks: dict[int, str] = {}
    for m, a in inside:
        parts = _ours(m)
        if parts is not None:
            constraints.extend(parts.constraints)
            constraints.extend(_summary_prohibitions(parts.model))
            blocks.update(parts.verbatim)
        elif isinstance(m, _USER) or _persons(m):
            reading = read_constraints(m.text)
            if reading.unread:
                blocks[a] = m.text
            else:
                constraints.extend(reading.constraints)
    text = fold(_context_text([m for m, _ in inside]))
    constraints.extend(c for c in carry if c.strip() and holds(text, c))
    whole = [(k, t) for k, t in sorted(blocks.items()) if not holds(stays, t)]
    held = "\n".join([stays, fold("\n".join(t for _, t in whole)), fold("\n".join(written))])
    keys: dict[str, str] = {}
    for c in constraints:
        k = item_key(c)
        if k and k not in held and k not in keys:
            keys[k] = c
    out = [c for k, c in keys.items() if not any(k != o and k in o for o in keys)]  # the longer one holds it
    return out, whole


async def summarize_l2(transcript: Sequence[Message], records: Sequence[CompactionRecord], summarizer: Summarizer, *,
                       first: int, last: int, options: CompactionOptions = CompactionOptions(),
                       keep: Sequence[str] = (), schema: OutputSchema = SUMMARY_SCHEMA,
                       tokens: Callable[[Sequence[Message]], int] = count_message_tokens,
                       reason: str = "", carry: Sequence[str] = ()) -> CompactionRecord:
    """Summarize the view of transcript range ``[first, last]`` with one summarizer call.

    The summarizer gets exactly the view messages that stand for the range (system messages
    aside: they stay), so its input covers what the summary removes, an earlier summary included.

    The runtime, not the model, copies into the summary what the user stated as a constraint
    (:func:`render_summary`, :attr:`CompactionRecord.constraints` / ``verbatim``): every sentence
    of a user message in the range that reads as one (never, do not, don't, must, only, always,
    avoid ... in English and other languages), the whole message when a sentence of it is in a
    language or script the reader does not know, what an earlier summary in the range carried,
    and each item of ``carry`` (must-keep prohibitions) the range holds. A model that drops one
    drops nothing.

    Raises:
        CompactionFailed: the summarizer raised, timed out (``options.summarizer_timeout``), was
            cancelled, or answered with something invalid, empty, error-looking or over budget
            (its own part longer than ``max_summary_tokens``, or the whole summary not shorter
            than what it replaces).
        ValueError: the range does not fit.
    """
    spans = view_spans(transcript, records)
    inside = [m for m, a, b in spans if a >= first and b <= last and not isinstance(m, SystemMessage)]
    if any(a < first <= b or a <= last < b for _, a, b in spans):
        raise ValueError(f"m{first}-m{last} cuts through a summary in force")
    if not inside:
        raise ValueError(f"m{first}-m{last} holds nothing to summarize")
    raw = await _call(summarizer, tuple(inside), schema, options.summarizer_timeout)
    call_id = raw.call_id if isinstance(raw, SummarizerResult) else None
    output = _check_output(raw.output if isinstance(raw, SummarizerResult) else raw, schema)
    input_sha = _messages_sha(inside)
    if call_id is None:
        call_id = f"summarizer:{input_sha[:16]}"
    constraints, whole = _carry(spans, first, last, carry, [str(p) for p in output.get("prohibitions", ())])
    text = render_summary(output, first=first, last=last, call_id=call_id, constraints=constraints, verbatim=whole)
    # plain counts: the run's counter starts from the provider's report for the whole request (tool
    # definitions included), which is no measure of one message
    own = count_message_tokens([UserMessage(render_summary(output, first=first, last=last, call_id=call_id))])
    size, removed = count_message_tokens([UserMessage(text)]), count_message_tokens(list(inside))
    if own > options.max_summary_tokens or size >= removed:
        carried = f" (and {size - own:,} carried word for word)" if size > own else ""
        raise CompactionFailed("over_budget", f"the summary has {own:,} tokens{carried}; the limit is "
                               f"{options.max_summary_tokens:,} and it replaces {removed:,}")
    return CompactionRecord("L2", first, last, _messages_sha(transcript[first:last + 1]), summary=text,
                            summary_sha256=_sha(text), summary_output=output, summarizer_call_id=call_id,
                            summarizer_input_sha256=input_sha, summarizer_input_messages=len(inside),
                            kept=_kept_in(text, keep), reason=reason, constraints=tuple(constraints),
                            verbatim=tuple(k for k, _ in whole))


# -- the consistency check ---------------------------------------------------------------------

_GOAL_VERSION = re.compile(r"^Goal \(version (-?\d+)\):", re.M)


def _open_calls(messages: Sequence[Message]) -> set[str]:
    calls = {c.id for m in messages if isinstance(m, AssistantMessage) for c in m.tool_calls}
    answered = {m.tool_call_id for m in messages if isinstance(m, ToolResultMessage)}
    return calls - answered


def check_consistency(before: Sequence[Message], after: Sequence[Message], essentials: Essentials) -> list[str]:
    """What the context ``after`` lost against ``before``; ``[]`` when nothing.

    Compared: the goal, each prohibition, each verified fact and each verbatim text of
    ``essentials`` (as text, compared in :func:`._constraints.key` form: case, whitespace, curly or
    straight quotes, full-width forms and trailing full stops aside; present before means present
    after; a prohibition or verbatim text that a system or user message held before must be held by
    one after, a summary counting, not only by what the assistant or a tool said); the pending
    actions (call ids of ``essentials.pending`` and every call without a result before still so
    after); the goal version (every summary new in ``after`` must state
    ``essentials.goal_version``); and pairing (no pairing violation that ``before`` did not have).
    """
    problems: list[str] = []
    b, a = fold(_context_text(before)), fold(_context_text(after))
    said_b, said_a = _said(before), _said(after)
    for kind, items in (("goal", (essentials.goal,) if essentials.goal else ()),
                        ("prohibition", essentials.prohibitions), ("verified fact", essentials.facts),
                        ("message kept word for word", essentials.verbatim)):
        user_side = kind in ("prohibition", "message kept word for word")
        for item in items:
            k = item_key(item)
            if not k:
                continue
            if user_side and k in said_b:
                lost = k not in said_a
            else:
                lost = k in b and k not in a
            if lost:
                problems.append(f"lost {kind}: {item if len(item) <= 200 else item[:200] + '...'!r}")
    calls_before = {c.id for m in before if isinstance(m, AssistantMessage) for c in m.tool_calls}
    calls_after = {c.id for m in after if isinstance(m, AssistantMessage) for c in m.tool_calls}
    open_after = _open_calls(after)
    for cid in sorted(set(essentials.pending) & calls_before):
        if cid not in calls_after:
            problems.append(f"lost pending action: call {cid!r}")
    for cid in sorted(_open_calls(before)):
        if cid not in open_after and f"lost pending action: call {cid!r}" not in problems:
            problems.append(f"lost pending action: call {cid!r} no longer waits for its result")
    old = {m.text for m in before if isinstance(m, UserMessage)}
    for m in after:
        if isinstance(m, UserMessage) and m.text.startswith(SUMMARY_PREFIX) and m.text not in old:
            found = _GOAL_VERSION.search(_summary_parts(m.text).model)
            if found is None:
                problems.append("the new summary states no goal version")
            elif essentials.goal_version is not None and int(found.group(1)) != essentials.goal_version:
                problems.append(f"the new summary states goal version {found.group(1)}, the run is at "
                                f"{essentials.goal_version}")
    broken_after = pairing_problems(after)
    if len(broken_after) > len(pairing_problems(before)):
        problems.extend(f"pairing: {p}" for p in broken_after)
    return problems


_FACT_LINE = re.compile(r"^\s*(?:[-*\u2022]\s*)?(?:verified|fact)\s*:\s*(.+?)\s*$", re.I | re.M)
STEER_PREFIX = "New direction from the user:"
"""How the runtime words a Steer in the transcript (its text is part of the goal)."""


def extract_essentials(messages: Sequence[Message], goal_version: int | None = None,
                       pending: Sequence[str] = ()) -> Essentials:
    """The default must-keep items of a context (the plugin's ``essentials`` option replaces it):

    * goal: the first line of the first user message;
    * prohibitions: in every system and user message (the task, a Steer — ``New direction from
      the user: ...`` —, a Followup, any other) and every tool result a person wrote (a rejection's
      message, an answer given for a call: ``metadata["decision"]``), each sentence that reads as a constraint: one
      holding never / do not / don't (straight or curly) / must / must not / shall not / should
      not / only / always / avoid / under no circumstances / forbidden / please ..., in any case,
      or their forms in French, German, Spanish, Italian, Portuguese, Dutch, a dozen more
      Latin-script languages, Russian, Ukrainian, Greek, Chinese, Japanese, Korean, Arabic, Hebrew,
      Hindi or Thai (a ``Header:`` line with the list under it is one item); in an earlier summary
      of this module, what the runtime carried and the summarizer's ``Prohibitions`` (a message
      that starts with :data:`SUMMARY_PREFIX` but was written elsewhere is read like a user's).
      Each item is the text as written;
    * verbatim: each user or system message with a sentence in a language or script the reader
      does not know, whole (a summary must carry it word for word); and the messages an earlier
      summary carried whole;
    * facts: the items of the ``Verified facts`` / ``Evidence`` sections of earlier summaries, and
      lines that start with ``Verified:`` or ``Fact:`` anywhere;
    * pending: ``pending`` plus every call without a result.

    Assistant messages and tool results are not read for prohibitions (a tool's output is not the
    user's word).
    """
    first_user = next((i for i, m in enumerate(messages) if isinstance(m, UserMessage)
                       and not m.text.startswith(SUMMARY_PREFIX)), None)
    goal = messages[first_user].text.strip().split("\n", 1)[0][:300] if first_user is not None else None
    prohibitions: list[str] = []
    verbatim: list[str] = []
    facts: list[str] = []
    for m in messages:
        text = m.text
        parts = _ours(m)
        if parts is not None:
            prohibitions.extend(parts.constraints)
            prohibitions.extend(_summary_prohibitions(parts.model))
            verbatim.extend(t for _, t in parts.verbatim)
        elif isinstance(m, (SystemMessage, *_USER)) or _persons(m):
            reading = read_constraints(text)
            prohibitions.extend(reading.constraints)
            if reading.unread:
                verbatim.append(text)
        if isinstance(m, UserMessage) and text.startswith(SUMMARY_PREFIX):
            in_facts = False
            for line in (parts.model if parts is not None else text).split("\n"):
                stripped = line.strip()
                if re.match(r"^(?:verified facts|evidence)\s*:\s*$", stripped, re.I):
                    in_facts = True
                elif in_facts and stripped.startswith("- "):
                    item = re.sub(r"\s*\(evidence: .*\)$", "", stripped[2:]).strip()
                    if item and item != "(none)":
                        facts.append(item)
                else:
                    in_facts = False
        facts.extend(f.group(1) for f in _FACT_LINE.finditer(text) if len(f.group(1)) <= 300)
    return Essentials(goal, goal_version, tuple(dict.fromkeys(prohibitions)), tuple(dict.fromkeys(facts)),
                      tuple(dict.fromkeys([*pending, *sorted(_open_calls(messages))])),
                      tuple(dict.fromkeys(verbatim)))


# -- token counting ----------------------------------------------------------------------------

def count_tokens(messages: Sequence[Message], *, reported: int | None = None,
                 sent: Sequence[Message] | None = None, extra: int = 0,
                 count: Callable[[Sequence[Message]], int] = count_message_tokens) -> int:
    """Tokens of a context ``messages``.

    With ``reported`` (the provider's input tokens of the last call) and ``sent`` (that call's
    messages): ``reported`` plus the tiktoken count of what differs since — the messages after
    the longest common prefix, minus those of ``sent`` after it (what came after the last call,
    and what a compaction changed), and never less than the tiktoken count of ``messages`` (a
    provider that reports a placeholder such as 10 is not believed). Without a report: the tiktoken
    count plus ``extra`` (the tool definitions, which a report includes).
    """
    if reported is None or sent is None:
        return count(messages) + extra
    p = 0
    limit = min(len(messages), len(sent))
    while p < limit and (messages[p] is sent[p] or messages[p] == sent[p]):
        p += 1
    # never below our own count of the messages: a report far under it (a scripted or proxy
    # provider that reports a placeholder) would let the context grow past the window unseen
    return max(reported + count(messages[p:]) - count(sent[p:]), count(messages))


# -- the escalation ------------------------------------------------------------------------------

@frozen
class Attempt:
    """One level tried by :func:`compact`."""

    level: str
    record: CompactionRecord | None
    """The committed record, or ``None`` when the attempt failed."""
    failure: CompactionFailed | None = field(eq=False)
    """Why it failed, or ``None`` when it was committed."""
    tokens_before: int
    tokens_after: int


@frozen
class CompactionOutcome:
    """What :func:`compact` did."""

    records: tuple[CompactionRecord, ...]
    """Every record in force after (the given ones, then the committed ones)."""
    view: tuple[Message, ...]
    """The context after (the context before when nothing was committed)."""
    attempts: tuple[Attempt, ...]
    """Every level tried, in order (committed or failed); levels with nothing to do are not listed."""
    tokens: int
    """Tokens of ``view``."""

    @property
    def committed(self) -> tuple[CompactionRecord, ...]:
        return tuple(a.record for a in self.attempts if a.record is not None)


async def compact(transcript: Sequence[Message], records: Sequence[CompactionRecord], *,
                  target: int | None, hard_limit: int | None = None, levels: Collection[str] = LEVELS,
                  summarizer: Summarizer | None = None, essentials: Essentials = Essentials(),
                  options: CompactionOptions = CompactionOptions(),
                  tokens: Callable[[Sequence[Message]], int] = count_message_tokens,
                  indices: Collection[int] | None = None, fallback: bool = True) -> CompactionOutcome:
    """Escalate L1 → L3 → L2 (those in ``levels``) while the context is over ``target`` tokens
    (``None``: try each level once); then, if it is still over ``hard_limit`` and ``fallback``,
    a deterministic L1 and L3 with the ``fallback_*`` settings, labelled ``fallback=True``.

    Every candidate is checked with :func:`check_consistency` against the context before it; a
    candidate that loses anything, and every summarizer fault, is a failed :class:`Attempt` and
    changes nothing. ``indices`` limits L1 / L3 to those transcript indices (MidTurn: one result),
    whatever their age, and skips L2 and the fallback.
    """
    recs = list(records)
    view = apply_records(transcript, recs)
    cur = tokens(view)
    attempts: list[Attempt] = []
    keep = essentials.items

    def over(limit: int | None) -> bool:
        return limit is None or cur > limit

    async def attempt(level: str, plan: Callable[[], Awaitable[CompactionRecord | None]]) -> None:
        nonlocal view, cur
        try:
            rec = await plan()
            if rec is None:
                return
            cand = apply_records(transcript, [*recs, rec])
            problems = check_consistency(view, cand, essentials)
            if problems:
                raise CompactionFailed("inconsistent", "; ".join(problems), level=level)
        except CompactionFailed as exc:
            exc.level = level
            attempts.append(Attempt(level, None, exc, cur, cur))
            return
        after = tokens(cand)
        recs.append(rec)
        attempts.append(Attempt(level, rec, None, cur, after))
        view, cur = cand, after

    def why(label: str) -> str:
        return f"{label}: {cur:,} tokens" + (f" > target {target:,}" if target is not None else "")

    async def l1() -> CompactionRecord | None:
        return plan_l1(transcript, recs, options=options, keep=keep, indices=indices, reason=why("L1"))

    async def l3() -> CompactionRecord | None:
        return plan_l3(transcript, recs, options=options, keep=keep, indices=indices, reason=why("L3"))

    async def l2() -> CompactionRecord | None:
        rng = plan_l2_range(transcript, recs, options=options)
        if rng is None or summarizer is None:
            return None
        spans = view_spans(transcript, recs)
        inside = [m for m, a, b in spans if a >= rng[0] and b <= rng[1] and not isinstance(m, SystemMessage)]
        if count_message_tokens(inside) < options.min_summary_input_tokens:  # a plain count of the range
            return None
        return await summarize_l2(transcript, recs, summarizer, first=rng[0], last=rng[1], options=options,
                                  keep=keep, tokens=tokens, reason=why("L2"),
                                  carry=(*essentials.prohibitions, *essentials.verbatim))

    plans = {"L1": l1, "L3": l3, "L2": l2}
    for level in LEVELS:
        if level not in levels or (level == "L2" and indices is not None):
            continue
        if not over(target):
            break
        await attempt(level, plans[level])
    if fallback and indices is None and hard_limit is not None and cur > hard_limit:
        failed = [a.failure for a in attempts if a.failure is not None]
        note = (f"deterministic fallback ({'; '.join(str(f) for f in failed)[:300] or 'the levels were not enough'})"
                f": {cur:,} tokens > hard limit {hard_limit:,}")

        async def f1() -> CompactionRecord | None:
            return plan_l1(transcript, recs, options=options, keep=keep, fallback=True, reason=note,
                           keep_last_turns=1, preview_chars=options.fallback_preview_chars)

        async def f3() -> CompactionRecord | None:
            return plan_l3(transcript, recs, options=options, keep=keep, fallback=True, reason=note,
                           min_chars=options.fallback_artifact_min_chars, keep_last_turns=0)

        for level, plan in (("L1", f1), ("L3", f3)):
            if level in levels and cur > hard_limit:
                await attempt(level, plan)
    return CompactionOutcome(tuple(recs), tuple(view), tuple(attempts), cur)


# -- the default summarizer ----------------------------------------------------------------------

SUMMARIZER_INSTRUCTIONS = (
    "You compact the earlier part of an AI agent's conversation so the agent can go on without it. "
    "Fill every section of the JSON schema from the conversation below, and nothing else: "
    "goal (the task as the user stated it, with later changes of direction), goal_version "
    "(use {goal_version}), decisions taken, failures met (errors, dead ends), verified facts each with "
    "its evidence (which tool result or message showed it), prohibitions (things the user said never to "
    "do, verbatim), open to-dos, and pending actions. Copy facts and prohibitions word for word. "
    "Be brief: at most 8 items per section, each one short line; never repeat an item. "
    "Use empty lists for empty sections."
)
"""System prompt of :class:`ProviderSummarizer` (``{goal_version}`` is filled in)."""


def _render_for_summary(messages: Sequence[Message], per_message_chars: int, keep: Sequence[str]) -> str:
    parts = []
    for i, m in enumerate(messages):
        if isinstance(m, ToolResultMessage):
            who = f"tool result of {m.name or 'a tool'} (call {m.tool_call_id})" + (" [error]" if m.is_error else "")
        elif isinstance(m, AssistantMessage):
            who = "assistant"
        else:
            who = m.role
        text = _message_text(m)
        if len(text) > per_message_chars:
            head = _head(text, per_message_chars)
            text = "\n".join([head, f"[... {len(text) - len(head):,} more characters]", *_excerpts(text[len(head):], keep)])
        parts.append(f"### {i + 1}. {who}\n{text}")
    return "\n\n".join(parts)


def bounded_schema(schema: OutputSchema, max_items: int, max_chars: int) -> OutputSchema:
    """``schema`` with ``maxItems`` on every array and ``maxLength`` on every string: a grammar-
    constrained server (llama.cpp) then cannot let a small model repeat itself until the output
    limit cuts the JSON. (Not every vendor's strict mode accepts these keywords.)"""

    def bound(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: bound(v) for k, v in node.items()}
        if node.get("type") == "array":
            out["maxItems"] = max_items
        elif node.get("type") == "string":
            out["maxLength"] = max_chars
        return out

    return OutputSchema(schema.name, bound(schema.schema), schema.description, schema.strict)


class ProviderSummarizer:
    """The default summarizer: one schema-constrained call through ``ctx.call_provider``
    (``account=True``: its tokens and cost count toward the run), checked with
    :func:`fsm_agent.parse_output`. The messages are given as one text (each cut to
    ``per_message_chars``, keeping the lines that hold must-keep items), with the must-keep items
    listed, so a small model can copy them.

    Args:
        ctx: the run.
        provider: the summarizing model (``None``: the run's).
        goal_version: filled into the instructions.
        keep: must-keep items to list for the model.
        max_tokens: output tokens of the summary call.
        per_message_chars: characters of each message shown.
        bounds: ``(max_items, max_chars)`` sent as ``maxItems`` / ``maxLength`` in the schema
            (:func:`bounded_schema`); ``"auto"``: ``(8, 240)`` for the ``llamacpp`` profile (its
            grammar enforces them; a small model otherwise repeats itself until the output limit),
            none elsewhere. The answer is checked against the schema that was sent.
    """

    def __init__(self, ctx: RunContext, *, provider: Provider | None = None, goal_version: int = 0,
                 keep: Sequence[str] = (), max_tokens: int = 1500, per_message_chars: int = 4000,
                 instructions: str = SUMMARIZER_INSTRUCTIONS,
                 bounds: tuple[int, int] | str | None = "auto") -> None:
        self.ctx = ctx
        self.provider = provider
        self.goal_version = goal_version
        self.keep = tuple(keep)
        self.max_tokens = max_tokens
        self.per_message_chars = per_message_chars
        self.instructions = instructions
        if bounds == "auto":
            profile = getattr(provider or ctx.provider, "profile", None)
            bounds = (8, 240) if getattr(profile, "name", None) == "llamacpp" else None
        self.bounds: tuple[int, int] | None = bounds if isinstance(bounds, tuple) else None

    def request(self, messages: Sequence[Message], schema: OutputSchema) -> MessageRequest:
        """The summary request."""
        body = _render_for_summary(messages, self.per_message_chars, self.keep)
        if self.keep:
            body += "\n\nItems that must appear word for word in the summary:\n" + "\n".join(f"- {k}" for k in self.keep)
        provider = self.provider or self.ctx.provider
        return MessageRequest(model=provider.model or "",
                              messages=(SystemMessage(self.instructions.format(goal_version=self.goal_version)),
                                        UserMessage(f"The conversation to summarise:\n\n{body}")),
                              max_tokens=self.max_tokens, temperature=0.0, output_schema=schema)

    async def __call__(self, messages: Sequence[Message], schema: OutputSchema) -> SummarizerResult:
        if self.bounds is not None:
            schema = bounded_schema(schema, *self.bounds)
        response: MessageResponse = await self.ctx.call_provider(self.request(messages, schema),
                                                                 provider=self.provider, account=True)
        parsed = parse_output(response, schema)
        if parsed.error is not None:
            raise CompactionFailed("invalid", f"the summary does not match the schema: {parsed.error[:300]}")
        value: Mapping[str, Any] = parsed.value if isinstance(parsed.value, Mapping) else {}
        return SummarizerResult(value, response.id)

    def __repr__(self) -> str:
        return f"ProviderSummarizer(provider={self.provider!r}, max_tokens={self.max_tokens})"


def recorded_summarizer(events: Sequence[Any]) -> Summarizer:
    """A summarizer that answers as a recorded session's summarizer did, for an offline replay
    (``fsm_agent.testing.replay_trajectory`` does not replay ``ctx.call_provider`` calls).

    ``events``: the session's ``compaction`` and ``compaction.failed`` events (``EventRecord``s or
    their ``type`` / ``payload`` dicts), in log order. Each call returns the next committed L2
    record's ``summary_output`` with its call id, or raises the next failed L2 attempt's
    :class:`CompactionFailed`; past the end, it raises ``CompactionFailed("raised", ...)``.
    """
    answers: list[SummarizerResult | CompactionFailed] = []
    for ev in events:
        kind = ev["type"] if isinstance(ev, Mapping) else ev.type
        payload = ev["payload"] if isinstance(ev, Mapping) else ev.payload
        if kind == Compacted.TAG and payload["record"]["level"] == "L2":
            rec = payload["record"]
            answers.append(SummarizerResult(rec["summary_output"], rec["summarizer_call_id"]))
        elif kind == CompactionFailedEvent.TAG and payload["level"] == "L2":
            # (an answer rejected afterwards, as inconsistent or over budget, fails the same way again)
            answers.append(CompactionFailed(payload["reason"], payload["detail"]))
    pending = list(answers)

    async def summarizer(messages: Sequence[Message], schema: OutputSchema) -> SummarizerResult:
        if not pending:
            raise CompactionFailed("raised", "the recording holds no more summarizer answers")
        answer = pending.pop(0)
        if isinstance(answer, CompactionFailed):
            raise answer
        return answer

    return summarizer


# -- the plugin ------------------------------------------------------------------------------------

EssentialsOf = Callable[[Sequence[Message], RunContext], Essentials]
"""``essentials(view, ctx)``: the must-keep items of the context ``view`` (a plugin option)."""


def _limit(name: str, value: Any) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
            or (isinstance(value, float) and value > 1):
        raise ValueError(f"Compaction: {name} must be a token count (int > 0), a fraction of the budget "
                         f"(float in (0, 1]) or None, not {value!r}")
    return value


class Compaction(Middleware):
    """Compaction as a view (module docstring): levels, triggers and limits as options.

    Args (all keyword-only):
        levels: the levels used, of ``L1``, ``L2``, ``L3`` (escalated L1 → L3 → L2). L3 is used only
            when the run offers the load-back tool (:meth:`artifact_tool`), so a reference can
            always be loaded back.
        triggers: of :data:`TRIGGERS`; default ``pre_turn``, ``mid_turn``, ``context_error``
            (``post_turn`` refreshes the summary every ``refresh_every`` steps: one more model call).
        max_context_tokens: the window in tokens (``None``: ``provider.capabilities.context_window``).
        output_reserve_tokens: tokens kept for the answer when the run sets no output limit.
        trigger_tokens: PreTurn compacts when the context is over this: tokens (int) or a fraction
            of the budget (float; budget = window minus the output room). ``None``: never by size.
        target_tokens: the escalation stops once the context is at or under this (same units).
        hard_limit_tokens: over this after the escalation, the deterministic fallback runs (same
            units; ``None``: the whole budget).
        keep_last_turns: steps that L1 never previews and L2 never summarizes.
        preview_chars: characters an old tool result keeps (L1).
        exclude_tools: tools whose results L1 and L3 never edit (the load-back tool always).
        artifact_min_chars: tool results this long are moved out by L3.
        midturn_chars: a tool result longer than this is compacted locally (MidTurn trigger).
        summarizer: ``async (messages, schema) -> mapping`` (``None``: :class:`ProviderSummarizer`
            with ``summarizer_provider`` or the run's provider).
        summarizer_timeout: seconds the summarizer may take.
        max_summary_tokens: a longer summary is rejected as over budget.
        min_summary_input_tokens: no summary of less than this.
        refresh_every: PostTurn trigger: steps between two summary refreshes.
        retry_ratio: after a context-length error the context is compacted to this fraction of its
            size (the fallback when it stays over the midpoint between that and its size).
        l2_retry_messages: after a failed summary, the PreTurn trigger asks for none again until the
            transcript has grown by this many messages (L1, L3 and the fallback still run); a
            context-length error does not wait.
        essentials: ``(view, ctx) -> Essentials``, the must-keep items (default
            :func:`extract_essentials` with ``ctx.goal_version`` and the pending calls).
        store: the session store: needed by the load-back tool and to rebuild the view on resume
            from the session log's ``compaction`` events (without it, a resumed run starts from the
            whole transcript and compacts again as needed).
        fallback: allow the labelled deterministic fallback.
        use_reported_usage: count from the provider's reported input tokens of the last call (else
            tiktoken only).

    Raises:
        ValueError: an option out of range (at construction).

    Runs first among PreTurn middleware (``outermost``): it replaces ``ctx.messages`` with the
    view, and the plugins after it (redaction, budget's wrap-up, repair) work on that. Its
    failures are isolated (``failure_policy = "isolate"``): a bug in it leaves the context as the
    driver built it. Records live in ``ctx.state(self)["records"]``.
    """

    name = "compaction"
    ordering = Ordering(position="outermost")
    failure_policy = FailurePolicy.ISOLATE

    def __init__(self, *, levels: Collection[str] = LEVELS,
                 triggers: Collection[str] = ("pre_turn", "mid_turn", "context_error"),
                 max_context_tokens: int | None = None, output_reserve_tokens: int = 4096,
                 trigger_tokens: int | float | None = 0.8, target_tokens: int | float | None = 0.6,
                 hard_limit_tokens: int | float | None = None, keep_last_turns: int = 2,
                 preview_chars: int = 1500, exclude_tools: Collection[str] = (), artifact_min_chars: int = 8000,
                 midturn_chars: int = 20000, summarizer: Summarizer | None = None,
                 summarizer_provider: Provider | None = None, summarizer_timeout: float | None = 120.0,
                 max_summary_tokens: int = 2000, min_summary_input_tokens: int = 600, refresh_every: int = 4,
                 retry_ratio: float = 0.6, essentials: EssentialsOf | None = None, store: Store | None = None,
                 fallback: bool = True, use_reported_usage: bool = True,
                 artifact_tool_name: str = ARTIFACT_TOOL, l2_retry_messages: int = 6) -> None:
        bad = set(levels) - set(LEVELS) or set(triggers) - set(TRIGGERS)
        if bad:
            raise ValueError(f"Compaction: unknown level or trigger {sorted(bad)}; levels are {LEVELS}, "
                             f"triggers {TRIGGERS}")
        if not 0 < retry_ratio < 1 or refresh_every < 1 or midturn_chars < 1 or output_reserve_tokens < 0 \
                or l2_retry_messages < 0:
            raise ValueError("Compaction: need 0 < retry_ratio < 1, refresh_every >= 1, midturn_chars >= 1, "
                             "output_reserve_tokens >= 0, l2_retry_messages >= 0")
        self.l2_retry_messages = l2_retry_messages
        self.levels = tuple(x for x in LEVELS if x in set(levels))
        self.triggers = tuple(x for x in TRIGGERS if x in set(triggers))
        self.max_context_tokens = max_context_tokens
        self.output_reserve_tokens = output_reserve_tokens
        self.trigger_tokens = _limit("trigger_tokens", trigger_tokens)
        self.target_tokens = _limit("target_tokens", target_tokens)
        self.hard_limit_tokens = _limit("hard_limit_tokens", hard_limit_tokens)
        self.midturn_chars = midturn_chars
        self.summarizer = summarizer
        self.summarizer_provider = summarizer_provider
        self.refresh_every = refresh_every
        self.retry_ratio = retry_ratio
        self.essentials = essentials
        self.store = store
        self.fallback = fallback
        self.use_reported_usage = use_reported_usage
        self.options = CompactionOptions(
            keep_last_turns=keep_last_turns, preview_chars=preview_chars,
            exclude_tools=tuple(dict.fromkeys([artifact_tool_name, *exclude_tools])),
            artifact_min_chars=artifact_min_chars, max_summary_tokens=max_summary_tokens,
            min_summary_input_tokens=min_summary_input_tokens, summarizer_timeout=summarizer_timeout,
            artifact_tool=artifact_tool_name)
        self._tokens: dict[int, tuple[Message, int]] = {}
        """Tokens per message by ``id`` (the message kept to check identity); shared by runs."""

    def __repr__(self) -> str:
        return (f"Compaction(levels={self.levels!r}, triggers={self.triggers!r}, "
                f"trigger_tokens={self.trigger_tokens!r}, target_tokens={self.target_tokens!r}, "
                f"hard_limit_tokens={self.hard_limit_tokens!r}, keep_last_turns={self.options.keep_last_turns!r}, "
                f"midturn_chars={self.midturn_chars!r}, summarizer={self.summarizer!r}, store={self.store!r})")

    # -- the load-back tool ------------------------------------------------------------------------
    def artifact_tool(self, *, max_chars: int = 20000) -> Tool:
        """The L3 load-back tool (add it to the agent's tools; L3 is used only when it is offered).

        ``load_artifact(ref, offset=0)`` returns the text of message ``m<k>`` (the ``k``-th
        ``message`` event of the session log), ``max_chars`` at a time from ``offset``.

        Raises:
            ValueError: the plugin was built without ``store``.
        """
        store = self.store
        if store is None:
            raise ValueError("Compaction.artifact_tool needs the session store: Compaction(store=...)")
        limit = max_chars

        async def load_artifact(ref: str, context: ToolContext, offset: int = 0) -> str:
            """Load back a tool result that compaction moved out of the context.

            Args:
                ref: the reference in the artifact note, e.g. "m12".
                offset: the character to start from (for a result longer than one load).
            """
            found = re.fullmatch(r"\s*m(\d+)\s*", ref)
            if found is None:
                raise ValueError(f"unknown artifact reference {ref!r}: references look like \"m12\"")
            k = int(found.group(1))
            events = await store.read_events(context.session_id, types=("message",))
            if k >= len(events):
                raise ValueError(f"no artifact {ref!r} in this session")
            message: Message = structure(events[k].payload["message"], Message)
            text = _message_text(message)
            start = max(0, offset)
            chunk = text[start:start + limit]
            end = start + len(chunk)
            if end < len(text):
                chunk += (f"\n[characters {start:,}-{end:,} of {len(text):,}; "
                          f"{self.options.artifact_tool}(\"m{k}\", offset={end}) loads the next part]")
            return chunk

        return Tool(load_artifact, name=self.options.artifact_tool, effect="pure")

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _state(self, ctx: RunContext) -> dict[str, Any]:
        st = ctx.state(self)
        if not st:
            st.update(records=[], marked=set(), sent=None, reported=None, refreshed_at=0, warned=False)
        return st

    def _count(self, messages: Sequence[Message]) -> int:
        cache, base = self._tokens, _BASE_TOKENS
        total = base
        for m in messages:
            hit = cache.get(id(m))
            if hit is None or hit[0] is not m:
                if len(cache) >= 8192:
                    cache.clear()
                hit = cache[id(m)] = (m, count_message_tokens((m,)) - base)
            total += hit[1]
        return total

    def _counter(self, ctx: RunContext, st: dict[str, Any]) -> Callable[[Sequence[Message]], int]:
        reported, sent = (st["reported"], st["sent"]) if self.use_reported_usage else (None, None)
        extra = 0
        if reported is None and ctx.settings.tools_enabled and len(ctx.tools):
            extra = estimate_request_tokens(MessageRequest("", (), tools=ctx.tools.definitions(
                ctx.settings.active_tools))) - _BASE_TOKENS

        def tokens(messages: Sequence[Message]) -> int:
            return count_tokens(messages, reported=reported, sent=sent, extra=extra, count=self._count)

        return tokens

    def budget(self, ctx: RunContext) -> int | None:
        """Prompt tokens the context may use: the window minus the output room (``None``: unknown)."""
        window = self.max_context_tokens or ctx.provider.capabilities.context_window
        if window is None:
            return None
        reserve = ctx.settings.max_output_tokens or ctx.config.max_output_tokens or self.output_reserve_tokens
        return max(0, window - reserve)

    def _tokens_of(self, value: int | float | None, budget: int | None) -> int | None:
        if value is None:
            return None
        if isinstance(value, float):
            return None if budget is None else int(budget * value)
        return int(value)

    def _options(self, ctx: RunContext) -> tuple[CompactionOptions, tuple[str, ...]]:
        """The options and levels of this run: L3 (and load hints) only when the load-back tool is offered."""
        offered = self.options.artifact_tool in ctx.tools
        options = self.options if offered else evolve(self.options, load_hint=False)
        return options, tuple(x for x in self.levels if x != "L3" or offered)

    def _keep(self, ctx: RunContext, view: Sequence[Message], levels: Sequence[str]
              ) -> tuple[Essentials, Summarizer | None]:
        """The must-keep items of ``view``, and the summarizer told about them."""
        if self.essentials is not None:
            essentials = self.essentials(view, ctx)
        else:
            essentials = extract_essentials(view, ctx.goal_version, [c.id for c in ctx.pending_calls])
        summarizer = self.summarizer
        if summarizer is None and "L2" in levels:
            summarizer = ProviderSummarizer(ctx, provider=self.summarizer_provider, goal_version=ctx.goal_version,
                                            keep=essentials.items)
        return essentials, summarizer

    def _report(self, ctx: RunContext, st: dict[str, Any], outcome: CompactionOutcome, trigger: str) -> None:
        for a in outcome.attempts:
            if a.record is not None:
                st["records"].append(a.record)
                ctx.emit(Compacted(ctx.session_id, ctx.turn, trigger, a.record, a.tokens_before, a.tokens_after,
                                   len(st["records"]) - 1))
                log.info("session %s: %s compaction (%s)%s: %d -> %d tokens", ctx.session_id, a.level, trigger,
                         " [fallback]" if a.record.fallback else "", a.tokens_before, a.tokens_after)
            elif a.failure is not None:
                if a.level == "L2":  # back off: the same summary is not asked for again at once
                    st["l2_failed_at"] = len(ctx.transcript)
                ctx.emit(CompactionFailedEvent(ctx.session_id, ctx.turn, trigger, a.level, a.failure.reason,
                                               a.failure.detail, a.tokens_before))
                log.warning("session %s: %s (%s); nothing changed", ctx.session_id, a.failure, trigger)

    def _local(self, ctx: RunContext, st: dict[str, Any], hidden_or_done: set[int]) -> set[int]:
        """Transcript indices of large results to compact locally: those marked in MidTurn, and those
        of the newest step (after the last assistant message: a resume lost the marks)."""
        transcript = ctx.transcript
        exclude = set(self.options.exclude_tools)
        marked = st["marked"]

        def large(i: int, m: Message) -> bool:
            return isinstance(m, ToolResultMessage) and i not in hidden_or_done and m.name not in exclude \
                and len(m.text) > self.midturn_chars

        out: set[int] = set()
        if marked:
            out.update(i for i, m in enumerate(transcript)
                       if isinstance(m, ToolResultMessage) and m.tool_call_id in marked and large(i, m))
            marked.clear()
        for i in range(len(transcript) - 1, -1, -1):
            m = transcript[i]
            if isinstance(m, AssistantMessage):
                break
            if large(i, m):
                out.add(i)
        return out

    # -- hooks -----------------------------------------------------------------------------------
    async def on_run_start(self, ctx: RunContext) -> None:
        """Rebuild the records of a resumed session from its ``compaction`` events (with ``store``):
        records that no longer fit the transcript (written after its last checkpoint) are dropped."""
        st = ctx.state(self)
        st.clear()
        st = self._state(ctx)
        if self.store is None:
            return
        try:
            events = await self.store.read_events(ctx.session_id, types=(Compacted.TAG,))
        except Exception as exc:  # noqa: BLE001 - the view then starts from the transcript
            log.warning("session %s: could not read compaction events (%s); starting from the whole transcript",
                        ctx.session_id, exc)
            return
        records: list[CompactionRecord] = []
        transcript = ctx.transcript
        for ev in events:
            try:
                rec: CompactionRecord = structure(ev.payload["record"], CompactionRecord)
                fits = rec.last < len(transcript) and \
                    _messages_sha(transcript[rec.first:rec.last + 1]) == rec.covered_sha256
                if fits:
                    view_spans(transcript, [*records, rec])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                log.warning("session %s: compaction event %d unreadable (%s); later ones dropped",
                            ctx.session_id, ev.seq, exc)
                break
            if not fits:
                log.info("session %s: compaction event %d does not fit the transcript (written after the last "
                         "checkpoint); it and later ones are dropped", ctx.session_id, ev.seq)
                break
            records.append(rec)
        st["records"] = records

    async def pre_turn(self, ctx: RunContext) -> None:
        """Rebuild the view; compact locally what MidTurn marked; compact when over the trigger (or
        harder after a context-length error)."""
        st = self._state(ctx)
        transcript = ctx.transcript
        if len(ctx.messages) != len(transcript) or any(a is not b for a, b in zip(ctx.messages, transcript)):
            if not st["warned"]:
                st["warned"] = True
                log.warning("session %s: ctx.messages was changed before compaction ran (list compaction first); "
                            "compaction is skipped in this run", ctx.session_id)
            return
        records = st["records"]
        view = apply_records(transcript, records)
        options, levels = self._options(ctx)
        found: list[tuple[Essentials, Summarizer | None]] = []

        def must_keep() -> tuple[Essentials, Summarizer | None]:
            """The essentials of the view before any edit of this PreTurn (only when one is tried)."""
            if not found:
                found.append(self._keep(ctx, view, levels))
            return found[0]

        tokens = self._counter(ctx, st)
        if "mid_turn" in self.triggers:
            hidden, done = _current(transcript, records)
            local_levels = ("L3",) if "L3" in levels else ("L1",) if "L1" in levels else ()
            local = self._local(ctx, st, hidden | {i for i, e in done.items() if e.kind in ("artifact", "preview")})
            if local and local_levels:
                outcome = await compact(transcript, records, target=None, levels=local_levels,
                                        essentials=must_keep()[0], options=options, tokens=tokens, indices=local,
                                        fallback=False)
                self._report(ctx, st, outcome, "mid_turn")
                view = list(outcome.view)
        budget = self.budget(ctx)
        cur = tokens(view)
        hard = self._tokens_of(self.hard_limit_tokens, budget) or budget
        if ctx.context_retry and "context_error" in self.triggers:
            trigger, target = "context_error", int(cur * self.retry_ratio)
            hard = min(x for x in (hard, int(cur * (1 + self.retry_ratio) / 2)) if x is not None)
        else:
            limit = self._tokens_of(self.trigger_tokens, budget)
            if "pre_turn" not in self.triggers or limit is None or cur <= limit:
                ctx.messages = view
                return
            trigger, target = "pre_turn", self._tokens_of(self.target_tokens, budget) or limit
        failed_at = st.get("l2_failed_at")
        if failed_at is not None and trigger == "pre_turn" and "L2" in levels \
                and len(transcript) - failed_at < self.l2_retry_messages:
            # a summary failed a moment ago (a small model's JSON cut off, a provider error): until the
            # transcript has grown by l2_retry_messages, only L1 / L3 and the labelled fallback run
            levels = tuple(lv for lv in levels if lv != "L2")
        essentials, summarizer = must_keep()
        outcome = await compact(transcript, st["records"], target=target, hard_limit=hard, levels=levels,
                                summarizer=summarizer, essentials=essentials, options=options, tokens=tokens,
                                fallback=self.fallback)
        self._report(ctx, st, outcome, trigger)
        ctx.messages = list(outcome.view)

    async def wrap_model_call(self, request: MessageRequest, call_next: Any, ctx: RunContext) -> MessageResponse:
        """Remember what was sent and the input tokens the provider reported for it (the base of the
        next count); a context-length error's reported size too. Changes nothing."""
        st = self._state(ctx)
        try:
            response: MessageResponse = await call_next(request)
        except ContextLengthExceededError as exc:
            size = exc.input_tokens or exc.requested
            st["sent"], st["reported"] = (request.messages, size) if size else (None, None)
            raise
        usage = response.usage
        if usage is not None and not usage.estimated and usage.input_tokens > 0:
            st["sent"], st["reported"] = request.messages, usage.input_tokens
        else:
            st["sent"], st["reported"] = None, None
        return response

    async def wrap_tool_call(self, call: ToolUseBlock, call_next: Any, ctx: RunContext) -> ToolResultMessage:
        """MidTurn trigger: mark a result longer than ``midturn_chars`` for a local compaction at the
        next PreTurn. The result itself goes on unchanged (the log keeps the tool's real output)."""
        result: ToolResultMessage = await call_next(call)
        if "mid_turn" in self.triggers and call.name not in self.options.exclude_tools \
                and len(result.text) > self.midturn_chars:
            self._state(ctx)["marked"].add(call.id)
        return result

    async def post_turn(self, ctx: RunContext) -> None:  # type: ignore[override]
        """PostTurn trigger (off by default): refresh the long-term summary every ``refresh_every``
        steps. Returns no decision."""
        if "post_turn" not in self.triggers or "L2" not in self.levels:
            return None
        st = self._state(ctx)
        steps = len(_step_starts(ctx.transcript))
        if steps - st["refreshed_at"] < self.refresh_every:
            return None
        st["refreshed_at"] = steps
        transcript = ctx.transcript
        view = apply_records(transcript, st["records"])
        options, levels = self._options(ctx)
        essentials, summarizer = self._keep(ctx, view, levels)
        outcome = await compact(transcript, st["records"], target=None, levels=("L2",), summarizer=summarizer,
                                essentials=essentials, options=options, tokens=self._counter(ctx, st),
                                fallback=False)
        self._report(ctx, st, outcome, "post_turn")
        return None


_BASE_TOKENS = count_message_tokens(())
