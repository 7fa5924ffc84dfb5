"""Type-mutated A2A requests (seeded): every answer is HTTP 200 with a JSON-RPC result or a typed
error (never -32603, never a dropped connection), and the server keeps serving.

Each case takes a valid request of one of the six methods and mutates it: a value at a random
path is replaced by a value of another type (null, booleans, a negative, a huge integer, a float,
empty and huge strings, control characters, lists, objects), a key is deleted, or an unknown key is
added. ``FSM_A2A_FUZZ_SEED`` sets the seed, ``FSM_A2A_FUZZ_CASES`` the count (default 400).
"""

from __future__ import annotations

import copy
import os
import random
from typing import Any

import aiohttp
import orjson

from a2a_peers import A2A, Live, parse_frames
from fsm_agent import Agent, ScriptedProvider
from fsm_agent.server import create_app
from fsm_agent.server.a2a import A2AConfig, add_a2a_routes
from fsm_agent.server.auth import Tenants
from fsm_agent.store import MemoryStore

SEED = int(os.environ.get("FSM_A2A_FUZZ_SEED", "20261202"))
CASES = int(os.environ.get("FSM_A2A_FUZZ_CASES", "400"))
CODES = {-32700, -32600, -32601, -32602, -32001, -32002, -32003, -32004, -32005, -32009}
VALUES: list[Any] = [None, True, False, -1, 0, 2**62, 1.5, "", "x" * 20_000, "\u0000\u001f", "../../etc", "ROLE_AGENT",
                     "TASK_STATE_WORKING", [], [1, "a"], {}, {"text": 5}, {"data": {"decisions": {"c": {}}}}]


def templates(task_id: str) -> list[dict[str, Any]]:
    message = {"messageId": "m", "contextId": "ctx", "role": "ROLE_USER", "parts": [{"text": "hello"},
                                                                                   {"data": {"k": [1, 2]}}]}
    return [
        {"method": "SendMessage", "params": {"message": message, "configuration": {"historyLength": 2,
                                                                                   "returnImmediately": False}}},
        {"method": "SendStreamingMessage", "params": {"message": message}},
        {"method": "GetTask", "params": {"id": task_id, "historyLength": 1}},
        {"method": "ListTasks", "params": {"contextId": "ctx", "pageSize": 5, "status": "TASK_STATE_COMPLETED",
                                           "includeArtifacts": True}},
        {"method": "CancelTask", "params": {"id": task_id}},
        {"method": "SubscribeToTask", "params": {"id": task_id}},
        {"method": "SendMessage", "params": {"message": {**message, "taskId": task_id,
                                                         "parts": [{"data": {"limits": {"max_iterations": 3}}}]}}},
    ]


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*prefix, i))
    return out


def mutate(req: dict[str, Any], rng: random.Random, n: int) -> dict[str, Any]:
    req = copy.deepcopy(req)
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": n, **req}
    body["params"] = copy.deepcopy(req["params"])
    if "message" in body["params"]:
        body["params"]["message"]["messageId"] = f"fuzz-{n}"  # each case its own message
    path = rng.choice(paths(body)[1:])
    parent: Any = body
    for key in path[:-1]:
        parent = parent[key]
    what = rng.random()
    if what < 0.7:
        parent[path[-1]] = rng.choice(VALUES)
    elif what < 0.85 and isinstance(parent, dict):
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[f"unknown_{n}"] = rng.choice(VALUES)
    return body


async def test_mutated_requests_get_typed_answers_and_never_an_internal_error() -> None:
    rng = random.Random(SEED)
    agent = Agent(ScriptedProvider(["fine"], repeat_last=True), store=MemoryStore())
    app = create_app(agent, tenants=Tenants(), live_deltas=False)
    add_a2a_routes(app, A2AConfig(name="fuzz", description="fuzzing target", blocking_timeout=5.0, cancel_wait=1.0))
    seen: dict[int, int] = {}
    async with Live(app) as live, aiohttp.ClientSession() as cs:
        async with cs.post(live.rpc_url, json={"jsonrpc": "2.0", "id": 0, "method": "SendMessage", "params": {
                "message": {"messageId": "seed", "role": "ROLE_USER", "parts": [{"text": "hi"}]}}}, headers=A2A) as r:
            task_id = (await r.json())["result"]["task"]["id"]
        reqs = templates(task_id)
        for n in range(1, CASES + 1):
            body = mutate(rng.choice(reqs), rng, n)
            async with cs.post(live.rpc_url, data=orjson.dumps(body), headers=A2A,
                               timeout=aiohttp.ClientTimeout(total=20)) as r:
                assert r.status == 200, (body, r.status)
                raw = await r.read()
                if r.headers["Content-Type"].startswith("text/event-stream"):
                    frames = parse_frames(raw)
                    assert frames, (body, raw[:300])
                    answers = [f["data"] for f in frames]
                else:
                    answers = [orjson.loads(raw)]
            for a in answers:
                assert a["jsonrpc"] == "2.0" and ("result" in a) != ("error" in a), (body, a)
                if "error" in a:
                    code = a["error"]["code"]
                    assert code in CODES, (body, a)  # never -32603: no input reaches an internal error
                    assert a["error"]["message"], (body, a)
                    seen[code] = seen.get(code, 0) + 1
                else:
                    seen[0] = seen.get(0, 0) + 1
        async with cs.post(live.rpc_url, json={"jsonrpc": "2.0", "id": "last", "method": "GetTask",
                                               "params": {"id": task_id}}, headers=A2A) as r:
            assert (await r.json())["result"]["id"] == task_id  # still serving
    print(f"seed {SEED}: {CASES} cases, answers by code: {dict(sorted(seen.items()))}")
    assert seen.get(-32602, 0) > 20 and seen.get(0, 0) > 5  # both refusals and successes were exercised
