"""The span tree of real runs, in the GenAI conventions (issue 22): every attribute is checked
against the conventions module's constants, never against strings copied by hand."""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as G
from opentelemetry.semconv.attributes import error_attributes as E
from opentelemetry.semconv.attributes import server_attributes as S
from opentelemetry.trace import SpanKind, StatusCode

from fsm_agent import (Agent, AskApproval, Deny, Middleware, RunConfig, ScriptedProvider, StopReason, StopRun, tool)
from fsm_agent.errors import RateLimitError
from fsm_agent.otel import names as N
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider, text_response, tool_call_response
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import ToolUseBlock, Usage

from .conftest import Telemetry


def barrier_tools() -> list[Any]:
    """Two tools that can only finish when both run at once (each waits for the other)."""
    arrived: dict[str, asyncio.Event] = {"left": asyncio.Event(), "right": asyncio.Event()}

    @tool
    async def left(x: int) -> str:
        "Left."
        arrived["left"].set()
        await asyncio.wait_for(arrived["right"].wait(), 5)
        return f"left {x}"

    @tool(effect="side_effect")
    async def right(x: int) -> str:
        "Right."
        arrived["right"].set()
        await asyncio.wait_for(arrived["left"].wait(), 5)
        return f"right {x}"

    return [left, right]


