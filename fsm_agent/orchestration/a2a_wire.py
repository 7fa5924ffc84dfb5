"""Agent2Agent (A2A 1.0), JSON-RPC binding: what both sides speak, in one place.

The server (:mod:`fsm_agent.server.a2a`) and the client (:mod:`fsm_agent.orchestration.a2a`) use
these and nothing else for the wire:

* the protocol's constants: :data:`A2A_VERSION`, :data:`AGENT_CARD_PATH`, :func:`supported_version`;
* the JSON-RPC 2.0 envelope: :func:`rpc_request` / :func:`parse_request`, :func:`rpc_result` /
  :func:`rpc_error` / :func:`parse_response`, and :class:`RpcError` (a JSON-RPC error, with the
  A2A reason in a ``google.rpc.ErrorInfo``, as the official SDK sends it);
* task states (:class:`TaskState`, and the plain strings the server writes), and the mapping of a
  run's stop, and of a session, to a task state (:func:`stop_task_state`, :func:`task_state`);
* messages, parts, the ``answer`` artifact, stream frames (:data:`FRAME_KINDS`,
  :func:`frame_result`) and fsm_agent's usage metadata (:func:`usage_metadata` /
  :func:`usage_of`).

Pure: no I/O. The layer is the orchestration patterns' (the client's), which the server may use.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any

import orjson

from ..store.base import QUEUED, SessionRecord
from ..types.messages import Usage
from ..types.run import StopReason

__all__ = ["A2A_VERSION", "AGENT_CARD_PATH", "ALL_STATES", "ANSWER_ARTIFACT", "AUTH_REQUIRED", "CANCELED",
           "COMPLETED", "CONTENT_TYPE_NOT_SUPPORTED", "FAILED", "FRAME_KINDS", "INPUT_REQUIRED", "INTERNAL_ERROR",
           "INVALID_PARAMS", "INVALID_REQUEST", "METADATA_KEY", "METHOD_NOT_FOUND", "PARSE_ERROR",
           "PUSH_NOT_SUPPORTED", "REASONS", "REFUSAL_KINDS", "REJECTED", "SERVER_STOPPING", "SUBMITTED",
           "TASK_NOT_CANCELABLE", "TASK_NOT_FOUND", "TERMINAL_STATES", "UNSUPPORTED_OPERATION",
           "VERSION_NOT_SUPPORTED", "WORKING", "NotJsonRpc", "RpcError", "TaskState",
           "agent_message", "answer_artifact", "frame_result", "parse_request", "parse_response", "parts_text",
           "rpc_error", "rpc_request", "rpc_result", "stop_reason", "stop_task_state", "supported_version",
           "task_state", "usage_metadata", "usage_of", "user_message"]

A2A_VERSION = "1.0"
"""The protocol version spoken (the ``A2A-Version`` header; a card's ``protocolVersion``)."""
AGENT_CARD_PATH = "/.well-known/agent-card.json"
"""Where an agent card is served (A2A's well-known URI)."""

_VERSION = re.compile(r"1(\.[0-9]+){0,2}")


def supported_version(version: str) -> bool:
    """Whether ``version`` (an ``A2A-Version`` header, a card's ``protocolVersion``) is a 1.x this
    side speaks (``1``, ``1.0``, ``1.0.0``, ``1.1`` ...)."""
    return _VERSION.fullmatch(version) is not None


# -- JSON-RPC 2.0 --------------------------------------------------------------------------------
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = -32700, -32600, -32601, -32602, -32603
TASK_NOT_FOUND, TASK_NOT_CANCELABLE, PUSH_NOT_SUPPORTED, UNSUPPORTED_OPERATION = -32001, -32002, -32003, -32004
CONTENT_TYPE_NOT_SUPPORTED, VERSION_NOT_SUPPORTED = -32005, -32009
REASONS = {PARSE_ERROR: "PARSE_ERROR", INVALID_REQUEST: "INVALID_REQUEST", METHOD_NOT_FOUND: "METHOD_NOT_FOUND",
           INVALID_PARAMS: "INVALID_PARAMS", INTERNAL_ERROR: "INTERNAL_ERROR", TASK_NOT_FOUND: "TASK_NOT_FOUND",
           TASK_NOT_CANCELABLE: "TASK_NOT_CANCELABLE", PUSH_NOT_SUPPORTED: "PUSH_NOTIFICATION_NOT_SUPPORTED",
           UNSUPPORTED_OPERATION: "UNSUPPORTED_OPERATION", CONTENT_TYPE_NOT_SUPPORTED: "CONTENT_TYPE_NOT_SUPPORTED",
           VERSION_NOT_SUPPORTED: "VERSION_NOT_SUPPORTED"}
"""The A2A reason (``error.data[0].reason``) of each JSON-RPC and A2A error code."""
_ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"


class RpcError(Exception):
    """A JSON-RPC error: ``code`` (JSON-RPC or A2A), ``message`` (what was wrong and what to do),
    ``data`` (extra fields for the ``google.rpc.ErrorInfo`` metadata) and ``reason`` (the A2A
    reason a remote sent, ``""`` when none; one made here carries :data:`REASONS` of its code)."""

    def __init__(self, code: int, message: str, data: Mapping[str, Any] | None = None, *, reason: str = "",
                 raw: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, dict(data or {})
        self.reason = reason
        self.raw = raw
        """The ``error.data`` member as a remote sent it (``None`` for an error made here)."""

    def to_json(self) -> dict[str, Any]:
        """The ``error`` member: ``code``, ``message`` and ``data`` (a ``google.rpc.ErrorInfo`` with
        the A2A reason, as the official SDK sends it)."""
        info = {"@type": _ERROR_INFO, "reason": self.reason or REASONS.get(self.code, "UNKNOWN_ERROR"), "domain": "a2a-protocol.org",
                "metadata": {k: str(v) for k, v in self.data.items()}}
        return {"code": self.code, "message": self.message, "data": [info]}


class NotJsonRpc(ValueError):
    """An answer that is not a JSON-RPC 2.0 response (the message says what is wrong)."""


def rpc_request(method: str, params: Mapping[str, Any], rid: str | int) -> bytes:
    """A JSON-RPC 2.0 request's body."""
    return orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})


