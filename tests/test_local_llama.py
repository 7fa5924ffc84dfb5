"""End to end against the real local llama.cpp server with SmolLM2-135M (the embedded default).

Nothing here is mocked: the CLI starts its own server; the API tests share one started by the
``llama_server`` fixture. The model is tiny and unreliable at tasks, so assertions are about the
runtime's behaviour (real answers arrive, tool calls are executed with the model's own arguments,
every run ends in a typed StopReason with a clear detail), not about the model's intelligence.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from conftest import Recorder
from fsm_agent import Agent, RunConfig, StopReason
from fsm_agent.providers.constrained import tool_call_schema
from fsm_agent.tools.demo import calculator
from fsm_agent.types import MessageRequest, TextDelta, ToolResultMessage, ToolUseBlock, UserMessage

pytestmark = pytest.mark.llama


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fsm_agent.cli", "run", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_main_job_on_the_embedded_default() -> None:
    code, out, err = await cli("What is the capital of France? Answer in one short sentence.")
    assert code == 0, err
    assert out.strip(), "the local model printed no answer"
    assert "using the embedded local model" in err
    assert "local model ready" in err and "stopping local llama.cpp server" in err
    assert "stop: COMPLETED" in err
    assert "Traceback" not in err


async def test_calculator_run_passes_mid_turn_with_the_models_arguments(local_provider) -> None:
    """The model's own arguments reach the tool. SmolLM2-135M often answers instead of calling a
    tool, so the first call requires one (``tool_choice="required"`` leaves the constrained mode no
    final-answer branch): what is checked is the runtime, not the model's judgement."""
    result = await Agent(local_provider, tools=[calculator],
                         config=RunConfig(tool_choice="required", temperature=0.0, max_iterations=2,
                                          max_output_tokens=200)).run(
        "Use the calculator to compute 17 * 23.")
    assert result.stop.reason in (StopReason.PAUSED_BUDGET, StopReason.COMPLETED), result.stop.detail
    assert result.stop.detail
    calls = [b for m in result.messages if m.role == "assistant" for b in m.tool_calls]
    results = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert calls, "the constrained mode with a required tool produced no tool call"
    assert calls[0].name == "calculator"
    first_result = next(r for r in results if r.tool_call_id == calls[0].id)
    # the tool ran with exactly the arguments the model produced
    try:
        want = calculator(**calls[0].input)
        assert first_result.text == want and not first_result.is_error
    except (ValueError, TypeError) as exc:
        assert first_result.is_error and type(exc).__name__ in first_result.text




async def test_streaming_text_arrives_in_several_deltas(local_provider) -> None:
    rec = Recorder()
    result = await Agent(local_provider, observers=[rec], config=RunConfig(max_output_tokens=60)).run(
        "Write two sentences about the sea.")
    deltas = [e.event for e in rec.events if getattr(e, "event", None) and isinstance(e.event, TextDelta)]
    assert len(deltas) > 3
    assert "".join(d.text for d in deltas) == result.output
    assert result.stop.reason is StopReason.COMPLETED
    assert result.usage.input_tokens > 0 and not result.usage.estimated  # llama.cpp reports usage


async def test_constrained_mode_always_yields_a_valid_tool_call_or_answer(local_provider) -> None:
    req = MessageRequest("", (UserMessage("Compute 12 + 30 with the calculator."),), tools=(calculator.definition,),
                         max_tokens=80)
    for _ in range(3):
        resp = await local_provider.chat(req)
        if resp.tool_calls:
            (call,) = resp.tool_calls
            assert call.name == "calculator" and isinstance(call.input.get("expression"), str)
            assert call.provider_data == {"constrained": True}
        else:
            assert resp.text  # a final answer, never raw JSON left unparsed
            assert not resp.text.lstrip().startswith('{"final_answer"')


def test_constrained_schema_shape() -> None:
    schema = tool_call_schema(MessageRequest("", (), tools=(calculator.definition,)))
    assert [o["required"] for o in schema["anyOf"]] == [["final_answer"], ["tool", "arguments"]]
    assert schema["anyOf"][1]["properties"]["tool"] == {"type": "string", "enum": ["calculator"]}


async def test_tool_results_go_back_to_the_model(local_provider) -> None:
    call = ToolUseBlock("call_x", "calculator", {"expression": "6 * 7"})
    from fsm_agent.types import AssistantMessage

    req = MessageRequest("", (UserMessage("What is 6 * 7?"), AssistantMessage((call,)),
                              ToolResultMessage("call_x", "42", name="calculator")),
                         tools=(calculator.definition,), max_tokens=60)
    resp = await local_provider.chat(req)
    assert resp.stop_reason.value in {"end_turn", "tool_use", "max_tokens"}
