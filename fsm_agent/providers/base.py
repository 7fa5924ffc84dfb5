"""The provider contract, vendor profiles as data, retries, and the shared call path.

A provider is one wire protocol (a subclass of :class:`Provider`: OpenAI Chat
Completions, OpenAI Responses, Anthropic Messages) plus a :class:`Profile`
(base URL, auth header, field quirks, tool-calling mode, capabilities). DeepSeek,
Qwen and llama.cpp are profiles over the OpenAI Chat protocol, not new modules.

Call placement: retries live here, inside :meth:`Provider.chat` /
:meth:`Provider.chat_stream`, once per HTTP attempt. Middleware's
``wrap_model_call`` runs once per logical call, outside these retries.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import inspect
import logging
import os
import random
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, ClassVar, Protocol

import orjson
from attrs import evolve, field, frozen

from ..errors import (
    ConfigurationError,
    ContextLengthExceededError,
    EmptyResponseError,
    ProviderConnectionError,
    ProviderError,
    ProviderProtocolError,
)
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import ErrorEvent, MessageComplete, StreamEvent, TextDelta, ThinkingDelta, ToolCallArgumentsDelta
from .costs import cost_update, events_for
from .errors import classify_error, scrub_error
from .record import Recorder
from .sse import DEFAULT_MAX_EVENT_BYTES, SSEDecoder, ServerSentEvent
from .wire import ANY, check, guard

log = logging.getLogger("fsm_agent.providers")

__all__ = [
    "HttpProvider",
    "NEVER_RETRIED_STATUSES",
    "Profile",
    "Provider",
    "ProviderCapabilities",
    "ProviderConfig",
    "RetryListener",
    "RetryPolicy",
    "StreamParser",
    "ToolMode",
    "announce_retry",
    "call_deadline",
    "cost_update",
    "events_for",
    "first_token_timeout_for",
    "may_retry",
    "retry_empty_elsewhere",
    "retry_listener",
    "server_retry_after",
]

call_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("fsm_agent_call_deadline", default=None)
"""``time.monotonic()`` instant past which no retry may sleep (the run's remaining wall-clock budget).
The driver sets it around each model call; ``None`` means no limit."""

RetryListener = Callable[[ProviderError, int, float], Any]
"""``(error, retry_number, delay_s) -> None`` (or an awaitable): told of a retry before its wait."""

retry_listener: contextvars.ContextVar[RetryListener | None] = contextvars.ContextVar(
    "fsm_agent_retry_listener", default=None)
"""Called by :meth:`HttpProvider.chat` / :meth:`HttpProvider.chat_stream` before each retry's wait,
with the error that caused it, the retry number (1-based) and the wait in seconds. The driver sets it
around each model call and turns each call into a :class:`~fsm_agent.types.ModelRetry` event (for
the observers and the session log), so that the provider layer never knows the driver. A listener
that raises is logged and ignored; ``None`` means nobody listens."""


retry_empty_elsewhere: contextvars.ContextVar[bool] = contextvars.ContextVar("fsm_agent_retry_empty_elsewhere",
                                                                             default=False)
"""``True`` while a fallback chain (:class:`~fsm_agent.providers.FallbackProvider`) calls a provider
that has a next one: an empty response (:class:`~fsm_agent.errors.EmptyResponseError`) is then not
retried on the same provider (:attr:`RetryPolicy.empty_response_retries` does not apply), because the
chain's next provider is the one retry (seed 000 §5.2.6). ``False`` (default): the provider's own
policy retries it."""


async def announce_retry(error: ProviderError, retry_number: int, delay_s: float) -> None:
    """Tell the :data:`retry_listener` of the current context about a retry (never raises but for
    cancellation)."""
    listener = retry_listener.get()
    if listener is None:
        return
    try:
        result = listener(error, retry_number, delay_s)
        if inspect.isawaitable(result):
            await result
    except Exception:  # noqa: BLE001 - a listener cannot change the call
        log.exception("retry listener %r failed; ignored", listener)


class ToolMode(str, enum.Enum):
    """How tools reach the model.

    ``native``: the protocol's own tool calling. ``constrained``: tools are sent
    as one JSON-Schema ``response_format`` (a tool name with its arguments, or a
    final answer), enforced by the server's grammar, and the reply is mapped
    back to tool-use blocks; for models or servers without native tool calls.
    """

    NATIVE = "native"
    CONSTRAINED = "constrained"


@frozen
class ProviderCapabilities:
    """What a profile supports. ``context_window`` and ``max_output_tokens`` are in tokens (``None``: unknown)."""

    streaming: bool = True
    tools: bool = True
    parallel_tools: bool = True
    thinking: bool = False
    images: bool = False
    constrained_output: bool = True
    """The server enforces a JSON-Schema ``response_format`` in the Chat shape, so the constrained
    tool mode can run on it."""
    structured_output: bool = True
    """The server enforces a JSON-Schema answer format of its own protocol (Chat ``response_format``
    ``json_schema``, Responses ``text.format``, Anthropic ``output_config.format``). When ``False``, a
    request's ``output_schema`` falls back: ``json_object`` plus the schema in the system prompt on
    the OpenAI protocols, a forced answer tool on Anthropic (see :meth:`HttpProvider.prepare`)."""
    context_window: int | None = None
    max_output_tokens: int | None = None


@frozen
class Profile:
    """A vendor endpoint over a wire protocol: everything that differs between vendors, as data."""

    name: str
    """Profile name used in errors, logs and ``--provider`` (``openai``, ``deepseek`` ...)."""
    protocol: str
    """``openai-chat``, ``openai-responses`` or ``anthropic``."""
    base_url: str | None = None
    """Default base URL, or ``None`` when the user must give one."""
    api_key_env: tuple[str, ...] = ()
    """Environment variables read (in order) for the API key."""
    auth: str = "bearer"
    """``bearer`` (``Authorization: Bearer KEY``), ``x-api-key`` (Anthropic) or ``none``."""
    max_tokens_field: str = "max_tokens"
    """``max_tokens`` or ``max_completion_tokens`` (OpenAI's newer models reject the former)."""
    tool_mode: ToolMode = ToolMode.NATIVE
    stream_usage: bool = True
    """Send ``stream_options.include_usage`` (OpenAI Chat protocol)."""
    reasoning_field: str | None = None
    """Assistant-message field that carries reasoning on the wire (``reasoning_content`` for DeepSeek/Qwen)."""
    echo_reasoning: bool = False
    """Send reasoning back on every assistant turn, also reasoning with no record of its vendor under
    ``reasoning_field`` (DeepSeek thinking mode, case B06). Without it, reasoning decoded from this
    same vendor still goes back on tool-call turns (Kimi, C05)."""
    headers: tuple[tuple[str, str], ...] = ()
    """Extra headers sent on every request (``anthropic-version`` ...)."""
    default_model: str | None = None
    default_max_tokens: int | None = None
    """``max_tokens`` sent when a request gives none (tokens), or ``None`` to leave it to the server."""
    capabilities: ProviderCapabilities = ProviderCapabilities()
    options: tuple[tuple[str, Any], ...] = ()
    """Protocol-specific switches. OpenAI Chat: ``thinking_param`` (``enable_thinking``, ``thinking``,
    ``reasoning``, ``chat_template_kwargs``; else ``reasoning_effort``), ``thinking_streamed_only``
    (DashScope: a non-streamed call sends ``enable_thinking: false``), ``tool_ids`` (``mistral``:
    9-character alphanumeric call ids), ``foreign_call_signature`` (Gemini: the placeholder thought
    signature for a call it did not make), ``system_role``."""

    def option(self, key: str, default: Any = None) -> Any:
        for k, v in self.options:
            if k == key:
                return v
        return default


def first_token_timeout_for(input_tokens: int, base: float = 30.0, per_1k: float = 1.0, cap: float = 180.0) -> float:
    """Seed 000 §5.2.7: ``min(30 + input_tokens/1000, 180)`` seconds to the first token."""
    return min(base + per_1k * input_tokens / 1000.0, cap)


NEVER_RETRIED_STATUSES: frozenset[int] = frozenset({400, 401, 403, 404, 422})
"""HTTP statuses that are never retried, whatever the error's ``retryable`` flag or an
``x-should-retry`` header says: the same request will get the same answer."""


def may_retry(error: ProviderError) -> bool:
    """Whether sending the same request again may succeed.

    ``error.retryable``, except that a status in :data:`NEVER_RETRIED_STATUSES` and a
    :class:`~fsm_agent.errors.ContextLengthExceededError` (the same request overflows again; the
    driver re-trims instead) are never retried. The one rule both retry layers and the fallback
    chain (:class:`~fsm_agent.providers.FallbackRule`) use.
    """
    if not error.retryable or isinstance(error, ContextLengthExceededError):
        return False
    return error.status not in NEVER_RETRIED_STATUSES


def server_retry_after(error: ProviderError) -> float | None:
    """The wait in seconds the server asked for with ``error``, or ``None``: ``error.retry_after``
    (set from the headers, or from a 429's "try again in" wording), else the ``retry-after-ms`` or
    ``Retry-After`` header on it (what :meth:`RetryPolicy.delay` honours). An HTTP-date is measured
    against the response's ``Date`` header (see :func:`~fsm_agent.providers.parse_retry_after`)."""
    server = error.retry_after
    if server is None and error.headers:
        from .errors import parse_retry_after

        server = parse_retry_after(error.headers)
    return server


def _check_retry_policy(instance: Any, attribute: Any, value: Any) -> None:
    if attribute.name == "max_attempts" and value < 1:
        raise ValueError(f"max_attempts must be at least 1, got {value}")
    if attribute.name != "max_attempts" and value < 0:
        raise ValueError(f"{attribute.name} must not be negative, got {value}")


@frozen
class RetryPolicy:
    """The backoff policy: when to retry, how long to wait, honouring the server's Retry-After.

    fsm_agent's only backoff: the provider's per-HTTP-attempt retries
    (:meth:`HttpProvider.chat` / :meth:`HttpProvider.chat_stream`) and the ``retry`` plugin
    (``fsm_agent_middleware.retry.RetryFallback``, per logical call) both ask :meth:`delay`, so the
    same error on the same retry gets the same wait from either layer.

    Waits, in seconds. Retry ``n`` (1-based: the first retry is 1) has the base
    ``base(n) = min(max_delay, initial_delay * 2**(n-1))`` and waits
    ``base(n) + rng() * (min(max_delay, 2 * base(n)) - base(n))``, that is uniformly in
    ``[base(n), min(2 * base(n), max_delay)]``: the jitter is added on top of the base and never
    taken off it, and no computed wait exceeds ``max_delay``. With the defaults: retry 1 waits
    0.5-1 s, retry 2 1-2 s, retry 3 2-4 s.

    A server-requested wait (``ProviderError.retry_after``, else the ``retry-after-ms`` or
    ``Retry-After`` header, see :func:`~fsm_agent.providers.parse_retry_after`) replaces the
    computed one exactly, without jitter; one above ``max_retry_after`` ends the retries. No wait
    ever ends at or past :data:`call_deadline` (nor past ``remaining`` seconds when a caller gives
    it): the error is raised at once instead. When a server's wait ended the retries, the error
    says so in its message and keeps the wait in ``retry_after`` (so a run's stop carries it as
    ``error["retry_after_s"]``).

    Never retried: errors for which :func:`may_retry` is false (``retryable=False``; HTTP 400,
    401, 403, 404 and 422 whatever the flag says; context-length errors). An empty response is
    retried at most ``empty_response_retries`` times.
    """

    max_attempts: int = field(default=3, validator=_check_retry_policy)
    """Attempts in all, the first included (1 disables retries)."""
    initial_delay: float = field(default=0.5, validator=_check_retry_policy)
    """Seconds: the base of the first retry's wait."""
    max_delay: float = field(default=20.0, validator=_check_retry_policy)
    """Seconds: no computed wait is longer (an ``initial_delay`` above it is lowered to it)."""
    max_retry_after: float = field(default=60.0, validator=_check_retry_policy)
    """Longest server-requested wait honoured, in seconds; longer ones end the retries."""
    empty_response_retries: int = field(default=1, validator=_check_retry_policy)
    """Extra attempts for an empty response (seed 000 §5.2.6: one)."""
    rng: Callable[[], float] | None = field(default=None, eq=False, repr=False)
    """``() -> float`` in [0, 1) for the jitter (``None``: ``random.random``); a seeded
    ``random.Random(seed).random`` makes the waits reproducible."""
    sleep: Callable[[float], Awaitable[Any]] | None = field(default=None, eq=False, repr=False)
    """``async (seconds) -> None`` used to wait (``None``: ``asyncio.sleep``)."""

    def backoff(self, retry_number: int, rng: Callable[[], float] | None = None) -> float:
        """The computed wait in seconds before retry ``retry_number`` (1-based), ignoring any server hint.

        Always in ``[base(n), min(2 * base(n), max_delay)]`` (see the class doc).
        """
        factor: int = 2 ** max(0, retry_number - 1)  # int ** int is typed Any (a negative power is a float)
        base = min(self.max_delay, self.initial_delay * factor)
        top = min(self.max_delay, 2 * base)
        return base + (rng or self.rng or random.random)() * (top - base)

    def delay(self, error: ProviderError, retry_number: int, rng: Callable[[], float] | None = None, *,
              attempts: int | None = None, remaining: float | None = None) -> float | None:
        """Seconds to wait before retry ``retry_number`` (1-based) after ``error``, or ``None`` to give up.

        Args:
            error: the failure of the attempt just made.
            retry_number: 1 for the first retry.
            rng: overrides the policy's jitter source for this call.
            attempts: attempts in all for this caller (default ``max_attempts``).
            remaining: seconds left of the caller's own budget, checked besides :data:`call_deadline`.
        """
        if not may_retry(error):
            return None
        limit = self.max_attempts if attempts is None else attempts
        if isinstance(error, EmptyResponseError):
            limit = min(limit, self.empty_response_retries + 1)
        if retry_number >= limit:
            return None
        server = server_retry_after(error)
        if server is not None:
            error.retry_after = server
            if server > self.max_retry_after:
                _not_retried(error, f"the server asked to wait {server:g} s before retrying, longer than "
                                    f"max_retry_after ({self.max_retry_after:g} s)")
                return None
            wait = float(server)
        else:
            wait = self.backoff(retry_number, rng)
        deadline = call_deadline.get()
        if deadline is not None:
            left = deadline - time.monotonic()
            remaining = left if remaining is None else min(remaining, left)
        if remaining is not None and wait >= remaining:
            if server is not None:
                _not_retried(error, f"the server asked to wait {server:g} s before retrying, and only "
                                    f"{max(0.0, remaining):.1f} s are left of the run's wall-clock budget")
            return None
        return wait

    async def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` with the policy's ``sleep``."""
        await (self.sleep or asyncio.sleep)(seconds)


def _not_retried(error: ProviderError, why: str) -> None:
    """Say in ``error``'s message why its retries ended (once; both retry layers may decide it)."""
    note = f" (not retried: {why})"
    if "(not retried: " not in error.message:
        error.message += note
        if error.args and isinstance(error.args[0], str):
            error.args = (error.message, *error.args[1:])


@frozen
class ProviderConfig:
    """How to reach a provider. Unset fields fall back to the profile and the environment."""

    model: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    headers: Mapping[str, str] = field(factory=dict)
    """Extra headers for every request."""
    tool_mode: ToolMode | None = None
    """Override the profile's tool-calling mode."""
    retry: RetryPolicy = RetryPolicy()
    first_token_timeout: float | None = None
    """Seconds to the first streamed event; ``None``: the adaptive seed-000 formula."""
    chunk_timeout: float | None = 30.0
    """Seconds allowed between streamed events; ``None``: no limit."""
    request_timeout: float | None = 600.0
    """Seconds for a whole non-streaming response; ``None``: no limit."""
    connect_timeout: float = 10.0
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    """Largest SSE event accepted (bytes)."""
    allow_stream_replay: bool = False
    """Retry a stream that already produced content (the consumer then sees the content again)."""
    record_to: str | None = None
    """Append every exchange, credentials scrubbed, to this JSON file (:mod:`fsm_agent.providers.record`)."""
    profile: str | Profile | None = None
    """The vendor profile, by name (``"mistral"``, one of :data:`~fsm_agent.providers.PROFILES`) or as a
    :class:`Profile`: used as it is, overriding what :func:`~fsm_agent.providers.create_provider` would
    detect from the base URL's host and the model name (see its order). ``None``: detected."""


class StreamParser(Protocol):
    """Turns one protocol's SSE events into :data:`StreamEvent` values.

    ``feed`` may raise a :class:`ProviderError` for an error reported inside the
    stream. ``finish`` is called at end of body: it closes open blocks and
    returns the events up to and including :class:`MessageComplete`, or raises
    :class:`ProviderProtocolError` when the stream ended before the protocol's
    end marker and nothing usable arrived.
    """

    partial: Any

    def feed(self, sse: ServerSentEvent) -> list[StreamEvent]: ...

    def finish(self) -> list[StreamEvent]: ...


_CONTENT_EVENTS = frozenset({TextDelta, ThinkingDelta, ToolCallArgumentsDelta})


class Provider(ABC):
    """What the runtime needs from a model: one call, streamed or not.

    Implementations: :class:`HttpProvider` subclasses (one per wire protocol) and
    :class:`~fsm_agent.providers.scripted.ScriptedProvider` (a deterministic test double).
    """

    name: str
    model: str | None

    @property
    @abstractmethod
    def capabilities(self) -> ProviderCapabilities: ...

    @abstractmethod
    async def chat(self, request: MessageRequest) -> MessageResponse:
        """One complete response.

        Raises:
            ProviderError: the most specific subclass, after the provider's own retries.
        """

    @abstractmethod
    def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
        """Stream events ending with exactly one :class:`MessageComplete`, or raise a ProviderError."""

    async def aclose(self) -> None:
        """Release connections (idempotent)."""

    async def __aenter__(self) -> Provider:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class HttpProvider(Provider):
    """A wire protocol client over aiohttp. Subclasses implement the four protocol hooks.

    Use as an async context manager, or call :meth:`aclose` when done.
    """

    protocol: ClassVar[str]

    def __init__(self, profile: Profile, config: ProviderConfig | None = None) -> None:
        self.profile = profile
        self.config = config or ProviderConfig()
        self.model = self.config.model or profile.default_model
        if not self.model:
            raise ConfigurationError(
                f"provider {profile.name!r} needs a model name (ProviderConfig(model=...); CLI: --model)"
            )
        base = self.config.base_url or profile.base_url
        if not base:
            raise ConfigurationError(f"provider {profile.name!r} needs a base URL "
                                     "(ProviderConfig(base_url=...); CLI: --base-url)")
        if not base.startswith(("http://", "https://")):
            raise ConfigurationError(f"base URL {base!r} must start with http:// or https:// "
                                     "(e.g. http://localhost:8000/v1)")
        self.base_url = base.rstrip("/")
        self.api_key = self.config.api_key or next(
            (os.environ[k] for k in profile.api_key_env if os.environ.get(k)), None
        )
        if profile.auth != "none" and not self.api_key and not _is_local(self.base_url):
            env = " or ".join(profile.api_key_env) or "an API key"
            raise ConfigurationError(f"provider {profile.name!r} needs an API key: set {env} "
                                     "(or ProviderConfig(api_key=...); CLI: --api-key)")
        self.tool_mode = self.config.tool_mode or profile.tool_mode
        self._wire_profiles: dict[str, Profile] = {}
        from .http import HttpClient  # aiohttp is imported with the first HTTP provider, not with fsm_agent

        self._http = HttpClient(
            profile.name, connect_timeout=self.config.connect_timeout, request_timeout=self.config.request_timeout
        )
        self._http.secrets = self.secrets()
        if self.config.record_to:
            self._http.recorder = Recorder(self.config.record_to, secrets=(self.api_key or "",))

    # -- identity --------------------------------------------------------------
    @property
    def name(self) -> str:  # type: ignore[override]
        return self.profile.name

    model_rules: Callable[[Profile, str | None], Profile] | None = None
    """``(profile, model) -> profile`` adding a model's own wire rules to the profile
    (:func:`~fsm_agent.providers.profiles.with_model_rules`, set by
    :func:`~fsm_agent.providers.create_provider` unless ``ProviderConfig.profile`` chose the profile),
    or ``None``: the profile as it is (a provider class built directly)."""

    def wire_profile(self, model: str | None = None) -> Profile:
        """The profile whose wire rules a request for ``model`` (default: this provider's model) follows:
        :attr:`profile` with :attr:`model_rules` applied, or :attr:`profile` itself when there are none
        or ``ProviderConfig.profile`` chose it."""
        if self.model_rules is None or self.config.profile is not None:
            return self.profile
        key = model or self.model or ""
        found = self._wire_profiles.get(key)
        if found is None:
            if len(self._wire_profiles) >= 64:  # models named per request: keep the map small
                self._wire_profiles.clear()
            found = self._wire_profiles[key] = self.model_rules(self.profile, key)
        return found

    @property
    def capabilities(self) -> ProviderCapabilities:
        return self.profile.capabilities

    def __repr__(self) -> str:
        return f"{type(self).__name__}(profile={self.profile.name!r}, model={self.model!r}, base_url={self.base_url!r})"

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- protocol hooks ----------------------------------------------------------
    @abstractmethod
    def endpoint(self, request: MessageRequest, stream: bool) -> str:
        """URL path below the base URL (``/chat/completions``)."""

    @abstractmethod
    def build_body(self, request: MessageRequest, stream: bool) -> dict[str, Any]:
        """The wire request body."""

    @abstractmethod
    def parse_response(self, data: dict[str, Any]) -> MessageResponse:
        """A non-streaming response body into a :class:`MessageResponse`."""

    @abstractmethod
    def stream_parser(self) -> StreamParser:
        """A fresh parser for one streamed response."""

    def secrets(self) -> tuple[str, ...]:
        """What must never leave an error: the API key and the values of credential headers given in
        the config (scrubbed from every error this provider raises, besides key-shaped tokens)."""
        found = [self.api_key or ""]
        for k, v in self.config.headers.items():
            name = k.lower()
            if any(w in name for w in ("auth", "key", "token", "secret", "cookie")):
                found.append(v.split(" ", 1)[1] if name.endswith("authorization") and " " in v else v)
        return tuple(s for s in found if s)

    def _failed(self, exc: ProviderError) -> ProviderError:
        """The error boundary of a call: name the provider and scrub the secrets."""
        if exc.provider is None:
            exc.provider = self.name
        return scrub_error(exc, self._http.secrets)

    def auth_headers(self) -> dict[str, str]:
        if not self.api_key or self.profile.auth == "none":
            return {}
        if self.profile.auth == "x-api-key":
            return {"x-api-key": self.api_key}
        return {"Authorization": f"Bearer {self.api_key}"}

    def headers(self, stream: bool) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream" if stream else "application/json"}
        h.update(dict(self.profile.headers))
        h.update(self.auth_headers())
        h.update(self.config.headers)
        return h

    # -- request preparation --------------------------------------------------------
    def prepare(self, request: MessageRequest) -> MessageRequest:
        """Fill the model, apply the constrained tool mode, and place the output schema.

        An ``output_schema`` goes, in order of preference: into the ``final_answer`` branch of the
        constrained union (constrained mode with tools); into the protocol's own JSON-Schema format
        (``build_body``; when ``capabilities.structured_output`` or the constrained mode says the
        server enforces one); else into the fallback of :meth:`prepare_output_schema`. An explicit
        ``response_format`` always wins.
        """
        if not request.model:
            request = evolve(request, model=self.model or "")
        if self.tool_mode is ToolMode.CONSTRAINED and request.tools:
            from .constrained import constrain_request

            request = constrain_request(request)
        elif (request.output_schema is not None and request.response_format is None
              and not self.capabilities.structured_output and self.tool_mode is not ToolMode.CONSTRAINED):
            request = self.prepare_output_schema(request)
        return request

    def prepare_output_schema(self, request: MessageRequest) -> MessageRequest:
        """The fallback for a server without a JSON-Schema answer format: JSON mode with the schema in
        the system prompt (:func:`~fsm_agent.providers.structured_output.json_object_request`)."""
        from .structured_output import json_object_request

        return json_object_request(request)

    def interpret(self, original: MessageRequest, response: MessageResponse) -> MessageResponse:
        """Map a reply of a rewritten request (constrained mode, output-schema fallback) back to the
        shape the original request asked for."""
        if self.tool_mode is ToolMode.CONSTRAINED and original.tools:
            from .constrained import interpret_response

            return interpret_response(response, original)
        return response

    def stream_wrapper(self, request: MessageRequest) -> Callable[[AsyncIterator[StreamEvent]],
                                                                   AsyncIterator[StreamEvent]] | None:
        """The streamed counterpart of :meth:`interpret` for the original ``request``, or ``None``."""
        if self.tool_mode is ToolMode.CONSTRAINED and request.tools:
            from .constrained import ConstrainedStream

            return ConstrainedStream(request).wrap
        return None

    def encode(self, request: MessageRequest, stream: bool) -> tuple[str, bytes]:
        """URL and body bytes of the wire request for an already prepared ``request``."""
        body = self.build_body(request, stream)
        return self.base_url + self.endpoint(request, stream), orjson.dumps(body)

    # -- calls ----------------------------------------------------------------------
    async def chat(self, request: MessageRequest) -> MessageResponse:
        """One non-streaming call, with retries.

        Raises:
            ProviderError: the most specific subclass, after retries are spent.
        """
        wire = self.prepare(request)
        url, body = self.encode(wire, stream=False)
        headers = self.headers(stream=False)
        retry = 0
        while True:
            try:
                resp = await self._http.post(url, body, headers, timeout=self.config.request_timeout,
                                             timeout_message=f"no response within {self.config.request_timeout} s "
                                                             "(raise request_timeout for slow models)")
                raw = await self._http.read_body(resp)
                if "event-stream" in resp.headers.get("Content-Type", ""):
                    response = await self._decode_stream_body(raw)
                else:
                    response = self.decode_body(raw, resp.status, dict(resp.headers))
                if response.is_empty:
                    raise EmptyResponseError(
                        "the model returned an empty response (no text, no tool call)",
                        provider=self.name, partial=response,
                    )
                return self.interpret(request, response)
            except ProviderError as exc:
                self._failed(exc)
                retry += 1
                wait = None if self._empty_elsewhere(exc) else self.config.retry.delay(exc, retry)
                if wait is None:
                    raise
                await announce_retry(exc, retry, wait)
                await self.config.retry.wait(wait)

    @staticmethod
    def _empty_elsewhere(exc: ProviderError) -> bool:
        """An empty response that a fallback chain retries on its next provider (:data:`retry_empty_elsewhere`)."""
        return isinstance(exc, EmptyResponseError) and retry_empty_elsewhere.get()

    def decode_body(self, raw: bytes, status: int = 200, headers: Mapping[str, str] | None = None) -> MessageResponse:
        """A non-streaming body into a response; an error object in a 200 body raises."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ProviderProtocolError(
                f"response body is not JSON ({exc}): {raw[:200]!r}", provider=self.name, status=status,
                body=raw[:65536].decode("utf-8", "replace"),
            ) from exc
        if not isinstance(data, dict):
            raise ProviderProtocolError(f"response body is not a JSON object: {raw[:200]!r}", provider=self.name)
        check(data, ANY, what="response body", provider=self.name, raw=raw)  # nesting depth
        if "error" in data and data.get("error") and not data.get("choices") and not data.get("content") and not data.get("output"):
            raise classify_error(status if status >= 400 else None, data, headers, provider=self.name, in_stream=True)
        with guard("response body", self.name):
            return self.parse_response(data)

    async def _decode_stream_body(self, raw: bytes) -> MessageResponse:
        final: MessageResponse | None = None
        for event in self.decode_stream_bytes(raw):
            if isinstance(event, MessageComplete):
                final = event.full_response
        assert final is not None
        return final

    def decode_stream_bytes(self, raw: bytes) -> list[StreamEvent]:
        """Decode a whole recorded stream body (no I/O); raises like a live stream would."""
        decoder = SSEDecoder(self.config.max_event_bytes)
        parser = self.stream_parser()
        out: list[StreamEvent] = []
        try:
            try:
                for sse in decoder.feed(raw) + decoder.flush():
                    out.extend(parser.feed(sse))
                out.extend(parser.finish())
            except ProviderError as exc:
                cut = _cut_line(exc, decoder, parser, self.name)
                if cut is exc:
                    raise
                raise cut from exc
        except ProviderError as exc:
            if exc.partial is None and getattr(parser, "partial", None) is not None and out:
                try:
                    exc.partial = parser.partial.snapshot()
                except Exception:  # noqa: BLE001 - a broken partial must not hide the real error
                    exc.partial = None
            raise
        return out

    async def chat_stream(self, request: MessageRequest) -> AsyncIterator[StreamEvent]:
        """Stream one call: deltas as they arrive, then exactly one :class:`MessageComplete`.

        A failure before any content was yielded is retried like :meth:`chat`; after
        content, only when ``allow_stream_replay`` is set. The raised error's
        ``partial`` holds what was decoded; an :class:`ErrorEvent` precedes it.
        """
        wire = self.prepare(request)
        url, body = self.encode(wire, stream=True)
        headers = self.headers(stream=True)
        first_timeout = self.config.first_token_timeout
        if first_timeout is None:
            # about 4 bytes of JSON per token: counting with tiktoken on every call would cost more
            # than the whole call as the conversation grows, for a timeout that only needs the scale
            first_timeout = first_token_timeout_for(len(body) // 4)
        wrapper = self.stream_wrapper(request)
        retry = 0
        while True:
            produced = False
            parser = self.stream_parser()
            try:
                started = asyncio.get_running_loop().time()
                resp = await self._http.post(
                    url, body, headers, timeout=first_timeout,
                    timeout_message=f"no first token within {first_timeout:g} s (no response headers yet; raise "
                                    "first_token_timeout for slow models or very long prompts)")
                if "event-stream" not in resp.headers.get("Content-Type", "event-stream"):
                    raw = await self._http.read_body(resp)
                    response = self.decode_body(raw, resp.status, dict(resp.headers))
                    if response.is_empty:
                        raise EmptyResponseError("the model returned an empty response", provider=self.name, partial=response)
                    response = self.interpret(request, response)
                    for event in _events_for(response):
                        yield event
                    return
                decoder = SSEDecoder(self.config.max_event_bytes)
                batches = self._stream_batches(resp, decoder, parser, first_timeout, started)
                if wrapper is not None:
                    batches = _batched(wrapper(_flatten(batches)))
                async for batch in batches:  # one batch per network read: fewer generator hops per event
                    for event in batch:
                        t = type(event)
                        if t is MessageComplete:
                            if event.full_response.is_empty and not produced:  # type: ignore[union-attr]
                                raise EmptyResponseError(
                                    "the model returned an empty response", provider=self.name,
                                    partial=event.full_response,  # type: ignore[union-attr]
                                )
                        elif t in _CONTENT_EVENTS:
                            produced = True
                        yield event
                return
            except ProviderError as exc:
                if exc.partial is None and getattr(parser, "partial", None) is not None:
                    try:
                        exc.partial = parser.partial.snapshot()
                    except Exception:  # noqa: BLE001 - a broken partial must not hide the real error
                        exc.partial = None
                self._failed(exc)
                retry += 1
                wait = None
                if (not produced or self.config.allow_stream_replay) and not self._empty_elsewhere(exc):
                    wait = self.config.retry.delay(exc, retry)
                if wait is None:
                    yield ErrorEvent(exc.kind, str(exc))
                    raise
                await announce_retry(exc, retry, wait)
                await self.config.retry.wait(wait)

    async def _stream_batches(
        self, resp: Any, decoder: SSEDecoder, parser: StreamParser, first_timeout: float | None, started: float
    ) -> AsyncIterator[list[StreamEvent]]:
        """The stream events of each network read, as one list per read.

        When ``parser.feed`` raises partway through a read, the events decoded from that read before
        the failing event are yielded first, so that what the consumer saw matches the error's
        ``partial`` (which the parser had already folded them into).
        """
        from .http import iter_sse

        tap = self._http.tap(resp)
        try:
            async for sses in iter_sse(
                resp, decoder, provider=self.name, first_event_timeout=first_timeout,
                chunk_timeout=self.config.chunk_timeout, started=started, tap=tap,
            ):
                out: list[StreamEvent] = []
                try:
                    for sse in sses:
                        out += parser.feed(sse)
                except ProviderError as exc:
                    # the events this read decoded before the failing one are in the error's partial:
                    # the consumer sees them too, then the error
                    if out:
                        yield out
                    cut = _cut_line(exc, decoder, parser, self.name)
                    if cut is exc:
                        raise
                    raise cut from exc
                if out:
                    yield out
            try:
                last = parser.finish()
            except ProviderError as exc:
                cut = _cut_line(exc, decoder, parser, self.name)
                if cut is exc:
                    raise
                raise cut from exc
            yield last
        finally:
            if tap is not None:
                self._http.record(resp, tap)


def _cut_line(exc: ProviderError, decoder: SSEDecoder, parser: StreamParser, provider: str) -> ProviderError:
    """``exc``, or a retryable :class:`ProviderConnectionError` in its place when the body ended in
    the middle of a line (a connection closed mid-event, with no chunked or length framing to tell
    it): the cut line is what made the parser fail, not the provider's protocol. The partial decoded
    before the cut is kept."""
    if not decoder.ended_mid_line or not isinstance(exc, ProviderProtocolError):
        return exc
    partial = exc.partial
    if partial is None and getattr(parser, "partial", None) is not None:
        try:
            partial = parser.partial.snapshot()
        except Exception:  # noqa: BLE001 - a broken partial must not hide the real error
            partial = None
    return ProviderConnectionError(
        f"the connection closed in the middle of a line: the response is incomplete ({exc.message})",
        provider=exc.provider or provider, partial=partial)


async def _flatten(batches: AsyncIterator[list[StreamEvent]]) -> AsyncIterator[StreamEvent]:
    async for batch in batches:
        for event in batch:
            yield event


async def _batched(events: AsyncIterator[StreamEvent]) -> AsyncIterator[list[StreamEvent]]:
    async for event in events:
        yield [event]


_events_for = events_for


def _is_local(url: str) -> bool:
    return any(h in url for h in ("://127.0.0.1", "://localhost", "://[::1]", "://0.0.0.0"))
