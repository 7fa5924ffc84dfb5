"""Composition of middleware into per-phase chains (the contract is in :mod:`fsm_agent.middleware`).

Built once, at construction:

1. **Validate** each middleware: which hooks it overrides (compared with the
   base class's pass-through, so untouched hooks cost nothing at run time),
   and whether each overridden hook is ``async def`` where it must be and
   plain ``def`` where it must be. Errors name the plugin.
2. **Order**: list order is wrapping order (first listed = outermost).
   Declarative :class:`~fsm_agent.middleware.Ordering` constraints are
   applied with a stable topological sort in which the user's order breaks
   ties (like pydantic-ai's capability ordering). Cycles, duplicate names,
   missing requirements and declared conflicts raise :class:`~fsm_agent.errors.ChainError`.
3. **Compose**, when the chain is frozen (before the first run): one tuple of bound hook methods
   per phase, already filtered and ordered, and one composed onion per ``wrap_*`` hook. The
   driver calls typed methods (:meth:`MiddlewareChain.pre_turn`, :meth:`~MiddlewareChain.model_call`
   ...); nothing is looked up by hook name at run time.

A chain is frozen after the first run starts; changing it then raises.
"""

from __future__ import annotations

import graphlib
import heapq
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from attrs import evolve

from .errors import ChainError, MiddlewareError, ProviderError, ReplayDivergence, Signal, StopRun
from .middleware import (
    ASYNC_ONLY,
    HOOKS,
    SYNC_ONLY,
    AskApproval,
    Deny,
    Edit,
    FailurePolicy,
    Middleware,
    Respond,
    ToolDecision,
    TurnDecision,
)
from .types.content import ToolUseBlock
from .types.messages import ToolResultMessage
from .types.requests import MessageRequest, MessageResponse
from .types.stream import StreamEvent

if TYPE_CHECKING:
    from .context import RunContext
    from .types.run import RunResult

_A = TypeVar("_A")
_R = TypeVar("_R")

Inner = Callable[[_A], Awaitable[_R]]
Composed = Callable[[_A, "RunContext", Inner[_A, _R]], Awaitable[_R]]
"""A composed ``wrap_*`` chain: ``await composed(arg, ctx, inner)`` runs every layer, then ``inner``."""

__all__ = ["MiddlewareChain", "resolve_order"]

log = logging.getLogger("fsm_agent.chain")


def _overrides(mw: Middleware, hook: str) -> bool:
    impl = getattr(type(mw), hook, None)
    return impl is not None and impl is not getattr(Middleware, hook)


def resolve_order(items: Sequence[Middleware]) -> list[Middleware]:
    """Apply ordering constraints; user order breaks ties.

    Raises:
        ChainError: duplicate names, a missing requirement, a declared conflict, an unknown
            position, or a cycle.
    """
    names = [m.middleware_name for m in items]
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ChainError(f"two middleware are named {n!r}; names must be unique in a chain")
        seen.add(n)
    index = {n: i for i, n in enumerate(names)}
    for m in items:
        o = m.ordering
        if o.position not in (None, "outermost", "innermost"):
            raise ChainError(f"middleware {m.middleware_name!r}: position must be 'outermost' or 'innermost', "
                             f"not {o.position!r}")
        missing = [r for r in o.requires if r not in index]
        if missing:
            raise ChainError(f"middleware {m.middleware_name!r} requires {', '.join(map(repr, missing))}, "
                             "which is not in the chain; add it or remove the requirement")
        for other, why in o.conflicts:
            if other in index and other != m.middleware_name:
                raise ChainError(f"middleware {m.middleware_name!r} cannot be in one chain with {other!r}"
                                 f"{': ' + why if why else ''}; remove one of them")
    # edges: a -> b means a must come before (outside) b
    graph: dict[str, set[str]] = {n: set() for n in names}  # node -> predecessors
    for m in items:
        me = m.middleware_name
        for other in m.ordering.wraps:
            if other in index:
                graph[other].add(me)
        for other in m.ordering.wrapped_by:
            if other in index:
                graph[me].add(other)
        if m.ordering.position == "outermost":
            for n in names:
                if n != me and items[index[n]].ordering.position != "outermost":
                    graph[n].add(me)
        elif m.ordering.position == "innermost":
            for n in names:
                if n != me and items[index[n]].ordering.position != "innermost":
                    graph[me].add(n)
    # Kahn's algorithm; among the nodes ready at each step, the earliest in user order goes first.
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        cycle = " -> ".join(exc.args[1]) if len(exc.args) > 1 else "?"
        raise ChainError(f"middleware ordering constraints form a cycle: {cycle}") from None
    pending = {n: set(p) for n, p in graph.items()}
    ready = [(index[n], n) for n, p in pending.items() if not p]
    heapq.heapify(ready)
    out: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(n)
        for other, preds in pending.items():
            if n in preds:
                preds.discard(n)
                if not preds:
                    heapq.heappush(ready, (index[other], other))
    return [items[index[n]] for n in out]


