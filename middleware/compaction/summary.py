"""The L2 summary message: its schema (:data:`SUMMARY_SCHEMA`), how it is written
(:func:`render_summary`) and how the runtime reads one of its own back (:func:`_ours`: the
constraints and messages it carried word for word, and the summarizer's sections).

Only the text: calling the summarizer is :mod:`.summarizer`'s, what must be carried is
:mod:`.essentials`'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import frozen

from fsm_agent import OutputSchema, UserMessage
from fsm_agent.types import Message


SUMMARY_PREFIX = "[compacted summary]"
"""How the text of a summary message starts (the same prefix ``fsm_agent.testing.conversations``
uses for histories that were compacted before)."""


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


# -- writing a summary and reading it back -----------------------------------------------------

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


_OURS = re.compile(rf"^{re.escape(SUMMARY_PREFIX)} Messages m\d+-m\d+ of this session, summarised")


def _ours(m: Message) -> _Parts | None:
    """A summary this module rendered, taken apart; ``None`` for any other message (a message that
    only starts with :data:`SUMMARY_PREFIX`, a summary from elsewhere, is read like a user's)."""
    if not (isinstance(m, UserMessage) and _OURS.match(m.text)):
        return None
    parts = _summary_parts(m.text)
    return parts if parts.model.startswith("Goal (version ") else None
