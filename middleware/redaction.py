"""Redaction: mask secrets and personal data before the model, in stream events, in the record and in logs.

Where masking happens (and nothing else is touched):

1. **Before the model** — ``pre_turn`` rewrites ``ctx.messages`` (the context of
   this call; ``ctx.transcript`` is never changed): text of system, user and
   assistant messages, tool results (also ``ToolResultBlock`` inside user
   messages), and the string values of tool-call arguments (``input``, nested
   dicts and lists, and ``raw_input``). Each distinct value becomes a stable
   placeholder ``[REDACTED:<kind>:<n>]``: the same value gets the same
   placeholder for the whole run (the mapping lives in ``ctx.state(self)``),
   and since the transcript is re-masked in order at every PreTurn, a resumed
   run with the same history numbers values the same way. The middleware is
   ``innermost`` and wrapped by LoopDetection and MessageRepair (both also
   innermost), so its ``pre_turn`` runs after every other one and masks what
   they added too (LoopDetection's notice quotes tool results); MessageRepair thus
   trims before masking (a placeholder, 18-30 characters, may outgrow its original).
2. **Stream events** — ``on_model_event`` masks what observers (the command line's
   printer, the server's live SSE deltas, any observer) see: text / thinking / refusal /
   tool-argument deltas, ``ToolCallEnd.call``, ``MessageComplete.full_response`` and
   ``ErrorEvent.message`` (a provider error may echo a key). A value split over several deltas is
   masked too: each block's deltas (text, thinking, tool-call arguments; the refusal) go through
   a streaming masker (:class:`StreamMasker`) that emits at once all text no continuation could
   change and holds back only what could still become a match: for a literal, the longest
   suffix that is a proper prefix of it; for a pattern, text from where the pattern, partially
   matched (the ``regex`` package's partial matching), could still match or extend its match. The
   held text comes out, masked, just before the event that ends its block (``ContentBlockEnd``,
   ``ToolCallEnd``, ``MessageComplete``, ``ErrorEvent``), so the deltas of a block add up to the
   block masked whole. What that costs (characters and milliseconds held) is in
   ``docs/redaction.md``. Thinking deltas, and the thinking blocks of ``MessageComplete``, are
   masked here although thinking blocks are not masked before the model.
3. **Traces** — ``mask_for_telemetry`` masks what OpenTelemetry content capture puts on spans
   (:mod:`fsm_agent.otel`: message content, tool arguments and results, stop details), with
   this run's placeholder for a value the model already saw masked and ``[REDACTED:<kind>]`` for
   any other (it never adds placeholders: the run is not changed by being traced).
4. **Logs** — :class:`RedactionFilter` (``Redaction(...).log_filter()``), a
   ``logging.Filter`` for handlers: it masks the formatted message, the
   traceback text and the stack info with the same rules, as ``[REDACTED:<kind>]``.
5. **Tool arguments, restored** — with ``restore_in_tool_args=True`` (every tool)
   or a collection of tool names, ``wrap_tool_call`` swaps this run's
   placeholders in the call's arguments back to the originals for the tool's
   execution only; the transcript keeps the model's call with placeholders.
   The tool's result goes into the transcript as the tool returned it and is
   masked again at the next PreTurn, before the model sees it.
6. **The answer of record** — ``wrap_model_call`` masks the model's response before the turn goes on
   with it (``mask_record=True``, the default): text blocks, the refusal, tool calls' arguments
   (``input`` and ``raw_input``) and thinking blocks without a signature, redacted data or protocol
   data (signed thinking is kept: the provider checks it when it is sent back; it was masked live).
   So the transcript, the session log's ``message`` events (which the server's SSE stream sends),
   ``RunResult.output`` and the tools get placeholders for a value the model wrote itself. What the
   engine records of a cut stream (a failed call's ``stop.partial``, an interrupted answer kept in the
   transcript) is the stream as the filters showed it: masked by ``on_model_event``. A resumed run
   (new state) re-masks the transcript and counts the placeholders already in it as given, so their
   numbers are never given to another value (their originals, never in any message, are not known
   any more: a tool gets such a placeholder as it is).

Not covered: images, audio, files and ``UserImageMessage`` (binary); signed
thinking blocks in the record (their text is signed by Anthropic) and, before the model,
thinking blocks at all; ``ExtensionBlock`` data (sent back verbatim to its protocol); citations of
text blocks; numbers (not strings) in tool arguments; tool definitions; the user's messages and the
tools' results in the transcript and the store (they are recorded as given and masked before the
model); ``MessageResponse.extra`` (a provider's extra choices); a provider error's message in the
stop's detail and error; observer events other than model stream events (``ToolFinished.result``
holds what the tool returned); AWS secret keys and other unlabelled high-entropy strings; phone
numbers without ``+`` in formats other than ``(555) 123-4567`` / ``555-123-4567``.
A placeholder typed by the user themselves is treated as a placeholder.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

import regex
from attrs import evolve, field, frozen

from fsm_agent import ConfigurationError, Middleware, ModelCallNext, Ordering, RunContext
from fsm_agent.types import (AssistantMessage, ContentBlockEnd, ContentBlockStart, ErrorEvent, Message,
                             MessageComplete, MessageRequest, MessageResponse, MessageStart, RefusalDelta, StreamEvent, SystemMessage, TextBlock,
                             TextDelta, ThinkingBlock, ThinkingDelta, ToolCallArgumentsDelta, ToolCallEnd,
                             ToolResultBlock, ToolResultMessage, ToolUseBlock, UserMessage)

__all__ = ["DEFAULT_RULES", "PLACEHOLDER", "STREAM_CONTEXT", "Redaction", "RedactionFilter", "RedactionRule",
           "StreamMasker", "iban_valid", "luhn_valid"]

PLACEHOLDER = re.compile(r"\[REDACTED:([a-z0-9_]+):(\d+)\]")
"""A run's placeholder: ``[REDACTED:<kind>:<n>]`` (kind in ``[a-z0-9_]``, ``n`` from 1 per kind)."""
_KIND = re.compile(r"^[a-z0-9_]{1,40}$")
ToolCallNext = Callable[[ToolUseBlock], Awaitable[ToolResultMessage]]