class _Hook:
    """One middleware's bound hook, with what the chain needs to call it."""

    __slots__ = ("fn", "is_async", "isolate", "name")

    def __init__(self, m: Middleware, hook: str) -> None:
        self.fn = getattr(m, hook)
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self.isolate = FailurePolicy(m.failure_policy) is FailurePolicy.ISOLATE
        self.name = m.middleware_name


class MiddlewareChain:
    """Middleware composed per hook. The driver calls the typed methods below; each runs the hook of
    every middleware that overrides it, in chain order (reverse order for the "after" hooks
    ``post_turn`` and ``on_run_end``), with each middleware's failure policy applied."""

    def __init__(self, middleware: Iterable[Middleware] = ()) -> None:
        items = list(middleware)
        for m in items:
            if not isinstance(m, Middleware):
                raise ChainError(f"{m!r} is not a fsm_agent.Middleware instance")
            self._validate(m)
        self.middleware: tuple[Middleware, ...] = tuple(resolve_order(items))
        self._by_hook: dict[str, tuple[Middleware, ...]] = {
            h: tuple(m for m in self.middleware if _overrides(m, h)) for h in HOOKS
        }
        self.frozen = False
        self._compile()

    @staticmethod
    def _validate(m: Middleware) -> None:
        for hook in HOOKS:
            if not _overrides(m, hook):
                continue
            fn = getattr(m, hook)
            is_async = inspect.iscoroutinefunction(fn)
            if hook in ASYNC_ONLY and not is_async:
                raise ChainError(f"middleware {m.middleware_name!r}: {hook} must be 'async def' (it awaits call_next)")
            if hook in SYNC_ONLY and is_async:
                raise ChainError(f"middleware {m.middleware_name!r}: {hook} must be a plain 'def' "
                                 "(it runs for every streamed event)")
        policy = m.failure_policy
        try:
            FailurePolicy(policy)
        except ValueError:
            raise ChainError(f"middleware {m.middleware_name!r}: failure_policy must be 'propagate' or 'isolate', "
                             f"not {policy!r}") from None

    def _compile(self) -> None:
        """Bind every overridden hook once and compose the ``wrap_*`` onions."""
        by = self._by_hook
        self._pre_turn = tuple(_Hook(m, "pre_turn") for m in by["pre_turn"])
        self._on_tool_call = tuple(_Hook(m, "on_tool_call") for m in by["on_tool_call"])
        self._post_turn = tuple(_Hook(m, "post_turn") for m in reversed(by["post_turn"]))
        self._run_start = tuple(_Hook(m, "on_run_start") for m in by["on_run_start"])
        self._run_end = tuple(_Hook(m, "on_run_end") for m in reversed(by["on_run_end"]))
        self._events = tuple(_Hook(m, "on_model_event") for m in by["on_model_event"])
        self.model_call: Composed[MessageRequest, MessageResponse] = _compose(
            tuple(_Hook(m, "wrap_model_call") for m in by["wrap_model_call"]), "wrap_model_call")
        """``await chain.model_call(request, ctx, provider_call)``: the ``wrap_model_call`` layers around
        ``provider_call`` (first listed outermost); once per logical call, outside the provider's retries."""
        self.tool_call: Composed[ToolUseBlock, ToolResultMessage] = _compose(
            tuple(_Hook(m, "wrap_tool_call") for m in by["wrap_tool_call"]), "wrap_tool_call")
        """``await chain.tool_call(call, ctx, execute)``: the ``wrap_tool_call`` layers around ``execute``."""

    def freeze(self) -> None:
        """Fix the chain (called when the first run starts); later changes raise ChainError."""
        self.frozen = True

    def with_middleware(self, extra: Iterable[Middleware]) -> MiddlewareChain:
        """A new chain with ``extra`` appended (this one unchanged)."""
        if self.frozen:
            raise ChainError("the middleware chain is frozen: it cannot change after the first run started")
        return MiddlewareChain([*self.middleware, *extra])

    def hooks(self, hook: str) -> tuple[Middleware, ...]:
        """The middleware overriding ``hook``, in chain order (for descriptions and diagrams)."""
        return self._by_hook[hook]

    @property
    def filters_model_events(self) -> bool:
        """Whether any middleware overrides ``on_model_event`` (the driver skips the call otherwise)."""
        return bool(self._events)

    def __len__(self) -> int:
        return len(self.middleware)

    def describe(self) -> dict[str, list[str]]:
        """Hook name -> middleware names in execution order (for diagrams and ``middleware list``)."""
        out = {}
        for h in HOOKS:
            names = [m.middleware_name for m in self._by_hook[h]]
            if h in ("post_turn", "on_run_end"):
                names.reverse()
            out[h] = names
        return out

    # -- the phases' calls ---------------------------------------------------------------
    async def run_start(self, ctx: RunContext) -> None:
        """``on_run_start`` of each middleware, in chain order."""
        for h in self._run_start:
            await _call(h, "on_run_start", ctx)

    async def run_end(self, ctx: RunContext, result: RunResult) -> None:
        """``on_run_end`` of each middleware, in reverse chain order."""
        for h in self._run_end:
            await _call(h, "on_run_end", ctx, result)

    async def pre_turn(self, ctx: RunContext) -> None:
        """``pre_turn`` of each middleware, in chain order."""
        for h in self._pre_turn:
            await _call(h, "pre_turn", ctx)

    def model_event(self, event: StreamEvent, ctx: RunContext, start: int = 0) -> tuple[StreamEvent, ...]:
        """Pass a stream event through every ``on_model_event`` (from the ``start``-th on): the events
        to hand on, in order. ``()`` once one hides it; a hook that returns a tuple puts those events
        in its place, each passed through the hooks after it."""
        out: Any = event
        hooks = self._events
        for n in range(start, len(hooks)):
            h = hooks[n]
            try:
                out = h.fn(out, ctx)
            except (Signal, ReplayDivergence) as sig:  # StopRun from on_model_event ends the run as from any other hook
                stopped_by(sig, h.name)
                raise
            except Exception as exc:
                if h.isolate:
                    log.exception("middleware %r failed in on_model_event; isolated", h.name)
                    continue
                raise MiddlewareError(h.name, "on_model_event", exc) from exc
            if out is None:
                return ()
            if type(out) is tuple:
                return tuple(e for ev in out for e in self.model_event(ev, ctx, n + 1))
        return (out,)

    async def tool_decisions(self, call: ToolUseBlock, ctx: RunContext) -> list[tuple[str, ToolDecision]]:
        """Each middleware's decision on ``call`` in order, as (name, decision), stopping at a final one
        (Deny, AskApproval, Respond). ``Edit`` decisions are applied before asking the next middleware."""
        out: list[tuple[str, ToolDecision]] = []
        for h in self._on_tool_call:
            d = await _call(h, "on_tool_call", call, ctx)
            if d is None or d is _ISOLATED:
                continue
            out.append((h.name, d))
            if isinstance(d, Edit):
                call = evolve(call, input=dict(d.arguments), raw_input=None)
            if isinstance(d, (Deny, AskApproval, Respond)):
                break
        return out

    async def turn_decision(self, ctx: RunContext) -> tuple[str, TurnDecision] | None:
        """The first ``post_turn`` decision in reverse chain order, as (name, decision), or ``None``."""
        for h in self._post_turn:
            d = await _call(h, "post_turn", ctx)
            if d is not None and d is not _ISOLATED:
                return h.name, d
        return None