def rpc_result(rid: Any, result: Any) -> bytes:
    """A JSON-RPC 2.0 response's body (its ``result``)."""
    return orjson.dumps({"jsonrpc": "2.0", "id": rid, "result": result}, option=orjson.OPT_NON_STR_KEYS)


def rpc_error(rid: Any, err: RpcError) -> bytes:
    """A JSON-RPC 2.0 error response's body."""
    return orjson.dumps({"jsonrpc": "2.0", "id": rid, "error": err.to_json()})


def parse_request(body: Any) -> tuple[Any, str, dict[str, Any]]:
    """(id, method, params) of a JSON-RPC 2.0 request (one object: no batches, no notifications).

    Raises:
        RpcError: -32600 / -32602 saying what is wrong; its ``data['id']`` is the id to echo when
            the id itself was readable.
    """
    if isinstance(body, list):
        raise RpcError(INVALID_REQUEST, "batch requests are not supported: send one JSON-RPC request per HTTP POST")
    if not isinstance(body, dict):
        raise RpcError(INVALID_REQUEST, f"the request must be a JSON-RPC 2.0 request object, not {type(body).__name__}")
    rid = body.get("id")
    if isinstance(rid, bool) or not (rid is None or isinstance(rid, (str, int))) or (
            isinstance(rid, str) and len(rid) > 256):
        raise RpcError(INVALID_REQUEST, "'id' must be a string (at most 256 characters), an integer or null")
    if body.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, "'jsonrpc' must be exactly \"2.0\"", {"id": rid})
    if "id" not in body:
        raise RpcError(INVALID_REQUEST, "'id' is missing: A2A methods are requests, not notifications; give an id",
                       {"id": rid})
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise RpcError(INVALID_REQUEST, "'method' must be a non-empty string", {"id": rid})
    params = body.get("params", {})
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, f"'params' must be an object, not {type(params).__name__}", {"id": rid})
    return rid, method, params


