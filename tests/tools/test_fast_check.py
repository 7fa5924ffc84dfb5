"""The quick argument check of common tool schemas never accepts what the JSON Schema refuses.

``Tool.validate`` first tries a sufficient check for flat schemas of plain types (what ``@tool``
makes from a typed signature); only when it says "not sure" does jsonschema run (and word the
errors). Property-tested here against jsonschema on random flat schemas and random arguments.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_agent import tool
from fsm_agent.errors import ToolArgumentsError
from fsm_agent.tools.registry import Tool, _fast_checker

TYPES = ["string", "integer", "number", "boolean", "null", "array", "object"]

values = st.recursive(st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False)
                      | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=6)


@st.composite
def flat_schemas(draw: Any) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), unique=True, max_size=4))
    props = {}
    for n in names:
        sub: dict[str, Any] = {}
        kind = draw(st.sampled_from(["one", "many", "none"]))
        if kind == "one":
            sub["type"] = draw(st.sampled_from(TYPES))
        elif kind == "many":
            sub["type"] = draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=3, unique=True))
        if draw(st.booleans()):
            sub["description"] = "x"
        props[n] = sub
    required = draw(st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), unique=True, max_size=3))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": draw(st.booleans())}


@settings(max_examples=600, deadline=None)
@given(flat_schemas(), st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e"]), values, max_size=5))
def test_the_quick_check_accepts_only_what_jsonschema_accepts(schema: dict[str, Any], args: dict[str, Any]) -> None:
    check = _fast_checker(schema)
    assert check is not None  # every flat schema of plain types gets the quick check
    if check(args):
        assert jsonschema.Draft202012Validator(schema).is_valid(args), (schema, args)


def test_a_valid_call_of_a_typed_function_passes_and_an_invalid_one_is_worded_by_jsonschema() -> None:
    @tool
    def weather(city: str, days: int = 1) -> str:
        """Weather.

        Args:
            city: a city.
            days: how many days.
        """
        return city

    weather.validate({"city": "Paris"})
    weather.validate({"city": "Paris", "days": 3})
    with pytest.raises(ToolArgumentsError, match=r"days: 'x' is not of type 'integer'"):
        weather.validate({"city": "Paris", "days": "x"})
    with pytest.raises(ToolArgumentsError, match=r"'city' is a required property"):
        weather.validate({"days": 3})
    with pytest.raises(ToolArgumentsError, match="Additional properties are not allowed"):
        weather.validate({"city": "Paris", "extra": 1})
    weather.validate({"city": "Paris", "days": 2.0})  # jsonschema's integer: a whole float is one


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 2}}},
    {"type": "object", "properties": {"a": {"enum": [1, 2]}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}},
    {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}},
    {"anyOf": [{"type": "object"}]},
])
def test_anything_beyond_flat_plain_types_goes_to_jsonschema(schema: dict[str, Any]) -> None:
    assert _fast_checker(schema) is None
    t = Tool(lambda **kw: kw, name="t", parameters=schema)
    assert t._fast_check is None
