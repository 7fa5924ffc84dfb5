"""The plugin (:class:`Compaction`, entry point ``compaction``): runs the engine at its triggers
(PreTurn, MidTurn, PostTurn, a context-length error), keeps a run's records, counts tokens from
the provider's reports, rebuilds the records of a resumed session from its log, and offers L3's
load-back tool.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any

from attrs import evolve

from fsm_agent import (
    ContextLengthExceededError,
    FailurePolicy,
    MessageRequest,
    MessageResponse,
    Middleware,
    Ordering,
    Provider,
    RunContext,
    Tool,
    ToolContext,
    ToolResultMessage,
    ToolUseBlock,
)
from fsm_agent.store import Store
from fsm_agent.types import (
    AssistantMessage,
    Message,
    count_message_tokens,
    estimate_request_tokens,
    structure,
)

from .escalation import CompactionOutcome, compact, count_tokens
from .essentials import Essentials, extract_essentials
from .records import (
    ARTIFACT_TOOL,
    LEVELS,
    TRIGGERS,
    Compacted,
    CompactionFailedEvent,
    CompactionOptions,
    CompactionRecord,
    Summarizer,
    _messages_sha,
)
from .summarizer import ProviderSummarizer
from .view import _current, _message_text, _step_starts, apply_records, view_spans

log = logging.getLogger("fsm_agent.middleware.compaction")


EssentialsOf = Callable[[Sequence[Message], RunContext], Essentials]
"""``essentials(view, ctx)``: the must-keep items of the context ``view`` (a plugin option)."""


def _limit(name: str, value: Any) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
            or (isinstance(value, float) and value > 1):
        raise ValueError(f"Compaction: {name} must be a token count (int > 0), a fraction of the budget "
                         f"(float in (0, 1]) or None, not {value!r}")
    return value


class Compaction(Middleware):
    """Compaction as a view (the package docstring): levels, triggers and limits as options.

    Args (all keyword-only):
        levels: the levels used, of ``L1``, ``L2``, ``L3`` (escalated L1 → L3 → L2). L3 is used only
            when the run offers the load-back tool (:meth:`artifact_tool`), so a reference can
            always be loaded back.
        triggers: of :data:`TRIGGERS`; default ``pre_turn``, ``mid_turn``, ``context_error``
            (``post_turn`` refreshes the summary every ``refresh_every`` steps: one more model call).
        max_context_tokens: the window in tokens (``None``: ``provider.capabilities.context_window``).
        output_reserve_tokens: tokens kept for the answer when the run sets no output limit.
        trigger_tokens: PreTurn compacts when the context is over this: tokens (int) or a fraction
            of the budget (float; budget = window minus the output room). ``None``: never by size.
        target_tokens: the escalation stops once the context is at or under this (same units).
        hard_limit_tokens: over this after the escalation, the deterministic fallback runs (same
            units; ``None``: the whole budget).
        keep_last_turns: steps that L1 never previews and L2 never summarizes.
        preview_chars: characters an old tool result keeps (L1).
        exclude_tools: tools whose results L1 and L3 never edit (the load-back tool always).
        artifact_min_chars: tool results this long are moved out by L3.
        midturn_chars: a tool result longer than this is compacted locally (MidTurn trigger).
        summarizer: ``async (messages, schema) -> mapping`` (``None``: :class:`ProviderSummarizer`
            with ``summarizer_provider`` or the run's provider).
        summarizer_timeout: seconds the summarizer may take.
        max_summary_tokens: a longer summary is rejected as over budget.
        min_summary_input_tokens: no summary of less than this.
        refresh_every: PostTurn trigger: steps between two summary refreshes.
        retry_ratio: after a context-length error the context is compacted to this fraction of its
            size (the fallback when it stays over the midpoint between that and its size).
        l2_retry_messages: after a failed summary, the PreTurn trigger asks for none again until the
            transcript has grown by this many messages (L1, L3 and the fallback still run); a
            context-length error does not wait.
        essentials: ``(view, ctx) -> Essentials``, the must-keep items (default
            :func:`extract_essentials` with ``ctx.goal_version`` and the pending calls).
        store: the session store: needed by the load-back tool and to rebuild the view on resume
            from the session log's ``compaction`` events (without it, a resumed run starts from the
            whole transcript and compacts again as needed).
        fallback: allow the labelled deterministic fallback.
        use_reported_usage: count from the provider's reported input tokens of the last call (else
            tiktoken only).

    Raises:
        ValueError: an option out of range (at construction).

    Runs first among PreTurn middleware (``outermost``): it replaces ``ctx.messages`` with the
    view, and the plugins after it (redaction, budget's wrap-up, repair) work on that. Its
    failures are isolated (``failure_policy = "isolate"``): a bug in it leaves the context as the
    driver built it. Records live in ``ctx.state(self)["records"]``.
    """

    name = "compaction"
    ordering = Ordering(position="outermost")
    failure_policy = FailurePolicy.ISOLATE

    def __init__(self, *, levels: Collection[str] = LEVELS,
                 triggers: Collection[str] = ("pre_turn", "mid_turn", "context_error"),
                 max_context_tokens: int | None = None, output_reserve_tokens: int = 4096,
                 trigger_tokens: int | float | None = 0.8, target_tokens: int | float | None = 0.6,
                 hard_limit_tokens: int | float | None = None, keep_last_turns: int = 2,
                 preview_chars: int = 1500, exclude_tools: Collection[str] = (), artifact_min_chars: int = 8000,
                 midturn_chars: int = 20000, summarizer: Summarizer | None = None,
                 summarizer_provider: Provider | None = None, summarizer_timeout: float | None = 120.0,
                 max_summary_tokens: int = 2000, min_summary_input_tokens: int = 600, refresh_every: int = 4,
                 retry_ratio: float = 0.6, essentials: EssentialsOf | None = None, store: Store | None = None,
                 fallback: bool = True, use_reported_usage: bool = True,
                 artifact_tool_name: str = ARTIFACT_TOOL, l2_retry_messages: int = 6) -> None:
        bad = set(levels) - set(LEVELS) or set(triggers) - set(TRIGGERS)
        if bad:
            raise ValueError(f"Compaction: unknown level or trigger {sorted(bad)}; levels are {LEVELS}, "
                             f"triggers {TRIGGERS}")
        if not 0 < retry_ratio < 1 or refresh_every < 1 or midturn_chars < 1 or output_reserve_tokens < 0 \
                or l2_retry_messages < 0:
            raise ValueError("Compaction: need 0 < retry_ratio < 1, refresh_every >= 1, midturn_chars >= 1, "
                             "output_reserve_tokens >= 0, l2_retry_messages >= 0")
        self.l2_retry_messages = l2_retry_messages
        self.levels = tuple(x for x in LEVELS if x in set(levels))
        self.triggers = tuple(x for x in TRIGGERS if x in set(triggers))
        self.max_context_tokens = max_context_tokens
        self.output_reserve_tokens = output_reserve_tokens
        self.trigger_tokens = _limit("trigger_tokens", trigger_tokens)
        self.target_tokens = _limit("target_tokens", target_tokens)
        self.hard_limit_tokens = _limit("hard_limit_tokens", hard_limit_tokens)
        self.midturn_chars = midturn_chars
        self.summarizer = summarizer
        self.summarizer_provider = summarizer_provider
        self.refresh_every = refresh_every
        self.retry_ratio = retry_ratio
        self.essentials = essentials
        self.store = store
        self.fallback = fallback
        self.use_reported_usage = use_reported_usage
        self.options = CompactionOptions(
            keep_last_turns=keep_last_turns, preview_chars=preview_chars,
            exclude_tools=tuple(dict.fromkeys([artifact_tool_name, *exclude_tools])),
            artifact_min_chars=artifact_min_chars, max_summary_tokens=max_summary_tokens,
            min_summary_input_tokens=min_summary_input_tokens, summarizer_timeout=summarizer_timeout,
            artifact_tool=artifact_tool_name)
        self._tokens: dict[int, tuple[Message, int]] = {}
        """Tokens per message by ``id`` (the message kept to check identity); shared by runs."""

    def __repr__(self) -> str:
        return (f"Compaction(levels={self.levels!r}, triggers={self.triggers!r}, "
                f"trigger_tokens={self.trigger_tokens!r}, target_tokens={self.target_tokens!r}, "
                f"hard_limit_tokens={self.hard_limit_tokens!r}, keep_last_turns={self.options.keep_last_turns!r}, "
                f"midturn_chars={self.midturn_chars!r}, summarizer={self.summarizer!r}, store={self.store!r})")

    # -- the load-back tool ------------------------------------------------------------------------
    def artifact_tool(self, *, max_chars: int = 20000) -> Tool:
        """The L3 load-back tool (add it to the agent's tools; L3 is used only when it is offered).

        ``load_artifact(ref, offset=0)`` returns the text of message ``m<k>`` (the ``k``-th
        ``message`` event of the session log), ``max_chars`` at a time from ``offset``.

        Raises:
            ValueError: the plugin was built without ``store``.
        """
        store = self.store
        if store is None:
            raise ValueError("Compaction.artifact_tool needs the session store: Compaction(store=...)")
        limit = max_chars

        async def load_artifact(ref: str, context: ToolContext, offset: int = 0) -> str:
            """Load back a tool result that compaction moved out of the context.

            Args:
                ref: the reference in the artifact note, e.g. "m12".
                offset: the character to start from (for a result longer than one load).
            """
            found = re.fullmatch(r"\s*m(\d+)\s*", ref)
            if found is None:
                raise ValueError(f"unknown artifact reference {ref!r}: references look like \"m12\"")
            k = int(found.group(1))
            events = await store.read_events(context.session_id, types=("message",))
            if k >= len(events):
                raise ValueError(f"no artifact {ref!r} in this session")
            message: Message = structure(events[k].payload["message"], Message)
            text = _message_text(message)
            start = max(0, offset)
            chunk = text[start:start + limit]
            end = start + len(chunk)
            if end < len(text):
                chunk += (f"\n[characters {start:,}-{end:,} of {len(text):,}; "
                          f"{self.options.artifact_tool}(\"m{k}\", offset={end}) loads the next part]")
            return chunk

        return Tool(load_artifact, name=self.options.artifact_tool, effect="pure")

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _state(self, ctx: RunContext) -> dict[str, Any]:
        st = ctx.state(self)
        if not st:
            st.update(records=[], marked=set(), sent=None, reported=None, refreshed_at=0, warned=False)
        return st

    def _count(self, messages: Sequence[Message]) -> int:
        cache, base = self._tokens, _BASE_TOKENS
        total = base
        for m in messages:
            hit = cache.get(id(m))
            if hit is None or hit[0] is not m:
                if len(cache) >= 8192:
                    cache.clear()
                hit = cache[id(m)] = (m, count_message_tokens((m,)) - base)
            total += hit[1]
        return total

    def _counter(self, ctx: RunContext, st: dict[str, Any]) -> Callable[[Sequence[Message]], int]:
        reported, sent = (st["reported"], st["sent"]) if self.use_reported_usage else (None, None)
        extra = 0
        if reported is None and ctx.settings.tools_enabled and len(ctx.tools):
            extra = estimate_request_tokens(MessageRequest("", (), tools=ctx.tools.definitions(
                ctx.settings.active_tools))) - _BASE_TOKENS

        def tokens(messages: Sequence[Message]) -> int:
            return count_tokens(messages, reported=reported, sent=sent, extra=extra, count=self._count)

        return tokens

    def budget(self, ctx: RunContext) -> int | None:
        """Prompt tokens the context may use: the window minus the output room (``None``: unknown)."""
        window = self.max_context_tokens or ctx.provider.capabilities.context_window
        if window is None:
            return None
        reserve = ctx.settings.max_output_tokens or ctx.config.max_output_tokens or self.output_reserve_tokens
        return max(0, window - reserve)

    def _tokens_of(self, value: int | float | None, budget: int | None) -> int | None:
        if value is None:
            return None
        if isinstance(value, float):
            return None if budget is None else int(budget * value)
        return int(value)

    def _options(self, ctx: RunContext) -> tuple[CompactionOptions, tuple[str, ...]]:
        """The options and levels of this run: L3 (and load hints) only when the load-back tool is offered."""
        offered = self.options.artifact_tool in ctx.tools
        options = self.options if offered else evolve(self.options, load_hint=False)
        return options, tuple(x for x in self.levels if x != "L3" or offered)

    def _keep(self, ctx: RunContext, view: Sequence[Message], levels: Sequence[str]
              ) -> tuple[Essentials, Summarizer | None]:
        """The must-keep items of ``view``, and the summarizer told about them."""
        if self.essentials is not None:
            essentials = self.essentials(view, ctx)
        else:
            essentials = extract_essentials(view, ctx.goal_version, [c.id for c in ctx.pending_calls])
        summarizer = self.summarizer
        if summarizer is None and "L2" in levels:
            summarizer = ProviderSummarizer(ctx, provider=self.summarizer_provider, goal_version=ctx.goal_version,
                                            keep=essentials.items)
        return essentials, summarizer

    def _report(self, ctx: RunContext, st: dict[str, Any], outcome: CompactionOutcome, trigger: str) -> None:
        for a in outcome.attempts:
            if a.record is not None:
                st["records"].append(a.record)
                ctx.emit(Compacted(ctx.session_id, ctx.turn, trigger, a.record, a.tokens_before, a.tokens_after,
                                   len(st["records"]) - 1))
                log.info("session %s: %s compaction (%s)%s: %d -> %d tokens", ctx.session_id, a.level, trigger,
                         " [fallback]" if a.record.fallback else "", a.tokens_before, a.tokens_after)
            elif a.failure is not None:
                if a.level == "L2":  # back off: the same summary is not asked for again at once
                    st["l2_failed_at"] = len(ctx.transcript)
                ctx.emit(CompactionFailedEvent(ctx.session_id, ctx.turn, trigger, a.level, a.failure.reason,
                                               a.failure.detail, a.tokens_before))
                log.warning("session %s: %s (%s); nothing changed", ctx.session_id, a.failure, trigger)

    def _local(self, ctx: RunContext, st: dict[str, Any], hidden_or_done: set[int]) -> set[int]:
        """Transcript indices of large results to compact locally: those marked in MidTurn, and those
        of the newest step (after the last assistant message: a resume lost the marks)."""
        transcript = ctx.transcript
        exclude = set(self.options.exclude_tools)
        marked = st["marked"]

        def large(i: int, m: Message) -> bool:
            return isinstance(m, ToolResultMessage) and i not in hidden_or_done and m.name not in exclude \
                and len(m.text) > self.midturn_chars

        out: set[int] = set()
        if marked:
            out.update(i for i, m in enumerate(transcript)
                       if isinstance(m, ToolResultMessage) and m.tool_call_id in marked and large(i, m))
            marked.clear()
        for i in range(len(transcript) - 1, -1, -1):
            m = transcript[i]
            if isinstance(m, AssistantMessage):
                break
            if large(i, m):
                out.add(i)
        return out

    # -- hooks -----------------------------------------------------------------------------------
    async def on_run_start(self, ctx: RunContext) -> None:
        """Rebuild the records of a resumed session from its ``compaction`` events (with ``store``):
        records that no longer fit the transcript (written after its last checkpoint) are dropped."""
        st = ctx.state(self)
        st.clear()
        st = self._state(ctx)
        if self.store is None:
            return
        try:
            events = await self.store.read_events(ctx.session_id, types=(Compacted.TAG,))
        except Exception as exc:  # noqa: BLE001 - the view then starts from the transcript
            log.warning("session %s: could not read compaction events (%s); starting from the whole transcript",
                        ctx.session_id, exc)
            return
        records: list[CompactionRecord] = []
        transcript = ctx.transcript
        for ev in events:
            try:
                rec: CompactionRecord = structure(ev.payload["record"], CompactionRecord)
                fits = rec.last < len(transcript) and \
                    _messages_sha(transcript[rec.first:rec.last + 1]) == rec.covered_sha256
                if fits:
                    view_spans(transcript, [*records, rec])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                log.warning("session %s: compaction event %d unreadable (%s); later ones dropped",
                            ctx.session_id, ev.seq, exc)
                break
            if not fits:
                log.info("session %s: compaction event %d does not fit the transcript (written after the last "
                         "checkpoint); it and later ones are dropped", ctx.session_id, ev.seq)
                break
            records.append(rec)
        st["records"] = records

    async def pre_turn(self, ctx: RunContext) -> None:
        """Rebuild the view; compact locally what MidTurn marked; compact when over the trigger (or
        harder after a context-length error)."""
        st = self._state(ctx)
        transcript = ctx.transcript
        if len(ctx.messages) != len(transcript) or any(a is not b for a, b in zip(ctx.messages, transcript)):
            if not st["warned"]:
                st["warned"] = True
                log.warning("session %s: ctx.messages was changed before compaction ran (list compaction first); "
                            "compaction is skipped in this run", ctx.session_id)
            return
        records = st["records"]
        view = apply_records(transcript, records)
        options, levels = self._options(ctx)
        found: list[tuple[Essentials, Summarizer | None]] = []

        def must_keep() -> tuple[Essentials, Summarizer | None]:
            """The essentials of the view before any edit of this PreTurn (only when one is tried)."""
            if not found:
                found.append(self._keep(ctx, view, levels))
            return found[0]

        tokens = self._counter(ctx, st)
        if "mid_turn" in self.triggers:
            hidden, done = _current(transcript, records)
            local_levels = ("L3",) if "L3" in levels else ("L1",) if "L1" in levels else ()
            local = self._local(ctx, st, hidden | {i for i, e in done.items() if e.kind in ("artifact", "preview")})
            if local and local_levels:
                outcome = await compact(transcript, records, target=None, levels=local_levels,
                                        essentials=must_keep()[0], options=options, tokens=tokens, indices=local,
                                        fallback=False)
                self._report(ctx, st, outcome, "mid_turn")
                view = list(outcome.view)
        budget = self.budget(ctx)
        cur = tokens(view)
        hard = self._tokens_of(self.hard_limit_tokens, budget) or budget
        if ctx.context_retry and "context_error" in self.triggers:
            trigger, target = "context_error", int(cur * self.retry_ratio)
            hard = min(x for x in (hard, int(cur * (1 + self.retry_ratio) / 2)) if x is not None)
        else:
            limit = self._tokens_of(self.trigger_tokens, budget)
            if "pre_turn" not in self.triggers or limit is None or cur <= limit:
                ctx.messages = view
                return
            trigger, target = "pre_turn", self._tokens_of(self.target_tokens, budget) or limit
        failed_at = st.get("l2_failed_at")
        if failed_at is not None and trigger == "pre_turn" and "L2" in levels \
                and len(transcript) - failed_at < self.l2_retry_messages:
            # a summary failed a moment ago (a small model's JSON cut off, a provider error): until the
            # transcript has grown by l2_retry_messages, only L1 / L3 and the labelled fallback run
            levels = tuple(lv for lv in levels if lv != "L2")
        essentials, summarizer = must_keep()
        outcome = await compact(transcript, st["records"], target=target, hard_limit=hard, levels=levels,
                                summarizer=summarizer, essentials=essentials, options=options, tokens=tokens,
                                fallback=self.fallback)
        self._report(ctx, st, outcome, trigger)
        ctx.messages = list(outcome.view)

    async def wrap_model_call(self, request: MessageRequest, call_next: Any, ctx: RunContext) -> MessageResponse:
        """Remember what was sent and the input tokens the provider reported for it (the base of the
        next count); a context-length error's reported size too. Changes nothing."""
        st = self._state(ctx)
        try:
            response: MessageResponse = await call_next(request)
        except ContextLengthExceededError as exc:
            size = exc.input_tokens or exc.requested
            st["sent"], st["reported"] = (request.messages, size) if size else (None, None)
            raise
        usage = response.usage
        if usage is not None and not usage.estimated and usage.input_tokens > 0:
            st["sent"], st["reported"] = request.messages, usage.input_tokens
        else:
            st["sent"], st["reported"] = None, None
        return response

    async def wrap_tool_call(self, call: ToolUseBlock, call_next: Any, ctx: RunContext) -> ToolResultMessage:
        """MidTurn trigger: mark a result longer than ``midturn_chars`` for a local compaction at the
        next PreTurn. The result itself goes on unchanged (the log keeps the tool's real output)."""
        result: ToolResultMessage = await call_next(call)
        if "mid_turn" in self.triggers and call.name not in self.options.exclude_tools \
                and len(result.text) > self.midturn_chars:
            self._state(ctx)["marked"].add(call.id)
        return result

    async def post_turn(self, ctx: RunContext) -> None:  # type: ignore[override]
        """PostTurn trigger (off by default): refresh the long-term summary every ``refresh_every``
        steps. Returns no decision."""
        if "post_turn" not in self.triggers or "L2" not in self.levels:
            return None
        st = self._state(ctx)
        steps = len(_step_starts(ctx.transcript))
        if steps - st["refreshed_at"] < self.refresh_every:
            return None
        st["refreshed_at"] = steps
        transcript = ctx.transcript
        view = apply_records(transcript, st["records"])
        options, levels = self._options(ctx)
        essentials, summarizer = self._keep(ctx, view, levels)
        outcome = await compact(transcript, st["records"], target=None, levels=("L2",), summarizer=summarizer,
                                essentials=essentials, options=options, tokens=self._counter(ctx, st),
                                fallback=False)
        self._report(ctx, st, outcome, "post_turn")
        return None


_BASE_TOKENS = count_message_tokens(())
