"""Composition of middleware into per-phase chains (the contract is in :mod:`fsm_agent.middleware`).

Built once, at construction:

1. **Validate** each middleware: which hooks it overrides (compared with the
   base class's pass-through, so untouched hooks cost nothing at run time),
   and whether each overridden hook is ``async def`` where it must be and
   plain ``def`` where it must be. Errors name the plugin.
2. **Order**: list order is wrapping order (first listed = outermost).
   Declarative :class:`~fsm_agent.middleware.Ordering` constraints are
   applied with a stable topological sort in which the user's order breaks
   ties (like pydantic-ai's capability ordering). Cycles, duplicate names and
   missing requirements raise :class:`~fsm_agent.errors.ChainError`.
3. **Build** one list per hook, already filtered and ordered.

A chain is frozen after the first run starts; changing it then raises.
"""

from __future__ import annotations

import graphlib
import heapq
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import ChainError, MiddlewareError, ProviderError, Signal
from .middleware import ASYNC_ONLY, HOOKS, SYNC_ONLY, FailurePolicy, Middleware

if TYPE_CHECKING:
    from .machine.context import RunContext

__all__ = ["MiddlewareChain", "resolve_order"]

log = logging.getLogger("fsm_agent.chain")


def _overrides(mw: Middleware, hook: str) -> bool:
    impl = getattr(type(mw), hook, None)
    return impl is not None and impl is not getattr(Middleware, hook)


def resolve_order(items: Sequence[Middleware]) -> list[Middleware]:
    """Apply ordering constraints; user order breaks ties.

    Raises:
        ChainError: duplicate names, a missing requirement, an unknown position, or a cycle.
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


class MiddlewareChain:
    """Middleware composed per hook. Call the ``run_*`` methods from the driver."""

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
        self._async: dict[tuple[int, str], bool] = {
            (id(m), h): inspect.iscoroutinefunction(getattr(m, h)) for m in self.middleware for h in HOOKS
        }
        self.frozen = False

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

    def freeze(self) -> None:
        self.frozen = True

    def with_middleware(self, extra: Iterable[Middleware]) -> MiddlewareChain:
        """A new chain with ``extra`` appended (this one unchanged)."""
        if self.frozen:
            raise ChainError("the middleware chain is frozen: it cannot change after the first run started")
        return MiddlewareChain([*self.middleware, *extra])

    def hooks(self, hook: str) -> tuple[Middleware, ...]:
        return self._by_hook[hook]

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

    # -- invocation helpers ------------------------------------------------------
    async def _call(self, m: Middleware, hook: str, *args: Any) -> Any:
        try:
            result = getattr(m, hook)(*args)
            if self._async[(id(m), hook)]:
                result = await result
            return result
        except (Signal, ProviderError):
            raise
        except Exception as exc:
            if FailurePolicy(m.failure_policy) is FailurePolicy.ISOLATE:
                log.exception("middleware %r failed in %s; isolated, continuing", m.middleware_name, hook)
                return _ISOLATED
            raise MiddlewareError(m.middleware_name, hook, exc) from exc

    async def run_pre_turn(self, ctx: RunContext) -> None:
        for m in self._by_hook["pre_turn"]:
            await self._call(m, "pre_turn", ctx)

    async def run_lifecycle(self, hook: str, ctx: RunContext, *args: Any) -> None:
        items = self._by_hook[hook]
        if hook == "on_run_end":
            items = tuple(reversed(items))
        for m in items:
            await self._call(m, hook, ctx, *args)

    def model_event(self, event: Any, ctx: RunContext) -> Any:
        for m in self._by_hook["on_model_event"]:
            try:
                event = m.on_model_event(event, ctx)
            except Exception as exc:
                if FailurePolicy(m.failure_policy) is FailurePolicy.ISOLATE:
                    log.exception("middleware %r failed in on_model_event; isolated", m.middleware_name)
                    continue
                raise MiddlewareError(m.middleware_name, "on_model_event", exc) from exc
            if event is None:
                return None
        return event

    def wrap(self, hook: str, inner: Callable[[Any], Awaitable[Any]], ctx: RunContext) -> Callable[[Any], Awaitable[Any]]:
        """Compose ``hook`` (``wrap_model_call`` / ``wrap_tool_call``) around ``inner``; first listed is outermost."""
        call = inner
        for m in reversed(self._by_hook[hook]):
            call = self._layer(m, hook, call, ctx)
        return call

    def _layer(self, m: Middleware, hook: str, nxt: Callable[[Any], Awaitable[Any]], ctx: RunContext) -> Callable[[Any], Awaitable[Any]]:
        fn = getattr(m, hook)
        isolate = FailurePolicy(m.failure_policy) is FailurePolicy.ISOLATE

        async def layer(arg: Any) -> Any:
            entered = [False]

            async def guarded_next(a: Any) -> Any:
                entered[0] = True
                return await nxt(a)

            try:
                return await fn(arg, guarded_next, ctx)
            except (Signal, ProviderError):
                raise
            except MiddlewareError:
                raise
            except Exception as exc:
                if isolate and not entered[0]:
                    log.exception("middleware %r failed in %s; isolated, passing through", m.middleware_name, hook)
                    return await nxt(arg)
                if isolate:
                    raise
                raise MiddlewareError(m.middleware_name, hook, exc) from exc

        return layer

    async def tool_decisions(self, call: Any, ctx: RunContext) -> list[tuple[str, Any]]:
        """Each middleware's decision on ``call`` in order, as (name, decision), stopping at a final one.

        ``Edit`` decisions are applied before asking the next middleware.
        """
        from .middleware import AskApproval, Deny, Edit, Respond

        out: list[tuple[str, Any]] = []
        for m in self._by_hook["on_tool_call"]:
            d = await self._call(m, "on_tool_call", call, ctx)
            if d is None or d is _ISOLATED:
                continue
            out.append((m.middleware_name, d))
            if isinstance(d, Edit):
                from attrs import evolve

                call = evolve(call, input=dict(d.arguments), raw_input=None)
            if isinstance(d, (Deny, AskApproval, Respond)):
                break
        return out

    async def turn_decision(self, ctx: RunContext) -> tuple[str, Any] | None:
        for m in reversed(self._by_hook["post_turn"]):
            d = await self._call(m, "post_turn", ctx)
            if d is not None and d is not _ISOLATED:
                return m.middleware_name, d
        return None


_ISOLATED = object()
