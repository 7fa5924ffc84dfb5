"""What no compaction may lose: the must-keep items of a context (:class:`Essentials`,
:func:`extract_essentials`); the check that a new context still holds them
(:func:`check_consistency`); the lines holding them that a shrunk tool result keeps (L1 / L3);
and what the runtime itself copies into a summary, word for word (:func:`_carry`).

Whether a sentence states a constraint is :mod:`.constraints`' to say.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from attrs import frozen

from fsm_agent import SystemMessage, ToolResultMessage, UserMessage
from fsm_agent.types import AssistantMessage, Message

from .constraints import fold, holds
from .constraints import key as item_key
from .constraints import read as read_constraints
from .summary import SUMMARY_PREFIX, _ours, _summary_parts, _summary_prohibitions
from .view import _USER, _context_text, _persons, pairing_problems


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


# -- keeping must-keep lines -------------------------------------------------------------------

def _norm(text: str) -> str:
    return fold(text)


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


# -- what a summary carries word for word ------------------------------------------------------

def _said(messages: Sequence[Message]) -> str:
    """What the user side said (system and user messages, summaries included), folded."""
    return fold("\n".join(m.text for m in messages if isinstance(m, (SystemMessage, UserMessage))))


def _carry(spans: Sequence[tuple[Message, int, int]], first: int, last: int, carry: Sequence[str],
           written: Sequence[str]) -> tuple[list[str], list[tuple[int, str]]]:
    """What the runtime copies into a summary of ``[first, last]`` itself, word for word:
    ``(constraints, [(index, text), ...] of whole messages)``.

    Read from the range: each user message's constraint sentences (:mod:`.constraints`), or the
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


# -- the consistency check ---------------------------------------------------------------------

_GOAL_VERSION = re.compile(r"^Goal \(version (-?\d+)\):", re.M)


def _open_calls(messages: Sequence[Message]) -> set[str]:
    calls = {c.id for m in messages if isinstance(m, AssistantMessage) for c in m.tool_calls}
    answered = {m.tool_call_id for m in messages if isinstance(m, ToolResultMessage)}
    return calls - answered


def check_consistency(before: Sequence[Message], after: Sequence[Message], essentials: Essentials) -> list[str]:
    """What the context ``after`` lost against ``before``; ``[]`` when nothing.

    Compared: the goal, each prohibition, each verified fact and each verbatim text of
    ``essentials`` (as text, compared in :func:`.constraints.key` form: case, whitespace, curly or
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
