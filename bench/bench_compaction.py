"""bench_compaction.py: context compaction's invariants (issue 11), fsm_agent and LangChain side by side.

The same 400 generated conversations (``fsm_agent.testing.random_conversation``, seeds 0..399; each
with a random token budget and random options drawn from its seed) go through

* **LangChain** ``SummarizationMiddleware`` (1.5.x): the fsm_agent messages are converted to
  ``HumanMessage`` / ``AIMessage(tool_calls=...)`` / ``ToolMessage(tool_call_id=...)`` and its
  ``before_model`` hook is called directly with ``{"messages": [...]}`` (the hook reads nothing
  else); the returned ``RemoveMessage(REMOVE_ALL) + summary + kept`` update is applied. The system
  prompt stays out of the state, as with ``create_agent(system_prompt=...)``. Its summarizer is a
  small ``BaseChatModel`` passed as ``model`` (the default path: ``summary_prompt`` + the model);
* **fsm_agent**'s compaction engine (``middleware/compaction.py``), through :func:`fsm_compact`.

Both get the same summarizer: an *oracle* that records each call's input and answers with every
fact, goal and prohibition of the conversation that it was shown, verbatim; so "facts kept"
measures what the pipeline let through (what stayed in the view, or what the summarizer saw), not
a model's quality. A second pass gives each example a *faulty* summarizer (one fault per seed, in
turn: raises, times out, is cancelled, returns empty, whitespace, over-budget or error-looking
text).

Budgets, per example: a prompt budget of 0.15-1.3x the conversation's tokens (the hard limit), a
trigger at 0.7-0.9x of it and a target at 0.4-0.7x (the ``Compaction`` plugin's ``trigger_tokens``
/ ``target_tokens``; LangChain gets ``trigger=("tokens", trigger)``). Options: LangChain ``keep`` =
20 messages (its default), 2-30 messages or the target in tokens, ``trim_tokens_to_summarize`` =
4000 (default), none or 1000-8000; fsm_agent ``keep_last_turns`` 1-3, ``preview_chars``,
``artifact_min_chars``, ``max_summary_tokens``, and the levels (all; L2 only; L1 + L2), with a
0.2 s summarizer timeout.

Violations per 400 examples, per invariant (fsm_agent must show 0 in every column):

* ``unpaired``: ``check_pairing(next context, pending=conv.pending)`` is not empty (a tool call
  without its result, a result without its call, a duplicate; the pending tail is allowed);
* ``no_call``: a new summary message is in the context but the summarizer was never called;
* ``not_verbatim``: a summarizer call returned, a summary was committed, and no summarizer output
  appears verbatim in it (LangChain: the output text; fsm_agent, whose summarizer returns a
  structured object: every string of it); only counted when the summarizer was called;
* ``uncovered``: a removed message (in the old context, gone from the new one) is absent from every
  summarizer input (fingerprint: the call ids, else the first 48 characters of its text);
* ``failed_changed`` (fault pass): the summarizer failed, and the next context differs from the
  one a compaction without any summary would give (LangChain: the context before; fsm_agent: the
  same ``compact`` without a summarizer, L1 / L3 / the fallback as usual, see :func:`fsm_compact`);
* ``extra`` (fsm_agent only): the view rebuilt from the committed records differs from the live
  one, or a record's ``summary_sha256`` does not match its summary.

An example counts once per invariant when either pass (oracle or faulty summarizer) breaks it;
pairing is checked after every edit (fsm_agent: the view after each committed record). fsm_agent
runs twice: with the plugin's default essentials (``extract_essentials``), and as
``fsm_agent+facts`` with the conversation's goal, prohibitions and facts given as essentials (the
plugin's ``essentials=`` option). ``--self-test`` corrupts compacted fsm_agent outcomes five ways
(a result dropped, the calls forgotten, the summary altered, the input emptied, the baseline
changed) and checks that each check fires.

Also: compaction latency per level (fsm_agent L1, L3, L2; LangChain's one summarizing step), and
tokens saved (tiktoken, ``count_message_tokens``) against facts kept (share of
``Conversation.facts`` still verbatim in the next context, its summary included).

    /work/bench-venv/bin/python bench/bench_compaction.py              # 400 examples
    /work/bench-venv/bin/python bench/bench_compaction.py --n 100      # fewer
    /work/bench-venv/bin/python bench/bench_compaction.py --only langchain --show 5   # 5 violations each
    /work/bench-venv/bin/python bench/bench_compaction.py --self-test  # the checks catch corruptions

Results: ``bench/results/compaction-<UTC time>.json`` and ``compaction-latest.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import random
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _common import machine, median, pct, say, table, versions, write_results  # noqa: E402

from fsm_agent.testing.conversations import Conversation, check_pairing, random_conversation  # noqa: E402
from fsm_agent.types import (  # noqa: E402
    AssistantMessage,
    Message,
    SystemMessage,
    TextBlock,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
    count_message_tokens,
)

PACKAGES = ("fsm-agent", "langchain", "langchain-core", "langgraph", "tiktoken")
INVARIANTS = ("unpaired", "no_call", "not_verbatim", "uncovered", "failed_changed", "extra")
LABELS = {
    "unpaired": "unpaired call/result after compaction",
    "no_call": "history replaced without a summarizer call",
    "not_verbatim": "summary not the summarizer's output verbatim",
    "uncovered": "summarizer input did not cover the removed range",
    "failed_changed": "failed compaction changed the context",
    "extra": "records: rebuilt view != live view, or a hash mismatch",
}
FAULTS = ("raise", "timeout", "cancelled", "empty", "whitespace", "over_budget", "error_text")
ERROR_TEXT = ("Error code: 429 - {'error': {'message': 'Rate limit reached for requests', "
              "'type': 'requests', 'code': 'rate_limit_exceeded'}}")
OVER_BUDGET_CHARS = 20_000
LEVEL_ORDER = ("L1", "L3", "L2", "fallback L1", "fallback L3", "total")


# -- the summarizer ---------------------------------------------------------------------------

class SummarizerFailed(Exception):
    """The faulty summarizer's injected error."""


