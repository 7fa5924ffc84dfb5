"""The Agent: a provider, tools, middleware, observers and budgets, run as the state machine.

    >>> import asyncio
    >>> from fsm_agent import Agent, ScriptedProvider, tool
    >>> @tool
    ... def add(a: int, b: int) -> int:
    ...     "Add two integers."
    ...     return a + b
    >>> from fsm_agent.providers import tool_call_response
    >>> agent = Agent(ScriptedProvider([tool_call_response(("add", {"a": 2, "b": 3})), "5"]), tools=[add])
    >>> result = asyncio.run(agent.run("What is 2 + 3?"))
    >>> result.stop.reason.value, result.output
    ('COMPLETED', '5')

Everything given to an Agent is fixed when its first run starts: the
middleware chain is frozen then, and adding middleware afterwards raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

from attrs import evolve

from .chain import MiddlewareChain
from .control import Cancel, Decision, Followup, Interrupt, LoopControl, RequestPermissions, Restrict, Steer
from .errors import (ChainError, ConfigurationError, ReplayDivergence, ResumeError, SessionBusyError, SessionEndedError,
                     SessionExistsError)
from .hooks import HookBus
from .config import RunConfig
from .machine.definition import MachineState
from .machine.driver import Driver
from .machine.journal import Journal
from .machine.live import LivePort
from .machine.phases import Phase, Trigger
from .machine.port import EffectPort
from .machine.state import RunState
from .machine.view import RunView
from .middleware import Middleware
from .otel import OtelSettings
from .otel import active as _otel_active
from .otel import build as _otel_build
from .otel import tracing_muted as _otel_muted
from .permissions import PERMISSIONS_METADATA_KEY, Permissions, control_text
from .plugins import load_plugin
from .prompt import PROMPT_KEY, PromptFile, PromptSnapshot, PromptSource, prompt_digest
from .pricing import cost_usd
from .providers.base import Provider
from .store.base import QUEUED, ControlKind, LedgerEntry, LedgerStatus, SessionRecord, Store
from .store.decisions import DecisionOutcome, merge_decisions, read_decisions, write_decision
from .store.memory import MemoryStore
from .store.sessions import LoadedSession, load_session, send_control
from .structured import OutputStream
from .tools.registry import Tool, ToolRegistry
from .types.codec import structure, unstructure
from .types.messages import AssistantMessage, Message, SystemMessage, UserMessage
from .task import TASK_DEFINITION_KEY, Task, TaskResult, stored_task
from .types.run import RunResult, RunStop, StopReason
from .types.structured import OutputSchema

__all__ = ["Agent", "PortFactory", "drain_on_signals"]

PortFactory = Callable[[EffectPort], EffectPort]
"""``port=`` of :meth:`Agent.run` / :meth:`Agent.resume`: given the agent's live port (its store, its
control poll), the port this run segment uses. A recording or a replaying port
(:class:`fsm_agent.testing.effects.EffectRecording`) wraps or replaces it."""


class Agent:
    """A governed agent.

    Args:
        provider: the model (any :class:`~fsm_agent.providers.Provider`).
        tools: tools (``@tool`` functions, or plain typed functions, wrapped on the fly).
        system_prompt: the system message put first in every new session: a text, a
            :class:`~fsm_agent.PromptFile` followed while the agent runs, or ``None``. It may change
            while runs go on (:meth:`set_system_prompt`); each run takes the current one at its next
            PreTurn unless its session pinned its own (``RunConfig.pin_system_prompt``); see
            docs/system-prompt.md.
        middleware: policy plugins; list order is wrapping order (first = outermost).
        observers: watchers (see :mod:`fsm_agent.hooks`).
        config: budgets and limits (:class:`RunConfig`; defaults from seed 000).
        store: where sessions live (default: :class:`~fsm_agent.store.MemoryStore`, in process; use
            :class:`~fsm_agent.store.SQLiteStore` or :class:`~fsm_agent.store.PostgresStore` to resume
            in another process or host).
        worker_id: this worker's lease owner name (default: host:pid:random).
        lease_ttl: seconds a session lease lasts without renewal.
        control_poll: seconds between checks for control events while a model call or tools run.
        permissions: what every session of this agent may do at most (:class:`~fsm_agent.Permissions`:
            tools and argument scopes), checked by the engine; a session's own permissions
            (``run(permissions=...)``, a server's request or tenant, a task) narrow them. ``None``
            (default): every tool, unless the session's own say otherwise.
        host: a durable host (``fsm_agent.temporal.TemporalHost``: the sessions run as Temporal
            workflows on workers serving this agent); ``None``: runs happen in this process.
        instrument: OpenTelemetry GenAI traces and metrics of this agent's runs (extra
            ``fsm-agent[otel]``; :mod:`fsm_agent.otel`): ``True`` (the defaults) or an
            :class:`~fsm_agent.otel.OtelSettings`; ``False``: never, even when
            :func:`fsm_agent.instrument` turned it on for the process; ``None`` (default): as the
            process says (off unless :func:`fsm_agent.instrument` was called).

    Raises:
        ChainError: the middleware cannot form a chain (cycle, missing requirement, bad hook).
        ConfigurationError: duplicate tool names, an observer that is neither callable nor has ``on_*``;
            ``instrument`` given without OpenTelemetry installed, or of another type; a prompt file
            that cannot be read.
    """

    def __init__(
        self,
        provider: Provider,
        *,
        tools: Iterable[Tool | Any] = (),
        system_prompt: str | PromptFile | None = None,
        middleware: Iterable[Middleware] = (),
        observers: Iterable[Any] = (),
        config: RunConfig | None = None,
        store: Store | None = None,
        worker_id: str | None = None,
        lease_ttl: float = 30.0,
        control_poll: float = 0.5,
        permissions: Permissions | None = None,
        host: Any = None,
        instrument: bool | OtelSettings | None = None,
    ) -> None:
        self.provider = provider
        self.host = host
        """A durable host that drives this agent's sessions (:class:`fsm_agent.temporal.TemporalHost`):
        :meth:`run`, :meth:`resume`, :meth:`control` and :meth:`decide` go to it; ``None``: in process."""
        self.tools = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        self._prompt = PromptSource(system_prompt)
        """The agent's versioned system prompt (read by runs through their port at each PreTurn)."""
        self.chain = MiddlewareChain(middleware)
        self.hooks = HookBus(observers)
        self.config = config or RunConfig()
        self.store: Store = store if store is not None else MemoryStore()
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease_ttl = lease_ttl
        self.control_poll = control_poll
        self._active: set[Driver] = set()
        """Drivers of this agent's runs in flight in this process (for :meth:`drain_on_signals`)."""
        self.permissions = permissions
        """What every session of this agent may do at most (``None``: no limit of the agent's own)."""
        self._task: Task | None = None
        """The task this agent runs (an agent :meth:`run_task` derived), or ``None``."""
        self.instrument = instrument
        self._otel: Any = _otel_build(instrument) if instrument is not None and instrument is not False else None
        """This agent's own instrumentation (``instrument=True`` or settings), built once."""

    @property
    def middleware(self) -> tuple[Middleware, ...]:
        """The chain in its resolved order."""
        return self.chain.middleware

    # -- the system prompt -------------------------------------------------------------------------
    @property
    def system_prompt(self) -> str | None:
        """The system prompt now (a followed file is read again); setting it is :meth:`set_system_prompt`."""
        return self._prompt.current().text

    @system_prompt.setter
    def system_prompt(self, value: str | PromptFile | None) -> None:
        self.set_system_prompt(value)

    def set_system_prompt(self, prompt: str | PromptFile | None) -> int:
        """Change the system prompt of this agent (and of the agents derived from it without a prompt of
        their own) while it runs, without a restart: a text, a :class:`~fsm_agent.PromptFile` to follow
        from now on, or ``None`` (no system prompt). Safe from any thread or task.

        Every session of the agent that has not pinned its prompt (``RunConfig.pin_system_prompt``) and
        did not bring its own system message uses it from its next PreTurn on: its next model call sees
        it, and the session log gets a ``system_prompt_changed`` event (version, digest, text, source).

        Returns:
            the prompt's version now in force (each change adds one; the same text again changes nothing).

        Raises:
            ConfigurationError: a file that cannot be read, or a value of another type (nothing changes).
        """
        return self._prompt.set(prompt)

    def current_system_prompt(self) -> PromptSnapshot:
        """The system prompt now, with its version, digest and source (a followed file is read again)."""
        return self._prompt.current()

    def derive(self, *, tools: Iterable[Tool | Any] = (), middleware: Iterable[Middleware] = (),
               system_prompt: str | None = None) -> Agent:
        """A new agent like this one (provider, config, store, observers, worker id, lease, control
        poll) with ``tools`` and ``middleware`` added after its own, and ``system_prompt`` instead of
        its own when given. This agent is not changed. Without a ``system_prompt``, the new agent shares
        this one's prompt: :meth:`set_system_prompt` on this agent (or its prompt file changing) reaches
        the new agent's runs too (docs/system-prompt.md).

        The new agent's runs count as this agent's runs in this process: :meth:`interrupt_all` and
        :meth:`drain_on_signals` of either reach the runs of both (the orchestration patterns build
        their agents this way, so that draining the agent you gave them drains their runs too).

        Raises:
            ChainError: the middleware cannot form a chain.
            ConfigurationError: a tool name used twice.
        """
        agent = Agent(self.provider, tools=[*self.tools, *tools], system_prompt=system_prompt,
                      middleware=[*self.middleware, *middleware], observers=self.hooks.observers, config=self.config,
                      store=self.store, worker_id=self.worker_id, lease_ttl=self.lease_ttl,
                      control_poll=self.control_poll, permissions=self.permissions)
        if system_prompt is None:  # the same prompt: a change to this agent's reaches the new one's runs
            agent._prompt = self._prompt
        agent.instrument, agent._otel = self.instrument, self._otel
        agent._active = self._active
        return agent

    def add_middleware(self, *middleware: Middleware) -> None:
        """Append middleware before the first run.

        Raises:
            ChainError: the chain is frozen (a run already started), or the new chain is invalid.
        """
        if self.chain.frozen:
            raise ChainError("the middleware chain is frozen: it cannot change after the first run started")
        self.chain = self.chain.with_middleware(middleware)

    @staticmethod
    def _task_messages(task: str | Message | Sequence[Message]) -> list[Message]:
        if isinstance(task, str):
            return [UserMessage(task)]
        if isinstance(task, Sequence):
            return [m for m in task if not isinstance(m, str)]
        return [task]

    async def _initial_messages(self, task: str | Message | Sequence[Message], effects: EffectPort
                                ) -> tuple[list[Message], dict[str, Any]]:
        """A new session's first messages (the agent's system prompt, read through ``effects``, first,
        unless the task brings its own system message) and its prompt record (:data:`PROMPT_KEY`)."""
        msgs = self._task_messages(task)
        own = next((m for m in msgs if isinstance(m, SystemMessage)), None)
        if own is not None:
            return msgs, {"version": 0, "digest": prompt_digest(own.text), "source": "session", "text": own.text,
                          "leading": False, "own": True}
        snap = await effects.system_prompt(self._prompt)
        if snap is None:  # the port cannot tell (history made before prompts were read): as configured then
            snap = self._prompt.cached()
        if snap.text:
            msgs.insert(0, SystemMessage(snap.text))
        return msgs, {"version": snap.version, "digest": snap.digest, "source": snap.source, "text": snap.text,
                      "leading": bool(snap.text), "own": False, "fresh": True}

    def new_context(self, messages: list[Message], *, session_id: str | None = None,
                    config: RunConfig | None = None, state: RunState | None = None) -> RunView:
        """A run context (the plugins' view) over ``state`` (default: a fresh :class:`RunState`)."""
        run = state if state is not None else RunState(config=config or self.config)
        if config is not None:
            run.config = config
        return RunView(session_id or uuid.uuid4().hex, self.provider, self.tools, messages, run)

    def live_port(self) -> LivePort:
        """Today's effects for a run of this agent: its store, its control poll."""
        return LivePort(self.store, control_poll=self.control_poll)

    def _port(self, factory: PortFactory | None) -> EffectPort:
        live = self.live_port()
        return live if factory is None else factory(live)

    def driver(self, ctx: RunView, journal: Journal | None = None,
               ledger: Mapping[str, LedgerEntry] | None = None, *, port: EffectPort | None = None,
               hooks: HookBus | None = None) -> Driver:
        """A driver for ``ctx`` (freezes the middleware chain); ``ledger``: the session's tool-call
        ledger; ``port``: its effects (default: the journal's port, else :meth:`live_port`);
        ``hooks``: its observers (default: the agent's)."""
        self.chain.freeze()
        if port is None:
            port = journal.port if journal is not None else self.live_port()
        return Driver(ctx, self.chain, self.hooks if hooks is None else hooks, port=port, cost_of=cost_usd,
                      journal=journal, lease_ttl=self.lease_ttl, ledger=ledger, prompt=self._prompt)

    def _instrumentation(self) -> Any:
        """The instrumentation this agent's runs use now (:mod:`fsm_agent.otel`), or ``None``."""
        if _otel_muted.get():
            return None
        if self.instrument is None:
            return _otel_active()
        return self._otel

    async def _drive(self, ctx: RunView, journal: Journal, first: Trigger | None, reason: str,
                     ledger: Mapping[str, LedgerEntry] | None = None) -> RunResult:
        otel = self._instrumentation()
        segment = None
        if otel is not None:
            try:  # the segment's span, its traced port and its observer (fsm_agent.otel)
                segment = otel.segment(ctx, self.chain, reason)
                driver = self.driver(ctx, journal, ledger, port=segment.port(journal.port),
                                     hooks=segment.bus(self.hooks))
            except Exception:  # noqa: BLE001 - tracing never stops a run
                logging.getLogger("fsm_agent.otel").exception("could not trace session %s", ctx.session_id)
                segment, driver = None, self.driver(ctx, journal, ledger)
        else:
            driver = self.driver(ctx, journal, ledger)
        self._active.add(driver)
        try:
            if segment is not None:
                return await segment.run(driver.run(first, reason), self.store)  # type: ignore[no-any-return]
            return await driver.run(first, reason)
        finally:
            self._active.discard(driver)
            await self._release(journal.port, ctx.session_id)

    async def _release(self, port: EffectPort, session_id: str) -> None:
        try:
            await port.store.release_lease(session_id, self.worker_id)
        except ReplayDivergence:
            raise
        except Exception:  # noqa: BLE001 - the lease expires on its own
            pass

    @contextlib.asynccontextmanager
    async def drain_on_signals(self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
                               ) -> AsyncIterator[None]:
        """Opt in to graceful shutdown: while the block runs, each of ``signals`` interrupts every run
        this agent drives in this process. The model stream is cut (the streamed text is kept), each
        tool call in flight gets its result or "outcome unknown", and the run ends INTERRUPTED with a
        checkpoint and a released lease, so it can be resumed at once; ``run`` returns that result.
        A second signal gets the default behaviour (for SIGINT, ``KeyboardInterrupt``).

        Unix only (``loop.add_signal_handler``); the previous handlers are restored on exit.

            async with agent.drain_on_signals():
                result = await agent.run("...")
        """
        async with drain_on_signals(self.interrupt_all, signals):
            yield

    def interrupt_all(self, reason: str) -> int:
        """Interrupt every run this agent drives in this process (as :meth:`drain_on_signals` does
        on a signal), the runs of the agents derived from it (:meth:`derive`) among them: each ends
        INTERRUPTED, resumable, with ``reason`` in its detail. Returns how many runs were interrupted."""
        drivers = list(self._active)
        for driver in drivers:
            driver.interrupt(reason)
        return len(drivers)

    async def run(
        self,
        task: str | Message | Sequence[Message],
        *,
        session_id: str | None = None,
        config: RunConfig | None = None,
        metadata: Mapping[str, Any] | None = None,
        port: PortFactory | None = None,
        permissions: Permissions | None = None,
        **limits: Any,
    ) -> RunResult:
        """Run ``task`` (a user message, a message, or a whole history) to a StopReason.

        ``limits`` override :class:`RunConfig` fields for this run only
        (``max_iterations=5``, ``max_wall_clock=30.0`` ...). ``port``: the effects of this run (see
        :data:`PortFactory`; default: :meth:`live_port`). ``permissions``: what the new session may do
        (:class:`~fsm_agent.Permissions`; within the agent's own), stored with it (its metadata and
        checkpoint) and checked by the engine at PreTurn and for every tool call.

        Never raises for what happens during the run: failures end in
        FAILED_RETRYABLE / FAILED_TERMINAL with the error in ``stop.error``.
        Cancelling the task records INTERRUPTED and re-raises ``CancelledError``.

        Raises:
            SessionExistsError: ``session_id`` names a session that exists (resume it instead), unless
                it is a session a server created ``QUEUED`` that never ran: that one is adopted.
            ConfigurationError: a bad limit.
            PermissionsError: the session's stored permissions (a server's) are invalid.
            StoreError: the store could not create the session.
        """
        cfg = config or self.config
        if limits:
            cfg = evolve(cfg, **limits)
        meta = dict(metadata or {})
        if permissions is not None:
            meta[PERMISSIONS_METADATA_KEY] = permissions.to_dict()
        if self.host is not None and port is None:
            # the system prompt is the one of the agent the workers serve, read there as the session starts
            messages = self._task_messages(task)
            return await self.host.run(self, messages, session_id=session_id or uuid.uuid4().hex, config=cfg,  # type: ignore[no-any-return]
                                       metadata=meta, limits={})
        return await self._run_here(task, session_id, cfg, meta, self._port(port))

    async def _run_here(self, task: str | Message | Sequence[Message], session_id: str | None, cfg: RunConfig,
                        meta: dict[str, Any], effects: EffectPort) -> RunResult:
        """:meth:`run` in this process, on ``effects``. A session whose metadata holds a task definition
        (given, or stored by a server for a QUEUED session) runs as that task (:meth:`run_task`)."""
        if self._task is None and meta.get(TASK_DEFINITION_KEY) is not None:
            t = stored_task(meta)
            assert t is not None
            return await self._as_task(t)._run_here(t.messages(), session_id, t.config(cfg), meta, effects)
        store = effects.store
        messages, prompt = await self._initial_messages(task, effects)
        ctx = self.new_context(list(messages), session_id=session_id or effects.new_id(), config=cfg)
        ctx._run.metadata[PROMPT_KEY] = prompt
        goal = (self._task.goal if self._task is not None else
                next((m.text for m in messages if isinstance(m, UserMessage)), ""))
        now = effects.now()
        ctx._set_metadata(dict(meta))
        try:
            await store.create_session(SessionRecord(ctx.session_id, Phase.IDLE.value, goal=goal[:2000],
                                                     metadata=dict(meta), created_at=now, updated_at=now))
        except SessionExistsError:
            queued = await store.get_session(ctx.session_id)
            if queued is None or queued.state != QUEUED or queued.last_seq:
                raise
            # created QUEUED by a server (fsm_agent.server): this run is its first
            full = {**queued.metadata, **meta}
            if self._task is None and full.get(TASK_DEFINITION_KEY) is not None:
                t = stored_task(full)
                assert t is not None
                return await self._as_task(t)._run_here(t.messages(), ctx.session_id, t.config(cfg), full, effects)
            if meta:
                await store.update_metadata(ctx.session_id, dict(meta))
            ctx._set_metadata(full)
        perms = ctx._run.permissions = self._session_permissions(ctx.metadata)
        if not await store.acquire_lease(ctx.session_id, self.worker_id, self.lease_ttl):
            raise SessionBusyError(f"session {ctx.session_id} is leased by another worker")
        journal = Journal(effects, ctx.session_id, 1, self.worker_id)
        journal.record("session_started", {"goal": goal, "config": unstructure(cfg),
                                           "permissions": perms.to_dict() if perms is not None else None})
        for m in messages:
            journal.message(m, 0)
        return await self._drive(ctx, journal, Trigger.START, "start")

    async def check_resume(self, session_id: str, decisions: Mapping[str, Decision] | None = None) -> LoadedSession:
        """Check that ``session_id`` can be resumed with ``decisions``, without taking its lease or
        changing anything; returns the loaded session.

        Raises:
            SessionEndedError: it ended for good (COMPLETED, FAILED_TERMINAL or CANCELLED); the error's
                ``result`` is its stored :class:`RunResult` (a :class:`ResumeError`).
            ResumeError: unknown session; a decision for a call that is not pending, or of a kind that
                call does not allow.
            SessionBusyError: another worker holds its lease, or this agent is driving it already (a
                :class:`ResumeError`).
        """
        return await self._check_resume(self.store, session_id, decisions, time.time())

    async def _check_resume(self, store: Store, session_id: str, decisions: Mapping[str, Decision] | None,
                            now: float) -> LoadedSession:
        loaded = await load_session(store, session_id)
        if loaded is None:
            raise ResumeError(f"unknown session {session_id!r}")
        rec = loaded.record
        terminal = _terminal(rec.state)
        if terminal is not None and not terminal.resumable:
            result = _stored_result(loaded, terminal)
            detail = f" (stop detail: {result.stop.detail})" if result.stop.detail else ""
            raise SessionEndedError(
                f"session {session_id} ended {terminal.value}; only WAITING_HUMAN, PAUSED_BUDGET, INTERRUPTED and "
                f"FAILED_RETRYABLE sessions can be resumed. Nothing was run again; the stored result is this error's "
                f"result{detail}", session_id=session_id, reason=terminal, result=result)
        if decisions:
            _check_decisions(rec.stop, decisions)
        if any(d.ctx.session_id == session_id for d in self._active):
            raise SessionBusyError(f"session {session_id} is being driven by this agent in this process "
                              "(its run has not stopped yet); interrupt it or wait")
        if rec.lease_owner is not None and rec.lease_owner != self.worker_id and (rec.lease_until or 0) > now:
            raise SessionBusyError(f"session {session_id} is being driven by worker {rec.lease_owner} "
                              f"(lease until {time.ctime(rec.lease_until or 0)}); interrupt it or wait")
        return loaded

    async def resume(
        self,
        session_id: str,
        *,
        decisions: Mapping[str, Decision] | None = None,
        confirm_cancel: bool = False,
        port: PortFactory | None = None,
        **limits: Any,
    ) -> RunResult:
        """Continue a stopped (or crashed) session from its last checkpoint.

        Args:
            decisions: for WAITING_HUMAN, a :class:`~fsm_agent.control.Decision` per pending tool-call id.
                Decisions taken before through :meth:`decide` (or the server's approval route) are
                applied too; calls without one stay pending (the run stops WAITING_HUMAN again).
            confirm_cancel: for a cancel waiting on uncompensated side effects: confirm it.
            port: the effects of this run segment (see :data:`PortFactory`; default: :meth:`live_port`).
            limits: raised budgets (``max_iterations=80``, ``max_wall_clock=1200`` ...) for a PAUSED_BUDGET run.

        Completed tool calls never run again (the ledger has their results); a side-effect call
        found started but unfinished after a crash is reconciled by its tool or put to a person.
        Everything is checked before the lease is taken, and the lease is released on every way out.

        **A session that already ended** (after a crash a caller cannot know whether the run
        finished): a COMPLETED, FAILED_TERMINAL or CANCELLED session is never run again; ``resume``
        raises :class:`~fsm_agent.errors.SessionEndedError`, whose ``result`` is the stored
        :class:`RunResult` (its stop, last answer, transcript, usage, cost)::

            try:
                result = await agent.resume(session_id)
            except SessionEndedError as ended:
                result = ended.result          # the run had finished; nothing ran now

        Raises:
            SessionEndedError: the session ended for good; carries its stored result.
            DecisionRefused: a decision in ``decisions`` differs from the one taken before for that
                call (through :meth:`decide` or the server); a :class:`ResumeError`.
            ResumeError: see :meth:`check_resume`; also when another worker takes the lease first.
        """
        if self.host is not None and port is None:
            return await self.host.resume(self, session_id, decisions=decisions,  # type: ignore[no-any-return]
                                          confirm_cancel=confirm_cancel, limits=limits)
        return await self._resume_here(self._port(port), session_id, decisions, confirm_cancel, limits)

    async def _resume_here(self, effects: EffectPort, session_id: str, decisions: Mapping[str, Decision] | None,
                           confirm_cancel: bool, limits: Mapping[str, Any]) -> RunResult:
        """:meth:`resume` in this process, on ``effects``; a task session resumes as its task."""
        store = effects.store
        loaded = await self._check_resume(store, session_id, decisions, effects.now())
        if self._task is None:
            t = stored_task(loaded.record.metadata if isinstance(loaded.record.metadata, dict) else {})
            if t is not None:
                return await self._as_task(t)._resume_here(effects, session_id, decisions, confirm_cancel, limits)
        if loaded.record.state == StopReason.WAITING_HUMAN.value:
            # the decisions written through the one writer (Agent.decide, the server) answer the calls they name
            decisions = merge_decisions(decisions, await read_decisions(store, loaded.record))
        if not await store.acquire_lease(session_id, self.worker_id, self.lease_ttl):
            fresh = await store.get_session(session_id)
            owner = fresh.lease_owner if fresh is not None else None
            raise SessionBusyError(f"session {session_id} was just taken by worker {owner or 'another worker'}; "
                              "interrupt it or wait")
        try:
            ctx, journal, first, reason = await self._resume_context(effects, loaded, decisions, confirm_cancel,
                                                                     limits)
        except BaseException:
            await self._release(effects, session_id)
            raise
        return await self._drive(ctx, journal, first, reason, loaded.ledger)

    async def _resume_context(self, effects: EffectPort, loaded: LoadedSession,
                              decisions: Mapping[str, Decision] | None, confirm_cancel: bool,
                              limits: Mapping[str, Any]) -> tuple[RunView, Journal, Trigger | None, str]:
        rec, ck = loaded.record, loaded.checkpoint
        session_id = rec.session_id
        if loaded.state_data is not None:
            state: RunState = structure(loaded.state_data, RunState)
        else:  # no checkpoint yet (a crash before the first): the permissions it was created with
            state = RunState(config=self.config)
            state.permissions = self._session_permissions(rec.metadata if isinstance(rec.metadata, dict) else {})
        if limits:
            state.config = evolve(state.config, **limits)
        # Earlier approvals of calls not yet run carry over; an approval replayed from the checkpoint for
        # a call the ledger says started (or closed) is stale: the call is settled by the ledger, not rerun.
        settled = {cid for cid, e in loaded.ledger.items() if e.status is LedgerStatus.STARTED or e.status.final}
        state.decisions = {k: v for k, v in state.decisions.items() if k not in settled}
        state.decisions.update(decisions or {})
        state.cancel_confirmed = confirm_cancel
        state.goal_version = max(state.goal_version, rec.goal_version)
        prompt = state.metadata.get(PROMPT_KEY)
        if isinstance(prompt, dict):
            prompt.pop("fresh", None)  # the first PreTurn of this segment reads the agent's prompt
        ctx = self.new_context(loaded.transcript, session_id=session_id, state=state)
        ctx._set_metadata(rec.metadata if isinstance(rec.metadata, dict) else {})
        journal = Journal(effects, session_id, rec.last_seq + 1, self.worker_id)
        # what this resume was given, so that a replay of the log (fsm_agent.testing.trajectory) resumes alike
        journal.record("resume", {"decisions": {k: unstructure(v) for k, v in (decisions or {}).items()},
                                  "limits": unstructure(dict(limits)), "confirm_cancel": confirm_cancel})
        for stale in await effects.store.take_controls(session_id, [ControlKind.INTERRUPT]):
            # an interrupt meant for an earlier run must not stop this one
            journal.record("control_dropped", {"kind": stale.kind.value, "text": stale.text,
                                               "reason": "queued before this resume"})
        terminal = _terminal(rec.state)
        if terminal is not None:
            ctx._set_machine(MachineState(terminal))
            to_tools = ck is not None and ck.safe_point == Phase.MID_TURN.value and bool(state.pending_calls)
            first = Trigger.RESUME_TOOLS if to_tools else Trigger.RESUME
            return ctx, journal, first, "resume" + (f" with {len(state.decisions)} decision(s)" if state.decisions else "")
        # Not terminal: the worker that drove it is gone (its lease expired). Continue at the last safe point.
        if ck is None:
            ctx._set_machine(MachineState(Phase.IDLE))
            return ctx, journal, Trigger.START, "start (recovered: no checkpoint yet)"
        ctx._set_machine(MachineState(Phase(ck.safe_point)))
        journal.record("recovered", {"state": rec.state, "checkpoint_id": ck.checkpoint_id,
                                     "reason": f"the worker that drove it ({rec.lease_owner or 'unknown'}) "
                                               f"stopped in {rec.state}"})
        return ctx, journal, None, "recovered"

    async def control(self, session_id: str, control: LoopControl) -> None:
        """Send a control event to a session, wherever it runs (through the store). A
        :class:`~fsm_agent.Restrict` narrows the session's permissions; a
        :class:`~fsm_agent.RequestPermissions` asks a person to widen them (the run stops
        WAITING_HUMAN with the request pending; approve it with :meth:`decide` or :meth:`resume`).

        Raises:
            ResumeError: unknown session, a session that ended for good, or an interrupt for a
                session that is not running.
        """
        if isinstance(control, Restrict):
            kind, text = ControlKind.RESTRICT, control_text("restriction", control.restriction, control.reason)
        elif isinstance(control, RequestPermissions):
            kind, text = ControlKind.REQUEST_PERMISSIONS, control_text("permissions", control.permissions, control.reason)
        else:
            kind = {Steer: ControlKind.STEER, Followup: ControlKind.FOLLOWUP, Interrupt: ControlKind.INTERRUPT,
                    Cancel: ControlKind.CANCEL}[type(control)]
            text = str(getattr(control, "text", None) or getattr(control, "reason", ""))
        if self.host is not None:
            await self.host.control(session_id, control)
            return
        await send_control(self.store, session_id, kind, text)

    async def decide(self, session_id: str, call_id: str, decision: Decision) -> DecisionOutcome:
        """Take a person's decision on a pending tool call, through the one writer of decisions
        (:func:`fsm_agent.store.decisions.write_decision`; the server's approval route and A2A use it
        too). A run waiting in process (Hang-Wait, ``RunConfig.approval_timeout``) takes it at once,
        on any worker; a session stopped WAITING_HUMAN takes it at its next :meth:`resume`.

        The same decision again returns the first one's outcome (``replayed``); nothing is taken twice.

        Raises:
            DecisionRefused: the session waits for no decision on ``call_id`` now (``not_waiting``,
                ``not_pending``), the call does not allow this kind (``not_allowed``), an edit's
                arguments break the tool's schema (``bad_arguments``), a different decision was taken
                first (``conflict``); a :class:`ResumeError`.
            ConfigurationError: the agent's store keeps no idempotency keys.
        """
        if self.host is not None:
            return await self.host.decide(session_id, call_id, decision)  # type: ignore[no-any-return]
        return await write_decision(self.store, session_id, call_id, decision, tools=self.tools)

    # -- task mode --------------------------------------------------------------------------------
    def _session_permissions(self, metadata: Mapping[str, Any]) -> Permissions | None:
        """The session's permissions: the agent's, narrowed by those its metadata holds (given to
        :meth:`run`, stored by a server) and by its task's.

        Raises:
            PermissionsError: the stored permissions are invalid.
        """
        perms = self.permissions
        data = metadata.get(PERMISSIONS_METADATA_KEY)
        if data is not None:
            own = Permissions.from_dict(data, source="the session's permissions")
            perms = own if perms is None else perms.narrow(own, "the session's permissions")
        return self._task.session_permissions(perms) if self._task is not None else perms

    def _as_task(self, task: Task) -> Agent:
        """This agent, deriving one that runs ``task``: its acceptance checks by the ``verifier``
        plugin (:meth:`Verifier.for_task <fsm_agent_middleware.verifier.Verifier.for_task>`).

        Raises:
            ConfigurationError: the task has checks and no ``verifier`` plugin with ``for_task`` is
                installed; ChainError: its checks cannot share the chain (PlanAct).
        """
        extra: list[Middleware] = []
        if task.checks:
            verifier = load_plugin("verifier")
            for_task = getattr(verifier, "for_task", None)
            if for_task is None:
                raise ConfigurationError("a task's acceptance checks need the built-in verifier plugin (entry point "
                                         f"'verifier' with Verifier.for_task); the installed one is {verifier!r}")
            extra.append(for_task(task))
        agent = self.derive(middleware=extra)
        agent._task = task
        return agent

    async def run_task(self, task: Task, *, session_id: str | None = None, permissions: Permissions | None = None,
                       metadata: Mapping[str, Any] | None = None, port: PortFactory | None = None) -> TaskResult:
        """Run ``task`` (task mode, seed 000's ``run_task``): one session whose first message states the
        goal, inputs, constraints, expected output and acceptance criteria; its permissions narrowed
        to the task's (``allowed_tools``, ``permissions``); its budget and output schema the task's;
        its acceptance checks run by the ``verifier`` plugin at PostTurn (a failed check goes back to
        the model, up to ``task.max_repairs`` times). The definition is stored with the session
        (``metadata["task_definition"]``): a resume, by any worker or a server, runs it as that task.

        Args:
            task: the task (:class:`~fsm_agent.Task`; ``Task.from_file`` reads a task file).
            session_id: the new session's id (default: a fresh one).
            permissions: the session's permissions (within the agent's), narrowed by the task's.
            metadata: more session metadata.
            port: the effects of the run (see :meth:`run`).

        Returns:
            the :class:`~fsm_agent.TaskResult`: outcome, validated output, checks, evidence, usage,
            cost and the stop. Like :meth:`run`, it never raises for what happens during the run.

        Raises:
            SessionExistsError: ``session_id`` names a session that exists.
            ConfigurationError: a budget RunConfig refuses; no verifier plugin for the checks; a task
                with callable checks on a durable host (give them as ``python = "module:function"``).
        """
        meta = {**dict(metadata or {}), TASK_DEFINITION_KEY: task.to_dict()}
        cfg = task.config(self.config)
        if self.host is not None and port is None:
            if not task.rebuildable:
                raise ConfigurationError("this task has acceptance checks given as Python callables, which a durable "
                                         "host cannot run elsewhere: give them as AcceptanceCheck.python_ref(name, "
                                         "\"module:function\")")
            result = await self.run(task.messages(), session_id=session_id, config=cfg, metadata=meta,
                                    permissions=permissions)
        else:
            result = await self._as_task(task).run(task.messages(), session_id=session_id, config=cfg, metadata=meta,
                                                   permissions=permissions, port=port)
        return TaskResult.from_run(result, task)

    async def resume_task(self, session_id: str, task: Task | None = None, *,
                          decisions: Mapping[str, Decision] | None = None, confirm_cancel: bool = False,
                          port: PortFactory | None = None, **limits: Any) -> TaskResult:
        """:meth:`resume` a task session; returns its :class:`~fsm_agent.TaskResult`. ``task``: the task
        it runs (needed when its checks are Python callables); ``None``: the definition stored with
        the session (a plain :meth:`resume` of a task session runs it as its task too).

        Raises:
            ResumeError: an unknown session, or one that is no task session (and no ``task`` given);
                see :meth:`resume` for the rest (a task session that ended raises
                :class:`SessionEndedError`; ``TaskResult.from_run(error.result, task)`` reads it).
        """
        if task is None:
            rec = await self.store.get_session(session_id)
            if rec is None:
                raise ResumeError(f"unknown session {session_id!r}")
            task = stored_task(rec.metadata if isinstance(rec.metadata, dict) else {})
            if task is None:
                raise ResumeError(f"session {session_id} is no task session (it holds no task definition); "
                                  "resume it with Agent.resume()")
        if self.host is not None and port is None:
            result = await self.resume(session_id, decisions=decisions, confirm_cancel=confirm_cancel, **limits)
        else:
            result = await self._as_task(task).resume(session_id, decisions=decisions, confirm_cancel=confirm_cancel,
                                                      port=port, **limits)
        return TaskResult.from_run(result, task)

    async def task_result(self, session_id: str, task: Task | None = None) -> TaskResult:
        """The :class:`~fsm_agent.TaskResult` of a stopped task session, read back from the store
        (nothing runs). ``task``: the task it ran (default: the definition stored with it).

        Raises:
            ResumeError: an unknown session, one that is no task session, or one still running.
        """
        loaded = await load_session(self.store, session_id)
        if loaded is None:
            raise ResumeError(f"unknown session {session_id!r}")
        rec = loaded.record
        task = task or stored_task(rec.metadata if isinstance(rec.metadata, dict) else {})
        if task is None:
            raise ResumeError(f"session {session_id} is no task session (it holds no task definition)")
        reason = _terminal(rec.state)
        if reason is None:
            raise ResumeError(f"session {session_id} has not stopped yet ({rec.state}): its task has no result")
        return TaskResult.from_run(_stored_result(loaded, reason), task)

    def stream_output(self, task: str | Message | Sequence[Message], *, output_schema: OutputSchema | None = None,
                      session_id: str | None = None, **kw: Any) -> OutputStream:
        """Run ``task`` as :meth:`run` does, and stream its structured answer as it comes.

            async with agent.stream_output("Largest city of France?", output_schema=city) as stream:
                async for part in stream:        # OutputPartial: the answer so far, checked as far as it goes
                    show(part.value, part.error)
            stream.result.output_data            # the answer the final check accepted (part.validated)

        The iterator yields :class:`~fsm_agent.types.OutputPartial` values: each answer's JSON value
        each time it grows (``error`` says what is already wrong, ``None``: valid as far as it goes),
        then the one the final check accepted (``validated=True``); see
        :class:`~fsm_agent.structured.OutputStream`. The run starts when the iteration does; partial
        values need ``RunConfig.stream`` (the default) and a provider that streams, else only the
        validated one comes. ``kw``: as :meth:`run` (``config``, ``metadata``, ``port``,
        ``permissions``, limits). Nothing of the partial values is written to the session.

        Raises:
            ConfigurationError: no output schema (give ``output_schema`` or ``RunConfig.output_schema``);
                the agent runs on a durable host (``host=``: the answer streams in a worker, not here).
        """
        cfg = kw.get("config") or self.config
        if output_schema is None and cfg.output_schema is None and kw.get("output_schema") is None:
            raise ConfigurationError("stream_output needs an output schema: pass output_schema=OutputSchema(...) "
                                     "or set RunConfig.output_schema")
        if self.host is not None and kw.get("port") is None:
            raise ConfigurationError("stream_output runs in this process: the agent has a durable host, whose "
                                     "workers stream the answer; use run() and the result's output_data")
        if output_schema is not None:
            kw["output_schema"] = output_schema
        sid = session_id or uuid.uuid4().hex
        return OutputStream(sid, lambda: self.run(task, session_id=sid, **kw))

    def run_sync(self, task: str | Message | Sequence[Message], **kw: Any) -> RunResult:
        """:meth:`run` from synchronous code (starts and closes an event loop)."""

        async def main() -> RunResult:
            try:
                return await self.run(task, **kw)
            finally:
                await self.provider.aclose()

        return asyncio.run(main())

    def __repr__(self) -> str:
        return (f"Agent(provider={self.provider!r}, tools={list(self.tools.names)}, "
                f"middleware={[m.middleware_name for m in self.chain.middleware]})")


