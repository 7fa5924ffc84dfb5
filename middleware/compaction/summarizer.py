"""L2: one summarizer call made a record (:func:`summarize_l2`), every way the call can fail made
a :class:`CompactionFailed`; and the summarizers: the default one through the run's provider
(:class:`ProviderSummarizer`) and one that answers as a recorded session's did
(:func:`recorded_summarizer`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsm_agent import (
    MessageRequest,
    MessageResponse,
    OutputSchema,
    Provider,
    RunContext,
    StopRun,
    SystemMessage,
    ToolResultMessage,
    UserMessage,
    parse_output,
)
from fsm_agent.types import AssistantMessage, Message, count_message_tokens

from .essentials import _carry, _excerpts, _head, _kept_in
from .records import (
    Compacted,
    CompactionFailed,
    CompactionFailedEvent,
    CompactionOptions,
    CompactionRecord,
    Summarizer,
    SummarizerResult,
    _messages_sha,
    _sha,
)
from .summary import SUMMARY_SCHEMA, render_summary
from .view import _message_text, view_spans


# -- the summarizer's answer -------------------------------------------------------------------

_ERROR_START = re.compile(
    r"^\s*(?:\[error\]|error\s*(?::|-|\(|\d{3}\b|code\b|occurred|while|calling|from\b|response\b|status\b)"
    r"|(?:[\w.]+(?:error|exception))\s*:|exception\b|traceback\b|http\s*\d{3}\b|status(?: code)?\s*\d{3}\b"
    r"|i'?m sorry|i am sorry|sorry[,!.]|apologies|i (?:cannot|can't|can not|am unable|'m unable|am not able)"
    r"|as an ai\b|unable to\b|failed to (?:summari[sz]e|generate|produce))", re.I)
_NO_SUMMARY = re.compile(r"(?:could ?n[o']t|can ?n[o']t|unable to|failed to|not able to)\s+summari[sz]", re.I)
"""The summarizer saying it did not summarise: refused in every section, the failures included."""
_ERROR_ANYWHERE = re.compile(
    r"(?:could ?n[o']t|can ?n[o']t|unable to|failed to|not able to)\s+summari[sz]"  # "could not summarise"
    r"|traceback \(most recent call last\)|\berror code:?\s*\d{3}\b"
    r"|[{,]\s*['\"]error['\"]\s*:\s*[{'\"]", re.I)  # a serialized error object: {'error': {...}}


def _check_output(out: Any, schema: OutputSchema) -> dict[str, Any]:
    """The summarizer's output as a dict, or :class:`CompactionFailed` (invalid, empty, error text)."""
    if not isinstance(out, Mapping):
        raise CompactionFailed("invalid", f"the summarizer returned {type(out).__name__}, not an object")
    props = schema.schema.get("properties", {})
    missing = [k for k in schema.schema.get("required", ()) if k not in out]
    if missing:
        raise CompactionFailed("invalid", f"the summary lacks the section(s) {', '.join(missing)}")
    extra = [str(k)[:40] for k in out if k not in props]
    if extra:  # the schema allows no other keys (and a record stores the output as given)
        raise CompactionFailed("invalid", f"the summary has section(s) the schema does not allow: {', '.join(extra)}")
    value = dict(out)
    strings: list[tuple[str, str]] = []
    for key, spec in props.items():
        v = value.get(key)
        if key == "goal_version":
            if isinstance(v, bool) or not isinstance(v, int):
                raise CompactionFailed("invalid", f"goal_version must be an integer, not {v!r}")
            continue
        if spec.get("type") == "string":
            if not isinstance(v, str):
                raise CompactionFailed("invalid", f"{key} must be a string")
            strings.append((key, v))
            continue
        if not isinstance(v, list):
            raise CompactionFailed("invalid", f"{key} must be a list")
        for item in v:
            if key == "verified_facts":
                if not (isinstance(item, Mapping) and set(item) <= {"fact", "evidence"}
                        and isinstance(item.get("fact"), str) and isinstance(item.get("evidence"), str)):
                    raise CompactionFailed("invalid", "each verified fact is {fact, evidence}, two strings")
                strings.append((key, item["fact"]))
                strings.append(("evidence", item["evidence"]))
            elif isinstance(item, str):
                strings.append((key, item))
            else:
                raise CompactionFailed("invalid", f"{key} must hold strings")
    if not any(s.strip() for k, s in strings if k != "evidence"):
        raise CompactionFailed("empty", "the summary is empty or whitespace only")
    for key, s in strings:
        if key != "failures" and _ERROR_START.match(s):
            raise CompactionFailed("error_text", f"the summary's {key} reads like an error or a refusal: {s[:120]!r}")
        if (key != "failures" and _ERROR_ANYWHERE.search(s)) or _NO_SUMMARY.search(s):
            raise CompactionFailed("error_text", f"the summary's {key} holds an error or a refusal: {s[:120]!r}")
    return value


