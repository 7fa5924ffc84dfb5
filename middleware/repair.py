"""Message repair: make a history valid for the provider before every model call.

Seed 000 §5.2.4. Each pass is a pure function ``list[Message] -> list[Message]``: it returns a new
list and never changes its input (messages are frozen). :func:`repair_messages` runs, in order:

0. :func:`collapse_repeated_calls` — a call given twice (same id, name and arguments) is kept once,
   unless the second is a new call reusing the id (the first was answered and it has its own result)
   (:func:`fsm_agent.types.collapse_repeated_calls`, the rule every protocol module applies too).
   :func:`drop_empty_content` — blank text blocks and the turns they leave empty (case B04).
1. :func:`trim_to_context_window` — the newest whole groups that fit a token budget (B01, B20).
2. :func:`normalize_system_messages` — one system message, first.
3. :func:`repair_message_order` — tool results directly after the turn that called them.
4. :func:`pair_tool_calls_with_results` — drop results with no earlier call, and duplicates.
5. :func:`synthesize_missing_results` — an error result for every unanswered call (B02).
6. :func:`truncate_old_tool_results` — cut long results of older turns, saying how much.
7. :func:`normalize_tool_call_ids` — ids non-empty, unique, legal, short enough.

Matching (passes 1, 3-7): a :class:`ToolResultMessage` belongs to the nearest earlier assistant
turn with a call of its id, and the k-th result with id X answers that turn's k-th call with id X;
so ids reused every turn (``call_0``) or inside one turn (``""``) stay paired (``ToolResultBlock``
in user messages is not examined). Matching and the placement of results (passes 3 and 5) are the
core's (:func:`fsm_agent.types.result_owners`, :func:`fsm_agent.types.normalize_pairing`): what the
protocol modules already do losslessly before every request; this plugin adds what loses or invents
content (trimming, dropping orphans, synthesized results that say why). :class:`MessageRepair` runs
it all in ``pre_turn``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence

from attrs import evolve, frozen

from fsm_agent import Middleware, Ordering, RunContext
from fsm_agent.types import (
    AssistantMessage,
    Message,
    MessageRequest,
    SystemMessage,
    TextBlock,
    ToolResultMessage,
    ToolUseBlock,
    UserImageMessage,
    UserMessage,
    collapse_repeated_calls,
    count_message_tokens,
    estimate_request_tokens,
    normalize_pairing,
    result_owners,
)

__all__ = [
    "RULES", "MessageRepair", "ProviderRules", "collapse_repeated_calls", "drop_empty_content",
    "normalize_system_messages",
    "normalize_tool_call_ids", "pair_tool_calls_with_results", "repair_message_order",
    "repair_messages", "rules_for", "synthesize_missing_results", "trim_to_context_window",
    "truncate_old_tool_results"]

Count = Callable[[Sequence[Message]], int]
"""Tokens of a message list; additive: ``count(ms) == count([]) + Σ (count([m]) - count([]))``."""


@frozen
class ProviderRules:
    """What one wire protocol accepts in a history: the provider-aware part of the pipeline."""

    protocol: str
    """``anthropic``, ``openai-chat``, ``openai-responses`` or ``generic`` (the strictest)."""
    first_turn_user: bool
    """The first non-system message must be a user one (Anthropic; OpenAI takes either)."""
    id_chars: str
    """Regex character-class body of what a tool-call id may hold (Anthropic ``a-zA-Z0-9_-``)."""
    max_id_length: int
    """Longest tool-call id accepted, in characters (OpenAI Chat: 40)."""


RULES: dict[str, ProviderRules] = {
    "anthropic": ProviderRules("anthropic", True, "A-Za-z0-9_-", 64),
    "openai-chat": ProviderRules("openai-chat", False, "A-Za-z0-9_.:-", 40),
    "openai-responses": ProviderRules("openai-responses", False, "A-Za-z0-9_.:-", 64),
    "generic": ProviderRules("generic", True, "A-Za-z0-9_-", 40),
}
"""Rules by protocol; ``generic`` (unknown providers, test doubles) is the strictest of each."""


def rules_for(protocol: str | None) -> ProviderRules:
    """The rules of ``protocol`` (a ``Profile.protocol``); ``generic`` for ``None`` or unknown."""
    return RULES.get(protocol or "generic", RULES["generic"])


_USER = (UserMessage, UserImageMessage)


def _owners(messages: Sequence[Message]) -> list[tuple[int, int] | None]:
    """Per index, ``(assistant index, call position)`` a tool result answers (the core's matching,
    :func:`fsm_agent.types.result_owners`)."""
    return result_owners(messages)


def _start_with_user(messages: Sequence[Message]) -> list[Message]:
    """Drop non-system messages before the first user message (unchanged when there is none)."""
    first = next((i for i, m in enumerate(messages) if isinstance(m, _USER)), None)
    if first is None:
        return list(messages)
    return [m for i, m in enumerate(messages) if i >= first or isinstance(m, SystemMessage)]


def drop_empty_content(messages: Sequence[Message]) -> list[Message]:
    """Pass 0 (B04): drop empty or whitespace-only text blocks, then system, user and assistant
    messages left with no block (a tool-only turn keeps just its tool_use). Tool results are
    never dropped here: that would orphan their call."""
    out: list[Message] = []
    for m in messages:
        if isinstance(m, (SystemMessage, UserMessage, AssistantMessage)):
            blocks = tuple(b for b in m.content
                           if not (isinstance(b, TextBlock) and not b.text.strip()))
            if not blocks:
                continue
            m = evolve(m, content=blocks) if len(blocks) != len(m.content) else m
        out.append(m)
    return out


def trim_to_context_window(messages: Sequence[Message], budget_tokens: int | None, *,
                           count: Count = count_message_tokens) -> list[Message]:
    """Pass 1 (B01): keep the newest messages whose tokens (by ``count``) fit ``budget_tokens``.

    Only whole units go (an assistant turn with tool calls plus all its results is one unit, any
    other non-system message is one); system messages stay. The newest unit stays, and so does the
    latest user message before the kept units when they hold none (the task of a long tool run):
    the result may then exceed the budget and the provider's context error decides (B20). Then
    messages before the first user one are dropped, then orphaned results. ``None``: unchanged.
    """
    msgs = list(messages)
    if budget_tokens is None or count(msgs) <= budget_tokens:
        return msgs
    base = count([])
    cost = [count([m]) - base for m in msgs]
    units: list[list[int]] = []
    group_of: dict[int, list[int]] = {}
    for j, (m, o) in enumerate(zip(msgs, _owners(msgs), strict=True)):
        if o is not None:
            group_of[o[0]].append(j)
        elif not isinstance(m, SystemMessage):
            units.append(group_of.setdefault(j, [j]))
    systems = [j for j, m in enumerate(msgs) if isinstance(m, SystemMessage)]
    fixed = base + sum(cost[j] for j in systems)

    def fill(candidates: list[list[int]], total: int, budget: int) -> list[list[int]]:
        kept: list[list[int]] = []
        for unit in reversed(candidates):
            c = sum(cost[j] for j in unit)
            if kept and total + c > budget:
                break
            kept.append(unit)
            total += c
        return kept

    kept = fill(units, fixed, budget_tokens)
    if kept and not any(isinstance(msgs[u[0]], _USER) for u in kept):
        users = [k for k in range(units.index(kept[-1])) if isinstance(msgs[units[k][0]], _USER)]
        if users:
            pin = users[-1]
            kept = [*fill(units[pin + 1:], fixed + cost[units[pin][0]], budget_tokens), units[pin]]
    keep = sorted({j for u in kept for j in u} | set(systems))
    return pair_tool_calls_with_results(_start_with_user([msgs[j] for j in keep]))


def normalize_system_messages(messages: Sequence[Message]) -> list[Message]:
    """Pass 2: merge all system messages into one at the front, texts in order joined by a blank
    line; blank ones disappear. A lone system message already first is kept as it is."""
    systems = [m for m in messages if isinstance(m, SystemMessage)]
    if not systems or (len(systems) == 1 and messages[0] is systems[0]):
        return list(messages)
    text = "\n\n".join(s.text for s in systems if s.text.strip())
    rest: list[Message] = [m for m in messages if not isinstance(m, SystemMessage)]
    return [SystemMessage(text), *rest] if text else rest


def _regroup(messages: Sequence[Message], synthesize: bool) -> list[Message]:
    """Each matched result right after its step, in call order; gaps filled when ``synthesize``
    (:func:`fsm_agent.types.normalize_pairing`, without collapsing repeated calls)."""
    out, _ = normalize_pairing(messages, fill=_synthetic if synthesize else None, collapse=False)
    return list(out)


def _synthetic(call: ToolUseBlock, answered: bool, after: Message | None) -> ToolResultMessage:
    kind, text = _SYNTHETIC[answered or after is None or isinstance(after, _USER)]
    return ToolResultMessage(call.id, text.format(call.name, call.id), is_error=True, name=call.name,
                             metadata={"synthetic": kind})


_SYNTHETIC = {  # interrupted? -> (metadata kind, text)
    True: ("cancelled", "[cancelled] The call {} ({}) was cancelled before it returned: the run "
           "was interrupted. There is no result; do not assume it ran."),
    False: ("unavailable", "[result unavailable] The result of {} ({}) is not in the "
            "conversation history (it was filtered out or lost). Do not assume it succeeded; "
            "call it again if needed."),
}


def repair_message_order(messages: Sequence[Message],
                         rules: ProviderRules = RULES["generic"]) -> list[Message]:
    """Pass 3: move each tool result up to right after the turn that called it, in call order, so
    a message that sat between a call and its results now follows them (OpenAI Chat: tool messages
    right after the ``tool_calls`` message; Anthropic: ``tool_result`` blocks in the very next
    turn). With ``rules.first_turn_user`` non-system messages before the first user message are
    dropped. Results with no earlier call stay where they are (pass 4 drops them)."""
    out = _regroup(messages, synthesize=False)
    return _start_with_user(out) if rules.first_turn_user else out


def pair_tool_calls_with_results(messages: Sequence[Message]) -> list[Message]:
    """Pass 4: drop tool results with no matching call anywhere earlier, and every result after
    the first for one call (matching as in the module docstring)."""
    owners = _owners(messages)
    return [m for j, m in enumerate(messages)
            if not isinstance(m, ToolResultMessage) or owners[j] is not None]


def synthesize_missing_results(messages: Sequence[Message]) -> list[Message]:
    """Pass 5 (B02): every call gets a result right after its turn, in call order.

    A missing one becomes ``ToolResultMessage(id, text, is_error=True, metadata={"synthetic":
    kind})``: ``"cancelled"`` (text "[cancelled] ... was cancelled ...") when the run was
    interrupted — a sibling call has a real result, or a user message (or nothing) comes next —
    else ``"unavailable"`` ("[result unavailable] ...": the run went on, so the result was
    filtered out of the history).
    """
    return _regroup(messages, synthesize=True)


def truncate_old_tool_results(messages: Sequence[Message], *, keep_last_turns: int = 2,
                              max_chars: int = 2000) -> list[Message]:
    """Pass 6: cut results older than the last ``keep_last_turns`` turns to ``max_chars`` chars.

    A result's age is the number of assistant messages (model turns) after it, so results of the
    newest turn are never cut. The kept head is followed by ``[... N of M characters cut ...]``;
    metadata gets ``truncated_chars = N``; non-text blocks stay.

    Raises:
        ValueError: ``keep_last_turns < 1`` or ``max_chars < 0``.
    """
    if keep_last_turns < 1 or max_chars < 0:
        raise ValueError("keep_last_turns must be >= 1 and max_chars >= 0")
    out, age = list(messages), 0
    for j in range(len(out) - 1, -1, -1):
        m = out[j]
        age += isinstance(m, AssistantMessage)
        if isinstance(m, ToolResultMessage) and age >= keep_last_turns and len(m.text) > max_chars:
            text, cut = m.text, len(m.text) - max_chars
            note = f"\n[... {cut} of {len(text)} characters cut from this old tool result]"
            rest = tuple(b for b in m.content if not isinstance(b, TextBlock))
            out[j] = evolve(m, content=(TextBlock(text[:max_chars] + note), *rest),
                            metadata={**(m.metadata or {}), "truncated_chars": cut})
    return out


def normalize_tool_call_ids(messages: Sequence[Message],
                            rules: ProviderRules = RULES["generic"]) -> list[Message]:
    """Pass 7: rewrite call ids that are empty, used by an earlier call (any turn), hold characters
    ``rules`` forbid, or exceed ``rules.max_id_length``; matching results get the same new id. A
    new id is the old one with illegal characters as ``_``, cut to length, when that is free; else
    ``call_<16 hex>`` hashed from the old id (the same history gives the same ids)."""
    legal, illegal = re.compile(f"[{rules.id_chars}]+"), re.compile(f"[^{rules.id_chars}]")
    taken = {c.id for m in messages if isinstance(m, AssistantMessage) for c in m.tool_calls}
    seen: set[str] = set()
    renamed: dict[tuple[int, int], str] = {}
    out = list(messages)
    for i, m in enumerate(messages):
        if not isinstance(m, AssistantMessage) or not m.tool_calls:
            continue
        blocks, pos = [], 0
        for b in m.content:
            if isinstance(b, ToolUseBlock):
                if not (b.id and len(b.id) <= rules.max_id_length and legal.fullmatch(b.id)
                        and b.id not in seen):
                    renamed[(i, pos)] = _fresh_id(b.id, rules, illegal, seen | taken)
                    b = evolve(b, id=renamed[(i, pos)])
                seen.add(b.id)
                pos += 1
            blocks.append(b)
        out[i] = evolve(m, content=tuple(blocks)) if blocks != list(m.content) else m
    for j, o in enumerate(_owners(messages)):
        r = out[j]
        if o in renamed and isinstance(r, ToolResultMessage):
            out[j] = evolve(r, tool_call_id=renamed[o])
    return out


def _fresh_id(old: str, rules: ProviderRules, illegal: re.Pattern[str], taken: set[str]) -> str:
    clean = illegal.sub("_", old)[: rules.max_id_length]
    if clean.strip("_") and clean not in taken:
        return clean
    n = 0
    while (new := f"call_{hashlib.sha256(f'{old}#{n}'.encode()).hexdigest()[:16]}") in taken:
        n += 1
    return new


def repair_messages(messages: Sequence[Message], *, rules: ProviderRules = RULES["generic"],
                    budget_tokens: int | None = None, count: Count = count_message_tokens,
                    keep_last_turns: int = 2, tool_result_max_chars: int = 2000) -> list[Message]:
    """Every pass, in order (module docstring). ``budget_tokens``: prompt tokens the messages may
    use (``None``: no trimming)."""
    out = drop_empty_content(collapse_repeated_calls(messages))
    out = trim_to_context_window(out, budget_tokens, count=count)
    out = normalize_system_messages(out)
    out = repair_message_order(out, rules)
    out = pair_tool_calls_with_results(out)
    out = synthesize_missing_results(out)
    out = truncate_old_tool_results(out, keep_last_turns=keep_last_turns,
                                    max_chars=tool_result_max_chars)
    return normalize_tool_call_ids(out, rules)


_CACHE_SIZE = 8192
"""Entries a :class:`MessageRepair` token cache holds before it starts again (bounds memory)."""
_BASE_TOKENS = count_message_tokens(())
"""Tokens of an empty message list (the reply priming): each message adds its own on top."""


class MessageRepair(Middleware):
    """PreTurn middleware: :func:`repair_messages` on ``ctx.messages`` before every model call.

    Innermost, so its ``pre_turn`` runs after other PreTurn middleware and has the last word.
    ``ctx.transcript`` is never changed. The prompt budget is :meth:`budget`.

    Args:
        max_context_tokens: the window in tokens (``None``: ``capabilities.context_window``;
            no trimming when that is unknown too).
        output_reserve_tokens: tokens left for the answer when the run sets no output limit.
        retry_budget_ratio: share of the budget on the retry after a context-length error (B20).
        keep_last_turns: tool results of this many newest turns are never truncated.
        tool_result_max_chars: characters an older tool result keeps.
        protocol: these rules (else the provider's ``profile.protocol``, else ``generic``).

    Raises:
        ValueError: an option out of range (at construction).
    """

    name = "repair"

    ordering = Ordering(position="innermost")

    def __init__(self, *, max_context_tokens: int | None = None, output_reserve_tokens: int = 4096,
                 retry_budget_ratio: float = 0.75, keep_last_turns: int = 2,
                 tool_result_max_chars: int = 2000, protocol: str | None = None) -> None:
        if not 0 < retry_budget_ratio <= 1 or keep_last_turns < 1 or min(
                tool_result_max_chars, output_reserve_tokens) < 0 or protocol not in (None, *RULES):
            raise ValueError("need 0 < retry_budget_ratio <= 1, keep_last_turns >= 1, sizes >= 0, "
                             f"protocol None or one of {', '.join(RULES)}")
        self.max_context_tokens = max_context_tokens
        self.output_reserve_tokens = output_reserve_tokens
        self.retry_budget_ratio = retry_budget_ratio
        self.keep_last_turns = keep_last_turns
        self.tool_result_max_chars = tool_result_max_chars
        self.protocol = protocol
        self._message_tokens: dict[int, tuple[Message, int]] = {}
        """Tokens of messages seen, by ``id`` (the message is kept to check identity); shared by runs."""
        self._tool_tokens: dict[tuple[int, ...], tuple[tuple[object, ...], int]] = {}
        """Tokens of tool-definition tuples offered, by the definitions' ``id``s."""

    def rules(self, ctx: RunContext) -> ProviderRules:
        """The rules for this run's provider."""
        profile = getattr(ctx.provider, "profile", None)
        return rules_for(self.protocol or getattr(profile, "protocol", None))

    def budget(self, ctx: RunContext) -> int | None:
        """Prompt tokens for the messages of this call, or ``None`` (window unknown): the window
        minus the output room (``ctx.settings.max_output_tokens``, else ``config.max_output_tokens``, else
        ``output_reserve_tokens``) minus the offered tool definitions (``fsm_agent.types.tokens``
        counts; cl100k); times ``retry_budget_ratio`` when ``ctx.context_retry`` (B20)."""
        window = self.max_context_tokens or ctx.provider.capabilities.context_window
        if window is None:
            return None
        settings = ctx.settings
        reserve = (settings.max_output_tokens or ctx.config.max_output_tokens
                   or self.output_reserve_tokens)
        budget = window - reserve
        if settings.tools_enabled and len(ctx.tools):
            tools = ctx.tools.definitions(settings.active_tools)
            key = tuple(map(id, tools))
            hit = self._tool_tokens.get(key)
            if hit is None or any(a is not b for a, b in zip(hit[0], tools, strict=True)):
                if len(self._tool_tokens) >= _CACHE_SIZE:
                    self._tool_tokens.clear()
                hit = self._tool_tokens[key] = (tools, estimate_request_tokens(MessageRequest("", (), tools=tools)))
            budget -= hit[1]
        if ctx.context_retry:
            budget = int(budget * self.retry_budget_ratio)
        return max(budget, 0)

    def count(self, messages: Sequence[Message]) -> int:
        """``count_message_tokens(messages)``, each message counted once: messages are frozen, so a
        message's tokens are kept (by identity) and the whole transcript is not re-tokenized every
        turn. The count is additive, so the sum is the same."""
        cache, total = self._message_tokens, _BASE_TOKENS
        for m in messages:
            hit = cache.get(id(m))
            if hit is None or hit[0] is not m:
                if len(cache) >= _CACHE_SIZE:
                    cache.clear()
                hit = cache[id(m)] = (m, count_message_tokens((m,)) - _BASE_TOKENS)
            total += hit[1]
        return total

    def pre_turn(self, ctx: RunContext) -> None:
        ctx.messages = repair_messages(
            ctx.messages, rules=self.rules(ctx), budget_tokens=self.budget(ctx), count=self.count,
            keep_last_turns=self.keep_last_turns, tool_result_max_chars=self.tool_result_max_chars)

    def __repr__(self) -> str:
        opts = ("max_context_tokens", "output_reserve_tokens", "retry_budget_ratio",
                "keep_last_turns", "tool_result_max_chars", "protocol")
        return f"MessageRepair({', '.join(f'{k}={getattr(self, k)!r}' for k in opts)})"
