"""Every exception fsm_agent raises, in one tree.

::

    FsmAgentError
    ├── UserError                      misuse, found before or at construction; never retried
    │   ├── ConfigurationError         bad provider / agent / CLI configuration
    │   │   ├── PermissionsError (+ValueError)  invalid session permissions (every problem listed)
    │   │   └── TaskDefinitionError (+ValueError)  an invalid task definition (every problem listed)
    │   ├── ToolDefinitionError        a function that cannot become a tool
    │   ├── ChainError                 a middleware chain that cannot be built (cycle, missing
    │   │                              requirement, sync/async mismatch, change after freezing)
    │   ├── ExtraTypeError (+TypeError) MessageRequest.extra holds the wrong type for a key
    │   ├── ContextWriteError (+AttributeError)  a plugin wrote to a read-only part of its RunContext
    │   ├── ResumeError                resuming a session that cannot be resumed
    │   │   ├── SessionBusyError       another worker (or this agent) drives it now
    │   │   ├── SessionEndedError      it ended for good; carries its stored ``result``
    │   │   └── DecisionRefused        a person's decision that cannot be taken (no such pending
    │   │                              call, a kind it does not allow, bad edited arguments, a
    │   │                              different decision made first); ``kind`` says which
    │   ├── SessionExistsError (+KeyError)  a new run given the id of a session that exists
    │   └── SessionLinkError           a child session id already linked to another parent (or call)
    └── RunError                       a failure while a run is under way
        ├── ToolArgumentsError         a tool call's arguments do not match its schema
        ├── ToolError                  a tool answers its call with an error result (the model reads
        │                              it; the run goes on), e.g. an MCP server's ``isError``
        ├── MiddlewareError            a fail-closed middleware raised (wraps the cause)
        ├── LeaseLost                  another worker holds the session's lease; this one must stop writing
        │   └── SessionConflictError   another writer appended to the session since this one read it
        ├── ReplayDivergence           a replayed run asked for an effect the recording does not
        │                              have there (the first differing effect, named)
        ├── StoreError                 a store read or write failed (disk full, read-only, locked, gone);
        │                              names the store's location and the cause; ``transient`` says
        │                              whether retrying may help
        ├── StructuredOutputError      the answer still does not match the declared output schema
        │                              after the repair turn (carries the last result)
        ├── InvalidPlanError (+ValueError)  a plan breaks its rules: duplicate or unknown node ids,
        │                              a dependency cycle (carries every problem found)
        └── ProviderError              anything a provider call can fail with; carries
            │                          status, body, headers (lower-cased), provider, retryable
            ├── RateLimitError         429 (retry_after seconds when the server says)
            │   └── RateLimitRequestTooLargeError  one request exceeds a per-minute token limit: waiting won't help
            ├── QuotaExceededError     402 / insufficient_quota: the account has no credit left
            ├── OverloadedError        529 / 503 "overloaded"
            ├── ContextLengthExceededError   the prompt does not fit the model's window
            ├── AuthenticationError    401
            ├── PermissionDeniedError  403
            ├── NotFoundError          404 (model or endpoint)
            ├── InvalidRequestError    400 / 422 not covered above
            │   └── InvalidHistoryError  the message history breaks protocol rules (tool_use without tool_result)
            ├── RequestTooLargeError   413
            │   └── PayloadTooLargeError  one payload over a durable host's limit (Temporal)
            ├── ServerError            5xx
            ├── ContentFilteredError   the provider refused the content
            ├── ProviderTimeoutError (+TimeoutError)   no first token / a stalled stream / request timeout
            ├── ProviderConnectionError (+ConnectionError)  could not connect, or the connection dropped
            ├── StreamError            the provider reported an error inside an HTTP 200 stream
            ├── EmptyResponseError     the provider answered with no text, no tool call
            └── ProviderProtocolError  bytes that do not follow the wire protocol

Control-flow signals form their own family, outside :class:`FsmAgentError`::

    Signal
    ├── StopRun                        middleware asks the driver to end the run with a StopReason
    │   ├── GuardrailTripwireTriggered  a guardrail's tripwire fired: FAILED_TERMINAL, error kind
    │   │                              ``guardrail_tripwire`` naming the guardrail
    │   └── LoopStop                   a model that went on with a loop of tool calls after the warning:
    │                                  FAILED_TERMINAL, error kind ``loop_detected`` naming the calls
    └── SuspendCall                    a tool's call cannot finish now but can later: the run stops
        │                              INTERRUPTED with that call pending, and a resume runs it again
        ├── WaitForHuman               a tool's call cannot finish without a person: the run stops
        │                              WAITING_HUMAN with that call pending
        └── OutcomeUnknown             the worker running a side-effect call was lost: its tool's
                                       on_reconcile settles it, or the run stops WAITING_HUMAN
                                       with the call pending as ``unknown_outcome``

The driver never treats a signal as a failure.

A :class:`ProviderError` raised from a stream keeps what was decoded before the
failure in ``partial`` (a ``MessageResponse`` or ``None``), so nothing the
provider already sent is lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Nothing of fsm_agent is imported here, not even for annotations: errors sit below every other
# module. A content block or a MessageResponse is typed ``Any`` where an error carries one.

__all__ = [
    "AuthenticationError",
    "ChainError",
    "ConfigurationError",
    "ContentFilteredError",
    "ContextLengthExceededError",
    "ContextWriteError",
    "DecisionRefused",
    "EmptyResponseError",
    "ExtraTypeError",
    "FsmAgentError",
    "GuardrailTripwireTriggered",
    "InvalidHistoryError",
    "InvalidPlanError",
    "InvalidRequestError",
    "LeaseLost",
    "LoopStop",
    "MiddlewareError",
    "NotFoundError",
    "OutcomeUnknown",
    "OverloadedError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "PermissionsError",
    "ProviderConnectionError",
    "ProviderError",
    "ProviderProtocolError",
    "ProviderTimeoutError",
    "QuotaExceededError",
    "RateLimitError",
    "RateLimitRequestTooLargeError",
    "ReplayDivergence",
    "RequestTooLargeError",
    "ResumeError",
    "RunError",
    "ServerError",
    "SessionConflictError",
    "SessionEndedError",
    "SessionExistsError",
    "SessionLinkError",
    "Signal",
    "StopRun",
    "StoreError",
    "StreamError",
    "StructuredOutputError",
    "SuspendCall",
    "TaskDefinitionError",
    "ToolArgumentsError",
    "ToolDefinitionError",
    "ToolError",
    "UserError",
    "WaitForHuman",
]


class FsmAgentError(Exception):
    """Root of every exception fsm_agent raises on purpose."""


class UserError(FsmAgentError):
    """The library was used wrongly; the message says what to change."""


class ConfigurationError(UserError):
    """A provider, agent or CLI setting is missing or invalid."""


class PermissionsError(ConfigurationError, ValueError):
    """Session permissions (:class:`fsm_agent.Permissions`, a permissions file or table) are
    invalid. ``problems`` holds one line per problem, each naming where it is."""

    def __init__(self, problems: Any) -> None:
        self.problems = [str(p) for p in problems]
        super().__init__("\n".join(self.problems))


class TaskDefinitionError(ConfigurationError, ValueError):
    """A task definition (:class:`fsm_agent.Task`, a task file, a server request's task) is
    invalid. ``problems`` holds one line per problem, each naming where it is."""

    def __init__(self, problems: Any) -> None:
        self.problems = [str(p) for p in problems]
        super().__init__("\n".join(self.problems))


class ToolDefinitionError(UserError):
    """A Python function cannot be turned into a tool (unsupported annotation, bad name)."""


class ChainError(UserError):
    """A middleware chain cannot be built or changed: found at construction, never mid-run."""


class ExtraTypeError(UserError, TypeError):
    """``MessageRequest.extra[key]`` exists but is not of the requested type."""


class ContextWriteError(UserError, AttributeError):
    """A plugin tried to change a read-only part of its :class:`~fsm_agent.RunContext` (the transcript,
    the machine, the tools, a counter). The message names the supported way: a hook's return value
    (a tool or turn decision, ``StopRun``), ``ctx.messages`` / ``ctx.settings`` in ``pre_turn``,
    ``ctx.state(self)``, ``ctx.emit`` or ``ctx.update_plan``."""


class ResumeError(UserError):
    """The session cannot be resumed (it ended COMPLETED, FAILED_TERMINAL or CANCELLED, or is unknown)."""


class DecisionRefused(ResumeError):
    """A person's decision on a pending tool call that cannot be taken
    (:func:`fsm_agent.store.decisions.write_decisions`, the one writer of decisions).

    Attributes:
        kind: why: ``unknown_session``; ``not_waiting`` (the session waits for no decision now);
            ``not_pending`` (no such pending call); ``not_allowed`` (a kind the call does not
            allow); ``bad_arguments`` (an edit whose arguments break the tool's schema);
            ``conflict`` (a different decision on the same question was taken first).
        call_id: the tool call the decision was for.
        prior: for ``conflict``, the decision taken first (a :class:`~fsm_agent.control.Decision`),
            else ``None``.
    """

    def __init__(self, kind: str, message: str, *, call_id: str = "", prior: Any = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.call_id = call_id
        self.prior = prior


class SessionBusyError(ResumeError):
    """The session is being driven now (another worker holds its lease, or this agent drives it
    in this process): it can be resumed once that run stops. Try again later, or interrupt it."""


class SessionEndedError(ResumeError):
    """The session already ended for good (COMPLETED, FAILED_TERMINAL or CANCELLED): nothing was run
    again. After a crash a caller cannot know whether its run finished; this error is how
    :meth:`~fsm_agent.Agent.resume` (and ``check_resume``) hands back what the session stored.

    Attributes:
        session_id: the session.
        reason: its :class:`~fsm_agent.types.StopReason`.
        result: its stored :class:`~fsm_agent.types.RunResult` (stop with its detail and payload,
            last answer, whole transcript, usage, cost, structured output; ``duration_s`` 0: no run
            took place now), or ``None`` when only the caught error was built without one.
    """

    def __init__(self, message: str, *, session_id: str, reason: Any, result: Any = None) -> None:
        super().__init__(message)
        self.session_id = session_id
        self.reason = reason
        self.result = result


class SessionExistsError(UserError, KeyError):
    """A new run was given the id of a session that already exists.

    Use :meth:`~fsm_agent.Agent.resume` to continue it, or pass another ``session_id``
    (or none, for a fresh one). Subclasses ``KeyError`` for stores written before it existed.
    """

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id

    def __str__(self) -> str:
        return (f"session {self.session_id!r} already exists; choose another session id (or none, for a fresh "
                "one)")


class SessionLinkError(UserError):
    """A child session id is already linked to another parent session, or to another call of the
    same parent (:func:`fsm_agent.orchestration.links.link_child`): two starts would share one
    child session. Give the child another id."""


class RunError(FsmAgentError):
    """A failure while a run is under way."""


class ToolArgumentsError(RunError):
    """A tool call's arguments are not valid JSON or do not match the tool's JSON Schema.

    The driver turns it into an error tool result the model sees; it never ends a run.
    """


class ToolError(RunError):
    """Raised by a tool to answer its call with an error result rather than a value.

    The runtime does not treat it as a crash: the call gets a
    :class:`~fsm_agent.types.ToolResultMessage` with ``is_error`` set whose content is ``content``
    (content blocks: text, images) or, when that is empty, the message; ``kind`` goes into the
    result's ``metadata["error"]`` (the runtime's own kinds are ``unknown_tool``, ``invalid_json``,
    ``invalid_arguments``, ``timeout`` and ``exception``). The model reads the result and the run
    goes on; the ledger records the call ``failed``.
    """

    def __init__(self, message: str, *, content: tuple[Any, ...] = (), kind: str = "tool_error") -> None:
        super().__init__(message)
        self.message = message
        """What went wrong and what the model can do about it."""
        self.content = tuple(content)
        """The result's content blocks; empty: the message is the result."""
        self.kind = kind
        """A short machine-readable tag for ``metadata["error"]``."""


class MiddlewareError(RunError):
    """A middleware with failure policy ``propagate`` raised; the run ends FAILED_TERMINAL.

    Attributes:
        middleware: the middleware's name.
        hook: the hook that raised (``pre_turn``, ``on_tool_call`` ...).
    """

    def __init__(self, middleware: str, hook: str, cause: BaseException) -> None:
        super().__init__(f"middleware {middleware!r} failed in {hook}: {type(cause).__name__}: {cause}")
        self.middleware = middleware
        self.hook = hook


class LeaseLost(RunError):  # noqa: N818 - a condition the driver reacts to
    """This worker no longer holds the session's lease (it expired and another worker took it);
    its writes are refused so that one session is driven by one worker at a time."""


class ReplayDivergence(RunError):
    """A replayed run (:mod:`fsm_agent.testing.effects`) asked for an effect that differs from the
    recorded one at the same place, asked for one the recording does not have, or ended before the
    recording did. The engine lets it through (the run stops where it diverged).

    Attributes:
        index: the position of the first differing effect in the run's sequence of effects (0-based).
        expected: what the recording has there (kind and a short form of its arguments), or ``None``
            when the recording had ended.
        actual: what the replayed run asked for, or ``None`` when it ended first.
        difference: the first differing field of the two, as a path (``request.messages[3].content``),
            or ``""``.
    """

    def __init__(self, index: int, expected: str | None, actual: str | None, difference: str = "") -> None:
        self.index = index
        self.expected = expected
        self.actual = actual
        self.difference = difference
        where = f" (first difference at {difference})" if difference else ""
        if actual is None:
            text = f"the replayed run ended, but the recording goes on with effect #{index}: {expected}"
        elif expected is None:
            text = f"the replayed run asked for effect #{index}, {actual}, after the recording ended"
        else:
            text = f"effect #{index} differs: the recording has {expected}, the replay asked for {actual}{where}"
        super().__init__(text)


class StoreError(RunError):
    """A store operation failed for a reason outside fsm_agent: a full disk, a read-only file, a
    database locked past its busy timeout, a dropped database connection.

    Attributes:
        location: the store's file path or DSN (without password).
        operation: what was being done (``write``, ``acquire_lease`` ...).
        cause: the underlying error's text.
        transient: ``True`` when retrying the same operation later may succeed (locked, connection
            lost); ``False`` when a person must act (disk full, read-only, corrupt).
    """

    def __init__(self, location: str, operation: str, cause: BaseException | str, *, transient: bool) -> None:
        self.location = location
        self.operation = operation
        self.cause = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        self.transient = transient
        hint = "retrying may help" if transient else "free space, fix permissions or repair the store, then resume"
        super().__init__(f"store {location}: {operation} failed: {self.cause} ({hint})")


class StructuredOutputError(RunError):
    """The model's answer did not match the declared output schema, and the repair turn
    (when one was allowed) did not fix it.

    Attributes:
        schema_name: the :class:`~fsm_agent.types.OutputSchema` name.
        error: what was wrong with the last answer (the JSON path and the failed constraint,
            or ``not JSON: ...``).
        raw: the last answer's text as the model gave it.
        attempts: model calls made (1 without a repair turn, 2 with one).
        result: the last :class:`~fsm_agent.structured.StructuredResult`.
        response: the last :class:`~fsm_agent.types.MessageResponse`, or ``None``.
    """

    def __init__(self, schema_name: str, error: str, raw: str, attempts: int, *, result: Any = None,
                 response: Any = None) -> None:
        self.schema_name = schema_name
        self.error = error
        self.raw = raw
        self.attempts = attempts
        self.result = result
        self.response = response
        calls = "1 call" if attempts == 1 else f"{attempts} calls"
        super().__init__(f"the answer does not match output schema {schema_name!r} after {calls}: {error}")


class InvalidPlanError(RunError, ValueError):
    """A plan (:class:`~fsm_agent.types.Plan`) breaks its rules: no nodes, a duplicate node id, a
    dependency on an unknown node, a dependency cycle, an open node that depends on a skipped one,
    more than one running node, a version that goes back.

    Raised by :meth:`~fsm_agent.types.Plan.validate` and by ``ctx.update_plan``; the PlanAct plugin
    sends the problems back to the planner and stops the run, typed, when they persist.

    Attributes:
        problems: every problem found, one sentence each (``node 's3' depends on unknown node 's9'``).
    """

    def __init__(self, problems: list[str] | tuple[str, ...]) -> None:
        self.problems = tuple(problems)
        super().__init__("invalid plan: " + "; ".join(self.problems))


class SessionConflictError(LeaseLost):
    """Another writer appended events to the session after this writer read it (two writers without
    a lease, or a worker whose view is stale): this writer's events would not follow the log, so
    nothing was written. Reload the session (``Agent.resume``) to continue from what was stored.

    Attributes:
        session_id: the session.
        expected_seq: the seq this writer's first event had.
        last_seq: the log's last seq when the write was refused.
    """

    def __init__(self, session_id: str, expected_seq: int, last_seq: int) -> None:
        self.session_id = session_id
        self.expected_seq = expected_seq
        self.last_seq = last_seq
        super().__init__(f"session {session_id}: another writer appended to the log (it ends at seq {last_seq}, "
                         f"this write starts at {expected_seq}); nothing was written — resume the session to "
                         "continue from what was stored")


class ProviderError(RunError):
    """A provider call failed.

    Attributes:
        message: human-readable cause, including what the user can do.
        provider: profile name (``"openai"``, ``"anthropic"``, ``"llamacpp"`` ...).
        status: HTTP status, or ``None`` when no response arrived.
        body: the response body as text (may be truncated to 64 KiB), or ``None``.
        headers: response headers with lower-cased names.
        retryable: whether retrying the same request may succeed.
        partial: what a stream produced before it failed, or ``None``.
        code: the provider's machine-readable error code or type, when given.
        retry_after: the wait in seconds the server asked for (``Retry-After``), or ``None``.
    """

    default_retryable = False

    def __init__(
        self,
        message: str,
        *,
        provider: str | None = None,
        status: int | None = None,
        body: str | None = None,
        headers: Mapping[str, str] | None = None,
        retryable: bool | None = None,
        partial: Any = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.provider = provider
        self.status = status
        self.body = body
        self.headers: dict[str, str] = {k.lower(): v for k, v in (headers or {}).items()}
        self.retryable = self.default_retryable if retryable is None else retryable
        self.partial = partial
        self.code = code
        self.retry_after: float | None = None

    def __str__(self) -> str:
        where = []
        if self.provider:
            where.append(self.provider)
        if self.status is not None:
            where.append(f"HTTP {self.status}")
        prefix = f"[{' '.join(where)}] " if where else ""
        return f"{prefix}{self.message}"

    @property
    def kind(self) -> str:
        """Stable snake_case name of the error class (``"rate_limited"``, ``"context_length_exceeded"`` ...)."""
        return _KINDS.get(type(self), "provider_error")

    def to_info(self) -> dict[str, Any]:
        """A JSON-ready summary for stop reasons and event logs (no headers, body cut to 2 KiB; with
        ``retry_after_s`` when the server asked for a wait)."""
        info: dict[str, Any] = {
            "kind": self.kind,
            "message": self.message,
            "provider": self.provider,
            "status": self.status,
            "code": self.code,
            "retryable": self.retryable,
            "body": self.body[:2048] if self.body else None,
        }
        if self.retry_after is not None:
            info["retry_after_s"] = self.retry_after
        return info


class RateLimitError(ProviderError):
    """HTTP 429. ``retry_after`` is the server's wait in seconds, when it said."""

    default_retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class RateLimitRequestTooLargeError(RateLimitError):
    """A single request is larger than a per-minute token limit (OpenAI 429 "Request too large ... TPM").

    Not retryable and not a context-window problem: trimming to the window will not help (case B20).
    """

    default_retryable = False


class QuotaExceededError(ProviderError):
    """The account's balance or quota is exhausted (HTTP 402, ``insufficient_quota``); retrying will not help."""


class OverloadedError(ProviderError):
    """The provider is temporarily over capacity (Anthropic 529, ``overloaded_error``)."""

    default_retryable = True


class ContextLengthExceededError(ProviderError):
    """The prompt (plus requested output) does not fit the model's context window.

    Attributes:
        limit: the window in tokens, when the message says.
        requested: tokens the request needed, when the message says.
        max_tokens_requested: for "input + max_tokens > limit" wordings, the
            requested output tokens; lowering ``max_tokens`` to ``limit - input``
            may be enough without trimming the history (case B20).
        input_tokens: the input part of such a message.
    """

    def __init__(
        self,
        message: str,
        *,
        limit: int | None = None,
        requested: int | None = None,
        input_tokens: int | None = None,
        max_tokens_requested: int | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(message, **kw)
        self.limit = limit
        self.requested = requested
        self.input_tokens = input_tokens
        self.max_tokens_requested = max_tokens_requested


class AuthenticationError(ProviderError):
    """HTTP 401: the API key is missing, wrong or expired."""


class PermissionDeniedError(ProviderError):
    """HTTP 403: the key is valid but may not use this model or feature."""


class NotFoundError(ProviderError):
    """HTTP 404: unknown model or wrong base URL."""


class InvalidRequestError(ProviderError):
    """HTTP 400/422: the request is malformed or uses an unsupported parameter."""


class InvalidHistoryError(InvalidRequestError):
    """The provider rejected the message history (a tool call without its result, bad order).

    The runtime's repair pipeline exists to prevent it (case B02); seeing it means a repair pass is missing.
    """


class RequestTooLargeError(ProviderError):
    """HTTP 413, or a per-request size/TPM limit that retrying will not fix."""


class PayloadTooLargeError(RequestTooLargeError):
    """A durable host (Temporal) refuses to carry one payload this large between a session's
    workflow and its activities (its limit is 2 MiB a payload). Not retryable: the same request is as
    large the next time.

    Attributes:
        what: which crossing it was (the activity's name).
        size: the payload's size in bytes.
        limit: the largest payload allowed, in bytes.
    """

    def __init__(self, what: str, size: int, limit: int) -> None:
        super().__init__(
            f"{what}: a payload of {size:,} bytes is over the durable host's limit of {limit:,} bytes; keep the "
            "context shorter (the compaction plugin), make tools return less (or store large results and return "
            "a reference), or raise the host's payload limit where the cluster allows it", provider="temporal")
        self.what = what
        self.size = size
        self.limit = limit


class ServerError(ProviderError):
    """HTTP 5xx from the provider."""

    default_retryable = True


class ContentFilteredError(ProviderError):
    """The provider's content filter blocked the prompt or the answer."""


class ProviderTimeoutError(ProviderError, TimeoutError):
    """No first token within the first-token timeout, a stream stalled, or the request timed out."""

    default_retryable = True


class ProviderConnectionError(ProviderError, ConnectionError):
    """The connection could not be made or dropped before the response ended."""

    default_retryable = True


class StreamError(ProviderError):
    """The provider reported an error inside an HTTP 200 stream (``event: error``, ``response.failed``)."""


class EmptyResponseError(ProviderError):
    """The provider answered with neither text nor a tool call (retried once, seed 000 §5.2.6)."""

    default_retryable = True


class ProviderProtocolError(ProviderError):
    """The response does not follow the wire protocol (bad JSON, bad UTF-8, oversize SSE event)."""


_KINDS: dict[type, str] = {
    ProviderError: "provider_error",
    RateLimitError: "rate_limited",
    RateLimitRequestTooLargeError: "rate_limited_request_too_large",
    InvalidHistoryError: "invalid_history",
    OverloadedError: "overloaded",
    QuotaExceededError: "quota_exceeded",
    ContextLengthExceededError: "context_length_exceeded",
    AuthenticationError: "authentication",
    PermissionDeniedError: "permission_denied",
    NotFoundError: "not_found",
    InvalidRequestError: "invalid_request",
    RequestTooLargeError: "request_too_large",
    PayloadTooLargeError: "payload_too_large",
    ServerError: "server_error",
    ContentFilteredError: "content_filtered",
    ProviderTimeoutError: "timeout",
    ProviderConnectionError: "connection",
    StreamError: "stream_error",
    EmptyResponseError: "empty_response",
    ProviderProtocolError: "protocol_error",
}


class Signal(Exception):  # noqa: N818 - a signal, not an error
    """Root of control-flow signals; never an error, never retried."""


class StopRun(Signal):
    """Signal: end the run now with ``reason`` (a :class:`~fsm_agent.StopReason`).

    Raised by middleware; the driver catches it and moves the machine to the
    named terminal state with ``detail`` and the payload fields given.
    """

    def __init__(self, reason: Any, detail: str = "", **payload: Any) -> None:
        super().__init__(detail or str(reason))
        self.reason = reason
        self.detail = detail
        self.payload = payload


class GuardrailTripwireTriggered(StopRun):
    """Signal: a guardrail's tripwire fired (the ``guardrails`` plugin, ``fsm_agent_middleware.guardrails``).

    A :class:`StopRun` for ``FAILED_TERMINAL`` whose stop carries ``error={"kind": "guardrail_tripwire",
    "guardrail": name, "guardrail_kind": kind, "message": message, "info": info}``. The plugin raises
    it when a stop-type guardrail trips; a guardrail function may raise it instead of returning a
    tripped result (the plugin fills in the guardrail's name and kind), and any middleware hook may
    raise it to stop a run the same way.

    Args:
        message: why, in words (the stop's detail says it after the guardrail's name).
        guardrail: the guardrail's name (``""``: filled in by the plugin).
        kind: ``input``, ``output``, ``tool_input`` or ``tool_output`` (``""``: filled in by the plugin).
        info: what the guardrail found (JSON-like data: it is written to the session log).
    """

    def __init__(self, message: str = "", *, guardrail: str = "", kind: str = "", info: Any = None) -> None:
        self.guardrail = guardrail
        self.kind = kind
        self.message = message
        self.info = info
        who = f"{kind.replace('_', ' ')} guardrail {guardrail!r}" if guardrail else "a guardrail"
        super().__init__("FAILED_TERMINAL", f"{who} tripped{': ' + message if message else ''}",
                         error={"kind": "guardrail_tripwire", "guardrail": guardrail, "guardrail_kind": kind,
                                "message": message, "info": info})


class LoopStop(StopRun):
    """Signal: a model went on with a loop of tool calls after it was warned, and the run ends.

    A :class:`StopRun` for ``FAILED_TERMINAL`` whose stop carries ``error={"kind": "loop_detected",
    "pattern": ["name {arguments}", ...], **details}``. The engine raises it for
    ``RunConfig(loop_detection=LoopConfig(then="stop"))`` (details: ``count``, the times the pattern
    came back with the same results, and ``call_id``, the call that went on with it); the
    ``loop_detection`` plugin raises it when its escalation ends the run.

    Args:
        detail: why, in words (the stop's detail).
        pattern: the calls of the loop, as ``name {arguments}``.
        details: more of the ``error`` payload (JSON-like values).
    """

    def __init__(self, detail: str, *, pattern: list[str], **details: Any) -> None:
        self.pattern = list(pattern)
        super().__init__("FAILED_TERMINAL", detail, error={"kind": "loop_detected", "pattern": self.pattern,
                                                           **details})


class SuspendCall(Signal):
    """Signal: raised by a tool whose call cannot finish now but can later, by running again with
    the same idempotency key (a sub-agent that stopped in a resumable state, workers that could not
    be driven).

    The driver records no result for the call: it stays open (ledger ``started``), the other calls
    of the batch finish and keep theirs, and the run stops INTERRUPTED with this call pending
    (``PendingAction.reason`` is ``reason``; ``detail`` is the stop's detail). A resume runs the
    call again (a ``pure`` or ``idempotent`` tool; a ``side_effect`` one goes through its
    ``on_reconcile``). A person's decision on the pending call is an ordinary one: ``approve``
    runs it again, ``reject`` and ``respond`` close it with their result.

    Attributes:
        detail: why the call cannot finish now, and what lets it finish.
        reason: the pending action's reason code (``suspended`` unless given).
    """

    def __init__(self, detail: str, *, reason: str = "suspended") -> None:
        super().__init__(detail)
        self.detail = detail
        self.reason = reason
        self.allowed_decisions: tuple[str, ...] = ("approve", "reject", "respond")


class WaitForHuman(SuspendCall):
    """Signal: raised by a tool whose call cannot finish without a person (a sub-agent waiting for
    an approval, a remote agent asking for input).

    The driver does not record a result for the call: the other calls of the batch finish and keep
    theirs, and the run stops WAITING_HUMAN with this call pending (``PendingAction.reason`` is
    ``reason``; ``detail`` is the stop's detail and ``required_decision``). The person's decision
    is the answer to the tool's question: ``approve`` or ``respond`` with a message (``edit`` with
    new arguments) runs the call again with the same idempotency key and the decision in
    :attr:`fsm_agent.ToolContext.decision`; the tool returns its result or raises this again.
    ``reject`` closes the call with the usual "a person rejected this tool call" result and does
    **not** run the tool, unless it raised with ``run_on_reject=True`` (it then runs again and
    reads the rejection, as a sub-agent tool does to pass it on to the calls its sub-agent waits
    on). A resume without a decision runs the call again (a ``pure`` or ``idempotent`` tool; a
    ``side_effect`` one goes through its ``on_reconcile``). Hang-Wait
    (``RunConfig.approval_timeout``) does not apply: the run stops.

    Attributes:
        detail: what the person must decide, in words they can act on.
        reason: the pending action's reason code (``waiting_human`` unless given).
        allowed_decisions: the decision kinds the call accepts (default approve, reject, respond);
            a resume with another kind is a ``ResumeError``.
        run_on_reject: a ``reject`` runs the tool again (with the decision) instead of closing the call.
    """

    def __init__(self, detail: str, *, reason: str = "waiting_human",
                 allowed_decisions: tuple[str, ...] = ("approve", "reject", "respond"),
                 run_on_reject: bool = False) -> None:
        super().__init__(detail, reason=reason)
        self.allowed_decisions = tuple(allowed_decisions)
        self.run_on_reject = run_on_reject


class OutcomeUnknown(SuspendCall):
    """Signal: raised by a run's port (never by a tool) when the worker running a ``side_effect``
    call was lost while it ran (a durable host's activity timed out without a heartbeat): the call
    may or may not have taken effect, and running it again silently could do it twice.

    MidTurn treats it as the crash recovery does in process: the tool's ``on_reconcile`` settles the
    call (its result, or "run it again"), or the run stops WAITING_HUMAN with the call pending as
    ``unknown_outcome``; a person's decision is an ordinary one (``approve`` runs it again, ``reject``
    and ``respond`` close it with their result).
    """

    def __init__(self, detail: str) -> None:
        super().__init__(detail, reason="unknown_outcome")
