"""Guardrails: checks that run beside the model and the tools, with a tripwire that stops the run.

Four kinds, each a function ``(ctx, data) -> GuardrailResult`` (plain or ``async``) made a
:class:`Guardrail` by its decorator, and one middleware, :class:`Guardrails`, that runs them:

* :func:`input_guardrail`: ``data`` is the user's input (``str``: the user messages at the end of
  the context, joined by blank lines), checked at each model call whose context ends with user input
  not yet checked in this run or resume: the run's input, a Steer or a Followup sent while it runs,
  a resume's new input (and user-role messages the runtime adds, such as a verifier's feedback).
  By default it runs **beside** that model call: both start together; when the
  tripwire fires first, the model call is cancelled and its answer is never used; when the answer
  comes first, it waits for the guardrails. ``run_in_parallel=False`` runs it before the call (a
  trip then spends no model tokens).
* :func:`output_guardrail`: ``data`` is a final answer's text (a model response without tool
  calls), checked before the answer enters the conversation. A trip withholds it: it is neither in
  ``RunResult.messages`` nor ``RunResult.output``. (With streaming on, observers saw its deltas.)
* :func:`tool_input_guardrail`: ``data`` is the :class:`~fsm_agent.ToolUseBlock` (name, arguments),
  checked before any call of the turn runs. ``on_trip="reject"`` (default) denies the call with a
  reason the model reads (the tool does not run); ``"stop"`` ends the run.
* :func:`tool_output_guardrail`: ``data`` is a :class:`ToolOutput` (the call and its result), checked
  after the tool ran. ``on_trip="reject"`` (default) replaces the result with an error result
  saying it was withheld; ``"stop"`` ends the run. Either way the output never reaches the model.

A trip that stops the run ends it FAILED_TERMINAL through
:class:`~fsm_agent.errors.GuardrailTripwireTriggered`: ``stop.error`` is ``{"kind":
"guardrail_tripwire", "guardrail": name, "guardrail_kind": kind, "message", "info"}`` (plus
``tool`` and ``call_id`` for a tool guardrail), and the stop's detail names the guardrail. A
guardrail function may raise that exception instead of returning a tripped result.

Guardrails of one kind run concurrently, each in its own task; the first that trips wins and the
others are cancelled. A guardrail that raises or runs past its ``timeout`` follows its
``on_error`` policy: ``"fail_closed"`` (default, as the chain's ``propagate``) does what a trip
does, with ``error.kind`` ``guardrail_failed``; ``"fail_open"`` (as ``isolate``) logs it and counts
as passed. Every guardrail run is a :class:`GuardrailChecked` event (session log type
``guardrail``; observers get it through ``on_plugin_event``).

:func:`llm_guardrail` makes a guardrail that asks a model. Its call goes through
``ctx.call_provider``, an effect of the run: a recorded run replays without calling that model
again, and a durable host (Temporal) runs it as an activity. Everything a guardrail needs of the
world must come through ``ctx`` the same way (``docs/writing-middleware.md``, "Surviving a replay").
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

import orjson
from attrs import field, frozen, validators

from fsm_agent import (
    ConfigurationError,
    Deny,
    MessageRequest,
    MessageResponse,
    Middleware,
    ModelCallNext,
    Ordering,
    Provider,
    RunContext,
    StopReason,
    StopRun,
    SystemMessage,
    ToolCallNext,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
)
from fsm_agent.errors import GuardrailTripwireTriggered, ReplayDivergence, Signal

__all__ = [
    "GUARDRAIL_INSTRUCTIONS",
    "KINDS",
    "TRIPWIRE_FORMAT",
    "Guardrail",
    "GuardrailChecked",
    "GuardrailResult",
    "Guardrails",
    "LLMGuardrail",
    "ToolOutput",
    "input_guardrail",
    "llm_guardrail",
    "output_guardrail",
    "parse_tripwire",
    "tool_input_guardrail",
    "tool_output_guardrail",
]

log = logging.getLogger("fsm_agent.guardrails")

KINDS = ("input", "output", "tool_input", "tool_output")
"""The four kinds of guardrail, in the order a run meets them."""

_ON_TRIP = {"input": ("stop",), "output": ("stop",), "tool_input": ("reject", "stop"),
            "tool_output": ("reject", "stop")}
_ON_ERROR = ("fail_closed", "fail_open")


# -- what a guardrail returns and receives ----------------------------------------------------------
@frozen
class GuardrailResult:
    """What a guardrail function returns.

    Attributes:
        tripwire: ``True``: the tripwire fired (the run stops, or a tool call or its output is
            rejected, as the guardrail's ``on_trip`` says).
        info: what the guardrail found, for the log and the stop (JSON-like data: dicts, lists,
            strings, numbers; anything else is written as its ``repr``).
        message: why, in words: the stop's detail, or what the model reads when a tool call or its
            output is rejected.
    """

    tripwire: bool = field(validator=validators.instance_of(bool))
    info: Any = None
    message: str = field(default="", validator=validators.instance_of(str))

    @classmethod
    def passed(cls, info: Any = None) -> GuardrailResult:
        """A result whose tripwire did not fire."""
        return cls(False, info)

    @classmethod
    def tripped(cls, message: str = "", info: Any = None) -> GuardrailResult:
        """A result whose tripwire fired, saying why."""
        return cls(True, info, message)


@frozen
class ToolOutput:
    """The ``data`` of a tool-output guardrail: the call as it ran and the result it gave."""

    call: ToolUseBlock
    result: ToolResultMessage

    @property
    def text(self) -> str:
        """The result's text."""
        return self.result.text


GuardrailFunction = Callable[[RunContext, Any], "GuardrailResult | Awaitable[GuardrailResult]"]
"""``(ctx, data) -> GuardrailResult``, plain or ``async``."""


def _names(value: Any) -> tuple[str, ...] | None:
    """``tools=``: one name, or several, as a tuple (``None``: every tool)."""
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


@frozen
class Guardrail:
    """One guardrail: a function and how it runs (made by :func:`input_guardrail` and its siblings).

    Attributes:
        fn: the guardrail function ``(ctx, data) -> GuardrailResult`` (plain or ``async``).
        kind: ``input``, ``output``, ``tool_input`` or ``tool_output``.
        name: the name events, stops and rejections give (unique in one :class:`Guardrails`).
        run_in_parallel: input guardrails: ``True`` runs beside the model call, ``False`` before it.
        on_trip: ``"stop"`` ends the run; ``"reject"`` (tool guardrails) rejects the call or its output.
        on_error: ``"fail_closed"`` (a failure does what a trip does) or ``"fail_open"`` (it passes).
        timeout: seconds the guardrail may take (on the run's timers), or ``None``; running past it is
            a failure.
        tools: tool guardrails: the tool names it checks, or ``None`` for every tool.
    """

    fn: GuardrailFunction
    kind: str
    name: str
    run_in_parallel: bool = True
    on_trip: str = "stop"
    on_error: str = "fail_closed"
    timeout: float | None = None
    tools: tuple[str, ...] | None = field(default=None, converter=_names)

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigurationError(f"guardrail {self.name!r}: kind must be one of {', '.join(KINDS)}, "
                                     f"not {self.kind!r}")
        if not callable(self.fn):
            raise ConfigurationError(f"guardrail {self.name!r}: {self.fn!r} is not callable; give a function "
                                     "(ctx, data) -> GuardrailResult")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationError("a guardrail needs a name (a non-empty string)")
        if self.on_trip not in _ON_TRIP[self.kind]:
            raise ConfigurationError(f"guardrail {self.name!r}: on_trip of a {self.kind} guardrail must be "
                                     f"{' or '.join(map(repr, _ON_TRIP[self.kind]))}, not {self.on_trip!r}")
        if self.on_error not in _ON_ERROR:
            raise ConfigurationError(f"guardrail {self.name!r}: on_error must be 'fail_closed' or 'fail_open', "
                                     f"not {self.on_error!r}")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not self.timeout > 0):
            raise ConfigurationError(f"guardrail {self.name!r}: timeout must be positive seconds (or None), "
                                     f"not {self.timeout!r}")
        if self.tools is not None and self.kind not in ("tool_input", "tool_output"):
            raise ConfigurationError(f"guardrail {self.name!r}: tools= applies to tool guardrails only")
        if not isinstance(self.run_in_parallel, bool):
            raise ConfigurationError(f"guardrail {self.name!r}: run_in_parallel must be True or False")

    def applies_to(self, tool: str) -> bool:
        """Whether this (tool) guardrail checks calls to ``tool``."""
        return self.tools is None or tool in self.tools


