"""The pairing invariant of tool calls and results: what every context sent to a provider must keep
(OpenAI, Anthropic and most OpenAI-compatible servers refuse an unpaired call or result with a 400).

A *step* is an assistant message, plus the assistant messages with tool calls that directly follow
it (a provider that splits one step's calls across two messages). A user message, an assistant
message without tool calls, or an assistant message after a tool result closes the step. Then:

1. every tool result follows its call: its id is the id of a call of the current step, not yet
   answered; otherwise it is an orphan (no such call, or the call's step was already closed) or a
   second result;
2. every call has exactly one result before the message that closes its step, unless it is the
   pending tail (the last step, with nothing after it but its own results);
3. call ids are distinct within a step (``unique_ids="step"``: positional ids such as ``call_0``
   recur in later steps, as Gemini, Ollama and several llama.cpp templates do), or in the whole
   list (``unique_ids="list"``).

Used by the compaction plugin after every edit, by :mod:`fsm_agent.testing.conversations`, and by
the benchmarks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

from .messages import AssistantMessage, Message, SystemMessage, ToolResultMessage, UserImageMessage, UserMessage

__all__ = ["pairing_problems"]


def pairing_problems(messages: Sequence[Message], *, unique_ids: Literal["step", "list"] = "step",
                  pending: Collection[str] | None = None) -> list[str]:
    """The violations of the pairing invariant in ``messages`` (module docstring), ``[]`` if none.

    Each violation is one line naming the message index (and call id). ``unique_ids="step"``:
    ids distinct within a step, reusable in later steps; ``"list"``: no call id twice anywhere.
    ``pending``: the ids allowed to stay open at the end (a :attr:`Conversation.pending`, so an
    edit that drops a result of the last step is caught); ``None``: any call of the last step.

    Raises:
        ValueError: ``unique_ids`` is neither ``"step"`` nor ``"list"``.
    """
    if unique_ids not in ("step", "list"):
        raise ValueError(f"unique_ids must be 'step' or 'list', got {unique_ids!r}")
    out: list[str] = []
    open_calls: dict[str, int] = {}     # id -> index of the assistant message holding the call
    answered: set[str] = set()          # ids of the current step with a result
    first_call: dict[str, int] = {}     # for unique_ids="list"
    prev: Message | None = None         # previous non-system message

    def close(at: int, what: str) -> None:
        for cid, i in open_calls.items():
            if cid not in answered:
                out.append(f"call {cid!r} (message {i}) has no result before message {at} ({what})")
        open_calls.clear()
        answered.clear()

    for j, m in enumerate(messages):
        if isinstance(m, SystemMessage):
            continue
        if isinstance(m, AssistantMessage):
            if not (m.tool_calls and isinstance(prev, AssistantMessage) and prev.tool_calls):
                close(j, "assistant")
            for c in m.tool_calls:
                if c.id in open_calls:
                    out.append(f"call id {c.id!r} (message {j}) is used twice in one step "
                               f"(first in message {open_calls[c.id]})")
                    continue
                if unique_ids == "list" and c.id in first_call:
                    out.append(f"call id {c.id!r} (message {j}) is not unique in the list "
                               f"(first in message {first_call[c.id]})")
                first_call.setdefault(c.id, j)
                open_calls[c.id] = j
        elif isinstance(m, ToolResultMessage):
            cid = m.tool_call_id
            if cid in open_calls and cid not in answered:
                answered.add(cid)
            elif cid in answered:
                out.append(f"result {cid!r} (message {j}) is a second result for one call")
            else:
                out.append(f"result {cid!r} (message {j}) does not follow its call (orphan: no open "
                           "call of that id in its step)")
        elif isinstance(m, (UserMessage, UserImageMessage)):
            close(j, "user")
        prev = m
    # what is still open at the end is the pending tail: allowed (only the given ids, if given)
    if pending is not None:
        for cid, i in open_calls.items():
            if cid not in answered and cid not in pending:
                out.append(f"call {cid!r} (message {i}) has no result and is not one of the pending calls")
    return out