@contextlib.asynccontextmanager
async def drain_on_signals(interrupt_all: Callable[[str], int],
                           signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> AsyncIterator[None]:
    """While the block runs, each of ``signals`` calls ``interrupt_all("received <SIGNAL>")`` once (a
    second one gets the default behaviour). The machinery of :meth:`Agent.drain_on_signals`, for
    anything that drives runs of several agents (a team, a handoff chain). Unix only."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        interrupt_all(f"received {sig.name}")
        loop.remove_signal_handler(sig)  # a second signal: the default behaviour

    try:
        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def _stored_result(loaded: LoadedSession, reason: StopReason) -> RunResult:
    """The :class:`RunResult` a session that stopped ``reason`` stored: its stop (with payload), last
    answer, transcript, usage, cost and structured output, read back without running anything."""
    rec = loaded.record
    state = structure(loaded.state_data, RunState) if loaded.state_data is not None else RunState()
    stop = structure(rec.stop, RunStop) if rec.stop else RunStop(reason, f"ended {reason.value}")
    output = next((m.text for m in reversed(loaded.transcript) if isinstance(m, AssistantMessage) and m.text.strip()),
                  "")
    last = state.last_response
    return RunResult(rec.session_id, stop, output, tuple(loaded.transcript), state.usage, state.turn,
                     state.tool_calls_made, last.stop_reason if last is not None else None, state.cost_usd, 0.0,
                     state.metadata.get("output_data"))


def _terminal(state: str) -> StopReason | None:
    try:
        return StopReason(state)
    except ValueError:
        return None


def _check_decisions(stop: Mapping[str, Any] | None, decisions: Mapping[str, Decision]) -> None:
    """Every decision must answer a pending call, with a kind that call allows.

    Raises:
        ResumeError: a decision for a call that is not pending, or of a kind it does not allow.
    """
    pending = {p["call"]["id"]: p for p in (stop or {}).get("pending_actions") or ()}
    for call_id, decision in decisions.items():
        p = pending.get(call_id)
        if p is None:
            known = ", ".join(pending) or "none"
            raise ResumeError(f"no pending tool call {call_id!r} (pending: {known})")
        allowed = tuple(p.get("allowed_decisions") or ())
        if allowed and decision.kind not in allowed:
            raise ResumeError(f"tool call {call_id!r} allows {', '.join(allowed)}, not {decision.kind!r}")
