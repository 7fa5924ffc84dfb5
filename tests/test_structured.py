"""Structured output: parse_output finds and checks the answer, the error text says what was wrong,
structured_call repairs once and then stops with a typed error."""

from __future__ import annotations

import orjson
import pytest

from fsm_agent import OutputSchema, ScriptedProvider, StructuredOutputError, StructuredResult, structured_call
from fsm_agent.errors import ConfigurationError, RunError
from fsm_agent.providers.scripted import text_response, tool_call_response
from fsm_agent.structured import parse_output, repair_message, validate_value
from fsm_agent.types import (
    AssistantMessage,
    MessageRequest,
    MessageResponse,
    ModelStopReason,
    TextBlock,
    ToolUseBlock,
    UserMessage,
)

ORDER = OutputSchema("order", {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "zip": {"type": "string"}},
                     "required": ["name", "zip"]},
        "items": {"type": "array", "items": {
            "type": "object", "properties": {"sku": {"type": "string"}, "price": {"type": "number"}},
            "required": ["sku", "price"]}},
    },
    "required": ["customer", "items"],
})
GOOD = {"customer": {"name": "Ada", "zip": "10115"}, "items": [{"sku": "a1", "price": 3.5}, {"sku": "b2", "price": 10}]}
REQ = MessageRequest("m", (UserMessage("Extract the order."),))


def check(text: str, schema: OutputSchema = ORDER) -> StructuredResult:
    return parse_output(text_response(text), schema)


# ---------------------------------------------------------------------------- parse and validate
def test_valid_answer() -> None:
    raw = orjson.dumps(GOOD).decode()
    result = check(raw)
    assert result == StructuredResult(GOOD, None, raw) and result.ok


def test_wrong_type_at_a_nested_path() -> None:
    bad = {**GOOD, "items": [{"sku": "a1", "price": 3.5}, {"sku": "b2", "price": "ten"}]}
    result = check(orjson.dumps(bad).decode())
    assert not result.ok and result.value is None
    assert result.error == "$.items[1].price: 'ten' is not of type 'number' (failed: type)"


def test_missing_required_at_the_root_and_nested() -> None:
    result = check('{"customer": {"name": "Ada"}}')
    assert result.error == ("$: 'items' is a required property (failed: required)\n"
                            "$.customer: 'zip' is a required property (failed: required)")


def test_every_failed_constraint_is_listed_up_to_a_limit() -> None:
    items = [{"sku": i, "price": "x"} for i in range(4)]
    result = check(orjson.dumps({"customer": {"name": "A", "zip": "1"}, "items": items}).decode())
    lines = (result.error or "").splitlines()
    assert len(lines) == 6 and lines[-1] == "... and 3 more"
    assert lines[0] == "$.items[0].price: 'x' is not of type 'number' (failed: type)"


@pytest.mark.parametrize("text", [
    "```json\n{doc}\n```",
    "```\n{doc}\n```",
    "Here is the order:\n\n```JSON\n{doc}\n```\nLet me know if you need more.",
    "Sure! The extracted order is: {doc}",
    "  {doc}\n",
])
def test_json_in_fences_or_after_prose_is_found(text: str) -> None:
    result = check(text.replace("{doc}", orjson.dumps(GOOD, option=orjson.OPT_INDENT_2).decode()))
    assert result.ok and result.value == GOOD and result.raw.startswith(text[:3])


@pytest.mark.parametrize(("text", "error"), [
    ("The order is for Ada.", "not JSON: "),
    ('{"customer": ', "not JSON:"),
    ('{"a": 1} and also {"b": 2}', "ambiguous: the answer holds 2 separate JSON values"),
    ("```json\n{}\n```\n```json\n[]\n```", "ambiguous: the answer holds 2 JSON code blocks"),
    ('{"customer": {}} - hope this helps!', "not JSON: there is text after the JSON value"),
])
def test_not_json_or_ambiguous(text: str, error: str) -> None:
    result = check(text)
    assert result.value is None and (result.error or "").startswith(error), result.error
    assert result.raw == text
    if not text.startswith(("{", "`")):  # the decoder's own words, then where the answer went wrong
        assert (result.error or "").endswith("line 1 column 1 (char 0) (the answer begins 'The order is for Ada.')")