ERROR_TEXTS = (ERROR_TEXT, "I'm sorry, but I can't summarize this conversation.",
               "Error: the summarization service is unavailable, please retry later.")


@dataclass
class Summarizer:
    """Records every call; answers as an oracle (every fact / goal / prohibition it was shown,
    verbatim), or fails the way ``fault`` says. ``text`` is LangChain's interface (a prompt in, a
    text out), ``structured`` fsm_agent's (``await summarizer(messages, schema)`` -> a mapping)."""

    conv: Conversation
    fault: str | None = None
    variant: int = 0
    timeout_sleep: float = 5.0
    calls: list[tuple[str, list[str] | None]] = field(default_factory=list)
    """Per call: (its input as text, the strings of its output; ``None`` when it failed)."""

    def _seen(self, text: str) -> tuple[bool, list[str], list[str]]:
        seen = _norm(text)
        c = self.conv
        return (_norm(c.goal) in seen, [p for p in c.prohibitions if p in seen], [x for x in c.facts if x in seen])

    def _raise(self) -> None:
        if self.fault == "raise":
            raise SummarizerFailed("summarizer exploded")
        if self.fault == "timeout":  # LangChain has no timeout of its own: the client's timeout error
            raise TimeoutError("summarizer timed out")
        if self.fault == "cancelled":
            import asyncio

            raise asyncio.CancelledError()

    def text(self, prompt: str) -> str:
        try:
            self._raise()
            f = self.fault
            if f == "empty":
                out = ""
            elif f == "whitespace":
                out = " \n\t \n"
            elif f == "over_budget":
                out = "Summary: " + "lorem ipsum dolor sit amet " * (OVER_BUDGET_CHARS // 27)
            elif f == "error_text":
                out = ERROR_TEXTS[self.variant % len(ERROR_TEXTS)]
            else:
                goal, prohibitions, facts = self._seen(prompt)
                lines = [f"Summary of {len(prompt)} characters of history."]
                lines += [f"Goal: {self.conv.goal}."] if goal else []
                lines += [f"Constraint: {p}." for p in prohibitions]
                lines += [f"Fact: {x}." for x in facts]
                out = "\n".join(lines)
        except BaseException:
            self.calls.append((prompt, None))
            raise
        self.calls.append((prompt, [out]))
        return out

    async def structured(self, messages: Sequence[Message], schema: Any) -> dict[str, Any]:
        import asyncio

        prompt = "\n".join(" ".join([*(c.id for c in getattr(m, "tool_calls", ())), m.text]) for m in messages)
        empty: dict[str, Any] = {"goal": "", "goal_version": 0, "decisions": [], "failures": [],
                                 "verified_facts": [], "prohibitions": [], "todos": [], "pending_actions": []}
        try:
            if self.fault == "timeout":  # a real timeout: the engine's summarizer_timeout fires
                await asyncio.sleep(self.timeout_sleep)
            self._raise()
            f = self.fault
            if f == "empty":
                out = empty
            elif f == "whitespace":
                out = {**empty, "goal": " \n\t ", "decisions": ["  "], "todos": ["\n"]}
            elif f == "over_budget":
                out = {**empty, "goal": "Continue the task.",
                       "decisions": ["lorem ipsum dolor sit amet " * (OVER_BUDGET_CHARS // 27)]}
            elif f == "error_text":
                out = {**empty, "goal": ERROR_TEXTS[self.variant % len(ERROR_TEXTS)]}
            else:
                goal, prohibitions, facts = self._seen(prompt)
                pending = [p for p in self.conv.pending if p in prompt]
                out = {**empty, "goal": self.conv.goal if goal else "Continue the task of the first user message.",
                       "decisions": [f"Summarised {len(messages)} messages."], "prohibitions": prohibitions,
                       "verified_facts": [{"fact": x, "evidence": "a tool result"} for x in facts],
                       "pending_actions": pending}
        except BaseException:
            self.calls.append((prompt, None))
            raise
        strings = [v for k, v in out.items() if isinstance(v, str)]
        strings += [x for k, v in out.items() if isinstance(v, list) for x in v if isinstance(x, str)]
        strings += [x["fact"] for x in out["verified_facts"]]
        self.calls.append((prompt, [x.strip() for x in strings if x.strip()]))
        return out


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(text))


# -- outcome of one compaction, and the checks ------------------------------------------------

@dataclass
class Outcome:
    before: list[Message]
    after: list[Message]
    summaries: list[str]
    """Texts of the summary messages that are new in ``after``."""
    removed: Sequence[Message]
    """Messages of ``before`` the compaction took out of the context (by the peer's own identity)."""
    calls: list[tuple[str, list[str] | None]]
    error: str | None = None
    """An exception that came out of the compaction (the context is then ``before``)."""
    latency: dict[str, float] = field(default_factory=dict)
    """Seconds per level that ran."""
    baseline: list[Message] | None = None
    """Fault pass: what the context must be when the summary failed (``None``: ``before``)."""
    intermediate: list[list[Message]] = field(default_factory=list)
    """The context after each edit but the last (pairing is checked after every edit)."""
    extra: list[str] = field(default_factory=list)
    """Violations of checks only one peer supports (fsm_agent: a view rebuilt from the records
    differs from the live one; a record's hash does not match)."""


def removed_messages(before: Sequence[Message], after: Sequence[Message]) -> list[Message]:
    """The messages of ``before`` that ``after`` no longer holds: ``after`` (new summary messages
    aside) is aligned in order with ``before``; a message matches itself (the same object), or, for
    a tool result edited in place (L1 / L3), a new result with the same call id and tool name."""
    old = {id(m) for m in before}
    out: list[Message] = []
    j = 0
    for m in after:
        if id(m) not in old and not isinstance(m, ToolResultMessage):
            continue  # a new message: a summary
        while j < len(before):
            b = before[j]
            j += 1
            if b is m or (isinstance(m, ToolResultMessage) and id(m) not in old and isinstance(b, ToolResultMessage)
                          and b.tool_call_id == m.tool_call_id and b.name == m.name):
                break
            out.append(b)
    out.extend(before[j:])
    return out


def fingerprints(m: Message) -> list[str]:
    if isinstance(m, AssistantMessage) and m.tool_calls:
        return [c.id for c in m.tool_calls]
    t = _norm(m.text).strip()[:48]
    return [t] if t else []


def violations(conv: Conversation, o: Outcome, faulty: bool) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {k: [] for k in INVARIANTS}
    for k, view in enumerate([*o.intermediate, o.after]):
        bad = check_pairing(view, pending=conv.pending)
        if bad:
            where = f"after edit {k + 1} of {len(o.intermediate) + 1}: " if o.intermediate else ""
            out["unpaired"] = [where + b for b in bad[:3]]
            break
    if o.summaries and not o.calls:
        out["no_call"] = [f"summary {o.summaries[0][:80]!r} without a summarizer call"]
    outputs = [r for _, r in o.calls if r is not None]
    if o.summaries and outputs and not faulty:
        for s in o.summaries:
            if not any(all(x in s for x in r) for r in outputs):
                out["not_verbatim"].append(f"summary {s[:80]!r} does not hold a summarizer output verbatim")
    if o.removed:
        seen = _norm("\n".join(i for i, _ in o.calls))
        for m in o.removed:
            miss = [f for f in fingerprints(m) if f not in seen]
            if miss:
                out["uncovered"].append(f"removed {m.role} {miss[0]!r} not in any summarizer input")
        out["uncovered"] = out["uncovered"][:3]
    if faulty and o.calls:
        want = o.before if o.baseline is None else o.baseline
        if o.after != want:
            out["failed_changed"] = [f"{len(want)} -> {len(o.after)} messages after a failed summary"]
    out["extra"] = list(o.extra)
    return out


def facts_kept(conv: Conversation, msgs: Sequence[Message]) -> float | None:
    if not conv.facts:
        return None
    text = "\n".join(m.text for m in msgs)
    return sum(f in text for f in conv.facts) / len(conv.facts)


# -- per-example budget and options -----------------------------------------------------------

@dataclass
class Example:
    seed: int
    conv: Conversation
    tokens: int
    """Tokens of the conversation (tiktoken, ``count_message_tokens``)."""
    budget: int
    """The prompt budget (the plugin's ``budget``: window minus output room); the hard limit."""
    trigger: int
    """Compact when the context is over this (the plugin's ``trigger_tokens``)."""
    target: int
    """Compact down to this (fsm_agent's ``target_tokens``)."""
    options: dict[str, Any]


def make_example(seed: int) -> Example:
    conv = random_conversation(random.Random(seed))
    rng = random.Random(f"compaction-bench-{seed}")
    tokens = count_message_tokens(conv.messages)
    budget = max(1000, int(tokens * rng.uniform(0.15, 1.3)))
    trigger = int(budget * rng.uniform(0.7, 0.9))
    target = int(budget * rng.uniform(0.4, 0.7))
    options = {
        # LangChain: keep the default 20 messages, a random count, or the target in tokens
        "keep": rng.choice((("messages", 20), ("messages", rng.randint(2, 30)), ("tokens", target))),
        "trim_tokens_to_summarize": rng.choice((4000, 4000, None, rng.randint(1000, 8000))),
        # fsm_agent's CompactionOptions
        "keep_last_turns": rng.choice((1, 2, 2, 3)),
        "preview_chars": rng.choice((500, 1500, 1500, 3000)),
        "artifact_min_chars": rng.choice((4000, 8000, 8000, 16000)),
        "max_summary_tokens": rng.choice((1000, 2000, 2000, 3000)),
        "levels": rng.choice((("L1", "L3", "L2"), ("L1", "L3", "L2"), ("L2",), ("L1", "L2"))),
    }
    return Example(seed, conv, tokens, budget, trigger, target, options)


# -- LangChain --------------------------------------------------------------------------------

def langchain_available() -> str | None:
    try:
        import langchain.agents.middleware.summarization  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def to_langchain(msgs: Sequence[Message]) -> list[Any]:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    out: list[Any] = []
    for m in msgs:
        if isinstance(m, AssistantMessage):
            out.append(AIMessage(content=m.text, tool_calls=[{"id": c.id, "name": c.name, "args": c.input,
                                                              "type": "tool_call"} for c in m.tool_calls]))
        elif isinstance(m, ToolResultMessage):
            out.append(ToolMessage(content=m.text, tool_call_id=m.tool_call_id, name=m.name,
                                   status="error" if m.is_error else "success"))
        elif isinstance(m, UserMessage):
            out.append(HumanMessage(content=m.text))
        else:
            raise TypeError(f"unexpected {type(m).__name__}")
    return out


def from_langchain(lc: Any, original: Message | None) -> Message:
    """Back to fsm_agent; a message LangChain kept as it was maps to the original object."""
    if original is not None:
        return original
    from langchain_core.messages import AIMessage, ToolMessage

    if isinstance(lc, AIMessage):
        text = (TextBlock(str(lc.content)),) if lc.content else ()
        return AssistantMessage(text + tuple(ToolUseBlock(c["id"], c["name"], c["args"]) for c in lc.tool_calls))
    if isinstance(lc, ToolMessage):
        return ToolResultMessage(lc.tool_call_id, str(lc.content), is_error=lc.status == "error", name=lc.name)
    return UserMessage(lc.text if hasattr(lc, "text") else str(lc.content))


def _fake_model(fn: Callable[[str], str]) -> Any:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    class OracleChatModel(BaseChatModel):  # type: ignore[misc]
        """A chat model whose answer is ``fn(the prompt text)``."""

        fn: Any

        @property
        def _llm_type(self) -> str:
            return "oracle-summarizer"

        def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                      **kwargs: Any) -> ChatResult:
            text = "\n".join(m.text for m in messages)
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content=self.fn(text)))])

    return OracleChatModel(fn=fn)


