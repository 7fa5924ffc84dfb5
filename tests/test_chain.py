"""Chain rules: list order is wrapping order, before in order / after in reverse, declarative
ordering, failure policies, decisions, sync and async hooks, stream-event filters, run-scoped state."""

from __future__ import annotations

from typing import Any

import pytest

from fsm_agent import (
    Agent,
    Allow,
    Complete,
    Continue,
    Deny,
    Edit,
    Middleware,
    Ordering,
    Respond,
    ScriptedProvider,
    StopReason,
    tool,
)
from fsm_agent.chain import MiddlewareChain
from fsm_agent.errors import ChainError
from fsm_agent.providers import tool_call_response
from fsm_agent.types import TextDelta, UserMessage

LOG: list[str] = []


@tool
def echo(text: str) -> str:
    """Echo."""
    LOG.append(f"tool:{text}")
    return text


class Layer(Middleware):
    def __init__(self, tag: str, *, async_hooks: bool = False) -> None:
        self.tag = tag
        self.async_hooks = async_hooks

    @property
    def middleware_name(self) -> str:  # several instances of one class in a chain
        return self.tag

    def pre_turn(self, ctx: Any) -> None:
        LOG.append(f"pre:{self.tag}")

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        LOG.append(f"model>{self.tag}")
        r = await call_next(request)
        LOG.append(f"model<{self.tag}")
        return r

    async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
        LOG.append(f"tool>{self.tag}")
        r = await call_next(call)
        LOG.append(f"tool<{self.tag}")
        return r

    def post_turn(self, ctx: Any) -> None:
        LOG.append(f"post:{self.tag}")


class AsyncLayer(Layer):
    async def pre_turn(self, ctx: Any) -> None:  # type: ignore[override]
        LOG.append(f"apre:{self.tag}")


@pytest.fixture(autouse=True)
def _clear():
    LOG.clear()


async def test_list_order_is_wrapping_order() -> None:
    agent = Agent(ScriptedProvider([tool_call_response(("echo", {"text": "x"})), "done"]), tools=[echo],
                  middleware=[Layer("1"), AsyncLayer("2"), Layer("3")])
    await agent.run("go")
    first_turn = LOG[:LOG.index("post:3") + 3]
    assert first_turn == ["pre:1", "apre:2", "pre:3",
                          "model>1", "model>2", "model>3", "model<3", "model<2", "model<1",
                          "tool>1", "tool>2", "tool>3", "tool:x", "tool<3", "tool<2", "tool<1",
                          "post:3", "post:2", "post:1"]


class Outer(Middleware):
    ordering = Ordering(position="outermost")


class Inner(Middleware):
    ordering = Ordering(position="innermost")


class NeedsOuter(Middleware):
    ordering = Ordering(requires=("Outer",), wrapped_by=("Outer",))


class WrapsNeeds(Middleware):
    ordering = Ordering(wraps=("NeedsOuter",))


def test_declared_order_wins_and_user_order_breaks_ties() -> None:
    chain = MiddlewareChain([Inner(), NeedsOuter(), WrapsNeeds(), Outer()])
    assert [m.middleware_name for m in chain.middleware] == ["Outer", "WrapsNeeds", "NeedsOuter", "Inner"]
    chain = MiddlewareChain([Layer("b"), Layer("a"), Inner(), Layer("c")])
    assert [m.middleware_name for m in chain.middleware] == ["b", "a", "c", "Inner"]


class Judge(Middleware):
    ordering = Ordering(conflicts={"Outer": "both decide when the run is complete"})


class Loner(Middleware):
    ordering = Ordering(conflicts=("Inner",))


def test_a_declared_conflict_is_refused_whatever_the_order() -> None:
    for items in ([Judge(), Outer()], [Outer(), Judge()]):
        with pytest.raises(ChainError, match="middleware 'Judge' cannot be in one chain with 'Outer': both decide "
                                             "when the run is complete; remove one of them"):
            MiddlewareChain(items)
    with pytest.raises(ChainError, match="middleware 'Loner' cannot be in one chain with 'Inner'; remove one"):
        MiddlewareChain([Inner(), Loner()])
    assert [m.middleware_name for m in MiddlewareChain([Judge(), Loner()]).middleware] == [
        "Judge", "Loner"]  # a conflict with a name that is absent is no conflict
    assert Ordering(conflicts={"a": "why"}).conflicts == (("a", "why"),)


class Boom(Middleware):
    def __init__(self, policy: str) -> None:
        self.failure_policy = policy  # type: ignore[misc]

    def on_tool_call(self, call: Any, ctx: Any) -> None:
        raise KeyError("broken policy")

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        if ctx.turn == 1:
            raise ValueError("broken before call_next")
        return await call_next(request)


