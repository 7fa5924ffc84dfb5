"""Loop detection: warn, then block, then stop a model that repeats tool calls without progress.

**The engine detects loops without this plugin.** Every run has ``RunConfig.loop_detection``
(:class:`fsm_agent.LoopConfig`, seed 000 §5.4: a warning, then ``warn`` again, ``block`` or
``stop``; docs/loops.md). This plugin is the escalation for those who want more than one
fixed answer: warn, then block, then stop after ``max_blocks`` turns of denials, with denials by
other middleware and people counted. With it in the chain the engine's detection stands aside
(``handles_loops``), so the model is never warned twice. Both find loops with the same code,
:mod:`fsm_agent.loops` (identities, :func:`~fsm_agent.loops.find_pattern`); this module adds the
escalation.

Sources: DESIGN.md §4; seed 000 §5.4 (octos ``loop_detect.rs``); case B22 (false positives versus a
real loop); issue 8 item 4 (progress versus no progress; alternation through denials); issue 19
item 6 (a repeat is judged once its result is in: polling is not a loop).

Seed 000 §5.4.2 gives the numbers: a ring buffer of the last **12** call signatures (tool name +
arguments), patterns of length **1, 2 or 3**, and a loop is "the same pattern **3** times in a row"
(``[A, A, A]``, ``[A, B, A, B, A, B]``, ``[A, B, C, A, B, C, A, B, C]``). Its §5.4.3 only injects
a warning and leaves the end to the iteration limit; B22 and issue 8 ask for more (a repeat
intercepted, the run stopped rather than COMPLETED), hence the escalation below.

* **Call identity**: tool name + arguments as canonical JSON (sorted keys, compact), so re-ordered
  keys do not hide a repeat; arguments that were not valid JSON count by their raw text. The
  identity is the model's proposal as recorded in the transcript.
* **Result identity**: a hash of ``is_error`` + the result's content blocks as canonical JSON
  (what the model was shown; ``metadata`` is not part of it).
* **A repeat counts once its result is in.** A loop is the last calls (the window) ending with a
  pattern of 1-``max_pattern`` calls repeated ``repeats`` times in a row, the same calls *with the
  same results* in every repetition, every one of those results known. A proposal is never judged
  by guessing its result: a status poll that answered "running" twice runs a 3rd time (it may say
  "done"), and so do three identical calls proposed together in one response. A call repeated with
  new results each time (polling 10%, 45%, 90%) is progress, and so is a batch that repeats one
  shape with other arguments (B22 ``fp_*``). A call whose result flips between two values (on, off,
  on, off, on, off) is a pattern of length 2 with repeating results: no progress. A pattern of
  several calls counts only when each of its calls' results repeats too.
* **Denials are kept in the history.** A proposal this middleware denied stays in it as a call
  that did not run: it matches any result and counts as no repetition, so A, B, A, B, A, B,
  A(denied), B is still the same loop and the run stops there. The window holds ``window`` calls
  with a result; this middleware's own denials are kept besides them. A call that another
  middleware denied or answered never reaches this middleware's ``on_tool_call``; it is read from
  the transcript with the answer it got as its result, so the same denied call proposed again and
  again is a loop too.

Escalation, per loop:

1. **warn** — once ``repeats`` repetitions came back with the same results, the next model call
   gets a runtime notice, a user message appended to ``ctx.messages`` (once per loop);
2. **block** — a proposal that continues the loop gets ``Deny``: it does not run, and the model
   sees an error tool result saying why and what to do instead (other calls of the same response
   that continue it too are denied with it);
3. **stop** — once the model has seen denials of the loop from ``max_blocks`` model turns, its next
   proposal that continues the loop ends the run FAILED_TERMINAL, detail ``"loop detected: ..."``,
   ``error={"kind": "loop_detected", ...}``. Several denials in one model turn count once (the
   model had not seen any of them when it proposed them). A loop that this middleware never gets
   to block (another middleware or a person answers every proposal first) ends the run in PreTurn
   once the model has continued it, after the loop was known, in ``max(max_blocks, 1)`` turns.

Defaults on B22 ``tp_same_call_same_result``: 3 identical runs, the warning, the 4th proposal
denied, the 5th stops the run. (B22's expected file predates issue 19 and intercepts the 3rd
proposal, a guess at a result not yet known: the same guess that denied polls.) A poll that
returns the same status 3 times in a row is a loop by the same rule: include progress in such
results, or raise ``repeats``.

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

Cost: each call's identity is computed once (orjson, sorted keys) when its response is read, each
result's once when it arrives; a proposal whose call has fewer than ``repeats`` results in the
window is let through without looking for patterns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from fsm_agent import Deny, Middleware, Ordering, RunContext
from fsm_agent.errors import LoopStop
from fsm_agent.loops import NOTICE_PREFIX, call_identity, find_pattern, find_repetition, result_identity
from fsm_agent.types import AssistantMessage, ToolResultMessage, ToolUseBlock, UserImageMessage, UserMessage

__all__ = ["NOTICE_PREFIX", "LoopDetection", "call_identity", "find_repetition", "result_identity"]

_NOT_RUN_KEYS = ("denied_by", "responded_by")


class _Step(NamedTuple):
    call: str
    """Call identity (:func:`call_identity`)."""
    result: str | None
    """Result identity (:func:`result_identity`), or ``None`` while no result is known: a proposal
    this middleware denied (it never ran), or one of the current response that has not run yet."""
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


def _loop_key(steps: Sequence[_Step]) -> tuple[str, ...]:
    """The pattern up to rotation: A,B and B,A are one loop."""
    p = tuple(s.call for s in steps)
    return min(p[i:] + p[:i] for i in range(len(p)))


def _labels(steps: Sequence[_Step]) -> list[str]:
    return [s.label for s in steps]


def _shown(tail: Sequence[_Step], length: int) -> str:
    """The latest known result preview of each call of the pattern ``tail[:length]``, in order."""
    out = []
    for i in range(length):
        preview = next((s.preview for s in reversed(tail[i::length]) if s.result is not None), "")
        if preview:
            out.append(repr(preview))
    return "; ".join(out) or "no output"


class LoopDetection(Middleware):
    """MidTurn middleware that warns, blocks and finally stops repeated tool calls (module doc).

    Args:
        window: calls remembered, with their results (seed 000 §5.4.2: 12); this middleware's own
            denials are kept besides them.
        max_pattern: longest pattern looked for, in calls (seed 000 §5.4.2: 3).
        repeats: repetitions, each with its results in, that make a loop (seed 000 §5.4.2, B22: 3);
            the warning comes once they are in, the block at the next proposal in the loop.
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

    handles_loops = True
    """The engine's own loop detection (``RunConfig.loop_detection``) stands aside in a chain with this one."""

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
        the latest assistant message, with their identities), ``open`` (those without a result yet,
        by id), ``history`` (``_Step``s: the last ``window`` with a result, and this middleware's
        denials among them), ``denied`` (ids this middleware denied), ``warned`` (loop keys warned
        of), ``events``.
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
                opened = st["open"].pop(m.tool_call_id, None)
                if opened is not None:
                    history.append(self._step(opened[0], opened[1], st["turn"], m, st["denied"]))
            elif isinstance(m, AssistantMessage):
                st["turn"] += 1
                st["last"] = tuple((c, call_identity(c)) for c in m.tool_calls)
                st["open"] = {c.id: (c, ident) for c, ident in st["last"]}
            elif isinstance(m, (UserMessage, UserImageMessage)):  # new input: a fresh start
                history.clear()
        st["pos"] = len(transcript)
        if len(history) > self.window:
            self._trim(history)
        return st

    def _trim(self, history: list[_Step]) -> None:
        """Keep the last ``window`` steps with a result, and this middleware's denials after the
        oldest of them (a denial is no call that ran; it must not push the loop's repetitions out)."""
        kept = 0
        for i in range(len(history) - 1, -1, -1):
            if not history[i].ours:
                kept += 1
                if kept > self.window:
                    del history[: i + 1]
                    return

    def _step(self, call: ToolUseBlock, identity: str, turn: int, result: ToolResultMessage | None,
              denied: set[str]) -> _Step:
        label = f"{call.name} {identity[len(call.name) + 1:][:200]}"
        if result is None:
            return _Step(identity, None, turn, call.id in denied, False, label, "")
        md = result.metadata or {}
        ours = md.get("denied_by") == self.middleware_name or call.id in denied
        if ours:
            return _Step(identity, None, turn, True, False, label, "")
        ran = not any(md.get(k) for k in _NOT_RUN_KEYS) and md.get("decision") not in ("reject", "respond")
        return _Step(identity, result_identity(result), turn, False, ran, label, result.text[:120])

    def _match(self, steps: Sequence[_Step], repeats: int) -> tuple[int, list[_Step]] | None:
        found = find_pattern(steps, repeats, range(1, self.max_pattern + 1), self.same_results)
        if found is None:
            return None
        length, tail = found
        return length, list(steps[len(steps) - tail:])

    def _interceptions(self, tail: Sequence[_Step], length: int, before: int) -> list[_Step]:
        """The steps of ``tail`` (a pattern of ``length`` calls) proposed before model turn ``before``
        that did not run although the loop was already known: this middleware's denials, and a
        proposal another middleware or a person answered instead of running it."""
        known = [0] * length
        established = False
        out: list[_Step] = []
        m = len(tail)
        for i, s in enumerate(tail):
            if not established:
                if s.result is not None:
                    known[(m - 1 - i) % length] += 1
                    established = min(known) >= self.repeats
                if not s.ours:
                    continue
            if s.turn < before and (s.ours or not s.ran):
                out.append(s)
        return out

    # -- hooks ---------------------------------------------------------------------------------
    def pre_turn(self, ctx: RunContext) -> None:
        st = self._sync(ctx)
        history: list[_Step] = st["history"]
        found = self._match(history, self.repeats)
        if found is None:
            st["warned"].clear()  # the loop is broken: a new one gets its own warning
            return
        length, tail = found
        last = tail[:length]  # the pattern as it first came
        if not any(s.ours for s in tail):
            # a loop this middleware never got to block: another middleware or a person answered
            # its proposals after it was known; as many turns of that as of our own denials end it
            stops = self._interceptions(tail, length, st["turn"] + 1)
            if len({s.turn for s in stops}) >= max(self.max_blocks, 1):
                st["events"].append({"action": "stop", "turn": ctx.turn + 1, "pattern": _labels(last)})
                raise LoopStop(
                    f"loop detected: {' -> '.join(_labels(last))} was proposed {len(tail) // length} times in a "
                    f"row with the same result each time ({_shown(tail, length)}), so the run was stopped before "
                    "spending its budget",
                    pattern=_labels(last), blocked=0, executed_in_loop=sum(s.ran for s in tail))
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
        history: list[_Step] = st["history"]
        last: tuple[tuple[ToolUseBlock, str], ...] = st["last"]
        index = next((i for i, (c, _) in enumerate(last) if c.id == call.id), None)
        # the model's own proposal (as the transcript records it), or the call as given, alone
        proposed, identity = last[index] if index is not None else (call, call_identity(call))
        # a loop is judged on results: the call must already be in the history with a result
        # at least `repeats` times, or it continues no loop (the cheap test, first)
        if sum(1 for s in history if s.result is not None and s.call == identity) < self.repeats:
            return None
        turn = st["turn"]
        # earlier calls of this response have no result yet: they match any result, count as none
        earlier = [self._step(c, ident, turn, None, st["denied"]) for c, ident in last[:index or 0]]
        steps = [*history, *earlier, self._step(proposed, identity, turn, None, st["denied"])]
        found = self._match(steps, self.repeats)
        if found is None:
            return None
        length, tail = found
        pattern = tail[:length]  # as it first came
        # interceptions the model has seen: this middleware's denials, and a proposal of the known
        # loop that another middleware or a person answered instead of running it
        stops = self._interceptions(tail, length, turn)
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
            raise LoopStop(
                f"loop detected: {loop}; {warned}{len(stops)} repeat(s) were denied"
                f"{'' if all(s.ours for s in stops) else ' or answered without running'} and the "
                "model proposed it again, so the run was stopped before spending its budget",
                pattern=_labels(pattern), blocked=blocked, executed_in_loop=ran)
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
