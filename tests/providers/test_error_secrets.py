"""API keys a provider echoes in an error are scrubbed at the error boundary (issue 9, item 10).

The configured key (in any form: as given, JSON-escaped, URL-encoded) and every key-shaped token
(``sk-...``, ``sk-ant-...``, ``AIza...``, ``Bearer ...``, long hex and base64 secrets) are gone from
the error's message, body, headers and ``to_info()`` before anything is stored, logged or printed.

The leak test configures a distinctive key, has a real local server echo it in error bodies (401,
400, a retried 503, an error event inside a 200 stream) and in headers, and then looks for it in
the bytes of the SQLite store (database, WAL and shared-memory files), the log records, the
``fsm-agent run --json`` output and every other CLI message (the CLI run in-process).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_agent import Agent, ModelRetry, StopReason
from fsm_agent.cli import main
from fsm_agent.errors import ProviderError
from fsm_agent.providers import ProviderConfig, RetryPolicy, classify_error, create_provider, scrub_error, scrub_secrets
from fsm_agent.providers.errors import REDACTED
from fsm_agent.store import SQLiteStore
from fsm_agent.testing import RecordedResponse, ReplayServer

# -- the patterns ---------------------------------------------------------------------------------------
KEY_SHAPED = [
    "sk-proj-Abc123def456GHI789jkl012MNO345pqr678",
    "sk-ant-api03-abcdefghij1234567890ABCDEFGHIJ-_zyx",
    "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "sk-1234567890abcdef1234567890abcdef",          # DeepSeek's shape
    "gsk_AbCdEf0123456789GhIjKl0123456789",
    "xai-AbCdEf0123456789GhIjKl0123456789",
    "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345",
    "AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q",
    "0123456789abcdef0123456789abcdef01234567",     # 40 hex digits
    "QmFzZTY0U2VjcmV0S2V5VGhhdElzTG9uZ0Vub3VnaDEyMw==",  # base64, 48 characters
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
]


@pytest.mark.parametrize("token", KEY_SHAPED)
@pytest.mark.parametrize("wrap", ["{}", "Incorrect API key provided: {}.", '{{"key":"{}"}}', "key={}&x=1",
                                  "({})", "'{}'"])
def test_key_shaped_tokens_are_scrubbed_wherever_they_stand(token: str, wrap: str) -> None:
    text = wrap.format(token)
    out = scrub_secrets(text)
    assert token not in out and REDACTED in out


@pytest.mark.parametrize("text, kept", [
    ("Authorization: Bearer abc.def-ghi_jkl~mno-pqr", "Authorization: Bearer "),
    ('{"x-api-key": "my-very-own-secret"}', '{"x-api-key": "'),
    ("api_key=hunter2hunter2", "api_key="),
    ("client_secret: s3cr3t-v4lue", "client_secret: "),
])
def test_named_secrets_lose_their_value_and_keep_their_name(text: str, kept: str) -> None:
    out = scrub_secrets(text)
    assert out.startswith(kept) and REDACTED in out
    assert text[len(kept):].strip('"}') not in out


@pytest.mark.parametrize("text", [
    "This model's maximum context length is 128000 tokens. However, your messages resulted in 130015 tokens.",
    "Rate limit reached for gpt-4o in organization org-AbCdEf123 on requests per min (RPM): Limit 500.",
    "request id req_011CSHoEeqs5C35K2UUqR7Fy; trace 5ee1ad9c-1b2b-4b0f-9d1f-63e1c5a3d0b7",
    "Invalid value for 'messages[3].content': expected a string, got an array.",
    "tool_use ids were found without tool_result blocks immediately after: toolu_01A09q90qw90lq917835lq9",
    "https://api.example.com/v1/projects/my-project-name-1234/locations/us-central1/endpoints/openapi",
    "an_extremely_long_snake_case_identifier_name_that_is_not_a_secret_v2",
    "sha256 of the file is 9f86d081884c7d659a2feaa0c55ad015",  # 32 hex: a digest, below the 40 cut-off
    "Please pass a valid API key.",
    "You need to provide your API key in an Authorization header using Bearer auth.",
    "Bearer authentication is required for this endpoint",
])
def test_ordinary_error_wordings_are_left_alone(text: str) -> None:
    assert scrub_secrets(text) == text


def test_configured_secrets_are_scrubbed_in_every_form_and_short_ones_ignored() -> None:
    key = "plain words/and+symbols=="  # nothing key-shaped about it
    forms = [key, json.dumps(key), key.replace("/", "\\/"), urllib.parse.quote(key, safe=""),
             urllib.parse.quote_plus(key)]
    text = " | ".join(forms)
    out = scrub_secrets(text, [key])
    assert "words" not in out and "symbols" not in out and out.count(REDACTED) == len(forms)
    assert scrub_secrets("a k in the key", ["k"]) == "a k in the key"  # a placeholder key is not a secret


def test_classify_error_scrubs_message_body_headers_and_info() -> None:
    key = "not-key-shaped-but-configured-4711"
    body = json.dumps({"error": {"message": f"Incorrect API key provided: {key}; also saw sk-proj-{'x1' * 12}",
                                 "type": "invalid_request_error", "code": "invalid_api_key"}})
    err = classify_error(401, body.encode(), {"X-Echo": key, "Authorization": "Bearer zzz", "WWW-Authenticate":
                                              f"Bearer realm=api, token={key}"}, provider="p", secrets=[key])
    assert err.kind == "authentication" and not err.retryable  # classified before it was scrubbed
    dumped = json.dumps([str(err), err.message, err.body, err.headers, err.to_info(), err.args])
    assert key not in dumped and "x1x1x1" not in dumped
    assert err.headers["authorization"] == REDACTED and err.headers["x-echo"] == REDACTED


def test_scrub_error_works_in_place_on_any_provider_error() -> None:
    err = ProviderError("boom sk-ant-api03-AAAAAAAAAAAAAAAAAAAAAAAA", body="sk-ant-api03-AAAAAAAAAAAAAAAAAAAAAAAA")
    assert scrub_error(err) is err
    assert "AAAAAAAA" not in str(err) and "AAAAAAAA" not in err.body and "AAAAAAAA" not in repr(err.args)


# -- the leak test -----------------------------------------------------------------------------------------
KEYS = {
    "key-shaped": "sk-fsmleak-Q7x9Lm2Pz4Rt8Vw1Yb6Nc3Kd5Hf0Gj",
    "configured": "leaky passphrase 4711 zebra",  # found only because it is the configured key
}


def echoing(key: str) -> list[RecordedResponse]:
    """Errors that echo ``key``: a retried 503, then a 401 (both with the key in a header)."""
    hdrs = {"x-echo-key": key, "www-authenticate": f'Bearer realm="api", error="invalid_token", key="{key}"'}
    return [
        RecordedResponse(503, json.dumps({"error": {"message": f"upstream rejected Authorization: Bearer {key}",
                                                    "type": "server_error"}}).encode(),
                         headers={**hdrs, "retry-after": "0"}),
        RecordedResponse(401, json.dumps({"error": {"message": f"Incorrect API key provided: {key}.",
                                                    "type": "invalid_request_error", "code": "invalid_api_key",
                                                    "param": key}}).encode(), headers=hdrs),
    ]


def bad_request(key: str) -> RecordedResponse:
    return RecordedResponse(400, f"<html><body>Bad request: header x-api-key={key!r} ({key})</body></html>".encode(),
                            "text/html", headers={"x-echo-key": key})


def stream_error(key: str) -> RecordedResponse:
    body = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message","role":'
            b'"assistant","model":"m","content":[],"stop_reason":null,"usage":{"input_tokens":1,"output_tokens":1}}}'
            b'\n\nevent: error\ndata: ' + json.dumps({"type": "error", "error": {
                "type": "invalid_request_error", "message": f"key {key} is not allowed"}}).encode() + b"\n\n")
    return RecordedResponse(200, body, "text/event-stream", headers={"x-echo-key": key})


def _files(root: Path) -> Iterator[Path]:
    return (p for p in root.rglob("*") if p.is_file())


def assert_nowhere(key: str, *texts: str, files: tuple[Path, ...] = ()) -> None:
    needles = {key, json.dumps(key)[1:-1], key.replace(" ", "%20"), key.replace(" ", "+")}
    for t in texts:
        for n in needles:
            assert n not in t, f"the key leaked: {t[max(0, t.find(n) - 200): t.find(n) + 200]!r}"
    for root in files:
        for f in _files(root):
            data = f.read_bytes()
            for n in needles:
                assert n.encode() not in data, f"the key is in {f}"
                assert n.encode("utf-16-le") not in data


@pytest.mark.parametrize("which", sorted(KEYS))
async def test_an_echoed_key_reaches_neither_the_store_nor_the_logs(which: str, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    key = KEYS[which]
    caplog.set_level(logging.DEBUG)
    seen: list[Any] = []
    db = tmp_path / "store"
    db.mkdir()
    store = SQLiteStore(str(db / "sessions.db"))
    stops = []
    for protocol, responses in (("chat", echoing(key)), ("chat", [bad_request(key)]),
                                ("anthropic", [stream_error(key)])):
        server = ReplayServer(responses)
        base = await server.start()
        cfg = ProviderConfig(model="m", api_key=key, retry=RetryPolicy(initial_delay=0.01))
        if protocol == "anthropic":
            p = create_provider("anthropic", ProviderConfig(**{**_fields(cfg), "base_url": base + "/v1"}))
        else:
            p = create_provider("openai-compatible", ProviderConfig(**{**_fields(cfg), "base_url": base}))
        try:
            result = await Agent(p, store=store, observers=[seen.append]).run("hi")
        finally:
            await p.aclose()
            await server.close()
        stops.append(result.stop)
        assert result.stop.reason in (StopReason.FAILED_TERMINAL, StopReason.FAILED_RETRYABLE)
    assert [s.error["kind"] for s in stops] == ["authentication", "invalid_request", "invalid_request"]
    assert REDACTED in stops[0].detail and REDACTED in stops[1].detail
    retries = [e for e in seen if isinstance(e, ModelRetry)]
    assert len(retries) == 1 and REDACTED in retries[0].reason  # the retried 503 was announced, scrubbed
    texts = [repr(seen), repr(stops), caplog.text] + [r.getMessage() for r in caplog.records]
    assert_nowhere(key, *texts, files=(db,))
    close = getattr(store, "close", None)
    if close is not None:
        res = close()
        if asyncio.iscoroutine(res):
            await res
    assert_nowhere(key, files=(db,))


def _fields(cfg: ProviderConfig) -> dict[str, Any]:
    import attrs

    return {f.name: getattr(cfg, f.name) for f in attrs.fields(ProviderConfig)}


class ServerThread:
    """A ReplayServer on its own event loop in a thread (the CLI runs its own ``asyncio.run``)."""

    def __init__(self, responses: list[RecordedResponse]) -> None:
        self.server = ReplayServer(responses)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("which", sorted(KEYS))
def test_an_echoed_key_reaches_no_cli_output(which: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = KEYS[which]
    caplog.set_level(logging.DEBUG)
    store = tmp_path / "cli"
    store.mkdir()
    where = ("--store", str(store / "sessions.db"))
    texts: list[str] = []
    for responses, extra in ((echoing(key), ("--json",)), (echoing(key), ()), ([bad_request(key)], ("--json",)),
                             ([bad_request(key)], ("-v",))):
        with ServerThread(responses) as base:
            code, out, err = cli("run", "hi", "--provider", "openai-compatible", "--base-url", base, "--model", "m",
                                 "--api-key", key, *where, *extra)
        assert code in (5, 6, 7), (code, err)
        texts += [out, err]
        if "--json" in extra:
            assert json.loads(out)["stop"]["reason"].startswith("FAILED")
    assert any("authentication failed" in t and REDACTED in t for t in texts)
    assert any("! model call failed: server_error (HTTP 503); retry 1 in 0 s, as the server asked" in t
               for t in texts)  # the CLI shows each retry
    code, out, err = cli("sessions", "list", "--json", *where)
    texts += [out, err]
    for sid in [s["session_id"] for s in json.loads(out)]:
        for flags in (("--events",), ("--json",), ("--turns",)):
            code, out, err = cli("sessions", "show", sid, *flags, *where)
            assert code == 0, err
            texts += [out, err]
    assert any("model_retry" in t for t in texts)  # the retried 503 is in the log, scrubbed
    # decode --status prints what the HTTP path raises: a key-shaped key is scrubbed there too
    if which == "key-shaped":
        body = tmp_path / "body.json"
        body.write_bytes(echoing(key)[1].body)
        code, out, err = cli("decode", "--protocol", "openai-chat", "--status", "401", "--header",
                             f"x-echo-key: {key}", str(body))
        assert code == 0 and "authentication" in out
        texts += [out, err]
    assert_nowhere(key, *texts, caplog.text, files=(store,))