def _make(kind: str, fn: GuardrailFunction | None, opts: dict[str, Any]
          ) -> Guardrail | Callable[[GuardrailFunction], Guardrail]:
    def build(f: GuardrailFunction) -> Guardrail:
        if isinstance(f, Guardrail):
            raise ConfigurationError(f"{f.name!r} is already a {f.kind} guardrail")
        rest = dict(opts)
        name = rest.pop("name", None) or getattr(f, "name", None) or getattr(f, "__name__", None)
        if not isinstance(name, str) or not name or name == "<lambda>":
            raise ConfigurationError(f"guardrail {f!r} needs a name: pass name=...")
        return Guardrail(f, kind, name, **rest)

    return build if fn is None else build(fn)


def input_guardrail(fn: GuardrailFunction | None = None, *, name: str | None = None, run_in_parallel: bool = True,
                    on_error: str = "fail_closed", timeout: float | None = None) -> Any:
    """Make ``fn`` an input guardrail: ``fn(ctx, text)`` judges the user's input (``str``).

    Use as ``@input_guardrail``, ``@input_guardrail(name=..., run_in_parallel=False)`` or
    ``input_guardrail(llm_guardrail(...), name=...)``. A trip ends the run FAILED_TERMINAL.

    Args:
        name: default: the function's name.
        run_in_parallel: ``True`` (default): beside the model call, which is cancelled when the
            tripwire fires first; ``False``: before it.
        on_error, timeout: see :class:`Guardrail`.

    Returns:
        A :class:`Guardrail` (or, without ``fn``, a decorator that makes one).

    Raises:
        ConfigurationError: a bad option, or a function without a usable name.
    """
    return _make("input", fn, {"name": name, "run_in_parallel": run_in_parallel, "on_error": on_error,
                               "timeout": timeout})