async def _call(summarizer: Summarizer, messages: Sequence[Message], schema: OutputSchema,
                timeout: float | None) -> Any:
    try:
        if timeout is None:
            return await summarizer(messages, schema)
        async with asyncio.timeout(timeout) as deadline:
            answer = await summarizer(messages, schema)
        if deadline.expired():  # it swallowed the cancellation and answered late: still a timeout
            raise TimeoutError
        return answer
    except TimeoutError as exc:
        raise CompactionFailed("timeout", f"the summarizer did not answer within {timeout} s"
                               if timeout is not None else f"the summarizer timed out: {exc}") from exc
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the run itself is being cancelled: not ours to swallow
        raise CompactionFailed("cancelled", "the summarizer call was cancelled") from None
    except (CompactionFailed, StopRun):
        raise
    except Exception as exc:  # noqa: BLE001 - every summarizer fault is a failed attempt
        raise CompactionFailed("raised", f"the summarizer raised {type(exc).__name__}: {str(exc)[:300]}") from exc


# -- the summary -------------------------------------------------------------------------------

async def summarize_l2(transcript: Sequence[Message], records: Sequence[CompactionRecord], summarizer: Summarizer, *,
                       first: int, last: int, options: CompactionOptions = CompactionOptions(),
                       keep: Sequence[str] = (), schema: OutputSchema = SUMMARY_SCHEMA,
                       tokens: Callable[[Sequence[Message]], int] = count_message_tokens,
                       reason: str = "", carry: Sequence[str] = ()) -> CompactionRecord:
    """Summarize the view of transcript range ``[first, last]`` with one summarizer call.

    The summarizer gets exactly the view messages that stand for the range (system messages
    aside: they stay), so its input covers what the summary removes, an earlier summary included.

    The runtime, not the model, copies into the summary what the user stated as a constraint
    (:func:`render_summary`, :attr:`CompactionRecord.constraints` / ``verbatim``): every sentence
    of a user message in the range that reads as one (never, do not, don't, must, only, always,
    avoid ... in English and other languages), the whole message when a sentence of it is in a
    language or script the reader does not know, what an earlier summary in the range carried,
    and each item of ``carry`` (must-keep prohibitions) the range holds. A model that drops one
    drops nothing.

    Raises:
        CompactionFailed: the summarizer raised, timed out (``options.summarizer_timeout``), was
            cancelled, or answered with something invalid, empty, error-looking or over budget
            (its own part longer than ``max_summary_tokens``, or the whole summary not shorter
            than what it replaces).
        ValueError: the range does not fit.
    """
    spans = view_spans(transcript, records)
    inside = [m for m, a, b in spans if a >= first and b <= last and not isinstance(m, SystemMessage)]
    if any(a < first <= b or a <= last < b for _, a, b in spans):
        raise ValueError(f"m{first}-m{last} cuts through a summary in force")
    if not inside:
        raise ValueError(f"m{first}-m{last} holds nothing to summarize")
    raw = await _call(summarizer, tuple(inside), schema, options.summarizer_timeout)
    call_id = raw.call_id if isinstance(raw, SummarizerResult) else None
    output = _check_output(raw.output if isinstance(raw, SummarizerResult) else raw, schema)
    input_sha = _messages_sha(inside)
    if call_id is None:
        call_id = f"summarizer:{input_sha[:16]}"
    constraints, whole = _carry(spans, first, last, carry, [str(p) for p in output.get("prohibitions", ())])
    text = render_summary(output, first=first, last=last, call_id=call_id, constraints=constraints, verbatim=whole)
    # plain counts: the run's counter starts from the provider's report for the whole request (tool
    # definitions included), which is no measure of one message
    own = count_message_tokens([UserMessage(render_summary(output, first=first, last=last, call_id=call_id))])
    size, removed = count_message_tokens([UserMessage(text)]), count_message_tokens(list(inside))
    if own > options.max_summary_tokens or size >= removed:
        carried = f" (and {size - own:,} carried word for word)" if size > own else ""
        raise CompactionFailed("over_budget", f"the summary has {own:,} tokens{carried}; the limit is "
                               f"{options.max_summary_tokens:,} and it replaces {removed:,}")
    return CompactionRecord("L2", first, last, _messages_sha(transcript[first:last + 1]), summary=text,
                            summary_sha256=_sha(text), summary_output=output, summarizer_call_id=call_id,
                            summarizer_input_sha256=input_sha, summarizer_input_messages=len(inside),
                            kept=_kept_in(text, keep), reason=reason, constraints=tuple(constraints),
                            verbatim=tuple(k for k, _ in whole))


