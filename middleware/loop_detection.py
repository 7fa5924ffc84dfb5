"""Loop detection: warn, then block, then stop a model that repeats the same tool calls.

Sources: DESIGN.md §4; seed 000 §5.4 (octos ``loop_detect.rs``: a window of 12 call signatures,
patterns of length 1-3 repeated 3 times); case B22 (false positives versus a real loop).

* **Call identity**: tool name + arguments as canonical JSON (sorted keys, compact), so re-ordered
  keys do not hide a repeat; arguments that were not valid JSON count by their raw text.
* **Result identity**: ``is_error`` + the result's text (hashed).
* **Loop**: the executed calls (the last ``window``) end with a pattern of 1-``max_pattern`` calls
  repeated in a row with the same calls *and the same results* each time. Polling that makes
  progress (same call, new result) is not a loop, nor is a batch that repeats one shape with other
  arguments (B22 ``fp_*``).

Escalation, per loop (a pattern, whichever of its calls comes first):

1. **warn** — once the executed calls end with ``repeats - 1`` repetitions, the next model call
   gets a runtime notice, a user message appended to ``ctx.messages``;
2. **block** — a proposal that would complete the ``repeats``-th repetition gets ``Deny``: it does
   not run, and the model sees an error tool result saying why and what to do instead;
3. **stop** — once the model has seen ``max_blocks`` such denials, the next such proposal ends the
   run FAILED_TERMINAL, detail ``"loop detected: ..."``, ``error={"kind": "loop_detected", ...}``.

Defaults on B22 ``tp_same_call_same_result``: 2 identical runs, the warning, the 3rd proposal
denied, the 4th stops the run. A poll that returns the same status twice in a row is treated the
same way: include progress in such results, or raise ``repeats``.

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
from typing import TYPE_CHECKING, Any, NamedTuple

from fsm_agent import Deny, Middleware, Ordering, RunContext, StopReason, StopRun
from fsm_agent.types import ToolResultMessage, ToolUseBlock, UserMessage

if TYPE_CHECKING:  # the contract's type aliases; ``fsm_agent`` does not re-export them
    from fsm_agent.middleware import ToolCallNext, ToolDecision

__all__ = ["NOTICE_PREFIX", "LoopDetection", "call_identity", "find_repetition"]

NOTICE_PREFIX = "[runtime notice: loop detection]"
"""First words of the warning message."""


class _Step(NamedTuple):
    call: str
    """Call identity (:func:`call_identity`)."""
    result: str | None
    """Result identity, or ``None`` for a proposal that has not run."""
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


def _step(call: ToolUseBlock, result: ToolResultMessage | None = None) -> _Step:
    if result is None:
        return _Step(call_identity(call), None, f"{call.name} {_args(call)[:200]}", "")
    digest = hashlib.sha256(f"{int(result.is_error)}:{result.text}".encode()).hexdigest()[:32]
    return _Step(call_identity(call), digest, f"{call.name} {_args(call)[:200]}", result.text[:120])


def find_repetition(steps: Sequence[tuple[str, str | None]], *, repeats: int,
                    max_pattern: int = 3, same_results: bool = True) -> int | None:
    """Length of the shortest pattern (1..``max_pattern``) that ``steps`` end with, ``repeats``
    times in a row, or ``None``.

    ``steps``: ``(call identity, result identity or None)``, oldest first. Two steps match when the
    calls are equal and (with ``same_results``) the results are equal or one is ``None`` (not run).
    """
    for length in range(1, max_pattern + 1):
        n = length * repeats
        tail = steps[-n:]
        if len(steps) >= n and all(_match(tail[i], tail[i + length], same_results)
                                   for i in range(n - length)):
            return length
    return None


def _match(a: tuple[str, str | None], b: tuple[str, str | None], same_results: bool) -> bool:
    return a[0] == b[0] and (not same_results or a[1] is None or b[1] is None or a[1] == b[1])


def _loop_key(steps: Sequence[_Step]) -> tuple[str, ...]:
    """The pattern up to rotation: A,B and B,A are one loop."""
    p = tuple(s.call for s in steps)
    return min(p[i:] + p[:i] for i in range(len(p)))


class LoopDetection(Middleware):
    """MidTurn middleware that warns, blocks and finally stops repeated tool calls (module doc).

    Args:
        window: executed calls remembered (seed 000: 12).
        max_pattern: longest pattern looked for, in calls (seed 000: 3).
        repeats: repetitions that make a loop (seed 000, B22: 3); the warning comes one earlier.
        max_blocks: denials of one loop the model may see before the next ends the run (1).
        same_results: a repeat counts only when its results were identical too (B22; True).

    State is per run (``ctx.state(self)``); :meth:`detections` lists what it did. Innermost: its
    ``on_tool_call`` runs after policy middleware (DESIGN §4: policy → loop detection → execute)
    and its ``wrap_tool_call`` sees the tool's own result. The calls of one model turn are recorded
    in proposal order, whatever order their parallel executions finish in.

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

    def _state(self, ctx: RunContext) -> dict[str, Any]:
        st = ctx.state(self)
        if not st:  # history: executed _Steps; done: (seq, _Step) of this turn; order: id -> seqs
            st.update(history=[], done=[], order={}, seq=0, warned=set(), blocked={}, events=[], seen=set())
        return st

    def _flush(self, st: dict[str, Any]) -> list[_Step]:
        """Move finished calls into the history, in proposal order; return the history."""
        history: list[_Step] = st["history"]
        if st["done"]:
            history.extend(step for _, step in sorted(st["done"], key=lambda d: d[0]))
            del history[: -self.window]
            st["done"].clear()
        return history

    def _find(self, steps: Sequence[_Step], repeats: int) -> int | None:
        return find_repetition([(s.call, s.result) for s in steps], repeats=repeats,
                               max_pattern=self.max_pattern, same_results=self.same_results)

    # -- hooks ------------------------------------------------------------------------------
    def _unexecuted(self, ctx: RunContext, st: dict[str, Any]) -> None:
        """Record the last turn's calls that another middleware answered without running them (a
        policy denial, a response): the same denied call proposed again and again is a loop too."""
        last = ctx.last_response
        if last is None or not last.tool_calls:
            return
        results = {m.tool_call_id: m for m in ctx.transcript[-len(last.tool_calls) - 1:]
                   if isinstance(m, ToolResultMessage)}
        for call in last.tool_calls:
            if call.id in st["seen"] or call.id not in results:
                continue
            st["seen"].add(call.id)
            st["seq"] += 1
            st["done"].append((st["seq"], _step(call, results[call.id])))

    def pre_turn(self, ctx: RunContext) -> None:
        st = self._state(ctx)
        self._unexecuted(ctx, st)
        history = self._flush(st)
        st["order"].clear()
        stuck = self._find(history, self.repeats + self.max_blocks)
        if stuck is not None:  # only calls others denied can get here: ours are blocked before
            last = history[-stuck:]
            st["events"].append({"action": "stop", "turn": ctx.turn + 1, "pattern": _labels(last)})
            raise StopRun(
                StopReason.FAILED_TERMINAL,
                f"loop detected: {' -> '.join(_labels(last))} was proposed {self.repeats + self.max_blocks} times "
                f"in a row with the same result each time ({'; '.join(repr(s.preview) for s in last)}), so the run "
                "was stopped before spending its budget",
                error={"kind": "loop_detected", "pattern": _labels(last), "blocked": 0,
                       "executed_in_loop": 0})
        length = self._find(history, self.repeats - 1)
        if length is None or _loop_key(history[-length:]) in st["warned"]:
            return
        last = history[-length:]
        st["warned"].add(_loop_key(last))
        st["events"].append({"action": "warn", "turn": ctx.turn + 1, "pattern": _labels(last)})
        what = (f"called {last[0].label}" if length == 1
                else f"repeated the sequence {' -> '.join(_labels(last))}")
        ctx.messages.append(UserMessage(
            f"{NOTICE_PREFIX} You {what} {self.repeats - 1} times in a row and got the same "
            f"result every time ({'; '.join(repr(s.preview) for s in last)}). Repeating it will "
            "not change the result and will be blocked. Use the results you already have, try a "
            "different approach, or give your final answer."))

    def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> ToolDecision | None:
        st = self._state(ctx)
        history = self._flush(st)
        me = _step(call)
        length = self._find([*history[-(self.window - 1):], me], self.repeats)
        if length is None:
            st["seq"] += 1
            st["order"].setdefault(call.id, []).append(st["seq"])
            return None
        pattern = [*history[len(history) - length + 1:], me]
        key = _loop_key(pattern)
        count, blocked_turn = st["blocked"].get(key, (0, -1))
        shown = "; ".join(repr(s.preview) for s in history[-length:] if s.preview) or "no output"
        seq = " (as a sequence)" if length > 1 else ""
        loop = (f"{' -> '.join(_labels(pattern))} already ran {self.repeats - 1} times in a row"
                f"{seq} with the same result each time ({shown})")
        if count >= self.max_blocks and (count == 0 or blocked_turn < ctx.turn):
            st["events"].append({"action": "stop", "turn": ctx.turn, "pattern": _labels(pattern)})
            warned = "after a warning, " if key in st["warned"] else ""
            raise StopRun(
                StopReason.FAILED_TERMINAL,
                f"loop detected: {loop}; {warned}{count} repeat(s) were denied and the model "
                "proposed it again, so the run was stopped before spending its budget",
                error={"kind": "loop_detected", "pattern": _labels(pattern), "blocked": count,
                       "executed_in_loop": self.repeats * length - 1})
        if blocked_turn < ctx.turn:  # several denials in one model turn count once
            st["blocked"][key] = (count + 1, ctx.turn)
        st["seen"].add(call.id)
        st["events"].append({"action": "block", "turn": ctx.turn, "pattern": _labels(pattern)})
        return Deny(f"loop detected: {loop}; it was not run again. Do not repeat it: use the "
                    "result you have, change the arguments or the approach, or give your final "
                    "answer. Repeating it again ends the run.")

    async def wrap_tool_call(self, call: ToolUseBlock, call_next: ToolCallNext,
                             ctx: RunContext) -> ToolResultMessage:
        result = await call_next(call)
        st = self._state(ctx)
        st["seen"].add(call.id)
        pending = st["order"].get(call.id)
        if pending:
            seq = pending.pop(0)
        else:  # not seen proposed by this middleware (e.g. run after an approval on resume)
            st["seq"] += 1
            seq = st["seq"]
        st["done"].append((seq, _step(call, result)))
        return result

    def detections(self, ctx: RunContext) -> list[dict[str, Any]]:
        """What it did in the run of ``ctx``, in order: ``{"action": "warn" | "block" | "stop",
        "turn": model call number, "pattern": ["name {args}", ...]}``."""
        return list(self._state(ctx)["events"])

    def __repr__(self) -> str:
        opts = ("window", "max_pattern", "repeats", "max_blocks", "same_results")
        return f"LoopDetection({', '.join(f'{k}={getattr(self, k)!r}' for k in opts)})"


def _labels(steps: Sequence[_Step]) -> list[str]:
    return [s.label for s in steps]
