"""The one boundary where provider failures become :mod:`fsm_agent.errors` classes.

* :func:`classify_error` maps an HTTP status plus an error body (any provider's
  shape) to the most specific :class:`~fsm_agent.errors.ProviderError`.
* :func:`error_from_payload` does the same for an error object found inside a
  200 stream (Anthropic ``event: error``, llama.cpp ``data: {"error": ...}``,
  Responses ``response.failed``).
* :func:`map_transport_errors` is the context manager that turns aiohttp and
  asyncio exceptions into :class:`ProviderConnectionError` /
  :class:`ProviderTimeoutError`, always ``raise ... from exc``.

Context-window errors are recognized across wordings and statuses (case B20):
OpenAI ``code: context_length_exceeded``; Azure "Input tokens exceed the
configured limit"; Anthropic "prompt is too long" and "input length and
`max_tokens` exceed context limit"; vLLM "maximum context length is N";
llama.cpp "exceeds the available context size" (also mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import re
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import orjson

from ..errors import (
    AuthenticationError,
    ContentFilteredError,
    ContextLengthExceededError,
    InvalidHistoryError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    ProviderConnectionError,
    ProviderError,
    ProviderTimeoutError,
    QuotaExceededError,
    RateLimitError,
    RateLimitRequestTooLargeError,
    RequestTooLargeError,
    ServerError,
    StreamError,
)

__all__ = [
    "REDACTED",
    "classify_error",
    "error_from_payload",
    "map_transport_errors",
    "parse_retry_after",
    "scrub_error",
    "scrub_secrets",
]

_BODY_LIMIT = 64 * 1024

# (pattern, groups meaning) — numbers are pulled out where the wording has them.
_CTX_PATTERNS: list[tuple[re.Pattern[str], tuple[str, ...]]] = [
    (re.compile(r"input length and `?max_tokens`? exceed context limit:\s*(\d+)\s*\+\s*(\d+)\s*>\s*(\d+)", re.I),
     ("input_tokens", "max_tokens_requested", "limit")),
    (re.compile(r"prompt is too long:\s*(\d+)\s*tokens?\s*>\s*(\d+)", re.I), ("requested", "limit")),
    (re.compile(r"maximum context length is\s*(\d+)\s*tokens?.*?(?:resulted in|requested)\s*(\d+)\s*tokens", re.I | re.S),
     ("limit", "requested")),
    (re.compile(r"input tokens exceed the configured limit of\s*(\d+)\s*tokens?.*?resulted in\s*(\d+)\s*tokens", re.I | re.S),
     ("limit", "requested")),
    (re.compile(r"maximum context length is\s*(\d+)", re.I), ("limit",)),
    (re.compile(r"context (?:window|length|size)[^.]*?(?:of|is)\s*(\d+)\s*tokens", re.I), ("limit",)),
    (re.compile(r"exceeds? the (?:available )?context (?:size|window|length)", re.I), ()),
    (re.compile(r"context[_ ]length[_ ]exceeded", re.I), ()),
    (re.compile(r"(?:request|input|prompt)[^.]{0,40}(?:too long|too many tokens)[^.]{0,40}context", re.I), ()),
    (re.compile(r"Range of input length should be \[\d+,\s*(\d+)\]", re.I), ("limit",)),
]
_CTX_CODES = {"context_length_exceeded", "exceed_context_size_error", "context_window_exceeded",
              "model_context_window_exceeded", "string_above_max_length"}
_HISTORY_PATTERNS = [
    re.compile(r"tool_use`? ids were found without `?tool_result", re.I),
    re.compile(r"tool_result`? block\(s\)? .*?(?:corresponding|matching) `?tool_use", re.I),
    re.compile(r"unexpected `?tool_use_id`?", re.I),
    re.compile(r"messages with role 'tool' must be a response to a preceeding message with 'tool_calls'", re.I),
    re.compile(r"an assistant message with 'tool_calls' must be followed by tool messages", re.I),
    re.compile(r"No tool call found for function call output", re.I),
    re.compile(r"No tool output found for (?:tool|function) call", re.I),
    re.compile(r"was provided without its required '?reasoning'? item", re.I),
    re.compile(r"reasoning'? was provided without its required following item", re.I),
    re.compile(r"reasoning_content.{0,40}must be passed back", re.I),
    re.compile(r"text content blocks must be non-empty", re.I),
]
_LOOSE_FIELD = re.compile(r"""['"](message|code|type)['"]\s*:\s*['"]([^'"]{1,500})['"]""")
_TRY_AGAIN = re.compile(r"try again in\s*(\d+(?:\.\d+)?)\s*(ms|s|seconds?)\b", re.I)
_TPM = re.compile(r"request too large .*?(?:tokens per min|TPM)", re.I | re.S)
_FILTER_CODES = {"content_filter", "content_policy_violation", "data_inspection_failed", "content_filtered"}


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms``, or ``retry-after`` (seconds or an HTTP-date); ``None`` if absent.

    Header names must be lower-cased. Negative and unparsable values give ``None``.

    An HTTP-date is measured against the response's own ``Date`` header when it has a valid one, so
    that the skew between the server's clock and the local one does not count (RFC 9110 §10.2.3:
    both dates come from the server's clock). Only without a ``Date`` header is it measured against
    ``now`` (Unix seconds; default: the local clock). A date in the past gives 0.
    """
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            v = float(ms) / 1000.0
            if v >= 0:
                return v
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if not ra:
        return None
    ra = ra.strip()
    try:
        v = float(ra)
        return v if v >= 0 else None
    except ValueError:
        pass
    when = _http_date(ra)
    if when is None:
        return None
    served = _http_date(headers.get("date") or "")
    if served is None:
        served = time.time() if now is None else now
    return max(0.0, when - served)


def _http_date(value: str) -> float | None:
    """Unix seconds of an HTTP-date (IMF-fixdate, RFC 850 or asctime), or ``None``."""
    if not value:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    try:
        if when.tzinfo is None:  # asctime has no zone; HTTP dates are always GMT
            when = when.replace(tzinfo=datetime.timezone.utc)
        return when.timestamp()
    except (OverflowError, OSError, ValueError):
        return None


# -- secrets echoed in error responses --------------------------------------------------------------
REDACTED = "[REDACTED]"
"""What a scrubbed secret is replaced with."""

_KEY_SHAPES: tuple[tuple[re.Pattern[str], str], ...] = (
    # an Authorization value echoed back: "Bearer <token>" (the scheme is kept)
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/-]{16,}=*"), rf"\1{REDACTED}"),
    # "api_key=...", "x-api-key: ...", "access_token": "..." (the name is kept)
    (re.compile(r"""(?i)\b((?:x-)?(?:api[_-]?key|access[_-]?token|auth[_-]?token|secret[_-]?key|client[_-]?secret)"""
                r"""["']?\s*[:=]\s*["']?)[^\s"',;&<>]{8,}"""), rf"\1{REDACTED}"),
    # vendor-prefixed keys: OpenAI / DeepSeek / OpenRouter / Anthropic (sk-..., sk-proj-..., sk-or-v1-...,
    # sk-ant-api03-...), Groq gsk_, xAI xai-, Perplexity pplx-, NVIDIA nvapi-, Hugging Face hf_
    (re.compile(r"\b(?:sk|gsk|xai|pplx|nvapi|hf)[-_][A-Za-z0-9_-]{16,}"), REDACTED),
    # Google API keys
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}"), REDACTED),
    # JSON Web Tokens
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), REDACTED),
    # 40 or more hex digits (160+ bits: longer than request ids and UUIDs)
    (re.compile(r"(?<![0-9A-Za-z])[0-9a-fA-F]{40,}(?![0-9A-Za-z])"), REDACTED),
    # 40 or more base64 characters mixing upper case, lower case and digits, unbroken by "_", "-" or "."
    # (so snake_case names, paths and hostnames are kept)
    (re.compile(r"(?<![A-Za-z0-9+/])(?=[A-Za-z0-9+/]*[0-9])(?=[A-Za-z0-9+/]*[a-z])(?=[A-Za-z0-9+/]*[A-Z])"
                r"[A-Za-z0-9+/]{40,}={0,2}"), REDACTED),
)
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key",
                             "cookie", "set-cookie"})
_MIN_SECRET = 8
"""Configured secrets shorter than this are not searched for (a placeholder key such as ``"k"``
would otherwise blank every letter k)."""


def scrub_secrets(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every configured secret and every key-shaped token replaced by :data:`REDACTED`.

    ``secrets`` (the configured API key, secret header values) are removed as given, JSON-escaped
    (also with ``\\/``) and URL-encoded; those under 8 characters are ignored. Key-shaped tokens,
    whatever key they are, are removed by deliberately conservative patterns (few false positives,
    so error messages stay readable):

    * ``Bearer <token>`` (16+ characters), and the value (8+ characters) after a name that says it
      is a secret (``api_key=``, ``x-api-key:``, ``"access_token": "``, ``auth_token``,
      ``secret_key``, ``client_secret``);
    * vendor-prefixed keys: ``sk-`` (OpenAI, DeepSeek, OpenRouter ``sk-or-``, Anthropic
      ``sk-ant-``), ``gsk_`` (Groq), ``xai-``, ``pplx-``, ``nvapi-``, ``hf_``, each followed by 16+
      key characters; Google's ``AIza`` + 35; JSON Web Tokens (``eyJ...``);
    * 40 or more hex digits, and 40 or more base64 characters that mix upper case, lower case and
      digits (UUIDs, request ids and identifiers are shorter or broken by ``-``, ``_``, ``.``).
    """
    if not text:
        return text
    for secret in _variants(secrets):
        if secret in text:
            text = text.replace(secret, REDACTED)
    for pattern, repl in _KEY_SHAPES:
        text = pattern.sub(repl, text)
    return text


def _variants(secrets: Iterable[str]) -> list[str]:
    out: list[str] = []
    for s in secrets:
        if not s or len(s) < _MIN_SECRET:
            continue
        escaped = orjson.dumps(s).decode()[1:-1]
        for v in (s, escaped, escaped.replace("/", "\\/"), urllib.parse.quote(s, safe=""), urllib.parse.quote_plus(s)):
            if v not in out:
                out.append(v)
    return sorted(out, key=len, reverse=True)  # an escaped form may contain the plain one


def scrub_error(error: ProviderError, secrets: Iterable[str] = ()) -> ProviderError:
    """Remove secrets (see :func:`scrub_secrets`) from ``error``'s message, body, headers and code,
    in place, before it is stored, logged or printed; returns ``error``.

    Header values whose name carries credentials (``authorization``, ``x-api-key``, ``cookie`` ...)
    are replaced whole."""
    secrets = tuple(secrets)
    error.message = scrub_secrets(error.message, secrets)
    if error.args and isinstance(error.args[0], str):
        error.args = (error.message, *error.args[1:])
    if error.body:
        error.body = scrub_secrets(error.body, secrets)
    if error.code:
        error.code = scrub_secrets(error.code, secrets)
    if error.headers:
        error.headers = {k: REDACTED if k in _SECRET_HEADERS else scrub_secrets(v, secrets)
                         for k, v in error.headers.items()}
    return error


def _extract(body: Any) -> tuple[str, str | None, str | None]:
    """(message, code, type) from any provider's error body shape."""
    if isinstance(body, (bytes, str)):
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        try:
            body = orjson.loads(text) if text.strip() else None
        except orjson.JSONDecodeError:
            # not JSON (an HTML page, a gateway's Python repr of the error): pull the usual fields out
            fields = {k: v for k, v in _LOOSE_FIELD.findall(text)}
            message = fields.get("message") or text.strip()[:2000]
            return message, fields.get("code"), fields.get("type")
    if isinstance(body, list) and body and isinstance(body[0], dict):  # some gateways wrap in a list
        body = body[0]
    if not isinstance(body, dict):
        return ("" if body is None else _text(body)), None, None
    err = body.get("error", body)
    if isinstance(err, str):
        return err, _s(body.get("code")), _s(body.get("type"))
    if not isinstance(err, dict):
        err = body
    message = err.get("message") or body.get("message") or body.get("detail") or ""
    if isinstance(message, (dict, list)):
        message = _text(message)
    code = _s(err.get("code")) or _s(body.get("code"))
    etype = _s(err.get("type")) or _s(body.get("type"))
    if etype == "error":  # Anthropic wraps {"type":"error","error":{"type":...}}
        etype = _s(err.get("type"))
    # OpenRouter puts the upstream's error in metadata.raw
    meta = err.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("raw"), str):
        message = f"{message} ({meta['raw'][:500]})"
    return str(message), code, etype


def _s(v: Any) -> str | None:
    if v is None:
        return None
    return v if isinstance(v, str) else _text(v)


def _text(v: Any, limit: int = _BODY_LIMIT) -> str:
    """``v`` as text: JSON for containers and numbers; never raises (orjson writes at most 254
    levels of nesting, ``str`` recurses: a hostile body may nest deeper)."""
    if isinstance(v, str):
        return v[:limit]
    try:
        return orjson.dumps(v).decode()[:limit]
    except (TypeError, orjson.JSONEncodeError):
        return f"<{type(v).__name__} nested too deep to show>"


def _context_error(message: str, code: str | None, etype: str | None, kw: dict[str, Any]) -> ContextLengthExceededError | None:
    hit = (code or "").lower() in _CTX_CODES or (etype or "").lower() in _CTX_CODES
    nums: dict[str, int] = {}
    for pattern, names in _CTX_PATTERNS:
        m = pattern.search(message)
        if m:
            hit = True
            for name, value in zip(names, m.groups()):
                nums.setdefault(name, int(value))
            if nums.get("limit") is not None and (nums.get("requested") is not None or "requested" not in names):
                break
    if not hit:
        return None
    if "requested" not in nums and "input_tokens" in nums and "max_tokens_requested" in nums:
        nums["requested"] = nums["input_tokens"] + nums["max_tokens_requested"]
    hint = " Trim the history (the repair pipeline does this with a tighter budget) or use a model with a larger window."
    if "max_tokens_requested" in nums and "limit" in nums and "input_tokens" in nums:
        hint = f" Lowering max_tokens to {nums['limit'] - nums['input_tokens']} or less is enough; no trimming needed."
    return ContextLengthExceededError(f"context length exceeded: {message}.{hint}", **nums, **kw)


def classify_error(
    status: int | None,
    body: Any,
    headers: Mapping[str, str] | None = None,
    *,
    provider: str | None = None,
    in_stream: bool = False,
    secrets: Iterable[str] = (),
) -> ProviderError:
    """The most specific :class:`ProviderError` for an error response.

    A server's explicit ``x-should-retry: true|false`` header (Anthropic, OpenAI) overrides the
    class's retryable default. A ``Retry-After`` on any error is kept as its ``retry_after``
    (seconds). The error comes back scrubbed (:func:`scrub_error`): ``secrets`` and every key-shaped
    token are gone from its message, body and headers.

    Args:
        status: HTTP status (``None`` or 200 for an error found inside a stream).
        body: the error body as bytes, text or parsed JSON (any provider's shape).
        headers: response headers (any case).
        provider: profile name recorded on the error.
        in_stream: the error arrived inside a 200 stream; unrecognized ones become :class:`StreamError`.
        secrets: values to remove besides key-shaped tokens (the configured API key).
    """
    err = _classify(status, body, headers, provider=provider, in_stream=in_stream)
    hdrs = {k.lower(): v for k, v in (headers or {}).items()}
    should = hdrs.get("x-should-retry", "").strip().lower()
    if should in ("true", "false"):
        err.retryable = should == "true"
    if err.retry_after is None and hdrs:
        err.retry_after = parse_retry_after(hdrs)
    return scrub_error(err, secrets)


def _classify(
    status: int | None,
    body: Any,
    headers: Mapping[str, str] | None,
    *,
    provider: str | None,
    in_stream: bool,
) -> ProviderError:
    hdrs = {k.lower(): v for k, v in (headers or {}).items()}
    if isinstance(body, bytes):
        body_text = body[:_BODY_LIMIT].decode("utf-8", "replace")
    elif isinstance(body, str):
        body_text = body[:_BODY_LIMIT]
    elif body is None:
        body_text = None
    else:
        body_text = _text(body)
    message, code, etype = _extract(body if body is not None else "")
    if not message:
        message = f"HTTP {status}" if status else "error"
    # Numeric "code" fields (OpenRouter, llama.cpp) echo the status.
    eff_status = status
    if (eff_status is None or eff_status == 200) and code and code.isdigit():
        eff_status = int(code)
    kw: dict[str, Any] = {"provider": provider, "status": status, "body": body_text, "headers": hdrs,
                          "code": code or etype}
    lower_type = (etype or "").lower()
    lower_code = (code or "").lower()

    ctx = _context_error(message, code, etype, kw)
    if ctx is not None and eff_status not in (429,):
        return ctx
    if any(p.search(message) for p in _HISTORY_PATTERNS):
        return InvalidHistoryError(f"invalid message history: {message}", **kw)
    if eff_status == 429 or lower_type in ("rate_limit_error", "tokens", "requests") or lower_code == "rate_limit_exceeded":
        if _TPM.search(message):
            return RateLimitRequestTooLargeError(
                f"request too large for the per-minute token limit: {message} "
                "(waiting will not help; send a smaller request or raise the limit)", **kw)
        if lower_code == "insufficient_quota" or lower_type == "insufficient_quota":
            return QuotaExceededError(f"quota exhausted: {message} (check the account's plan and billing)", **kw)
        retry_after = parse_retry_after(hdrs)
        if retry_after is None:
            m = _TRY_AGAIN.search(message)
            if m:
                retry_after = float(m.group(1)) / (1000.0 if m.group(2).lower() == "ms" else 1.0)
        return RateLimitError(f"rate limited: {message}", retry_after=retry_after, **kw)
    if eff_status == 402 or lower_code == "insufficient_quota" or lower_type == "insufficient_quota":
        return QuotaExceededError(f"quota exhausted: {message} (check the account's plan and billing)", **kw)
    if eff_status == 529 or lower_type in ("overloaded_error", "overloaded") or "overloaded" in message.lower() and eff_status in (503, 529, None, 200):
        return OverloadedError(f"provider overloaded: {message}", **kw)
    if lower_code in _FILTER_CODES or lower_type in _FILTER_CODES:
        return ContentFilteredError(f"content filtered: {message}", **kw)
    if eff_status == 401 or lower_type == "authentication_error" or lower_code == "invalid_api_key":
        return AuthenticationError(f"authentication failed: {message} (check the API key)", **kw)
    if eff_status == 403 or lower_type == "permission_error":
        return PermissionDeniedError(f"permission denied: {message}", **kw)
    if eff_status == 404 or lower_type == "not_found_error" or lower_code == "model_not_found":
        return NotFoundError(f"not found: {message} (check the model name and base URL)", **kw)
    if eff_status == 413 or lower_type == "request_too_large":
        return RequestTooLargeError(f"request too large: {message}", **kw)
    if eff_status in (400, 422) or lower_type in ("invalid_request_error", "badrequesterror"):
        return InvalidRequestError(f"invalid request: {message}", **kw)
    if (eff_status is not None and eff_status >= 500 or lower_type in ("api_error", "server_error")
            or lower_code in ("api_error", "server_error")):
        return ServerError(f"server error: {message}", **kw)
    if in_stream:
        return StreamError(f"error inside the stream: {message}", **kw)
    if eff_status == 408:
        return ProviderTimeoutError(f"request timeout: {message}", **kw)
    return ProviderError(f"unexpected error response: {message}", **kw)


def error_from_payload(payload: Any, *, provider: str | None = None, status: int | None = 200) -> ProviderError:
    """Classify an error object found inside a stream (never a success)."""
    return classify_error(status, payload, None, provider=provider, in_stream=True)


@contextlib.contextmanager
def map_transport_errors(provider: str | None, what: str) -> Iterator[None]:
    """Translate aiohttp/asyncio failures inside the block into typed provider errors."""
    import aiohttp  # imported here: `import fsm_agent` stays light when no HTTP provider is used

    try:
        yield
    except ProviderError:
        raise
    except asyncio.TimeoutError as exc:  # also TimeoutError on 3.11+
        raise ProviderTimeoutError(f"{what}: timed out", provider=provider) from exc
    except aiohttp.ClientPayloadError as exc:
        raise ProviderConnectionError(f"{what}: the connection dropped mid-response ({exc})", provider=provider) from exc
    except aiohttp.ServerDisconnectedError as exc:
        raise ProviderConnectionError(f"{what}: the server closed the connection ({exc})", provider=provider) from exc
    except aiohttp.ClientConnectorError as exc:
        raise ProviderConnectionError(
            f"{what}: cannot connect to {exc.host}:{exc.port} ({exc.os_error}): nothing answers at this base URL",
            provider=provider,
        ) from exc
    except (aiohttp.ClientError, ConnectionError, OSError) as exc:
        raise ProviderConnectionError(f"{what}: {type(exc).__name__}: {exc}", provider=provider) from exc