def parse_response(data: Any) -> Any:
    """The ``result`` of a JSON-RPC 2.0 response (parsed JSON).

    Raises:
        RpcError: the response is an error (``reason`` and ``raw`` as the remote sent them).
        NotJsonRpc: it is not a JSON-RPC 2.0 response.
    """
    if not isinstance(data, dict) or data.get("jsonrpc") != "2.0":
        raise NotJsonRpc(f"the answer is not a JSON-RPC 2.0 response: {str(data)[:200]}")
    err = data.get("error")
    if err is not None:
        if not isinstance(err, dict):
            raise NotJsonRpc(f"'error' is not an object: {str(err)[:200]}")
        code: int = err["code"] if isinstance(err.get("code"), int) else 0
        reason = ""
        details: list[Any] = err["data"] if isinstance(err.get("data"), list) else []
        for d in details:
            if isinstance(d, dict) and isinstance(d.get("reason"), str):
                reason = d["reason"]
        raise RpcError(code, str(err.get("message")), reason=reason, raw=err.get("data"))
    if "result" not in data:
        raise NotJsonRpc("the answer has neither 'result' nor 'error'")
    return data["result"]


# -- task states ------------------------------------------------------------------------------------
class TaskState(str, enum.Enum):
    """A2A task states (their JSON names)."""

    SUBMITTED = "TASK_STATE_SUBMITTED"
    WORKING = "TASK_STATE_WORKING"
    COMPLETED = "TASK_STATE_COMPLETED"
    FAILED = "TASK_STATE_FAILED"
    CANCELED = "TASK_STATE_CANCELED"
    INPUT_REQUIRED = "TASK_STATE_INPUT_REQUIRED"
    REJECTED = "TASK_STATE_REJECTED"
    AUTH_REQUIRED = "TASK_STATE_AUTH_REQUIRED"
    UNSPECIFIED = "TASK_STATE_UNSPECIFIED"

    @property
    def short(self) -> str:
        """``COMPLETED`` for ``TASK_STATE_COMPLETED``."""
        return self.value.removeprefix("TASK_STATE_")

    @property
    def terminal(self) -> bool:
        """COMPLETED, FAILED, CANCELED or REJECTED: the task will not change again."""
        return self.value in TERMINAL_STATES

    @property
    def interrupted(self) -> bool:
        """INPUT_REQUIRED or AUTH_REQUIRED: the task waits for the client."""
        return self in (TaskState.INPUT_REQUIRED, TaskState.AUTH_REQUIRED)

    @classmethod
    def parse(cls, raw: Any) -> TaskState:
        """From a JSON state (``TASK_STATE_WORKING``, or a 0.3-style ``working``); unknown: UNSPECIFIED."""
        text = str(raw or "")
        try:
            return cls(text)
        except ValueError:
            try:
                return cls("TASK_STATE_" + text.upper().replace("-", "_"))
            except ValueError:
                return cls.UNSPECIFIED


# the states as the plain strings a server writes (a str-valued Enum member hashes by its name)
SUBMITTED, WORKING = TaskState.SUBMITTED.value, TaskState.WORKING.value
COMPLETED, FAILED = TaskState.COMPLETED.value, TaskState.FAILED.value
CANCELED, INPUT_REQUIRED, REJECTED = TaskState.CANCELED.value, TaskState.INPUT_REQUIRED.value, TaskState.REJECTED.value
AUTH_REQUIRED = TaskState.AUTH_REQUIRED.value
TERMINAL_STATES = frozenset({COMPLETED, FAILED, CANCELED, REJECTED})
"""The states a task never leaves."""
ALL_STATES = frozenset({SUBMITTED, WORKING, COMPLETED, FAILED, CANCELED, INPUT_REQUIRED, REJECTED, AUTH_REQUIRED})
"""Every state a task can be in (UNSPECIFIED is none)."""

