"""Agent2Agent (A2A 1.0) client, JSON-RPC binding: the agent card, the methods, and what they return.

* :func:`fetch_agent_card` gets and checks an agent card (``/.well-known/agent-card.json``): it
  must offer a JSONRPC interface of protocol version 1.x (a 0.3-only card is refused, by name).
* :class:`A2AClient` speaks the methods: ``SendMessage``, ``SendStreamingMessage``, ``GetTask``,
  ``ListTasks``, ``CancelTask``, ``SubscribeToTask`` (with ``Last-Event-ID`` when the server gave
  frame ids, as fsm_agent's server does). Every request carries ``A2A-Version: 1.0``.
* Its values: :class:`AgentCard`, :class:`RemoteTask` (:class:`RemoteArtifact`), :class:`StreamEvent`;
  its errors: the :class:`A2AError` family (a ``RunError``) and :class:`AgentCardError` (a
  ``ConfigurationError``).

The wire itself (the envelope, task states, frames) is :mod:`.a2a_wire`, shared with the server.
Import these from :mod:`fsm_agent.orchestration.a2a`, which also makes a tool of a remote agent.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson
from attrs import field, frozen

from ..errors import ConfigurationError, RunError
from ..providers.sse import SSEDecoder
from .a2a_wire import (A2A_VERSION, AGENT_CARD_PATH, NotJsonRpc, RpcError, TaskState, frame_result, parse_response,
                       parts_text, rpc_request, supported_version)

__all__ = ["A2AClient", "A2AConnectionError", "A2AError", "A2AHTTPError", "A2AProtocolError", "A2ARemoteError",
           "AgentCard", "AgentCardError", "RemoteArtifact", "RemoteTask", "StreamEvent", "fetch_agent_card"]


def _tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else tuple(value)


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
            if binding == "JSONRPC" and supported_version(version) and isinstance(i.get("url"), str):
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


@frozen
class RemoteArtifact:
    """One artifact of a remote task."""

    artifact_id: str
    name: str
    parts: tuple[dict[str, Any], ...] = field(converter=_tuple)

    @property
    def text(self) -> str:
        """Its text parts joined (chunks are fragments), data parts as JSON."""
        return parts_text(self.parts)


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
                   parts_text(msg.get("parts")) if isinstance(msg, dict) else "", arts,
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
        body = rpc_request(method, params, uuid.uuid4().hex)
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
        try:
            return parse_response(data)
        except RpcError as e:
            raise A2ARemoteError(f"{method}: the remote agent answered error {e.code}: {e.message}", e.code, e.reason,
                                 e.raw) from None
        except NotJsonRpc as e:
            raise A2AProtocolError(f"{method}: {e}") from None

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
        try:
            kind, value = frame_result(self._result(method, parsed))
        except NotJsonRpc as e:
            raise A2AProtocolError(f"{method}: {e}") from None
        return StreamEvent(kind, value, event_id)

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


