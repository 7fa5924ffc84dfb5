"""The memory routes: the caller's tenant's episodes (episodic memory, :mod:`fsm_agent.store.episodes`).

* ``GET /memory/episodes?limit=N``: the tenant's episodes, the last saved first; ``?q=TEXT``: the
  ones that best match ``TEXT`` instead, best first, each with its ``score`` (what the ``memory``
  plugin would recall for a task).
* ``GET /memory/episodes/{eid}``: one episode.
* ``DELETE /memory/episodes/{eid}``: delete it (204).
* ``DELETE /memory/episodes?all=true``: delete every episode of the tenant (``{"deleted": N}``).

Tenants and sign-in are the other routes' (:mod:`fsm_agent.server.auth`): a caller sees and deletes
its own tenant's episodes only; another tenant's episode answers 404, as a session does. The episode
store is the one the served agent's ``memory`` plugin uses (or one set as ``app[MEMORY_KEY]`` before
the app starts); without either, these routes answer 404 saying so. A store that fails answers 503.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..errors import ConfigurationError, StoreError
from ..store.episodes import EpisodeStore
from ..types.codec import unstructure
from .http import Problem, json_response

__all__ = ["MEMORY_KEY", "add_memory_routes", "memory_of"]

MEMORY_KEY = web.AppKey("fsm_memory", EpisodeStore)
"""The episode store the memory routes serve, when set (else the served agent's ``memory`` plugin's)."""


def memory_of(agent: Any) -> EpisodeStore | None:
    """The episode store of ``agent``'s memory plugin (the first middleware whose ``store`` is an
    :class:`~fsm_agent.store.EpisodeStore`), or ``None``."""
    for m in getattr(agent, "middleware", ()):
        if getattr(m, "middleware_name", None) == "memory" or hasattr(m, "recall_episodes"):
            store = getattr(m, "store", None)
            if isinstance(store, EpisodeStore):
                return store
    return None


def _limit(raw: str, default: int, most: int) -> int:
    if raw == "":
        return default
    n = int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 7 else 0
    if not 1 <= n <= most:
        raise Problem(400, "Wrong field", f"limit must be between 1 and {most}")
    return n


def _check_eid(eid: str) -> str:
    if not eid or len(eid) > 200 or any(not c.isprintable() or c == "/" for c in eid):
        raise Problem(400, "Wrong field", "an episode id is 1 to 200 printable characters, without '/'")
    return eid


class _Routes:
    def __init__(self, tenant_key: Any, agent_key: Any) -> None:
        self.tenant_key, self.agent_key = tenant_key, agent_key

    def store(self, request: web.Request) -> EpisodeStore:
        app = request.app
        store = app.get(MEMORY_KEY)
        if store is None and self.agent_key is not None and self.agent_key in app:
            store = memory_of(app[self.agent_key])
        if store is None:
            raise Problem(404, "No memory", "this server keeps no episodic memory: serve an agent with the memory "
                                            "plugin (fsm_agent_middleware.memory.EpisodicMemory), or set "
                                            "app[MEMORY_KEY] to an episode store")
        return store

    async def call(self, request: web.Request, work: Callable[[EpisodeStore, str], Any]) -> Any:
        store = self.store(request)
        try:
            return await work(store, request[self.tenant_key])
        except StoreError as exc:
            raise Problem(503, "Memory unavailable", f"the episode store failed: {exc}",
                          {"Retry-After": "5"} if exc.transient else None) from exc
        except ConfigurationError as exc:
            raise Problem(400, "Wrong field", str(exc)) from exc

    async def list_episodes(self, request: web.Request) -> web.Response:
        q = request.query
        unknown = sorted(set(q) - {"limit", "q"})
        if unknown:
            raise Problem(400, "Unknown field", f"unknown query parameter(s) {', '.join(unknown)}; allowed: limit, q")
        text = q.get("q")
        if text is not None:
            if not text.strip() or len(text) > 4000:
                raise Problem(400, "Wrong field", "q is the text to search for: 1 to 4,000 characters")
            limit = _limit(q.get("limit", ""), 5, 100)
            hits = await self.call(request, lambda s, t: s.search(t, text, limit=limit))
            return json_response({"episodes": [{**unstructure(h.episode), "score": h.score} for h in hits]})
        limit = _limit(q.get("limit", ""), 50, 1000)
        episodes = await self.call(request, lambda s, t: s.list_episodes(tenant=t, limit=limit))
        return json_response({"episodes": [unstructure(e) for e in episodes]})

    async def get(self, request: web.Request) -> web.Response:
        eid = _check_eid(request.match_info["eid"])
        episode = await self.call(request, lambda s, t: s.get(eid, tenant=t))
        if episode is None:
            raise Problem(404, "Unknown episode", f"no episode {eid!r}")
        return json_response(unstructure(episode))

    async def delete(self, request: web.Request) -> web.Response:
        eid = _check_eid(request.match_info["eid"])
        if request.query:
            raise Problem(400, "Unknown field", "DELETE /memory/episodes/{eid} takes no query parameters")
        if not await self.call(request, lambda s, t: s.delete(eid, tenant=t)):
            raise Problem(404, "Unknown episode", f"no episode {eid!r}")
        return web.Response(status=204)

    async def delete_all(self, request: web.Request) -> web.Response:
        if dict(request.query) != {"all": "true"}:
            raise Problem(400, "Wrong field", "to delete every episode of your tenant, send DELETE "
                                              "/memory/episodes?all=true (one episode: /memory/episodes/{eid})")
        n = await self.call(request, lambda s, t: s.delete_tenant(t))
        return json_response({"deleted": n})


def add_memory_routes(app: web.Application, *, tenant_key: Any, agent_key: Any = None) -> None:
    """Register the memory routes on ``app`` (see the module doc). ``tenant_key``: the request key the
    app's auth middleware puts the caller's tenant under; ``agent_key``: the app key of the served
    agent (whose memory plugin's store is served unless ``app[MEMORY_KEY]`` is set)."""
    routes = _Routes(tenant_key, agent_key)
    app.router.add_get("/memory/episodes", routes.list_episodes)
    app.router.add_delete("/memory/episodes", routes.delete_all)
    app.router.add_get("/memory/episodes/{eid}", routes.get)
    app.router.add_delete("/memory/episodes/{eid}", routes.delete)
