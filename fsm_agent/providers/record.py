"""Record real provider traffic, credentials scrubbed, in the format
:class:`fsm_agent.testing.ReplayServer` serves (the HTTP client of :mod:`.http` calls the recorder;
both :class:`Recorder` and :func:`load_recording` are exported from :mod:`fsm_agent.testing`).

Format (the "json_req_resp_list" of ../shared/corpus, as the Anthropic SDK's inline snapshots use):
a JSON list of ``{"request": {"method", "url", "headers", "body"}, "response": {"status_code",
"headers", "body"}}``; a JSON request/response body is stored parsed, a streamed body as the raw
text. Secrets are removed before anything is written: credential headers (``authorization``,
``x-api-key``, ``api-key``, cookies, organization ids) become ``"REDACTED"``, as do credential
query parameters, and the API key's value wherever it appears in a body.

Turn it on with ``ProviderConfig(record_to="exchanges.json")``; replay with
``ReplayServer.from_recording("exchanges.json")``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

__all__ = ["SCRUBBED_HEADERS", "Recorder", "load_recording", "scrub_headers"]

SCRUBBED_HEADERS = frozenset({
    "authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key", "cookie", "set-cookie",
    "openai-organization", "openai-project", "anthropic-organization-id", "x-dashscope-apikey",
})
_QUERY_SECRET = re.compile(r"([?&](?:key|api_key|apikey|access_token|token)=)[^&#]*", re.I)


def scrub_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers with credential values replaced by ``REDACTED`` (names lower-cased)."""
    return {k.lower(): ("REDACTED" if k.lower() in SCRUBBED_HEADERS else v) for k, v in headers.items()}


def _body(raw: bytes, secrets: tuple[str, ...]) -> Any:
    text = raw.decode("utf-8", "replace")
    for s in secrets:
        if s:
            text = text.replace(s, "REDACTED")
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


class Recorder:
    """Appends scrubbed exchanges to a JSON file (thread-safe; one file per recorder)."""

    def __init__(self, path: str | Path, *, secrets: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        self.secrets = tuple(s for s in secrets if s)
        self._lock = threading.Lock()

    def __call__(self, url: str, request_headers: Mapping[str, str], request_body: bytes, status: int,
                 response_headers: Mapping[str, str], response_body: bytes) -> None:
        exchange = {
            "request": {"method": "POST", "url": _QUERY_SECRET.sub(r"\1REDACTED", url),
                        "headers": scrub_headers(request_headers), "body": _body(request_body, self.secrets)},
            "response": {"status_code": status, "headers": scrub_headers(response_headers),
                         "body": _body(response_body, self.secrets)},
        }
        with self._lock:
            data = load_recording(self.path) if self.path.exists() else []
            data.append(exchange)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))


def load_recording(path: str | Path) -> list[dict[str, Any]]:
    """The exchanges of a recording file."""
    data = orjson.loads(Path(path).read_bytes())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a recording is a JSON list of request/response exchanges")
    return data
