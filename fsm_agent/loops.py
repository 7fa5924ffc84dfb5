"""Loop detection: finding a model that repeats the same tool calls with the same results.

Seed 000 §5.4: the last **12** call signatures (tool name + arguments), patterns of length **1, 2
or 3**, and a loop is the same pattern **3** times in a row (``[A, A, A]``, ``[A, B, A, B, A, B]``,
``[A, B, C, A, B, C, A, B, C]``); what is done about it is a warning in the model's context, not a
forced stop (§5.4.3). This module is the pure half: identities, the pattern finder, the reading of
a transcript and the words of the warning. The engine (``fsm_agent.machine.loops``) applies a
run's :class:`LoopConfig` at PreTurn and MidTurn; the ``loop_detection`` plugin uses the same
finder for its own warn → block → stop escalation.

Everything here is deterministic (no clock, no randomness, no I/O): the same transcript gives the
same verdict, in a replay and in a Temporal workflow too.

* **Call identity**: tool name + arguments as canonical JSON (sorted keys, compact), so re-ordered
  keys do not hide a repeat; arguments that were not valid JSON count by their raw text.
* **Result identity**: a hash of ``is_error`` + the result's content blocks as canonical JSON (what
  the model was shown; ``metadata`` is not part of it).
* **A repeat counts once its result is in** (issue 19 item 6): a loop is a pattern whose calls came
  back *with the same results* in every repetition. A status poll whose answer changes (10 %,
  45 %, 90 %) is progress, not a loop; a call proposed but not yet run is never judged by a guess
  at its result.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Literal

import orjson
from attrs import field, frozen

from .errors import ConfigurationError
from .types.codec import unstructure
from .types.content import TextBlock, ToolUseBlock
from .types.messages import AssistantMessage, Message, ToolResultMessage, UserImageMessage, UserMessage

__all__ = ["LOOP_DETECTION", "Loop", "LoopConfig", "NOTICE_PREFIX", "call_identity", "continuing_calls",
           "find_loop", "find_pattern", "find_repetition", "loop_notice", "result_identity"]

NOTICE_PREFIX = "[runtime notice: loop detection]"
"""First words of the warning the model reads (the engine's and the ``loop_detection`` plugin's)."""

LOOP_DETECTION = "loop_detection"
"""The name the engine's loop detection goes by: in a denial's ``metadata["denied_by"]``, in
:class:`~fsm_agent.types.PolicyDecision` events and in the ``loop_detected`` log event."""

_SORTED = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS

_Then = Literal["warn", "block", "stop"]


def _lengths(value: Any) -> tuple[int, ...]:
    return tuple(sorted(set(value)))


@frozen
class LoopConfig:
    """How the engine detects and answers a loop of tool calls (``RunConfig.loop_detection``).

    The defaults are seed 000 §5.4's. The first answer to a loop is always a warning in the context
    of the next model call; :attr:`then` says what a model that goes on with the loop after it gets.

    Raises:
        ConfigurationError: an option out of range (at construction).
    """

    window: int = 12
    """Calls remembered, each with its result (the latest ones since the last user input)."""
    pattern_lengths: tuple[int, ...] = field(default=(1, 2, 3), converter=_lengths)
    """Lengths of the patterns looked for, in calls."""
    repeats: int = 3
    """Repetitions of a pattern, each with the same results, that make a loop."""
    then: _Then = "warn"
    """What follows the warning when the model goes on with the loop:

    * ``"warn"`` (default, seed 000 §5.4.3): the warning again, in the context of every model call
      whose history still ends in the loop; the calls run, and the run's ``max_iterations`` ends a
      loop the model never leaves;
    * ``"block"``: a call that goes on with the loop does not run; the model reads an error result
      saying why (``metadata["denied_by"] == "loop_detection"``);
    * ``"stop"``: a call that goes on with the loop ends the run FAILED_TERMINAL before it runs,
      error kind ``loop_detected``.
    """

    def __attrs_post_init__(self) -> None:
        if self.then not in ("warn", "block", "stop"):
            raise ConfigurationError(f"LoopConfig(then={self.then!r}): use 'warn', 'block' or 'stop'")
        if not self.pattern_lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                           for n in self.pattern_lengths):
            raise ConfigurationError(f"LoopConfig(pattern_lengths={self.pattern_lengths!r}): give one or more "
                                     "whole numbers of at least 1")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 2:
            raise ConfigurationError(f"LoopConfig(repeats={self.repeats!r}): a loop needs at least 2 repetitions")
        need = max(self.pattern_lengths) * self.repeats
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < need:
            raise ConfigurationError(f"LoopConfig(window={self.window!r}): the window must hold the longest "
                                     f"pattern {self.repeats} times, at least {need} calls")


@frozen
class Loop:
    """A loop found at the end of a history of calls with their results."""

    length: int
    """Calls in the pattern."""
    count: int
    """Times the pattern ran and came back, in a row, with the same results (at least ``repeats``;
    calls blocked in the loop are not counted)."""
    pattern: tuple[str, ...]
    """The pattern's calls as ``name {arguments}`` (arguments cut at 200 characters), as it first came."""
    next_calls: tuple[str, ...]
    """Call identities (:func:`call_identity`) that go on with the loop, the next one first."""
    results: tuple[str, ...]
    """The start of the latest result text of each call of :attr:`pattern` (for the warning)."""