async def test_a_run_with_parallel_tools_is_one_invoke_agent_span_over_chat_and_execute_tool_spans(
        telemetry: Telemetry) -> None:
    calls = tool_call_response(ToolUseBlock("call_L", "left", {"x": 1}), ToolUseBlock("call_R", "right", {"x": 2}),
                               usage=Usage(100, 20))
    agent = Agent(ScriptedProvider([calls, text_response("done", usage=Usage(130, 7))]), tools=barrier_tools(),
                  instrument=telemetry.settings(agent_name="weather"), config=RunConfig(temperature=0.2))
    result = await agent.run("go", session_id="s-parallel")
    assert result.stop.reason is StopReason.COMPLETED

    [root] = telemetry.named("invoke_agent")
    assert root.name == "invoke_agent weather" and root.kind is SpanKind.INTERNAL and root.parent is None
    a = root.attributes
    assert a[G.GEN_AI_OPERATION_NAME] == G.GenAiOperationNameValues.INVOKE_AGENT.value
    assert a[G.GEN_AI_AGENT_NAME] == "weather"
    assert a[G.GEN_AI_CONVERSATION_ID] == "s-parallel"
    assert a[N.STOP_REASON] == "COMPLETED" and a[N.STOP_RESUMABLE] is False
    assert a[G.GEN_AI_USAGE_INPUT_TOKENS] == 230 and a[G.GEN_AI_USAGE_OUTPUT_TOKENS] == 27

    kids = telemetry.children(root)
    assert [s.name for s in kids] == ["chat scripted", "execute_tool left", "execute_tool right", "chat scripted"] \
        or [s.name for s in kids] == ["chat scripted", "execute_tool right", "execute_tool left", "chat scripted"]
    assert {s.trace_id for s in (c.context for c in kids)} == {root.context.trace_id}
    chat1, chat2 = kids[0], kids[3]
    for chat, resp_tokens in ((chat1, (100, 20)), (chat2, (130, 7))):
        c = chat.attributes
        assert chat.kind is SpanKind.CLIENT
        assert c[G.GEN_AI_OPERATION_NAME] == G.GenAiOperationNameValues.CHAT.value
        assert c[G.GEN_AI_PROVIDER_NAME] == "scripted"
        assert c[G.GEN_AI_REQUEST_MODEL] == "scripted" and c[G.GEN_AI_RESPONSE_MODEL] == "scripted"
        assert c[G.GEN_AI_RESPONSE_ID].startswith("resp_")
        assert (c[G.GEN_AI_USAGE_INPUT_TOKENS], c[G.GEN_AI_USAGE_OUTPUT_TOKENS]) == resp_tokens
        assert c[G.GEN_AI_REQUEST_TEMPERATURE] == 0.2
        assert N.PHASE not in c  # the Model phase's own call (a side call names its phase)
    assert chat1.attributes[G.GEN_AI_RESPONSE_FINISH_REASONS] == ("tool_calls",)
    assert chat2.attributes[G.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert chat1.attributes[N.TURN] == 1 and chat2.attributes[N.TURN] == 2

    tools = {s.attributes[G.GEN_AI_TOOL_NAME]: s for s in kids[1:3]}
    for name, call_id, effect in (("left", "call_L", "pure"), ("right", "call_R", "side_effect")):
        t = tools[name]
        assert t.kind is SpanKind.INTERNAL
        assert t.attributes[G.GEN_AI_OPERATION_NAME] == G.GenAiOperationNameValues.EXECUTE_TOOL.value
        assert t.attributes[G.GEN_AI_TOOL_CALL_ID] == call_id
        assert t.attributes[N.TOOL_EFFECT] == effect
        assert t.attributes[N.TOOL_OUTCOME] == "completed"
        assert t.status.status_code is StatusCode.UNSET
    # in parallel: each started before the other ended
    left, right = tools["left"], tools["right"]
    assert left.start_time < right.end_time and right.start_time < left.end_time

    # the FSM's own view: every transition, in order, on the segment's span
    moves = [(e.attributes["fsm_agent.transition.from"], e.attributes["fsm_agent.transition.trigger"],
              e.attributes["fsm_agent.transition.to"]) for e in root.events if e.name == N.EV_TRANSITION]
    assert moves == [("Idle", "start", "PreTurn"), ("PreTurn", "call_model", "Model"), ("Model", "tool_use", "MidTurn"),
                     ("MidTurn", "tools_done", "PostTurn"), ("PostTurn", "next_turn", "PreTurn"),
                     ("PreTurn", "call_model", "Model"), ("Model", "model_done", "PostTurn"),
                     ("PostTurn", "complete", "COMPLETED")]


async def test_the_providers_retry_with_retry_after_and_server_address_are_on_the_chat_span(
        telemetry: Telemetry) -> None:
    chunk = (b'data: {"id":"c1","object":"chat.completion.chunk","model":"m-2025","choices":[{"index":0,'
             b'"delta":{"role":"assistant","content":"hi"},"finish_reason":null}]}\n\n'
             b'data: {"id":"c1","object":"chat.completion.chunk","model":"m-2025","choices":[{"index":0,'
             b'"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
             b"data: [DONE]\n\n")
    limited = RecordedResponse(429, b'{"error":{"message":"Rate limit reached","type":"requests"}}',
                               headers={"Retry-After": "2"})
    server = ReplayServer([limited, RecordedResponse(200, chunk, "text/event-stream")])
    base = await server.start()

    async def no_wait(_seconds: float) -> None:
        await asyncio.sleep(0)

    provider = create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="k",
                                                                   retry=RetryPolicy(sleep=no_wait)))
    try:
        agent = Agent(provider, instrument=telemetry.settings(), config=RunConfig(max_output_tokens=64))
        result = await agent.run("hello")
    finally:
        await provider.aclose()
        await server.close()
    assert result.stop.reason is StopReason.COMPLETED
    [chat] = telemetry.named("chat")
    a = chat.attributes
    assert chat.name == "chat m"
    assert a[S.SERVER_ADDRESS] == "127.0.0.1" and a[S.SERVER_PORT] == int(base.rsplit(":", 1)[1].split("/")[0])
    assert a[G.GEN_AI_PROVIDER_NAME] == "openai-compatible"
    assert a[G.GEN_AI_RESPONSE_MODEL] == "m-2025" and a[G.GEN_AI_RESPONSE_ID] == "c1"
    assert a[G.GEN_AI_REQUEST_MAX_TOKENS] == 64
    [retry] = [e for e in chat.events if e.name == N.EV_RETRY]
    assert retry.attributes[E.ERROR_TYPE] == "rate_limited"
    assert retry.attributes["http.response.status_code"] == 429
    assert retry.attributes["fsm_agent.retry.delay_s"] == 2.0 and retry.attributes["fsm_agent.retry.server_hint"]
    assert retry.attributes["fsm_agent.retry.layer"] == "provider"
    assert chat.status.status_code is StatusCode.UNSET  # the call succeeded after the retry


