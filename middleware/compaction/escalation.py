"""How large a context is (:func:`count_tokens`) and the escalation over the levels
(:func:`compact`): L1 → L3 → L2 while over the target, then the labelled deterministic fallback
while over the hard limit; every candidate checked (:func:`.essentials.check_consistency`)
before it is committed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence

from attrs import field, frozen

from fsm_agent import SystemMessage
from fsm_agent.types import Message, count_message_tokens

from .essentials import Essentials, check_consistency
from .levels import plan_l1, plan_l2_range, plan_l3
from .records import LEVELS, CompactionFailed, CompactionOptions, CompactionRecord, Summarizer
from .summarizer import summarize_l2
from .view import apply_records, view_spans


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