def test_empty_answers_say_why() -> None:
    assert check("").error == "empty answer: expected one JSON value"
    assert check("  \n").error == "empty answer: expected one JSON value"
    refused = MessageResponse("r", "m", AssistantMessage(()), ModelStopReason.REFUSAL, refusal="I can't help with that.")
    assert parse_output(refused, ORDER).error == "the model refused: I can't help with that."
    called = tool_call_response(("lookup", {"q": "x"}))
    assert parse_output(called, ORDER).error == "empty answer: the model called lookup instead of answering with JSON"
    cut = MessageResponse("r", "m", AssistantMessage('{"customer": {"na'), ModelStopReason.MAX_TOKENS)
    assert (parse_output(cut, ORDER).error or "").endswith("(the answer was cut off at the output token limit)")


def test_forced_tool_answer_is_read_from_the_call() -> None:
    call = MessageResponse("r", "m", AssistantMessage((TextBlock("Here:"), ToolUseBlock("t1", "order", GOOD))),
                           ModelStopReason.TOOL_USE)
    result = parse_output(call, ORDER)
    assert result.value == GOOD and result.raw == orjson.dumps(GOOD).decode()
    broken = MessageResponse("r", "m", AssistantMessage((ToolUseBlock("t1", "order", {}, '{"customer": '),)),
                             ModelStopReason.TOOL_USE)
    assert (parse_output(broken, ORDER).error or "").startswith("not JSON: the arguments of 'order'")


def test_scalar_and_null_answers() -> None:
    assert check("42", OutputSchema("n", {"type": "integer"})).value == 42
    nothing = check("null", OutputSchema("n", {"type": "null"}))
    assert nothing.ok and nothing.value is None
    assert check('"42"', OutputSchema("n", {"type": "integer"})).error == \
        "$: '42' is not of type 'integer' (failed: type)"


def test_an_invalid_schema_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="invalid output JSON Schema"):
        check("{}", OutputSchema("bad", {"type": "no-such-type"}))
    assert validate_value({"customer": {"name": "A", "zip": "1"}, "items": []}, ORDER) is None


def test_repair_message_quotes_the_error_and_asks_for_json_only() -> None:
    result = check('{"customer": {"name": "Ada"}}')
    text = repair_message(result)
    assert result.error and result.error in text
    assert text.endswith("Reply again with only the corrected JSON value: no prose, no code fences.")
    assert '"required":["customer","items"]' in repair_message(result, ORDER)


# ---------------------------------------------------------------------------- structured_call
async def test_right_first_time_is_one_call() -> None:
    provider = ScriptedProvider([orjson.dumps(GOOD).decode()])
    result = await structured_call(provider, REQ, ORDER)
    assert result.value == GOOD and len(provider.requests) == 1
    assert provider.requests[0].output_schema == ORDER  # declared on the request, for the protocol to send


async def test_wrong_then_right_is_one_repair_call() -> None:
    wrong = '{"customer": {"name": "Ada"}, "items": []}'
    provider = ScriptedProvider([wrong, "```json\n" + orjson.dumps(GOOD).decode() + "\n```"])
    result = await structured_call(provider, REQ, ORDER)
    assert result.ok and result.value == GOOD
    assert len(provider.requests) == 2
    repair = provider.requests[1]
    assert repair.output_schema == ORDER
    assert repair.messages[:-2] == REQ.messages
    assert repair.messages[-2] == AssistantMessage((TextBlock(wrong),))
    assert isinstance(repair.messages[-1], UserMessage)
    assert "$.customer: 'zip' is a required property (failed: required)" in repair.messages[-1].text


async def test_wrong_twice_is_a_typed_error() -> None:
    provider = ScriptedProvider(["Ada ordered two things.", '{"customer": {"name": "Ada", "zip": 10115}, "items": []}'])
    with pytest.raises(StructuredOutputError) as caught:
        await structured_call(provider, REQ, ORDER)
    err = caught.value
    assert isinstance(err, RunError) and len(provider.requests) == 2 and err.attempts == 2
    assert err.schema_name == "order"
    assert err.error == "$.customer.zip: 10115 is not of type 'string' (failed: type)"
    assert err.raw == '{"customer": {"name": "Ada", "zip": 10115}, "items": []}'
    assert err.result is not None and not err.result.ok and err.response is not None
    assert "after 2 calls" in str(err)
    # an empty first answer is not echoed back as an empty assistant turn
    provider = ScriptedProvider([" ", "nope"])
    with pytest.raises(StructuredOutputError, match="not JSON"):
        await structured_call(provider, REQ, ORDER)
    assert provider.requests[1].messages[:-1] == REQ.messages