async def test_isolate_logs_and_continues_propagate_fails_closed(caplog: pytest.LogCaptureFixture) -> None:
    script = lambda: [tool_call_response(("echo", {"text": "x"})), "done"]  # noqa: E731
    isolated = await Agent(ScriptedProvider(script()), tools=[echo], middleware=[Boom("isolate")]).run("go")
    assert isolated.stop.reason is StopReason.COMPLETED and LOG == ["tool:x"]
    assert "failed in on_tool_call; isolated" in caplog.text and "failed in wrap_model_call; isolated" in caplog.text
    LOG.clear()
    closed = await Agent(ScriptedProvider(script()), tools=[echo], middleware=[Boom("propagate")]).run("go")
    assert closed.stop.reason is StopReason.FAILED_TERMINAL
    assert closed.stop.detail == "middleware 'Boom' failed in wrap_model_call: ValueError: broken before call_next"
    assert LOG == []


class EditThenDeny(Middleware):
    def __init__(self, decision: Any) -> None:
        self.decision = decision

    @property
    def middleware_name(self) -> str:
        return f"d{id(self)}"

    def on_tool_call(self, call: Any, ctx: Any) -> Any:
        LOG.append(f"saw:{call.input['text']}")
        return self.decision


async def test_tool_decisions_compose_edits_and_stop_at_the_first_final_one() -> None:
    chain = [EditThenDeny(Edit({"text": "edited"})), EditThenDeny(Allow()), EditThenDeny(None),
             EditThenDeny(Deny("no")), EditThenDeny(Respond("never asked"))]
    result = await Agent(ScriptedProvider([tool_call_response(("echo", {"text": "orig"})), "done"]), tools=[echo],
                         middleware=chain).run("go")
    assert LOG == ["saw:orig", "saw:edited", "saw:edited", "saw:edited"]
    res = next(m for m in result.messages if m.role == "tool")
    assert res.is_error and res.text.endswith(": no")
    LOG.clear()
    result = await Agent(ScriptedProvider([tool_call_response(("echo", {"text": "orig"})), "done"]), tools=[echo],
                         middleware=[EditThenDeny(Edit({"text": "edited"}))]).run("go")
    assert LOG == ["saw:orig", "tool:edited"]
    LOG.clear()
    result = await Agent(ScriptedProvider([tool_call_response(("echo", {"text": "orig"})), "done"]), tools=[echo],
                         middleware=[EditThenDeny(Respond("answered by policy"))]).run("go")
    assert LOG == ["saw:orig"] and next(m for m in result.messages if m.role == "tool").text == "answered by policy"


class Upper(Middleware):
    def on_model_event(self, event: Any, ctx: Any) -> Any:
        if isinstance(event, TextDelta):
            return TextDelta(event.index, event.text.upper())
        return event


class HideDeltas(Middleware):
    def on_model_event(self, event: Any, ctx: Any) -> Any:
        return None if isinstance(event, TextDelta) else event


async def test_stream_event_filters_change_what_observers_see_not_the_answer() -> None:
    seen: list[str] = []
    obs = lambda e: seen.append(e.event.text) if getattr(e, "event", None) is not None and isinstance(e.event, TextDelta) else None  # noqa: E731
    r = await Agent(ScriptedProvider(["hello"]), middleware=[Upper()], observers=[obs]).run("x")
    assert seen == ["HELLO"] and r.output == "hello"
    seen.clear()
    await Agent(ScriptedProvider(["hello"]), middleware=[HideDeltas(), Upper()], observers=[obs]).run("x")
    assert seen == []


class Verify(Middleware):
    def post_turn(self, ctx: Any) -> Any:
        state = ctx.state(self)
        state["n"] = state.get("n", 0) + 1
        if "42" in ctx.last_response.text:
            return Complete(evidence=(f"checked {state['n']} answers",), detail="answer verified")
        return Continue(UserMessage("Check again: the answer must be a number."), reason="verifier rejected")


async def test_post_turn_decisions_and_run_scoped_state() -> None:
    agent = Agent(ScriptedProvider(["maybe", "42"]), middleware=[Verify()])
    r = await agent.run("answer?")
    assert r.stop.reason is StopReason.COMPLETED
    assert r.stop.detail == "answer verified (decided by Verify)"
    assert r.stop.evidence_refs == ("checked 2 answers",)
    assert [m.text for m in r.messages][-2] == "Check again: the answer must be a number."
    r2 = await Agent(ScriptedProvider(["42"]), middleware=[Verify()]).run("again")
    assert r2.stop.evidence_refs == ("checked 1 answers",)  # state does not leak between runs


async def test_observers_see_the_result_of_a_denied_call() -> None:
    from fsm_agent.types import ToolFinished, ToolStarted

    events: list[Any] = []
    await Agent(ScriptedProvider([tool_call_response(("echo", {"text": "x"})), "done"]), tools=[echo],
                middleware=[EditThenDeny(Deny("blocked here"))], observers=[events.append]).run("go")
    finished = [e for e in events if isinstance(e, ToolFinished)]
    assert [e.result.text.endswith(": blocked here") for e in finished] == [True]
    assert finished[0].duration_s == 0.0 and not [e for e in events if isinstance(e, ToolStarted)]
    assert LOG == ["saw:x"]  # the tool never ran
