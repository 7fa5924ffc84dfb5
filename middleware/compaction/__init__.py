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
  avoid ... in many languages; :mod:`.constraints`), and the whole message when the reader cannot
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

**Modules**, each one concern, importing only those above it in this list (no circles):

==================  ===========================================================================
``constraints``     reading the constraints a person wrote, sentence by sentence (no messages)
``records``         the data: records, events, the levels' settings, :class:`CompactionFailed`
``view``            THE view (:func:`apply_records`) and how the transcript reads (steps, units)
``summary``         the summary message: its schema, :func:`render_summary`, reading one back
``essentials``      what must survive: :func:`extract_essentials`, :func:`check_consistency`,
                    the lines a shrunk result keeps, what a summary carries word for word
``levels``          the planners: :func:`plan_l1`, :func:`plan_l3`, :func:`plan_l2_range`
``summarizer``      L2: :func:`summarize_l2`, :class:`ProviderSummarizer`,
                    :func:`recorded_summarizer`
``escalation``      :func:`count_tokens` and :func:`compact` (the escalation and the fallback)
``plugin``          :class:`Compaction`, the middleware
==================  ===========================================================================

This package's namespace is the public surface; the modules are how it is built.
"""

from .escalation import Attempt, CompactionOutcome, compact, count_tokens
from .essentials import STEER_PREFIX, Essentials, check_consistency, extract_essentials
from .levels import plan_l1, plan_l2_range, plan_l3
from .plugin import Compaction, EssentialsOf
from .records import (
    ARTIFACT_TOOL,
    LEVELS,
    TRIGGERS,
    Compacted,
    CompactionFailed,
    CompactionFailedEvent,
    CompactionOptions,
    CompactionRecord,
    ContentEdit,
    Summarizer,
    SummarizerResult,
)
from .summarizer import (
    SUMMARIZER_INSTRUCTIONS,
    ProviderSummarizer,
    _check_output,
    bounded_schema,
    recorded_summarizer,
    summarize_l2,
)
from .summary import CARRIED_HEADING, SUMMARY_PREFIX, SUMMARY_SCHEMA, VERBATIM_HEADING, render_summary
from .view import apply_records, pairing_problems, view_spans

__all__ = [
    "Attempt", "Compacted", "Compaction", "CompactionFailed", "CompactionFailedEvent", "CompactionOptions",
    "CompactionOutcome", "CompactionRecord", "ContentEdit", "Essentials", "LEVELS", "ProviderSummarizer",
    "SUMMARY_PREFIX", "SUMMARY_SCHEMA", "Summarizer", "SummarizerResult", "TRIGGERS", "apply_records",
    "bounded_schema", "check_consistency", "compact", "count_tokens", "extract_essentials",
    "pairing_problems", "plan_l1", "plan_l2_range", "plan_l3", "recorded_summarizer", "render_summary",
    "summarize_l2", "view_spans",
]
# Also here, as before the split (not in __all__): ARTIFACT_TOOL, CARRIED_HEADING, VERBATIM_HEADING,
# STEER_PREFIX, SUMMARIZER_INSTRUCTIONS, EssentialsOf, and _check_output (the unit tests call it).
