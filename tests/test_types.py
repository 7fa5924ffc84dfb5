"""Every data type round-trips through JSON with the one converter; MessageRequest.extra is typed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_agent.errors import ExtraTypeError
from fsm_agent.types import (
    ApprovalRequested,
    AssistantMessage,
    AudioBlock,
    BudgetWarning,
    ContentBlock,
    ContentBlockEnd,
    ContentBlockStart,
    CostUpdate,
    ErrorEvent,
    ExtensionBlock,
    FileBlock,
    ImageBlock,
    Message,
    MessageComplete,
    MessageRequest,
    MessageResponse,
    MessageStart,
    ModelStopReason,
    ModelStreamEvent,
    ObserverEvent,
    OutputSchema,
    PendingAction,
    RefusalDelta,
    RunResult,
    RunStop,
    StopReason,
    StreamEvent,
    SystemMessage,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingConfig,
    ThinkingDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolDefinition,
    ToolFinished,
    ToolResultBlock,
    ToolResultMessage,
    ToolStarted,
    ToolUseBlock,
    TransitionEvent,
    Usage,
    UserImageMessage,
    UserMessage,
    dumps,
    loads,
)

CALL = ToolUseBlock("call_1", "f", {"a": [1, {"b": None}]}, None, {"id": "fc_1"})
BLOCKS = [
    TextBlock("héllo ✅", ({"type": "url_citation", "url": "https://x"},)),
    ImageBlock(data="aGk=", media_type="image/png"),
    ImageBlock(url="https://example.com/a.png", detail="high"),
    AudioBlock("UklGRg==", "wav"),
    FileBlock(file_id="file-1", filename="a.pdf"),
    CALL,
    ToolUseBlock("c2", "g", {}, raw_input='{"x": '),
    ToolResultBlock("call_1", (TextBlock("ok"),), is_error=True),
    ThinkingBlock("hmm", signature="sig", source="anthropic"),
    ThinkingBlock(redacted_data="opaque", source="anthropic"),
    ExtensionBlock("server_tool_use", {"id": "srvtoolu_1", "input": {"q": 1}}, "anthropic"),
]
MESSAGES = [
    SystemMessage("be brief"),
    UserMessage([TextBlock("look"), ImageBlock(url="https://x/y.png")]),
    UserImageMessage("aGk=", "image/png"),
    AssistantMessage(tuple(BLOCKS[:1]) + (CALL,), {"id": "msg_1"}),
    ToolResultMessage("call_1", "42", name="f", metadata={"synthetic": "unavailable"}),
]
RESPONSE = MessageResponse("id", "m", MESSAGES[3], ModelStopReason.TOOL_USE, "tool_calls", Usage(1, 2, 3, 4, 5, True),
                           "openai", None, {"system_fingerprint": "fp"})
EVENTS = [
    MessageStart("id", "m"), ContentBlockStart(0, "tool_use", "c", "f", {"k": 1}), ContentBlockEnd(0),
    TextDelta(0, "t"), ThinkingDelta(1, "r"), RefusalDelta("no"), ToolCallArgumentsDelta(0, "{"),
    ToolCallEnd(0, CALL), CostUpdate(Usage(1, 1), 0.5), MessageComplete(RESPONSE), ErrorEvent("timeout", "x"),
]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: type(b).__name__)
def test_blocks_round_trip(block: object) -> None:
    assert loads(dumps(block), ContentBlock) == block


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip(message: object) -> None:
    data = dumps(message)
    assert b'"role"' in data
    assert loads(data, Message) == message


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_stream_events_round_trip(event: object) -> None:
    assert loads(dumps(event), StreamEvent) == event


def test_requests_responses_runs_and_observer_events_round_trip() -> None:
    req = MessageRequest("m", MESSAGES, (ToolDefinition("f", "d", {"type": "object"}, True),), "auto", 10, 0.5, 0.9,
                         ("STOP",), ThinkingConfig(True, 1024, "low", "auto"), {"type": "json_object"}, False,
                         {"body": {"seed": 1}},
                         OutputSchema("answer", {"type": "object", "properties": {"n": {"type": "integer"}}},
                                      "the answer", False))
    assert loads(dumps(req), MessageRequest) == req
    assert loads(dumps(req), MessageRequest).output_schema == OutputSchema(
        "answer", {"type": "object", "properties": {"n": {"type": "integer"}}}, "the answer", False)
    assert loads(dumps(MessageRequest("m", ())), MessageRequest).output_schema is None
    assert loads(dumps(RESPONSE), MessageResponse) == RESPONSE
    stop = RunStop(StopReason.WAITING_HUMAN, "d", True, "ck", "MidTurn", (PendingAction(CALL, "approval"),), "approve",
                   ("ev1",), None, {"kind": "x"})
    run = RunResult("s", stop, "out", MESSAGES, Usage(1, 1), 2, 1, ModelStopReason.END_TURN, 0.1, 1.5)
    assert loads(dumps(run), RunResult) == run
    for ev in [TransitionEvent("s", 1, "PreTurn", "call_model", "Model", "r", 1.0),
               ModelStreamEvent("s", 1, TextDelta(0, "x")), ToolStarted("s", 1, CALL),
               ToolFinished("s", 1, CALL, MESSAGES[4], 0.1), BudgetWarning("s", 1, "tokens", 80, 100),
               ApprovalRequested("s", 2, (PendingAction(CALL, "approval required"),))]:
        assert loads(dumps(ev), ObserverEvent) == ev


@settings(max_examples=60, deadline=None)
@given(st.text(), st.dictionaries(st.text(min_size=1, max_size=5), st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text() | st.none(), max_size=4))
def test_arbitrary_text_and_arguments_round_trip(text: str, args: dict) -> None:
    m = AssistantMessage((TextBlock(text), ToolUseBlock("i", "n", args)))
    assert loads(dumps(m), Message) == m


def test_extra_is_typed() -> None:
    req = MessageRequest("m", (), extra={"store": True, "n": 3, "tools": ["x"]})
    assert req.get_extra("store", bool) is True
    assert req.get_extra("n", float) == 3
    assert req.get_extra("missing", str, "dflt") == "dflt"
    with pytest.raises(ExtraTypeError, match=r"extra\['n'\] must be str, got int"):
        req.get_extra("n", str)
    with pytest.raises(ExtraTypeError):
        req.get_extra("store", int)  # bool is not an int here
    with pytest.raises(KeyError):
        req.get_extra("missing", str)
    assert req.with_extra(previous_response_id="r1").extra["previous_response_id"] == "r1"


def test_usage_adds_and_keeps_the_estimate_flag() -> None:
    u = Usage(1, 2, 3, 4, 5) + Usage(10, 20, estimated=True)
    assert (u.input_tokens, u.output_tokens, u.total_tokens, u.estimated) == (11, 22, 33, True)


def test_string_content_is_wrapped() -> None:
    assert UserMessage("x").content == (TextBlock("x"),)
    assert AssistantMessage("y").text == "y"


def test_output_schema_name_is_checked() -> None:
    from fsm_agent.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="must match"):
        OutputSchema("has space", {"type": "object"})
    assert OutputSchema("ok_name-1").response_format() == {
        "type": "json_schema", "json_schema": {"name": "ok_name-1", "schema": {"type": "object"}, "strict": True}}
