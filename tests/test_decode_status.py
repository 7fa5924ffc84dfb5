"""`fsm-agent decode --status N` classifies an error body exactly as the HTTP path does.

For every error body of the corpus manifest (status >= 400), the JSON that ``decode --status``
prints (class, kind, retryable, retry_after, message, status, code, provider) equals what the real
HTTP path raises when a ReplayServer answers a call with that status and body: the same mapping
function (``classify_error``) on the same bytes. Also with response headers (Retry-After in both
forms, ``retry-after-ms``, ``x-should-retry``) given as ``--header``.
"""

from __future__ import annotations

import email.utils
import io
import time

import orjson
import pytest

from corpus import CORPUS, bodies
from fsm_agent.cli import main
from fsm_agent.errors import ProviderError
from fsm_agent.providers import ProviderConfig, RetryPolicy
from fsm_agent.providers.decode import _PROFILES, decoder_for, error_info
from fsm_agent.providers.profiles import create_provider
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import MessageRequest, UserMessage

ERRORS = [b for b in bodies() if b.status >= 400]
REQUEST = MessageRequest(model="m", messages=(UserMessage("hi"),))


def decode_status(protocol: str, status: int, path: str, *headers: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["decode", "--protocol", protocol, "--status", str(status)]
    for h in headers:
        argv += ["--header", h]
    code = main([*argv, path], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


async def http_error(protocol: str, status: int, body: bytes, content_type: str,
                     headers: dict[str, str] | None = None, stream: bool = False) -> ProviderError:
    server = ReplayServer([RecordedResponse(status, body, content_type, headers=headers or {})])
    base = await server.start()
    provider = create_provider(_PROFILES[protocol], ProviderConfig(base_url=base, model="m", api_key="k",
                                                                   retry=RetryPolicy(max_attempts=1)))
    try:
        with pytest.raises(ProviderError) as info:
            if stream:
                async for _ in provider.chat_stream(REQUEST):
                    pass
            else:
                await provider.chat(REQUEST)
    finally:
        await provider.aclose()
        await server.close()
    return info.value


def test_the_manifest_has_error_bodies_of_every_protocol() -> None:
    assert {b.protocol for b in ERRORS} == set(_PROFILES)
    assert len(ERRORS) >= 25


@pytest.mark.parametrize("body", ERRORS, ids=lambda b: b.path)
async def test_decode_status_equals_the_http_path(body) -> None:
    code, out, err = decode_status(body.protocol, body.status, str(CORPUS / "bodies" / body.path))
    assert code == 0, err
    assert err == ""
    printed = orjson.loads(out)
    raised = await http_error(body.protocol, body.status, body.data, body.content_type, stream=body.streaming)
    assert printed == orjson.loads(orjson.dumps(error_info(raised)))
    assert printed["error"] == type(raised).__name__ and printed["kind"] == raised.kind
    assert printed["status"] == body.status


def _http_date(seconds_ahead: float) -> str:
    return email.utils.formatdate(time.time() + seconds_ahead, usegmt=True)


HEADER_CASES = [
    (429, {"retry-after": "17"}),
    (429, {"retry-after-ms": "2500"}),
    (503, {"retry-after": "4"}),
    (529, {"retry-after": "3", "x-should-retry": "false"}),
    (500, {"x-should-retry": "false"}),
    (400, {"x-should-retry": "true"}),
    (429, {"retry-after": "HTTP-DATE+120"}),
]


@pytest.mark.parametrize(("status", "headers"), HEADER_CASES, ids=[f"{s}-{'-'.join(h)}" for s, h in HEADER_CASES])
@pytest.mark.parametrize("protocol", list(_PROFILES))
async def test_headers_given_to_decode_act_as_on_the_http_path(protocol: str, status: int,
                                                                headers: dict[str, str], tmp_path) -> None:
    body = next(b for b in ERRORS if b.protocol == protocol)
    dated = "HTTP-DATE+120" in headers.values()
    headers = {k: (_http_date(120) if v == "HTTP-DATE+120" else v) for k, v in headers.items()}
    path = tmp_path / "body"
    path.write_bytes(body.data)
    code, out, err = decode_status(protocol, status, str(path), *(f"{k}: {v}" for k, v in headers.items()))
    assert code == 0, err
    printed = orjson.loads(out)
    raised = await http_error(protocol, status, body.data, body.content_type, headers)
    want = orjson.loads(orjson.dumps(error_info(raised)))
    if dated:  # an HTTP-date is measured against the clock: a second may pass between the two
        assert printed.pop("retry_after") == pytest.approx(want.pop("retry_after"), abs=2)
    assert printed == want
    if "x-should-retry" in headers:
        assert printed["retryable"] is (headers["x-should-retry"] == "true")


def test_the_output_names_class_kind_retryable_and_retry_after() -> None:
    body = next(b for b in ERRORS if b.status == 429 and b.protocol == "openai-chat")
    code, out, _ = decode_status("openai-chat", 429, str(CORPUS / "bodies" / body.path), "Retry-After: 9")
    info = orjson.loads(out)
    assert code == 0
    assert set(info) >= {"error", "kind", "retryable", "retry_after", "message", "status", "code", "provider"}
    assert info["retry_after"] == 9.0 and info["retryable"] is True
    assert info["provider"] == decoder_for("openai-chat").name


@pytest.mark.parametrize("raw", [b"", b"\x00\xff\xfe junk", b"<html><body>502 Bad Gateway</body></html>",
                                 b'{"error": 5}', b'{"error": {"message": ' + b"[" * 400 + b"]" * 400 + b"}}",
                                 b"[" * 2000 + b"]" * 2000],
                         ids=["empty", "binary", "html", "error-number", "deep-message", "too-deep"])
@pytest.mark.parametrize("status", [400, 429, 500, 503, 599])
async def test_any_error_body_is_classified_like_the_http_path(raw: bytes, status: int, tmp_path) -> None:
    path = tmp_path / "body"
    path.write_bytes(raw)
    code, out, err = decode_status("anthropic", status, str(path))
    assert code == 0 and err == ""
    raised = await http_error("anthropic", status, raw, "application/json")
    assert orjson.loads(out) == orjson.loads(orjson.dumps(error_info(raised)))


def test_a_status_below_400_decodes_the_body() -> None:
    body = next(b for b in bodies() if b.status == 200 and not b.streaming and b.protocol == "openai-chat")
    code, out, err = decode_status("openai-chat", 200, str(CORPUS / "bodies" / body.path))
    assert code == 0, err
    assert "message" in orjson.loads(out)


def test_a_header_needs_a_name_and_a_status(tmp_path) -> None:
    path = tmp_path / "body"
    path.write_bytes(b"{}")
    out, err = io.StringIO(), io.StringIO()
    assert main(["decode", "--protocol", "anthropic", "--status", "429", "--header", "nocolon", str(path)],
                out=out, err=err) == 2
    assert "NAME: VALUE" in err.getvalue()
    err = io.StringIO()
    assert main(["decode", "--protocol", "anthropic", "--header", "a: b", str(path)], out=out, err=err) == 2
    assert "--header goes with --status" in err.getvalue()
