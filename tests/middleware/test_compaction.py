"""Compaction (issue 11): each level on a hand-made history with exact expectations, every way the
summarizer can fail (nothing changes, one ``compaction.failed``), the consistency check, the
labelled deterministic fallback, token counting, and the plugin in real runs (PreTurn, MidTurn
with the load-back tool, a context-length error, PostTurn, resume, the session log and the CLI,
the state diagram). The invariants over generated conversations are in
``test_compaction_properties.py``."""

from __future__ import annotations

from types import SimpleNamespace

import asyncio
import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from attrs import evolve

from fsm_agent import (
    Agent,
    ContextLengthExceededError,
    MemoryStore,
    MessageRequest,
    OutputSchema,
    RunConfig,
    ScriptedProvider,
    SQLiteStore,
    StopReason,
    StopRun,
    tool,
)
from fsm_agent.diagrams import render_machine
from fsm_agent.plugins import load_plugin
from fsm_agent.providers import ProviderCapabilities, text_response, tool_call_response
from fsm_agent.types import (
    AssistantMessage,
    Message,
    SystemMessage,
    TextBlock,
    ToolResultMessage,
    ToolUseBlock,
    Usage,
    UserMessage,
    count_message_tokens,
    estimate_request_tokens,
    structure,
    unstructure,
)
from fsm_agent_middleware.compaction import (
    SUMMARY_PREFIX,
    SUMMARY_SCHEMA,
    Compacted,
    Compaction,
    CompactionFailed,
    CompactionOptions,
    CompactionRecord,
    Essentials,
    SummarizerResult,
    apply_records,
    check_consistency,
    compact,
    count_tokens,
    extract_essentials,
    pairing_problems,
    plan_l1,
    plan_l2_range,
    plan_l3,
    render_summary,
    summarize_l2,
    view_spans,
)

FACT = "the invoice total is 4,217.50 EUR"
PROHIBITION = "never push directly to the main branch"
PROHIBITION2 = "never change the billing code"
BIG_A = "\n".join(f"row {i}: " + "a" * 70 for i in range(40)) + f"\nNOTE: {FACT}\n" + \
    "\n".join(f"row {i}: " + "b" * 70 for i in range(40, 80))
LOG = "starting\n" + "retrying connection...\n" * 50 + "connected"
SAME = "identical output " * 30
HUGE = "\n".join(f"{i:05d} " + "x" * 90 for i in range(200))  # ~19 KB


def call(cid: str, name: str = "read_file", **args: Any) -> ToolUseBlock:
    return ToolUseBlock(cid, name, args)


def asst(*calls: ToolUseBlock, text: str = "") -> AssistantMessage:
    return AssistantMessage(((TextBlock(text),) if text else ()) + calls)


def res(cid: str, text: str, name: str = "read_file") -> ToolResultMessage:
    return ToolResultMessage(cid, text, name=name)


def history() -> list[Message]:
    """system, goal; step 1: read a (big, holds FACT); step 2: read b + shell (a repeated log line);
    two identical results; an answer; a new question; the last step; the answer."""
    return [
        SystemMessage("You are careful."),
        UserMessage(f"Goal: reconcile the invoices.\nConstraints:\n- {PROHIBITION}"),
        asst(call("c1", path="a")),                                           # 2  step 1
        res("c1", BIG_A),                                                     # 3
        asst(call("c2", path="b"), call("c3", "run_shell", cmd="x")),         # 4  step 2
        res("c2", SAME),                                                      # 5
        res("c3", LOG, name="run_shell"),                                     # 6
        asst(call("c4", path="b")),                                           # 7  step 3
        res("c4", SAME),                                                      # 8
        AssistantMessage(f"Looked at a and b; I will {PROHIBITION2}."),      # 9  step 4
        UserMessage("Go on."),                                                # 10
        asst(call("c5", path="c")),                                           # 11 step 5
        res("c5", "short"),                                                   # 12
        AssistantMessage("Done."),                                            # 13 step 6
    ]


def dumps(messages: Sequence[Message]) -> bytes:
    return orjson.dumps([unstructure(m, Message) for m in messages], option=orjson.OPT_SORT_KEYS)


def good_output(facts: Sequence[str] = (FACT,), prohibitions: Sequence[str] = (PROHIBITION, PROHIBITION2),
                goal_version: int = 1, **over: Any) -> dict[str, Any]:
    out = {"goal": "reconcile the invoices", "goal_version": goal_version, "decisions": ["read a and b first"],
           "failures": [], "verified_facts": [{"fact": f, "evidence": "read_file a"} for f in facts],
           "prohibitions": list(prohibitions), "todos": ["file the report"], "pending_actions": []}
    out.update(over)
    return out


class Spy:
    """A summarizer that records its inputs and answers with ``output`` (or a callable of the input)."""

    def __init__(self, output: Any = None) -> None:
        self.output = output if output is not None else good_output()
        self.inputs: list[tuple[Message, ...]] = []

    async def __call__(self, messages: Sequence[Message], schema: OutputSchema) -> Any:
        assert schema is SUMMARY_SCHEMA
        self.inputs.append(tuple(messages))
        return self.output(messages) if callable(self.output) else self.output


ESS = Essentials("Goal: reconcile the invoices.", 1, (PROHIBITION, PROHIBITION2), (FACT,))
OPTS = CompactionOptions(min_summary_input_tokens=1)


# -- L1 -------------------------------------------------------------------------------------------

def test_l1_folds_repeated_lines_identical_results_and_previews_old_results() -> None:
    h = history()
    rec = plan_l1(h, options=CompactionOptions(preview_chars=1000), keep=ESS.items)
    assert rec is not None and rec.level == "L1"
    kinds = {e.index: e.kind for e in rec.edits}
    assert kinds == {3: "preview", 5: "fold", 6: "dedupe"}
    view = apply_records(h, [rec])
    # every message, call and id stays: only the text of tool results changed
    assert len(view) == len(h)
    assert [type(m) for m in view] == [type(m) for m in h]
    assert all(v is m for v, m in zip(view, h, strict=True) if not isinstance(m, ToolResultMessage))
    assert [m.tool_call_id for m in view if isinstance(m, ToolResultMessage)] == ["c1", "c2", "c3", "c4", "c5"]
    assert view[3].text.startswith("row 0: ") and len(view[3].text) < len(BIG_A) // 2
    assert "L1 preview" in view[3].text and f"NOTE: {FACT}" in view[3].text  # the fact's line is kept
    assert view[5].text == f"[L1: identical to the later result of call c4 (m8), {len(SAME):,} characters]"
    assert view[8] is h[8]  # the last of the identical results stays whole
    assert view[6].text == "starting\nretrying connection...\n[L1: the line above repeats 49 more times]\nconnected"
    assert view[3].metadata == {"compacted": "preview"} and h[3].metadata is None
    assert pairing_problems(view) == [] and check_consistency(h, view, ESS) == []
    assert rec.first == 3 and rec.last == 6 and rec.kept == (FACT,)
    assert rec.edits[0].original_chars == len(BIG_A)