def output_guardrail(fn: GuardrailFunction | None = None, *, name: str | None = None,
                     on_error: str = "fail_closed", timeout: float | None = None) -> Any:
    """Make ``fn`` an output guardrail: ``fn(ctx, text)`` judges a final answer's text before it enters
    the conversation. A trip withholds the answer and ends the run FAILED_TERMINAL.

    Returns and raises as :func:`input_guardrail`.
    """
    return _make("output", fn, {"name": name, "on_error": on_error, "timeout": timeout})


def tool_input_guardrail(fn: GuardrailFunction | None = None, *, name: str | None = None, on_trip: str = "reject",
                         tools: Sequence[str] | str | None = None, on_error: str = "fail_closed",
                         timeout: float | None = None) -> Any:
    """Make ``fn`` a tool-input guardrail: ``fn(ctx, call)`` judges each proposed
    :class:`~fsm_agent.ToolUseBlock` (``call.name``, ``call.input``) before any call of the turn runs.

    Args:
        on_trip: ``"reject"`` (default): the call does not run, the model reads why; ``"stop"``: the
            run ends FAILED_TERMINAL.
        tools: the tool names it checks (default: all).
        name, on_error, timeout: see :class:`Guardrail`.

    Returns and raises as :func:`input_guardrail`.
    """
    return _make("tool_input", fn, {"name": name, "on_trip": on_trip, "tools": tools, "on_error": on_error,
                                    "timeout": timeout})