def _walk(value: Any, fn: Callable[[str], str]) -> Any:
    """``value`` (JSON-like: dicts, lists, scalars) with ``fn`` applied to every string in it."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _walk(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, fn) for v in value]
    return value


def _reserve(m: Message, counts: dict[str, int]) -> None:
    """Count the placeholders already written in ``m`` as given: a resumed run (new state) re-masks
    a transcript whose model-written values were recorded masked (their originals are in no message),
    and must not give their numbers to other values."""
    def see(text: str) -> str:
        if "[REDACTED:" in text:
            for kind, n in PLACEHOLDER.findall(text):
                if int(n) > counts.get(kind, 0):
                    counts[kind] = int(n)
        return text

    for b in getattr(m, "content", ()):
        if isinstance(b, TextBlock):
            see(b.text)
        elif isinstance(b, ThinkingBlock):
            see(b.thinking)
        elif isinstance(b, ToolUseBlock):
            _walk(b.input, see)
        elif isinstance(b, ToolResultBlock):
            for x in b.content:
                if isinstance(x, TextBlock):
                    see(x.text)


def _unsigned(b: ThinkingBlock) -> bool:
    """Whether a thinking block may be masked in the record: no signature, redacted data or protocol
    data that the provider checks or needs verbatim when the block is sent back."""
    return b.signature is None and b.redacted_data is None and b.provider_data is None


def luhn_valid(number: str) -> bool:
    """True when the digits of ``number`` (13 to 19 of them; other characters ignored) pass the Luhn check."""
    digits = [int(c) for c in number if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = sum(d if i % 2 == 0 else (d * 2 - 9 if d > 4 else d * 2) for i, d in enumerate(reversed(digits)))
    return total % 10 == 0


def iban_valid(iban: str) -> bool:
    """True when ``iban`` (spaces ignored) has 15 to 34 characters and passes the ISO 13616 mod-97 check."""
    s = iban.replace(" ", "").upper()
    if not 15 <= len(s) <= 34 or not s[:2].isalpha() or not s[2:4].isdigit() or not s.isalnum():
        return False
    return int("".join(str(int(c, 36)) for c in s[4:] + s[:4])) % 97 == 1


def _phone_digits_ok(value: str) -> bool:
    return 7 <= sum(c.isdigit() for c in value) <= 15


def _compile(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
    return pattern if isinstance(pattern, re.Pattern) else re.compile(pattern)


@frozen
class RedactionRule:
    """One kind of sensitive value: a pattern, the part of a match to mask, an optional check."""

    kind: str
    """Placeholder kind (``[a-z0-9_]``, at most 40 characters)."""
    pattern: re.Pattern[str] = field(converter=_compile)
    """What to find. A group named ``secret``, when present, is the only part masked (``Bearer <secret>``)."""
    validate: Callable[[str], bool] | None = None
    """Called with the masked part; a match is masked only when it returns True (Luhn, mod 97)."""
    hint: str | tuple[str, ...] | re.Pattern[str] | None = None
    """What every match contains: a substring, one of several substrings, or a pattern found with
    ``search``; text without it is skipped before the (slower) full pattern runs. ``None``: always search."""

    def __attrs_post_init__(self) -> None:
        if not _KIND.match(self.kind):
            raise ConfigurationError(f"redaction kind {self.kind!r} must match [a-z0-9_]{{1,40}}")


_TOKEN = r"[A-Za-z0-9\-._~+/]"
_DIGITS = re.compile(r"\d\d")
DEFAULT_RULES: tuple[RedactionRule, ...] = (
    RedactionRule("private_key", r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY-----[\s\S]*?(?:-----END[A-Z0-9 ]*PRIVATE KEY-----|\Z)",
                  hint="PRIVATE KEY-----"),
    RedactionRule("anthropic_key", r"\bsk-ant-[A-Za-z0-9_\-]{20,}", hint="sk-ant-"),
    RedactionRule("openai_key", r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{20,}", hint="sk-"),
    RedactionRule("aws_access_key", r"\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b", hint=("AKIA", "ASIA", "ABIA", "ACCA")),
    RedactionRule("github_token", r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b",
                  hint=("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_")),
    RedactionRule("bearer_token", rf"\b[Bb]earer\s+(?P<secret>(?={_TOKEN}*[0-9\-._~+/]){_TOKEN}{{16,}}=*)", hint="earer"),
    RedactionRule("email", r"(?<![\w.%+\-])[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}\b", hint="@"),
    RedactionRule("iban", r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b", iban_valid, _DIGITS),
    RedactionRule("credit_card", r"(?<![\w\-])(?:\d{13,19}|\d{4}([ \-])\d{4}\1\d{4}\1\d{4}(?:\1\d{3})?"
                                 r"|\d{4}([ \-])\d{6}\2\d{5})(?![\w\-])", luhn_valid, _DIGITS),
    RedactionRule("phone", r"(?<![\w+])(?:\+\d{1,3}[ .\-]?(?:\(\d{1,4}\)[ .\-]?)?\d{1,4}(?:[ .\-]?\d{2,4}){1,4}"
                           r"|\(\d{3}\)[ .\-]?\d{3}[ .\-]\d{4}|\d{3}[.\-]\d{3}[.\-]\d{4})(?![\w])", _phone_digits_ok,
                  _DIGITS),
)
"""Built-in rules, in the order they are applied (more specific first: keys before ``sk-``, IBANs and cards
before phone numbers)."""


class _Masker:
    """Applies rules and literals to text; ``assign(kind, value) -> placeholder`` names each value.

    Hot path (every stream delta): a rule's hint is checked inline (substring ``in`` is a C scan),
    then one ``search``; the replacement closure is built only when a rule matched.
    """

    __slots__ = ("_plan", "rules")

    def __init__(self, rules: tuple[RedactionRule, ...]) -> None:
        self.rules = rules
        self._plan = tuple((r, (r.hint,) if isinstance(r.hint, str) else r.hint if isinstance(r.hint, tuple) else (),
                            r.hint if isinstance(r.hint, re.Pattern) else None) for r in rules)

    def mask(self, text: str, assign: Callable[[str, str], str]) -> str:
        for rule, substrings, gate in self._plan:
            if substrings:
                for h in substrings:
                    if h in text:
                        break
                else:
                    continue
            elif gate is not None and gate.search(text) is None:
                continue
            if rule.pattern.search(text) is None:
                continue
            text = rule.pattern.sub(_replacer(rule, assign), text)
        return text


def _replacer(rule: RedactionRule, assign: Callable[[str, str], str]) -> Callable[[re.Match[str]], str]:
    group: str | int = "secret" if "secret" in rule.pattern.groupindex else 0

    def repl(m: re.Match[str]) -> str:
        value = m.group(group)
        if rule.validate is not None and not rule.validate(value):
            return m.group(0)
        whole, at = m.group(0), m.start()
        return whole[:m.start(group) - at] + assign(rule.kind, value) + whole[m.end(group) - at:]

    return repl


STREAM_CONTEXT = 256
"""Characters of already released text a streamed block keeps for the rules' lookbehinds, ``\\b`` and
``^`` (a rule's lookbehind that looks further back than this is not honoured while streaming)."""


def _touching(pattern: re.Pattern[str]) -> Any:
    """``pattern`` made never to match, so that ``search(text, pos, partial=True)`` finds the first start
    from which the pattern's matching reads to the end of ``text`` (where more text could still change
    whether, and how far, it matches); ``regex`` otherwise prefers any full match to a partial one."""
    src = pattern.pattern
    if not isinstance(src, str):  # pragma: no cover - RedactionRule compiles str patterns only
        raise ConfigurationError("redaction patterns must be str patterns")
    nl = "\n" if pattern.flags & re.VERBOSE else ""  # a trailing comment must not swallow the ")"
    try:
        return regex.compile(f"(?:{src}{nl})(?!)", pattern.flags)
    except regex.error as exc:
        raise ConfigurationError(f"redaction pattern {src!r} cannot be matched while streaming ({exc}); rewrite it "
                                 "in syntax the `regex` package accepts, or pass mask_events=False") from exc


class _Stage:
    """One rule applied to one stream of text as ``pattern.sub`` would apply it to the whole text,
    releasing each character as soon as no continuation of the stream can change how it is masked."""

    __slots__ = ("buf", "pattern", "pos", "repl", "touch")

    def __init__(self, pattern: re.Pattern[str], touch: Any, repl: Callable[[re.Match[str]], str]) -> None:
        self.pattern, self.touch, self.repl = pattern, touch, repl
        self.buf = ""  # context (already released) + held text
        self.pos = 0  # where the held text starts in buf

    def feed(self, text: str, final: bool) -> str:
        buf = self.buf + text if text else self.buf
        pos, end = self.pos, len(buf)
        out: list[str] = []
        touch = -1
        while pos < end:
            if final:
                hold = end
            else:
                if touch < pos:
                    t = self.touch.search(buf, pos, partial=True)
                    touch = end if t is None else t.start()
                hold = touch
            m = self.pattern.search(buf, pos)
            if m is None or m.start() >= hold or (not final and m.end() >= end):
                # nothing decided starts before `hold`: release up to it, keep the rest
                stop = hold if m is None else min(hold, m.start())
                out.append(buf[pos:stop])
                pos = stop
                break
            out.append(buf[pos:m.start()])
            out.append(self.repl(m))
            if m.end() > m.start():
                pos = m.end()
            else:  # an empty match: keep the next character as it is (as re.sub moves on past it)
                out.append(buf[m.end():m.end() + 1])
                pos = m.end() + 1
        if pos > 2 * STREAM_CONTEXT:
            cut = pos - STREAM_CONTEXT
            buf, pos = buf[cut:], pos - cut
        self.buf, self.pos = buf, pos
        return "".join(out)

    @property
    def held(self) -> int:
        return len(self.buf) - self.pos


class StreamMasker:
    """Masks one stream of text (one content block) that arrives in pieces, so that the pieces it
    returns add up to the whole text masked at once, never show a value split over several pieces,
    and lag the input by as little as the rules need.

    ``feed(piece)`` returns the text that can be released now (``""`` while everything is held);
    ``flush()`` releases the rest at the end of the text. Each rule is a stage (the output of one is
    the input of the next, as in :meth:`RedactionFilter.mask`), and a stage holds back text from
    the first position where its pattern, matched partially, reaches the end of what has arrived:
    for a literal, the longest suffix that is a proper prefix of it; for ``\\d{13,19}``, a trailing
    run of digits; for the e-mail rule, a trailing word (it could be followed by ``@``). A match
    that ends exactly at the end of what has arrived is held as well (it could still grow).
    ``held`` is the number of characters held now.

    Args:
        rules: the rules, in the order they apply.
        assign: ``assign(kind, value) -> placeholder`` (see :class:`Redaction`).
        touching: the rules' never-matching twins (built with the rules; internal).
    """

    __slots__ = ("_stages",)

    def __init__(self, rules: tuple[RedactionRule, ...], assign: Callable[[str, str], str],
                 touching: tuple[Any, ...] | None = None) -> None:
        touch = touching if touching is not None else tuple(_touching(r.pattern) for r in rules)
        self._stages = tuple(_Stage(r.pattern, t, _replacer(r, assign)) for r, t in zip(rules, touch))

    def feed(self, text: str) -> str:
        """The masked text that can be released after ``text`` arrived."""
        for st in self._stages:
            text = st.feed(text, False)
            if not text:  # nothing reaches the next stages this time
                break
        return text

    def flush(self) -> str:
        """The rest, masked (the text has ended)."""
        text = ""
        for st in self._stages:
            text = st.feed(text, True)
        return text

    @property
    def held(self) -> int:
        """Characters held back now (across the stages; a placeholder counts as its length)."""
        return sum(st.held for st in self._stages)


def _build_rules(kinds: Collection[str] | None, patterns: Mapping[str, str | re.Pattern[str]],
                 literals: Iterable[str] | Mapping[str, str]) -> tuple[RedactionRule, ...]:
    known = {r.kind for r in DEFAULT_RULES}
    if kinds is not None and set(kinds) - known:
        raise ConfigurationError(f"unknown redaction kinds {sorted(set(kinds) - known)}; known: {sorted(known)}")
    lits = dict(literals) if isinstance(literals, Mapping) else {v: "secret" for v in literals}
    by_kind: dict[str, list[str]] = {}
    for value in filter(None, lits):
        by_kind.setdefault(lits[value], []).append(value)
    # literals first: an exact value the user named wins over a pattern that would cover part of it
    rules = [RedactionRule(kind, "|".join(re.escape(v) for v in sorted(vals, key=len, reverse=True)), hint=tuple(vals))
             for kind, vals in by_kind.items()]
    rules += [r for r in DEFAULT_RULES if kinds is None or r.kind in kinds]
    rules += [RedactionRule(kind, p) for kind, p in patterns.items()]
    return tuple(rules)


class RedactionFilter(logging.Filter):
    """A ``logging.Filter`` that masks log records with redaction rules (as ``[REDACTED:<kind>]``).

    Attach it to **handlers** (``handler.addFilter(f)``): a logger's own filters do
    not see records propagated from child loggers. It rewrites ``record.msg`` to the
    masked, formatted message (``record.args`` becomes ``None``), and masks the
    traceback (``exc_text``) and ``stack_info``. It never drops a record.
    """

    def __init__(self, rules: Iterable[RedactionRule] = DEFAULT_RULES, name: str = "") -> None:
        super().__init__(name)
        self._masker = _Masker(tuple(rules))

    def __repr__(self) -> str:
        return f"RedactionFilter(kinds={[r.kind for r in self._masker.rules]})"

    def mask(self, text: str) -> str:
        return self._masker.mask(text, lambda kind, _value: f"[REDACTED:{kind}]")

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a badly formatted record is logging's problem, not ours
            return True
        record.msg, record.args = self.mask(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.mask(record.exc_text)
        if record.stack_info:
            record.stack_info = self.mask(record.stack_info)
        return True


class Redaction(Middleware):
    """Mask secrets and personal data before the model, in stream events, in the answer of record and in
    logs (see the module doc).

    Args:
        kinds: built-in kinds to use (``None``: all of :data:`DEFAULT_RULES`).
        patterns: extra ``{kind: regex}``; a group named ``secret`` limits what is masked.
        literals: exact values to mask, as an iterable (kind ``secret``) or ``{value: kind}``.
        restore_in_tool_args: ``True`` to put originals back into every tool's arguments, or the
            names of the tools allowed to receive them; ``False`` (default): tools get placeholders.
        mask_events: mask model stream events before observers see them (default ``True``).
        mask_record: mask the model's answer before it is recorded (default ``True``): the
            transcript, the session log, ``RunResult.output``, a failed stream's ``stop.partial``
            (see :meth:`wrap_model_call`). ``False``: the record keeps what the model wrote.

    Raises:
        ConfigurationError: an unknown built-in kind, or a kind outside ``[a-z0-9_]{1,40}``.

    State (``ctx.state(self)``): ``originals`` ``{placeholder: value}``, ``placeholders``
    ``{value: placeholder}``, ``counts`` ``{kind: n}``, ``restored`` (one record per tool call
    that received originals: ``{"call_id", "tool", "placeholders"}``).
    """

    name = "redaction"

    ordering = Ordering(position="innermost", wrapped_by=("loop_detection", "repair"))

    def __init__(
        self,
        *,
        kinds: Collection[str] | None = None,
        patterns: Mapping[str, str | re.Pattern[str]] | None = None,
        literals: Iterable[str] | Mapping[str, str] = (),
        restore_in_tool_args: bool | Collection[str] = False,
        mask_events: bool = True,
        mask_record: bool = True,
    ) -> None:
        literals = dict(literals) if isinstance(literals, Mapping) else list(literals)
        self.kinds = None if kinds is None else tuple(kinds)
        self.patterns = dict(patterns or {})
        self._literal_count = len(literals)
        self.rules = _build_rules(self.kinds, self.patterns, literals)
        self._masker = _Masker(self.rules)
        r = (restore_in_tool_args,) if isinstance(restore_in_tool_args, str) else restore_in_tool_args
        self.restore_in_tool_args: bool | frozenset[str] = r if isinstance(r, bool) else frozenset(r)
        self.mask_events = mask_events
        self.mask_record = mask_record
        self._touching = tuple(_touching(r.pattern) for r in self.rules) if mask_events else ()

    def __repr__(self) -> str:
        shown = r if isinstance(r := self.restore_in_tool_args, bool) else sorted(r)
        kinds = "all" if self.kinds is None else list(self.kinds)
        return (f"Redaction(kinds={kinds}, patterns={sorted(self.patterns)}, literals={self._literal_count}, "
                f"restore_in_tool_args={shown}, mask_events={self.mask_events}, mask_record={self.mask_record})")

    def log_filter(self) -> RedactionFilter:
        """A logging filter with this middleware's rules and literals."""
        return RedactionFilter(self.rules)

    # -- masking -------------------------------------------------------------------
    def _assigner(self, state: dict[str, Any]) -> Callable[[str, str], str]:
        cached: Callable[[str, str], str] | None = state.get("_assign")
        if cached is not None:
            return cached
        placeholders: dict[str, str] = state.setdefault("placeholders", {})
        originals: dict[str, str] = state.setdefault("originals", {})
        counts: dict[str, int] = state.setdefault("counts", {})

        def assign(kind: str, value: str) -> str:
            ph = placeholders.get(value)
            if ph is None:
                counts[kind] = counts.get(kind, 0) + 1
                ph = f"[REDACTED:{kind}:{counts[kind]}]"
                placeholders[value] = ph
                originals[ph] = value
            return ph

        state["_assign"] = assign
        return assign

    def mask_text(self, text: str, ctx: RunContext) -> str:
        """``text`` with every match replaced by this run's placeholder for it."""
        return self._masker.mask(text, self._assigner(ctx.state(self)))

    def mask_for_telemetry(self, text: str, ctx: RunContext | None = None) -> str:
        """``text`` as telemetry may show it (:mod:`fsm_agent.otel` calls this on every string it puts
        on a span with content capture on): each match becomes this run's placeholder for it when the
        model saw one, else ``[REDACTED:<kind>]``. Reads the run's state; never changes it."""
        known: dict[str, str] = {}
        if ctx is not None:
            known = ctx.state(self).get("placeholders") or {}
        return self._masker.mask(text, lambda kind, value: known.get(value) or f"[REDACTED:{kind}]")

    def _block(self, b: Any, assign: Callable[[str, str], str],
               thinking: bool | Callable[[ThinkingBlock], bool] = False) -> Any:
        if isinstance(b, ThinkingBlock) and (thinking(b) if callable(thinking) else thinking):
            # the observers' copy; of the record, only thinking no provider checks on echo
            text = self._masker.mask(b.thinking, assign)
            return b if text == b.thinking else evolve(b, thinking=text)
        if isinstance(b, TextBlock):
            text = self._masker.mask(b.text, assign)
            return b if text == b.text else evolve(b, text=text)
        if isinstance(b, ToolUseBlock):
            new_input = _walk(b.input, lambda t: self._masker.mask(t, assign))
            raw = None if b.raw_input is None else self._masker.mask(b.raw_input, assign)
            return b if new_input == b.input and raw == b.raw_input else evolve(b, input=new_input, raw_input=raw)
        if isinstance(b, ToolResultBlock):
            content = tuple(self._block(x, assign) for x in b.content)
            return b if content == b.content else evolve(b, content=content)
        return b  # images, audio, files, thinking, extensions: not covered (module doc)

    def _message(self, m: Message, assign: Callable[[str, str], str],
                 thinking: bool | Callable[[ThinkingBlock], bool] = False) -> Message:
        if not isinstance(m, (SystemMessage, UserMessage, AssistantMessage, ToolResultMessage)):
            return m  # UserImageMessage: not covered
        content = tuple(self._block(b, assign, thinking) for b in m.content)
        return m if content == m.content else evolve(m, content=content)

    # -- hooks ---------------------------------------------------------------------
    def pre_turn(self, ctx: RunContext) -> None:
        """Replace ``ctx.messages`` with masked copies (the transcript is left as it is)."""
        state = ctx.state(self)
        assign = self._assigner(state)
        cache: dict[int, tuple[Message, Message]] = state.setdefault("cache", {})
        out: list[Message] = []
        for m in ctx.messages:
            hit = cache.get(id(m))
            if hit is None or hit[0] is not m:
                _reserve(m, state.setdefault("counts", {}))
                hit = (m, self._message(m, assign))
                cache[id(m)] = hit
            out.append(hit[1])
        ctx.messages = out

    def on_model_event(self, event: StreamEvent, ctx: RunContext) -> StreamEvent | tuple[StreamEvent, ...] | None:
        """Mask one stream event for observers (the response the runtime keeps is masked by
        :meth:`wrap_model_call`; what it keeps of a cut stream is what this passed on).

        A delta comes back with only the text that can be released (``None`` while all of it is
        held); the event that ends a block (``ContentBlockEnd``, ``ToolCallEnd``) or the stream
        (``MessageComplete``, ``ErrorEvent``) comes back after the deltas that release what was held."""
        if not self.mask_events:
            return event
        state = ctx.state(self)
        streams: dict[tuple[str, int], StreamMasker] = state.setdefault("_streams", {})
        if isinstance(event, (TextDelta, ThinkingDelta, RefusalDelta)):
            index = -1 if isinstance(event, RefusalDelta) else event.index
            text = self._stream(streams, event.TAG, index, state).feed(event.text)
            return event if text == event.text else evolve(event, text=text) if text else None
        if isinstance(event, ToolCallArgumentsDelta):
            args = self._stream(streams, event.TAG, event.index, state).feed(event.arguments)
            return event if args == event.arguments else evolve(event, arguments=args) if args else None
        assign = self._assigner(state)
        if isinstance(event, ContentBlockEnd):
            return self._flushed(streams, event.index, event)
        if isinstance(event, ToolCallEnd):
            call = self._block(event.call, assign)
            return self._flushed(streams, event.index, event if call is event.call else evolve(event, call=call))
        if isinstance(event, (ContentBlockStart, MessageStart)):  # a new block, or a new stream (a retry)
            for key in [k for k in streams if isinstance(event, MessageStart) or k[1] == event.index]:
                del streams[key]  # what a cut stream held is dropped, never released into the new one
            return event
        mask = self._masker.mask
        if isinstance(event, MessageComplete):
            resp = event.full_response
            message = self._message(resp.message, assign, thinking=True)
            assert isinstance(message, AssistantMessage)  # _message keeps the message type
            refusal = None if resp.refusal is None else mask(resp.refusal, assign)
            unchanged = message is resp.message and refusal == resp.refusal
            return self._flushed(streams, None, event if unchanged else
                                 MessageComplete(evolve(resp, message=message, refusal=refusal)))
        if isinstance(event, ErrorEvent):
            msg = mask(event.message, assign)
            return self._flushed(streams, None, event if msg == event.message else evolve(event, message=msg))
        return event

    def _stream(self, streams: dict[tuple[str, int], StreamMasker], tag: str, index: int,
                state: dict[str, Any]) -> StreamMasker:
        masker = streams.get((tag, index))
        if masker is None:
            masker = streams[(tag, index)] = StreamMasker(self.rules, self._assigner(state), self._touching)
        return masker

    @staticmethod
    def _flushed(streams: dict[tuple[str, int], StreamMasker], index: int | None,
                 event: StreamEvent) -> StreamEvent | tuple[StreamEvent, ...]:
        """``event`` after the deltas releasing what the streams of block ``index`` (``None``: every
        stream, the refusal's too) still hold."""
        keys = [k for k in streams if index is None or k[1] == index]
        if not keys:
            return event
        out: list[StreamEvent] = []
        for tag, i in keys:
            text = streams.pop((tag, i)).flush()
            if not text:
                continue
            if tag == TextDelta.TAG:
                out.append(TextDelta(i, text))
            elif tag == ThinkingDelta.TAG:
                out.append(ThinkingDelta(i, text))
            elif tag == ToolCallArgumentsDelta.TAG:
                out.append(ToolCallArgumentsDelta(i, text))
            else:
                out.append(RefusalDelta(text))
        out.append(event)
        return tuple(out)

    async def wrap_model_call(self, request: MessageRequest, call_next: ModelCallNext, ctx: RunContext
                              ) -> MessageResponse:
        """Mask the answer of record: the response the turn goes on with (its message enters the
        transcript, the session log and ``RunResult.output``) gets this run's placeholders in its text
        blocks, its refusal and its tool calls' arguments (``input``, every string in it, and
        ``raw_input``), so that a secret the model writes (a value it was never sent) is recorded as
        it was streamed: masked. Thinking blocks are left as they are when the provider checks them on
        echo (a ``signature``, ``redacted_data`` or ``provider_data``); unsigned thinking is masked.
        Placeholders are numbered by first appearance in the run (the stream's masking, in the same
        order, already named the values), so a replay records the same text. A tool listed in
        ``restore_in_tool_args`` still gets the originals (:meth:`wrap_tool_call`)."""
        response = await call_next(request)
        if not self.mask_record:
            return response
        assign = self._assigner(ctx.state(self))
        message = self._message(response.message, assign, thinking=_unsigned)
        assert isinstance(message, AssistantMessage)  # _message keeps the message type
        refusal = None if response.refusal is None else self._masker.mask(response.refusal, assign)
        if message is response.message and refusal == response.refusal:
            return response
        return evolve(response, message=message, refusal=refusal)

    async def wrap_tool_call(self, call: ToolUseBlock, call_next: ToolCallNext, ctx: RunContext) -> ToolResultMessage:
        """Run the tool with this run's placeholders in its arguments swapped back to the originals,
        when configured for this tool; otherwise pass the call through unchanged."""
        allowed = self.restore_in_tool_args
        if not (allowed if isinstance(allowed, bool) else call.name in allowed):
            return await call_next(call)
        state = ctx.state(self)
        originals: dict[str, str] = state.get("originals", {})
        used: set[str] = set()

        def swap(m: re.Match[str]) -> str:
            original = originals.get(m.group(0))
            if original is None:  # not one of this run's placeholders: left as the model wrote it
                return m.group(0)
            used.add(m.group(0))
            return original

        new_input = _walk(call.input, lambda t: PLACEHOLDER.sub(swap, t) if "[REDACTED:" in t else t)
        if not used:
            return await call_next(call)
        state.setdefault("restored", []).append({"call_id": call.id, "tool": call.name, "placeholders": sorted(used)})
        return await call_next(evolve(call, input=new_input))
