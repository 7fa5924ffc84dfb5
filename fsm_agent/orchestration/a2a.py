"""Agent2Agent (A2A 1.0) client: call a remote agent over the JSON-RPC binding, and use one as a tool.

* :func:`fetch_agent_card` gets and checks an agent card (``/.well-known/agent-card.json``): it
  must offer a JSONRPC interface of protocol version 1.x (a 0.3-only card is refused, by name).
* :class:`A2AClient` speaks the methods: ``SendMessage``, ``SendStreamingMessage``, ``GetTask``,
  ``ListTasks``, ``CancelTask``, ``SubscribeToTask`` (with ``Last-Event-ID`` when the server gave
  frame ids, as fsm_agent's server does). Every request carries ``A2A-Version: 1.0``.
* :func:`remote_agent_tool` makes a :class:`~fsm_agent.tools.Tool` of a remote agent.

**The tool's results by task state:**

========================== ===================================================================
COMPLETED                  the artifacts' text (text parts joined, data parts as JSON); the
                           status message when there is no artifact
FAILED, CANCELED, REJECTED an error result (:class:`RemoteTaskError`, ``metadata.error`` =
                           ``a2a_failed`` / ``a2a_canceled`` / ``a2a_rejected``) naming the
                           state, the task id and the remote's status message
INPUT_REQUIRED             an error result (``a2a_input_required``) with the remote's question
                           and how to answer: call the tool again with ``task_id`` and the
                           answer as ``message``; the remote task waits
AUTH_REQUIRED              an error result (``a2a_auth_required``): the remote wants credentials
                           this tool cannot give; the remote task is left waiting
a direct Message reply     its text
no answer within timeout   ``a2a_timeout``; the remote task is canceled
a JSON-RPC error           ``a2a_error`` (``a2a_no_task`` for an unknown ``task_id``)
no usable answer           ``a2a_unreachable`` (no connection, or it dropped more than
                           ``max_reconnects`` times), ``a2a_http`` (an HTTP error status),
                           ``a2a_protocol`` (not A2A JSON-RPC)
========================== ===================================================================

**Nothing twice.** The tool is ``side_effect`` (the remote agent may act on the world) and
``resumable``. A call's ``messageId`` is ``fsm-<idempotency key>`` and, for a new task, its
``contextId`` is ``fsm-ctx-<idempotency key>``: the same on every resume of the same call. Before
sending, the tool looks for the task that call created (``ListTasks`` by that context, or the
message in the named task's history) and reattaches to it (``SubscribeToTask``, else ``GetTask``
polls) instead of sending again. After a crash, the runtime asks the tool's ``on_reconcile``: it
reattaches and returns the task's result when the task exists, answers "run again" when the
server says it does not, and leaves the call to a person when the server cannot be asked (no
``ListTasks``).

**Cancel, interrupt.** A Cancel of the parent cancels the remote task (``on_compensate`` sends
``CancelTask``), the one the call started or the one it was continuing; one that had finished
after the call's message cannot be undone, and the parent asks to confirm. An Interrupt leaves it
running: the call stays open and the resume reattaches.

**Reports.** The remote task's id goes into the parent's log as a ``tool_progress`` event as soon
as it is known, and each WORKING status update with a message becomes one. Usage and cost the
remote reports in the task's metadata (``metadata.fsm_agent.usage`` / ``cost_usd``, as
fsm_agent's server sends them, or ``metadata.usage`` with ``input_tokens``/``output_tokens`` or
``prompt_tokens``/``completion_tokens``) are added to the parent run with
:meth:`~fsm_agent.tools.ToolContext.add_usage` (``child_session_id``: the remote task's id). A remote
reports a task's usage so far: each call adds only the increase over what was counted for that
task before (the parent's log with ``store``, this process's roll-ups, the task's usage when a
continuation began), so a task continued over several calls is counted once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson
from attrs import field, frozen

from ..errors import ConfigurationError, RunError, SessionLinkError, StoreError, ToolError
from ..providers.sse import SSEDecoder
from ..store.base import LinkKind, Store
from ..tools.registry import RUN_AGAIN, DEFAULT_TOOL_TIMEOUT, Tool, ToolContext, ToolEffect
from ..types.codec import structure
from ..types.messages import Usage

__all__ = ["A2AClient", "A2AConnectionError", "A2AError", "A2AHTTPError", "A2AProtocolError", "A2ARemoteError",
           "AgentCard", "AgentCardError", "RemoteArtifact", "RemoteTask", "RemoteTaskError", "StreamEvent",
           "TaskState", "fetch_agent_card", "remote_agent_tool"]

log = logging.getLogger("fsm_agent.orchestration.a2a")

A2A_VERSION = "1.0"
AGENT_CARD_PATH = "/.well-known/agent-card.json"
TASK_NOT_FOUND, UNSUPPORTED_OPERATION, METHOD_NOT_FOUND = -32001, -32004, -32601


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
        return self in _TERMINAL

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


def _tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else tuple(value)


_TERMINAL = frozenset({TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELED, TaskState.REJECTED})


# -- errors ---------------------------------------------------------------------------------------
class A2AError(RunError):
    """A call to a remote A2A agent failed."""


class A2AConnectionError(A2AError, ConnectionError):
    """The remote agent could not be reached, or the connection dropped."""


class A2AHTTPError(A2AError):
    """The remote answered with an HTTP error status (401: give a token; 404: wrong URL ...)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status."""


class A2AProtocolError(A2AError):
    """The remote's answer is not A2A 1.0 JSON-RPC (not JSON, no ``result``, a wrong shape)."""