# -- the default summarizer ----------------------------------------------------------------------

SUMMARIZER_INSTRUCTIONS = (
    "You compact the earlier part of an AI agent's conversation so the agent can go on without it. "
    "Fill every section of the JSON schema from the conversation below, and nothing else: "
    "goal (the task as the user stated it, with later changes of direction), goal_version "
    "(use {goal_version}), decisions taken, failures met (errors, dead ends), verified facts each with "
    "its evidence (which tool result or message showed it), prohibitions (things the user said never to "
    "do, verbatim), open to-dos, and pending actions. Copy facts and prohibitions word for word. "
    "Be brief: at most 8 items per section, each one short line; never repeat an item. "
    "Use empty lists for empty sections."
)
"""System prompt of :class:`ProviderSummarizer` (``{goal_version}`` is filled in)."""


def _render_for_summary(messages: Sequence[Message], per_message_chars: int, keep: Sequence[str]) -> str:
    parts = []
    for i, m in enumerate(messages):
        if isinstance(m, ToolResultMessage):
            who = f"tool result of {m.name or 'a tool'} (call {m.tool_call_id})" + (" [error]" if m.is_error else "")
        elif isinstance(m, AssistantMessage):
            who = "assistant"
        else:
            who = m.role
        text = _message_text(m)
        if len(text) > per_message_chars:
            head = _head(text, per_message_chars)
            text = "\n".join([head, f"[... {len(text) - len(head):,} more characters]", *_excerpts(text[len(head):], keep)])
        parts.append(f"### {i + 1}. {who}\n{text}")
    return "\n\n".join(parts)


def bounded_schema(schema: OutputSchema, max_items: int, max_chars: int) -> OutputSchema:
    """``schema`` with ``maxItems`` on every array and ``maxLength`` on every string: a grammar-
    constrained server (llama.cpp) then cannot let a small model repeat itself until the output
    limit cuts the JSON. (Not every vendor's strict mode accepts these keywords.)"""

    def bound(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: bound(v) for k, v in node.items()}
        if node.get("type") == "array":
            out["maxItems"] = max_items
        elif node.get("type") == "string":
            out["maxLength"] = max_chars
        return out

    return OutputSchema(schema.name, bound(schema.schema), schema.description, schema.strict)


