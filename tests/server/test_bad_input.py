"""Bad input on every route, table-driven: each case is one request that must be refused with an RFC 9457
problem document (``application/problem+json``: type, title, status, detail, instance; ``status`` equal
to the HTTP status; a detail that names what was wrong) and must change nothing.

All cases share one server (``max_body=4096``, one tenant) with two sessions: ``w`` WAITING_HUMAN with
call ``c0`` pending (its tool allows approve, reject and edit, not respond) and ``c`` COMPLETED. Every
row of the store is compared before and after each case, no run may be started, and after the whole
table the store still equals its first state and the tool never ran.

Cases marked ``bug`` are known server bugs (see their reason); a request of such a case may change
the store, so each runs on a server of its own.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import pytest_asyncio
from aiohttp import ClientError, DummyCookieJar
from aiohttp.test_utils import TestClient, TestServer

from fsm_agent.agent import Agent
from fsm_agent.server import create_app
from fsm_agent.server.app import RUNNER_KEY
from fsm_agent.server.auth import Tenants
from fsm_agent.store import SQLiteStore

from . import common
from .common import RAN, dump

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "tok-aaaaaaaaaaaaaaaaaaaa"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
W, C = "w", "c"
MAX_BODY = 4096
TABLES = ("sessions", "events", "checkpoints", "ledger", "controls", "idempotency")
LONG_ID = "x" * 201

def agent(store: Any) -> Agent:
    return common.approval_agent(store, allowed=["approve", "reject", "edit"], repeat_last=True)


@attrs.define
class Srv:
    client: TestClient
    db: Path
    baseline: dict[str, list[tuple[Any, ...]]] = attrs.field(factory=dict)

    async def idle(self, *sids: str) -> None:
        runner = self.client.server.app[RUNNER_KEY]
        for sid in (W, C, *sids):
            assert not await runner.busy(sid), f"a run of {sid!r} was started"


async def wait_state(client: TestClient, sid: str, state: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    snap: dict[str, Any] = {}
    while time.monotonic() < deadline:
        snap = await (await client.get(f"/sessions/{sid}", headers=AUTH)).json()
        if snap.get("state") == state and not snap.get("running"):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{sid} did not reach {state}: {snap}")


async def start(db: Path) -> Srv:
    app = create_app(agent, SQLiteStore(db), tenants=Tenants({TOKEN: "alice"}), max_body=MAX_BODY)
    client = TestClient(TestServer(app, host="127.0.0.1"), cookie_jar=DummyCookieJar())
    await client.start_server()
    r = await client.post("/sessions", json={"task": "mail a0", "session_id": W}, headers=AUTH)
    assert r.status == 201, await r.text()
    await wait_state(client, W, "WAITING_HUMAN")
    r = await client.post("/sessions", json={"task": "hello", "session_id": C}, headers=AUTH)
    assert r.status == 201, await r.text()
    await wait_state(client, C, "COMPLETED")
    srv = Srv(client, db)
    srv.baseline = dump(db)
    assert RAN == []
    return srv


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory):
    srv = await start(tmp_path_factory.mktemp("bad-input") / "s.db")
    yield srv
    await srv.client.close()


# -- the table -----------------------------------------------------------------------------------------------
NO_BODY = object()


@attrs.frozen
class Case:
    id: str
    method: str
    path: str
    body: Any = NO_BODY
    """bytes: sent as they are; anything else but NO_BODY: sent as JSON."""
    status: int = 400
    detail: str = ""
    """A piece of the problem's detail (case-insensitive): what was wrong."""
    headers: dict[str, str] = attrs.field(factory=dict)
    bug: str | None = None
    """A known server bug this case shows (the case is expected to fail until it is fixed)."""


RUN, STREAM, CONTROL, DECIDE = f"/sessions/{W}/runs", f"/sessions/{W}/runs/stream", f"/sessions/{W}/control", \
    f"/sessions/{W}/approvals/c0"
POSTS = {  # route -> a valid body (to which an unknown field is added)
    "create": ("/sessions", {"task": "x"}),
    "run": (RUN, {}),
    "run-stream": (STREAM, {}),
    "control": (CONTROL, {"kind": "cancel"}),
    "approve": (DECIDE, {"decision": "approve"}),
    "login": ("/auth/login", {"token": TOKEN}),
}

