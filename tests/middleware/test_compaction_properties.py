"""Compaction's invariants (docs/compaction.md), as property tests over generated valid
conversations (``fsm_agent.testing.conversations``), after every level:

1. **pairing** — every result follows its call, every call has exactly one result (the pending
   tail aside), ids unique per step; L1 and L3 keep every message and call id;
2. **a failed compaction changes nothing** — a fault-injecting summarizer: no record, the records
   and the view byte for byte as before, one failed attempt saying why;
3. **provenance** — a spy summarizer: a view that shrank by a summary implies a summarizer call
   whose input was exactly the removed range's view; the summary holds its output verbatim; a view
   rebuilt from the log's events equals the live view; nothing that had to be kept was lost;
4. **every prohibition the user wrote survives** — placed in many phrasings, languages, sentence
   contexts, kinds of message and positions, summarised by a model that drops them: the tests
   print how many were placed and how many survived (``-s``), and assert they are equal.

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
    ToolUseBlock,
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
        # the summarizer's output verbatim, after what the runtime carried word for word itself
        assert rec.summary == render_summary(output, first=rec.first, last=rec.last, call_id=call_id,
                                             constraints=rec.constraints,
                                             verbatim=[(k, msgs[k].text) for k in rec.verbatim])
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


# -- 4. every prohibition the user wrote survives (issue 19, item 8) ------------------------------

# A prohibition is one of many phrasings (English in every form the issue lists, curly and straight
# apostrophes, capitals; French, German, Spanish, Italian, Portuguese, Dutch, Chinese, Japanese,
# Korean, Russian, Greek, Arabic, Hebrew, Hindi, Thai; and languages the reader has no words for,
# whose message must then be kept whole), set in a sentence context (alone, before or after other
# sentences, in a list, wrapped over two lines, in brackets, quoted, after "P.S."), in a message
# of one kind (the task, a later user message, a Followup, a Steer as the driver words it, a system
# message, a person's rejection or answer of a tool call) at a position drawn among every unit
# boundary of a generated conversation. The real path runs on it — the default essentials
# (``extract_essentials``), the escalation, L2 with a summarizer that drops, paraphrases or copies
# one prohibition, then a second L2 that supersedes the first — and each prohibition must still be
# stated by a system or user message of the view (or the person's tool result, left in place).

def _en(template: str) -> Any:
    return lambda verb, ing, obj: template.format(v=verb, V=verb.upper(), ing=ing, Ing=ing.capitalize(),
                                                  o=obj, O=obj.upper())


PHRASINGS: dict[str, Any] = {
    "never": _en("never {v} {o}"),
    "Never.": _en("Never {v} {o}."),
    "NEVER!": _en("NEVER {V} {O}!"),
    "do not": _en("do not {v} {o}"),
    "Do not.": _en("Do not {v} {o}."),
    "DO NOT": _en("DO NOT {V} {O}"),
    "don't": _en("don't {v} {o}"),
    "Don’t": _en("Don\u2019t {v} {o}."),
    "DON’T": _en("DON\u2019T {V} {O}"),
    "please never": _en("please never {v} {o}"),
    "Please, never": _en("Please, never {v} {o}."),
    "please don’t": _en("Please don\u2019t {v} {o}."),
    "you should never": _en("you should never {v} {o}"),
    "You must not": _en("You must not {v} {o}."),
    "you mustn't": _en("you mustn't {v} {o}"),
    "shall not": _en("The agent shall not {v} {o}."),
    "under no circumstances": _en("Under no circumstances {v} {o}."),
    "under no circumstances should you": _en("Under no circumstances should you {v} {o}."),
    "avoid at all costs": _en("Avoid {ing} {o} at all costs."),
    "forbidden": _en("It is forbidden to {v} {o}."),
    "not allowed": _en("{Ing} {o} is not allowed."),
    "refrain": _en("Refrain from {ing} {o}."),
    "only": _en("You may only read {o}; leave it as it is."),
    "always ask": _en("Always ask me before you {v} {o}."),
    "no X": _en("No {ing} {o}, ever."),
    "fr ne jamais": lambda v, i, o: f"Ne supprimez jamais {o}.",
    "fr n'utilisez pas": lambda v, i, o: f"N'utilisez pas {o}.",
    "fr interdit": lambda v, i, o: f"Il est interdit de modifier {o}.",
    "de niemals": lambda v, i, o: f"Lösche niemals {o}.",
    "de bitte nicht": lambda v, i, o: f"Bitte {o} nicht anfassen.",
    "de verboten": lambda v, i, o: f"Es ist verboten, {o} zu ändern.",
    "es nunca": lambda v, i, o: f"Nunca borres {o}.",
    "es no": lambda v, i, o: f"No toques {o} bajo ningún concepto.",
    "it non mai": lambda v, i, o: f"Non cancellare mai {o}.",
    "pt nunca": lambda v, i, o: f"Nunca apague {o}.",
    "nl nooit": lambda v, i, o: f"Verwijder nooit {o}.",
    "zh 不要": lambda v, i, o: f"不要删除{o}。",
    "zh 禁止": lambda v, i, o: f"禁止修改{o}",
    "zh 切勿": lambda v, i, o: f"切勿重启{o}！",
    "zh 绝不": lambda v, i, o: f"绝不能推送{o}",
    "ja しないで": lambda v, i, o: f"{o}を削除しないでください。",
    "ja 禁止": lambda v, i, o: f"{o}の変更は禁止です。",
    "ko 마세요": lambda v, i, o: f"절대로 {o}를 삭제하지 마세요.",
    "ru никогда": lambda v, i, o: f"Никогда не удаляй {o}.",
    "el μην": lambda v, i, o: f"Μην διαγράψεις το {o}.",
    "ar لا": lambda v, i, o: f"لا تحذف {o} أبدا.",
    "he אל": lambda v, i, o: f"אל תמחק את {o}.",
    "hi मत": lambda v, i, o: f"{o} को कभी मत हटाओ।",
    "th ห้าม": lambda v, i, o: f"ห้ามลบ {o}",
    "tr asla": lambda v, i, o: f"{o} asla silme.",
    "id jangan": lambda v, i, o: f"Jangan pernah menghapus {o}.",
    "pl nigdy": lambda v, i, o: f"Nigdy nie usuwaj {o}.",
    # no word the reader knows: the message must be kept whole
    "sw usifute": lambda v, i, o: f"Usifute jedwali {o}.",
    "cs nemaž": lambda v, i, o: f"Nemaž tabulku {o}.",
    "eo neniam": lambda v, i, o: f"Vi forigu neniam la tabelon {o}.",
}
LANGUAGES = frozenset("fr de es it pt nl zh ja ko ru el ar he hi th tr id pl sw cs eo".split())
ACTS = (("delete", "deleting"), ("push to", "pushing to"), ("restart", "restarting"), ("email", "emailing"),
        ("drop", "dropping"), ("touch", "touching"), ("deploy", "deploying"))
NOUNS = ("ledger", "billing", "prod", "orders", "payments", "invoices")
CONTEXTS = {
    "alone": "{p}",
    "after": "Thanks for the update on the report. {p}",
    "before": "{p} Then go on with the report.",
    "middle": "I read your notes.\n{p} Please send the summary afterwards.",
    "list": "A few rules for the rest of the task:\n- keep the report short\n- {p}\n- report back when done",
    "wrapped": "{wrapped}",
    "brackets": "Check the logs again (and {p}) before you write the report.",
    "quoted": "The client wrote: \u201c{p}\u201d",
    "ps": "Here is the status of the other items.\n\nP.S. {p}",
    "label": "IMPORTANT: {p}",
}
KINDS = ("task", "user", "followup", "steer", "system", "system_prompt", "reject", "respond")


def _prohibition(phrasing: str, act: int, noun: int, n: int) -> str:
    verb, ing = ACTS[act % len(ACTS)]
    name = f"{NOUNS[noun % len(NOUNS)]}-{n}"
    # English phrasings name "the ledger-12 table"; the others the bare name
    return PHRASINGS[phrasing](verb, ing, f"the {name} table" if phrasing[:3].strip().isascii()
                               and phrasing.split()[0] not in LANGUAGES else name)


def _in_context(p: str, context: str) -> str:
    cut = p.find(" ", len(p) // 2)
    wrapped = p if cut < 0 else p[:cut] + "\n" + p[cut + 1:]
    return CONTEXTS[context].format(p=p, wrapped=wrapped)


def _boundaries(msgs: Sequence[Message]) -> list[int]:
    """Indices where a message may be inserted without parting a call from its results (after the
    task, before a user message or the first assistant message of a step)."""
    return [i for i in range(2, len(msgs)) if isinstance(msgs[i], UserMessage)
            or (isinstance(msgs[i], AssistantMessage) and not isinstance(msgs[i - 1], AssistantMessage))]


def _place(msgs: list[Message], kind: str, text: str, at: int) -> int:
    """Put ``text`` in ``msgs`` as a message of ``kind``; the transcript index of that message."""
    if kind == "task":
        msgs[1] = UserMessage(f"{msgs[1].text}\n{text}")
        return 1
    if kind == "system_prompt":
        msgs[0] = SystemMessage(f"{msgs[0].text}\n{text}")
        return 0
    message = {"user": lambda: UserMessage(f"One more thing about the task: {text}"),
               "followup": lambda: UserMessage(text),  # as the driver appends a Followup
               "steer": lambda: UserMessage(  # as the driver's _pre_turn words a Steer
                   f"New direction from the user: {text}\nKeep what has already been verified, drop what "
                   "no longer applies, and re-plan the remaining steps."),
               "system": lambda: SystemMessage(text),
               # a person's decision on a call (fsm-agent resume --reject CALL --message / --respond CALL=TEXT),
               # as the driver's MidTurn words it
               "reject": lambda: ToolResultMessage(f"person_{len(msgs)}", f"A person rejected this tool call: {text}",
                                                   is_error=True, name="send_email", metadata={"decision": "reject"}),
               "respond": lambda: ToolResultMessage(f"person_{len(msgs)}", text, name="ask_user",
                                                    metadata={"decision": "respond"})}[kind]()
    points = _boundaries(msgs)
    i = points[at % len(points)] if points else len(msgs)
    if isinstance(message, ToolResultMessage):  # with the call it answers, as a step of its own
        msgs[i:i] = [AssistantMessage((ToolUseBlock(message.tool_call_id, message.name or "", {}),)), message]
        return i + 1
    msgs.insert(i, message)
    return i


class Dropper:
    """A summarizer that keeps the goal and the facts its input shows but drops every prohibition
    (``mode="drop"``), paraphrases them (``"paraphrase"``), or copies the first one it was shown
    word for word and drops the rest (``"copy"``)."""

    def __init__(self, conv: Conversation, mode: str, placed: Sequence[str]) -> None:
        self.conv, self.mode, self.placed = conv, mode, placed
        self.calls = 0

    async def __call__(self, messages: Sequence[Message], schema: OutputSchema) -> Any:
        self.calls += 1
        seen = " ".join(" ".join(m.text.split()) for m in messages).casefold()
        facts = [f for f in self.conv.facts if f.casefold() in seen]
        shown = [p for p in self.placed if " ".join(p.split()).casefold() in seen]
        prohibitions = {"drop": [], "paraphrase": ["the user set some rules about the tables"] if shown else [],
                        "copy": shown[:1]}[self.mode]
        return {"goal": self.conv.goal, "goal_version": 1, "decisions": [f"went through {len(messages)} messages"],
                "failures": [], "verified_facts": [{"fact": f, "evidence": "a tool result"} for f in facts],
                "prohibitions": prohibitions, "todos": ["go on"], "pending_actions": []}


PLACEMENT = st.tuples(st.sampled_from(sorted(PHRASINGS)), st.sampled_from(sorted(CONTEXTS)), st.sampled_from(KINDS),
                      st.integers(0, 10**6), st.integers(0, 50))


def _run_placed(seed: int, placements: Sequence[tuple[str, str, str, int, int]], mode: str
                ) -> tuple[list[tuple[str, str, str, bool, bool]], list[str]]:
    """Place, compact twice, and say per prohibition ``(phrasing, kind, context, survived,
    summarised)`` (summarised: its message ended up inside a committed summary's range); and the
    consistency problems of the final view."""
    from fsm_agent_middleware.compaction.constraints import fold, key
    from fsm_agent_middleware.compaction import extract_essentials

    conv = random_conversation(random.Random(seed), turns=(3, 7), steps=(1, 3), big_results=0.1, compacted=0.15)
    msgs = list(conv.messages)
    where: list[tuple[str, str, str, str]] = []  # (prohibition, phrasing, kind, context)
    for n, (phrasing, context, kind, at, act) in enumerate(placements):
        p = _prohibition(phrasing, act, act // len(ACTS), 1000 * seed % 9973 + n)
        _place(msgs, kind, _in_context(p, context), at)
        where.append((p, phrasing, kind, context))
    assert check_pairing(msgs) == []
    placed = [p for p, *_ in where]
    records: list[CompactionRecord] = []
    problems: list[str] = []
    # first a summary of the older part (a transcript that stops at a unit boundary), then one of
    # the whole transcript that supersedes it
    points = _boundaries(msgs)
    stages = [points[len(points) // 2]] if len(points) > 2 else []
    for end in [*stages, len(msgs)]:
        part = msgs[:end]
        ess = extract_essentials(apply_records(part, records), 1, conv.pending if end == len(msgs) else ())
        out = run(compact(part, records, target=1, summarizer=Dropper(conv, mode, placed), essentials=ess,
                          options=OPTIONS, tokens=tokens))
        records = list(out.records)
        problems += check_consistency(apply_records(part, []), list(out.view), ess)
    view = apply_records(msgs, records)
    said = fold("\n".join(m.text for m in view if isinstance(m, (SystemMessage, UserMessage))
                           or (getattr(m, "metadata", None) or {}).get("decision")))
    summarised = [r for r in records if r.level == "L2"]
    results = []
    for p, phrasing, kind, context in where:
        index = next(i for i, m in enumerate(msgs) if " ".join(p.split()) in " ".join(m.text.split()))
        inside = any(r.first <= index <= r.last for r in summarised) and not isinstance(msgs[index], SystemMessage)
        results.append((phrasing, kind, context, key(p) in said, inside))
    return results, problems


TALLY: dict[str, int] = {}


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(SEEDS, st.lists(PLACEMENT, min_size=1, max_size=6), st.sampled_from(("drop", "paraphrase", "copy")))
def _every_placed_prohibition(seed: int, placements: list[tuple[str, str, str, int, int]], mode: str) -> None:
    results, problems = _run_placed(seed, placements, mode)
    for phrasing, kind, context, survived, inside in results:
        TALLY["placed"] = TALLY.get("placed", 0) + 1
        TALLY["survived"] = TALLY.get("survived", 0) + survived
        TALLY["summarised"] = TALLY.get("summarised", 0) + inside
        TALLY["summarised_survived"] = TALLY.get("summarised_survived", 0) + (inside and survived)
        if not survived:
            TALLY.setdefault("lost", []).append((seed, phrasing, kind, context))  # type: ignore[attr-defined]
    TALLY["inconsistent"] = TALLY.get("inconsistent", 0) + bool(problems)


def test_every_prohibition_placed_anywhere_in_any_phrasing_survives_compaction() -> None:
    """Issue 19, item 8: placed == survived, across every phrasing, sentence context, message kind
    and position; and most of them were inside a committed summary (the test reaches the path)."""
    TALLY.clear()
    _every_placed_prohibition()
    lost = TALLY.pop("lost", [])
    print(f"\nprohibitions placed: {TALLY['placed']}, survived: {TALLY['survived']}; inside a committed "
          f"summary: {TALLY['summarised']}, of which survived: {TALLY['summarised_survived']}; examples whose "
          f"final view failed the consistency check: {TALLY['inconsistent']}")
    assert lost == [] and TALLY["survived"] == TALLY["placed"], lost[:10]
    assert TALLY["summarised"] >= TALLY["placed"] // 3
    assert TALLY["inconsistent"] == 0


def test_every_phrasing_in_every_kind_of_message_survives_a_summary_that_drops_it() -> None:
    """The same, as a sweep: each phrasing once in each kind of message, in each sentence context
    in turn, at a position inside the older part (so the summaries cover it)."""
    placed = survived = summarised = 0
    lost = []
    for n, phrasing in enumerate(sorted(PHRASINGS)):
        for k, kind in enumerate(KINDS):
            context = sorted(CONTEXTS)[(n + k) % len(CONTEXTS)]
            results, problems = _run_placed(n * len(KINDS) + k, [(phrasing, context, kind, 0, n + k)], "drop")
            assert problems == [], (phrasing, kind, problems)
            for _, _, _, ok, inside in results:
                placed, survived, summarised = placed + 1, survived + ok, summarised + inside
                if not ok:
                    lost.append((phrasing, kind, context))
    print(f"\nsweep: prohibitions placed: {placed}, survived: {survived}; inside a committed summary: {summarised}")
    assert lost == [] and survived == placed
    assert summarised >= placed // 3
