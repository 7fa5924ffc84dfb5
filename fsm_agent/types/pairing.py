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

:func:`normalize_pairing` is the one place that puts a history into the shape every wire protocol
accepts, by moves that lose and invent nothing: a call given twice is kept once, results move to
right after their step (past a system, user or assistant message that sat between a call and its
result), in call order, and the calls of a step split over several assistant messages stay together
(Chat Completions then sends them as one message). What cannot be fixed that way is left to the
caller: a call with no result (``fill`` may answer it) and a result of no earlier call (an *orphan*:
returned, for the protocol to refuse or keep). Every protocol module calls it before building a
request, and the ``repair`` plugin builds its passes on it. Matching (:func:`result_owners`): a
result belongs to the nearest earlier assistant message with a call of its id, the k-th result with
id X to that message's k-th call with id X, so ids reused every turn (``call_0``) stay paired.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal

from attrs import evolve

from .content import ToolUseBlock
from .messages import AssistantMessage, Message, SystemMessage, ToolResultMessage, UserImageMessage, UserMessage

__all__ = ["MISSING_RESULT", "Fill", "collapse_repeated_calls", "missing_result", "normalize_pairing",
           "pairing_problems", "result_owners"]

MISSING_RESULT = ("No result was recorded for this call (the run stopped before it finished); its outcome "
                  "is unknown.")
"""The text of the error result a protocol sends for a call the history never answered (every
protocol refuses a call without its result)."""

Fill = Callable[[ToolUseBlock, bool, "Message | None"], ToolResultMessage]
"""``(call, answered, after) -> result`` for a call with no result: ``answered`` tells whether another
call of its step has a real result, ``after`` is the first message after the step that is neither a
result nor a system message (``None``: the step ends the history)."""


def missing_result(call: ToolUseBlock, answered: bool = False, after: Message | None = None) -> ToolResultMessage:
    """The :data:`Fill` the protocol modules use: an error result saying no result was recorded
    (:data:`MISSING_RESULT`), ``metadata={"synthetic": "missing"}``."""
    return ToolResultMessage(call.id, MISSING_RESULT, is_error=True, name=call.name,
                             metadata={"synthetic": "missing"})


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


def result_owners(messages: Sequence[Message]) -> list[tuple[int, int] | None]:
    """Per index, the ``(assistant index, call position)`` the tool result there answers; ``None`` for
    other messages, for orphans (no earlier call of that id) and for second results (more results of
    an id than that message has calls of it). Matching as in the module docstring."""
    latest: dict[str, int] = {}
    used: dict[tuple[int, str], int] = {}
    out: list[tuple[int, int] | None] = [None] * len(messages)
    for j, m in enumerate(messages):
        if type(m) is AssistantMessage:
            for c in m.tool_calls:
                latest[c.id] = j
        elif type(m) is ToolResultMessage:
            i = latest.get(m.tool_call_id)
            if i is None:
                continue
            key = m.tool_call_id
            k = used.get((i, key), 0)
            slots = [p for p, c in enumerate(messages[i].tool_calls) if c.id == key]  # type: ignore[union-attr]
            if k < len(slots):
                used[(i, key)] = k + 1
                out[j] = (i, slots[k])
    return out


def collapse_repeated_calls(messages: Sequence[Message]) -> list[Message]:
    """A tool call given twice — the same id, name and arguments, in one turn or in a later one (a
    client that echoes ``tool_calls`` and a block, a history glued from two sources) — is kept once,
    so the provider sees that call once with its one result (:func:`normalize_pairing` drops the
    extra results). A later call with the same id is a *new* call, and kept, when the earlier one
    was answered before it and it has a result of its own (servers that number ``call_0`` each turn).
    Calls with an empty id are never collapsed. A message left with no block stays, empty."""
    first: dict[str, tuple[int, ToolUseBlock]] = {}
    results: dict[str, list[int]] = {}
    for j, m in enumerate(messages):
        if type(m) is ToolResultMessage:
            results.setdefault(m.tool_call_id, []).append(j)
    out: list[Message] = []
    for i, m in enumerate(messages):
        if not (type(m) is AssistantMessage and m.tool_calls):
            out.append(m)
            continue
        kept: list[Any] = []
        here: set[str] = set()
        changed = False
        for b in m.content:
            if isinstance(b, ToolUseBlock) and b.id:
                prev = first.get(b.id)
                if prev is not None and prev[1].name == b.name and prev[1].input == b.input:
                    before = prev[0]
                    answered_before = any(before < j < i for j in results.get(b.id, ()))
                    nxt = next((k for k in range(i + 1, len(messages)) if type(messages[k]) is AssistantMessage
                                and any(c.id == b.id for c in messages[k].tool_calls)),  # type: ignore[union-attr]
                               len(messages))
                    own_result = any(i < j < nxt for j in results.get(b.id, ()))
                    if b.id in here or not answered_before or not own_result:
                        changed = True
                        continue  # the same call again
                first[b.id] = (i, b)
                here.add(b.id)
            kept.append(b)
        out.append(evolve(m, content=tuple(kept)) if changed else m)
    return out


