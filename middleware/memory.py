"""Episodic memory: save what each run came to, recall the relevant past into the next runs.

Seed 000's ``save_episodes`` (an agent's experience is kept in its ``EpisodeStore``) and seed 004's
PostTurn "update Memory", as one plugin:

* **Save.** When a run (or a resume) ends, ``on_run_end`` saves the session's :class:`Episode`: the
  goal (its first user message), the outcome (stop reason, detail, last answer), the key steps
  (tool calls with their arguments and results; failed ones always kept) and what failed (failed
  calls, a stop that was not COMPLETED). One episode per session, replaced as the session goes on
  (a WAITING_HUMAN stop, then its resumed COMPLETED end).
* **Recall.** At the first PreTurn of a run (or a resume), the session's goal (and its latest user
  message) is searched among the tenant's episodes (ranked full-text search, see
  :mod:`fsm_agent.store.episodes`); the best ones are put before the conversation as one system
  message, within a token share of the context window you set (counted with the run's token
  counter), and kept there for every later model call of the run. The session's own episode is
  never recalled. What was recalled (ids, scores, tokens, the budget, what did not fit, or the
  store's error) is logged as a ``memory_recalled`` event (:class:`~fsm_agent.types.MemoryRecalled`).
* **Tenants.** An episode belongs to the session's tenant (``ctx.metadata["tenant"]``, as the server
  stores it; ``"default"`` without one), and recall searches that tenant's episodes only.
* **Replay.** Every call to the store is an effect of the run (``ctx.plugin_effect``): a recorded
  run replays with the same recall, and the store is not touched by a replay.
* **Failures.** A store that cannot be read leaves the run without memory (the event carries the
  error); one that cannot be written loses that episode (logged). Memory never stops a run.

Order: it sits inside ``compaction`` (which rebuilds the context first) and outside ``repair`` and
``redaction`` (which then see the recalled text: trimmed to the window, secrets masked).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from fsm_agent import Middleware, Ordering, RunContext, StopReason, SystemMessage
from fsm_agent.errors import ConfigurationError, StoreError
from fsm_agent.store import Episode, EpisodeHit, EpisodeStep, EpisodeStore, open_episode_store
from fsm_agent.types import (
    AssistantMessage,
    MemoryRecalled,
    RunResult,
    ToolResultMessage,
    UserMessage,
    count_tokens,
)

__all__ = ["RECALL_HEADER", "EpisodicMemory", "episode_of"]

log = logging.getLogger("fsm_agent.middleware.memory")

RECALL_HEADER = ("Relevant past episodes of this user (from memory, best match first; they may be outdated: "
                 "check before relying on them):")
"""The first line of the recalled block."""

_DEFAULT_TENANT = "default"  # fsm_agent.server.auth.DEFAULT_TENANT: a session without a tenant


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[:most - 1] + "…"


def _tenant_of(metadata: Any) -> str:
    t = metadata.get("tenant") if hasattr(metadata, "get") else None
    return t if isinstance(t, str) and t else _DEFAULT_TENANT


def episode_of(result: RunResult, tenant: str, now: float, *, max_steps: int = 12) -> Episode:
    """The episode of a run that ended with ``result`` (its whole session's transcript): see the
    module doc. ``now``: Unix seconds (the save time)."""
    calls: dict[str, EpisodeStep] = {}
    order: list[str] = []
    goal = ""
    for m in result.messages:
        if isinstance(m, UserMessage) and not goal:
            goal = m.text
        elif isinstance(m, AssistantMessage):
            for c in m.tool_calls:
                args = orjson.dumps(c.input, option=orjson.OPT_SORT_KEYS).decode() if c.input is not None else ""
                calls[c.id] = EpisodeStep(c.name, _cut(args, 300), "", False)
                order.append(c.id)
        elif isinstance(m, ToolResultMessage) and m.tool_call_id in calls:
            step = calls[m.tool_call_id]
            calls[m.tool_call_id] = EpisodeStep(step.tool, step.arguments, _cut(m.text, 500), not m.is_error)
    steps = [calls[i] for i in order]
    failed = [i for i, s in enumerate(steps) if not s.ok]
    keep = set(failed[:max_steps])
    for i in [0, *range(len(steps) - 1, 0, -1)]:  # the first step, then the latest ones
        if len(keep) >= max_steps or i >= len(steps):
            break
        keep.add(i)
    failures = [f"{s.tool}: {_cut(s.result, 200) or 'no result'}" for s in steps if not s.ok][:20]
    stop = result.stop
    if stop.reason is not StopReason.COMPLETED:
        kind = stop.error.get("kind") if isinstance(stop.error, dict) else None
        failures.append(_cut(f"{stop.reason.value}{f' ({kind})' if kind else ''}: {stop.detail}", 500))
    return Episode(result.session_id, tenant, result.session_id, _cut(goal, 4000), stop.reason.value,
                   detail=_cut(stop.detail, 2000), answer=_cut(result.output, 4000),
                   steps=tuple(steps[i] for i in sorted(keep)), failures=tuple(failures), turns=result.turns,
                   tool_calls=result.tool_calls, cost_usd=result.cost_usd, created_at=now, updated_at=now)


class EpisodicMemory(Middleware):
    """Save an episode when a run ends; recall relevant ones at its first PreTurn (see the module doc).

    Args:
        store: an :class:`~fsm_agent.store.EpisodeStore`, or a location for
            :func:`~fsm_agent.store.open_episode_store` (a SQLite path or a ``postgresql://`` DSN);
            ``None``: beside the CLI's session store (``$FSM_AGENT_STORE``, else
            ``~/.fsm-agent/sessions.db``). A location is opened at first use.
        recall: recall episodes into the context.
        save: save an episode when a run ends.
        limit: at most this many episodes recalled.
        token_share: the share of the context window the recalled block may take (0 < share <= 0.5);
            the window is ``max_context_tokens``, else the provider's ``context_window``.
        max_tokens: the recalled block's tokens at most, whatever the window (also the budget when
            the window is unknown).
        max_context_tokens: the window in tokens (``None``: the provider's).
        min_score: leave out hits scoring below this (``None``: keep every hit; scores depend on the
            backend: see :class:`~fsm_agent.store.EpisodeHit`).
        tenant: the tenant of every episode (``None``: the session's ``metadata["tenant"]``, else
            ``"default"``).
        save_on: save only runs that stop for one of these reasons (``None``: every stop).
        max_steps: key steps kept per episode.
        steps_shown: key steps shown per recalled episode.

    Raises:
        ConfigurationError: an option out of range.
    """

    name = "memory"
    ordering = Ordering(wrapped_by=("compaction",), wraps=("repair", "redaction"))
    failure_policy = "isolate"

    def __init__(self, store: EpisodeStore | str | Path | None = None, *, recall: bool = True, save: bool = True,
                 limit: int = 3, token_share: float = 0.1, max_tokens: int = 2000,
                 max_context_tokens: int | None = None, min_score: float | None = None, tenant: str | None = None,
                 save_on: Iterable[StopReason] | None = None, max_steps: int = 12, steps_shown: int = 6) -> None:
        if store is not None and not isinstance(store, (EpisodeStore, str, Path)):
            raise ConfigurationError(f"store is an EpisodeStore or a location (path or DSN), not {store!r}")
        if isinstance(token_share, bool) or not isinstance(token_share, (int, float)) \
                or not 0 < token_share <= 0.5:
            raise ConfigurationError(f"token_share is a share of the context window, 0 < share <= 0.5, not "
                                     f"{token_share!r}")
        for what, value in (("limit", limit), ("max_tokens", max_tokens), ("max_steps", max_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{what} is a positive integer, not {value!r}")
        if max_context_tokens is not None and (not isinstance(max_context_tokens, int) or max_context_tokens < 1):
            raise ConfigurationError(f"max_context_tokens is a positive integer or None, not {max_context_tokens!r}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ConfigurationError(f"tenant is a non-empty string or None, not {tenant!r}")
        self._store = store if isinstance(store, EpisodeStore) else None
        self._location = None if isinstance(store, EpisodeStore) else store
        self.recall, self.save = recall, save
        self.limit, self.token_share, self.max_tokens = limit, float(token_share), max_tokens
        self.max_context_tokens, self.min_score, self.tenant = max_context_tokens, min_score, tenant
        self.save_on = None if save_on is None else frozenset(StopReason(r) for r in save_on)
        self.max_steps, self.steps_shown = max_steps, steps_shown

    def __repr__(self) -> str:
        where = self._store if self._store is not None else self._location
        return (f"EpisodicMemory({where!r}, limit={self.limit}, token_share={self.token_share:g}, "
                f"max_tokens={self.max_tokens})")

    @property
    def store(self) -> EpisodeStore:
        """The episode store (opened at first use when a location was given)."""
        if self._store is None:
            self._store = open_episode_store(self._location)
        return self._store

    async def aclose(self) -> None:
        """Close the store when this plugin opened it."""
        if self._store is not None and self._location is not None:
            await self._store.close()
            self._store = None

    # -- the effects (called through ctx.plugin_effect: recorded, replayed, run where effects run) ----
    async def recall_episodes(self, tenant: str, query: str, limit: int, exclude: list[str]) -> list[EpisodeHit]:
        """The ``tenant``'s best episodes for ``query`` (an effect of the run)."""
        return await self.store.search(tenant, query, limit=limit, exclude=exclude)

    async def save_episode(self, episode: Episode) -> Episode:
        """Save ``episode`` (an effect of the run)."""
        return await self.store.save(episode)

    # -- hooks ---------------------------------------------------------------------------------------
    def budget(self, ctx: RunContext) -> int:
        """Tokens the recalled block may take in this run."""
        window = self.max_context_tokens or ctx.provider.capabilities.context_window
        if not window:
            return self.max_tokens
        return max(0, min(self.max_tokens, math.floor(window * self.token_share)))

    def _tenant(self, ctx: RunContext) -> str:
        return self.tenant or _tenant_of(ctx.metadata)

    @staticmethod
    def _query(ctx: RunContext) -> str:
        users = [m.text for m in ctx.transcript if isinstance(m, UserMessage) and m.text.strip()]
        if not users:
            return ""
        asked = users[0] if len(users) == 1 or users[-1] == users[0] else f"{users[0]}\n{users[-1]}"
        return _cut(asked, 2000)

    async def pre_turn(self, ctx: RunContext) -> None:
        if not self.recall:
            return
        st = ctx.state(self)
        if "block" not in st:
            st["block"] = await self._recall(ctx)
        block = st["block"]
        if block:
            at = 0
            while at < len(ctx.messages) and isinstance(ctx.messages[at], SystemMessage):
                at += 1
            ctx.messages.insert(at, SystemMessage(block))

    async def _recall(self, ctx: RunContext) -> str | None:
        query = self._query(ctx)
        if not query:
            return None
        tenant, budget = self._tenant(ctx), self.budget(ctx)
        try:
            hits: list[EpisodeHit] = await ctx.plugin_effect(self, "recall_episodes", tenant, query, self.limit,
                                                             [ctx.session_id])
        except StoreError as exc:
            log.warning("session %s: memory recall failed: %s", ctx.session_id, exc)
            ctx.emit(MemoryRecalled(ctx.session_id, ctx.turn, tenant, _cut(query, 300), (), (), 0, budget,
                                    error=str(exc)))
            return None
        if self.min_score is not None:
            hits = [h for h in hits if h.score >= self.min_score]
        parts: list[str] = []
        chosen: list[EpisodeHit] = []
        skipped: list[str] = []
        for h in hits:
            for shown in (self.steps_shown, 0):  # whole, then without its steps
                text = h.episode.describe(steps=shown)
                if count_tokens("\n\n".join([RECALL_HEADER, *parts, text])) <= budget:
                    parts.append(text)
                    chosen.append(h)
                    break
            else:
                skipped.append(h.episode.episode_id)
        block = "\n\n".join([RECALL_HEADER, *parts]) if parts else None
        ctx.emit(MemoryRecalled(ctx.session_id, ctx.turn, tenant, _cut(query, 300),
                                tuple(h.episode.episode_id for h in chosen), tuple(h.score for h in chosen),
                                count_tokens(block) if block else 0, budget, tuple(skipped)))
        return block

    async def on_run_end(self, ctx: RunContext, result: RunResult) -> None:
        if not self.save or (self.save_on is not None and result.stop.reason not in self.save_on):
            return
        episode = episode_of(result, self._tenant(ctx), ctx.now(), max_steps=self.max_steps)
        try:
            await ctx.plugin_effect(self, "save_episode", episode)
        except StoreError as exc:
            log.warning("session %s: the episode was not saved: %s", ctx.session_id, exc)
