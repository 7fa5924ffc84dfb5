"""What an A2A client sends the server (:mod:`fsm_agent.server.a2a`), checked: the ``A2A-Version``
header, the ``params`` fields (JSON names or proto field names, as the SDK's parser accepts), a
message and its parts (text, JSON data, ``raw`` text; the data part that carries ``decisions`` and
``limits``) and a ``SendMessage`` configuration. Each check raises :class:`RpcError` saying what was
wrong and what to send instead. The envelope itself is :func:`~fsm_agent.orchestration.a2a_wire.parse_request`.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from typing import Any

import attrs
import orjson

from ..config import RunConfig
from ..control import Decision
from ..errors import ConfigurationError
from ..orchestration.a2a_wire import (A2A_VERSION, CONTENT_TYPE_NOT_SUPPORTED, INVALID_PARAMS, PUSH_NOT_SUPPORTED,
                                      VERSION_NOT_SUPPORTED, RpcError, supported_version)
from ..store.decisions import DECISION_KINDS
from .runs import RESUME_LIMITS

__all__ = ["MAX_ID", "MAX_TEXT", "Inbound", "bad_char", "check_version", "get_field", "id_field", "json_object",
           "opt_int", "parse_configuration", "parse_message"]

MAX_TEXT = 100_000
"""The most characters of text a message may carry."""
MAX_ID = 200
"""The most characters of an id (a message's, a task's, a context's)."""
_LIMITS = RESUME_LIMITS
_DECISIONS = DECISION_KINDS
_INT = re.compile(r"^-?[0-9]{1,10}$")


def get_field(obj: Mapping[str, Any], camel: str, snake: str | None = None) -> Any:
    """A field by its JSON name, or by its proto field name (the SDK's parser accepts both)."""
    if camel in obj:
        return obj[camel]
    return obj.get(snake) if snake else None


def bad_char(c: str) -> bool:
    """A character no id may hold: a control character or ``/``."""
    return ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c == "/"


def id_field(obj: Mapping[str, Any], camel: str, snake: str | None, where: str, *, required: bool) -> str | None:
    """An id field (``None`` when absent and not ``required``); ``where`` names it in errors."""
    v = get_field(obj, camel, snake)
    if v is None or v == "":
        if required:
            raise RpcError(INVALID_PARAMS, f"{where}.{camel} is required")
        return None
    if not isinstance(v, str) or len(v) > MAX_ID or any(bad_char(c) for c in v):
        raise RpcError(INVALID_PARAMS, f"{where}.{camel} must be a string of 1 to {MAX_ID} characters without "
                                       f"control characters or '/', not {str(v)[:40]!r}")
    return v


def opt_int(obj: Mapping[str, Any], camel: str, snake: str, where: str, lo: int, hi: int) -> int | None:
    """An optional integer field from ``lo`` to ``hi`` (a JSON number, or a string of digits)."""
    v = get_field(obj, camel, snake)
    if v is None:
        return None
    if isinstance(v, str) and _INT.match(v.strip()):  # ASCII digits only: proto3 JSON allows int32 as a string
        v = int(v.strip())
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RpcError(INVALID_PARAMS, f"{where}.{camel} must be an integer from {lo} to {hi}, not {str(v)[:40]!r}")
    return v


def json_object(v: Any, where: str) -> dict[str, Any]:
    """``v`` when it is a JSON object; ``where`` names it in the error."""
    if not isinstance(v, dict):
        raise RpcError(INVALID_PARAMS, f"{where} must be a JSON object, not {type(v).__name__}")
    return v


@attrs.define
class Inbound:
    """A client's message, as this server uses it."""

    message_id: str
    context_id: str | None
    task_id: str | None
    text: str
    decisions: dict[str, Decision] | None
    limits: dict[str, Any] | None
    digest: str
    """sha256 of the message's canonical JSON: a retry must send the same message."""
    control: dict[str, Any] | None = None
    """The data part that carried ``decisions`` / ``limits``, as sent."""


def _decision(call_id: str, raw: Any) -> Decision:
    where = f"params.message data part: decisions[{call_id!r}]"
    d = json_object(raw, where)
    unknown = sorted(set(d) - {"decision", "arguments", "message", "is_error"})
    if unknown:
        raise RpcError(INVALID_PARAMS, f"{where}: unknown field(s) {', '.join(unknown)}; allowed: decision, "
                                       "arguments, message, is_error")
    kind = d.get("decision")
    if kind not in _DECISIONS:
        raise RpcError(INVALID_PARAMS, f"{where}.decision must be one of {', '.join(_DECISIONS)}, not {kind!r}")
    message, is_error = d.get("message", ""), d.get("is_error", False)
    if not isinstance(message, str) or len(message) > MAX_TEXT or not isinstance(is_error, bool):
        raise RpcError(INVALID_PARAMS, f"{where}: 'message' must be a string (at most {MAX_TEXT:,} characters) and "
                                       "'is_error' true or false")
    if kind == "edit":
        if not isinstance(d.get("arguments"), dict):
            raise RpcError(INVALID_PARAMS, f"{where}: an edit needs 'arguments', the new arguments (an object)")
        return Decision.edit(d["arguments"])
    if d.get("arguments") is not None or (message and kind == "approve") or ("is_error" in d and kind != "respond"):
        raise RpcError(INVALID_PARAMS, f"{where}: 'arguments' belongs to an edit, 'message' to a reject or a "
                                       "respond, 'is_error' to a respond")
    if kind == "approve":
        return Decision.approve()
    if kind == "reject":
        return Decision.reject(message or "rejected by an A2A client")
    if not message:
        raise RpcError(INVALID_PARAMS, f"{where}: a respond needs 'message', the result the model is given")
    return Decision.respond(message, is_error=is_error)


def _limits(raw: Any) -> dict[str, Any]:
    where = "params.message data part: limits"
    d = json_object(raw, where)
    for key, value in d.items():
        types = _LIMITS.get(key)
        if types is None:
            raise RpcError(INVALID_PARAMS, f"{where}.{key} cannot be raised; raise one of: {', '.join(_LIMITS)}")
        positive = isinstance(value, (int, float)) and value > 0
        if isinstance(value, bool) or not isinstance(value, types) or not positive:
            kind = "a positive integer" if types == (int,) else "a positive number"
            raise RpcError(INVALID_PARAMS, f"{where}.{key} must be {kind}, not {value!r}")
    try:
        attrs.evolve(RunConfig(), **d)
    except (TypeError, ValueError, ConfigurationError) as e:
        raise RpcError(INVALID_PARAMS, f"{where}: {e}") from e
    return dict(d)


def parse_message(params: dict[str, Any]) -> Inbound:
    """The ``params.message`` of a ``SendMessage``, checked.

    Raises:
        RpcError: -32602 for a wrong field, -32005 for a part this agent cannot read.
    """
    m = json_object(get_field(params, "message"), "params.message") if get_field(params, "message") is not None else None
    if m is None:
        raise RpcError(INVALID_PARAMS, "params.message is required: the message to send "
                                       '({"messageId", "role": "ROLE_USER", "parts": [{"text": ...}]})')
    mid = id_field(m, "messageId", "message_id", "params.message", required=True)
    assert mid is not None
    role = m.get("role")
    if not (isinstance(role, str) and role in ("ROLE_USER", "user") or type(role) is int and role == 1):
        raise RpcError(INVALID_PARAMS, f"params.message.role must be ROLE_USER (a message to the agent), not {role!r}")
    parts = m.get("parts")
    if not isinstance(parts, list) or not parts:
        raise RpcError(INVALID_PARAMS, "params.message.parts must be a non-empty list of parts")
    texts: list[str] = []
    decisions: dict[str, Decision] | None = None
    limits: dict[str, Any] | None = None
    control: dict[str, Any] | None = None
    for i, part in enumerate(parts):
        where = f"params.message.parts[{i}]"
        part = json_object(part, where)
        kinds = [k for k in ("text", "data", "raw", "url") if k in part]
        if len(kinds) != 1:
            raise RpcError(INVALID_PARAMS, f"{where} must have exactly one of text, data, raw, url (has "
                                           f"{', '.join(kinds) or 'none'})")
        kind = kinds[0]
        media = str(get_field(part, "mediaType", "media_type") or "")
        if kind == "text":
            if not isinstance(part["text"], str):
                raise RpcError(INVALID_PARAMS, f"{where}.text must be a string")
            texts.append(part["text"])
        elif kind == "data":
            data = part["data"]
            if isinstance(data, dict) and data and set(data) <= {"decisions", "limits"}:
                control = data
                if "decisions" in data:
                    decisions = {str(k): _decision(str(k), v) for k, v in
                                 json_object(data["decisions"], "params.message data part: decisions").items()}
                    if not decisions:
                        raise RpcError(INVALID_PARAMS, "params.message data part: decisions is empty")
                if "limits" in data:
                    limits = _limits(data["limits"])
            else:
                texts.append(orjson.dumps(data).decode())
        elif kind == "raw" and (media.startswith("text/") or media in ("application/json", "")):
            try:
                texts.append(base64.b64decode(str(part["raw"]), validate=True).decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise RpcError(INVALID_PARAMS, f"{where}.raw must be base64 of UTF-8 text ({e})") from e
        else:
            raise RpcError(CONTENT_TYPE_NOT_SUPPORTED,
                           f"{where}: this agent reads text and JSON data parts; a {kind} part"
                           f"{' of ' + media if media else ''} is not supported (send its content as text)",
                           {"part": i, "media_type": media})
    text = "\n".join(t for t in texts if t)
    if len(text) > MAX_TEXT:
        raise RpcError(INVALID_PARAMS, f"params.message: the text is longer than {MAX_TEXT:,} characters")
    return Inbound(mid, id_field(m, "contextId", "context_id", "params.message", required=False),
                    id_field(m, "taskId", "task_id", "params.message", required=False), text, decisions, limits,
                    hashlib.sha256(orjson.dumps(m, option=orjson.OPT_SORT_KEYS)).hexdigest(), control)


def parse_configuration(params: dict[str, Any]) -> tuple[int | None, bool]:
    """(historyLength, returnImmediately) of a SendMessage configuration."""
    raw = get_field(params, "configuration")
    if raw is None:
        return None, False
    conf = json_object(raw, "params.configuration")
    if get_field(conf, "taskPushNotificationConfig", "task_push_notification_config") is not None:
        raise RpcError(PUSH_NOT_SUPPORTED, "this agent does not send push notifications (capabilities."
                                           "pushNotifications is false): stream the task or poll GetTask")
    modes = get_field(conf, "acceptedOutputModes", "accepted_output_modes")
    if modes is not None:
        if not isinstance(modes, list) or not all(isinstance(x, str) for x in modes):
            raise RpcError(INVALID_PARAMS, "params.configuration.acceptedOutputModes must be a list of media types")
        if modes and not any(x in ("text/plain", "text/*", "*/*") for x in modes):
            raise RpcError(CONTENT_TYPE_NOT_SUPPORTED, f"this agent answers in text/plain; the client accepts only "
                                                       f"{', '.join(modes)}")
    immediately = get_field(conf, "returnImmediately", "return_immediately")
    if immediately is not None and not isinstance(immediately, bool):
        raise RpcError(INVALID_PARAMS, "params.configuration.returnImmediately must be true or false")
    return opt_int(conf, "historyLength", "history_length", "params.configuration", 0, 2**31 - 1), bool(immediately)


def check_version(header: str | None) -> None:
    """Check a request's ``A2A-Version`` header (``None``: none sent, which means 0.3).

    Raises:
        RpcError: -32009: not a 1.x version; the message names the header to send.
    """
    raw = (header or "").strip()
    version = raw or "0.3"
    if not supported_version(version):
        missing = " (no A2A-Version header means 0.3)" if not raw else ""
        raise RpcError(VERSION_NOT_SUPPORTED, f"A2A version {version[:20]!r}{missing} is not supported: this server "
                                              f"speaks A2A {A2A_VERSION} only; send the header 'A2A-Version: "
                                              f"{A2A_VERSION}' with 1.0 method names (SendMessage ...)",
                       {"supported": A2A_VERSION})
