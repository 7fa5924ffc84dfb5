"""The data of compaction: what a record holds, the events the plugin writes, the settings of the
levels, and the failure every part raises.

A :class:`CompactionRecord` is what a ``compaction`` event of the session log holds; the view
(:mod:`.view`) is rebuilt from the transcript and these records. Nothing here computes anything
but hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Union

import orjson
from attrs import frozen

from fsm_agent import OutputSchema
from fsm_agent.errors import RunError
from fsm_agent.types import Message, unstructure


LEVELS: tuple[str, ...] = ("L1", "L3", "L2")
"""The levels in escalation order (cheap and lossless first, the summary last)."""

TRIGGERS: tuple[str, ...] = ("pre_turn", "mid_turn", "post_turn", "context_error")
"""Every trigger the plugin knows (``post_turn`` is off by default)."""

ARTIFACT_TOOL = "load_artifact"
"""Default name of the load-back tool; its results are never compacted."""


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


# -- settings of the levels --------------------------------------------------------------------

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


# -- hashes ------------------------------------------------------------------------------------

def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _messages_sha(messages: Sequence[Message]) -> str:
    h = hashlib.sha256()
    for m in messages:
        h.update(orjson.dumps(unstructure(m, Message), option=orjson.OPT_SORT_KEYS))
        h.update(b"\n")
    return h.hexdigest()