def tool_output_guardrail(fn: GuardrailFunction | None = None, *, name: str | None = None, on_trip: str = "reject",
                          tools: Sequence[str] | str | None = None, on_error: str = "fail_closed",
                          timeout: float | None = None) -> Any:
    """Make ``fn`` a tool-output guardrail: ``fn(ctx, output)`` judges each :class:`ToolOutput` (the
    call and its result) after the tool ran.

    Args:
        on_trip: ``"reject"`` (default): the result is replaced by an error result saying the output
            was withheld; ``"stop"``: the run ends FAILED_TERMINAL. Either way the model never sees
            the output.
        tools: the tool names it checks (default: all).
        name, on_error, timeout: see :class:`Guardrail`.

    Returns and raises as :func:`input_guardrail`.
    """
    return _make("tool_output", fn, {"name": name, "on_trip": on_trip, "tools": tools, "on_error": on_error,
                                     "timeout": timeout})


# -- the event ----------------------------------------------------------------------------------------
@frozen
class GuardrailChecked:
    """One guardrail ran (session log type ``guardrail``; observers: ``on_plugin_event``)."""

    TAG: ClassVar[str] = "guardrail"
    session_id: str
    turn: int
    guardrail: str
    kind: str
    """``input``, ``output``, ``tool_input`` or ``tool_output``."""
    outcome: str
    """``passed``, ``tripped``, ``failed`` (it raised or returned no GuardrailResult), ``timed_out``
    or ``cancelled`` (another guardrail tripped first, or the run stopped)."""
    tripped: bool
    duration_s: float
    """Seconds it ran (the run's monotonic clock)."""
    action: str | None = None
    """What followed: ``stop``, ``reject``, ``ignored`` (a failure under ``fail_open``), or ``None``."""
    message: str = ""
    info: Any = None
    error: str | None = None
    """For ``failed`` and ``timed_out``: what went wrong."""
    tool: str | None = None
    call_id: str | None = None
    parallel: bool = False
    """An input guardrail that ran beside the model call."""


# -- the middleware -----------------------------------------------------------------------------------
@frozen
class _Verdict:
    """A guardrail that calls for action: it tripped, or it failed and fails closed."""

    guardrail: Guardrail
    tripped: bool
    message: str = ""
    info: Any = None
    error: str | None = None