class A2ARemoteError(A2AError):
    """The remote answered with a JSON-RPC error (-32001 task not found, -32009 version not supported ...)."""

    def __init__(self, message: str, code: int, reason: str = "", data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        """The JSON-RPC error code."""
        self.reason = reason
        """The A2A reason (``TASK_NOT_FOUND`` ...) when the remote sent one."""
        self.data = data
        """The error's ``data`` member as sent."""


class AgentCardError(ConfigurationError):
    """An agent card that cannot be used: not found, not JSON, not A2A 1.0, no JSONRPC interface."""


class RemoteTaskError(ToolError):
    """The tool's error result for a remote task that did not complete (``kind`` = ``a2a_<state>``,
    or ``a2a_timeout`` / ``a2a_no_task``)."""

    def __init__(self, message: str, *, state: TaskState, task_id: str | None, kind: str | None = None) -> None:
        super().__init__(message, kind=kind or f"a2a_{state.short.lower()}")
        self.state = state
        """The remote task's state."""
        self.task_id = task_id
        """The remote task's id (``None`` when none was created)."""


# -- values ---------------------------------------------------------------------------------------
@frozen
class AgentCard:
    """The parts of a remote agent card this client uses."""

    name: str
    description: str
    url: str
    """The JSON-RPC endpoint (from ``supportedInterfaces``)."""
    protocol_version: str
    streaming: bool
    """``capabilities.streaming``: whether SendStreamingMessage and SubscribeToTask are offered."""
    version: str = ""
    skills: tuple[str, ...] = field(default=(), converter=_tuple)
    """The skills' names."""
    raw: dict[str, Any] = field(factory=dict, eq=False, repr=False)
    """The card as received."""

    @classmethod
    def parse(cls, data: Any, source: str = "the agent card") -> AgentCard:
        """Check a card and keep what this client needs.

        Raises:
            AgentCardError: not an object; no name; 0.3-only; no JSONRPC interface of version 1.x.
        """
        if not isinstance(data, dict):
            raise AgentCardError(f"{source} is not a JSON object")
        name = data.get("name")
        if not isinstance(name, str) or not name.strip():
            raise AgentCardError(f"{source} has no 'name'")
        interfaces = data.get("supportedInterfaces")
        if interfaces is None and isinstance(data.get("url"), str):
            raise AgentCardError(f"{source} is an A2A {data.get('protocolVersion') or '0.3'} card (top-level 'url', no "
                                 "'supportedInterfaces'); this client speaks A2A 1.0 only")
        if not isinstance(interfaces, list):
            raise AgentCardError(f"{source} has no 'supportedInterfaces' list")
        found = None
        offered = []
        for i in interfaces:
            if not isinstance(i, dict):
                continue
            binding, version = str(i.get("protocolBinding") or ""), str(i.get("protocolVersion") or "")
            offered.append(f"{binding} {version}".strip())
            if binding == "JSONRPC" and re.fullmatch(r"1(\.[0-9]+){0,2}", version) and isinstance(i.get("url"), str):
                found = i
                break
        if found is None:
            raise AgentCardError(f"{source} offers no JSONRPC interface of A2A 1.x "
                                 f"(offered: {', '.join(offered) or 'none'}); "
                                 "this client speaks the JSON-RPC binding of A2A 1.0")
        caps: dict[str, Any] = data["capabilities"] if isinstance(data.get("capabilities"), dict) else {}
        skills = tuple(str(s.get("name") or s.get("id") or "") for s in data.get("skills") or () if isinstance(s, dict))
        return cls(name, str(data.get("description") or ""), found["url"], str(found["protocolVersion"]),
                   caps.get("streaming") is True, str(data.get("version") or ""), skills, data)


def _text(parts: Any) -> str:
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


@frozen
class RemoteArtifact:
    """One artifact of a remote task."""

    artifact_id: str
    name: str
    parts: tuple[dict[str, Any], ...] = field(converter=_tuple)

    @property
    def text(self) -> str:
        """Its text parts joined (chunks are fragments), data parts as JSON."""
        return _text(self.parts)


@frozen
class RemoteTask:
    """A remote task as the server last described it."""

    id: str
    context_id: str
    state: TaskState
    message: str = ""
    """The text of ``status.message`` ('' when none)."""
    artifacts: tuple[RemoteArtifact, ...] = field(default=(), converter=_tuple)
    metadata: dict[str, Any] = field(factory=dict)
    history: tuple[dict[str, Any], ...] = field(default=(), converter=_tuple)
    raw: dict[str, Any] = field(factory=dict, eq=False, repr=False)

    @property
    def text(self) -> str:
        """The artifacts' text, one artifact per paragraph."""
        return "\n\n".join(t for t in (a.text for a in self.artifacts) if t)

    @classmethod
    def parse(cls, data: Any) -> RemoteTask:
        """From a JSON ``Task``.

        Raises:
            A2AProtocolError: not a task (no ``id`` or ``status``).
        """
        if not (isinstance(data, dict) and isinstance(data.get("id"), str) and isinstance(data.get("status"), dict)):
            raise A2AProtocolError(f"expected an A2A Task (id, status), got {str(data)[:200]}")
        status = data["status"]
        arts = []
        for a in data.get("artifacts") or ():
            if isinstance(a, dict):
                arts.append(RemoteArtifact(str(a.get("artifactId") or ""), str(a.get("name") or ""),
                                           tuple(p for p in a.get("parts") or () if isinstance(p, dict))))
        msg = status.get("message")
        return cls(data["id"], str(data.get("contextId") or ""), TaskState.parse(status.get("state")),
                   _text(msg.get("parts")) if isinstance(msg, dict) else "", arts,
                   data["metadata"] if isinstance(data.get("metadata"), dict) else {},
                   tuple(h for h in data.get("history") or () if isinstance(h, dict)), data)


@frozen
class StreamEvent:
    """One frame of a stream: ``kind`` is ``task``, ``message``, ``status_update`` or ``artifact_update``."""

    kind: str
    data: dict[str, Any]
    """The result's member (the Task, Message, TaskStatusUpdateEvent or TaskArtifactUpdateEvent)."""
    event_id: str | None = None
    """The frame's SSE ``id:`` (fsm_agent's server: the session-log seq), or ``None``."""


_KINDS = {"task": "task", "message": "message", "statusUpdate": "status_update", "artifactUpdate": "artifact_update",
          "status_update": "status_update", "artifact_update": "artifact_update"}


# -- the client -----------------------------------------------------------------------------------
def _card_url(url: str) -> str:
    return url if url.endswith(".json") else url.rstrip("/") + AGENT_CARD_PATH


async def fetch_agent_card(url: str, *, headers: Mapping[str, str] | None = None, timeout: float = 30.0,
                           session: aiohttp.ClientSession | None = None) -> AgentCard:
    """The agent card of the agent at ``url`` (its base URL, or the card's own URL ending in ``.json``).

    Raises:
        AgentCardError: unreachable, not found, not JSON, or not a usable A2A 1.0 card.
    """
    target = _card_url(url)
    own = session is None
    s = session or aiohttp.ClientSession()
    try:
        async with s.get(target, headers=dict(headers or {}), timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise AgentCardError(f"no agent card at {target}: HTTP {resp.status}")
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise AgentCardError(f"the agent card at {target} is not JSON: {e}") from e
        return AgentCard.parse(data, f"the agent card at {target}")
    except (aiohttp.ClientError, TimeoutError) as e:
        raise AgentCardError(f"cannot fetch the agent card at {target}: {type(e).__name__}: {e}") from e
    finally:
        if own:
            await s.close()


class A2AClient:
    """One remote agent's JSON-RPC endpoint. Use as ``async with A2AClient(...) as client:``.

    Args:
        agent: the agent's base URL (its card is fetched on first use), its card's URL, or an
            :class:`AgentCard` / card dict.
        token: a bearer token (``Authorization: Bearer <token>``).
        headers: more headers for every request.
        timeout: seconds a non-streaming request may take.
        idle_timeout: seconds a stream may stay silent (no frame, no heartbeat) before it counts as dropped.
    """

    def __init__(self, agent: str | AgentCard | Mapping[str, Any], *, token: str | None = None,
                 headers: Mapping[str, str] | None = None, timeout: float = 30.0, idle_timeout: float = 120.0) -> None:
        self._card: AgentCard | None = None
        self._source = agent if isinstance(agent, str) else None
        if isinstance(agent, AgentCard):
            self._card = agent
        elif not isinstance(agent, str):
            self._card = AgentCard.parse(dict(agent))
        self.headers = {"A2A-Version": A2A_VERSION, **dict(headers or {})}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.timeout, self.idle_timeout = timeout, idle_timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> A2AClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def card(self) -> AgentCard:
        """The agent's card (fetched once).

        Raises:
            AgentCardError: see :func:`fetch_agent_card`.
        """
        if self._card is None:
            assert self._source is not None
            hdrs = {k: v for k, v in self.headers.items() if k.lower() == "authorization"}
            self._card = await fetch_agent_card(self._source, headers=hdrs, timeout=self.timeout, session=self._http())
        return self._card

    async def _post(self, method: str, params: dict[str, Any], *, stream: bool = False,
                    last_event_id: str | None = None) -> aiohttp.ClientResponse:
        card = await self.card()
        body = orjson.dumps({"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params})
        headers = {**self.headers, "Content-Type": "application/json"}
        if stream:
            headers["Accept"] = "text/event-stream"
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        timeout = (aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.idle_timeout) if stream
                   else aiohttp.ClientTimeout(total=self.timeout))
        try:
            resp = await self._http().post(card.url, data=body, headers=headers, timeout=timeout)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise A2AConnectionError(f"{method} to {card.url}: cannot connect: {type(e).__name__}: {e}") from e
        if resp.status != 200:
            text = (await resp.read())[:500].decode("utf-8", "replace")
            resp.release()
            hint = " (give the agent's token)" if resp.status in (401, 403) else ""
            raise A2AHTTPError(f"{method} to {card.url}: HTTP {resp.status}{hint}: {text}", resp.status)
        return resp

    @staticmethod
    def _result(method: str, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("jsonrpc") != "2.0":
            raise A2AProtocolError(f"{method}: the answer is not a JSON-RPC 2.0 response: {str(data)[:200]}")
        err = data.get("error")
        if err is not None:
            if not isinstance(err, dict):
                raise A2AProtocolError(f"{method}: 'error' is not an object: {str(err)[:200]}")
            code: int = err["code"] if isinstance(err.get("code"), int) else 0
            reason = ""
            details: list[Any] = err["data"] if isinstance(err.get("data"), list) else []
            for d in details:
                if isinstance(d, dict) and isinstance(d.get("reason"), str):
                    reason = d["reason"]
            raise A2ARemoteError(f"{method}: the remote agent answered error {code}: {err.get('message')}", code,
                                 reason, err.get("data"))
        if "result" not in data:
            raise A2AProtocolError(f"{method}: the answer has neither 'result' nor 'error'")
        return data["result"]

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        """One JSON-RPC request; returns its ``result``.

        Raises:
            A2AConnectionError, A2AHTTPError, A2AProtocolError, A2ARemoteError: see the classes.
        """
        resp = await self._post(method, params)
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise A2AConnectionError(f"{method}: the connection dropped: {type(e).__name__}: {e}") from e
        finally:
            resp.release()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise A2AProtocolError(f"{method}: the answer is not JSON: {e}") from e
        return self._result(method, data)

    async def _events(self, method: str, params: dict[str, Any], last_event_id: str | None
                      ) -> AsyncIterator[StreamEvent]:
        resp = await self._post(method, params, stream=True, last_event_id=last_event_id)
        try:
            if "text/event-stream" not in resp.headers.get("Content-Type", ""):
                data = orjson.loads(await resp.read())
                result = self._result(method, data)  # an error answer raises here
                raise A2AProtocolError(f"{method}: expected an event stream, got a JSON result: {str(result)[:200]}")
            decoder = SSEDecoder()
            async for chunk in resp.content.iter_any():
                for sse in decoder.feed(chunk):
                    yield self._event(method, sse.data, sse.id, sse.event)
            for sse in decoder.flush():
                yield self._event(method, sse.data, sse.id, sse.event)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise A2AConnectionError(f"{method}: the stream dropped: {type(e).__name__}: {e}") from e
        except orjson.JSONDecodeError as e:
            raise A2AProtocolError(f"{method}: the answer is not JSON: {e}") from e
        finally:
            resp.release()

    def _event(self, method: str, data: str, event_id: str | None, event: str) -> StreamEvent:
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise A2AProtocolError(f"{method}: a stream frame is not JSON: {data[:200]!r}") from e
        result = self._result(method, parsed)
        if not isinstance(result, dict) or len(result) != 1 or next(iter(result)) not in _KINDS:
            raise A2AProtocolError(f"{method}: a stream frame's result is not one of task, message, statusUpdate, "
                                   f"artifactUpdate: {data[:200]}")
        (key, value), = result.items()
        if not isinstance(value, dict):
            raise A2AProtocolError(f"{method}: the frame's {key} is not an object")
        return StreamEvent(_KINDS[key], value, event_id)

    # -- methods -------------------------------------------------------------------------------
    @staticmethod
    def _send_params(message: Mapping[str, Any], return_immediately: bool = False,
                     history_length: int | None = None) -> dict[str, Any]:
        conf: dict[str, Any] = {"acceptedOutputModes": ["text/plain", "application/json"]}
        if return_immediately:
            conf["returnImmediately"] = True
        if history_length is not None:
            conf["historyLength"] = history_length
        return {"message": dict(message), "configuration": conf}

    async def send_message(self, message: Mapping[str, Any], *, return_immediately: bool = False,
                           history_length: int | None = None) -> RemoteTask | dict[str, Any]:
        """``SendMessage``: the task (or the agent's direct reply Message, as a dict)."""
        result = await self.call("SendMessage", self._send_params(message, return_immediately, history_length))
        if isinstance(result, dict) and isinstance(result.get("message"), dict) and "task" not in result:
            reply: dict[str, Any] = result["message"]
            return reply
        return RemoteTask.parse(result.get("task") if isinstance(result, dict) else None)

    def stream_message(self, message: Mapping[str, Any]) -> AsyncIterator[StreamEvent]:
        """``SendStreamingMessage``: the stream's frames."""
        return self._events("SendStreamingMessage", self._send_params(message), None)

    def subscribe(self, task_id: str, *, last_event_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """``SubscribeToTask``; with ``last_event_id`` (fsm_agent's extension) the frames after it."""
        return self._events("SubscribeToTask", {"id": task_id}, last_event_id)

    async def get_task(self, task_id: str, *, history_length: int | None = None) -> RemoteTask:
        """``GetTask``."""
        params: dict[str, Any] = {"id": task_id}
        if history_length is not None:
            params["historyLength"] = history_length
        return RemoteTask.parse(await self.call("GetTask", params))

    async def list_tasks(self, *, context_id: str | None = None, status: TaskState | None = None,
                         page_size: int | None = None, page_token: str | None = None,
                         history_length: int | None = None) -> tuple[list[RemoteTask], str]:
        """``ListTasks``: (tasks, next page token, '' on the last page)."""
        params: dict[str, Any] = {}
        for key, value in (("contextId", context_id), ("status", status.value if status else None),
                           ("pageSize", page_size), ("pageToken", page_token), ("historyLength", history_length)):
            if value is not None:
                params[key] = value
        result = await self.call("ListTasks", params)
        if not isinstance(result, dict) or not isinstance(result.get("tasks", []), list):
            raise A2AProtocolError(f"ListTasks: expected {{tasks, nextPageToken}}, got {str(result)[:200]}")
        return [RemoteTask.parse(t) for t in result.get("tasks") or ()], str(result.get("nextPageToken") or "")

    async def cancel_task(self, task_id: str) -> RemoteTask:
        """``CancelTask``."""
        return RemoteTask.parse(await self.call("CancelTask", {"id": task_id}))

    def __repr__(self) -> str:
        return f"A2AClient({self._card.url if self._card else self._source!r})"


# -- following one task ---------------------------------------------------------------------------
class _View:
    """A task put together from stream frames (artifact chunks appended by ``artifactId``)."""

    def __init__(self) -> None:
        self.task_id: str | None = None
        self.context_id = ""
        self.state = TaskState.UNSPECIFIED
        self.message = ""
        self.artifacts: dict[str, RemoteArtifact] = {}
        self.metadata: dict[str, Any] = {}
        self.reply: dict[str, Any] | None = None
        self.last_id: str | None = None
        self.frames = 0

    @property
    def done(self) -> bool:
        return self.reply is not None or self.state.terminal or self.state.interrupted

    def apply(self, ev: StreamEvent) -> None:
        self.frames += 1
        if ev.event_id is not None:
            self.last_id = ev.event_id
        d = ev.data
        if ev.kind == "message":
            self.reply = d
            return
        if ev.kind == "task":
            task = RemoteTask.parse(d)
            self.task_id, self.context_id, self.state, self.message = task.id, task.context_id, task.state, task.message
            self.artifacts = {a.artifact_id: a for a in task.artifacts}
            self.metadata = dict(task.metadata)
            return
        self.task_id = self.task_id or (d.get("taskId") if isinstance(d.get("taskId"), str) else None)
        if isinstance(d.get("metadata"), dict):
            self.metadata.update(d["metadata"])
        if ev.kind == "status_update":
            status: dict[str, Any] = d["status"] if isinstance(d.get("status"), dict) else {}
            self.state = TaskState.parse(status.get("state"))
            msg = status.get("message")
            self.message = _text(msg.get("parts")) if isinstance(msg, dict) else ""
        elif ev.kind == "artifact_update" and isinstance(d.get("artifact"), dict):
            a: dict[str, Any] = d["artifact"]
            aid = str(a.get("artifactId") or "")
            parts = tuple(p for p in a.get("parts") or () if isinstance(p, dict))
            old = self.artifacts.get(aid)
            if d.get("append") and old is not None:
                self.artifacts[aid] = RemoteArtifact(aid, old.name, old.parts + parts)
            else:
                self.artifacts[aid] = RemoteArtifact(aid, str(a.get("name") or ""), parts)

    def task(self) -> RemoteTask:
        return RemoteTask(self.task_id or "", self.context_id, self.state, self.message, tuple(self.artifacts.values()),
                          self.metadata)


def _usage_of(metadata: Mapping[str, Any]) -> tuple[Usage, float | None] | None:
    ours = metadata.get("fsm_agent")
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


class _Call:
    """One tool call to a remote agent: find or send, follow to a final or interrupted state."""

    def __init__(self, client: A2AClient, ctx: ToolContext, *, streaming: bool | None, poll_interval: float,
                 max_reconnects: int) -> None:
        self.client, self.ctx = client, ctx
        self.streaming, self.poll_interval, self.max_reconnects = streaming, poll_interval, max_reconnects
        self.message_id = f"fsm-{ctx.idempotency_key}"
        self.context_id = f"fsm-ctx-{ctx.idempotency_key}"
        self.view = _View()
        self.lookup_supported = True
        self.progress = 0
        self.announced: str | None = None
        self.on_task: Callable[[str], Awaitable[None]] | None = None
        """Awaited once with the id of the task this call started (not of a task it continues)."""
        self.continuing = False
        self.before: RemoteTask | None = None
        """The continued task as :meth:`find` saw it before this call's message reached it (its usage
        then was counted by the calls before this one)."""

    async def _announce(self) -> None:
        tid = self.view.task_id
        if tid and self.announced != tid:
            self.announced = tid
            where = f" at {self.client._card.url}" if self.client._card is not None else ""
            self.ctx.report_progress(self.progress, None, f"remote task {tid}{where}")
            if self.on_task is not None and not self.continuing:
                await self.on_task(tid)

    async def _apply(self, ev: StreamEvent) -> None:
        before = (self.view.state, self.view.message)
        self.view.apply(ev)
        await self._announce()
        v = self.view
        changed = ev.kind == "status_update" or (ev.kind == "task" and (v.state, v.message) != before)
        if changed and v.state is TaskState.WORKING and v.message:
            self.progress += 1
            self.ctx.report_progress(self.progress, None, v.message)

    async def find(self, task_id: str | None) -> RemoteTask | None:
        """The task an earlier attempt of this call already reached, or ``None``.

        A new task (``task_id`` ``None``): the task of this call's context, by ``ListTasks``
        (``None`` also when the remote offers no ``ListTasks``: :attr:`lookup_supported` is then
        false). A continuation: the named task when its ``history`` holds this call's
        ``messageId`` (fsm_agent's server lists every message a client sent there, a decisions-only
        one too); else ``None``, and the task as it was is kept in :attr:`before`.

        Raises:
            A2AError: the remote could not be asked (-32001 for an unknown ``task_id``).
        """
        try:
            if task_id is not None:
                task = await self.client.get_task(task_id)
                if any(h.get("messageId") == self.message_id for h in task.history):
                    return task
                self.before = task
                return None
            tasks, _ = await self.client.list_tasks(context_id=self.context_id, page_size=5)
            mine = [t for t in tasks if t.context_id == self.context_id]  # a server that ignores the filter
            return mine[0] if mine else None
        except A2ARemoteError as e:
            if e.code in (METHOD_NOT_FOUND, UNSUPPORTED_OPERATION):
                self.lookup_supported = False
                return None
            raise

    async def run(self, text: str, task_id: str | None, data: Any = None) -> RemoteTask | dict[str, Any]:
        self.continuing = task_id is not None
        existing = await self.find(task_id)
        if existing is not None:
            return await self.follow(existing)
        parts: list[dict[str, Any]] = [{"text": text}] if text else []
        if data is not None:
            parts.append({"data": data})
        message: dict[str, Any] = {"messageId": self.message_id, "role": "ROLE_USER", "parts": parts}
        if task_id is not None:
            message["taskId"] = task_id
        else:
            message["contextId"] = self.context_id
        card = await self.client.card()
        if card.streaming and self.streaming is not False:
            try:
                async for ev in self.client.stream_message(message):
                    await self._apply(ev)
                    if self.view.done:
                        break
            except (A2AConnectionError, A2AProtocolError) as e:
                if self.view.task_id is None:  # did the task come into being? look before sending again
                    found = await self.find(task_id)
                    if found is None:
                        raise
                    return await self.follow(found)
                log.info("stream of remote task %s dropped (%s); reconnecting", self.view.task_id, e)
            if self.view.reply is not None:
                return self.view.reply
            return await self.follow(None)
        result = await self.client.send_message(message)
        if isinstance(result, dict):
            return result
        return await self.follow(result)  # announces the task

    async def follow(self, task: RemoteTask | None) -> RemoteTask:
        """Follow the task to a final or interrupted state (reconnecting with Last-Event-ID), then
        return it as GetTask has it (the stream's view if GetTask fails)."""
        v = self.view
        if task is not None:
            v.apply(StreamEvent("task", task.raw or {"id": task.id, "contextId": task.context_id,
                                                     "status": {"state": task.state.value}}))
            await self._announce()
        if v.task_id is None:
            raise A2AProtocolError("the remote's stream ended before it named a task")
        card = await self.client.card()
        drops = 0
        while not v.done:
            dropped: Exception | None = None
            try:
                if card.streaming and self.streaming is not False:
                    async for ev in self.client.subscribe(v.task_id, last_event_id=v.last_id):
                        await self._apply(ev)
                        if v.done:
                            break
                    if not v.done:
                        dropped = A2AConnectionError("the stream ended before the task did")
                else:
                    await asyncio.sleep(self.poll_interval)
                    got = await self.client.get_task(v.task_id, history_length=0)
                    await self._apply(StreamEvent("task", got.raw))
            except A2ARemoteError as e:
                if e.code != UNSUPPORTED_OPERATION:  # -32004: it ended between two looks
                    raise
                got = await self.client.get_task(v.task_id, history_length=0)
                v.apply(StreamEvent("task", got.raw))
            except (A2AConnectionError, A2AProtocolError) as e:
                dropped = e
            if dropped is not None and not v.done:
                drops += 1
                if drops > self.max_reconnects:
                    raise A2AConnectionError(f"remote task {v.task_id}: gave up after {drops} dropped connections; "
                                             f"last: {dropped}") from dropped
                log.info("remote task %s: %s; reconnecting (%d)", v.task_id, dropped, drops)
                await asyncio.sleep(min(2.0, 0.05 * 2 ** drops))
        try:
            return await self.client.get_task(v.task_id, history_length=0)
        except A2AError:
            return v.task()

    async def cancel(self, timeout: float) -> None:
        """Cancel the remote task (when one exists and is not final); errors are logged, not raised."""
        tid = self.view.task_id
        if tid is None or self.view.state.terminal:
            return
        try:
            async with asyncio.timeout(timeout):
                await self.client.cancel_task(tid)
        except (A2AError, TimeoutError) as e:
            log.warning("could not cancel remote task %s: %s", tid, e)


def _outcome(task: RemoteTask | dict[str, Any], agent: str, tool: str | None) -> str:
    """The tool's result for a final or interrupted task (raises RemoteTaskError unless COMPLETED)."""
    if isinstance(task, dict):  # a direct Message reply
        return _text(task.get("parts")) or "(the remote agent replied with an empty message)"
    what = f"remote agent {agent}: task {task.id}"
    if task.state is TaskState.COMPLETED:
        return task.text or task.message or "(the remote agent completed with no output)"
    if task.state is TaskState.INPUT_REQUIRED:
        how = (f"To answer, call {tool} again with task_id={task.id!r} and the answer as message." if tool else
               "This tool cannot answer it; the task is left waiting.")
        raise RemoteTaskError(f"{what} needs more input (INPUT_REQUIRED): {task.message or 'no question given'}. "
                              f"{how}", state=task.state, task_id=task.id)
    if task.state is TaskState.AUTH_REQUIRED:
        raise RemoteTaskError(f"{what} needs authentication this tool cannot give (AUTH_REQUIRED): "
                              f"{task.message or 'no detail'}; the task is left waiting.", state=task.state,
                              task_id=task.id)
    raise RemoteTaskError(f"{what} ended {task.state.short}: {task.message or 'no detail given'}", state=task.state,
                          task_id=task.id)


def _tool_name(name: str) -> str:
    n = re.sub(r"[^a-zA-Z0-9_-]+", "_", name).strip("_")[:64]
    return n or "remote_agent"


def remote_agent_tool(agent: str | AgentCard | Mapping[str, Any], *, name: str | None = None,
                      description: str | None = None, token: str | None = None,
                      headers: Mapping[str, str] | None = None, timeout: float | None = DEFAULT_TOOL_TIMEOUT,
                      streaming: bool | None = None, poll_interval: float = 1.0, max_reconnects: int = 5,
                      cancel_timeout: float = 5.0, request_timeout: float = 30.0, store: Store | None = None,
                      continuation: bool = True) -> Tool:
    """A tool that sends the model's ``message`` to a remote A2A agent and returns its answer.

    Args:
        agent: the remote's base URL, its card's URL, or its card (:class:`AgentCard`, or a card
            dict such as :attr:`AgentCard.raw`). With a URL the card is fetched on the first call:
            give ``name`` and ``description`` for the model, or pass a fetched card.
        name: the tool's name (default: the card's name, made a valid tool name; ``remote_agent``
            with a URL).
        description: what the model reads (default: the card's description and skills).
        token: a bearer token for the remote.
        headers: more HTTP headers for every request.
        timeout: seconds one call may take in all (``None``: no limit). When it runs out the remote
            task is canceled and the call is an error result (``a2a_timeout``).
        streaming: ``False`` to poll with ``GetTask`` even when the card offers streaming.
        poll_interval: seconds between ``GetTask`` polls (non-streaming remotes).
        max_reconnects: dropped streams tolerated per call before the call fails.
        cancel_timeout: seconds a ``CancelTask`` may take.
        request_timeout: seconds each non-streaming request may take.
        store: the parent agent's store: each remote task the tool starts is linked there to the
            parent's call (:func:`~fsm_agent.orchestration.links.link_child`, kind ``remote``, the
            remote task's id as the child id, the agent's URL in the metadata), and the parent's log
            says how much of a task's usage was rolled up already (exact across crashes and
            processes). ``None``: no link (the task id is in the parent's log as a ``tool_progress``
            event either way), and a call resumed in another process may roll a task's usage up again.
        continuation: offer the ``task_id`` and ``data`` parameters, so that the model can answer a
            remote task that asks for input. ``False``: ``message`` only (for a remote that never
            asks, or a small model that should see one parameter); an INPUT_REQUIRED task is then
            an error result saying the tool cannot answer it.

    The tool's parameters: ``message`` (str), ``task_id`` (optional: continue a remote task that
    asked for input) and ``data`` (optional object, sent as a data part: what a remote asked for in
    structured form, such as fsm_agent's ``{"decisions": ...}``). It is ``side_effect`` and
    ``resumable``: an Interrupt of the parent leaves the remote task running and the resume
    reattaches to it; a Cancel of the parent cancels it (``on_compensate``; a remote task that had
    already finished cannot be undone, and the parent then asks to confirm the cancel). Results and guarantees: see the module docstring.

    Raises:
        AgentCardError: ``agent`` is a card that cannot be used.
        ConfigurationError: a bad option.
    """
    card = agent if isinstance(agent, AgentCard) else None if isinstance(agent, str) else AgentCard.parse(dict(agent))
    if poll_interval <= 0 or max_reconnects < 0 or cancel_timeout <= 0 or request_timeout <= 0 or (
            timeout is not None and timeout <= 0):
        raise ConfigurationError("remote_agent_tool: timeout, poll_interval, cancel_timeout and request_timeout must "
                                 "be positive and max_reconnects >= 0")
    tool_name = name or (_tool_name(card.name) if card else "remote_agent")
    if description is None:
        if card is not None:
            skills = f" Skills: {', '.join(s for s in card.skills if s)}." if any(card.skills) else ""
            description = f"Ask the remote agent {card.name}: {card.description.rstrip('.')}.{skills}"
        else:
            description = f"Ask the remote agent at {agent} (A2A)."
    if continuation:
        description += " If it needs more input, the result says so: call again with its task_id and your answer."
    state: dict[str, AgentCard] = {}
    rolled = _RolledUp(store)
    target: str | AgentCard = card if card is not None else str(agent)
    options = {"streaming": streaming, "poll_interval": poll_interval, "max_reconnects": max_reconnects}

    def client() -> A2AClient:
        return A2AClient(state.get("card", target), token=token, headers=headers, timeout=request_timeout)

    async def start(c: A2AClient, ctx: ToolContext) -> _Call:
        state.setdefault("card", await c.card())
        run = _Call(c, ctx, **options)  # type: ignore[arg-type]
        if store is not None:
            run.on_task = lambda tid: _link(store, ctx, tid, state["card"])
        return run

    async def call(message: str, ctx: ToolContext, task_id: str | None = None, data: Any = None) -> str:
        async with client() as c:
            run = await start(c, ctx)
            agent_name = state["card"].name
            try:
                async with asyncio.timeout(timeout):
                    task = await run.run(message, task_id, data)
            except TimeoutError:
                await run.cancel(cancel_timeout)
                raise RemoteTaskError(f"remote agent {agent_name}: task {run.view.task_id} did not finish within "
                                      f"{timeout:g} s; it was canceled", state=run.view.state,
                                      task_id=run.view.task_id, kind="a2a_timeout") from None
            except A2ARemoteError as e:
                if e.code == TASK_NOT_FOUND and task_id is not None:
                    raise RemoteTaskError(f"remote agent {agent_name}: there is no task {task_id!r} (give the task_id "
                                          "of an earlier result that asked for input, or none to start a new task)",
                                          state=TaskState.UNSPECIFIED, task_id=None, kind="a2a_no_task") from e
                raise RemoteTaskError(f"remote agent {agent_name} refused the message: {e}", state=run.view.state,
                                      task_id=run.view.task_id or task_id, kind="a2a_error") from e
            except A2AError as e:
                kind = ("a2a_protocol" if isinstance(e, A2AProtocolError) else "a2a_http" if isinstance(e, A2AHTTPError)
                        else "a2a_unreachable")
                raise RemoteTaskError(f"remote agent {agent_name}: {e}", state=run.view.state,
                                      task_id=run.view.task_id or task_id, kind=kind) from e
            await rolled.add(ctx, task, run.before)
            return _outcome(task, agent_name, tool_name if continuation else None)

    async def reconcile(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        """After a crash mid-call: the task's result when the task exists, RUN_AGAIN when the
        remote says it does not, None (ask a person) when the remote cannot be asked."""
        try:
            async with client() as c:
                run = await start(c, ctx)
                found = await run.find(arguments.get("task_id"))
                if found is None:
                    return RUN_AGAIN if run.lookup_supported else None
                async with asyncio.timeout(timeout):
                    task = await run.follow(found)
                await rolled.add(ctx, task, None)
                try:
                    return _outcome(task, state["card"].name, tool_name if continuation else None)
                except RemoteTaskError as e:
                    return str(e)
        except (A2AError, AgentCardError, TimeoutError) as e:
            log.warning("reconcile of %s (%s): %s; a person decides", tool_name, ctx.call_id, e)
            return None

    async def compensate(arguments: dict[str, Any], result: Any, ctx: ToolContext) -> bool:
        """The parent is cancelled: cancel the remote task this call made. ``True`` when it ends
        (or was) CANCELED; ``False`` when it had finished otherwise or cannot be reached."""
        try:
            async with client() as c:
                run = await start(c, ctx)
                task_id = arguments.get("task_id")
                found = await run.find(task_id)
                reached = found is not None
                if found is None and task_id is not None:
                    found = run.before  # the task it was continuing: the parent gives it up too
                if found is None:
                    return run.lookup_supported  # nothing was started: nothing to undo
                if found.state is TaskState.CANCELED:
                    return True
                if found.state.terminal:
                    return not reached  # finished: undone only if this call's message never reached it
                async with asyncio.timeout(cancel_timeout):
                    return (await c.cancel_task(found.id)).state is TaskState.CANCELED
        except (A2AError, AgentCardError, TimeoutError) as e:
            log.warning("could not cancel the remote task of %s (%s): %s", tool_name, ctx.call_id, e)
            return False

    params: dict[str, Any] = {"type": "object", "properties": {
        "message": {"type": "string", "description": "What to ask or tell the remote agent."},
        "task_id": {"type": "string", "description": "Only to answer a remote task that asked for more input: "
                                                     "its task_id from the earlier result."},
        "data": {"type": "object", "description": "Structured input the remote asked for, sent as a data part "
                                                  "(e.g. {\"decisions\": ...} for an agent waiting for approvals)."}},
        "required": ["message"], "additionalProperties": False}
    if not continuation:
        params["properties"] = {"message": params["properties"]["message"]}
    runtime_timeout = None if timeout is None else timeout + cancel_timeout + 5.0  # ours fires first
    t = Tool(call, name=tool_name, description=description, parameters=params, timeout=runtime_timeout,
             effect=ToolEffect.SIDE_EFFECT, resumable=True)
    t.on_reconcile(reconcile)
    t.on_compensate(compensate)
    return t


async def _link(store: Store, ctx: ToolContext, task_id: str, card: AgentCard) -> None:
    from .links import link_child

    try:
        await link_child(store, ctx.session_id, task_id, LinkKind.REMOTE.value, call_id=ctx.call_id,
                         metadata={"url": card.url, "agent": card.name})
    except (SessionLinkError, KeyError, ValueError, StoreError) as e:
        log.warning("remote task %s of call %s not linked to session %s: %s", task_id, ctx.call_id,
                    ctx.session_id, e)


def _at_least(a: tuple[Usage, float], b: tuple[Usage, float]) -> tuple[Usage, float]:
    """The larger of two counts of one cumulative total, field by field."""
    u, v = a[0], b[0]
    return (Usage(max(u.input_tokens, v.input_tokens), max(u.output_tokens, v.output_tokens),
                  max(u.cache_read_tokens, v.cache_read_tokens), max(u.cache_write_tokens, v.cache_write_tokens),
                  max(u.reasoning_tokens, v.reasoning_tokens), u.estimated or v.estimated), max(a[1], b[1]))


class _RolledUp:
    """Rolls a remote task's usage up into the parent once: a remote reports its task's usage so far
    (cumulative), and a task continued over several calls reports it again each time, so only the
    increase over what was counted before is added (``ToolContext.add_usage``, naming the task as
    ``child_session_id``).

    What was counted before, the most of: the parent's log (its ``usage_rolled_up`` events for the
    task, with ``store``: exact across resumes and processes), this process's own roll-ups, and the
    task's usage when the call began (a continuation: the earlier calls counted it)."""

    _KEEP = 10_000
    """Roll-ups remembered in memory (oldest forgotten first)."""

    def __init__(self, store: Store | None) -> None:
        self.store = store
        self.seen: dict[tuple[str, str], tuple[Usage, float]] = {}

    async def _logged(self, session_id: str, task_id: str) -> tuple[Usage, float]:
        total, cost = Usage(), 0.0
        if self.store is None:
            return total, cost
        try:
            events = await self.store.read_events(session_id, types=("usage_rolled_up",))
        except (StoreError, KeyError) as e:
            log.warning("usage of remote task %s: the parent's log could not be read (%s)", task_id, e)
            return total, cost
        for ev in events:
            if ev.payload.get("child_session_id") == task_id:
                total = total + structure(ev.payload.get("usage") or {}, Usage)
                cost += float(ev.payload.get("cost_usd") or 0.0)
        return total, cost

    async def add(self, ctx: ToolContext, task: RemoteTask | dict[str, Any], before: RemoteTask | None) -> None:
        """Add what ``task`` reports beyond what was counted (``before``: the task as the call found
        it before its message reached it)."""
        if not isinstance(task, RemoteTask):
            return
        got = _usage_of(task.metadata)
        if got is None:
            return
        key = (ctx.session_id, task.id)
        counted = _at_least(self.seen.get(key, (Usage(), 0.0)), await self._logged(ctx.session_id, task.id))
        earlier = _usage_of(before.metadata) if before is not None and before.id == task.id else None
        if earlier is not None:
            counted = _at_least(counted, (earlier[0], earlier[1] or 0.0))
        total, cost = got
        done, done_cost = counted
        delta = Usage(max(0, total.input_tokens - done.input_tokens), max(0, total.output_tokens - done.output_tokens),
                      max(0, total.cache_read_tokens - done.cache_read_tokens),
                      max(0, total.cache_write_tokens - done.cache_write_tokens),
                      max(0, total.reasoning_tokens - done.reasoning_tokens), total.estimated)
        extra = None if cost is None else max(0.0, cost - done_cost)
        if delta.total_tokens == 0 and not extra:
            return
        if len(self.seen) >= self._KEEP:
            self.seen.pop(next(iter(self.seen)))
        self.seen[key] = (done + delta, done_cost + (extra or 0.0))
        ctx.add_usage(delta, extra, child_session_id=task.id)
