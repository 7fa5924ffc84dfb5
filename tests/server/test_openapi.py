"""The served OpenAPI document is a valid OpenAPI 3.1 document and names every route of the app
with its methods; docs/server.md names every route too."""

from __future__ import annotations

import re
from pathlib import Path

from openapi_spec_validator import validate

from fsm_agent import ScriptedProvider
from fsm_agent.agent import Agent
from fsm_agent.server import create_app
from fsm_agent.server.openapi import openapi_document
from fsm_agent.store import MemoryStore

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"


def app_routes() -> set[tuple[str, str]]:
    app = create_app(Agent(ScriptedProvider(["x"]), store=MemoryStore()))
    out = set()
    for route in app.router.routes():
        if route.method in ("HEAD", "OPTIONS", "*"):
            continue
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        out.add((route.method.lower(), path))
    return out


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = openapi_document()
    assert doc["openapi"] == "3.1.0"
    validate(doc)


def test_every_route_is_in_the_document_and_in_docs_server_md() -> None:
    doc = openapi_document()
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    routes = app_routes()
    assert routes and routes == documented
    text = DOC.read_text(encoding="utf-8")
    in_md = set(re.findall(r"^\| `(GET|POST|DELETE) (/[^`]*)`", text, re.M))
    assert {(m.lower(), p) for m, p in in_md} == routes