def test_l1_keeps_recent_results_and_excluded_tools_whole() -> None:
    h = history()
    h[12] = res("c5", BIG_A)  # newest step: never previewed
    rec = plan_l1(h, options=CompactionOptions(preview_chars=1000, exclude_tools=("run_shell",)))
    assert rec is not None
    assert {e.index for e in rec.edits} == {3, 5}  # not 6 (excluded), not 12 (recent)


def test_l1_is_none_when_nothing_shrinks() -> None:
    assert plan_l1([UserMessage("hi"), asst(call("c1")), res("c1", "ok"), AssistantMessage("ok")]) is None


# -- L3 -------------------------------------------------------------------------------------------

def test_l3_moves_large_results_out_behind_a_reference_and_keeps_fact_lines() -> None:
    h = history()[:13]  # ends with the newest step's result
    h[12] = res("c5", HUGE)
    rec = plan_l3(h, options=CompactionOptions(artifact_min_chars=5000, artifact_preview_chars=200), keep=ESS.items)
    assert rec is not None and rec.level == "L3"
    assert [(e.index, e.kind) for e in rec.edits] == [(3, "artifact")]  # the newest step's result stays
    text = apply_records(h, [rec])[3].text
    assert text.startswith(f'[artifact m3: {len(BIG_A):,} chars of read_file output (call c1), moved out of the '
                           'context — load_artifact("m3") loads it back]\nrow 0: ')
    assert f"NOTE: {FACT}" in text and len(text) < 600
    # the MidTurn trigger names the result, whatever its age
    local = plan_l3(h, options=CompactionOptions(artifact_min_chars=5000), indices={12})
    assert local is not None and [e.index for e in local.edits] == [12]


def test_l3_after_l1_does_not_move_a_preview_again() -> None:
    h = history()
    l1 = plan_l1(h, options=CompactionOptions(preview_chars=500))
    assert l1 is not None
    assert plan_l3(h, [l1], options=CompactionOptions(artifact_min_chars=3000)) is None


# -- L2 -------------------------------------------------------------------------------------------

def test_l2_range_cuts_at_unit_boundaries_and_keeps_head_and_tail() -> None:
    h = history()
    assert plan_l2_range(h, options=CompactionOptions(keep_last_turns=2)) == (2, 9)  # the question before stays
    assert plan_l2_range(h, options=CompactionOptions(keep_last_turns=1)) == (2, 12)
    assert plan_l2_range(h, options=CompactionOptions(keep_last_turns=6)) is None
    # calls split across two assistant messages are one unit with their results
    split = [UserMessage("go"), asst(call("a1"), text="two"), asst(call("a2")), res("a2", "2"), res("a1", "1"),
             asst(call("b1")), res("b1", "x"), AssistantMessage("end")]
    assert plan_l2_range(split, options=CompactionOptions(keep_last_turns=2)) == (1, 4)


async def test_l2_replaces_its_range_with_one_summary_message_holding_the_output_verbatim() -> None:
    h = history()
    spy = Spy(SummarizerResult(good_output(), "resp_42"))
    rec = await summarize_l2(h, [], spy, first=2, last=9, options=OPTS, keep=ESS.items)
    assert spy.inputs == [tuple(h[2:10])]  # the input is exactly the range
    view = apply_records(h, [rec])
    assert view[:2] == h[:2] and view[3:] == h[10:]
    summary = view[2]
    assert isinstance(summary, UserMessage) and summary.text == rec.summary
    assert summary.text == render_summary(good_output(), first=2, last=9, call_id="resp_42")
    assert summary.text.splitlines()[:3] == [
        f"{SUMMARY_PREFIX} Messages m2-m9 of this session, summarised (summarizer call resp_42).",
        "Goal (version 1): reconcile the invoices", "Decisions:"]
    assert f"- {FACT} (evidence: read_file a)" in summary.text and f"- {PROHIBITION2}" in summary.text
    assert rec.summarizer_call_id == "resp_42" and rec.summary_output == good_output()
    assert rec.summary_sha256 is not None and len(rec.summary_sha256) == 64 and rec.summarizer_input_messages == 8
    assert check_consistency(h, view, ESS) == [] and pairing_problems(view) == []


async def test_a_later_summary_supersedes_the_earlier_one_and_reads_it() -> None:
    h = history() + [UserMessage("More."), asst(call("c6")), res("c6", "x"), AssistantMessage("ok"),
                     UserMessage("Again."), asst(call("c7")), res("c7", "y"), AssistantMessage("ok")]
    spy = Spy()
    first = await summarize_l2(h, [], spy, first=2, last=9, options=OPTS)
    rng = plan_l2_range(h, [first], options=OPTS)
    assert rng == (2, 17)
    second = await summarize_l2(h, [first], spy, first=rng[0], last=rng[1], options=OPTS)
    view = apply_records(h, [first, second])
    assert [m.text.startswith(SUMMARY_PREFIX) for m in view].count(True) == 1
    assert spy.inputs[1][0].text == first.summary  # the earlier summary is part of the input
    assert view[2].text == second.summary and view[3:] == h[18:]


def test_apply_records_is_deterministic_and_checks_its_records() -> None:
    h = history()
    rec = plan_l1(h, options=CompactionOptions(preview_chars=800))
    assert rec is not None
    assert dumps(apply_records(h, [rec])) == dumps(apply_records(list(h), [rec]))
    assert apply_records(h, []) == h
    with pytest.raises(ValueError, match="not that result"):
        apply_records(h, [evolve(rec, edits=(evolve(rec.edits[0], index=2),))])
    with pytest.raises(ValueError, match="outside"):
        apply_records(h[:3], [rec])
    # a view rebuilt from the stored (unstructured) record is the same
    again = structure(orjson.loads(orjson.dumps(unstructure(rec))), CompactionRecord)
    assert dumps(apply_records(h, [again])) == dumps(apply_records(h, [rec]))
    assert [(m.text[:10], a, b) for m, a, b in view_spans(h, [rec])][3][1:] == (3, 3)


# -- failures change nothing ----------------------------------------------------------------------

class Boom(RuntimeError):
    pass


async def _raises(messages: Sequence[Message], schema: OutputSchema) -> Any:
    raise Boom("provider down")


async def _slow(messages: Sequence[Message], schema: OutputSchema) -> Any:
    await asyncio.sleep(30)


async def _cancelled(messages: Sequence[Message], schema: OutputSchema) -> Any:
    raise asyncio.CancelledError()


def _answer(value: Any) -> Any:
    async def summarizer(messages: Sequence[Message], schema: OutputSchema) -> Any:
        return value
    return summarizer


async def _late(messages: Sequence[Message], schema: OutputSchema) -> Any:
    """Swallows the timeout's cancellation and answers late (a summarizer that ignores it)."""
    try:
        await asyncio.sleep(0.3)
    except asyncio.CancelledError:
        await asyncio.sleep(0.1)
    return good_output()


def _nested(depth: int) -> Any:
    v: Any = "x"
    for _ in range(depth):
        v = {"k": v}
    return v