async def test_no_repair_when_not_allowed() -> None:
    provider = ScriptedProvider(["not json", orjson.dumps(GOOD).decode()])
    with pytest.raises(StructuredOutputError) as caught:
        await structured_call(provider, REQ, ORDER, repair=False)
    assert caught.value.attempts == 1 and len(provider.requests) == 1
    assert "after 1 call:" in str(caught.value)


# ---------------------------------------------------------------------------- the real local model
@pytest.mark.llama
async def test_local_model_gives_a_valid_value(local_provider) -> None:
    """SmolLM2-135M under llama.cpp: the grammar-enforced ``response_format`` makes the answer valid."""
    schema = OutputSchema("capital", {
        "type": "object",
        "properties": {"country": {"type": "string", "maxLength": 40}, "capital": {"type": "string", "maxLength": 40}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    })
    request = MessageRequest("", (UserMessage("What is the capital of France? Answer in JSON."),),
                             max_tokens=200, temperature=0.0)
    result = await structured_call(local_provider, request, schema)
    assert result.ok, result.error
    assert validate_value(result.value, schema) is None
    assert set(result.value) == {"country", "capital"}
    assert all(isinstance(v, str) for v in result.value.values())


def test_an_invalid_schema_is_refused_at_construction_before_any_call() -> None:
    import pytest as _pytest

    from fsm_agent import Agent, ConfigurationError, OutputSchema, ScriptedProvider

    with _pytest.raises(ConfigurationError, match="invalid output JSON Schema at type"):
        OutputSchema("bad", {"type": "nope"})
    with _pytest.raises(ConfigurationError, match="must be a JSON Schema object"):
        OutputSchema("bad", ["not", "a", "schema"])  # type: ignore[arg-type]
    provider = ScriptedProvider(["never called"])
    with _pytest.raises(ConfigurationError):
        Agent(provider).run_sync("x", output_schema=OutputSchema("bad", {"properties": {"a": {"type": 3}}}))
    assert provider.requests == []


# -- answers nested too deeply: a typed parse failure, never a RecursionError ----------------------
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("text", [DEEP, "Here it is: " + DEEP, '```json\n' + DEEP + '\n```',
                                  '{"customer": ' + "[" * 600 + "]" * 600 + "}"],
                         ids=["bare", "after prose", "fenced", "inside an object"])
def test_an_answer_nested_too_deeply_is_a_parse_failure(text: str) -> None:
    result = check(text)
    assert not result.ok and result.value is None
    assert result.error == ("not JSON: the answer nests arrays or objects more than 512 levels deep; "
                            "give a flatter JSON value")


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    value = {"customer": {"name": "[" * 5000 + "{" * 5000, "zip": "1"}, "items": []}
    assert check(orjson.dumps(value).decode()).value == value


def test_a_forced_tool_answer_nested_too_deeply_is_a_parse_failure() -> None:
    deep: list = []
    cur = deep
    for _ in range(300):  # beyond orjson's 255 levels for dumps
        cur.append([])
        cur = cur[0]
    response = MessageResponse("r", "m", AssistantMessage((ToolUseBlock("c1", "order", {"items": deep}),)),
                               ModelStopReason.TOOL_USE)
    result = parse_output(response, ORDER)
    assert not result.ok and "more than 512 levels deep" in (result.error or "")


def test_a_value_too_deep_for_the_checker_is_an_error_text() -> None:
    nested = OutputSchema("nested", {"$ref": "#/$defs/x",
                                     "$defs": {"x": {"type": "array", "items": {"$ref": "#/$defs/x"}}}})
    value: list = []
    cur = value
    for _ in range(480):  # within MAX_DEPTH, but each level costs the checker several frames
        cur.append([])
        cur = cur[0]
    assert validate_value(value, nested) == ("$: the value nests arrays or objects too deeply to be checked; "
                                             "give a flatter value")


async def test_structured_call_raises_the_typed_error_for_a_deep_answer() -> None:
    provider = ScriptedProvider([DEEP, DEEP])
    with pytest.raises(StructuredOutputError, match="more than 512 levels deep"):
        await structured_call(provider, REQ, ORDER)