class Guardrails(Middleware):
    """Runs guardrails beside the model and the tools (see the module doc).

    Args:
        guardrails: :class:`Guardrail` objects (from the decorators), any kinds, any order; within a
            kind they run concurrently.
        name: middleware name (to have several in one chain).

    Raises:
        ConfigurationError: something given is not a Guardrail, or two share a name.

    Placement: outside ``retry`` (an input guardrail runs beside the whole retried call, an output
    guardrail sees the answer retries settled on), and its ``on_tool_call`` is asked before
    ``tool_policy``'s and ``approval``'s (a rejected call is never put to a person).
    """

    name = "guardrails"
    ordering = Ordering(wraps=("retry", "tool_policy", "approval"))

    def __init__(self, *guardrails: Guardrail, name: str | None = None) -> None:
        seen: set[str] = set()
        for g in guardrails:
            if not isinstance(g, Guardrail):
                raise ConfigurationError(f"Guardrails takes guardrails made by input_guardrail, output_guardrail, "
                                         f"tool_input_guardrail or tool_output_guardrail, not {g!r}")
            if g.name in seen:
                raise ConfigurationError(f"two guardrails are named {g.name!r}; give each its own name=")
            seen.add(g.name)
        self.guardrails = tuple(guardrails)
        self.providers = tuple(p for g in guardrails if isinstance(p := getattr(g.fn, "provider", None), Provider))
        """The models the guardrails ask (an :class:`LLMGuardrail`'s): a durable host's workers find a
        side call's provider among those the agent's plugins hold."""
        by = {k: tuple(g for g in guardrails if g.kind == k) for k in KINDS}
        self.input, self.output, self.tool_input, self.tool_output = (by[k] for k in KINDS)
        if name:
            self.name = name  # type: ignore[misc]  # instance override of the class-level name

    def __repr__(self) -> str:
        return f"Guardrails({', '.join(f'{g.kind}:{g.name}' for g in self.guardrails)})"

    # -- Model ---------------------------------------------------------------------------------
    async def wrap_model_call(self, request: MessageRequest, call_next: ModelCallNext, ctx: RunContext
                              ) -> MessageResponse:
        """Input guardrails before and beside a model call whose context ends with user input not checked
        yet in this run or resume; output guardrails on an answer without tool calls.

        Raises:
            GuardrailTripwireTriggered: a guardrail tripped (FAILED_TERMINAL; the answer is discarded).
            StopRun: a guardrail failed and fails closed (FAILED_TERMINAL, ``guardrail_failed``).
        """
        st = ctx.state(self)
        inputs: tuple[Guardrail, ...] = ()
        text = ""
        seen = len(ctx.transcript)  # the input is new when the transcript grew since the last check
        if self.input and st.get("input_checked") != seen:
            found = _user_input(request.messages)
            if found is not None:
                inputs, text = self.input, found
        before = tuple(g for g in inputs if not g.run_in_parallel)
        beside = tuple(g for g in inputs if g.run_in_parallel)
        if before:
            await self._enforce(ctx, before, text)
        if beside:
            response = await self._beside(ctx, beside, text, request, call_next)
        else:
            response = await call_next(request)
        if inputs:
            st["input_checked"] = seen
        if self.output and not response.tool_calls:
            await self._enforce(ctx, self.output, response.text)
        return response

    async def _beside(self, ctx: RunContext, guardrails: tuple[Guardrail, ...], text: str,
                      request: MessageRequest, call_next: ModelCallNext) -> MessageResponse:
        """The model call with ``guardrails`` running beside it, in their own task. A trip (or a
        fail-closed failure) while the call is in flight cancels this task's wait on it (as a deadline
        does) and raises the stop here; an answer that comes first waits for the guardrails."""
        task = asyncio.current_task()
        assert task is not None
        flags: dict[str, Any] = {"in_model": True, "cut": False, "stop": None}

        async def watch() -> None:
            try:
                verdict = await self._check(ctx, guardrails, text, parallel=True)
                stop: BaseException | None = None if verdict is None else self._stop(verdict)
            except (Signal, ReplayDivergence) as exc:  # a guardrail's own StopRun, a replay's divergence
                stop = exc
            if stop is None:
                return
            flags["stop"] = stop
            if flags["in_model"]:
                flags["cut"] = True
                task.cancel()

        guard = asyncio.ensure_future(watch())
        try:
            try:
                response = await call_next(request)
            except BaseException as exc:
                flags["in_model"] = False
                if flags["cut"]:
                    # our cancel landed (a cancel from outside at the same time stays a cancel)
                    if isinstance(exc, asyncio.CancelledError) and task.uncancel() > 0:
                        raise
                    if not isinstance(exc, asyncio.CancelledError):
                        task.uncancel()
                    raise flags["stop"] from None
                raise
            flags["in_model"] = False
            if flags["cut"]:  # the cancel was swallowed inside the call: the tripwire still wins
                task.uncancel()
                raise flags["stop"]
            await guard  # the answer waits for the guardrails
            if flags["stop"] is not None:
                raise flags["stop"]
            return response
        finally:
            if not guard.done():
                guard.cancel()
            await asyncio.gather(guard, return_exceptions=True)

    # -- MidTurn -------------------------------------------------------------------------------
    async def on_tool_call(self, call: ToolUseBlock, ctx: RunContext) -> Deny | None:  # type: ignore[override]
        """Tool-input guardrails on ``call``: ``None`` when they pass, ``Deny`` on a reject-type trip.

        Raises:
            GuardrailTripwireTriggered: a stop-type guardrail tripped.
            StopRun: a stop-type guardrail failed and fails closed.
        """
        guardrails = tuple(g for g in self.tool_input if g.applies_to(call.name))
        verdict = await self._check(ctx, guardrails, call, call=call) if guardrails else None
        if verdict is None:
            return None
        if verdict.guardrail.on_trip == "stop":
            raise self._stop(verdict, call)
        name = verdict.guardrail.name
        if verdict.tripped:
            return Deny(f"guardrail {name!r} rejected this call{': ' + verdict.message if verdict.message else ''}")
        return Deny(f"guardrail {name!r} could not check this call, so it was not run")

    async def wrap_tool_call(self, call: ToolUseBlock, call_next: ToolCallNext, ctx: RunContext
                             ) -> ToolResultMessage:
        """Tool-output guardrails on the result of ``call``: the result, or (reject-type trip) an error
        result saying the output was withheld.

        Raises:
            GuardrailTripwireTriggered: a stop-type guardrail tripped.
            StopRun: a stop-type guardrail failed and fails closed.
        """
        result = await call_next(call)
        guardrails = tuple(g for g in self.tool_output if g.applies_to(call.name))
        if not guardrails:
            return result
        verdict = await self._check(ctx, guardrails, ToolOutput(call, result), call=call)
        if verdict is None:
            return result
        if verdict.guardrail.on_trip == "stop":
            raise self._stop(verdict, call)
        name = verdict.guardrail.name
        why = (f": {verdict.message}" if verdict.message else "") if verdict.tripped else \
            " (the guardrail could not check it)"
        return ToolResultMessage(call.id, f"The output of this tool call was withheld by guardrail {name!r}{why}",
                                 is_error=True, name=call.name, metadata={"withheld_by": name})

    # -- running guardrails ----------------------------------------------------------------------
    async def _enforce(self, ctx: RunContext, guardrails: tuple[Guardrail, ...], data: Any) -> None:
        verdict = await self._check(ctx, guardrails, data)
        if verdict is not None:
            raise self._stop(verdict)

    async def _check(self, ctx: RunContext, guardrails: tuple[Guardrail, ...], data: Any, *,
                     call: ToolUseBlock | None = None, parallel: bool = False) -> _Verdict | None:
        """Run ``guardrails`` concurrently, each in its own task; the first that calls for action (in
        the order they finish; among those finishing together, in the order given) cancels the rest
        and is returned. ``None``: every one passed (or failed open)."""
        tasks = [asyncio.ensure_future(self._one(ctx, g, data, call, parallel)) for g in guardrails]
        try:
            pending = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in tasks:
                    if t.done() and t not in pending:
                        verdict = t.result()
                        if verdict is not None:
                            return verdict
            return None
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, ctx: RunContext, g: Guardrail, data: Any, call: ToolUseBlock | None,
                   parallel: bool) -> _Verdict | None:
        """Run one guardrail, emit its event, and say whether it calls for action."""
        started = ctx.monotonic()

        def event(outcome: str, action: str | None = None, result: GuardrailResult | None = None,
                  error: str | None = None) -> None:
            ctx.emit(GuardrailChecked(
                ctx.session_id, ctx.turn, g.name, g.kind, outcome, outcome == "tripped",
                max(0.0, ctx.monotonic() - started), action, result.message if result else "",
                _plain(result.info) if result else None, error, call.name if call else None,
                call.id if call else None, parallel))

        deadline = None
        try:
            try:
                if g.timeout is not None:
                    async with ctx.deadline(g.timeout) as deadline:
                        out = await _invoke(g.fn, ctx, data)
                else:
                    out = await _invoke(g.fn, ctx, data)
            except GuardrailTripwireTriggered as exc:
                out = GuardrailResult(True, exc.info, exc.message)
            if not isinstance(out, GuardrailResult):
                raise TypeError(f"it returned {type(out).__name__}, not a GuardrailResult")
        except asyncio.CancelledError:
            event("cancelled")
            raise
        except (Signal, ReplayDivergence):
            raise
        except Exception as exc:  # noqa: BLE001 - a guardrail's failure follows its on_error policy
            timed_out = isinstance(exc, TimeoutError) and deadline is not None and deadline.expired()
            error = (f"no result within {g.timeout:g} s" if timed_out
                     else f"{type(exc).__name__}: {exc}"[:2000])
            outcome = "timed_out" if timed_out else "failed"
            if g.on_error == "fail_open":
                log.warning("session %s: %s guardrail %r %s (%s); it fails open", ctx.session_id, g.kind, g.name,
                            outcome.replace("_", " "), error)
                event(outcome, "ignored", error=error)
                return None
            event(outcome, g.on_trip, error=error)
            return _Verdict(g, False, error=error)
        if not out.tripwire:
            event("passed", result=out)
            return None
        event("tripped", g.on_trip, out)
        return _Verdict(g, True, out.message, _plain(out.info))

    @staticmethod
    def _stop(v: _Verdict, call: ToolUseBlock | None = None) -> StopRun:
        g = v.guardrail
        if v.tripped:
            stop: StopRun = GuardrailTripwireTriggered(v.message, guardrail=g.name, kind=g.kind, info=v.info)
        else:
            what = f"{g.kind.replace('_', ' ')} guardrail {g.name!r}"
            stop = StopRun(StopReason.FAILED_TERMINAL, f"{what} failed ({v.error}); it fails closed",
                           error={"kind": "guardrail_failed", "guardrail": g.name, "guardrail_kind": g.kind,
                                  "message": v.error or ""})
        if call is not None:
            stop.payload["error"].update(tool=call.name, call_id=call.id)
        return stop


