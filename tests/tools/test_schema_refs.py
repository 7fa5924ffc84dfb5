"""JSON Schema references in tool schemas: never fetched, all resolved when the tool is defined,
and a schema that cannot be evaluated is an argument error for that call, never a crashed run.

A tool's ``parameters`` may come from an untrusted place (an MCP server's ``inputSchema``). A
``$ref`` to ``http://...`` used to make jsonschema fetch that URL with a blocking ``urlopen`` in
the event loop at every call; a dangling ``$ref`` passed the definition and ended the first call's
run FAILED_TERMINAL. A real HTTP server counts the fetches here.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from fsm_agent import Agent, ScriptedProvider, StopReason
from fsm_agent.errors import ToolArgumentsError, ToolDefinitionError
from fsm_agent.providers import tool_call_response
from fsm_agent.store import MemoryStore
from fsm_agent.tools import Tool
from fsm_agent.types import ToolResultMessage, ToolUseBlock


@pytest.fixture
def web() -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server on loopback that serves a schema and records every request path."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/schema+json")
            self.end_headers()
            self.wfile.write(b'{"type": "integer"}')

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", hits
    finally:
        srv.shutdown()
        thread.join(5)
        srv.server_close()


def _fn(**kwargs: Any) -> str:
    return "ran"


def _obj(props: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, **more}


@pytest.mark.parametrize("where", ["property", "defs", "items", "nested_id", "anyOf", "dynamic"])
def test_a_remote_ref_anywhere_is_a_definition_error_and_is_never_fetched(web: tuple[str, list[str]],
                                                                          where: str) -> None:
    base, hits = web
    url = f"{base}/internal/metadata?leak=1"
    schema = {
        "property": _obj({"a": {"$ref": url}}),
        "defs": _obj({"a": {"$ref": "#/$defs/x"}}, **{"$defs": {"x": {"$ref": url}}}),
        "items": _obj({"a": {"type": "array", "items": {"$ref": url}}}),
        "nested_id": _obj({"a": {"$id": "https://example.test/inner/", "$ref": "other.json"}}),
        "anyOf": _obj({"a": {"anyOf": [{"type": "string"}, {"$ref": url}]}}),
        "dynamic": _obj({"a": {"$dynamicRef": url}}),
    }[where]
    with pytest.raises(ToolDefinitionError, match="never fetched") as err:
        Tool(_fn, name="t", parameters=schema)
    assert "does not resolve" in str(err.value)
    assert hits == []


def test_file_refs_are_refused_too(tmp_path: Any) -> None:
    f = tmp_path / "x.json"
    f.write_text('{"type": "integer"}')
    with pytest.raises(ToolDefinitionError, match="does not resolve"):
        Tool(_fn, name="t", parameters=_obj({"a": {"$ref": f.as_uri()}}))


@pytest.mark.parametrize("ref", ["#/$defs/nope", "#missing_anchor", "#/properties/b/items"])
def test_a_dangling_local_ref_is_a_definition_error(ref: str) -> None:
    with pytest.raises(ToolDefinitionError, match=r"tool 't': JSON Schema \$ref"):
        Tool(_fn, name="t", parameters=_obj({"a": {"$ref": ref}, "b": {"type": "string"}}))


def test_refs_within_the_schema_still_work() -> None:
    tree = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "properties": {"root": {"$ref": "#/$defs/node"}, "n": {"$ref": "#num"},
                           "inner": {"$id": "https://example.test/a/", "$ref": "b.json"},
                           "meta": {"$ref": "https://json-schema.org/draft/2020-12/meta/validation#/$defs/simpleTypes"}},
            "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array",
                                                                         "items": {"$ref": "#/$defs/node"}}},
                               "additionalProperties": False},
                      "num": {"$anchor": "num", "type": "integer"},
                      "b": {"$id": "https://example.test/a/b.json", "type": "string"}}}
    t = Tool(_fn, name="t", parameters=tree)
    t.validate({"root": {"kids": [{"kids": []}]}, "n": 3, "inner": "x", "meta": "integer"})
    with pytest.raises(ToolArgumentsError) as err:
        t.validate({"root": {"kids": [{"kids": [{"bad": 1}]}]}, "n": "3", "inner": 1, "meta": "int"})
    text = str(err.value)
    assert "root/kids/0/kids/0" in text and "n: '3' is not of type 'integer'" in text and "inner: 1" in text

    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"a": {"$ref": "#/definitions/x"}}, "definitions": {"x": {"type": "integer"}}}
    t7 = Tool(_fn, name="t7", parameters=draft7)
    with pytest.raises(ToolArgumentsError, match="'s' is not of type 'integer'"):
        t7.validate({"a": "s"})
    with pytest.raises(ToolDefinitionError, match="does not resolve"):
        Tool(_fn, name="t7", parameters={**draft7, "properties": {"a": {"$ref": "#/definitions/y"}}})


def test_a_schema_that_cannot_be_evaluated_is_an_argument_error_not_a_crash() -> None:
    # every reference resolves, but evaluating it never ends (the root refers to itself)
    t = Tool(_fn, name="loop", parameters={"$ref": "#"})
    with pytest.raises(ToolArgumentsError, match="could not be checked: its JSON Schema cannot be evaluated"):
        t.validate({"a": 1})


async def test_a_run_goes_on_when_a_tool_schema_cannot_be_evaluated() -> None:
    loop = Tool(_fn, name="loop", parameters={"$ref": "#"})
    agent = Agent(ScriptedProvider([tool_call_response(ToolUseBlock("c0", "loop", {"a": 1})), "done"]),
                  tools=[loop], store=MemoryStore())
    res = await agent.run("go")
    assert res.stop.reason is StopReason.COMPLETED, res.stop
    (result,) = [m for m in res.messages if isinstance(m, ToolResultMessage)]
    assert result.is_error and result.metadata["error"] == "invalid_arguments"
    assert "cannot be evaluated" in result.text


def test_output_schemas_follow_the_same_rule(web: tuple[str, list[str]]) -> None:
    from fsm_agent.errors import ConfigurationError
    from fsm_agent.structured import validate_value
    from fsm_agent.types import OutputSchema

    base, hits = web
    with pytest.raises(ConfigurationError, match="never fetched"):
        OutputSchema("answer", _obj({"a": {"$ref": f"{base}/schema.json"}}))
    with pytest.raises(ConfigurationError, match="does not resolve"):
        OutputSchema("answer", _obj({"a": {"$ref": "#/$defs/nope"}}))
    assert hits == []
    ok = OutputSchema("answer", _obj({"a": {"$ref": "#/$defs/n"}}, required=["a"], **{"$defs": {"n": {"type": "integer"}}}))
    assert validate_value({"a": 1}, ok) is None
    assert "'x' is not of type 'integer'" in (validate_value({"a": "x"}, ok) or "")