def _in_shape(messages: Sequence[Message], filling: bool) -> bool:
    """Whether ``messages`` is already what :func:`normalize_pairing` returns: each step (an
    assistant message with calls, and the ones with calls right after it) followed at once by one
    result per call, in call order, with distinct ids in the step; a step missing results only at
    the very end (and then only when ``filling`` is false and it repeats no earlier id). One pass."""
    owed: list[str] = []
    k = 0
    calls_last = False  # the previous message is an assistant message with calls
    earlier: set[str] = set()  # ids of the calls of earlier steps
    for m in messages:
        t = type(m)
        if t is ToolResultMessage:
            if k < len(owed) and m.tool_call_id == owed[k]:  # type: ignore[union-attr]
                k += 1
                calls_last = False
                continue
            return False
        calls = m.tool_calls if t is AssistantMessage else ()  # type: ignore[union-attr]
        if k < len(owed):
            if not (calls and calls_last):
                return False  # a message inside a step's results, or a call left without one
            owed += [c.id for c in calls]  # the step goes on in a second message (split calls)
            if len(set(owed)) != len(owed):
                return False
            continue
        if calls:
            earlier.update(owed)
            owed = [c.id for c in calls]
            k = 0
            if len(set(owed)) != len(owed):
                return False
        calls_last = bool(calls)
    if k == len(owed):
        return True
    return not filling and earlier.isdisjoint(owed[k:])


def normalize_pairing(messages: Sequence[Message], *, fill: Fill | None = None,
                      collapse: bool = True) -> tuple[Sequence[Message], list[int]]:
    """``(messages, orphans)``: ``messages`` put in the shape every protocol accepts, without losing
    or inventing anything (module docstring), and the indexes (in the returned list) of the results
    that answer no earlier call.

    * ``collapse``: first :func:`collapse_repeated_calls`.
    * Each step (an assistant message with calls, plus the assistant messages with calls directly
      after it whose ids it does not hold yet, system messages between them aside) is followed at
      once by its results, in call order; whatever sat between a call and its result (system, user or assistant messages) comes
      after them, in its order; so do system messages between the messages of a split step. A second
      result for one call is dropped.
    * A call with no result gets ``fill(call, answered, after)`` in its place (:data:`Fill`), or
      none when ``fill`` is ``None``.
    * A result whose id no earlier call has (an orphan) stays where it was.

    The input itself comes back, with no orphans, when it is in that shape already: one pass over
    it, the common case. Otherwise a few linear passes."""
    if _in_shape(messages, fill is not None):
        return messages, []
    msgs: Sequence[Message] = collapse_repeated_calls(messages) if collapse else messages
    owners = result_owners(msgs)
    answers = {o: msgs[j] for j, o in enumerate(owners) if o is not None}
    # the steps: first message -> last message with calls, last message -> its messages with calls
    step_end: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    start = last = prev = -1
    step_ids: set[str] = set()
    for j, m in enumerate(msgs):
        t = type(m)
        if t is SystemMessage:
            continue
        if t is AssistantMessage and m.tool_calls:  # type: ignore[union-attr]
            ids = {c.id for c in m.tool_calls}  # type: ignore[union-attr]
            if last >= 0 and last == prev and step_ids.isdisjoint(ids):
                # right after the step's last message, with ids of its own: the same step, split
                members[j] = members.pop(last)
                members[j].append(j)
                step_end[start] = j
                step_ids |= ids
            else:  # (an id again: a new step, the earlier one's calls left without results)
                start = j
                members[j] = [j]
                step_end[j] = j
                step_ids = ids
            last = j
        prev = j
    out: list[Message] = []
    orphans: list[int] = []
    seen: set[str] = set()  # ids of the calls passed so far
    deferred: list[Message] = []  # system messages between the messages of a split step
    inside = -1  # the last message of the step being passed
    for j, m in enumerate(msgs):
        t = type(m)
        if t is ToolResultMessage:
            if owners[j] is None and m.tool_call_id not in seen:  # type: ignore[union-attr]
                orphans.append(len(out))
                out.append(m)
            continue  # placed after its step, or a second result for one call: dropped
        if t is AssistantMessage:
            seen.update(c.id for c in m.tool_calls)  # type: ignore[union-attr]
        if j in step_end:
            inside = step_end[j]
        if inside > j and t is SystemMessage:
            deferred.append(m)
            continue
        out.append(m)
        if j != inside:
            continue
        real = [[answers.get((i, p)) for p in range(len(msgs[i].tool_calls))]  # type: ignore[union-attr]
                for i in members[j]]
        answered = any(r is not None for rs in real for r in rs)
        after: Message | None = None
        if fill is not None and not all(r is not None for rs in real for r in rs):
            after = next((msgs[x] for x in range(j + 1, len(msgs))
                          if type(msgs[x]) not in (ToolResultMessage, SystemMessage)), None)
        for i, rs in zip(members[j], real, strict=True):
            for r, c in zip(rs, msgs[i].tool_calls, strict=True):  # type: ignore[union-attr]
                if r is not None:
                    out.append(r)
                elif fill is not None:
                    out.append(fill(c, answered, after))
        out += deferred
        deferred = []
        inside = -1
    return out, orphans
