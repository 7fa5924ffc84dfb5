"""The effect port of a run inside a session's workflow: the engine's effects in Temporal's terms.

* Time, timers, chance and ids come from the workflow's deterministic sources (``workflow.now()``,
  ``workflow.time()``, the workflow loop's durable timers, ``workflow.random()``,
  ``workflow.uuid4()``).
* The store is the workflow's :class:`~fsm_agent.temporal.mirror.MirrorStore`; its writes ride the
  next activity.
* Model calls, tools and tools' hooks are activities (:mod:`fsm_agent.temporal.activities`). A
  tool's retry policy follows its declared effect: a ``pure`` tool is retried, an ``idempotent`` one
  is retried with the same idempotency key, a ``side_effect`` one runs at most once; when the worker
  running it is lost, the engine hears :class:`~fsm_agent.errors.OutcomeUnknown` and settles the
  call as a crash recovery does (``on_reconcile``, or WAITING_HUMAN), never by a silent re-run.
* Controls come from the workflow's signals: the watch is told at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import CancelledError as TemporalCancelled
from temporalio.exceptions import TimeoutError as TemporalTimeout

from ..control import Decision
from ..errors import OutcomeUnknown, PayloadTooLargeError
from ..machine.port import Cancellable, ModelTrace, OnRetry, ToolReport
from ..prompt import PromptSnapshot, PromptSource
from ..providers.base import Provider
from ..store.base import ControlKind, ControlRecord
from ..tools.registry import Tool, ToolContext, ToolEffect, ToolRegistry
from ..types.codec import structure, unstructure
from ..types.content import ToolUseBlock
from ..types.messages import ToolResultMessage
from ..types.requests import MessageRequest, MessageResponse
from ..types.stream import StreamEvent
from ._codec import exception_of, form, message_digest, value_of
from .mirror import MirrorStore
from .registry import provider_key

__all__ = ["Timeouts", "WorkflowPort"]

_ACTIVITY_ERRORS = frozenset({"ModelCallCut"})

PROMPT_PATCH = "fsm_agent.system_prompt"
"""The patch (``workflow.patched``) under which a session reads its agent's system prompt at its start
and at each PreTurn: histories recorded before it replay without the reads."""


class Timeouts:
    """Activity timeouts and retries of a session's workflow.

    Args:
        heartbeat: seconds without a heartbeat after which a worker is taken for dead (activities
            heartbeat every second).
        model_call: seconds a model call's activity may take in all (each attempt).
        tool: seconds a tool's activity may take, when the tool sets no timeout of its own.
        attempts: attempts of an activity that may run again (a model call, a ``pure`` or
            ``idempotent`` tool) when its worker is lost.
        max_payload: bytes of one payload the workflow sends or receives; a larger one is refused
            with :class:`~fsm_agent.errors.PayloadTooLargeError` (Temporal's own limit is 2 MiB).
    """

    def __init__(self, *, heartbeat: float = 5.0, model_call: float = 600.0, tool: float = 600.0,
                 attempts: int = 5, max_payload: int = 1_800_000) -> None:
        self.heartbeat = heartbeat
        self.model_call = model_call
        self.tool = tool
        self.attempts = attempts
        self.max_payload = max_payload


def _size(data: Any) -> int:
    """Bytes of ``data`` as one payload."""
    return len(workflow.payload_converter().to_payloads([data])[0].data)


class _Handle:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class WorkflowPort:
    """The effects of one session's run inside its workflow (see the module doc).

    Args:
        agent: the agent's registered name (activities look it up).
        store: the workflow's mirror of the session.
        timeouts: activity timeouts and retries.
    """

    def __init__(self, agent: str, store: MirrorStore, timeouts: Timeouts, *, history_limit: int = 0,
                 continue_text: str = "") -> None:
        self.agent = agent
        self.history_limit = history_limit
        self.continue_text = continue_text
        self.continue_asked = False
        """The workflow's history passed ``history_limit``: an Interrupt was queued to stop the run at its
        next PreTurn, so that the workflow continues as new."""
        self.store = store
        self.timeouts = timeouts
        self.rng = workflow.random()
        self.stored: set[str] = set()
        """Digests of the message forms the real store holds (sent by reference after the first time)."""
        self.watchers: list[tuple[_Handle, Callable[[], None]]] = []

    # -- time and chance ---------------------------------------------------------------------
    def now(self) -> float:
        return workflow.now().timestamp()

    def monotonic(self) -> float:
        return workflow.time()

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        return asyncio.get_running_loop().call_later(max(0.0, delay), callback)

    def random(self) -> float:
        return self.rng.random()

    def new_id(self) -> str:
        return workflow.uuid4().hex

    # -- carried writes ---------------------------------------------------------------------------
    def _take_writes(self) -> list[dict[str, Any]]:
        writes, self.store.pending = self.store.pending, []
        return writes

    async def flush(self) -> None:
        """Apply the queued writes now (at a stop, before the workflow waits or ends)."""
        writes = self._take_writes()
        if writes:
            await self._apply_in_parts(writes)

    async def _apply_in_parts(self, writes: list[dict[str, Any]]) -> None:
        """Apply ``writes`` in order, in as few activities as keep each payload under the limit.

        Raises:
            PayloadTooLargeError: one write alone is over the limit. The writes before it are applied;
                it and the ones after it stay queued (``store.pending``), in order.
        """
        limit = self.timeouts.max_payload
        empty = _size({"agent": self.agent, "writes": []})
        parts: list[list[dict[str, Any]]] = [[]]
        size, too_large = empty, None
        for n, w in enumerate(writes):
            w_size = _size(w) + 1
            if empty + w_size > limit:
                too_large = (n, empty + w_size)
                break
            if parts[-1] and size + w_size > limit:
                parts.append([])
                size = empty
            parts[-1].append(w)
            size += w_size
        rest = writes[too_large[0]:] if too_large is not None else []
        parts = [p for p in parts if p]
        for k, part in enumerate(parts):
            try:
                await self._activity("fsm_agent.apply_writes", {"agent": self.agent, "writes": part}, part,
                                     retry=True, timeout=60.0)
            except BaseException:
                later = [w for p in parts[k + 1:] for w in p] + rest
                at = len(part) if self.store.pending[:1] == part[:1] else 0  # after the part, when it was kept
                self.store.pending[at:at] = later
                raise
        if too_large is not None:
            self.store.pending[:0] = rest
            raise PayloadTooLargeError("fsm_agent.apply_writes", too_large[1], limit)

    async def _activity(self, name: str, data: dict[str, Any], writes: list[dict[str, Any]], *, retry: bool,
                        timeout: float, cancel_wait: bool = False) -> Any:
        """Run activity ``name`` with ``data`` (carrying ``writes``). On a failure before the activity
        applied them (a lost worker), the writes go with the next activity (applying is idempotent)."""
        size = _size(data)
        if size > self.timeouts.max_payload and writes and name != "fsm_agent.apply_writes":
            # The carried writes make it too large: apply them on their own first, then send the rest.
            await self._apply_in_parts(writes)
            data, writes = {**data, "writes": []}, []
            size = _size(data)
        if size > self.timeouts.max_payload:
            self.store.pending[:0] = writes
            raise PayloadTooLargeError(name, size, self.timeouts.max_payload)
        try:
            out = await workflow.execute_activity(
                name, data, start_to_close_timeout=timedelta(seconds=timeout),
                heartbeat_timeout=timedelta(seconds=self.timeouts.heartbeat),
                retry_policy=RetryPolicy(maximum_attempts=self.timeouts.attempts if retry else 1,
                                         non_retryable_error_types=["PayloadTooLargeError"]),
                cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED if cancel_wait
                else workflow.ActivityCancellationType.TRY_CANCEL)
        except ActivityError as exc:
            if not isinstance(exc.cause, ApplicationError):
                self.store.pending[:0] = writes
            task = asyncio.current_task()
            if isinstance(exc.cause, TemporalCancelled) and task is not None and task.cancelling():
                raise asyncio.CancelledError() from None  # the run cut it: the engine's own cancel goes on
            raise
        except BaseException:
            self.store.pending[:0] = writes
            raise
        self._check_history()
        return out

    def _check_history(self) -> None:
        """Past the history limit: queue an Interrupt (it cuts nothing in flight; the run stops at its
        next PreTurn), once."""
        if self.history_limit and not self.continue_asked and self.store.record is not None \
                and workflow.info().get_current_history_length() > self.history_limit:
            self.continue_asked = True
            self.store.controls.append(ControlRecord(self.store.record.session_id, ControlKind.INTERRUPT,
                                                     self.continue_text, self.new_id(), self.now()))

    # -- the model -----------------------------------------------------------------------------
    async def call_model(self, provider: Provider, request: MessageRequest, *, stream: bool,
                         on_event: Callable[[StreamEvent], Awaitable[None]] | None, on_retry: OnRetry | None,
                         trace: ModelTrace, deadline_s: float | None) -> MessageResponse:
        skeleton = unstructure(request)
        refs = []
        new: list[str] = []
        for m in skeleton.pop("messages"):
            digest = message_digest(m)
            if digest in self.stored:
                refs.append({"ref": digest})
            else:
                refs.append({"message": m, "digest": digest})
                new.append(digest)
        writes = self._take_writes()
        info = workflow.info()
        data = {"agent": self.agent, "session_id": self.store.record.session_id if self.store.record else "",
                "writes": writes, "provider": provider_key(provider), "request": skeleton, "messages": refs,
                "stream": stream, "deadline_s": deadline_s, "turn": 0, "phase": "Model", "workflow": info.workflow_id,
                "events": on_event is not None}  # a side call's deltas are no answer: not shown live
        try:
            out = await self._activity("fsm_agent.model_call", data, writes, retry=True,
                                       timeout=deadline_s or self.timeouts.model_call, cancel_wait=True)
        except ActivityError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError):
                details = cause.details[0] if cause.details else {}
                if "trace" in details:
                    trace.text[:] = details["trace"]
                for r in details.get("retries") or ():
                    if on_retry is not None:
                        await on_retry(exception_of(r["exception"]), r["attempt"], r["delay_s"])
                if cause.type in _ACTIVITY_ERRORS:
                    raise asyncio.CancelledError() from None
                if "exception" in details:
                    raise exception_of(details["exception"]) from None
            raise
        self.stored.update(new)
        for r in out.get("retries") or ():
            if on_retry is not None:
                await on_retry(exception_of(r["exception"]), r["attempt"], r["delay_s"])
        trace.text[:] = out.get("trace") or []
        return structure(out["response"], MessageResponse)

    # -- tools ---------------------------------------------------------------------------------
    async def run_tool(self, call: ToolUseBlock, tools: ToolRegistry, *, session_id: str, turn: int,
                       timeout: float | None, decision: Decision | None, report: ToolReport,
                       budget_left: Callable[[], dict[str, float]]) -> ToolResultMessage:
        tool = tools.get(call.name)
        effect = tool.effect if tool is not None else ToolEffect.PURE
        limit = timeout if timeout is not None else (tool.timeout if tool is not None and tool.timeout else None)
        writes = self._take_writes()
        data = {"agent": self.agent, "session_id": session_id, "writes": writes, "call": unstructure(call),
                "turn": turn, "timeout": timeout, "decision": unstructure(decision) if decision else None,
                "budget_left": budget_left()}
        try:
            # a resumable tool (a sub-agent's call) is cut with its activity waited for: the child
            # workflow it drives stops (INTERRUPTED) before this run records its own stop
            out = await self._activity("fsm_agent.run_tool", data, writes,
                                       retry=effect is not ToolEffect.SIDE_EFFECT,
                                       timeout=(limit or self.timeouts.tool) + 30.0,
                                       cancel_wait=tool is not None and tool.resumable)
        except ActivityError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.details:
                details = cause.details[0]
                for r in details.get("reports") or ():
                    report(value_of(r))
                if "exception" in details:
                    raise exception_of(details["exception"]) from None
            if isinstance(cause, TemporalTimeout) and effect is ToolEffect.SIDE_EFFECT:
                raise OutcomeUnknown(f"the worker running {call.name}({call.id}) was lost while it ran "
                                     f"({cause.type.name.lower()} timeout); it may or may not have taken "
                                     "effect") from None
            raise
        for r in out.get("reports") or ():
            report(value_of(r))
        return structure(out["result"], ToolResultMessage)

    async def tool_hook(self, tool: Tool, hook: str, args: Sequence[Any], ctx: ToolContext) -> Any:
        writes = self._take_writes()
        data = {"agent": self.agent, "session_id": ctx.session_id, "writes": writes, "tool": tool.name, "hook": hook,
                "args": form(list(args)), "ctx": form(ctx)}
        try:
            out = await self._activity("fsm_agent.tool_hook", data, writes, retry=False, timeout=self.timeouts.tool)
        except ActivityError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.details and "exception" in cause.details[0]:
                raise exception_of(cause.details[0]["exception"]) from None
            raise
        return value_of(out)

    async def plugin_effect(self, plugin: Any, method: str, args: Sequence[Any]) -> Any:
        """A plugin's own I/O (``ctx.plugin_effect``) as an activity: the worker that runs it finds the
        plugin by its name among its agent's middleware."""
        writes = self._take_writes()
        name = getattr(plugin, "middleware_name", None) or type(plugin).__name__
        data = {"agent": self.agent, "writes": writes, "plugin": name, "method": method, "args": form(list(args))}
        try:
            out = await self._activity("fsm_agent.plugin_effect", data, writes, retry=True, timeout=self.timeouts.tool)
        except ActivityError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.details and "exception" in cause.details[0]:
                raise exception_of(cause.details[0]["exception"]) from None
            raise
        return value_of(out)

    # -- controls --------------------------------------------------------------------------------
    def watch(self, session_id: str, owner: str | None, lease_ttl: float, on_control: Callable[[], None],
              on_lost: Callable[[str], None]) -> Cancellable:
        handle = _Handle()
        self.watchers.append((handle, on_control))
        return handle

    def control_arrived(self, record: ControlRecord) -> None:
        """A control signal: queued in the mirror; an Interrupt or a Cancel cuts the phase in flight."""
        self.store.controls.append(record)
        if record.kind in (ControlKind.INTERRUPT, ControlKind.CANCEL):
            for handle, on_control in list(self.watchers):
                if not handle.cancelled:
                    on_control()

    async def wait_controls(self, session_id: str, kinds: Sequence[ControlKind], timeout: float
                            ) -> list[ControlRecord]:
        try:
            await workflow.wait_condition(
                lambda: any(c.kind in kinds for c in self.store.controls), timeout=timedelta(seconds=max(timeout, 0)))
        except asyncio.TimeoutError:
            pass
        return await self.store.take_controls(session_id, kinds)

    # -- the agent's system prompt ---------------------------------------------------------------
    async def system_prompt(self, source: PromptSource) -> PromptSnapshot | None:
        """The prompt of the agent this worker serves, read by a local activity (its result is in the
        history, so a replay sees the prompt the run saw). ``None`` for a history made before prompts
        were read (the session keeps the prompt it has)."""
        if not workflow.patched(PROMPT_PATCH):
            return None
        out = await workflow.execute_local_activity("fsm_agent.system_prompt", {"agent": self.agent},
                                                    start_to_close_timeout=timedelta(seconds=30))
        return structure(out, PromptSnapshot)
