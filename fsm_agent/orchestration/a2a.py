"""Agent2Agent (A2A 1.0) client: call a remote agent over the JSON-RPC binding, and use one as a tool.

* :func:`fetch_agent_card` gets and checks an agent card (``/.well-known/agent-card.json``): it
  must offer a JSONRPC interface of protocol version 1.x (a 0.3-only card is refused, by name).
* :class:`A2AClient` speaks the methods: ``SendMessage``, ``SendStreamingMessage``, ``GetTask``,
  ``ListTasks``, ``CancelTask``, ``SubscribeToTask`` (with ``Last-Event-ID`` when the server gave
  frame ids, as fsm_agent's server does). Every request carries ``A2A-Version: 1.0``.
* :func:`remote_agent_tool` makes a :class:`~fsm_agent.tools.Tool` of a remote agent.

This module is the tool, and the public face of the client (:mod:`.a2a_client`, re-exported here);
the wire both sides speak, this client and fsm_agent's server (:mod:`fsm_agent.server.a2a`), is
:mod:`.a2a_wire`: the JSON-RPC envelope, :class:`TaskState` and the stop-to-task-state mapping,
messages, parts and frames.

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
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..errors import ConfigurationError, SessionLinkError, StoreError, ToolError
from ..store.base import LinkKind, Store
from ..tools.registry import RUN_AGAIN, DEFAULT_TOOL_TIMEOUT, Tool, ToolContext, ToolEffect
from ..types.codec import structure
from ..types.messages import Usage
from .a2a_client import (A2AClient, A2AConnectionError, A2AError, A2AHTTPError, A2AProtocolError, A2ARemoteError,
                         AgentCard, AgentCardError, RemoteArtifact, RemoteTask, StreamEvent, fetch_agent_card)
from .a2a_wire import (METHOD_NOT_FOUND, TASK_NOT_FOUND, UNSUPPORTED_OPERATION, TaskState, parts_text, usage_of,
                       user_message)

__all__ = ["A2AClient", "A2AConnectionError", "A2AError", "A2AHTTPError", "A2AProtocolError", "A2ARemoteError",
           "AgentCard", "AgentCardError", "RemoteArtifact", "RemoteTask", "RemoteTaskError", "StreamEvent",
           "TaskState", "fetch_agent_card", "remote_agent_tool"]

log = logging.getLogger("fsm_agent.orchestration.a2a")


class RemoteTaskError(ToolError):
    """The tool's error result for a remote task that did not complete (``kind`` = ``a2a_<state>``,
    or ``a2a_timeout`` / ``a2a_no_task``)."""

    def __init__(self, message: str, *, state: TaskState, task_id: str | None, kind: str | None = None) -> None:
        super().__init__(message, kind=kind or f"a2a_{state.short.lower()}")
        self.state = state
        """The remote task's state."""
        self.task_id = task_id
        """The remote task's id (``None`` when none was created)."""


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
            self.message = parts_text(msg.get("parts")) if isinstance(msg, dict) else ""
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
        message = user_message(self.message_id, parts, task_id=task_id,
                               context_id=None if task_id is not None else self.context_id)
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
        return parts_text(task.get("parts")) or "(the remote agent replied with an empty message)"
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
        got = usage_of(task.metadata)
        if got is None:
            return
        key = (ctx.session_id, task.id)
        counted = _at_least(self.seen.get(key, (Usage(), 0.0)), await self._logged(ctx.session_id, task.id))
        earlier = usage_of(before.metadata) if before is not None and before.id == task.id else None
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
