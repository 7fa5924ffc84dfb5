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
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from attrs import evolve

from .chain import MiddlewareChain
from .errors import ChainError
from .hooks import HookBus
from .machine.context import RunConfig, RunContext
from .machine.driver import Driver
from .middleware import Middleware
from .pricing import cost_usd
from .providers.base import Provider
from .tools.registry import Tool, ToolRegistry
from .types.messages import Message, SystemMessage, UserMessage
from .types.run import RunResult

__all__ = ["Agent"]


class Agent:
    """A governed agent.

    Args:
        provider: the model (any :class:`~fsm_agent.providers.Provider`).
        tools: tools (``@tool`` functions, or plain typed functions, wrapped on the fly).
        system_prompt: the system message put first in every new session, or ``None``.
        middleware: policy plugins; list order is wrapping order (first = outermost).
        observers: watchers (see :mod:`fsm_agent.hooks`).
        config: budgets and limits (:class:`RunConfig`; defaults from seed 000).

    Raises:
        ChainError: the middleware cannot form a chain (cycle, missing requirement, bad hook).
        ConfigurationError: duplicate tool names, an observer that is neither callable nor has ``on_*``.
    """

    def __init__(
        self,
        provider: Provider,
        *,
        tools: Iterable[Tool | Any] = (),
        system_prompt: str | None = None,
        middleware: Iterable[Middleware] = (),
        observers: Iterable[Any] = (),
        config: RunConfig | None = None,
    ) -> None:
        self.provider = provider
        self.tools = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        self.system_prompt = system_prompt
        self.chain = MiddlewareChain(middleware)
        self.hooks = HookBus(observers)
        self.config = config or RunConfig()

    @property
    def middleware(self) -> tuple[Middleware, ...]:
        """The chain in its resolved order."""
        return self.chain.middleware

    def add_middleware(self, *middleware: Middleware) -> None:
        """Append middleware before the first run.

        Raises:
            ChainError: the chain is frozen (a run already started), or the new chain is invalid.
        """
        if self.chain.frozen:
            raise ChainError("the middleware chain is frozen: it cannot change after the first run started")
        self.chain = self.chain.with_middleware(middleware)

    def _initial_messages(self, task: str | Message | Sequence[Message]) -> list[Message]:
        if isinstance(task, str):
            msgs: list[Message] = [UserMessage(task)]
        elif isinstance(task, Sequence):
            msgs = list(task)
        else:
            msgs = [task]
        if self.system_prompt and not any(isinstance(m, SystemMessage) for m in msgs):
            msgs.insert(0, SystemMessage(self.system_prompt))
        return msgs

    def new_context(self, messages: list[Message], *, session_id: str | None = None,
                    config: RunConfig | None = None) -> RunContext:
        return RunContext(
            session_id=session_id or uuid.uuid4().hex,
            config=config or self.config,
            provider=self.provider,
            tools=self.tools,
            transcript=messages,
        )

    def driver(self, ctx: RunContext) -> Driver:
        self.chain.freeze()
        return Driver(ctx, self.chain, self.hooks, cost_of=cost_usd)

    async def run(
        self,
        task: str | Message | Sequence[Message],
        *,
        session_id: str | None = None,
        config: RunConfig | None = None,
        **limits: Any,
    ) -> RunResult:
        """Run ``task`` (a user message, a message, or a whole history) to a StopReason.

        ``limits`` override :class:`RunConfig` fields for this run only
        (``max_iterations=5``, ``max_wall_clock=30.0`` ...).

        Never raises for what happens during the run: failures end in
        FAILED_RETRYABLE / FAILED_TERMINAL with the error in ``stop.error``.
        Cancelling the task records INTERRUPTED and re-raises ``CancelledError``.
        """
        cfg = config or self.config
        if limits:
            cfg = evolve(cfg, **limits)
        ctx = self.new_context(self._initial_messages(task), session_id=session_id, config=cfg)
        return await self.driver(ctx).run()

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