REFUSAL_KINDS = frozenset({"refusal", "content_filtered", "policy", "guardrail"})
"""``stop.error.kind`` values of a FAILED_TERMINAL stop that mean *refused*, not *failed*: the task
is REJECTED. ``refusal`` and ``content_filtered`` come from the model; a policy middleware that
refuses a task raises ``StopRun(StopReason.FAILED_TERMINAL, detail, error={"kind": "policy"})``."""

SERVER_STOPPING = "server stopping"
"""The detail of a run a stopping server interrupted (the server resumes it when it starts again):
its task is still WORKING."""


def stop_reason(stop: Mapping[str, Any] | None) -> str:
    """The StopReason value of an unstructured RunStop (``""`` when it has none)."""
    r = (stop or {}).get("reason")
    return str(getattr(r, "value", r) or "")


def stop_task_state(stop: Mapping[str, Any]) -> str:
    """The A2A task state of a run's stop (an unstructured RunStop).

    ========================================= =====================
    StopReason                                task state
    ========================================= =====================
    COMPLETED                                 COMPLETED
    FAILED_TERMINAL, error kind in            REJECTED
    :data:`REFUSAL_KINDS` (a refusal)
    FAILED_TERMINAL, FAILED_RETRYABLE         FAILED
    CANCELLED                                 CANCELED
    WAITING_HUMAN                             INPUT_REQUIRED
    PAUSED_BUDGET                             INPUT_REQUIRED (the budget in the status message)
    INTERRUPTED                               INPUT_REQUIRED (WORKING when the server stopped it,
                                              detail :data:`SERVER_STOPPING`: the next server
                                              start resumes it)
    ========================================= =====================
    """
    reason = stop_reason(stop)
    if reason == StopReason.COMPLETED.value:
        return COMPLETED
    if reason in (StopReason.FAILED_TERMINAL.value, StopReason.FAILED_RETRYABLE.value):
        kind = (stop.get("error") or {}).get("kind") if isinstance(stop.get("error"), dict) else None
        return REJECTED if reason == StopReason.FAILED_TERMINAL.value and kind in REFUSAL_KINDS else FAILED
    if reason == StopReason.CANCELLED.value:
        return CANCELED
    if reason == StopReason.INTERRUPTED.value and str(stop.get("detail") or "").startswith(SERVER_STOPPING):
        return WORKING
    return INPUT_REQUIRED


def task_state(record: SessionRecord, busy: bool) -> str:
    """The A2A state of a session now: SUBMITTED while QUEUED, WORKING in a phase or while a run of a
    stopped session is queued or running (``busy``), else :func:`stop_task_state` of its stop."""
    if record.state == QUEUED:
        return SUBMITTED
    try:
        stopped = StopReason(record.state)
    except ValueError:
        return WORKING  # a phase
    if busy and stopped.resumable:
        return WORKING
    return stop_task_state(record.stop or {"reason": stopped.value})


# -- messages, artifacts, frames --------------------------------------------------------------------
ANSWER_ARTIFACT = "answer"
"""The artifact id of a task's answer (fsm_agent's server: the last assistant text)."""

FRAME_KINDS = {"task": "task", "message": "message", "statusUpdate": "status_update",
               "artifactUpdate": "artifact_update", "status_update": "status_update",
               "artifact_update": "artifact_update"}
"""A stream frame's ``result`` member (JSON name, or proto field name) -> its kind."""