def _canonical(value: Any) -> str:
    """``value`` as canonical JSON: sorted keys, compact, UTF-8 text (not ``\\u`` escapes)."""
    try:
        return orjson.dumps(value, option=_SORTED, default=str).decode()
    except orjson.JSONEncodeError:  # an integer past 64 bits, a key orjson cannot sort: the slow path
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def call_identity(call: ToolUseBlock) -> str:
    """``name`` + NUL + arguments as canonical JSON (sorted keys, compact) or ``raw:<text>`` when the
    arguments were not valid JSON."""
    args = f"raw:{call.raw_input}" if call.raw_input is not None else _canonical(call.input)
    return f"{call.name}\x00{args}"


def result_identity(result: ToolResultMessage) -> str:
    """A hash (32 hex digits) of ``is_error`` and the result's content blocks as canonical JSON."""
    blocks = [b.text if type(b) is TextBlock and not b.citations else unstructure(b) for b in result.content]
    return hashlib.sha256(_canonical([int(result.is_error), blocks]).encode()).hexdigest()[:32]


def _periodic(steps: Sequence[tuple[Any, ...]], length: int, same_results: bool = True) -> tuple[int, int]:
    """``(tail, known)``: how many of the last ``steps`` repeat the last ``length`` ones with period
    ``length``, and the fewest known results any one phase of that tail has.

    Steps are ``(call identity, result identity or None, ...)``. Within one phase of the period
    every call must be equal and (``same_results``) every known result equal. ``None`` (no result:
    not run, or not run yet) matches any result and is not counted as known; results are compared
    against the phase's result, not just the neighbour's, so a ``None`` between two different
    results does not join them.
    """
    n = len(steps)
    first: list[str | None] = [None] * length
    known = [0] * length
    k = 0
    while k < n:
        s = steps[n - 1 - k]
        phase = k % length
        if k >= length and s[0] != steps[n - 1 - phase][0]:
            break
        result = s[1]
        if result is not None:
            if same_results:
                if first[phase] is None:
                    first[phase] = result
                elif first[phase] != result:
                    break
            known[phase] += 1
        k += 1
    return k, min(known)


def find_pattern(steps: Sequence[tuple[Any, ...]], repeats: int, lengths: Sequence[int],
                 same_results: bool = True) -> tuple[int, int] | None:
    """``(pattern length, periodic tail length)`` of a pattern (of one of ``lengths``, ascending)
    whose calls came back with their results at least ``repeats`` times in a row at the end of
    ``steps``: the one with the longest periodic tail, the shortest of equals; or ``None``. (The
    longest tail, because a step without a result matches any result: after on, off, on, off, on,
    (denied) the tail "on, (denied)" is a shorter and wrong reading.)"""
    best: tuple[int, int] | None = None
    for length in lengths:
        if len(steps) < length * repeats:
            break
        tail, known = _periodic(steps, length, same_results)
        if known >= repeats and (best is None or tail > best[1]):
            best = (length, tail)
    return best


def find_repetition(steps: Sequence[tuple[str, str | None]], *, repeats: int,
                    max_pattern: int = 3, same_results: bool = True) -> int | None:
    """Length of the pattern (1..``max_pattern``) that ``steps`` end with, ``repeats`` or more times
    in a row with every result known, or ``None``. Of several, the one that covers the most steps,
    then the shortest.

    ``steps``: ``(call identity, result identity or None)``, oldest first. Repetitions match when
    their calls are equal and (with ``same_results``) their results are equal. ``None`` is a call
    whose result is not known (it did not run, or has not run yet): it matches any result but
    does not count as a repetition, so ``[(A, r), (A, r), (A, None)]`` is not yet a loop of 3.
    """
    found = find_pattern(steps, repeats, range(1, max_pattern + 1), same_results)
    return None if found is None else found[0]


