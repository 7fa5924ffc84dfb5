"""The planners: the edit each level would make now, as a record (nothing is committed here).

L1 (:func:`plan_l1`) folds repeated lines and identical results and shrinks old results to a
preview; L3 (:func:`plan_l3`) moves large results out behind a reference; :func:`plan_l2_range`
is the range an L2 summary would replace (the summary itself is :mod:`.summarizer`'s).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from fsm_agent import SystemMessage, ToolResultMessage
from fsm_agent.types import Message

from .essentials import _excerpts, _head, _kept_in
from .records import CompactionOptions, CompactionRecord, ContentEdit, _messages_sha, _sha
from .view import _USER, _ages, _current, _effective_l2, _persons, _step_starts


# -- L1 ----------------------------------------------------------------------------------------

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


# -- L2: the range -----------------------------------------------------------------------------

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
