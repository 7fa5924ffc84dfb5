"""The HTTP server (issue 10, foundation): an ``aiohttp.web`` app over a session store, with an SSE
event stream that replays the log after ``Last-Event-ID`` and then tails it live.

See :mod:`fsm_agent.server.sse` (the wire format) and :mod:`fsm_agent.server.app` (the routes).
"""

from __future__ import annotations

from .app import Notifier, NotifyingStore, create_app
from .sse import ClientGone, SSEWriter, encode_frame, event_frame, event_json

__all__ = ["ClientGone", "Notifier", "NotifyingStore", "SSEWriter", "create_app", "encode_frame", "event_frame",
           "event_json"]