async def _invoke(fn: GuardrailFunction, ctx: RunContext, data: Any) -> Any:
    out = fn(ctx, data)
    if inspect.isawaitable(out):
        out = await out
    return out


def _user_input(messages: Sequence[Any]) -> str | None:
    """The text of the user messages at the end of ``messages`` (system messages between them are
    skipped), joined by blank lines; ``None`` when the context does not end with user input."""
    texts: list[str] = []
    found = False
    for m in reversed(messages):
        if isinstance(m, SystemMessage):
            continue
        if m.role != "user":
            break
        found = True
        if isinstance(m, UserMessage) and m.text:
            texts.append(m.text)
    return "\n\n".join(reversed(texts)) if found else None


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-like data for the log (anything else as its ``repr``, cut)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth < 8 and isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if depth < 8 and isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    return repr(value)[:2000]


# -- a guardrail that asks a model ---------------------------------------------------------------------
TRIPWIRE_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {
        "name": "guardrail",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"tripwire": {"type": "boolean"}, "reason": {"type": "string"}},
            "required": ["tripwire", "reason"],
            "additionalProperties": False,
        },
    },
}
"""The ``response_format`` of :class:`LLMGuardrail`'s request (OpenAI-style JSON schema)."""

GUARDRAIL_INSTRUCTIONS = (
    'Reply with JSON only: {"tripwire": true or false, "reason": "one short sentence"}. '
    "Set tripwire to true only when the CONTENT breaks the rule above."
)
"""Appended to an :class:`LLMGuardrail`'s instructions: the reply it expects."""