BUG_SID = ("app.py _check_sid refuses only CR, LF, NUL and '/' in a session id: TAB, ESC, DEL ... pass "
           "(ESC: the session is created, then its Location header makes aiohttp drop the connection)")
BUG_FALSY_LIMITS = "app.py _start_run: `data.get('limits') or {}` takes [], 0, false, \"\" for no limits and resumes"
BUG_LIMIT_TYPES = ("app.py _start_run checks limits only with attrs.evolve(RunConfig), which checks no types: "
                   "wrongly typed limits are accepted and the resume runs with them (or a bare TypeError text)")
BUG_HUGE_SEQ = ("app.py _Server._after has no upper bound: a seq past SQLite's INTEGER range raises OverflowError "
                "after the 200 event-stream headers went out; the stream is cut instead of a 400")
BUG_IS_ERROR = "app.py _Server._decision checks 'is_error' only for a respond: approve/reject take any is_error"


def _generic() -> list[Case]:
    out: list[Case] = []
    for name, (path, valid) in POSTS.items():
        out += [
            Case(f"{name}-malformed-json", "POST", path, b'{"task": ', detail="not valid JSON"),
            Case(f"{name}-json-array", "POST", path, [valid], detail="JSON object"),
            Case(f"{name}-json-string", "POST", path, "x", detail="JSON object"),
            Case(f"{name}-json-null", "POST", path, b"null", detail="JSON object"),
            Case(f"{name}-not-utf8", "POST", path, b'{"task": "\xff\xfe"}', detail="not valid JSON"),
            Case(f"{name}-lone-surrogate", "POST", path, b'{"task": "\\ud800"}', detail="not valid JSON"),
            Case(f"{name}-too-deep", "POST", path, b"[" * 2000 + b"]" * 2000, detail="not valid JSON"),
            Case(f"{name}-unknown-field", "POST", path, {**valid, "bogus": 1}, detail="'bogus'"),
            Case(f"{name}-over-max-body", "POST", path, {**valid, "pad": "x" * 10_240}, 413, str(MAX_BODY)),
            Case(f"{name}-over-max-body-raw", "POST", path, b"x" * 10_240, 413, str(MAX_BODY)),
        ]
    return out


