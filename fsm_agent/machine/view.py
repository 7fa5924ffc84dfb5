"""The concrete plugin view of a run: :class:`RunView`, the :class:`~fsm_agent.RunContext` every
middleware hook is given (the contract is :mod:`fsm_agent.context`).

The view is closed: the run state behind it is the driver's. The transcript, the machine and the
tools are read-only wrappers over the driver's own objects (no copy is made), and an attempt to
write to them, or to any attribute but ``messages`` and ``settings``, raises
:class:`~fsm_agent.errors.ContextWriteError` naming the supported way.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn, overload

from ..context import RunConfig, TurnSettings
from ..errors import ConfigurationError, ContextWriteError, InvalidPlanError
from ..types.events import PlanUpdated
from ..types.messages import Message
from ..permissions import Permissions
from ..types.plan import Plan
from .definition import MachineState
from .phases import Phase, Trigger
from .state import RunState
from .timing import PortDeadline, sleep

if TYPE_CHECKING:
    from ..providers.base import Provider
    from ..tools.registry import Tool, ToolRegistry
    from ..types.content import ToolUseBlock
    from ..types.messages import Usage
    from ..types.requests import MessageRequest, MessageResponse, ToolDefinition
    from .port import EffectPort

__all__ = ["RunView", "state_named"]

_HOW = ("a plugin changes the run through its hooks' return values (ToolDecision, TurnDecision, StopRun) "
        "and the documented context writes: ctx.messages and ctx.settings in pre_turn, ctx.state(self), "
        "ctx.emit(event), ctx.update_plan(plan, reason)")


def _refuse(what: str) -> NoReturn:
    raise ContextWriteError(f"{what} is read-only for plugins; {_HOW}")


class TranscriptView(Sequence[Message]):
    """The conversation of record, read-only (the driver appends to the list behind it)."""

    __slots__ = ("_list",)

    def __init__(self, messages: list[Message]) -> None:
        self._list = messages

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...

    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        return self._list[index]

    def __len__(self) -> int:
        return len(self._list)

    def __iter__(self) -> Iterator[Message]:
        return iter(self._list)

    def __reversed__(self) -> Iterator[Message]:
        return reversed(self._list)

    def __contains__(self, value: object) -> bool:
        return value in self._list

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TranscriptView):
            return self._list == other._list
        return self._list == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TranscriptView({len(self._list)} messages)"

    def _write(self, *_: Any, **__: Any) -> NoReturn:
        _refuse("ctx.transcript (the conversation of record)")

    append = extend = insert = pop = remove = clear = sort = reverse = __setitem__ = __delitem__ = _write
    __iadd__ = _write


class _MachineView:
    """The machine, read-only: ``state``, ``is_terminal``, ``can_fire``."""

    __slots__ = ("_m",)

    def __init__(self, machine: MachineState) -> None:
        object.__setattr__(self, "_m", machine)

    @property
    def state(self) -> Phase | Any:
        return self._m.state

    @property
    def is_terminal(self) -> bool:
        return self._m.is_terminal

    def can_fire(self, trigger: Trigger) -> bool:
        return self._m.can_fire(trigger)

    def fire(self, trigger: Trigger) -> NoReturn:
        _refuse("ctx.machine (only the runtime fires triggers)")

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        _refuse("ctx.machine (only the runtime moves the machine)")

    def __delattr__(self, name: str) -> NoReturn:
        _refuse("ctx.machine (only the runtime moves the machine)")

    def __repr__(self) -> str:
        return f"MachineView(state={self._m.state.value})"


class _ToolsView:
    """The registered tools, read-only."""

    __slots__ = ("_r",)

    def __init__(self, registry: ToolRegistry) -> None:
        object.__setattr__(self, "_r", registry)

    def get(self, name: str) -> Tool | None:
        return self._r.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._r

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._r)

    def __len__(self) -> int:
        return len(self._r)

    @property
    def names(self) -> tuple[str, ...]:
        return self._r.names

    def definitions(self, names: Iterable[str] | None = None) -> tuple[ToolDefinition, ...]:
        return self._r.definitions(names)

    def add(self, *_: Any) -> NoReturn:
        _refuse("ctx.tools (tools are given to the Agent)")

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        _refuse("ctx.tools (tools are given to the Agent)")

    def __delattr__(self, name: str) -> NoReturn:
        _refuse("ctx.tools (tools are given to the Agent)")

    def __repr__(self) -> str:
        return f"ToolsView({list(self._r.names)})"


class _ReadOnly(Mapping[str, int]):
    __slots__ = ("_d",)

    def __init__(self, d: dict[str, int]) -> None:
        self._d = d

    def __getitem__(self, key: str) -> int:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


_WRITABLE = frozenset({"messages", "settings"})


class RunView:
    """The plugin's view of one run (valid for one run or resume): a :class:`~fsm_agent.RunContext`.

    Args:
        session_id: the session.
        provider: the run's provider.
        tools: the registered tools.
        transcript: the conversation of record (the driver's list; plugins see it read-only).
        run: the run state (default: a fresh one).
        machine: the machine (default: at the run state's saved state).
        metadata: the session's metadata (``SessionRecord.metadata``: ``tenant`` ...), read-only for plugins.
    """

    __slots__ = ("_run", "_states", "_outbox", "_host", "_transcript", "_machine", "_tools", "_tools_view",
                 "_metadata", "messages", "provider", "session_id", "settings", "started_at")

    def __init__(self, session_id: str, provider: Provider, tools: ToolRegistry, transcript: list[Message],
                 run: RunState | None = None, *, machine: MachineState | None = None,
                 metadata: Mapping[str, Any] | None = None) -> None:
        s = object.__setattr__
        s(self, "session_id", session_id)
        s(self, "provider", provider)
        s(self, "_tools", tools)
        s(self, "_tools_view", _ToolsView(tools))
        s(self, "_transcript", transcript)
        s(self, "_run", run if run is not None else RunState())
        s(self, "_machine", machine if machine is not None else MachineState(state_named(self._run.state)))
        s(self, "messages", [])
        s(self, "settings", TurnSettings())
        s(self, "started_at", time.monotonic())
        s(self, "_states", {})
        s(self, "_outbox", [])
        s(self, "_host", None)
        s(self, "_metadata", MappingProxyType(dict(metadata or {})))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WRITABLE:
            object.__setattr__(self, name, value)
            return
        _refuse(f"ctx.{name}")

    def __delattr__(self, name: str) -> NoReturn:
        raise ContextWriteError(f"ctx.{name} cannot be deleted by plugins; {_HOW}")

    # -- set by the runtime -----------------------------------------------------------------------
    def _bind(self, host: Any) -> None:
        """Attach the driver that runs this view (its port, its side calls)."""
        object.__setattr__(self, "_host", host)
        object.__setattr__(self, "started_at", host.port.monotonic())

    def _set_machine(self, machine: MachineState) -> None:
        object.__setattr__(self, "_machine", machine)

    def _set_metadata(self, metadata: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_metadata", MappingProxyType(dict(metadata)))

    def _port(self) -> EffectPort | None:
        host = self._host
        return None if host is None else host.port

    # -- the plugin's own data ------------------------------------------------------------------
    def state(self, middleware: Any) -> dict[str, Any]:
        key = getattr(middleware, "middleware_name", None) or str(middleware)
        return self._states.setdefault(key, {})

    def emit(self, event: Any) -> None:
        self._outbox.append(event)

    def update_plan(self, plan: Plan, reason: str) -> None:
        plan.validate()
        old = self._run.plan
        if old is not None and plan.version < old.version:
            raise InvalidPlanError([f"version {plan.version} is below the current plan's {old.version}; a plan's "
                                    "version only goes up (Plan.replan adds one)"])
        self._run.plan = plan
        self.emit(PlanUpdated(self.session_id, self._run.turn, plan, reason))

    async def call_provider(self, request: MessageRequest, provider: Provider | None = None, *,
                            account: bool = False) -> MessageResponse:
        host = self._host
        if host is None:
            raise ConfigurationError("ctx.call_provider is available only while a driver runs the context")
        return await host.side_call(request, provider, account=account)  # type: ignore[no-any-return]

    async def plugin_effect(self, plugin: Any, method: str, *args: Any) -> Any:
        fn = getattr(plugin, method, None)
        if method.startswith("__") or not callable(fn):
            raise ConfigurationError(f"ctx.plugin_effect: {type(plugin).__name__} has no method {method!r}; name "
                                     "a method of the plugin given (its name as a string)")
        host = self._host
        if host is None:  # a context no driver runs (a plugin's unit test): the call itself
            out = fn(*args)
            return await out if inspect.isawaitable(out) else out
        if not any(m is plugin for m in host.chain.middleware):
            raise ConfigurationError(f"ctx.plugin_effect: {plugin!r} is not a middleware of this run's chain; pass "
                                     "the plugin itself (self), so that a host running effects elsewhere finds it")
        port = host.port
        effect = getattr(port, "plugin_effect", None)
        if effect is None:
            raise ConfigurationError(f"ctx.plugin_effect: this run's effect port ({type(port).__name__}) does not "
                                     "implement plugin_effect (see fsm_agent.machine.port.EffectPort)")
        return await effect(plugin, method, args)

    # -- the world, through the port ---------------------------------------------------------------
    def now(self) -> float:
        port = self._port()
        return time.time() if port is None else port.now()

    def monotonic(self) -> float:
        port = self._port()
        return time.monotonic() if port is None else port.monotonic()

    def random(self) -> float:
        port = self._port()
        if port is None:
            import random

            return random.random()
        return port.random()

    def new_id(self) -> str:
        port = self._port()
        if port is None:
            import uuid

            return uuid.uuid4().hex
        return port.new_id()

    async def sleep(self, seconds: float) -> None:
        port = self._port()
        if port is None:
            import asyncio

            await asyncio.sleep(max(0.0, seconds))
            return
        await sleep(port, seconds)

    def deadline(self, seconds: float | None) -> PortDeadline:
        port = self._port()
        if port is None:
            raise ConfigurationError("ctx.deadline is available only while a driver runs the context")
        return PortDeadline(port, seconds)

    # -- read-only views --------------------------------------------------------------------------
    @property
    def transcript(self) -> TranscriptView:
        return TranscriptView(self._transcript)

    @property
    def machine(self) -> _MachineView:
        return _MachineView(self._machine)

    @property
    def tools(self) -> _ToolsView:
        return self._tools_view

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self._metadata

    @property
    def plan(self) -> Plan | None:
        return self._run.plan

    @property
    def permissions(self) -> Permissions | None:
        return self._run.permissions

    @property
    def config(self) -> RunConfig:
        return self._run.config

    @property
    def turn(self) -> int:
        return self._run.turn

    @property
    def usage(self) -> Usage:
        return self._run.usage

    @property
    def cost_usd(self) -> float | None:
        return self._run.cost_usd

    @property
    def tool_calls_made(self) -> int:
        return self._run.tool_calls_made

    @property
    def tool_call_counts(self) -> Mapping[str, int]:
        return _ReadOnly(self._run.tool_call_counts)

    @property
    def last_response(self) -> MessageResponse | None:
        return self._run.last_response

    @property
    def pending_calls(self) -> Sequence[ToolUseBlock]:
        return tuple(self._run.pending_calls)

    @property
    def context_retry(self) -> bool:
        return self._run.context_retry

    @property
    def max_output_override(self) -> int | None:
        return self._run.max_output_override

    @property
    def goal_version(self) -> int:
        return self._run.goal_version

    @property
    def evidence(self) -> Sequence[str]:
        return tuple(self._run.evidence)

    @property
    def elapsed(self) -> float:
        return self._run.elapsed + self.monotonic() - self.started_at

    @property
    def remaining_wall_clock(self) -> float | None:
        if self._run.config.max_wall_clock is None:
            return None
        return max(0.0, self._run.config.max_wall_clock - self.elapsed)

    @property
    def state_name(self) -> str:
        return str(self._machine.state.value)

    @property
    def active_tools(self) -> list[str] | None:
        return self.settings.active_tools

    @property
    def tools_enabled(self) -> bool:
        return self.settings.tools_enabled

    def __repr__(self) -> str:
        return f"RunView(session_id={self.session_id!r}, state={self.state_name}, turn={self.turn})"


def state_named(name: str) -> Any:
    """The machine state named ``name`` (a :class:`Phase` or a :class:`StopReason`)."""
    from ..types.run import StopReason

    try:
        return Phase(name)
    except ValueError:
        return StopReason(name)