_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.IGNORECASE)


def parse_tripwire(text: str) -> tuple[bool, str] | None:
    """``(tripwire, reason)`` from a guardrail model's reply, or ``None`` when it holds none.

    Accepts a bare JSON object, one in a code fence or inside prose, and ``"tripwire"`` given as the
    strings ``"true"`` / ``"false"``; ``reason`` is cut to 2,000 characters.
    """
    s = _FENCE.sub("", text.strip())
    candidates = [s]
    start, end = s.find("{"), s.rfind("}")
    if 0 <= start < end:
        candidates.append(s[start:end + 1])
    for c in candidates:
        try:
            obj = orjson.loads(c)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        trip = obj.get("tripwire")
        if isinstance(trip, str) and trip.strip().lower() in ("true", "false"):
            trip = trip.strip().lower() == "true"
        if not isinstance(trip, bool):
            continue
        reason = obj.get("reason", "")
        return trip, (reason if isinstance(reason, str) else orjson.dumps(reason).decode())[:2000]
    return None


def _render(data: Any) -> str:
    if isinstance(data, ToolOutput):
        return (f"TOOL CALL: {data.call.name}\nARGUMENTS: {orjson.dumps(data.call.input).decode()}\n"
                f"RESULT{' (an error)' if data.result.is_error else ''}:\n{data.text}")
    if isinstance(data, ToolUseBlock):
        return f"TOOL CALL: {data.name}\nARGUMENTS: {orjson.dumps(data.input).decode()}"
    return str(data)


