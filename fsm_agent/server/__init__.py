"""The HTTP server: sessions over HTTP, a live SSE event stream that replays the log after
``Last-Event-ID``, idempotent approvals and control, the review page, tenants, and workers across
hosts on PostgreSQL.

* :func:`create_app` — the ``aiohttp.web`` app (:mod:`fsm_agent.server.app`);
* :mod:`fsm_agent.server.sse` — the SSE wire format; :mod:`fsm_agent.server.notify` — wake-ups;
* :mod:`fsm_agent.server.runs` — who drives runs (:class:`LocalRunner`, in process);
* :mod:`fsm_agent.server.auth` — tenants, tokens, cookies, CSRF, CORS;
* :mod:`fsm_agent.server.queue` and :mod:`fsm_agent.server.worker` — runs queued on PostgreSQL for
  ``fsm-agent worker`` processes on many hosts (they need ``asyncpg``: imported on demand).

``docs/server.md`` describes the routes.
"""

from __future__ import annotations

from .app import create_app
from .auth import Tenants, check_bind
from .notify import LiveDeltas, Notifier, NotifyingStore
from .runs import LocalRunner, RunRequest, Runner, execute
from .sse import ClientGone, SSEWriter, encode_frame, event_frame, event_json

__all__ = ["ClientGone", "LiveDeltas", "LocalRunner", "Notifier", "NotifyingStore", "RunRequest", "Runner",
           "SSEWriter", "Tenants", "check_bind", "create_app", "encode_frame", "event_frame", "event_json", "execute"]