class ProviderSummarizer:
    """The default summarizer: one schema-constrained call through ``ctx.call_provider``
    (``account=True``: its tokens and cost count toward the run), checked with
    :func:`fsm_agent.parse_output`. The messages are given as one text (each cut to
    ``per_message_chars``, keeping the lines that hold must-keep items), with the must-keep items
    listed, so a small model can copy them.

    Args:
        ctx: the run.
        provider: the summarizing model (``None``: the run's).
        goal_version: filled into the instructions.
        keep: must-keep items to list for the model.
        max_tokens: output tokens of the summary call.
        per_message_chars: characters of each message shown.
        bounds: ``(max_items, max_chars)`` sent as ``maxItems`` / ``maxLength`` in the schema
            (:func:`bounded_schema`); ``"auto"``: ``(8, 240)`` for the ``llamacpp`` profile (its
            grammar enforces them; a small model otherwise repeats itself until the output limit),
            none elsewhere. The answer is checked against the schema that was sent.
    """

    def __init__(self, ctx: RunContext, *, provider: Provider | None = None, goal_version: int = 0,
                 keep: Sequence[str] = (), max_tokens: int = 1500, per_message_chars: int = 4000,
                 instructions: str = SUMMARIZER_INSTRUCTIONS,
                 bounds: tuple[int, int] | str | None = "auto") -> None:
        self.ctx = ctx
        self.provider = provider
        self.goal_version = goal_version
        self.keep = tuple(keep)
        self.max_tokens = max_tokens
        self.per_message_chars = per_message_chars
        self.instructions = instructions
        if bounds == "auto":
            profile = getattr(provider or ctx.provider, "profile", None)
            bounds = (8, 240) if getattr(profile, "name", None) == "llamacpp" else None
        self.bounds: tuple[int, int] | None = bounds if isinstance(bounds, tuple) else None

    def request(self, messages: Sequence[Message], schema: OutputSchema) -> MessageRequest:
        """The summary request."""
        body = _render_for_summary(messages, self.per_message_chars, self.keep)
        if self.keep:
            body += "\n\nItems that must appear word for word in the summary:\n" + "\n".join(f"- {k}" for k in self.keep)
        provider = self.provider or self.ctx.provider
        return MessageRequest(model=provider.model or "",
                              messages=(SystemMessage(self.instructions.format(goal_version=self.goal_version)),
                                        UserMessage(f"The conversation to summarise:\n\n{body}")),
                              max_tokens=self.max_tokens, temperature=0.0, output_schema=schema)

    async def __call__(self, messages: Sequence[Message], schema: OutputSchema) -> SummarizerResult:
        if self.bounds is not None:
            schema = bounded_schema(schema, *self.bounds)
        response: MessageResponse = await self.ctx.call_provider(self.request(messages, schema),
                                                                 provider=self.provider, account=True)
        parsed = parse_output(response, schema)
        if parsed.error is not None:
            raise CompactionFailed("invalid", f"the summary does not match the schema: {parsed.error[:300]}")
        value: Mapping[str, Any] = parsed.value if isinstance(parsed.value, Mapping) else {}
        return SummarizerResult(value, response.id)

    def __repr__(self) -> str:
        return f"ProviderSummarizer(provider={self.provider!r}, max_tokens={self.max_tokens})"


def recorded_summarizer(events: Sequence[Any]) -> Summarizer:
    """A summarizer that answers as a recorded session's summarizer did, for an offline replay
    (``fsm_agent.testing.replay_trajectory`` does not replay ``ctx.call_provider`` calls).

    ``events``: the session's ``compaction`` and ``compaction.failed`` events (``EventRecord``s or
    their ``type`` / ``payload`` dicts), in log order. Each call returns the next committed L2
    record's ``summary_output`` with its call id, or raises the next failed L2 attempt's
    :class:`CompactionFailed`; past the end, it raises ``CompactionFailed("raised", ...)``.
    """
    answers: list[SummarizerResult | CompactionFailed] = []
    for ev in events:
        kind = ev["type"] if isinstance(ev, Mapping) else ev.type
        payload = ev["payload"] if isinstance(ev, Mapping) else ev.payload
        if kind == Compacted.TAG and payload["record"]["level"] == "L2":
            rec = payload["record"]
            answers.append(SummarizerResult(rec["summary_output"], rec["summarizer_call_id"]))
        elif kind == CompactionFailedEvent.TAG and payload["level"] == "L2":
            # (an answer rejected afterwards, as inconsistent or over budget, fails the same way again)
            answers.append(CompactionFailed(payload["reason"], payload["detail"]))
    pending = list(answers)

    async def summarizer(messages: Sequence[Message], schema: OutputSchema) -> SummarizerResult:
        if not pending:
            raise CompactionFailed("raised", "the recording holds no more summarizer answers")
        answer = pending.pop(0)
        if isinstance(answer, CompactionFailed):
            raise answer
        return answer

    return summarizer