def parts_text(parts: Any) -> str:
    """The text of a message's or an artifact's parts: text parts as they are, data parts as JSON,
    a file by its URL, raw bytes by their media type."""
    out = []
    for p in parts or ():
        if not isinstance(p, dict):
            continue
        if isinstance(p.get("text"), str):
            out.append(p["text"])
        elif "data" in p:
            out.append(orjson.dumps(p["data"]).decode())
        elif isinstance(p.get("url"), str):
            out.append(f"[file: {p['url']}]")
        elif "raw" in p:
            out.append(f"[binary {p.get('mediaType') or 'data'}{' ' + p['filename'] if p.get('filename') else ''}]")
    return "".join(out)


def agent_message(text: str, task_id: str, context_id: str, message_id: str,
                  data: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Message of the agent: a text part, and a data part when ``data`` is given."""
    parts: list[dict[str, Any]] = [{"text": text}]
    if data is not None:
        parts.append({"data": data})
    return {"messageId": message_id, "contextId": context_id, "taskId": task_id, "role": "ROLE_AGENT", "parts": parts}


def user_message(message_id: str, parts: list[dict[str, Any]], *, task_id: str | None = None,
                 context_id: str | None = None) -> dict[str, Any]:
    """A Message of the client: to continue ``task_id``, or (``context_id``) to start a task."""
    message: dict[str, Any] = {"messageId": message_id, "role": "ROLE_USER", "parts": parts}
    if task_id is not None:
        message["taskId"] = task_id
    if context_id is not None:
        message["contextId"] = context_id
    return message


def answer_artifact(text: str) -> dict[str, Any]:
    """The ``answer`` artifact holding ``text``."""
    return {"artifactId": ANSWER_ARTIFACT, "name": ANSWER_ARTIFACT, "parts": [{"text": text}]}


def frame_result(result: Any) -> tuple[str, dict[str, Any]]:
    """(kind, member) of a stream frame's ``result``: ``task``, ``message``, ``status_update`` or
    ``artifact_update`` and the object it carries.

    Raises:
        NotJsonRpc: not exactly one of those members, or not an object.
    """
    if not isinstance(result, dict) or len(result) != 1 or next(iter(result)) not in FRAME_KINDS:
        raise NotJsonRpc(f"a stream frame's result is not one of task, message, statusUpdate, artifactUpdate: "
                         f"{str(result)[:200]}")
    (key, value), = result.items()
    if not isinstance(value, dict):
        raise NotJsonRpc(f"the frame's {key} is not an object")
    return FRAME_KINDS[key], value


# -- usage in metadata -------------------------------------------------------------------------------
METADATA_KEY = "fsm_agent"
"""The member of a task's (or a final status update's) ``metadata`` fsm_agent's server fills."""


def usage_metadata(usage: tuple[int, int], cost: float | None) -> dict[str, Any]:
    """What fsm_agent's server says of a task's usage so far (in ``metadata.fsm_agent``): ``usage``
    (``input_tokens``, ``output_tokens``) and ``cost_usd`` (``None``: unknown)."""
    return {"usage": {"input_tokens": usage[0], "output_tokens": usage[1]}, "cost_usd": cost}


def usage_of(metadata: Mapping[str, Any]) -> tuple[Usage, float | None] | None:
    """A remote task's usage so far and its cost (USD, ``None``: not given) from its metadata:
    ``metadata.fsm_agent`` as fsm_agent's server sends it, or ``metadata.usage`` with
    ``input_tokens``/``output_tokens`` or ``prompt_tokens``/``completion_tokens``; ``None`` when it
    reports none."""
    ours = metadata.get(METADATA_KEY)
    src = ours if isinstance(ours, dict) and isinstance(ours.get("usage"), dict) else metadata
    u = src.get("usage")
    if not isinstance(u, dict):
        return None

    def num(*keys: str) -> int:
        for k in keys:
            v = u.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                return int(v)
        return 0

    usage = Usage(num("input_tokens", "prompt_tokens", "inputTokens"), num("output_tokens", "completion_tokens",
                                                                            "outputTokens"))
    cost = src.get("cost_usd")
    if not usage.total_tokens and cost is None:
        return None
    return usage, float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) else None