CASES: list[Case] = _generic() + [
    # POST /sessions
    Case("create-empty-body", "POST", "/sessions", b"", detail="'task' is required"),
    Case("create-task-int", "POST", "/sessions", {"task": 5}, detail="'task'"),
    Case("create-task-empty", "POST", "/sessions", {"task": ""}, detail="'task'"),
    Case("create-task-null", "POST", "/sessions", {"task": None}, detail="'task' is required"),
    Case("create-task-list", "POST", "/sessions", {"task": ["x"]}, detail="'task'"),
    Case("create-sid-int", "POST", "/sessions", {"task": "x", "session_id": 5}, detail="'session_id'"),
    Case("create-sid-empty", "POST", "/sessions", {"task": "x", "session_id": ""}, detail="'session_id'"),
    Case("create-sid-too-long", "POST", "/sessions", {"task": "x", "session_id": LONG_ID}, detail="200"),
    Case("create-sid-lf", "POST", "/sessions", {"task": "x", "session_id": "a\nb"}, detail="session id"),
    Case("create-sid-cr", "POST", "/sessions", {"task": "x", "session_id": "a\rb"}, detail="session id"),
    Case("create-sid-nul", "POST", "/sessions", {"task": "x", "session_id": "a\x00b"}, detail="session id"),
    Case("create-sid-slash", "POST", "/sessions", {"task": "x", "session_id": "a/b"}, detail="session id"),
    Case("create-sid-tab", "POST", "/sessions", {"task": "x", "session_id": "a\tb"}, detail="session id", bug=BUG_SID),
    Case("create-sid-esc", "POST", "/sessions", {"task": "x", "session_id": "a\x1b[31mb"}, detail="session id",
         bug=BUG_SID),
    Case("create-sid-del", "POST", "/sessions", {"task": "x", "session_id": "a\x7fb"}, detail="session id",
         bug=BUG_SID),
    Case("create-sid-soh", "POST", "/sessions", {"task": "x", "session_id": "a\x01b"}, detail="session id",
         bug=BUG_SID),
    Case("create-existing-sid", "POST", "/sessions", {"task": "x", "session_id": W}, 409, "exists"),
    # POST /sessions/{sid}/runs and /runs/stream
    *[c for p, n in ((RUN, "run"), (STREAM, "run-stream")) for c in (
        Case(f"{n}-task-int", "POST", p, {"task": 5}, detail="'task'"),
        Case(f"{n}-limits-int", "POST", p, {"limits": 3}, detail="'limits'"),
        Case(f"{n}-limits-string", "POST", p, {"limits": "max_iterations=3"}, detail="'limits'"),
        Case(f"{n}-limits-unknown", "POST", p, {"limits": {"nope": 1}}, detail="nope"),
        Case(f"{n}-limits-bad-value", "POST", p, {"limits": {"max_iterations": 0}}, detail="max_iterations"),
        Case(f"{n}-confirm-cancel-string", "POST", p, {"confirm_cancel": "yes"}, detail="'confirm_cancel'"),
        Case(f"{n}-confirm-cancel-int", "POST", p, {"confirm_cancel": 1}, detail="'confirm_cancel'"),
        Case(f"{n}-confirm-cancel-null", "POST", p, {"confirm_cancel": None}, detail="'confirm_cancel'"),
        Case(f"{n}-task-on-existing", "POST", p, {"task": "again"}, 409, "without a task"),
        Case(f"{n}-unknown-session", "POST", p.replace(f"/{W}/", "/ghost/"), {}, 404, "ghost"),
        Case(f"{n}-completed-session", "POST", p.replace(f"/{W}/", f"/{C}/"), {}, 409, "COMPLETED"),
        Case(f"{n}-sid-too-long", "POST", p.replace(f"/{W}/", f"/{LONG_ID}/"), {"task": "x"}, detail="session id"),
        Case(f"{n}-sid-lf", "POST", p.replace(f"/{W}/", "/a%0Ab/"), {"task": "x"}, detail="session id"),
        Case(f"{n}-sid-nul", "POST", p.replace(f"/{W}/", "/a%00b/"), {"task": "x"}, detail="session id"),
        Case(f"{n}-sid-esc", "POST", p.replace(f"/{W}/", "/a%1Bb/"), {"task": "x"}, detail="session id", bug=BUG_SID),
    )],
    Case("run-limits-list", "POST", RUN, {"limits": []}, detail="'limits'", bug=BUG_FALSY_LIMITS),
    Case("run-limits-zero", "POST", RUN, {"limits": 0}, detail="'limits'", bug=BUG_FALSY_LIMITS),
    Case("run-limits-false", "POST", RUN, {"limits": False}, detail="'limits'", bug=BUG_FALSY_LIMITS),
    Case("run-limits-empty-string", "POST", RUN, {"limits": ""}, detail="'limits'", bug=BUG_FALSY_LIMITS),
    Case("run-limits-max-iterations-string", "POST", RUN, {"limits": {"max_iterations": "x"}},
         detail="max_iterations", bug=BUG_LIMIT_TYPES),  # refused, but the detail is a bare TypeError
    Case("run-limits-stream-string", "POST", RUN, {"limits": {"stream": "yes"}}, detail="stream", bug=BUG_LIMIT_TYPES),
    Case("run-limits-temperature-string", "POST", RUN, {"limits": {"temperature": "hot"}}, detail="temperature",
         bug=BUG_LIMIT_TYPES),
    Case("run-limits-max-iterations-float", "POST", RUN, {"limits": {"max_iterations": 1.5}},
         detail="max_iterations", bug=BUG_LIMIT_TYPES),
    Case("run-limits-output-schema-dict", "POST", RUN, {"limits": {"output_schema": {"type": "object"}}},
         detail="output_schema", bug=BUG_LIMIT_TYPES),
    # POST /sessions/{sid}/control
    Case("control-empty-body", "POST", CONTROL, b"", detail="'kind' is required"),
    Case("control-kind-list", "POST", CONTROL, {"kind": []}, detail="'kind'"),
    Case("control-kind-int", "POST", CONTROL, {"kind": 5}, detail="'kind'"),
    Case("control-kind-null", "POST", CONTROL, {"kind": None}, detail="'kind' is required"),
    Case("control-kind-unknown", "POST", CONTROL, {"kind": "shout"}, detail="'kind' must be one of"),
    Case("control-text-object", "POST", CONTROL, {"kind": "steer", "text": {}}, detail="'text'"),
    Case("control-text-int", "POST", CONTROL, {"kind": "followup", "text": 5}, detail="'text'"),
    Case("control-steer-without-text", "POST", CONTROL, {"kind": "steer"}, detail="needs 'text'"),
    Case("control-followup-empty-text", "POST", CONTROL, {"kind": "followup", "text": ""}, detail="'text'"),
    Case("control-idempotency-key-too-long", "POST", CONTROL, {"kind": "cancel"}, detail="Idempotency-Key",
         headers={"Idempotency-Key": "k" * 201}),
    Case("control-idempotency-key-empty", "POST", CONTROL, {"kind": "cancel"}, detail="Idempotency-Key",
         headers={"Idempotency-Key": ""}),
    Case("control-interrupt-not-running", "POST", CONTROL, {"kind": "interrupt"}, 409, "nothing to interrupt"),
    Case("control-completed-session", "POST", f"/sessions/{C}/control", {"kind": "cancel"}, 409, "COMPLETED"),
    Case("control-unknown-session", "POST", "/sessions/ghost/control", {"kind": "cancel"}, 404, "ghost"),
    Case("control-sid-too-long", "POST", f"/sessions/{LONG_ID}/control", {"kind": "cancel"}, detail="session id"),
    Case("control-sid-cr", "POST", "/sessions/a%0Db/control", {"kind": "cancel"}, detail="session id"),
    # POST /sessions/{sid}/approvals/{call_id}
    Case("approve-empty-body", "POST", DECIDE, b"", detail="'decision' is required"),
    Case("approve-decision-null", "POST", DECIDE, {"decision": None}, detail="'decision' is required"),
    Case("approve-decision-int", "POST", DECIDE, {"decision": 5}, detail="'decision'"),
    Case("approve-decision-unknown", "POST", DECIDE, {"decision": "maybe"}, detail="'decision' must be one of"),
    Case("approve-edit-arguments-string", "POST", DECIDE, {"decision": "edit", "arguments": "x"}, detail="arguments"),
    Case("approve-edit-arguments-null", "POST", DECIDE, {"decision": "edit", "arguments": None}, detail="arguments"),
    Case("approve-edit-arguments-list", "POST", DECIDE, {"decision": "edit", "arguments": ["to"]},
         detail="arguments"),
    Case("approve-arguments-on-approve", "POST", DECIDE, {"decision": "approve", "arguments": {}},
         detail="'arguments' belongs to an edit"),
    Case("approve-message-int", "POST", DECIDE, {"decision": "reject", "message": 5}, detail="'message'"),
    Case("approve-respond-without-message", "POST", DECIDE, {"decision": "respond"}, detail="'message'"),
    Case("approve-respond-is-error-string", "POST", DECIDE, {"decision": "respond", "message": "m",
                                                              "is_error": "yes"}, detail="'is_error'"),
    Case("approve-edit-schema-wrong-type", "POST", DECIDE, {"decision": "edit", "arguments": {"to": 5}},
         detail="'arguments'"),
    Case("approve-edit-schema-missing", "POST", DECIDE, {"decision": "edit", "arguments": {}}, detail="to"),
    Case("approve-not-allowed-kind", "POST", DECIDE, {"decision": "respond", "message": "done"}, 409,
         "allows approve, reject, edit"),
    Case("approve-unknown-call", "POST", f"/sessions/{W}/approvals/zz", {"decision": "approve"}, 404, "pending: c0"),
    Case("approve-call-on-completed", "POST", f"/sessions/{C}/approvals/c0", {"decision": "approve"}, 409,
         "not WAITING_HUMAN"),
    Case("approve-other-call-on-completed", "POST", f"/sessions/{C}/approvals/zz", {"decision": "reject"}, 409,
         "not WAITING_HUMAN"),
    Case("approve-call-id-too-long", "POST", f"/sessions/{W}/approvals/{'z' * 201}", {"decision": "approve"},
         detail="call id"),
    Case("approve-unknown-session", "POST", "/sessions/ghost/approvals/c0", {"decision": "approve"}, 404, "ghost"),
    Case("approve-sid-too-long", "POST", f"/sessions/{LONG_ID}/approvals/c0", {"decision": "approve"},
         detail="session id"),
    Case("approve-is-error-on-approve", "POST", DECIDE, {"decision": "approve", "is_error": "yes"},
         detail="'is_error'", bug=BUG_IS_ERROR),
    Case("approve-is-error-on-reject", "POST", DECIDE, {"decision": "reject", "is_error": 5},
         detail="'is_error'", bug=BUG_IS_ERROR),
    # POST /auth/login
    Case("login-empty-body", "POST", "/auth/login", b"", detail="'token' is required"),
    Case("login-token-int", "POST", "/auth/login", {"token": 5}, detail="'token'"),
    Case("login-token-empty", "POST", "/auth/login", {"token": ""}, detail="'token'"),
    Case("login-token-list", "POST", "/auth/login", {"token": [TOKEN]}, detail="'token'"),
    Case("login-token-too-long", "POST", "/auth/login", {"token": "t" * 1001}, detail="'token'"),
    Case("login-token-wrong", "POST", "/auth/login", {"token": "tok-zzzzzzzzzzzzzzzzzzzz"}, 401, "not valid"),
    # GET /sessions/{sid}/events
    Case("events-last-event-id-negative", "GET", f"/sessions/{W}/events", headers={"Last-Event-ID": "-1"},
         detail=">= 0"),
    Case("events-last-event-id-text", "GET", f"/sessions/{W}/events", headers={"Last-Event-ID": "abc"},
         detail="'abc'"),
    Case("events-last-event-id-float", "GET", f"/sessions/{W}/events", headers={"Last-Event-ID": "1.5"},
         detail="'1.5'"),
    Case("events-after-negative", "GET", f"/sessions/{W}/events?after=-1", detail=">= 0"),
    Case("events-after-text", "GET", f"/sessions/{W}/events?after=abc", detail="'abc'"),
    Case("events-after-empty", "GET", f"/sessions/{W}/events?after=", detail="event seq"),
    Case("events-last-event-id-huge", "GET", f"/sessions/{W}/events", headers={"Last-Event-ID": "9" * 20},
         detail="Last-Event-ID", bug=BUG_HUGE_SEQ),
    Case("events-after-huge", "GET", f"/sessions/{W}/events?after={2 ** 63}", detail="after", bug=BUG_HUGE_SEQ),
    Case("events-unknown-session", "GET", "/sessions/ghost/events", status=404, detail="ghost"),
    Case("events-sid-too-long", "GET", f"/sessions/{LONG_ID}/events", detail="session id"),
    # GET /sessions
    Case("list-limit-zero", "GET", "/sessions?limit=0", detail="limit"),
    Case("list-limit-over", "GET", "/sessions?limit=1001", detail="limit"),
    Case("list-limit-negative", "GET", "/sessions?limit=-5", detail="limit"),
    Case("list-limit-text", "GET", "/sessions?limit=x", detail="limit"),
    Case("list-limit-float", "GET", "/sessions?limit=2.5", detail="limit"),
    Case("list-unknown-param", "GET", "/sessions?bogus=1", detail="bogus"),
    Case("list-param-wrong-case", "GET", "/sessions?State=COMPLETED", detail="State"),
    Case("list-unknown-param-with-known", "GET", "/sessions?limit=5&offset=10", detail="offset"),
    # GET /sessions/{sid}/diagram
    Case("diagram-format-svg", "GET", f"/sessions/{W}/diagram?format=svg", detail="format"),
    Case("diagram-format-empty", "GET", f"/sessions/{W}/diagram?format=", detail="format"),
    Case("diagram-format-upper", "GET", f"/sessions/{W}/diagram?format=JSON", detail="format"),
    Case("diagram-unknown-session", "GET", "/sessions/ghost/diagram", status=404, detail="ghost"),
    # GET /sessions/{sid}
    Case("snapshot-unknown-session", "GET", "/sessions/ghost", status=404, detail="ghost"),
    Case("snapshot-sid-too-long", "GET", f"/sessions/{LONG_ID}", detail="session id"),
    Case("snapshot-sid-lf", "GET", "/sessions/a%0Ab", detail="session id"),
    Case("snapshot-sid-nul", "GET", "/sessions/a%00b", detail="session id"),
    Case("snapshot-sid-encoded-slash", "GET", "/sessions/a%2Fb", detail="session id"),
    Case("snapshot-sid-tab", "GET", "/sessions/a%09b", detail="session id", bug=BUG_SID),
    Case("snapshot-sid-esc", "GET", "/sessions/a%1Bb", detail="session id", bug=BUG_SID),
    Case("snapshot-sid-del", "GET", "/sessions/a%7Fb", detail="session id", bug=BUG_SID),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
PROBLEM_KEYS = {"type", "title", "status", "detail", "instance"}


async def send(srv: Srv, case: Case) -> tuple[int, str, dict[str, Any], dict[str, str]]:
    """The status, content type, JSON body and headers of the answer (status -1: no complete answer)."""
    kw: dict[str, Any] = {"headers": {**AUTH, **case.headers}}
    if isinstance(case.body, bytes):
        kw["data"] = case.body
        kw["headers"]["Content-Type"] = "application/json"
    elif case.body is not NO_BODY:
        kw["data"] = orjson.dumps(case.body)
        kw["headers"]["Content-Type"] = "application/json"
    try:
        r = await srv.client.request(case.method, case.path, **kw)
        raw = await asyncio.wait_for(r.read(), 10)
    except (ClientError, TimeoutError) as e:
        return -1, "", {"no complete answer": repr(e)}, {}
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        doc = {"not JSON": raw[:300].decode("utf-8", "replace")}
    return r.status, r.content_type, doc if isinstance(doc, dict) else {"not an object": doc}, dict(r.headers)


def check_problem(case: Case, status: int, ctype: str, doc: dict[str, Any], headers: dict[str, str]) -> None:
    assert status == case.status, f"expected {case.status}, got {status}: {doc}"
    assert ctype == "application/problem+json", (ctype, doc)
    assert PROBLEM_KEYS <= set(doc), f"missing {PROBLEM_KEYS - set(doc)}: {doc}"
    assert doc["status"] == status and isinstance(doc["type"], str) and doc["type"]
    assert isinstance(doc["title"], str) and doc["title"]
    assert doc["instance"] == urllib.parse.unquote(case.path.split("?")[0])
    assert isinstance(doc["detail"], str) and case.detail.lower() in doc["detail"].lower(), \
        f"the detail should say {case.detail!r}: {doc['detail']!r}"
    assert "Location" not in headers
    if status == 401:
        assert headers["WWW-Authenticate"].startswith("Bearer ")


async def run_case(srv: Srv, case: Case) -> None:
    before = dump(srv.db)
    status, ctype, doc, headers = await send(srv, case)
    await asyncio.sleep(0.01)
    await srv.idle("ghost")
    changed = {t for t, rows in dump(srv.db).items() if rows != before[t]}
    check_problem(case, status, ctype, doc, headers)
    assert not changed, f"the request changed the store's {sorted(changed)}"
    assert RAN == [], f"the tool ran: {RAN}"


@pytest.mark.parametrize("case", [c for c in CASES if c.bug is None], ids=lambda c: c.id)
async def test_bad_input_is_a_problem_and_changes_nothing(shared: Srv, case: Case) -> None:
    await run_case(shared, case)


async def test_after_the_whole_table_nothing_changed(shared: Srv) -> None:
    """Runs after the table (file order): the store equals its first state and the tool never ran."""
    await asyncio.sleep(0.1)
    await shared.idle("ghost")
    now = dump(shared.db)
    assert {t for t in TABLES if now[t] != shared.baseline[t]} == set()
    assert RAN == []
    assert [r[0] for r in now["sessions"]] == [C, W] and now["ledger"] == shared.baseline["ledger"]
    r = await shared.client.get(f"/sessions/{W}", headers=AUTH)
    snap = await r.json()
    assert snap["state"] == "WAITING_HUMAN" and [p["call"]["id"] for p in snap["pending_approvals"]] == ["c0"]


@pytest.mark.parametrize("case", [c for c in CASES if c.bug is not None], ids=lambda c: c.id)
async def test_inputs_that_were_bugs(tmp_path: Path, case: Case) -> None:
    """Cases that found bugs (``case.bug`` says which); each on a server of its own, so that a
    regression that changes the store cannot spoil the shared table."""
    srv = await start(tmp_path / "s.db")
    try:
        await run_case(srv, case)
    finally:
        await srv.client.close()
        RAN.clear()  # a bug case may run the tool on its own server; the shared server's check is separate
