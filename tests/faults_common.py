"""Shared pieces of the fault-injection suite (tests/test_faults_*.py) and bench/faults.py.

* :func:`act_tool` — a tool of a chosen effect that records each real execution as one line
  (its idempotency key) in a counter file: the number of lines is how often the effect happened.
* :func:`audit` — what a stopped or finished session's transcript says: tool calls without exactly
  one result, and results that tell the model a call did not run when it did (a lie).
* :func:`provider` — the real OpenAI HTTP provider pointed at a :class:`StrictServer`.
* :func:`finish` — resume a session until it is terminal, deciding as a careful person would
  (a call whose outcome is unknown is answered with its real result when the counter shows the
  effect happened, approved otherwise).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fsm_agent import Agent, Middleware, RunConfig, ToolContext, create_provider, tool
from fsm_agent.control import Decision
from fsm_agent.providers import ProviderConfig
from fsm_agent.store.sessions import load_session
from fsm_agent.tools.execution import idempotency_key
from fsm_agent.types import AssistantMessage, RunResult, StopReason, ToolResultMessage

EFFECTS = ("pure", "idempotent", "side_effect")

LIE_MARKERS = ("did not run", "do not assume it ran", "not run", "cancelled")
"""Phrases that tell the model a call did not happen."""


def executions(counter: Path) -> list[str]:
    """The idempotency keys of every real execution, in order."""
    return counter.read_text().split() if counter.exists() else []


def act_tool(effect: str, counter: Path, *, before: Callable[[ToolContext], Any] | None = None,
             after: Callable[[ToolContext], Any] | None = None, compensated: Path | None = None,
             name: str = "act") -> Any:
    """A tool ``act(n)`` of ``effect``; each execution appends its idempotency key to ``counter``
    (flushed and fsynced: a SIGKILL right after it keeps it). ``before`` / ``after`` run around the
    effect (awaited when they return an awaitable); ``compensated`` gets a line per ``on_compensate``."""

    async def act(n: int, ctx: ToolContext) -> str:
        """Do the thing once.

        Args:
            n: which thing.
        """
        if before is not None:
            out = before(ctx)
            if asyncio.iscoroutine(out):
                await out
        with open(counter, "a") as f:
            f.write(ctx.idempotency_key + "\n")
            f.flush()
            os.fsync(f.fileno())
        if after is not None:
            out = after(ctx)
            if asyncio.iscoroutine(out):
                await out
        return f"done {n}"

    t = tool(effect=effect, name=name)(act)
    if compensated is not None:
        @t.on_compensate
        def _undo(arguments: dict, result: Any, ctx: ToolContext) -> None:
            with open(compensated, "a") as f:
                f.write(ctx.idempotency_key + "\n")
    return t


def provider(base_url: str) -> Any:
    """The real OpenAI Chat Completions provider against ``base_url`` (no retries: a 400 is final)."""
    return create_provider("openai", ProviderConfig(base_url=base_url, api_key="x", model="m"))


def repair() -> Middleware:
    from fsm_agent_middleware.repair import MessageRepair

    return MessageRepair()


def audit(messages: Sequence[Any], session_id: str, counter: Path | None = None) -> dict[str, Any]:
    """``unanswered``: tool calls without exactly one result (plus results without a call);
    ``lies``: results saying a call did not run (or was cancelled) for a call whose effect the
    counter shows; ``calls``: every call id; ``unknown`` / ``not_run``: synthetic results."""
    calls: list[str] = []
    results: dict[str, list[ToolResultMessage]] = {}
    for m in messages:
        if isinstance(m, AssistantMessage):
            calls += [c.id for c in m.tool_calls]
        elif isinstance(m, ToolResultMessage):
            results.setdefault(m.tool_call_id, []).append(m)
    unanswered = sum(1 for c in calls if len(results.get(c, ())) != 1) + sum(1 for r in results if r not in calls)
    ran = set(executions(counter)) if counter is not None else set()
    lies = []
    for cid, rs in results.items():
        if idempotency_key(session_id, cid) not in ran:
            continue
        for r in rs:
            said = r.text.lower()
            if (r.metadata or {}).get("synthetic") == "not_run" or any(k in said for k in LIE_MARKERS):
                lies.append((cid, r.text))
    synth = [(r.metadata or {}).get("synthetic") for rs in results.values() for r in rs]
    return {"calls": calls, "unanswered": unanswered, "lies": lies,
            "unknown": synth.count("interrupted"), "not_run": synth.count("not_run")}


async def stored_transcript(store: Any, session_id: str) -> list[Any]:
    loaded = await load_session(store, session_id)
    assert loaded is not None
    return loaded.transcript


async def finish(agent: Agent, session_id: str, counter: Path | None, *, max_resumes: int = 4,
                 confirm_cancel: bool = False) -> tuple[RunResult, int]:
    """Resume until the session is terminal (or no longer resumable); returns the last result and
    the number of a person's decisions it took."""
    decisions_made = 0
    decisions: dict[str, Decision] = {}
    result: RunResult | None = None
    for _ in range(max_resumes):
        result = await agent.resume(session_id, decisions=decisions or None, confirm_cancel=confirm_cancel)
        if result.stop.reason is not StopReason.WAITING_HUMAN or result.stop.required_decision == "confirm_cancel":
            if result.stop.required_decision == "confirm_cancel" and not confirm_cancel:
                confirm_cancel = True
                decisions_made += 1
                continue
            break
        ran = set(executions(counter)) if counter is not None else set()
        decisions = {}
        for p in result.stop.pending_actions:
            if p.reason == "unknown_outcome" and idempotency_key(session_id, p.call.id) in ran:
                decisions[p.call.id] = Decision.respond(f"done {p.call.input.get('n')}")
            else:
                decisions[p.call.id] = Decision.approve()
        decisions_made += len(decisions)
    assert result is not None
    return result, decisions_made


def agent_for(base_url: str, store: Any, tools: Sequence[Any], *, middleware: Sequence[Any] = (),
              stream: bool = False, lease_ttl: float = 30.0, control_poll: float = 0.05, **kw: Any) -> Agent:
    return Agent(provider(base_url), tools=list(tools), middleware=list(middleware), store=store,
                 config=RunConfig(stream=stream, max_iterations=kw.pop("max_iterations", 20)),
                 lease_ttl=lease_ttl, control_poll=control_poll, **kw)