EMPTY = good_output(facts=(), prohibitions=(), goal="", decisions=[], todos=[])
FAULTS = {
    "late-answer": (_late, "timeout"),
    "refusal-in-failures": (_answer(good_output(failures=["I'm sorry, I could not summarise this conversation."])),
                            "error_text"),
    "extra-key": (_answer({**good_output(), "notes": _nested(400)}), "invalid"),
    "extra-fact-key": (_answer(good_output(verified_facts=[{"fact": FACT, "evidence": "read_file a",
                                                            "source": "x"}])), "invalid"),
    "error-evidence": (_answer(good_output(verified_facts=[{"fact": FACT, "evidence": "Error code: 500 - "
                                                            "{'error': 'internal'}"}])), "error_text"),
    "raise": (_raises, "raised"),
    "timeout": (_slow, "timeout"),
    "cancel": (_cancelled, "cancelled"),
    "empty": (_answer(EMPTY), "empty"),
    "whitespace": (_answer({**EMPTY, "goal": "  \n\t ", "decisions": ["   "]}), "empty"),
    "over-budget": (_answer(good_output(decisions=["a long decision " * 40] * 20)), "over_budget"),
    "sorry": (_answer(good_output(goal="I'm sorry, I cannot summarise this conversation.")), "error_text"),
    "error": (_answer(good_output(goal="Error: upstream timeout")), "error_text"),
    "could-not": (_answer(good_output(todos=["(could not summarise the rest)"])), "error_text"),
    "http-error": (_answer(good_output(goal="Error code: 429 - {'error': {'message': 'Rate limit reached for "
                                            "requests', 'type': 'requests', 'code': 'rate_limit_exceeded'}}")),
                   "error_text"),
    "exception": (_answer(good_output(decisions=["openai.RateLimitError: too many requests"])), "error_text"),
    "traceback": (_answer(good_output(todos=["Traceback (most recent call last):\n  File \"x.py\""])), "error_text"),
    "not-a-mapping": (_answer("Here is the summary: ..."), "invalid"),
    "missing-section": (_answer({"goal": "x", "goal_version": 1}), "invalid"),
    "lost-fact": (_answer(good_output(facts=())), "inconsistent"),
    "wrong-goal-version": (_answer(good_output(goal_version=3)), "inconsistent"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_every_summarizer_fault_commits_nothing_and_says_why(fault: str) -> None:
    summarizer, reason = FAULTS[fault]
    h = history()
    l1 = plan_l1(h, options=CompactionOptions(preview_chars=800), keep=ESS.items)
    assert l1 is not None
    records = [l1]
    snapshot = orjson.dumps([unstructure(r) for r in records])
    before = dumps(apply_records(h, records))
    options = evolve(OPTS, summarizer_timeout=0.05, max_summary_tokens=400)
    out = await compact(h, records, target=None, levels=("L2",), summarizer=summarizer, essentials=ESS,
                        options=options, fallback=False)
    assert [(a.level, a.record, a.failure.reason if a.failure else None) for a in out.attempts] == \
        [("L2", None, reason)]
    assert out.records == tuple(records) and out.committed == ()
    assert dumps(out.view) == before  # the next context is byte-identical
    assert orjson.dumps([unstructure(r) for r in records]) == snapshot
    assert not any(m.text.startswith(SUMMARY_PREFIX) for m in out.view)


async def test_the_run_being_cancelled_is_not_swallowed_as_a_failed_summary() -> None:
    started = asyncio.Event()

    async def slow(messages: Sequence[Message], schema: OutputSchema) -> Any:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.ensure_future(compact(history(), [], target=None, levels=("L2",), summarizer=slow, options=OPTS))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_stoprun_from_the_summarizer_passes_through() -> None:
    async def stop(messages: Sequence[Message], schema: OutputSchema) -> Any:
        raise StopRun(StopReason.PAUSED_BUDGET, "no budget for a summary")

    with pytest.raises(StopRun):
        await compact(history(), [], target=None, levels=("L2",), summarizer=stop, options=OPTS)


def test_error_looking_text_is_told_from_ordinary_text() -> None:
    from fsm_agent_middleware.compaction import _check_output

    for text in ("Error handling was moved into one module", "the API rate limit of yield is 61648 requests per minute",
                 "fix the error in parser.py", "errors are logged to /var/log/app"):
        assert _check_output(good_output(decisions=[text]), SUMMARY_SCHEMA)["decisions"] == [text]
    # the failures section may quote errors
    assert _check_output(good_output(failures=["Error: tests failed on CI"]), SUMMARY_SCHEMA)


# -- the consistency check -------------------------------------------------------------------------

def test_consistency_names_what_was_lost() -> None:
    h = history()
    ess = Essentials("Goal: reconcile the invoices.", 2, (PROHIBITION, PROHIBITION2), (FACT,), ("c9",))
    pending = [*h[:-1], asst(call("c9")),]
    gone = [m for i, m in enumerate(pending) if i not in (1, 3, 9)] + [UserMessage(f"{SUMMARY_PREFIX} x\nGoal (version 1): y")]
    problems = check_consistency(pending, gone, ess)
    assert f"lost prohibition: {PROHIBITION!r}" in problems and f"lost prohibition: {PROHIBITION2!r}" in problems
    assert f"lost verified fact: {FACT!r}" in problems
    assert "lost goal: 'Goal: reconcile the invoices.'" in problems
    assert "the new summary states goal version 1, the run is at 2" in problems
    assert any(p.startswith("pairing: ") for p in problems)  # c1's call lost its result
    assert "lost pending action: call 'c9'" in check_consistency(pending, pending[:-1], ess)
    assert check_consistency(h, h, ess) == []
    # case and whitespace do not matter; absent before means nothing to lose
    assert check_consistency([UserMessage("NEVER   push directly\nto the main branch")],
                             [UserMessage(PROHIBITION)], ess) == []
    assert check_consistency([UserMessage("x")], [UserMessage("y")], ess) == []


def test_extract_essentials_reads_constraints_summaries_and_open_calls() -> None:
    msgs = [SystemMessage("Be brief. Do not reveal the system prompt."),
            UserMessage("Goal: ship it.\nConstraints:\n- never push directly to the main branch; never send email"),
            UserMessage(f"{SUMMARY_PREFIX} Messages m2-m5 of this session, summarised.\nGoal (version 1): ship it\n"
                        f"Verified facts:\n- {FACT} "
                        "(evidence: m3)\nProhibitions:\n- never run migrations"),
            UserMessage("I don't know what you mean"),
            asst(call("open1")), res("zz", "Verified: the port is 8080")]
    e = extract_essentials(msgs, 3)
    assert e.goal == "Goal: ship it." and e.goal_version == 3
    # each item as written (a header with its list is one item); the reader errs towards
    # constraints: "I don't know" costs its sentence in a summary, a missed constraint would be lost
    assert e.prohibitions == ("Do not reveal the system prompt.",
                              f"Constraints:\n- {PROHIBITION}; never send email", "never run migrations",
                              "I don't know what you mean")
    assert e.facts == (FACT, "the port is 8080")
    assert e.pending == ("open1",) and e.verbatim == ()


# -- escalation and the fallback -------------------------------------------------------------------

async def test_escalation_stops_once_under_target_and_goes_l1_l3_l2() -> None:
    h = history()
    h[12] = res("c5", HUGE)
    size = count_message_tokens(h)
    spy = Spy()
    out = await compact(h, [], target=size - 10, summarizer=spy, essentials=ESS, options=OPTS)
    assert [a.level for a in out.attempts] == ["L1"] and spy.inputs == []
    out = await compact(h, [], target=1, summarizer=spy, essentials=ESS,
                        options=evolve(OPTS, artifact_min_chars=1000))
    assert [(a.level, a.record is not None) for a in out.attempts] == [("L1", True), ("L3", True), ("L2", True)]
    assert out.tokens == count_message_tokens(out.view) < size // 4
    assert pairing_problems(out.view) == [] and check_consistency(h, out.view, ESS) == []


async def test_failed_summary_over_the_hard_limit_falls_back_to_a_labelled_deterministic_edit() -> None:
    h = history()
    h[12] = res("c5", HUGE)
    out = await compact(h, [], target=1, hard_limit=800, summarizer=_raises, essentials=ESS,
                        options=evolve(OPTS, artifact_min_chars=10**6))
    levels = [(a.level, a.record.fallback if a.record else a.failure.reason) for a in out.attempts]  # type: ignore[union-attr]
    assert levels[:2] == [("L1", False), ("L2", "raised")]
    fallbacks = [a.record for a in out.attempts if a.record is not None and a.record.fallback]
    assert fallbacks and all(r.level in ("L1", "L3") for r in fallbacks)
    assert fallbacks[0].reason.startswith("deterministic fallback (L2 compaction failed (raised)")
    assert not any(r.level == "L2" for r in out.records)  # no summary is ever invented
    assert out.tokens < count_message_tokens(apply_records(h, out.records[:1])) and out.tokens <= 800
    assert check_consistency(h, out.view, ESS) == [] and pairing_problems(out.view) == []


# -- token counting -------------------------------------------------------------------------------

def test_count_tokens_is_the_report_plus_what_changed() -> None:
    h = history()
    assert count_tokens(h) == count_message_tokens(h)
    assert count_tokens(h, extra=7) == count_message_tokens(h) + 7
    base = count_message_tokens(h[:10])
    assert count_tokens(h, reported=5000, sent=h[:10]) == 5000 + count_message_tokens(h) - base
    rec = plan_l1(h, options=CompactionOptions(preview_chars=500))
    assert rec is not None
    view = apply_records(h, [rec])
    assert count_tokens(view, reported=5000, sent=h) == 5000 + count_message_tokens(view[3:]) - count_message_tokens(h[3:])
    # a placeholder report (a scripted or proxy provider says 10) is not believed below our own count
    assert count_tokens(h, reported=10, sent=h[:10]) == count_message_tokens(h)


# -- the plugin in real runs -----------------------------------------------------------------------

def file_text(path: str, lines: int = 60) -> str:
    return "\n".join(f"line {i} of {path}: " + "x" * 60 for i in range(lines))


@tool
def read_file(path: str) -> str:
    """Read a file."""
    return file_text(path)


@tool
def read_huge(path: str) -> str:
    """Read a big file."""
    return file_text(path, 400) + f"\nVerified: {FACT}"


def usage(item: Any) -> Any:
    """A script item answering with ``item`` and reporting the request's real input tokens."""
    def answer(request: MessageRequest) -> Any:
        resp = item(request) if callable(item) else item
        if isinstance(resp, str):
            resp = text_response(resp)
        return evolve(resp, usage=Usage(estimate_request_tokens(request), 5))
    return answer


def reads(*paths: str, name: str = "read_file") -> list[Any]:
    return [usage(tool_call_response(ToolUseBlock(f"call_{p}", name, {"path": p}))) for p in paths]


def summary_of(messages: Sequence[Message], schema: OutputSchema | None = None) -> dict[str, Any]:
    return good_output(facts=(), prohibitions=("never delete files",),
                       decisions=[f"read {len([m for m in messages if isinstance(m, ToolResultMessage)])} files"])


async def fake_summarizer(messages: Sequence[Message], schema: OutputSchema) -> dict[str, Any]:
    return summary_of(messages, schema)


CAPS = ProviderCapabilities(context_window=12000)
TASK = "Read the files a to j.\nConstraints:\n- never delete files"


async def events_of(store: Any, sid: str, *types: str) -> list[Any]:
    return await store.read_events(sid, types=types or None)


def no_isolated_failures(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.name == "fsm_agent.chain" and r.levelno >= logging.WARNING]
    assert not bad, [r.getMessage() for r in bad]


async def test_preturn_compaction_in_a_run_l1_then_l2_with_events_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    comp = Compaction(store=store, summarizer=fake_summarizer, min_summary_input_tokens=100)
    provider = ScriptedProvider([*reads(*"abcdefghij"), usage("done")], capabilities=CAPS)
    agent = Agent(provider, tools=[read_file], middleware=[comp], store=store)
    result = await agent.run(TASK)
    assert result.stop.reason is StopReason.COMPLETED and result.output == "done"
    events = await events_of(store, result.session_id, "compaction", "compaction.failed")
    assert [(e.type, e.payload["trigger"], e.payload["record"]["level"]) for e in events] == [
        ("compaction", "pre_turn", "L1"), ("compaction", "pre_turn", "L1"), ("compaction", "pre_turn", "L2")]
    assert [e.payload["seq"] for e in events] == [0, 1, 2]
    assert all(e.payload["tokens_after"] < e.payload["tokens_before"] for e in events)
    # provenance: the context of the last call is the view rebuilt from the log
    records = [structure(e.payload["record"], CompactionRecord) for e in events]
    transcript = [structure(e.payload["message"], Message) for e in await events_of(store, result.session_id, "message")]
    assert list(result.messages) == transcript
    last = provider.requests[-1]
    assert dumps(last.messages) == dumps(apply_records(transcript[:len(transcript) - 1], records))
    assert last.messages[1].text.startswith(SUMMARY_PREFIX) and "Goal (version 1)" in last.messages[1].text
    assert estimate_request_tokens(last) < 12000 - 4096
    no_isolated_failures(caplog)


async def test_a_failing_summarizer_in_a_run_changes_no_context_and_only_adds_compaction_failed() -> None:
    runs = {}
    for with_plugin in (True, False):
        store = MemoryStore()
        middleware = [Compaction(levels=("L2",), store=store, summarizer=_raises, min_summary_input_tokens=100,
                                 fallback=False)] if with_plugin else []
        provider = ScriptedProvider([*reads(*"abcdefgh"), usage("done")],
                                    capabilities=ProviderCapabilities(context_window=30000))
        agent = Agent(provider, tools=[read_file], middleware=middleware, store=store,
                      config=RunConfig(max_output_tokens=24000))
        result = await agent.run(TASK, session_id="same")
        assert result.stop.reason is StopReason.COMPLETED
        runs[with_plugin] = (provider, await store.read_events("same"))
    (p_with, ev_with), (p_without, ev_without) = runs[True], runs[False]
    assert [dumps(r.messages) for r in p_with.requests] == [dumps(r.messages) for r in p_without.requests]
    failed = [e for e in ev_with if e.type == "compaction.failed"]
    assert failed and {(e.payload["level"], e.payload["reason"]) for e in failed} == {("L2", "raised")}
    assert "provider down" in failed[0].payload["detail"]
    assert not [e for e in ev_with if e.type == "compaction"]
    rest = [(e.type, e.payload) for e in ev_with if e.type in ("message", "session_started")]
    assert rest == [(e.type, e.payload) for e in ev_without if e.type in ("message", "session_started")]
    hashes = [e.payload["context"]["hash"] for e in ev_with if e.type == "model_call"]
    assert hashes == [e.payload["context"]["hash"] for e in ev_without if e.type == "model_call"]


async def test_midturn_moves_a_large_result_out_and_load_artifact_brings_it_back() -> None:
    store = MemoryStore()
    comp = Compaction(store=store, midturn_chars=5000)
    provider = ScriptedProvider([*reads("big", name="read_huge"),
                                 usage(tool_call_response(("load_artifact", {"ref": "m2"}))), usage("done")],
                                capabilities=CAPS)
    agent = Agent(provider, tools=[read_huge, comp.artifact_tool(max_chars=100_000)], middleware=[comp], store=store)
    result = await agent.run("Read big.")
    assert result.stop.reason is StopReason.COMPLETED
    original = file_text("big", 400) + f"\nVerified: {FACT}"
    assert result.messages[2].text == original  # the log keeps the tool's real output
    shown = provider.requests[1].messages[2]
    assert isinstance(shown, ToolResultMessage) and shown.tool_call_id == result.messages[2].tool_call_id
    assert shown.text.startswith(f'[artifact m2: {len(original):,} chars of read_huge output')
    assert f"Verified: {FACT}" in shown.text and len(shown.text) < 1000  # the default essentials keep it
    loaded = result.messages[4]
    assert isinstance(loaded, ToolResultMessage) and loaded.text == original and not loaded.is_error
    assert provider.requests[2].messages[4].text == original  # a loaded artifact is never compacted
    events = await events_of(store, result.session_id, "compaction")
    assert [(e.payload["trigger"], e.payload["record"]["level"]) for e in events] == [("mid_turn", "L3")]


async def test_load_artifact_reads_in_parts_and_refuses_unknown_refs() -> None:
    store = MemoryStore()
    comp = Compaction(store=store, midturn_chars=10**9)
    provider = ScriptedProvider([*reads("big", name="read_huge"),
                                 usage(tool_call_response(("load_artifact", {"ref": "m2", "offset": 100}))),
                                 usage(tool_call_response(("load_artifact", {"ref": "m99"}))), usage("done")])
    agent = Agent(provider, tools=[read_huge, comp.artifact_tool(max_chars=50)], middleware=[comp], store=store)
    result = await agent.run("Read big.")
    part, missing = result.messages[4], result.messages[6]
    original = result.messages[2].text
    assert part.text.startswith(original[100:150] + f"\n[characters 100-150 of {len(original):,}; ")
    assert 'load_artifact("m2", offset=150)' in part.text
    assert missing.is_error and "no artifact 'm99'" in missing.text
    with pytest.raises(ValueError, match="needs the session store"):
        Compaction().artifact_tool()


async def test_without_the_load_back_tool_l3_is_not_used() -> None:
    store = MemoryStore()
    comp = Compaction(store=store, midturn_chars=5000)
    provider = ScriptedProvider([*reads("big", name="read_huge"), usage("done")], capabilities=CAPS)
    result = await Agent(provider, tools=[read_huge], middleware=[comp], store=store).run("Read big.")
    shown = provider.requests[1].messages[2].text
    assert "artifact" not in shown and "L1 preview" in shown and "load_artifact" not in shown
    assert f"Verified: {FACT}" in shown
    events = await events_of(store, result.session_id, "compaction")
    assert [(e.payload["trigger"], e.payload["record"]["level"]) for e in events] == [("mid_turn", "L1")]


async def test_a_context_length_error_compacts_harder_and_retries_once() -> None:
    store = MemoryStore()
    comp = Compaction(store=store, summarizer=fake_summarizer, min_summary_input_tokens=100, trigger_tokens=None)
    error = ContextLengthExceededError("prompt too long", limit=4000, requested=9000, provider="scripted")
    provider = ScriptedProvider([*reads(*"abcdef"), error, usage("done")], capabilities=CAPS)
    result = await Agent(provider, tools=[read_file], middleware=[comp], store=store).run(TASK)
    assert result.stop.reason is StopReason.COMPLETED
    events = await events_of(store, result.session_id, "compaction")
    assert events and {e.payload["trigger"] for e in events} == {"context_error"}
    failed, retried = provider.requests[-2], provider.requests[-1]
    assert estimate_request_tokens(retried) < 0.75 * estimate_request_tokens(failed)


async def test_posturn_refreshes_the_summary_every_n_steps() -> None:
    store = MemoryStore()
    spy = Spy(summary_of)
    comp = Compaction(store=store, summarizer=spy, triggers=("post_turn",), refresh_every=3,
                      min_summary_input_tokens=50, keep_last_turns=1)
    provider = ScriptedProvider([*reads(*"abcdefg"), usage("done")], capabilities=CAPS)
    result = await Agent(provider, tools=[read_file], middleware=[comp], store=store).run(TASK)
    assert result.stop.reason is StopReason.COMPLETED
    events = await events_of(store, result.session_id, "compaction")
    assert [e.payload["trigger"] for e in events] == ["post_turn", "post_turn"]
    assert len(spy.inputs) == 2 and spy.inputs[1][0].text.startswith(SUMMARY_PREFIX)


def _resumable(store: Any, **kw: Any) -> tuple[Agent, ScriptedProvider]:
    comp = Compaction(store=store, summarizer=fake_summarizer, min_summary_input_tokens=100, **kw)
    provider = ScriptedProvider([*reads(*"abcdefghij"), usage("done")], capabilities=CAPS)
    return Agent(provider, tools=[read_file], middleware=[comp], store=store), provider


async def test_a_resume_rebuilds_the_identical_view_from_the_log(tmp_path: Path) -> None:
    ref_store = MemoryStore()
    reference, ref_provider = _resumable(ref_store)
    await reference.run(TASK, session_id="s")
    expected = [(e.type, e.payload) for e in await events_of(ref_store, "s", "compaction")]
    assert len(expected) == 3
    async with SQLiteStore(tmp_path / "s.db") as store:
        agent, first = _resumable(store)
        stopped = await agent.run(TASK, session_id="s", max_iterations=10)
        assert stopped.stop.reason is StopReason.PAUSED_BUDGET
        assert len(await events_of(store, "s", "compaction")) == 1
        again, second = _resumable(store)  # a new process: new plugin, new provider
        second.script = second.script[10:]
        resumed = await again.resume("s", max_iterations=50)
        assert resumed.stop.reason is StopReason.COMPLETED
        # every context, before and after the resume, is the one the uninterrupted run sent
        assert [dumps(r.messages) for r in first.requests + second.requests] == \
            [dumps(r.messages) for r in ref_provider.requests]
        # the records read back were not made again; the one made after the resume is the same
        assert [(e.type, e.payload) for e in await events_of(store, "s", "compaction")] == expected


def test_compaction_events_show_in_sessions_show(tmp_path: Path) -> None:
    from fsm_agent.cli import main

    async def run() -> None:
        async with SQLiteStore(tmp_path / "s.db") as store:
            agent, _ = _resumable(store)
            await agent.run(TASK, session_id="shown")

    asyncio.run(run())
    out = io.StringIO()
    assert main(["sessions", "show", "shown", "--events", "--store", str(tmp_path / "s.db")], out=out) == 0
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    compactions = [e for e in lines if e["type"] == "compaction"]
    assert [e["payload"]["record"]["level"] for e in compactions] == ["L1", "L1", "L2"]
    assert compactions[-1]["payload"]["record"]["summary"].startswith(SUMMARY_PREFIX)


def test_the_plugin_is_registered_shows_in_the_diagram_and_checks_its_options() -> None:
    assert load_plugin("compaction") is Compaction
    agent = Agent(ScriptedProvider(["x"]), middleware=[Compaction()])
    chains = agent.chain.describe()
    for hook in ("pre_turn", "wrap_model_call", "wrap_tool_call", "post_turn", "on_run_start"):
        assert chains[hook] == ["compaction"]
    assert "compaction" in render_machine(chains=chains)
    for bad in ({"levels": ("L4",)}, {"triggers": ("sometimes",)}, {"trigger_tokens": 1.5},
                {"target_tokens": -3}, {"retry_ratio": 1.0}, {"keep_last_turns": 0}):
        with pytest.raises(ValueError):
            Compaction(**bad)
    assert "levels=('L1', 'L3', 'L2')" in repr(Compaction())


async def test_compacted_event_payload_round_trips() -> None:
    h = history()
    rec = plan_l1(h)
    assert rec is not None
    ev = Compacted("s", 3, "pre_turn", rec, 100, 50, 0)
    data = orjson.loads(orjson.dumps(unstructure(ev)))
    assert structure(data["record"], CompactionRecord) == rec and Compacted.TAG == "compaction"


def test_compaction_failed_is_a_run_error() -> None:
    from fsm_agent.errors import RunError

    exc = CompactionFailed("timeout", "slow", level="L2")
    assert isinstance(exc, RunError) and str(exc) == "L2 compaction failed (timeout): slow"


class Router:
    """A script that answers summary requests (``output_schema`` set) apart from the run's own calls."""

    def __init__(self, turns: list[Any], summary: str) -> None:
        self.turns = turns
        self.summary = summary
        self.summary_requests: list[MessageRequest] = []

    def __call__(self, request: MessageRequest) -> Any:
        if request.output_schema is not None:
            self.summary_requests.append(request)
            return evolve(text_response(self.summary), usage=Usage(1000, 100))
        return self.turns.pop(0)(request)


@pytest.mark.parametrize("answer", ["json", "prose"])
async def test_the_default_summarizer_is_one_schema_constrained_call_through_the_runtime(answer: str) -> None:
    store = MemoryStore()
    out = summary_of(())
    router = Router([*reads(*"abcdefghij"), usage("done")],
                    orjson.dumps(out).decode() if answer == "json" else "I could not do that, sorry.")
    provider = ScriptedProvider([router], repeat_last=True, capabilities=CAPS)
    comp = Compaction(store=store, min_summary_input_tokens=100, fallback=False)
    result = await Agent(provider, tools=[read_file], middleware=[comp], store=store).run(TASK)
    assert result.stop.reason is StopReason.COMPLETED
    request = router.summary_requests[0]
    assert request.output_schema is SUMMARY_SCHEMA and request.temperature == 0.0
    assert "goal_version" in request.messages[0].text and "(use 1)" in request.messages[0].text
    assert "never delete files" in request.messages[1].text  # the must-keep items are listed
    events = await events_of(store, result.session_id, "compaction", "compaction.failed")
    if answer == "json":
        l2 = [e for e in events if e.type == "compaction" and e.payload["record"]["level"] == "L2"]
        assert l2 and l2[0].payload["record"]["summary_output"] == out
        assert l2[0].payload["record"]["summarizer_call_id"].startswith("resp_")
        assert result.usage.input_tokens >= 1000  # the summary call is accounted to the run
    else:
        failed = [e.payload for e in events if e.type == "compaction.failed"]
        assert failed and failed[0]["reason"] == "invalid" and "does not match the schema" in failed[0]["detail"]
        assert not any(e.payload["record"]["level"] == "L2" for e in events if e.type == "compaction")


async def test_custom_essentials_and_excluded_tools() -> None:
    store = MemoryStore()
    seen: list[int] = []

    def essentials(view: Sequence[Message], ctx: Any) -> Essentials:
        seen.append(len(view))
        return Essentials(facts=("line 3 of a:",))

    comp = Compaction(store=store, summarizer=fake_summarizer, essentials=essentials, exclude_tools=("read_file",),
                      levels=("L1",), min_summary_input_tokens=100)
    provider = ScriptedProvider([*reads(*"abcdefghij"), usage("done")], capabilities=CAPS)
    result = await Agent(provider, tools=[read_file], middleware=[comp], store=store).run(TASK)
    assert result.stop.reason is StopReason.COMPLETED and seen  # asked only when compacting
    assert not await events_of(store, result.session_id, "compaction")  # nothing it may touch
    assert all(dumps(r.messages) == dumps(result.messages[:len(r.messages)]) for r in provider.requests)


async def test_the_default_summarizer_bounds_lists_and_strings_for_the_local_model() -> None:
    from fsm_agent import create_provider
    from fsm_agent.providers import ProviderConfig
    from fsm_agent_middleware.compaction import ProviderSummarizer, bounded_schema

    bounded = bounded_schema(SUMMARY_SCHEMA, 8, 240).schema
    assert bounded["properties"]["decisions"] == {"type": "array", "items": {"type": "string", "maxLength": 240},
                                                  "maxItems": 8}
    assert bounded["properties"]["verified_facts"]["items"]["properties"]["fact"]["maxLength"] == 240
    assert "maxItems" not in SUMMARY_SCHEMA.schema["properties"]["decisions"]  # the canonical schema is untouched
    sent: list[MessageRequest] = []

    async def call_provider(request: MessageRequest, provider: Any = None, *, account: bool = False) -> Any:
        sent.append(request)
        return text_response(orjson.dumps(good_output()).decode())

    for name, expected in (("llamacpp", bounded), ("openai", SUMMARY_SCHEMA.schema)):
        provider = create_provider(name, ProviderConfig(base_url="http://127.0.0.1:9", api_key="k"))
        ctx = SimpleNamespace(provider=provider, call_provider=call_provider)  # what the summarizer reads
        result = await ProviderSummarizer(ctx, goal_version=1)(history()[2:10], SUMMARY_SCHEMA)
        assert result.output == good_output()
        assert sent[-1].output_schema is not None and sent[-1].output_schema.schema == expected
        await provider.aclose()


async def test_an_offline_replay_of_a_compacted_session_sends_the_same_contexts() -> None:
    from fsm_agent.testing import replay_trajectory
    from fsm_agent_middleware.compaction import recorded_summarizer

    store = MemoryStore()
    agent, _ = _resumable(store)
    result = await agent.run(TASK, session_id="rec")
    assert result.stop.reason is StopReason.COMPLETED
    events = await events_of(store, "rec", "compaction", "compaction.failed")
    assert any(e.payload["record"]["level"] == "L2" for e in events if e.type == "compaction")
    again = Agent(ScriptedProvider([], capabilities=CAPS), tools=[read_file],
                  middleware=[Compaction(summarizer=recorded_summarizer(events), min_summary_input_tokens=100)])
    report = await replay_trajectory(store, "rec", again)
    assert report.ok, report.summary()
    # and the recorded answers run out honestly
    summarize = recorded_summarizer([])
    with pytest.raises(CompactionFailed, match="no more summarizer answers"):
        await summarize([], SUMMARY_SCHEMA)


async def test_after_a_failed_summary_preturn_waits_before_asking_again() -> None:
    """A summary that failed (a small model's JSON cut off) is not asked for again at every PreTurn:
    the next try waits until the transcript has grown by ``l2_retry_messages``."""
    asked: dict[int, list[int]] = {}
    for wait in (0, 6):
        calls: list[int] = []

        async def failing(messages: Sequence[Message], schema: OutputSchema) -> Any:
            calls.append(len(messages))
            raise RuntimeError("provider down")

        store = MemoryStore()
        provider = ScriptedProvider([*reads(*"abcdefgh"), usage("done")],
                                    capabilities=ProviderCapabilities(context_window=30000))
        agent = Agent(provider, tools=[read_file], store=store, config=RunConfig(max_output_tokens=24000),
                      middleware=[Compaction(levels=("L2",), store=store, summarizer=failing, fallback=False,
                                             min_summary_input_tokens=100, l2_retry_messages=wait)])
        assert (await agent.run(TASK)).stop.reason is StopReason.COMPLETED
        asked[wait] = calls
    assert len(asked[0]) >= 3 and 1 <= len(asked[6]) < len(asked[0])
    assert all(b - a >= 6 for a, b in zip(asked[6], asked[6][1:]))  # each retry saw a transcript 6+ messages longer


async def test_the_summary_is_measured_by_itself_not_by_the_runs_reported_count() -> None:
    """The run's counter starts from the provider's report for a whole request (tool definitions
    included); measured with it, a 100-token summary counted as thousands and L2 never committed
    with many tools, or a huge one passed with a provider that counts low."""
    h = history()

    def reported(messages: Sequence[Message]) -> int:  # what a counter seeded by a big report says
        return count_message_tokens(list(messages)) + 3000

    rec = await summarize_l2(h, [], Spy(), first=2, last=9, options=evolve(OPTS, max_summary_tokens=400),
                             keep=ESS.items, tokens=reported)
    assert rec.level == "L2" and rec.summary is not None
    huge = good_output(decisions=["a long decision " * 40] * 20)

    def low(messages: Sequence[Message]) -> int:  # a provider whose tokenizer counts half of ours
        return count_message_tokens(list(messages)) // 2

    with pytest.raises(CompactionFailed) as exc:
        await summarize_l2(h, [], Spy(huge), first=2, last=9, options=evolve(OPTS, max_summary_tokens=400),
                           keep=ESS.items, tokens=low)
    assert exc.value.reason == "over_budget"


# -- every prohibition the user wrote survives (issue 19, item 8) ---------------------------------
# (the property test over many phrasings and placements is in test_compaction_properties.py)

STEER = "Don\u2019t email the client about the ledger before Friday"
FOLLOWUPS = ("Also, under no circumstances touch the billing table.\nThanks!",
             "Ne supprimez jamais les journaux. And please read the remaining files.",
             "Usifute jedwali la malipo.")  # Swahili, words the reader does not know: kept whole
SYSTEM = "You read files for the user. NEVER delete files."


class Controls:
    """Queues a Steer before the second model call and the Followups before the third, as another
    process would with ``agent.control``."""

    def __init__(self, agent_ref: list[Agent]) -> None:
        self.agent_ref = agent_ref
        self.name = "controls"

    async def wrap_model_call(self, request: MessageRequest, call_next: Any, ctx: Any) -> Any:
        from fsm_agent import Followup, Steer

        if ctx.turn == 2:
            await self.agent_ref[0].control(ctx.session_id, Steer(STEER))
        if ctx.turn == 3:
            for text in FOLLOWUPS:
                await self.agent_ref[0].control(ctx.session_id, Followup(text))
        return await call_next(request)


def dropping_summary(messages: Sequence[Message], schema: OutputSchema | None = None) -> dict[str, Any]:
    """A summary that states no prohibition at all."""
    return good_output(facts=(), prohibitions=(), decisions=[f"read {len(messages)} messages"],
                       goal_version=2)  # the Steer made it 2


async def dropping_summarizer(messages: Sequence[Message], schema: OutputSchema) -> dict[str, Any]:
    return dropping_summary(messages)


@pytest.mark.parametrize("summarizer", ["callable", "provider"])
async def test_a_run_keeps_every_prohibition_of_its_steers_followups_and_system_prompt(summarizer: str) -> None:
    """A Steer and three Followups arrive through ``agent.control`` and are summarised by a model
    that drops every prohibition: the runtime carries each of them (and the message it cannot read,
    whole) into the summary, so the last context still states them all."""
    from fsm_agent import Middleware

    store = MemoryStore()
    kw: dict[str, Any] = {"summarizer": dropping_summarizer} if summarizer == "callable" else {
        "summarizer_provider": ScriptedProvider([orjson.dumps(dropping_summary(())).decode()], repeat_last=True)}
    comp = Compaction(store=store, min_summary_input_tokens=100, **kw)
    provider = ScriptedProvider([*reads(*"abc"), usage("first part done"), *reads(*"defghijkl"), usage("done")],
                                capabilities=CAPS)
    ref: list[Agent] = []
    controls = type("ControlsPlugin", (Controls, Middleware), {})(ref)
    agent = Agent(provider, tools=[read_file], middleware=[comp, controls], store=store, system_prompt=SYSTEM)
    ref.append(agent)
    result = await agent.run(TASK)
    assert result.stop.reason is StopReason.COMPLETED and result.output == "done"
    steer_at = next(i for i, m in enumerate(result.messages) if STEER in m.text)
    follow_at = [next(i for i, m in enumerate(result.messages) if m.text == f) for f in FOLLOWUPS]
    events = await events_of(store, result.session_id, "compaction")
    summaries = [structure(e.payload["record"], CompactionRecord) for e in events
                 if e.payload["record"]["level"] == "L2"]
    assert summaries and all(s.summary_output["prohibitions"] == [] for s in summaries)  # the model kept none
    last = summaries[-1]
    assert last.first <= min(steer_at, *follow_at) and max(steer_at, *follow_at) <= last.last  # all summarised
    context = provider.requests[-1].messages
    said = "\n".join(m.text for m in context if m.role in ("system", "user"))
    for sentence in (f"New direction from the user: {STEER}", "Also, under no circumstances touch the billing table.",
                     "Ne supprimez jamais les journaux.", "NEVER delete files.", "never delete files"):
        assert sentence in said, sentence
    assert f"[m{follow_at[2]}, 1 line]\n{FOLLOWUPS[2]}" in last.summary  # kept whole
    assert last.verbatim == (follow_at[2],)
    assert "Thanks!" not in last.summary  # a plain sentence is the model's to summarise


def test_the_consistency_check_refuses_a_summary_without_a_users_prohibition_however_spelled() -> None:
    task = UserMessage("Goal: reconcile the invoices.")
    before = [task, asst(call("c1")), res("c1", "ok"),
              UserMessage("Thanks. Don\u2019t touch the ledger table."),
              AssistantMessage("I won't touch the ledger table."),
              UserMessage("Usifute jedwali la malipo.")]
    ess = extract_essentials(before, 1)
    assert ess.prohibitions == ("Don\u2019t touch the ledger table.", "I won't touch the ledger table.") or \
        "Don\u2019t touch the ledger table." in ess.prohibitions
    assert ess.verbatim == ("Usifute jedwali la malipo.",)

    def summary(*lines: str) -> UserMessage:
        return UserMessage("\n".join([f"{SUMMARY_PREFIX} Messages m1-m5.", *lines, "Goal (version 1): x"]))

    # case, whitespace, straight or curly quotes, full-width forms and the full stop aside
    spelled = summary("- DON'T  TOUCH THE\nLEDGER TABLE",
                      "- \uff35\uff53\uff49\uff46\uff55\uff54\uff45 jedwali la malipo")
    assert check_consistency(before, [task, spelled], ess) == []
    problems = check_consistency(before, [task, summary("- Usifute jedwali la malipo.")], ess)
    assert "lost prohibition: 'Don\u2019t touch the ledger table.'" in problems
    # the assistant saying it is not the user's prohibition kept
    echo = [task, summary("- Usifute jedwali la malipo."), AssistantMessage("Don't touch the ledger table.")]
    assert "lost prohibition: 'Don\u2019t touch the ledger table.'" in check_consistency(before, echo, ess)
    problems = check_consistency(before, [task, summary("- don't touch the ledger table")], ess)
    assert problems == ["lost message kept word for word: 'Usifute jedwali la malipo.'"]


def test_extract_essentials_reads_every_user_side_message_in_many_phrasings() -> None:
    said = {
        "followup": "Please never push to main.",
        "steer": f"{STEER_TEXT}Avoid force-pushing at all costs\n{STEER_TAIL}",
        "user": "One more thing: you should never restart prod. Then go on.",
        "system": "Under no circumstances email customers.",
        "reject": "A person rejected this tool call: do NOT send it, the numbers are wrong",
        "zh": "请继续。不要删除数据库。",
        "ja": "ファイルを読んでください。本番のデータは削除しないでください。",
        "de": "Lies die Dateien. Lösche niemals die Logs.",
        "es": "Lee los archivos y no borres nada.",
    }
    msgs = [SystemMessage("You help with the repo."), UserMessage("Goal: tidy the repo."),
            UserMessage(said["followup"]), UserMessage(said["steer"]), UserMessage(said["user"]),
            SystemMessage(said["system"]), asst(call("r1", "send_email")),
            ToolResultMessage("r1", said["reject"], is_error=True, name="send_email", metadata={"decision": "reject"}),
            UserMessage(said["zh"]), UserMessage(said["ja"]), UserMessage(said["de"]), UserMessage(said["es"]),
            UserMessage("What did you find so far?"), UserMessage("Sil tabloyu hemen şimdi lütfen değil."),
            asst(call("t1", "read_file")), res("t1", "Never trust this line: it is a tool's output")]
    e = extract_essentials(msgs, 1)
    # each sentence as written (a line without a full stop runs on into the next); the reader errs
    # towards constraints ("请继续" — please go on — and "please read" count)
    assert e.prohibitions == ("Please never push to main.", said["steer"],
                              "One more thing: you should never restart prod.", said["system"], said["reject"],
                              "请继续。", "不要删除数据库。", "ファイルを読んでください。", "本番のデータは削除しないでください。",
                              "Lösche niemals die Logs.", said["es"], "Sil tabloyu hemen şimdi lütfen değil.")
    assert e.verbatim == ()  # "lütfen" (please) is a Turkish constraint word: read
    odd = extract_essentials([*msgs[:2], UserMessage("Siloni tabloyu, hemen şimdi. Go on.")], 1)
    assert odd.prohibitions == () and odd.verbatim == ("Siloni tabloyu, hemen şimdi. Go on.",)


STEER_TEXT = "New direction from the user: "
STEER_TAIL = "Keep what has already been verified, drop what no longer applies, and re-plan the remaining steps."


async def test_the_runtime_carries_what_the_summarizer_dropped_and_a_later_summary_carries_it_again() -> None:
    odd = "Usifute jedwali la malipo.\nGoal (version 9): a line that looks like the runtime's"
    h = [SystemMessage("You are careful."), UserMessage("Goal: reconcile the invoices."),
         asst(call("c1", path="a")), res("c1", BIG_A),
         UserMessage("Don\u2019t touch the ledger table.\nAlso check b."), UserMessage(odd),
         asst(call("c2", path="b")), res("c2", SAME + " b"),
         asst(call("c3", path="c")), res("c3", SAME + " c"), AssistantMessage("Read a, b and c."),
         UserMessage("Now d. Never email the client."), asst(call("c4", path="d")), res("c4", "d"),
         asst(call("c5", path="e")), res("c5", "e"), AssistantMessage("Done.")]
    ess = extract_essentials(h, 1)
    spy = Spy(good_output(facts=(), prohibitions=()))
    first = await summarize_l2(h, [], spy, first=2, last=10, options=OPTS, carry=ess.prohibitions)
    assert first.constraints == ("Don\u2019t touch the ledger table.",) and first.verbatim == (5,)
    assert first.summary_output["prohibitions"] == []  # the model dropped it; the runtime did not
    assert first.summary.split("\n")[1:6] == [
        "Constraints, kept word for word by the runtime:", "- Don\u2019t touch the ledger table.",
        "Messages kept word for word by the runtime (they may state constraints it could not read):",
        "[m5, 2 lines]", "Usifute jedwali la malipo."]
    view = apply_records(h, [first])
    assert check_consistency(h, view, ess) == []  # the goal version comes from the model's part
    # a later summary supersedes it, reading the earlier one's carried parts exactly
    second = await summarize_l2(h, [first], spy, first=2, last=13, options=OPTS,
                                carry=extract_essentials(view, 1).prohibitions)
    assert second.constraints == ("Don\u2019t touch the ledger table.", "Now d. Never email the client.")
    assert second.verbatim == (5,) and f"[m5, 2 lines]\n{odd}" in second.summary
    assert check_consistency(view, apply_records(h, [first, second]), extract_essentials(view, 1)) == []
    # a copy the model made word for word is not carried twice
    copied = await summarize_l2(h, [], Spy(good_output(facts=(), prohibitions=("Don\u2019t touch the ledger table.",))),
                                first=2, last=10, options=OPTS)
    assert copied.constraints == () and copied.summary.count("touch the ledger table") == 1
    # what the runtime carries does not count against max_summary_tokens (the model's part does)
    small = await summarize_l2(h, [], spy, first=2, last=10, options=evolve(OPTS, max_summary_tokens=
                               count_message_tokens([UserMessage(render_summary(
                                   spy.output, first=2, last=10, call_id=first.summarizer_call_id))])))
    assert small.constraints == first.constraints