def langchain_compact(ex: Example, summarizer: Summarizer) -> Outcome:
    from langchain.agents.middleware._retry import default_retry_on
    from langchain.agents.middleware.summarization import SummarizationMiddleware
    from langchain_core.messages import RemoveMessage

    system = [m for m in ex.conv.messages if isinstance(m, SystemMessage)]
    msgs = [m for m in ex.conv.messages if not isinstance(m, SystemMessage)]
    lc = to_langchain(msgs)
    model = _fake_model(summarizer.text)
    mw = SummarizationMiddleware(model, trigger=("tokens", ex.trigger), keep=ex.options["keep"],
                                 trim_tokens_to_summarize=ex.options["trim_tokens_to_summarize"])
    # the same 3 attempts as the default, without the exponential back-off sleeps (they only cost time)
    mw._summary_model = model.with_retry(retry_if_exception_type=default_retry_on,  # noqa: SLF001
                                         wait_exponential_jitter=False)
    before = system + msgs
    t0 = time.perf_counter()
    try:
        update = mw.before_model({"messages": lc}, None)
        error = None
    except BaseException as e:  # noqa: BLE001 (CancelledError too: the fault pass injects it)
        update, error = None, f"{type(e).__name__}: {e}"
    dt = time.perf_counter() - t0
    if update is None:
        return Outcome(before, before, [], [], summarizer.calls, error, {"L2": dt})
    new = update["messages"]
    assert isinstance(new[0], RemoveMessage)
    by_id = {m.id: orig for m, orig in zip(lc, msgs, strict=True)}
    after_lc = new[1:]
    after = system + [from_langchain(m, by_id.get(m.id)) for m in after_lc]
    kept = {m.id for m in after_lc}
    removed = [orig for m, orig in zip(lc, msgs, strict=True) if m.id not in kept]
    assert removed == removed_messages(before, after)
    summaries = [str(m.content) for m in after_lc
                 if m.id not in by_id and (m.additional_kwargs or {}).get("lc_source") == "summarization"]
    return Outcome(before, after, summaries, removed, summarizer.calls, None, {"L2": dt})


