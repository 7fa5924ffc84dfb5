"""One home for the A2A wire (``fsm_agent.orchestration.a2a_wire``), used by the server and the client:

* both sides' public names are the wire module's own objects (no second definition);
* what the server writes, the client reads: an error answer's code and reason, every frame the
  server makes of a log event, the usage metadata;
* every StopReason maps to a task state the client classifies as the server does (terminal, or
  waiting for the client).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

import fsm_agent.orchestration.a2a as client
import fsm_agent.orchestration.a2a_wire as wire
import fsm_agent.server.a2a as server
from fsm_agent.store.base import EventRecord, SessionRecord
from fsm_agent.types.messages import Usage
from fsm_agent.types.run import StopReason


def test_both_sides_use_the_wire_modules_objects() -> None:
    assert client.TaskState is wire.TaskState
    assert server.stop_task_state is wire.stop_task_state and server.task_state is wire.task_state
    assert server.RpcError is wire.RpcError and server.REFUSAL_KINDS is wire.REFUSAL_KINDS
    assert (server.A2A_VERSION, server.AGENT_CARD_PATH) == (wire.A2A_VERSION, wire.AGENT_CARD_PATH)
    assert {s: getattr(server, s) for s in ("COMPLETED", "FAILED", "INPUT_REQUIRED", "REJECTED", "WORKING")} == \
        {s: getattr(wire.TaskState, s).value for s in ("COMPLETED", "FAILED", "INPUT_REQUIRED", "REJECTED", "WORKING")}


@pytest.mark.parametrize("reason", list(StopReason))
def test_every_stop_maps_to_a_state_both_sides_classify_alike(reason: StopReason) -> None:
    state = wire.stop_task_state({"reason": reason.value, "detail": "x"})
    parsed = wire.TaskState.parse(state)
    assert parsed.value == state
    assert parsed.terminal is (state in wire.TERMINAL_STATES)
    # a resumable stop waits for the client; one that ended for good is terminal
    assert parsed.terminal is (not reason.resumable or reason is StopReason.FAILED_RETRYABLE)
    assert parsed.interrupted is (reason.resumable and reason is not StopReason.FAILED_RETRYABLE)
    rec = SessionRecord("s", reason.value, stop={"reason": reason.value, "detail": "x"})
    assert wire.task_state(rec, busy=False) == state


def test_a_refusal_is_rejected_and_a_server_stop_is_working() -> None:
    refused = {"reason": "FAILED_TERMINAL", "error": {"kind": "policy"}}
    assert wire.TaskState.parse(wire.stop_task_state(refused)) is wire.TaskState.REJECTED
    stopping = {"reason": "INTERRUPTED", "detail": wire.SERVER_STOPPING + " (SIGTERM)"}
    assert wire.stop_task_state(stopping) == wire.WORKING


def test_an_error_the_server_answers_is_read_back_by_the_client() -> None:
    err = wire.RpcError(wire.TASK_NOT_FOUND, "no task 't'", {"task_id": "t"})
    body = orjson.loads(wire.rpc_error(7, err))
    with pytest.raises(wire.RpcError) as got:
        wire.parse_response(body)
    assert (got.value.code, got.value.reason, got.value.message) == (-32001, "TASK_NOT_FOUND", "no task 't'")
    assert got.value.raw[0]["metadata"] == {"task_id": "t"}
    assert wire.parse_response(orjson.loads(wire.rpc_result(7, {"ok": 1}))) == {"ok": 1}
    for bad in ([1], {"jsonrpc": "2.0", "id": 1}, {"jsonrpc": "2.0", "error": "x"}):
        with pytest.raises(wire.NotJsonRpc):
            wire.parse_response(bad)


def test_a_request_the_client_builds_is_one_the_server_reads() -> None:
    rid, method, params = wire.parse_request(orjson.loads(wire.rpc_request("GetTask", {"id": "t"}, "r1")))
    assert (rid, method, params) == ("r1", "GetTask", {"id": "t"})
    with pytest.raises(wire.RpcError) as e:
        wire.parse_request([{"jsonrpc": "2.0"}])
    assert e.value.code == wire.INVALID_REQUEST


def _events() -> list[EventRecord]:
    assistant = {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}
    return [EventRecord("s", 1, "session_started", {"goal": "g"}),
            EventRecord("s", 2, "tool_call", {"status": "started", "tool": "t", "call_id": "c"}),
            EventRecord("s", 3, "tool_progress", {"tool": "t", "progress": 1, "total": 2, "message": "half"}),
            EventRecord("s", 4, "message", {"message": assistant}),
            EventRecord("s", 5, "run_stopped", {"stop": {"reason": "COMPLETED", "detail": "done"}})]


def test_every_frame_the_server_makes_the_client_reads() -> None:
    kinds = []
    for ev in _events():
        result: Any = server.event_result(ev, "s", "ctx", ((3, 4), 0.5))
        assert result is not None
        kind, value = wire.frame_result(orjson.loads(orjson.dumps(result)))
        kinds.append(kind)
        if kind == "artifact_update":
            assert wire.parts_text(value["artifact"]["parts"]) == "hello"
        if ev.type == "run_stopped":
            assert wire.TaskState.parse(value["status"]["state"]) is wire.TaskState.COMPLETED
            assert wire.usage_of(value["metadata"]) == (Usage(3, 4), 0.5)
    assert kinds == ["status_update", "status_update", "status_update", "artifact_update", "status_update"]


def test_usage_metadata_round_trips() -> None:
    meta = {wire.METADATA_KEY: wire.usage_metadata((10, 2), None)}
    assert wire.usage_of(meta) == (Usage(10, 2), None)
    assert wire.usage_of({"usage": {"prompt_tokens": 5, "completion_tokens": 1}}) == (Usage(5, 1), None)
    assert wire.usage_of({}) is None