def _label(call: ToolUseBlock, identity: str) -> str:
    return f"{call.name} {identity[len(call.name) + 1:][:200]}"


def find_loop(transcript: Sequence[Message], config: LoopConfig, *, skip_denied_by: str = LOOP_DETECTION
              ) -> Loop | None:
    """The loop the latest calls of ``transcript`` end with, or ``None``.

    The history is the calls since the latest user input (a user message, a steer, a follow-up, a
    verifier's feedback: new input starts an empty history) that have a result in ``transcript``,
    the latest ``config.window`` of them, in proposal order. A call without a result (cut, or not
    run yet) is left out. A call that ``skip_denied_by`` denied (its result has that
    ``metadata["denied_by"]``: a call blocked as part of a loop) stays in the history as a call
    without a result: it goes on with the pattern but is no repetition (and takes no place in the
    window). A call another middleware or a person answered counts with the answer as its result,
    so the same refused call proposed again and again is a loop too.
    """
    results: dict[str, ToolResultMessage] = {}
    steps: list[tuple[str, str | None, ToolUseBlock, ToolResultMessage]] = []
    known = 0
    for message in reversed(transcript):
        if isinstance(message, ToolResultMessage):
            results.setdefault(message.tool_call_id, message)
        elif isinstance(message, AssistantMessage):
            for call in reversed(message.tool_calls):
                result = results.get(call.id)
                if result is None or known >= config.window:
                    continue
                if (result.metadata or {}).get("denied_by") == skip_denied_by:
                    steps.append((call_identity(call), None, call, result))
                else:
                    steps.append((call_identity(call), result_identity(result), call, result))
                    known += 1
            if known >= config.window:
                break
        elif isinstance(message, (UserMessage, UserImageMessage)):
            break
    steps.reverse()
    found = find_pattern(steps, config.repeats, config.pattern_lengths)
    if found is None:
        return None
    length, tail = found
    n = len(steps)
    start = n - tail
    shown = []
    for i in range(length):  # the latest result of each call of the pattern, in the pattern's order
        latest = next((s[3] for s in reversed(steps[start + i:n:length]) if s[1] is not None), None)
        shown.append(latest.text[:120] if latest is not None else "")
    return Loop(length=length, count=_periodic(steps, length)[1],
                pattern=tuple(_label(s[2], s[0]) for s in steps[start:start + length]),
                next_calls=tuple(steps[n - length + j][0] for j in range(length)), results=tuple(shown))


def continuing_calls(loop: Loop, calls: Sequence[ToolUseBlock]) -> list[str]:
    """Ids of the ``calls`` (one model response's, in its order) that go on with ``loop``: the
    first call if it is the loop's next one, then each next call while it is the one after."""
    out: list[str] = []
    for k, call in enumerate(calls):
        if call_identity(call) != loop.next_calls[k % len(loop.next_calls)]:
            break
        out.append(call.id)
    return out


NOTICE_RESULT_CHARS = 80
"""Characters of each repeated result the loop notice quotes (the rest cut, marked with …)."""


def loop_notice(loop: Loop, then: _Then = "warn") -> str:
    """The warning the model reads (seed 000 §5.4.3's "Loop detected ... try a different
    approach"), with the calls, how often they came back and what they returned; the last sentence
    says what going on will bring (``then``)."""
    what = (f"called {loop.pattern[0]}" if loop.length == 1
            else f"repeated the sequence {' -> '.join(loop.pattern)}")
    # each result cut short: the notice is added after the PreTurn plugins (compaction among them),
    # so it must stay small whatever the tools returned
    shown = "; ".join(repr(r if len(r) <= NOTICE_RESULT_CHARS else r[:NOTICE_RESULT_CHARS] + "…")
                      for r in loop.results if r) or "no output"
    after = {"warn": "Repeating it will not change the result.",
             "block": "Repeating it will not change the result, and it will not be run again.",
             "stop": "Repeating it will not change the result, and repeating it again ends the run."}[then]
    return (f"{NOTICE_PREFIX} Loop detected: you {what} {loop.count} times in a row and got the same result "
            f"every time ({shown}). {after} Please try a different approach: use the results you already "
            "have, change the arguments, or give your final answer.")
