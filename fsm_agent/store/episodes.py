"""Episodic memory: what past runs did, kept per tenant and found again by ranked full-text search.

An :class:`Episode` is what one session came to: its goal, its outcome (the stop reason, the detail,
the answer), the key steps (tool calls with their arguments and results) and what failed. The
``memory`` plugin (``fsm_agent_middleware.memory``) saves one when a run ends and recalls the most
relevant ones into the context of a new run.

Two stores, beside the session store (the same SQLite file or PostgreSQL database by default, in
tables of their own, created by their own migrations): :class:`~fsm_agent.store.SQLiteEpisodeStore`
(SQLite FTS5, ranked by BM25) and :class:`~fsm_agent.store.PostgresEpisodeStore` (a ``tsvector``
with a GIN index, ranked by ``ts_rank``). :func:`~fsm_agent.store.open_episode_store` picks one from a
location as the CLI's ``--store`` does.

**Search.** Both stores index the same terms, made by :func:`search_terms`: words (letters and digits,
lower-cased; English words are stemmed by the database, so ``emails`` finds ``email``), and, for
Chinese, Japanese and Korean text, which has no spaces, every pair of adjacent characters (so the
query ``记忆`` finds ``长期记忆系统``). A query matches an episode that has *any* of its terms
(common English words such as ``the`` are left out); episodes that share more and rarer terms with
it, in the goal above the outcome above the steps, rank higher. The goal counts most.

**Embeddings** are an optional hook: give a store ``embed=`` (a function, sync or async, from a text
to a vector of floats) and it keeps a vector per episode; a search then also ranks the tenant's most
recent episodes (``vector_scan`` of them) by cosine similarity to the query's vector, and merges the
two rankings (reciprocal rank fusion), so an episode worded differently from the query can still be
found. Without ``embed`` nothing is computed.

**Tenants.** Every episode belongs to one tenant (the session's ``metadata["tenant"]``, else
``"default"``, as the server has it). Search, listing, reading and deleting take a tenant; listing,
reading and deleting without one (``tenant=None``) reach every tenant: that is the operator's view
(the CLI); the server always passes the caller's tenant.
"""

from __future__ import annotations

import abc
import functools
import inspect
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from attrs import field, frozen
from attrs.validators import instance_of, optional

from ..errors import ConfigurationError

__all__ = ["DEFAULT_TENANT", "Embed", "Episode", "EpisodeHit", "EpisodeStep", "EpisodeStore", "SearchTerms",
           "check_tenant", "search_terms"]

DEFAULT_TENANT = "default"
"""The tenant of a session without one (as :data:`fsm_agent.server.auth.DEFAULT_TENANT`)."""

Embed = Callable[[str], "Sequence[float] | Awaitable[Sequence[float]]"]
"""``embed(text) -> vector`` (or an awaitable of one): the optional embedding hook of a store."""