async def test_a_failed_model_call_has_error_type_from_the_taxonomy_and_an_error_status(
        telemetry: Telemetry) -> None:
    agent = Agent(ScriptedProvider([RateLimitError("slow down", status=429, retry_after=30.0, provider="scripted")]),
                  instrument=telemetry.settings())
    result = await agent.run("hello")
    assert result.stop.reason is StopReason.FAILED_RETRYABLE
    [chat] = telemetry.named("chat")
    assert chat.attributes[E.ERROR_TYPE] == "rate_limited"
    assert chat.status.status_code is StatusCode.ERROR and "slow down" in (chat.status.description or "")
    [root] = telemetry.named("invoke_agent")
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes[N.STOP_REASON] == "FAILED_RETRYABLE" and root.attributes[N.STOP_RESUMABLE] is True
    assert root.attributes[E.ERROR_TYPE] == "rate_limited"
    durations = telemetry.metrics()["gen_ai.client.operation.duration"]
    assert [p.attributes.get(E.ERROR_TYPE) for p in durations] == ["rate_limited"]


async def test_the_retry_plugin_retries_a_whole_call_each_attempt_its_own_chat_span(telemetry: Telemetry) -> None:
    from fsm_agent_middleware.retry import RetryFallback

    provider = ScriptedProvider([RateLimitError("busy", status=429, retry_after=0.01, provider="scripted"), "ok"])
    agent = Agent(provider, middleware=[RetryFallback(max_attempts=2)], instrument=telemetry.settings())
    result = await agent.run("hello")
    assert result.stop.reason is StopReason.COMPLETED
    chats = sorted(telemetry.named("chat"), key=lambda s: s.start_time or 0)
    assert [c.status.status_code for c in chats] == [StatusCode.ERROR, StatusCode.UNSET]
    assert chats[0].attributes[E.ERROR_TYPE] == "rate_limited"
    [root] = telemetry.named("invoke_agent")
    [retry] = [e for e in root.events if e.name == N.EV_RETRY]
    assert retry.attributes["fsm_agent.retry.layer"] == "retry"
    assert retry.attributes["fsm_agent.retry.server_hint"] is True
    assert retry.attributes["fsm_agent.retry.delay_s"] == 0.01


async def test_failed_denied_and_asked_tool_calls_carry_their_outcome_and_the_deciding_plugin(
        telemetry: Telemetry) -> None:
    @tool
    def boom() -> str:
        "Fails."
        raise ValueError("nope")

    @tool
    def wire(amount: int) -> str:
        "Sends money."
        return "sent"

    @tool
    def fine() -> str:
        "Fine."
        return "ok"

    class Policy(Middleware):
        name = "policy"

        def on_tool_call(self, call: Any, ctx: Any) -> Any:
            if call.name == "wire":
                return Deny("no wires on Sundays")
            if call.name == "fine" and ctx.turn > 1:
                return AskApproval("needs a look")
            return None

    script = [tool_call_response(ToolUseBlock("c_boom", "boom", {}), ToolUseBlock("c_wire", "wire", {"amount": 5}),
                                 ToolUseBlock("c_fine", "fine", {})),
              tool_call_response(ToolUseBlock("c_fine2", "fine", {}))]
    agent = Agent(ScriptedProvider(script), tools=[boom, wire, fine], middleware=[Policy()],
                  instrument=telemetry.settings())
    result = await agent.run("go")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    spans = {s.attributes[G.GEN_AI_TOOL_CALL_ID]: s for s in telemetry.named("execute_tool")}
    assert set(spans) == {"c_boom", "c_wire", "c_fine"}  # the asked call waits: it ran nowhere yet
    assert spans["c_boom"].attributes[N.TOOL_OUTCOME] == "failed"
    assert spans["c_boom"].attributes[E.ERROR_TYPE] == "exception"
    assert spans["c_boom"].status.status_code is StatusCode.ERROR
    assert spans["c_wire"].attributes[N.TOOL_OUTCOME] == "denied"
    assert spans["c_fine"].attributes[N.TOOL_OUTCOME] == "completed"
    [root] = telemetry.named("invoke_agent")
    decisions = [dict(e.attributes) for e in root.events if e.name == N.EV_DECISION]
    assert [(d["fsm_agent.middleware"], d["fsm_agent.decision"], d[G.GEN_AI_TOOL_CALL_ID]) for d in decisions] == [
        ("policy", "deny", "c_wire"), ("policy", "ask", "c_fine2")]
    assert "fsm_agent.decision.reason" not in decisions[0]  # words are content: off by default
    [approval] = [e for e in root.events if e.name == N.EV_APPROVAL]
    assert approval.attributes["fsm_agent.pending.call_ids"] == ("c_fine2",)
    assert approval.attributes["fsm_agent.pending.tools"] == ("fine",)
    assert root.attributes[N.STOP_REASON] == "WAITING_HUMAN" and root.attributes[N.STOP_RESUMABLE] is True
    calls = {(p.attributes[G.GEN_AI_TOOL_NAME], p.attributes[N.TOOL_OUTCOME]): p.value
             for p in telemetry.metrics()[N.METRIC_TOOL_CALLS]}
    assert calls == {("boom", "failed"): 1, ("wire", "denied"): 1, ("fine", "completed"): 1}
    stops = {(p.attributes[N.STOP_REASON], p.attributes[N.STOP_RESUMABLE]): p.value
             for p in telemetry.metrics()[N.METRIC_STOPS]}
    assert stops == {("WAITING_HUMAN", True): 1}


