"""The OpenAPI 3.1 document of the server's routes (served at ``GET /openapi.json``).

Written by hand from the routes of :mod:`fsm_agent.server.app`; ``tests/server`` checks that every
route of the app is in it and that it is a valid OpenAPI document.
"""

from __future__ import annotations

from typing import Any

from .._version import __version__

__all__ = ["openapi_document"]

_PROBLEM = {"$ref": "#/components/responses/Problem"}
_SID = {"name": "sid", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 200}}
_CALL = {"name": "call_id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 200}}
_EID = {"name": "eid", "in": "path", "required": True, "schema": {"type": "string", "maxLength": 200}}


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


def _op(summary: str, *, params: tuple[dict[str, Any], ...] = (), body: str | None = None,
        ok: tuple[str, str, str | None] = ("200", "OK", None), errors: tuple[str, ...] = ("400", "401", "404"),
        extra: dict[str, Any] | None = None) -> dict[str, Any]:
    code, desc, schema = ok
    resp: dict[str, Any] = {"description": desc}
    if schema == "sse":
        resp["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    elif schema == "text":
        resp["content"] = {"text/plain": {"schema": {"type": "string"}}}
    elif schema is not None:
        resp["content"] = _json(schema)
    op: dict[str, Any] = {"summary": summary, "responses": {code: resp, **{e: _PROBLEM for e in errors}}}
    if params:
        op["parameters"] = list(params)
    if body is not None:
        op["requestBody"] = {"required": True, "content": _json(body)}
    if extra:
        op.update(extra)
    return op


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document, as a JSON-ready dict."""
    after = {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0},
             "description": "Replay the events after this seq (a browser's first request; `Last-Event-ID` wins)."}
    last_id = {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"},
               "description": "The seq of the last event received: replay starts after it."}
    idem = {"name": "Idempotency-Key", "in": "header", "schema": {"type": "string", "maxLength": 200},
            "description": "A repeat with the same key returns the first outcome (200, `Idempotent-Replayed: true`)."}
    return {
        "openapi": "3.1.0",
        "info": {"title": "fsm_agent server", "version": __version__,
                 "description": "Sessions, runs, the SSE event stream, control, approvals, the review page and "
                                "the tenant's episodic memory. "
                                "Errors are RFC 9457 problem documents."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "cookie": {"type": "apiKey", "in": "cookie", "name": "fsm_auth"}},
            "responses": {"Problem": {"description": "An RFC 9457 problem document",
                                      "content": {"application/problem+json": {"schema": {
                                          "$ref": "#/components/schemas/Problem"}}}}},
            "schemas": {
                "Problem": {"type": "object", "properties": {
                    "type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"},
                    "detail": {"type": "string"}, "instance": {"type": "string"}}},
                "NewSession": {"type": "object", "required": ["task"], "additionalProperties": False, "properties": {
                    "task": {"oneOf": [{"type": "string", "minLength": 1},
                                       {"$ref": "#/components/schemas/TaskDefinition"}]},
                    "session_id": {"type": "string", "maxLength": 200},
                    "permissions": {"$ref": "#/components/schemas/Permissions"}}},
                "TaskDefinition": {"type": "object", "required": ["goal"], "description": (
                    "Task mode (docs/tasks.md): goal, inputs, constraints, allowed_tools, permissions, budget, "
                    "output_schema, check (value and grader checks; no python over HTTP), max_repairs, "
                    "on_check_failure, name"), "properties": {
                    "goal": {"type": "string", "minLength": 1}, "inputs": {"type": "object"},
                    "constraints": {"type": "array", "items": {"type": "string"}},
                    "allowed_tools": {"type": "array", "items": {"type": "string"}},
                    "permissions": {"$ref": "#/components/schemas/Permissions"},
                    "budget": {"type": "object"}, "output_schema": {"type": "object"},
                    "check": {"type": "array", "items": {"type": "object"}}, "max_repairs": {"type": "integer"},
                    "on_check_failure": {"enum": ["fail", "human"]}, "name": {"type": "string"}}},
                "Permissions": {"type": "object", "description": (
                    "A session's permissions (docs/permissions.md): tools (glob patterns) and scope (argument "
                    "conditions: under, host, le ...)"), "properties": {
                    "tools": {"type": "array", "items": {"type": "string"}},
                    "scope": {"type": "array", "items": {"type": "object"}},
                    "restriction": {"type": "array", "items": {"type": "object"}}}},
                "StartRun": {"type": "object", "additionalProperties": False, "properties": {
                    "task": {"type": "string", "minLength": 1},
                    "limits": {"type": "object", "description": "Raised RunConfig fields for a resume"},
                    "confirm_cancel": {"type": "boolean"}}},
                "Snapshot": {"type": "object", "properties": {
                    "session_id": {"type": "string"}, "tenant": {"type": "string"},
                    "state": {"type": "string", "description": "QUEUED, a phase, or a stop reason"},
                    "goal": {"type": "string"}, "stop": {"type": ["object", "null"]},
                    "pending_approvals": {"type": "array", "items": {"type": "object"}},
                    "last_seq": {"type": "integer"}, "running": {"type": "boolean"},
                    "usage": {"type": "object"}, "cost_usd": {"type": ["number", "null"]},
                    "created_at": {"type": "number"}, "updated_at": {"type": "number"}}},
                "SessionList": {"type": "object", "properties": {
                    "sessions": {"type": "array", "items": {"$ref": "#/components/schemas/Snapshot"}}}},
                "Control": {"type": "object", "required": ["kind"], "additionalProperties": False, "properties": {
                    "kind": {"enum": ["interrupt", "cancel", "steer", "followup", "restrict", "request_permissions"]},
                    "text": {"type": "string"},
                    "restriction": {"$ref": "#/components/schemas/Permissions"},
                    "permissions": {"$ref": "#/components/schemas/Permissions"},
                    "reason": {"type": "string"}}},
                "Decision": {"type": "object", "required": ["decision"], "additionalProperties": False, "properties": {
                    "decision": {"enum": ["approve", "edit", "reject", "respond"]},
                    "arguments": {"type": "object"}, "message": {"type": "string"}, "is_error": {"type": "boolean"}}},
                "Outcome": {"type": "object", "properties": {
                    "session_id": {"type": "string"}, "status": {"type": "string"}, "replayed": {"type": "boolean"}}},
                "Login": {"type": "object", "required": ["token"], "properties": {"token": {"type": "string"}}},
                "Episode": {"type": "object", "description": "What one session came to (docs/memory.md)",
                            "properties": {
                                "episode_id": {"type": "string"}, "tenant": {"type": "string"},
                                "session_id": {"type": "string"}, "goal": {"type": "string"},
                                "outcome": {"type": "string", "description": "a stop reason"},
                                "detail": {"type": "string"}, "answer": {"type": "string"},
                                "steps": {"type": "array", "items": {"type": "object", "properties": {
                                    "tool": {"type": "string"}, "arguments": {"type": "string"},
                                    "result": {"type": "string"}, "ok": {"type": "boolean"}}}},
                                "failures": {"type": "array", "items": {"type": "string"}},
                                "turns": {"type": "integer"}, "tool_calls": {"type": "integer"},
                                "cost_usd": {"type": ["number", "null"]}, "created_at": {"type": "number"},
                                "updated_at": {"type": "number"},
                                "score": {"type": "number", "description": "with ?q= only: higher matches better"}}},
                "EpisodeList": {"type": "object", "properties": {
                    "episodes": {"type": "array", "items": {"$ref": "#/components/schemas/Episode"}}}},
                "Deleted": {"type": "object", "properties": {"deleted": {"type": "integer"}}},
            },
        },
        "security": [{"bearer": []}, {"cookie": []}],
        "paths": {
            "/healthz": {"get": _op("Health", errors=(), extra={"security": []})},
            "/openapi.json": {"get": _op("This document", errors=(), extra={"security": []})},
            "/auth/login": {"post": _op("Sign in with a token; sets the fsm_auth and fsm_csrf cookies",
                                        body="Login", errors=("400", "401"), extra={"security": []})},
            "/auth/logout": {"post": _op("Sign out", errors=(), extra={"security": []})},
            "/sessions": {
                "post": _op("Create a session and start its first run", body="NewSession",
                            ok=("201", "Created (Location: the session)", "Snapshot"), errors=("400", "401", "403",
                                                                                                "409", "413")),
                "get": _op("The tenant's sessions, most recently updated first",
                           params=({"name": "state", "in": "query", "schema": {"type": "string"}},
                                   {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                                "maximum": 1000}}),
                           ok=("200", "OK", "SessionList"), errors=("400", "401"))},
            "/sessions/{sid}": {"get": _op("The snapshot", params=(_SID,), ok=("200", "OK", "Snapshot"))},
            "/sessions/{sid}/runs": {"post": _op(
                "Start a run (a new session with a task, else a resume)", params=(_SID,), body="StartRun",
                ok=("202", "Accepted (Location: the session)", "Snapshot"),
                errors=("400", "401", "403", "404", "409", "413"))},
            "/sessions/{sid}/runs/stream": {"post": _op(
                "Start a run and stream its events", params=(_SID,), body="StartRun",
                ok=("200", "The event stream (Location: the join URL)", "sse"),
                errors=("400", "401", "403", "404", "409", "413"))},
            "/sessions/{sid}/events": {"get": _op(
                "Join the event stream: replay after Last-Event-ID / after, then live", params=(_SID, after, last_id),
                ok=("200", "text/event-stream; id = log seq; `delta` events are live only (no id)", "sse"))},
            "/sessions/{sid}/control": {"post": _op(
                "Interrupt, cancel, steer, follow up, restrict or request permissions", params=(_SID, idem),
                body="Control",
                ok=("202", "Queued", "Outcome"), errors=("400", "401", "403", "404", "409", "413"))},
            "/sessions/{sid}/approvals/{call_id}": {"post": _op(
                "Decide a pending tool call (idempotent)", params=(_SID, _CALL), body="Decision",
                ok=("202", "Accepted (a repeat: 200 with the first outcome)", "Outcome"),
                errors=("400", "401", "403", "404", "409", "413"))},
            "/sessions/{sid}/diagram": {"get": _op(
                "The Mermaid state diagram with the current state and the path taken (view=plan: the "
                "session's PlanAct plan; JSON also carries plan and plan_mermaid)",
                params=(_SID, {"name": "format", "in": "query", "schema": {"enum": ["mermaid", "json"]}},
                        {"name": "view", "in": "query", "schema": {"enum": ["machine", "plan"]}}),
                ok=("200", "Mermaid source", "text"))},
            "/memory/episodes": {
                "get": _op("The tenant's episodes, last saved first; with q, the best matches of q, best first",
                           params=({"name": "q", "in": "query", "schema": {"type": "string", "maxLength": 4000}},
                                   {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                                "maximum": 1000}}),
                           ok=("200", "OK", "EpisodeList"), errors=("400", "401", "404", "503")),
                "delete": _op("Delete every episode of the tenant (all=true)",
                              params=({"name": "all", "in": "query", "required": True, "schema": {"enum": ["true"]}},),
                              ok=("200", "How many were deleted", "Deleted"), errors=("400", "401", "403", "404", "503"))},
            "/memory/episodes/{eid}": {
                "get": _op("One episode of the tenant", params=(_EID,), ok=("200", "OK", "Episode"),
                           errors=("400", "401", "404", "503")),
                "delete": _op("Delete one episode of the tenant", params=(_EID,), ok=("204", "Deleted", None),
                              errors=("400", "401", "403", "404", "503"))},
            "/review/{sid}": {"get": _op("The review page", params=(_SID,), ok=("200", "HTML", None), errors=(),
                                         extra={"security": []})},
            "/static/{name}": {"get": _op("The page's script and the vendored Mermaid",
                                          params=({"name": "name", "in": "path", "required": True,
                                                   "schema": {"type": "string"}},),
                                          ok=("200", "A file", None), errors=("404",), extra={"security": []})},
        },
    }
