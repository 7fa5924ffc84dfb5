"""Loop detection: warn, then block, then stop a model that repeats tool calls without progress.

Sources: DESIGN.md §4; seed 000 §5.4 (octos ``loop_detect.rs``); case B22 (false positives versus a
real loop); issue 8 item 4 (progress versus no progress; alternation through denials).

Seed 000 §5.4.2 gives the numbers: a ring buffer of the last **12** call signatures (tool name +
arguments), patterns of length **1, 2 or 3**, and a loop is "the same pattern **3** times in a row"
(``[A, A, A]``, ``[A, B, A, B, A, B]``, ``[A, B, C, A, B, C, A, B, C]``). Its §5.4.3 only injects
a warning and leaves the end to the iteration limit; B22 and issue 8 ask for more (the 3rd
proposal intercepted, the run stopped rather than COMPLETED), hence the escalation below.

* **Call identity**: tool name + arguments as canonical JSON (sorted keys, compact), so re-ordered
  keys do not hide a repeat; arguments that were not valid JSON count by their raw text. The
  identity is the model's proposal as recorded in the transcript.
* **Result identity**: a hash of ``is_error`` + the result's content blocks as canonical JSON
  (what the model was shown; ``metadata`` is not part of it).
* **No progress**: the last calls (the window) end with a pattern of 1-``max_pattern`` calls
  repeated in a row, with the same calls *and the same results* in every repetition. A call
  repeated with new results each time (polling 10%, 45%, 90%) is progress, and so is a batch that
  repeats one shape with other arguments (B22 ``fp_*``). A call whose result flips between two
  values (on, off, on, off) is a pattern of length 2 with repeating results: no progress. A
  pattern of several calls counts only when each of its calls' results repeats too.
* **Denials are kept in the history.** A proposal this middleware denied stays in it as a call
  that did not run (its result matches any result), so A, B, A, B, A, B(denied), A is still the
  same loop and the run stops there, within three repetitions. A call that another middleware
  denied or answered never reaches this middleware's ``on_tool_call``; it is read from the
  transcript with the answer it got as its result, so the same denied call proposed again and
  again is a loop too.

Escalation, per loop:

1. **warn** — once the calls end with ``repeats - 1`` repetitions, the next model call gets a
   runtime notice, a user message appended to ``ctx.messages`` (once per loop);
2. **block** — a proposal that brings the repetitions to ``repeats`` gets ``Deny``: it does not
   run, and the model sees an error tool result saying why and what to do instead;
3. **stop** — once the model has seen denials of the loop from ``max_blocks`` model turns, its next
   proposal that continues the loop ends the run FAILED_TERMINAL, detail ``"loop detected: ..."``,
   ``error={"kind": "loop_detected", ...}``. Several denials in one model turn count once (the
   model had not seen any of them when it proposed them). A loop that this middleware never gets
   to block (another middleware denies every repeat first) ends the run in PreTurn once it reaches
   ``repeats + max_blocks`` repetitions.

Defaults on B22 ``tp_same_call_same_result``: 2 identical runs, the warning, the 3rd proposal
denied, the 4th stops the run. A poll that returns the same status twice in a row is treated the
same way: include progress in such results, or raise ``repeats``.

**History comes from the transcript**, read incrementally (each message once), not from private
bookkeeping: a resumed run (a new ``RunContext`` over the same transcript, after a pause, an
approval, an interrupt or a crash) remembers the calls, results and denials before it, so a resume
is no way around a block. A user message in the transcript (a new task, a steer, a follow-up, a
verifier's feedback) is new input and starts an empty history. Only the warnings already given and
:meth:`LoopDetection.detections` are per run: after a resume the warning may be given again.

Why the notice goes into ``ctx.messages`` and not the transcript: the transcript records what the
user, the model and the tools said, and the facts behind the notice (the repeated calls and their
results) are already in it, as are the denial and the stop detail. In the transcript the notice
would be re-sent on every later call, long after it stopped being true, and saved with the session
as if a user had said it. It is a user message because Anthropic takes system text only first
(and the repair pipeline would merge a late system message there).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from fsm_agent import Deny, Middleware, Ordering, RunContext, StopReason, StopRun
from fsm_agent.types import (AssistantMessage, ToolResultMessage, ToolUseBlock, UserImageMessage, UserMessage,
                             unstructure)

__all__ = ["NOTICE_PREFIX", "LoopDetection", "call_identity", "find_repetition", "result_identity"]

NOTICE_PREFIX = "[runtime notice: loop detection]"
"""First words of the warning message."""

_NOT_RUN_KEYS = ("denied_by", "responded_by")


class _Step(NamedTuple):
    call: str
    """Call identity (:func:`call_identity`)."""
    result: str | None
    """Result identity (:func:`result_identity`), or ``None`` for a proposal that did not run
    because this middleware denied it, or has not run yet (an earlier call of the same turn)."""
    turn: int
    """Which model response proposed it (its number among the transcript's assistant messages)."""
    ours: bool
    """Denied by this middleware."""
    ran: bool
    """The tool ran (not denied or answered by a middleware or a person)."""
    label: str
    """``name {args}``, for messages."""
    preview: str
    """The start of the result text, for messages."""


def _args(call: ToolUseBlock) -> str:
    if call.raw_input is not None:
        return f"raw:{call.raw_input}"
    return json.dumps(call.input, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)


def call_identity(call: ToolUseBlock) -> str:
    """``name`` + NUL + arguments as canonical JSON (sorted keys, compact) or ``raw:<text>``."""
    return f"{call.name}\x00{_args(call)}"


def result_identity(result: ToolResultMessage) -> str:
    """A hash of ``is_error`` and the result's content blocks as canonical JSON (sorted keys)."""
    payload = json.dumps([int(result.is_error), unstructure(list(result.content))], sort_keys=True,
                         separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _periodic(steps: Sequence[tuple[Any, ...]], length: int, same_results: bool = True) -> int:
    """How many of the last ``steps`` repeat the last ``length`` ones, period ``length``.

    Steps are ``(call identity, result identity or None, ...)``. Within one phase of the period
    every call must be equal and every known result equal (``None``: did not run, matches any);
    results are compared against the phase's result, not just the neighbour's, so a ``None``
    between two different results does not join them.
    """
    n = len(steps)
    known: list[str | None] = [None] * length
    k = 0
    while k < n:
        s = steps[n - 1 - k]
        phase = k % length
        if k >= length and s[0] != steps[n - 1 - phase][0]:
            break
        if same_results and s[1] is not None:
            if known[phase] is None:
                known[phase] = s[1]
            elif known[phase] != s[1]:
                break
        k += 1
    return k


def _find(steps: Sequence[tuple[Any, ...]], repeats: int, max_pattern: int,
          same_results: bool = True) -> tuple[int, int] | None:
    """``(pattern length, periodic tail length)`` of a pattern repeated at least ``repeats`` times
    at the end of ``steps``: the one with the longest periodic tail, the shortest of equals; or
    ``None``. (The longest tail, because a call that did not run matches any result: after
    on, off, on, off, on, (denied) the tail "on, (denied)" is a shorter and wrong reading.)"""
    best: tuple[int, int] | None = None
    for length in range(1, max_pattern + 1):
        if len(steps) < length * repeats:
            break
        tail = _periodic(steps, length, same_results)
        if tail // length >= repeats and (best is None or tail > best[1]):
            best = (length, tail)
    return best


def find_repetition(steps: Sequence[tuple[str, str | None]], *, repeats: int,
                    max_pattern: int = 3, same_results: bool = True) -> int | None:
    """Length of the pattern (1..``max_pattern``) that ``steps`` end with, ``repeats`` or more times
    in a row, or ``None``. Of several, the one that covers the most steps, then the shortest.

    ``steps``: ``(call identity, result identity or None)``, oldest first. Repetitions match when
    their calls are equal and (with ``same_results``) their results are equal, ``None`` (not run)
    matching any result.
    """
    found = _find(steps, repeats, max_pattern, same_results)
    return None if found is None else found[0]


def _loop_key(steps: Sequence[_Step]) -> tuple[str, ...]:
    """The pattern up to rotation: A,B and B,A are one loop."""
    p = tuple(s.call for s in steps)
    return min(p[i:] + p[:i] for i in range(len(p)))


def _labels(steps: Sequence[_Step]) -> list[str]:
    return [s.label for s in steps]


def _shown(tail: Sequence[_Step], length: int) -> str:
    """The latest known result preview of each call of the pattern ``tail[-length:]``, in order."""
    out = []
    for i in range(length):
        phase = [tail[j] for j in range(len(tail) - length + i, -1, -length)]
        preview = next((s.preview for s in phase if s.result is not None), "")
        if preview:
            out.append(repr(preview))
    return "; ".join(out) or "no output"


class LoopDetection(Middleware):
    """MidTurn middleware that warns, blocks and finally stops repeated tool calls (module doc).

    Args:
        window: calls remembered (seed 000 §5.4.2: 12).
        max_pattern: longest pattern looked for, in calls (seed 000 §5.4.2: 3).
        repeats: repetitions that make a loop (seed 000 §5.4.2, B22: 3); the warning comes one
            earlier, the block at this one.
        max_blocks: model turns with denials of one loop the model may see before its next
            proposal in the loop ends the run (1). The window must hold them.
        same_results: a repeat counts only when its results were identical too (B22; True).

    State is per run (``ctx.state(self)``) and rebuilt from ``ctx.transcript``; :meth:`detections`
    lists what it did. Innermost: its ``on_tool_call`` runs after policy middleware (DESIGN §4:
    policy → loop detection → execute). Calls are taken in proposal order, whatever order their
    parallel executions finish in.

    Raises:
        ValueError: an option out of range (at construction).
    """

    name = "loop_detection"

    ordering = Ordering(position="innermost")

    def __init__(self, *, window: int = 12, max_pattern: int = 3, repeats: int = 3,
                 max_blocks: int = 1, same_results: bool = True) -> None:
        if repeats < 2 or max_pattern < 1 or max_blocks < 0 or window < max_pattern * repeats:
            raise ValueError("need repeats >= 2, max_pattern >= 1, max_blocks >= 0 and "
                             "window >= max_pattern * repeats")
        self.window = window
        self.max_pattern = max_pattern
        self.repeats = repeats
        self.max_blocks = max_blocks
        self.same_results = same_results

    # -- the history, read from the transcript ------------------------------------------------
    def _sync(self, ctx: RunContext) -> dict[str, Any]:
        """Read the transcript's new messages into the history; return the state.

        State: ``pos`` (messages read), ``turn`` (assistant messages read), ``last`` (the calls of
        the latest assistant message), ``open`` (its calls without a result yet, by id),
        ``history`` (``_Step``s, at most ``window``), ``denied`` (ids this middleware denied),
        ``warned`` (loop keys warned of), ``events``.
        """
        st = ctx.state(self)
        if not st:
            st.update(pos=0, turn=0, last=(), open={}, history=[], denied=set(), warned=set(), events=[])
        transcript = ctx.transcript
        if len(transcript) == st["pos"]:
            return st
        if len(transcript) < st["pos"]:  # not the transcript read so far: read it again
            st.update(pos=0, turn=0, last=(), open={}, history=[])
        history: list[_Step] = st["history"]
        for m in transcript[st["pos"]:]:
            if isinstance(m, ToolResultMessage):
                call = st["open"].pop(m.tool_call_id, None)
                if call is not None:
                    history.append(self._step(call, st["turn"], m, st["denied"]))
            elif isinstance(m, AssistantMessage):
                st["turn"] += 1
                st["last"] = m.tool_calls
                st["open"] = {c.id: c for c in m.tool_calls}
            elif isinstance(m, (UserMessage, UserImageMessage)):  # new input: a fresh start
                history.clear()
        st["pos"] = len(transcript)
        del history[: -self.window]
        return st

    def _step(self, call: ToolUseBlock, turn: int, result: ToolResultMessage | None,
              denied: set[str]) -> _Step:
        label = f"{call.name} {_args(call)[:200]}"
        if result is None:
            return _Step(call_identity(call), None, turn, call.id in denied, False, label, "")
        md = result.metadata or {}
        ours = md.get("denied_by") == self.middleware_name or call.id in denied
        if ours:
            return _Step(call_identity(call), None, turn, True, False, label, "")
        ran = not any(md.get(k) for k in _NOT_RUN_KEYS) and md.get("decision") not in ("reject", "respond")
        return _Step(call_identity(call), result_identity(result), turn, False, ran, label, result.text[:120])

    def _match(self, steps: Sequence[_Step], repeats: int) -> tuple[int, list[_Step]] | None:
        found = _find(steps, repeats, self.max_pattern, self.same_results)
        if found is None:
            return None
        length, tail = found
        return length, list(steps[len(steps) - tail:])

    # -- hooks ---------------------------------------------------------------------------------
    def pre_turn(self, ctx: RunContext) -> None:
        st = self._sync(ctx)
        history: list[_Step] = st["history"]
        stuck = self._match(history, self.repeats + self.max_blocks)
        if stuck is not None and not any(s.ours for s in stuck[1]):
            # only a loop this middleware never got to block: another middleware answered first
            length, tail = stuck
            last = tail[-length:]
            times = len(tail) // length
            st["events"].append({"action": "stop", "turn": ctx.turn + 1, "pattern": _labels(last)})
            raise StopRun(
                StopReason.FAILED_TERMINAL,
                f"loop detected: {' -> '.join(_labels(last))} was proposed {times} times in a row "
                f"with the same result each time ({_shown(tail, length)}), so the run was stopped "
                "before spending its budget",
                error={"kind": "loop_detected", "pattern": _labels(last), "blocked": 0,
                       "executed_in_loop": sum(s.ran for s in tail)})
        found = self._match(history, self.repeats - 1)
        if found is None:
            st["warned"].clear()  # the loop is broken: a new one gets its own warning
            return
        length, tail = found
        last = tail[-length:]
        key = _loop_key(last)
        if key in st["warned"] or any(s.ours for s in tail):  # warned, or already past warnings
            return
        st["warned"].add(key)
        st["events"].append({"action": "warn", "turn": ctx.turn + 1, "pattern": _labels(last)})
        what = (f"called {last[0].label}" if length == 1
                else f"repeated the sequence {' -> '.join(_labels(last))}")
        ctx.messages.append(UserMessage(
            f"{NOTICE_PREFIX} You {what} {len(tail) // length} times in a row and got the same "
            f"result every time ({_shown(tail, length)}). Repeating it will not change the result "
            "and will be blocked. Use the results you already have, try a different approach, or "
            "give your final answer."))

    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Deny | None:
        st = self._sync(ctx)
        last: tuple[ToolUseBlock, ...] = st["last"]
        index = next((i for i, c in enumerate(last) if c.id == call.id), None)
        turn = st["turn"]
        if index is None:  # not in the transcript's latest response: judge it as given, alone
            earlier: list[_Step] = []
            proposed = call
        else:  # earlier calls of this response have no result yet; the model's own proposal
            earlier = [self._step(c, turn, None, st["denied"]) for c in last[:index]]
            proposed = last[index]
        me = self._step(proposed, turn, None, st["denied"])
        steps = [*st["history"], *earlier, me][-self.window:]
        found = self._match(steps, self.repeats)
        if found is None:
            return None
        length, tail = found
        pattern = tail[-length:]
        # interceptions the model has seen: this middleware's denials, and a proposal past the
        # threshold that another middleware or a person answered instead of running it
        first = self.repeats * length - 1
        stops = [s for i, s in enumerate(tail) if s.turn < turn and (s.ours or (i >= first and not s.ran))]
        seen = len({s.turn for s in stops})
        blocked = sum(s.ours for s in tail)
        ran = sum(s.ran for s in tail)
        answered = any(s.result is not None and not s.ran for s in tail)  # by another middleware or a person
        times = 0 if answered else ran // length
        seq = " (as a sequence)" if length > 1 else ""
        loop = (f"{' -> '.join(_labels(pattern))} already ran {times} times in a row{seq} with the same "
                f"result each time ({_shown(tail, length)})" if times else
                f"{' -> '.join(_labels(pattern))} was proposed {len(tail) // length} times in a row{seq} "
                f"with the same result each time ({_shown(tail, length)})")
        if seen >= self.max_blocks:
            st["events"].append({"action": "stop", "turn": ctx.turn, "pattern": _labels(pattern)})
            warned = "after a warning, " if _loop_key(pattern) in st["warned"] else ""
            raise StopRun(
                StopReason.FAILED_TERMINAL,
                f"loop detected: {loop}; {warned}{len(stops)} repeat(s) were denied"
                f"{'' if all(s.ours for s in stops) else ' or answered without running'} and the "
                "model proposed it again, so the run was stopped before spending its budget",
                error={"kind": "loop_detected", "pattern": _labels(pattern), "blocked": blocked,
                       "executed_in_loop": ran})
        st["denied"].add(call.id)
        st["events"].append({"action": "block", "turn": ctx.turn, "pattern": _labels(pattern)})
        return Deny(f"loop detected: {loop}; it was not run again. Do not repeat it: use the "
                    "result you have, change the arguments or the approach, or give your final "
                    "answer. Repeating it again ends the run.")

    def detections(self, ctx: RunContext) -> list[dict[str, Any]]:
        """What it did in the run of ``ctx``, in order: ``{"action": "warn" | "block" | "stop",
        "turn": model call number, "pattern": ["name {args}", ...]}``."""
        return list(ctx.state(self).get("events", ()))

    def __repr__(self) -> str:
        opts = ("window", "max_pattern", "repeats", "max_blocks", "same_results")
        return f"LoopDetection({', '.join(f'{k}={getattr(self, k)!r}' for k in opts)})"