async def _call(h: _Hook, hook: str, *args: Any) -> Any:
    """Call a plain hook. A signal goes on; anything else (a ``ProviderError`` from a grader call
    included) is the middleware failing, under its failure policy."""
    try:
        result = h.fn(*args)
        if h.is_async:
            result = await result
        return result
    except (Signal, ReplayDivergence) as sig:
        stopped_by(sig, h.name)
        raise
    except Exception as exc:
        if h.isolate:
            log.exception("middleware %r failed in %s; isolated, continuing", h.name, hook)
            return _ISOLATED
        raise MiddlewareError(h.name, hook, exc) from exc


def _compose(layers: tuple[_Hook, ...], hook: str) -> Composed[Any, Any]:
    """The onion of ``layers`` (first = outermost) around the ``inner`` given at each call."""

    async def innermost(arg: Any, ctx: RunContext, inner: Inner[Any, Any]) -> Any:
        return await inner(arg)

    call: Composed[Any, Any] = innermost
    for h in reversed(layers):
        call = _layer(h, hook, call)
    return call


def _layer(h: _Hook, hook: str, nxt: Composed[Any, Any]) -> Composed[Any, Any]:
    fn = h.fn

    async def layer(arg: Any, ctx: RunContext, inner: Inner[Any, Any]) -> Any:
        entered = False

        async def call_next(a: Any) -> Any:
            nonlocal entered
            entered = True
            try:
                return await nxt(a, ctx, inner)
            except StopRun as sig:
                stopped_by(sig, None)  # from further in (an inner layer named itself; else not a middleware)
                raise

        try:
            return await fn(arg, call_next, ctx)
        except (Signal, ProviderError, MiddlewareError, ReplayDivergence) as sig:
            stopped_by(sig, h.name)
            raise
        except Exception as exc:
            if h.isolate and not entered:
                log.exception("middleware %r failed in %s; isolated, passing through", h.name, hook)
                return await nxt(arg, ctx, inner)
            # Failing after call_next ran, even an isolated layer cannot pass through (the inner call
            # would run twice): the failure is reported under this layer's name.
            raise MiddlewareError(h.name, hook, exc) from exc

    return layer


_ISOLATED = object()


def stopped_by(sig: BaseException, name: str | None) -> None:
    """Name the middleware a ``StopRun`` came from, once, as ``sig.middleware`` (the first hook it
    leaves; ``None`` when it came from inside a ``call_next``, e.g. a tool, and no layer raised it).
    Observers see it in the ``stop`` :class:`~fsm_agent.types.events.PolicyDecision`."""
    if isinstance(sig, StopRun) and "middleware" not in sig.__dict__:
        sig.middleware = name  # type: ignore[attr-defined]
