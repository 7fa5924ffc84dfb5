"""Across time and hosts (issue 22, item 2): a resume in a new process links to the segment it
continues; a sub-agent's run is a child of its parent's tool span; compaction, redaction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as G

from fsm_agent import Agent, MemoryStore, ScriptedProvider, SQLiteStore, StopReason, tool
from fsm_agent.orchestration.subagent import agent_tool
from fsm_agent.otel import names as N
from fsm_agent.providers import ProviderCapabilities, tool_call_response
from fsm_agent.types import ToolUseBlock

from ._approval import approval_agent_parts
from .conftest import Telemetry, every_string

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


async def test_an_approval_wait_and_a_resume_in_a_new_process_link_their_segments(
        telemetry: Telemetry, tmp_path: Path) -> None:
    path = str(tmp_path / "sessions.db")
    store = SQLiteStore(path)
    tools, middleware = approval_agent_parts()
    agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c_pay", "pay", {"invoice": 17}))]),
                  tools=tools, middleware=middleware, store=store, instrument=telemetry.settings())
    first = await agent.run("Pay invoice 17", session_id="s-approve")
    await store.close()
    assert first.stop.reason is StopReason.WAITING_HUMAN
    [seg1] = telemetry.named("invoke_agent")
    assert seg1.attributes[N.STOP_REASON] == "WAITING_HUMAN" and seg1.attributes[N.STOP_RESUMABLE] is True
    assert [e.name for e in seg1.events if e.name != N.EV_TRANSITION] == [N.EV_DECISION, N.EV_APPROVAL]
    assert not telemetry.named("execute_tool")  # nothing ran: the call waits for a person

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(HERE / "_resume_worker.py"), path, "s-approve", "c_pay"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.strip()]
    assert lines[-1] == {"stop": "COMPLETED"}
    spans = {s["name"]: s for s in lines[:-1]}
    seg2 = spans["invoke_agent fsm_agent"]
    # the same conversation; a new trace that links to the segment it continues
    assert seg2["attributes"][G.GEN_AI_CONVERSATION_ID] == "s-approve"
    assert seg2["attributes"][N.SEGMENT] == "resume"
    assert seg2["links"] == [{"trace_id": seg1.context.trace_id, "span_id": seg1.context.span_id,
                              "attributes": {N.SEGMENT: "continues"}}]
    pay = spans["execute_tool pay"]
    assert pay["parent"] == seg2["span_id"]
    assert pay["attributes"][G.GEN_AI_TOOL_CALL_ID] == "c_pay"
    assert pay["attributes"][N.TOOL_DECISION] == "approve" and pay["attributes"][N.TOOL_OUTCOME] == "completed"
    assert pay["attributes"][N.TOOL_EFFECT] == "side_effect"


async def test_a_sub_agents_run_is_a_child_of_the_parents_tool_span(telemetry: Telemetry) -> None:
    store = MemoryStore()
    child = Agent(ScriptedProvider(["Tokyo is sunny"]), store=store,
                  instrument=telemetry.settings(agent_name="researcher"))
    parent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c_ask", "research", {"task": "Tokyo?"})),
                                     "It is sunny"]),
                   tools=[agent_tool(child, name="research", description="Asks the researcher.")], store=store,
                   instrument=telemetry.settings(agent_name="lead"))
    result = await parent.run("Weather in Tokyo?")
    assert result.stop.reason is StopReason.COMPLETED
    [lead] = telemetry.named("invoke_agent lead")
    [researcher] = telemetry.named("invoke_agent researcher")
    [call] = telemetry.named("execute_tool research")
    assert call.parent is not None and call.parent.span_id == lead.context.span_id
    assert researcher.parent is not None and researcher.parent.span_id == call.context.span_id
    assert researcher.context.trace_id == lead.context.trace_id
    assert researcher.attributes[G.GEN_AI_CONVERSATION_ID] != lead.attributes[G.GEN_AI_CONVERSATION_ID]
    [child_chat] = telemetry.children(researcher)
    assert child_chat.name == "chat scripted"


async def test_a_compaction_is_an_event_with_its_level_and_sizes(telemetry: Telemetry) -> None:
    from fsm_agent_middleware.compaction import Compaction

    @tool
    def read_huge(path: str) -> str:
        "Reads a big file."
        return "\n".join(f"line {i} of {path}: " + "x" * 60 for i in range(400))

    store = MemoryStore()
    comp = Compaction(store=store, midturn_chars=5000)
    agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c_r", "read_huge", {"path": "big"})), "done"],
                                   capabilities=ProviderCapabilities(context_window=12000)),
                  tools=[read_huge, comp.artifact_tool()], middleware=[comp], store=store,
                  instrument=telemetry.settings())
    assert (await agent.run("Read big.")).stop.reason is StopReason.COMPLETED
    [root] = telemetry.named("invoke_agent")
    [ev] = [e for e in root.events if e.name == N.EV_COMPACTION]
    a = ev.attributes
    assert a["fsm_agent.compaction.level"] == "L3" and a["fsm_agent.compaction.trigger"] == "mid_turn"
    assert a["fsm_agent.compaction.tokens_before"] > a["fsm_agent.compaction.tokens_after"] > 0


SECRET = "tok-9f8e7d6c5b4a-very-secret"


async def test_with_content_capture_on_a_configured_secret_never_reaches_a_span(telemetry: Telemetry) -> None:
    from fsm_agent_middleware.redaction import Redaction

    @tool
    def lookup(token: str) -> str:
        "Looks a token up."
        return f"the token {token} belongs to Ada"

    echo = f"Your token {SECRET} belongs to Ada."
    agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c_l", "lookup", {"token": SECRET})), echo]),
                  tools=[lookup], system_prompt=f"Never reveal {SECRET}.",
                  middleware=[Redaction(literals=[SECRET], restore_in_tool_args=True)],
                  instrument=telemetry.settings(capture_content=True))
    result = await agent.run(f"Who owns {SECRET}?")
    assert result.stop.reason is StopReason.COMPLETED
    assert SECRET in result.messages[3].text  # the tool got (and returned) the original: the run is unchanged
    spans = telemetry.spans
    assert spans and all(SECRET not in text for s in spans for text in every_string(s))
    chats = sorted(telemetry.named("chat"), key=lambda s: s.start_time or 0)
    inputs = json.loads(chats[1].attributes[G.GEN_AI_INPUT_MESSAGES])
    assert [m["role"] for m in inputs] == ["user", "assistant", "tool"]
    assert "[REDACTED:secret:1]" in inputs[0]["parts"][0]["content"]
    assert "[REDACTED:secret" in chats[0].attributes[G.GEN_AI_SYSTEM_INSTRUCTIONS]
    assert "[REDACTED:secret" in chats[1].attributes[G.GEN_AI_OUTPUT_MESSAGES]
    [call] = telemetry.named("execute_tool")
    assert json.loads(call.attributes[G.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"token": "[REDACTED:secret:1]"}
    assert call.attributes[G.GEN_AI_TOOL_CALL_RESULT] == "the token [REDACTED:secret:1] belongs to Ada"


async def test_content_is_off_by_default_and_the_standard_variable_turns_it_on(telemetry: Telemetry,
                                                                               monkeypatch: Any) -> None:
    @tool
    def echo(text: str) -> str:
        "Echo."
        return text

    def agent() -> Agent:
        return Agent(ScriptedProvider([tool_call_response(("echo", {"text": "hello there"})), "bye"]), tools=[echo],
                     instrument=telemetry.settings())

    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    await agent().run("say hello", session_id="quiet")
    content_keys = {G.GEN_AI_INPUT_MESSAGES, G.GEN_AI_OUTPUT_MESSAGES, G.GEN_AI_SYSTEM_INSTRUCTIONS,
                    G.GEN_AI_TOOL_CALL_ARGUMENTS, G.GEN_AI_TOOL_CALL_RESULT}
    assert all(not content_keys & set(s.attributes) for s in telemetry.spans)
    assert all("hello there" not in t for s in telemetry.spans for t in every_string(s))
    telemetry.exporter.clear()
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
    await agent().run("say hello", session_id="loud")
    [call] = telemetry.named("execute_tool")
    assert json.loads(call.attributes[G.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"text": "hello there"}
    assert call.attributes[G.GEN_AI_TOOL_CALL_RESULT] == "hello there"