def _tuple(v: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(v)


@frozen
class EpisodeStep:
    """One key step of an episode: a tool call and what came of it."""

    tool: str = field(validator=instance_of(str))
    """The tool's name."""
    arguments: str = field(default="", validator=instance_of(str))
    """The call's arguments as compact JSON (cut to a few hundred characters)."""
    result: str = field(default="", validator=instance_of(str))
    """The result's text as the model got it (cut), or ``""`` when the call got none."""
    ok: bool = field(default=True, validator=instance_of(bool))
    """``False``: the call failed (an error result, denied, rejected)."""


@frozen
class Episode:
    """What one session came to (see the module doc). Times are Unix seconds."""

    episode_id: str = field(validator=instance_of(str))
    """Its id: the session's id when the ``memory`` plugin saved it (one episode per session, replaced
    as the session goes on)."""
    tenant: str = field(validator=instance_of(str))
    """The tenant it belongs to."""
    session_id: str = field(validator=instance_of(str))
    """The session it was made from."""
    goal: str = field(validator=instance_of(str))
    """What was asked (the session's first user message)."""
    outcome: str = field(validator=instance_of(str))
    """How the run ended: a StopReason's value (``COMPLETED``, ``FAILED_TERMINAL`` ...)."""
    detail: str = field(default="", validator=instance_of(str))
    """The stop's detail."""
    answer: str = field(default="", validator=instance_of(str))
    """The last answer (cut)."""
    steps: tuple[EpisodeStep, ...] = field(default=(), converter=_tuple)
    """The key steps, in order."""
    failures: tuple[str, ...] = field(default=(), converter=_tuple)
    """What failed: failed tool calls and a stop that was not COMPLETED, one line each."""
    turns: int = field(default=0, validator=instance_of(int))
    """Model calls made."""
    tool_calls: int = field(default=0, validator=instance_of(int))
    """Tool calls made."""
    cost_usd: float | None = field(default=None, validator=optional(instance_of((int, float))))
    """USD spent, or ``None`` when unknown."""
    created_at: float = field(default=0.0, validator=instance_of((int, float)))
    """When it was first saved (a later save of the same episode keeps it)."""
    updated_at: float = field(default=0.0, validator=instance_of((int, float)))
    """When it was last saved."""

    def __attrs_post_init__(self) -> None:
        check_id(self.episode_id, "episode id")
        check_tenant(self.tenant)
        if not all(isinstance(s, EpisodeStep) for s in self.steps):
            raise ConfigurationError("Episode.steps holds EpisodeStep values only")
        if not all(isinstance(f, str) for f in self.failures):
            raise ConfigurationError("Episode.failures holds strings only")

    def fields_text(self) -> tuple[str, str, str]:
        """The indexed text of the three ranked fields: goal; outcome (detail, answer, failures); steps."""
        outcome = "\n".join([self.outcome, self.detail, self.answer, *self.failures])
        steps = "\n".join(f"{s.tool} {s.arguments} {s.result}" for s in self.steps)
        return self.goal, outcome, steps

    def text(self) -> str:
        """All of its searchable text in one string (what an ``embed`` hook is given)."""
        return "\n".join(self.fields_text())

    def describe(self, *, steps: int | None = 8) -> str:
        """A few lines for a person or a model: goal, outcome, answer, up to ``steps`` key steps
        (``None``: all; ``0``: none) and what failed."""
        lines = [f"Goal: {_line(self.goal)}", f"Outcome: {self.outcome}" + (f" ({_line(self.detail)})"
                                                                           if self.detail else "")]
        if self.answer:
            lines.append(f"Answer: {_line(self.answer)}")
        shown = self.steps if steps is None else self.steps[:max(0, steps)]
        for s in shown:
            mark = "ok" if s.ok else "failed"
            lines.append(f"- {s.tool}({_line(s.arguments)}) {mark}: {_line(s.result)}")
        if len(shown) < len(self.steps):
            lines.append(f"- … {len(self.steps) - len(shown)} more step(s)")
        lines += [f"Failed: {_line(f)}" for f in self.failures]
        return "\n".join(lines)


def _line(text: str) -> str:
    """``text`` as one printable line (no control characters)."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


@frozen
class EpisodeHit:
    """One search result."""

    episode: Episode
    score: float
    """How well it matches, higher is better (comparable only within one search: BM25 on SQLite,
    ``ts_rank`` on PostgreSQL, a fused rank with ``embed``)."""


def check_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 200 or any(not c.isprintable() for c in value):
        raise ConfigurationError(f"a {what} is 1 to 200 printable characters, not {value!r}")
    return value


def check_tenant(tenant: Any) -> str:
    """``tenant`` when it is a valid tenant name (1 to 200 printable characters).

    Raises:
        ConfigurationError: it is not.
    """
    return check_id(tenant, "tenant")


def _check_limit(limit: Any, most: int = 1000) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= most:
        raise ConfigurationError(f"limit is an integer from 1 to {most}, not {limit!r}")
    return limit


# -- terms --------------------------------------------------------------------------------------
_CJK = "\u2e80-\u2fff\u3040-\u30ff\u3100-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKENS_RE = f"([{_CJK}]+)|((?:(?![{_CJK}])[^\\W_])+)"
_STOPWORDS = frozenset(
    "a an and are as at be but by for from has have he her his i if in into is it its me my no not of on or our "
    "she so that the their them then there these they this to was we were what when where which who whom why "
    "will with you your do does did can could would should shall may might must been being am how".split())
_MAX_TERM = 64


@functools.lru_cache(maxsize=1)
def _tokens() -> re.Pattern[str]:
    """The term pattern, compiled at first use (a few milliseconds that ``import fsm_agent`` need not pay)."""
    return re.compile(_TOKENS_RE)


@frozen
class SearchTerms:
    """The indexed or searched terms of a text: ``words`` (lower-cased; the database stems them) and
    ``grams`` (pairs of adjacent CJK characters, or a lone one)."""

    words: tuple[str, ...]
    grams: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not self.words and not self.grams

    def as_text(self) -> str:
        """One space-separated string of every term (what SQLite's tokenizer reads)."""
        return " ".join((*self.words, *self.grams))


def search_terms(text: str, *, query: bool = False, most: int = 64) -> SearchTerms:
    """The terms of ``text`` (see the module doc). ``query``: terms of a search, each once, common
    English words left out, at most ``most`` of them, in the order they came."""
    words: list[str] = []
    grams: list[str] = []
    for cjk, word in _tokens().findall(text.lower()):
        if cjk:
            grams.extend(cjk if len(cjk) == 1 else (cjk[i:i + 2] for i in range(len(cjk) - 1)))
        elif len(word) <= _MAX_TERM and not (query and word in _STOPWORDS):
            words.append(word)
    if query:
        words, grams = list(dict.fromkeys(words)), list(dict.fromkeys(grams))
        while len(words) + len(grams) > most:
            (words if len(words) >= len(grams) else grams).pop()
    return SearchTerms(tuple(words), tuple(grams))


# -- the store ------------------------------------------------------------------------------------
class EpisodeStore(abc.ABC):
    """Where episodes live (see the module doc).

    Args:
        embed: the optional embedding hook (see the module doc), or ``None``.
        vector_scan: with ``embed``, how many of the tenant's most recent episodes a search ranks by
            their vectors.

    Every method raises :class:`~fsm_agent.errors.StoreError` when the database fails, and
    :class:`~fsm_agent.errors.ConfigurationError` for bad arguments (an empty tenant, a limit out of
    range), naming what was wrong.
    """

    location: str
    """The file path or DSN (without its password), as errors name it."""

    def __init__(self, *, embed: Embed | None = None, vector_scan: int = 2000) -> None:
        if embed is not None and not callable(embed):
            raise ConfigurationError(f"embed must be a function from a text to a vector of floats, not {embed!r}")
        self.embed = embed
        self.vector_scan = _check_limit(vector_scan, 1_000_000)

    async def _vector(self, text: str) -> list[float] | None:
        if self.embed is None:
            return None
        out = self.embed(text)
        if inspect.isawaitable(out):
            out = await out
        try:
            vec = [float(x) for x in out]
        except (TypeError, ValueError):
            raise ConfigurationError(f"embed returned {type(out).__name__}, not a sequence of floats") from None
        if not vec or not all(math.isfinite(x) for x in vec):
            raise ConfigurationError("embed returned an empty vector or one with a NaN or an infinity")
        return vec

    # -- the public API ---------------------------------------------------------------------------
    async def save(self, episode: Episode) -> Episode:
        """Save ``episode``, replacing the one of the same id (its ``created_at`` is kept); returns it as stored.

        Raises:
            ConfigurationError: an episode of that id belongs to another tenant.
        """
        if not isinstance(episode, Episode):
            raise ConfigurationError(f"save takes an Episode, not {type(episode).__name__}")
        return await self._save(episode, await self._vector(episode.text()))

    async def search(self, tenant: str, query: str, *, limit: int = 5, exclude: Sequence[str] = ()) -> list[EpisodeHit]:
        """The ``tenant``'s episodes that best match ``query``, best first, at most ``limit``;
        ``exclude``: episode ids to leave out (the current session's own). A query with no usable
        term finds nothing (unless ``embed`` is set)."""
        check_tenant(tenant)
        _check_limit(limit)
        if not isinstance(query, str):
            raise ConfigurationError(f"query is a string, not {type(query).__name__}")
        excluded = tuple(exclude)
        terms = search_terms(query, query=True)
        found = [] if terms.empty else await self._text_search(tenant, terms, limit * 4 if self.embed else limit,
                                                               excluded)
        qvec = await self._vector(query) if self.embed is not None and query.strip() else None
        if qvec is None:
            return found[:limit]
        near = []
        for episode, vec in await self._vectors(tenant, self.vector_scan, excluded):
            if len(vec) == len(qvec):
                near.append((_cosine(qvec, vec), episode))
        near.sort(key=lambda p: (-p[0], -p[1].updated_at))
        fused: dict[str, list[Any]] = {}
        for ranking in ([h.episode for h in found], [e for s, e in near if s > 0][:limit * 4]):
            for rank, e in enumerate(ranking):
                entry = fused.setdefault(e.episode_id, [0.0, e])
                entry[0] += 1.0 / (60 + rank + 1)
        best = sorted(fused.values(), key=lambda p: (-p[0], -p[1].updated_at))[:limit]
        return [EpisodeHit(e, round(s, 9)) for s, e in best]

    async def get(self, episode_id: str, *, tenant: str | None = None) -> Episode | None:
        """The episode ``episode_id`` (of ``tenant``; ``None``: of any tenant), or ``None``."""
        if tenant is not None:
            check_tenant(tenant)
        return await self._get(check_id(episode_id, "episode id"), tenant)

    async def list_episodes(self, *, tenant: str | None = None, limit: int = 50) -> list[Episode]:
        """The newest episodes first (last saved first), of ``tenant`` (``None``: of every tenant)."""
        if tenant is not None:
            check_tenant(tenant)
        return await self._list(tenant, _check_limit(limit, 10_000))

    async def delete(self, episode_id: str, *, tenant: str | None = None) -> bool:
        """Delete the episode ``episode_id`` (of ``tenant``; ``None``: of any tenant); ``False`` when
        there was none."""
        if tenant is not None:
            check_tenant(tenant)
        return await self._delete(check_id(episode_id, "episode id"), tenant)

    async def delete_tenant(self, tenant: str) -> int:
        """Delete every episode of ``tenant``; returns how many there were."""
        return await self._delete_tenant(check_tenant(tenant))

    async def close(self) -> None:
        """Release the connection(s)."""

    async def __aenter__(self) -> EpisodeStore:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- what a backend implements ----------------------------------------------------------------
    @abc.abstractmethod
    async def _save(self, episode: Episode, vector: list[float] | None) -> Episode: ...

    @abc.abstractmethod
    async def _text_search(self, tenant: str, terms: SearchTerms, limit: int, exclude: tuple[str, ...]
                           ) -> list[EpisodeHit]: ...

    @abc.abstractmethod
    async def _vectors(self, tenant: str, limit: int, exclude: tuple[str, ...]) -> list[tuple[Episode, list[float]]]:
        """The tenant's ``limit`` most recent episodes that have a vector, with it."""

    @abc.abstractmethod
    async def _get(self, episode_id: str, tenant: str | None) -> Episode | None: ...

    @abc.abstractmethod
    async def _list(self, tenant: str | None, limit: int) -> list[Episode]: ...

    @abc.abstractmethod
    async def _delete(self, episode_id: str, tenant: str | None) -> bool: ...

    @abc.abstractmethod
    async def _delete_tenant(self, tenant: str) -> int: ...


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0