# -- fsm_agent --------------------------------------------------------------------------------

def fsm_available() -> str | None:
    try:
        import fsm_agent_middleware.compaction  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


_LOOP: Any = None
_TOKENS: dict[int, tuple[Message, int]] = {}


def _cached_tokens(messages: Sequence[Message]) -> int:
    """``count_message_tokens``, per message cached by identity (as the plugin's counter does)."""
    total = 3
    for m in messages:
        hit = _TOKENS.get(id(m))
        if hit is None or hit[0] is not m:
            hit = (m, count_message_tokens([m]) - 3)
            _TOKENS[id(m)] = hit
        total += hit[1]
    return total


class _LevelClock:
    """Wall time per level inside ``compact``: the plan (or the summary call), the view it gives,
    the consistency check and the count, charged to the level being attempted."""

    def __init__(self, mod: Any) -> None:
        self.mod = mod
        self.level: str | None = None
        self.times: dict[str, float] = {}
        self.saved = {n: getattr(mod, n) for n in ("plan_l1", "plan_l3", "summarize_l2", "apply_records",
                                                   "check_consistency")}

    def __enter__(self) -> _LevelClock:
        def plan(level: str, fn: Any, is_async: bool = False) -> Any:
            if is_async:
                async def wrapped_async(*a: Any, **k: Any) -> Any:
                    self.level = level
                    t0 = time.perf_counter()
                    try:
                        return await fn(*a, **k)
                    finally:
                        self.times[level] = self.times.get(level, 0.0) + time.perf_counter() - t0
                return wrapped_async

            def wrapped(*a: Any, **k: Any) -> Any:
                self.level = "fallback " + level if k.get("fallback") else level
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.times[self.level] = self.times.get(self.level, 0.0) + time.perf_counter() - t0
            return wrapped

        def charged(fn: Any) -> Any:
            def wrapped(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    if self.level is not None:
                        self.times[self.level] = self.times.get(self.level, 0.0) + time.perf_counter() - t0
            return wrapped

        m = self.mod
        m.plan_l1, m.plan_l3 = plan("L1", self.saved["plan_l1"]), plan("L3", self.saved["plan_l3"])
        m.summarize_l2 = plan("L2", self.saved["summarize_l2"], is_async=True)
        m.apply_records = charged(self.saved["apply_records"])
        m.check_consistency = charged(self.saved["check_consistency"])
        return self

    def __exit__(self, *exc: object) -> None:
        for n, f in self.saved.items():
            setattr(self.mod, n, f)


def fsm_compact(ex: Example, summarizer: Summarizer, *, given_facts: bool = False) -> Outcome:
    """The adapter to fsm_agent's compaction engine (``fsm_agent_middleware.compaction``): what the
    ``Compaction`` plugin's PreTurn does (compact when over the trigger, down to the target, the
    fallback over the budget), called directly: ``compact(transcript, [], target=..., hard_limit=...,
    summarizer=..., essentials=..., options=...)`` with L3 on (the load-back tool offered).

    Essentials: the plugin's default, ``extract_essentials(view, 0, pending)``; with
    ``given_facts`` the conversation's goal, prohibitions and facts are given as essentials (the
    plugin's ``essentials=`` option), so the engine knows which lines it must keep.

    Fault pass: the baseline is the same ``compact`` without a summarizer (L1, L3 and the fallback
    as usual): a failed summary must leave exactly that.
    """
    import asyncio

    import fsm_agent_middleware.compaction as fc

    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    transcript = list(ex.conv.messages)
    before = transcript
    o = ex.options
    options = fc.CompactionOptions(keep_last_turns=o["keep_last_turns"], preview_chars=o["preview_chars"],
                                   artifact_min_chars=o["artifact_min_chars"],
                                   max_summary_tokens=o["max_summary_tokens"], summarizer_timeout=0.2)
    if given_facts:
        c = ex.conv
        essentials = fc.Essentials(c.goal, 0, c.prohibitions, c.facts, c.pending)
    else:
        essentials = fc.extract_essentials(transcript, 0, ex.conv.pending)
    if _cached_tokens(transcript) <= ex.trigger:
        return Outcome(before, before, [], [], summarizer.calls)

    def run(s: Any) -> Any:
        return _LOOP.run_until_complete(fc.compact(
            transcript, [], target=ex.target, hard_limit=ex.budget, levels=o["levels"], summarizer=s,
            essentials=essentials,
            options=options, tokens=_cached_tokens))

    # the clock wraps the names in the module whose globals ``compact`` reads them from (the
    # package's ``escalation`` module since the split; patching the package itself times nothing)
    with _LevelClock(sys.modules[fc.compact.__module__]) as clock:
        t0 = time.perf_counter()
        out = run(summarizer.structured)
        total = time.perf_counter() - t0
    after = list(out.view)
    latency = {**clock.times, "total": total}
    baseline = list(run(None).view) if summarizer.fault else None
    # every edit: the view after each committed record
    committed = list(out.committed)
    intermediate = [fc.apply_records(transcript, committed[:k]) for k in range(1, len(committed))]
    old = {id(m) for m in before}
    summaries = [m.text for m in after if isinstance(m, UserMessage) and id(m) not in old]
    removed = removed_messages(before, after)
    extra = []
    if fc.apply_records(transcript, list(out.records)) != after:
        extra.append("the view rebuilt from the records differs from the live one")
    for r in committed:
        if r.summary is not None and r.summary_sha256 != hashlib.sha256(r.summary.encode()).hexdigest():
            extra.append(f"record m{r.first}-m{r.last}: summary_sha256 does not match its summary")
    return Outcome(before, after, summaries, removed, summarizer.calls, None, latency, baseline, intermediate, extra)


def fsm_compact_given_facts(ex: Example, summarizer: Summarizer) -> Outcome:
    """:func:`fsm_compact` with the conversation's facts given as essentials."""
    return fsm_compact(ex, summarizer, given_facts=True)


# -- the run ----------------------------------------------------------------------------------

PEERS: dict[str, tuple[Callable[[], str | None], Callable[[Example, Summarizer], Outcome]]] = {
    "fsm_agent": (fsm_available, fsm_compact),
    "fsm_agent+facts": (fsm_available, fsm_compact_given_facts),
    "langchain": (langchain_available, langchain_compact),
}


def run_peer(name: str, examples: list[Example], show: int) -> dict[str, Any]:
    _, compact = PEERS[name]
    hit: dict[str, set[int]] = {k: set() for k in INVARIANTS}  # seeds with a violation, in either pass
    shown: dict[str, list[str]] = {k: [] for k in INVARIANTS}
    latency: dict[str, list[float]] = {}
    saved: list[float] = []
    kept: list[float] = []
    compacted = summarizer_called = faults_reached = crashed = 0
    rows = []
    for ex in examples:
        for faulty in (False, True):
            s = Summarizer(ex.conv, FAULTS[ex.seed % len(FAULTS)] if faulty else None, ex.seed // len(FAULTS))
            try:
                o = compact(ex, s)
            except Exception:  # noqa: BLE001  (a crash of the harness or the engine: counted, shown)
                crashed += 1
                if crashed <= 3:
                    say(f"{name} seed {ex.seed} faulty={faulty}: CRASH\n{traceback.format_exc()}")
                continue
            v = violations(ex.conv, o, faulty)
            for k, msgs in v.items():
                if msgs:
                    hit[k].add(ex.seed)
                    if len(shown[k]) < show:
                        shown[k].append(f"seed {ex.seed}{f' (fault {s.fault})' if faulty else ''}: "
                                        + "; ".join(msgs))
            if faulty:
                faults_reached += bool(o.calls)
                continue
            for lvl, dt in o.latency.items():
                latency.setdefault(lvl, []).append(dt)
            changed = o.after != o.before
            compacted += changed
            summarizer_called += bool(o.calls)
            after_tokens = count_message_tokens(o.after) if changed else ex.tokens
            fk = facts_kept(ex.conv, o.after)
            if changed:
                saved.append(1 - after_tokens / ex.tokens)
                if fk is not None:
                    kept.append(fk)
            rows.append({"seed": ex.seed, "tokens": ex.tokens, "budget": ex.budget, "after_tokens": after_tokens,
                         "facts_kept": fk, "calls": len(o.calls), "error": o.error,
                         "violations": {k: m for k, m in v.items() if m}})
    counts = {k: len(v) for k, v in hit.items()}
    return {"counts": counts, "seeds": {k: sorted(v) for k, v in hit.items()}, "examples": shown, "crashed": crashed, "compacted": compacted,
            "summarizer_called": summarizer_called, "faults_reached_summarizer": faults_reached,
            "latency_ms": {lvl: {"median": median(xs) * 1e3, "p90": pct(xs, 90) * 1e3, "n": len(xs)}
                           for lvl, xs in latency.items()},
            "tokens_saved_median": median(saved), "facts_kept_median": median(kept),
            "facts_kept_mean": sum(kept) / len(kept) if kept else float("nan"), "rows": rows}


def self_test(examples: list[Example]) -> None:
    """The checks catch what they claim to: fsm_agent outcomes with a summary, corrupted five ways."""
    import dataclasses

    n = 0
    for ex in examples:
        o = fsm_compact(ex, Summarizer(ex.conv))
        if not (o.summaries and o.calls and o.removed) or violations(ex.conv, o, False) != \
                {k: [] for k in INVARIANTS}:
            continue
        n += 1
        drop = next((i for i, m in enumerate(o.after) if isinstance(m, ToolResultMessage)
                     and m.tool_call_id not in ex.conv.pending), None)
        if drop is None:
            continue
        summary_at = next(i for i, m in enumerate(o.after) if m.text in o.summaries)
        out = next(r for _, r in reversed(o.calls) if r)
        cases = {
            "unpaired": dataclasses.replace(o, after=o.after[:drop] + o.after[drop + 1:]),
            "no_call": dataclasses.replace(o, calls=[]),
            "not_verbatim": dataclasses.replace(o, summaries=[x.replace(out[-1], out[-1][:-3] + "...")
                                                              for x in o.summaries]),
            "uncovered": dataclasses.replace(o, calls=[("", r) for _, r in o.calls]),
            "failed_changed": dataclasses.replace(o, baseline=o.before),
        }
        for k, bad in cases.items():
            got = violations(ex.conv, bad, faulty=k == "failed_changed")
            assert got[k], (ex.seed, k, summary_at)
    assert n >= 10, n
    say(f"self-test: each of the 5 checks caught its corruption in all {n} compacted examples")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400, help="examples (seeds 0..n-1)")
    ap.add_argument("--only", default="fsm_agent,fsm_agent+facts,langchain", help="peers, comma-separated")
    ap.add_argument("--show", type=int, default=2, help="violations shown per invariant and peer")
    ap.add_argument("--self-test", action="store_true", help="check that the checks catch corrupted outcomes")
    args = ap.parse_args()
    if args.self_test:
        self_test([make_example(s) for s in range(args.n)])
        return

    info = machine()
    say(f"generating {args.n} conversations ...")
    t0 = time.perf_counter()
    examples = [make_example(s) for s in range(args.n)]
    say(f"  {time.perf_counter() - t0:.1f} s; median {median([e.tokens for e in examples]):,.0f} tokens, "
        f"{sum(bool(e.conv.facts) for e in examples)} with facts")
    results: dict[str, Any] = {}
    for name in args.only.split(","):
        absent = PEERS[name][0]()
        if absent:
            say(f"{name}: ABSENT — {absent}")
            results[name] = {"absent": absent}
            continue
        t0 = time.perf_counter()
        results[name] = run_peer(name, examples, args.show)
        say(f"{name}: {time.perf_counter() - t0:.1f} s")

    present = [n for n in results if "absent" not in results[n]]
    say(table(["invariant (violations per %d)" % args.n, *present],
              [[LABELS[k], *(results[n]["counts"][k] if k != "extra" or n.startswith("fsm_agent") else "n/a"
                             for n in present)] for k in INVARIANTS]
              + [["harness/engine crashes", *(results[n]["crashed"] for n in present)]],
              title="Invariants"))
    say(table(["", *present],
              [["examples compacted (context changed)", *(results[n]["compacted"] for n in present)],
               ["examples that called the summarizer", *(results[n]["summarizer_called"] for n in present)],
               ["fault pass: summarizer reached", *(results[n]["faults_reached_summarizer"] for n in present)],
               ["tokens saved, median of compacted", *(f"{results[n]['tokens_saved_median']:.0%}" for n in present)],
               ["facts kept, median of compacted", *(f"{results[n]['facts_kept_median']:.0%}" for n in present)],
               ["facts kept, mean of compacted", *(f"{results[n]['facts_kept_mean']:.0%}" for n in present)]],
              title="Compaction"))
    say(table(["peer", "level", "n", "median ms", "p90 ms"],
              [[n, lvl, d["n"], d["median"], d["p90"]] for n in present
               for lvl, d in sorted(results[n]["latency_ms"].items(), key=lambda kv: LEVEL_ORDER.index(kv[0]))],
              title="Latency per level (ms, examples where the level ran)"))
    for n in present:
        for k, shown in results[n]["examples"].items():
            for line in shown:
                say(f"  {n} {k}: {line[:300]}")
    path = write_results("compaction", {"machine": info, "versions": versions(PACKAGES), "n": args.n,
                                        "faults": FAULTS, "results": results})
    say(f"\nwrote {path}")


if __name__ == "__main__":
    main()