async def test_a_stop_raised_by_a_plugin_is_a_decision_naming_it(telemetry: Telemetry) -> None:
    class Guard(Middleware):
        name = "guard"

        def pre_turn(self, ctx: Any) -> None:
            if ctx.turn >= 1:
                raise StopRun(StopReason.PAUSED_BUDGET, "enough for today")

    agent = Agent(ScriptedProvider([tool_call_response(("t", {}))]), tools=[tool(lambda: "x", name="t",
                                                                                   description="T.")],
                  middleware=[Guard()], instrument=telemetry.settings())
    result = await agent.run("go")
    assert result.stop.reason is StopReason.PAUSED_BUDGET
    [root] = telemetry.named("invoke_agent")
    [stop] = [e for e in root.events if e.name == N.EV_DECISION]
    assert stop.attributes["fsm_agent.middleware"] == "guard" and stop.attributes["fsm_agent.decision"] == "stop"
    assert stop.attributes[N.STOP_REASON] == "PAUSED_BUDGET" and stop.attributes["fsm_agent.decision.hook"] == "PreTurn"


async def test_cost_tokens_and_duration_metrics_follow_the_conventions(telemetry: Telemetry) -> None:
    agent = Agent(ScriptedProvider([text_response("hi", usage=Usage(1000, 100), model="gpt-4o-mini")],
                                   model="gpt-4o-mini"), instrument=telemetry.settings())
    result = await agent.run("hello")
    assert result.cost_usd is not None and result.cost_usd > 0
    m = telemetry.metrics()
    tokens = {p.attributes[G.GEN_AI_TOKEN_TYPE]: p.sum for p in m["gen_ai.client.token.usage"]}
    assert tokens == {G.GenAiTokenTypeValues.INPUT.value: 1000, G.GenAiTokenTypeValues.OUTPUT.value: 100}
    for p in m["gen_ai.client.token.usage"] + m["gen_ai.client.operation.duration"]:
        assert p.attributes[G.GEN_AI_OPERATION_NAME] == "chat"
        assert p.attributes[G.GEN_AI_REQUEST_MODEL] == "gpt-4o-mini"
        assert p.attributes[G.GEN_AI_PROVIDER_NAME] == "scripted"
    [cost] = m[N.METRIC_COST]
    assert abs(cost.value - result.cost_usd) < 1e-12
    [root] = telemetry.named("invoke_agent")
    assert root.attributes[N.COST_USD] == result.cost_usd


async def test_turned_on_for_the_process_and_off_for_one_agent(telemetry: Telemetry) -> None:
    import fsm_agent

    fsm_agent.instrument(telemetry.settings(agent_name="everyone"))
    await Agent(ScriptedProvider(["a"])).run("x", session_id="traced")
    await Agent(ScriptedProvider(["b"]), instrument=False).run("x", session_id="dark")
    assert [s.attributes[G.GEN_AI_CONVERSATION_ID] for s in telemetry.named("invoke_agent")] == ["traced"]
    fsm_agent.otel.uninstrument()
    await Agent(ScriptedProvider(["c"])).run("x", session_id="after")
    assert [s.attributes[G.GEN_AI_CONVERSATION_ID] for s in telemetry.named("invoke_agent")] == ["traced"]


async def test_the_run_span_is_a_child_of_the_callers_span(telemetry: Telemetry) -> None:
    tracer = telemetry.tracer_provider.get_tracer("caller")
    with tracer.start_as_current_span("request") as outer:
        await Agent(ScriptedProvider(["a"]), instrument=telemetry.settings()).run("x")
    [root] = telemetry.named("invoke_agent")
    assert root.parent is not None and root.parent.span_id == outer.get_span_context().span_id