class LLMGuardrail:
    """A guardrail function that asks a model whether the content breaks a rule (see :func:`llm_guardrail`).

    The request: ``instructions`` and :data:`GUARDRAIL_INSTRUCTIONS` as the system message, the
    content (the input or answer text; a tool call's name and arguments; and its result) as
    ``CONTENT:`` in the user message, :data:`TRIPWIRE_FORMAT` as the ``response_format``. The reply
    is read by :func:`parse_tripwire`; the result's ``info`` holds ``reason``, ``response_id`` and
    ``model``, its ``message`` the reason.

    Raises (to the plugin, which applies the guardrail's ``on_error``):
        ValueError: the reply holds no readable verdict.
        ProviderError: the call failed.
    """

    def __init__(self, provider: Provider | None, instructions: str, *, name: str = "llm_guardrail",
                 max_tokens: int = 200, temperature: float | None = 0.0, account: bool = True) -> None:
        if not isinstance(instructions, str) or not instructions.strip():
            raise ConfigurationError("llm_guardrail needs instructions: the rule the model checks the content against")
        if max_tokens < 1:
            raise ConfigurationError(f"llm_guardrail: max_tokens must be at least 1, not {max_tokens}")
        self.provider = provider
        self.instructions = instructions
        self.name = name
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.account = account

    def __repr__(self) -> str:
        who = "run's own" if self.provider is None else f"{self.provider.name}:{self.provider.model}"
        return f"LLMGuardrail(name={self.name!r}, provider={who!r})"

    def request(self, ctx: RunContext, data: Any) -> MessageRequest:
        """The request that asks the model about ``data``."""
        provider = self.provider or ctx.provider
        return MessageRequest(
            model=provider.model or "",
            messages=(SystemMessage(f"{self.instructions.strip()}\n\n{GUARDRAIL_INSTRUCTIONS}"),
                      UserMessage(f"CONTENT:\n{_render(data)}")),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            response_format=TRIPWIRE_FORMAT,
        )

    async def __call__(self, ctx: RunContext, data: Any) -> GuardrailResult:
        response = await ctx.call_provider(self.request(ctx, data), provider=self.provider, account=self.account)
        parsed = parse_tripwire(response.text)
        if parsed is None:
            raise ValueError(f"the guardrail model's reply holds no verdict: {response.text[:300]!r}")
        tripped, reason = parsed
        info = {"reason": reason, "response_id": response.id, "model": response.model}
        return GuardrailResult(tripped, info, reason)


def llm_guardrail(provider: Provider | None, instructions: str, *, name: str = "llm_guardrail",
                  max_tokens: int = 200, temperature: float | None = 0.0, account: bool = True) -> LLMGuardrail:
    """A guardrail function that asks ``provider`` (``None``: the run's own) whether the content breaks
    the rule in ``instructions``; wrap it with a decorator to choose its kind::

        input_guardrail(llm_guardrail(cheap, "Trip when the user asks for help with homework."), name="homework")

    The call goes through ``ctx.call_provider``: recorded and replayed with the run, run as an
    activity on a durable host, and (``account=True``, default) counted in the run's token and cost
    budgets. Made beside the model call, its streamed events are not shown as the answer.

    Args:
        provider: the guardrail model.
        instructions: the rule, in words.
        name: the default name of a guardrail made from it.
        max_tokens: output tokens of the reply.
        temperature: sampling temperature (default 0).
        account: add the call's usage and cost to the run's.

    Raises:
        ConfigurationError: empty instructions or ``max_tokens`` below 1.
    """
    return LLMGuardrail(provider, instructions, name=name, max_tokens=max_tokens, temperature=temperature,
                        account=account)
