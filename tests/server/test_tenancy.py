"""Tenants, sign-in, cross-site checks, CORS and secrets, over HTTP.

* Tenant isolation on every route that takes a session id: Bob (bearer token or sign-in cookie)
  gets the same 404 problem document for Alice's sessions as for a session that does not exist,
  and nothing of Alice's changes (every row of the store is compared; the tool never runs).
  ``GET /sessions`` lists only the caller's sessions.
* No token -> 401 with ``WWW-Authenticate`` on every non-public route; a wrong token -> 401; the
  public routes answer without one.
* Cookie sign-in: ``fsm_auth`` (HttpOnly, SameSite=Strict) and ``fsm_csrf``; reads and the SSE
  stream work with the cookie alone; a POST needs ``X-CSRF-Token``; a cross-site POST is 403 even
  with both; a bearer POST needs no CSRF header. The same cross-site rule holds without tokens.
* CORS is off by default; with ``cors_origins`` the listed origin's preflight gets 204, another 403.
* :func:`check_bind` refuses a non-loopback address without tokens.
* A provider API key echoed in a provider error appears in no response, event or page.
"""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import DummyCookieJar
from aiohttp.test_utils import TestClient, TestServer
from providers.test_error_secrets import KEYS, assert_nowhere, echoing

from fsm_agent.agent import Agent
from fsm_agent.errors import ConfigurationError
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider
from fsm_agent.providers.errors import REDACTED
from fsm_agent.server import create_app
from fsm_agent.server.app import RUNNER_KEY
from fsm_agent.server.auth import AUTH_COOKIE, CSRF_COOKIE, CSRF_HEADER, Tenants, check_bind
from fsm_agent.store import SQLiteStore
from fsm_agent.testing import ReplayServer

from . import common
from .common import RAN, dump

ALICE_TOKEN = "tok-aaaaaaaaaaaaaaaaaaaa"
BOB_TOKEN = "tok-bbbbbbbbbbbbbbbbbbbb"
TOKENS = {ALICE_TOKEN: "alice", BOB_TOKEN: "bob"}
ALICE = {"Authorization": f"Bearer {ALICE_TOKEN}"}
BOB = {"Authorization": f"Bearer {BOB_TOKEN}"}
WAIT, DONE, NONE = "s-wait", "s-done", "s-none"
"""Alice's WAITING_HUMAN session, her COMPLETED session, and an id no one has."""
GOAL_WAIT, GOAL_DONE = "mail the quarterly figures", "say hello politely"
EVIL = "https://evil.example"

def approval_agent(store: Any) -> Agent:
    """The first model call asks for ``send_mail`` (held for approval); every later one answers text."""
    return common.approval_agent(store, repeat_last=True)


class Srv:
    """A test server over a SQLite file; cookies are sent only when a request says so."""

    def __init__(self, client: TestClient, db: Path) -> None:
        self.client, self.db = client, db

    @property
    def runner(self) -> Any:
        return self.client.server.app[RUNNER_KEY]

    def origin(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    async def close(self) -> None:
        await self.client.close()


async def serve(tmp_path: Path, factory: Any = approval_agent, tenants: Tenants | None = None, **kw: Any) -> Srv:
    db = tmp_path / "s.db"
    app = create_app(factory, SQLiteStore(db), tenants=Tenants(TOKENS) if tenants is None else tenants, **kw)
    client = TestClient(TestServer(app, host="127.0.0.1"), cookie_jar=DummyCookieJar())
    await client.start_server()
    return Srv(client, db)


async def wait_state(srv: Srv, sid: str, state: str, headers: dict[str, str] | None = None,
                     timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    snap: dict[str, Any] = {}
    while time.monotonic() < deadline:
        snap = await (await srv.client.get(f"/sessions/{sid}", headers=headers or ALICE)).json()
        if snap.get("state") == state and not snap.get("running"):
            return snap
        await asyncio.sleep(0.01)
    raise AssertionError(f"{sid} did not reach {state}: {snap}")


async def alice_sessions(srv: Srv) -> None:
    """Alice's WAITING_HUMAN session (pending call c0) and her COMPLETED one; Bob's own COMPLETED one."""
    r = await srv.client.post("/sessions", json={"task": GOAL_WAIT, "session_id": WAIT}, headers=ALICE)
    assert r.status == 201, await r.text()
    snap = await wait_state(srv, WAIT, "WAITING_HUMAN")
    assert [p["call"]["id"] for p in snap["pending_approvals"]] == ["c0"]
    r = await srv.client.post("/sessions", json={"task": GOAL_DONE, "session_id": DONE}, headers=ALICE)
    assert r.status == 201, await r.text()
    await wait_state(srv, DONE, "COMPLETED")
    r = await srv.client.post("/sessions", json={"task": "bob's own", "session_id": "bob-own"}, headers=BOB)
    assert r.status == 201, await r.text()
    await wait_state(srv, "bob-own", "COMPLETED", BOB)


async def settle(srv: Srv, *sids: str) -> None:
    """Give a wrongly started run the time to show, then check that nothing runs."""
    await asyncio.sleep(0.05)
    for sid in sids:
        assert not await srv.runner.busy(sid), f"a run of {sid} was started"


async def login(srv: Srv, token: str) -> dict[str, str]:
    """Sign in; returns the cookie values (``fsm_auth``, ``fsm_csrf``)."""
    r = await srv.client.post("/auth/login", json={"token": token})
    assert r.status == 200, await r.text()
    return {k: m.value for k, m in r.cookies.items()}


def cookie_header(cookies: dict[str, str]) -> dict[str, str]:
    return {"Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())}


async def bob_headers(srv: Srv, auth: str) -> dict[str, str]:
    if auth == "bearer":
        return dict(BOB)
    cookies = await login(srv, BOB_TOKEN)
    return {**cookie_header(cookies), CSRF_HEADER: cookies[CSRF_COOKIE]}


# -- tenant isolation on every route -------------------------------------------------------------------------
ROUTES: list[tuple[str, str, str, Any, dict[str, str]]] = [
    # id, method, path ({sid} is filled in), JSON body, extra headers
    ("snapshot", "GET", "/sessions/{sid}", None, {}),
    ("run", "POST", "/sessions/{sid}/runs", {}, {}),
    ("run-limits", "POST", "/sessions/{sid}/runs", {"limits": {"max_iterations": 5}}, {}),
    ("run-confirm-cancel", "POST", "/sessions/{sid}/runs", {"confirm_cancel": True}, {}),
    ("run-stream", "POST", "/sessions/{sid}/runs/stream", {}, {}),
    ("events", "GET", "/sessions/{sid}/events", None, {}),
    ("events-last-event-id", "GET", "/sessions/{sid}/events", None, {"Last-Event-ID": "2"}),
    ("events-after", "GET", "/sessions/{sid}/events?after=1", None, {}),
    ("control-cancel", "POST", "/sessions/{sid}/control", {"kind": "cancel", "text": "stop"}, {}),
    ("control-steer-idempotent", "POST", "/sessions/{sid}/control", {"kind": "steer", "text": "hi"},
     {"Idempotency-Key": "k1"}),
    ("control-interrupt", "POST", "/sessions/{sid}/control", {"kind": "interrupt"}, {}),
    ("control-followup", "POST", "/sessions/{sid}/control", {"kind": "followup", "text": "more"}, {}),
    ("approve", "POST", "/sessions/{sid}/approvals/c0", {"decision": "approve"}, {}),
    ("edit", "POST", "/sessions/{sid}/approvals/c0", {"decision": "edit", "arguments": {"to": "bob@x"}}, {}),
    ("respond", "POST", "/sessions/{sid}/approvals/c0", {"decision": "respond", "message": "sent"}, {}),
    ("reject-unknown-call", "POST", "/sessions/{sid}/approvals/zz", {"decision": "reject"}, {}),
    ("diagram", "GET", "/sessions/{sid}/diagram", None, {}),
    ("diagram-json", "GET", "/sessions/{sid}/diagram?format=json", None, {}),
]


def _normalised(value: Any, sid: str) -> Any:
    if isinstance(value, str):
        return value.replace(sid, "{sid}")
    if isinstance(value, dict):
        return {k: _normalised(v, sid) for k, v in value.items()}
    return value


async def answer(srv: Srv, route: tuple[str, str, str, Any, dict[str, str]], sid: str,
                 headers: dict[str, str]) -> tuple[int, dict[str, Any], dict[str, str], bytes]:
    """The status, problem document and headers (with ``sid`` replaced by ``{sid}``), and the raw body."""
    _, method, path, body, extra = route
    kw: dict[str, Any] = {"headers": {**headers, **extra}}
    if body is not None:
        kw["json"] = body
    r = await srv.client.request(method, path.format(sid=sid), **kw)
    raw = await asyncio.wait_for(r.read(), 10)
    doc = orjson.loads(raw) if r.content_type == "application/problem+json" else {"not a problem": raw.decode()}
    hdrs = {k: v for k, v in r.headers.items() if k not in ("Date", "Content-Length")}
    return r.status, _normalised(doc, sid), _normalised(hdrs, sid), raw


@pytest.mark.parametrize("auth", ["bearer", "cookie"])
@pytest.mark.parametrize("route", ROUTES, ids=[r[0] for r in ROUTES])
async def test_another_tenants_session_is_404_like_a_missing_one_and_is_left_alone(tmp_path, route, auth) -> None:
    srv = await serve(tmp_path)
    try:
        await alice_sessions(srv)
        before = dump(srv.db)
        bob = await bob_headers(srv, auth)
        missing = await answer(srv, route, NONE, bob)
        assert missing[0] == 404, missing
        assert missing[1]["status"] == 404 and missing[1]["instance"] == route[2].split("?")[0]
        for sid in (WAIT, DONE):
            got = await answer(srv, route, sid, bob)
            assert got[:3] == missing[:3], f"{sid}: {got[:3]} differs from a missing session's {missing[:3]}"
            for secret in ("alice", GOAL_WAIT, GOAL_DONE, "WAITING_HUMAN", "COMPLETED", "c0@", "a0@x"):
                assert secret.encode() not in got[3], f"{secret!r} leaked to bob: {got[3]!r}"
        await settle(srv, WAIT, DONE, NONE)
        assert dump(srv.db) == before
        assert RAN == []
        # Alice still sees her session as it was: WAITING_HUMAN on c0, nothing decided
        snap = await wait_state(srv, WAIT, "WAITING_HUMAN")
        assert [p["call"]["id"] for p in snap["pending_approvals"]] == ["c0"]
    finally:
        await srv.close()


async def test_alice_reaches_every_read_route_of_her_own_sessions(tmp_path) -> None:
    """The 404s above come from the tenant check, not from routes that do not work."""
    srv = await serve(tmp_path)
    try:
        await alice_sessions(srv)
        for path in ("/sessions/{sid}", "/sessions/{sid}/events", "/sessions/{sid}/diagram",
                     "/sessions/{sid}/diagram?format=json"):
            for sid in (WAIT, DONE):
                r = await srv.client.get(path.format(sid=sid), headers=ALICE)
                assert r.status == 200, (path, sid, await r.text())
                await asyncio.wait_for(r.read(), 10)
        r = await srv.client.post(f"/sessions/{WAIT}/approvals/zz", json={"decision": "approve"}, headers=ALICE)
        assert r.status == 404 and "pending: c0" in (await r.json())["detail"]  # her own: named pending calls
    finally:
        await srv.close()


async def test_a_taken_session_id_is_refused_without_telling_whose_it_is(tmp_path) -> None:
    """Session ids are global: Bob cannot create one Alice has (409). The answer is the one Bob gets for
    an id of his own, says nothing about the session, and changes nothing."""
    srv = await serve(tmp_path)
    try:
        await alice_sessions(srv)
        before = dump(srv.db)
        for sid in (WAIT, DONE):
            r = await srv.client.post("/sessions", json={"task": "take it", "session_id": sid}, headers=BOB)
            own = await srv.client.post("/sessions", json={"task": "take it", "session_id": "bob-own"}, headers=BOB)
            body, own_body = await r.json(), await own.json()
            assert r.status == own.status == 409
            assert _normalised(body, sid) == _normalised(own_body, "bob-own")
            r = await srv.client.post(f"/sessions/{sid}/runs", json={"task": "take it"}, headers=BOB)
            assert r.status == 409
            text = await r.text()
            for secret in ("alice", GOAL_WAIT, GOAL_DONE, "WAITING_HUMAN", "COMPLETED"):
                assert secret not in text
        await settle(srv, WAIT, DONE)
        assert dump(srv.db) == before and RAN == []
    finally:
        await srv.close()


async def test_the_session_list_shows_only_the_callers_sessions(tmp_path) -> None:
    srv = await serve(tmp_path)
    try:
        await alice_sessions(srv)
        for auth in ("bearer", "cookie"):
            bob = await bob_headers(srv, auth)
            for query in ("", "?state=WAITING_HUMAN", "?state=COMPLETED", "?limit=1000"):
                r = await srv.client.get(f"/sessions{query}", headers=bob)
                assert r.status == 200
                raw = await r.read()
                ids = [s["session_id"] for s in orjson.loads(raw)["sessions"]]
                assert WAIT not in ids and DONE not in ids, (query, ids)
                assert b"alice" not in raw and GOAL_WAIT.encode() not in raw
                assert ids == ([] if query == "?state=WAITING_HUMAN" else ["bob-own"])
        r = await srv.client.get("/sessions", headers=ALICE)
        assert sorted(s["session_id"] for s in (await r.json())["sessions"]) == [DONE, WAIT]
    finally:
        await srv.close()


# -- authentication ------------------------------------------------------------------------------------------
PROTECTED = [
    ("POST", "/sessions", {"task": "x"}),
    ("GET", "/sessions", None),
    ("GET", f"/sessions/{WAIT}", None),
    ("GET", f"/sessions/{NONE}", None),
    ("POST", f"/sessions/{WAIT}/runs", {}),
    ("POST", f"/sessions/{NONE}/runs", {"task": "x"}),
    ("POST", f"/sessions/{WAIT}/runs/stream", {}),
    ("GET", f"/sessions/{WAIT}/events", None),
    ("GET", f"/sessions/{WAIT}/events?after=1", None),
    ("POST", f"/sessions/{WAIT}/control", {"kind": "cancel"}),
    ("POST", f"/sessions/{WAIT}/approvals/c0", {"decision": "approve"}),
    ("GET", f"/sessions/{WAIT}/diagram", None),
    ("GET", f"/sessions/{WAIT}/diagram?format=json", None),
]
BAD_CREDENTIALS = {
    "none": {},
    "wrong-token": {"Authorization": "Bearer tok-cccccccccccccccccccc"},
    "empty-bearer": {"Authorization": "Bearer "},
    "basic": {"Authorization": "Basic " + base64.b64encode(f"alice:{ALICE_TOKEN}".encode()).decode()},
    "token-without-scheme": {"Authorization": ALICE_TOKEN},
    "forged-cookie": {"Cookie": f"{AUTH_COOKIE}=YWxpY2U.9999999999.deadbeef"},
}


@pytest.mark.parametrize("creds", sorted(BAD_CREDENTIALS))
async def test_every_non_public_route_needs_a_valid_token(tmp_path, creds) -> None:
    srv = await serve(tmp_path)
    try:
        await alice_sessions(srv)
        before = dump(srv.db)
        for method, path, body in PROTECTED:
            kw: dict[str, Any] = {"headers": BAD_CREDENTIALS[creds]}
            if body is not None:
                kw["json"] = body
            r = await srv.client.request(method, path, **kw)
            assert r.status == 401, (method, path, r.status, await r.text())
            assert r.content_type == "application/problem+json"
            assert r.headers["WWW-Authenticate"].startswith("Bearer ")
            doc = await r.json()
            assert doc["status"] == 401 and doc["instance"] == path.split("?")[0] and doc["detail"]
        await settle(srv, WAIT, DONE, NONE)
        assert dump(srv.db) == before and RAN == []
    finally:
        await srv.close()


async def test_an_expired_cookie_and_a_cookie_of_other_tokens_are_refused(tmp_path) -> None:
    srv = await serve(tmp_path)
    try:
        await alice_sessions(srv)
        tenants = Tenants(TOKENS)
        expired = tenants.cookie_for("alice", now=time.time() - 13 * 3600)
        other = Tenants({"tok-zzzzzzzzzzzzzzzzzzzz": "alice"}).cookie_for("alice")
        # a cookie re-signed for another tenant's name by hand: the MAC no longer matches
        body, _, mac = tenants.cookie_for("alice").rpartition(".")
        b64, _, expiry = body.partition(".")
        swapped = f"{base64.urlsafe_b64encode(b'bob').decode()}.{expiry}.{mac}"
        for cookie in (expired, other, swapped):
            r = await srv.client.get(f"/sessions/{WAIT}", headers={"Cookie": f"{AUTH_COOKIE}={cookie}"})
            assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer ")
            assert "expired or is not valid" in (await r.json())["detail"]
    finally:
        await srv.close()


async def test_public_routes_need_no_token(tmp_path) -> None:
    srv = await serve(tmp_path)
    try:
        await alice_sessions(srv)
        for path in ("/healthz", "/openapi.json", f"/review/{WAIT}", "/static/review.js"):
            r = await srv.client.get(path)
            assert r.status == 200, (path, await r.text())
            body = await r.read()
            assert GOAL_WAIT.encode() not in body  # the page is static: the session's data comes with a sign-in
        assert (await (await srv.client.get("/healthz")).json()) == {"status": "ok"}
        assert "paths" in await (await srv.client.get("/openapi.json")).json()
        r = await srv.client.post("/auth/login", json={"token": "tok-cccccccccccccccccccc"})
        assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer ")
        assert AUTH_COOKIE not in r.cookies
    finally:
        await srv.close()


# -- cookie sign-in, CSRF and cross-site requests ------------------------------------------------------------
async def test_login_sets_an_httponly_strict_auth_cookie_and_a_csrf_cookie(tmp_path) -> None:
    srv = await serve(tmp_path)
    try:
        r = await srv.client.post("/auth/login", json={"token": ALICE_TOKEN})
        assert r.status == 200 and await r.json() == {"tenant": "alice"}
        auth, csrf = r.cookies[AUTH_COOKIE], r.cookies[CSRF_COOKIE]
        assert auth["httponly"] is True and auth["samesite"] == "Strict" and auth["path"] == "/"
        assert csrf["samesite"] == "Strict" and not csrf["httponly"]  # the page's script reads it
        assert ALICE_TOKEN not in auth.value and ALICE_TOKEN not in csrf.value
        assert csrf.value and csrf.value != auth.value
        r = await srv.client.post("/auth/logout", headers=cookie_header({AUTH_COOKIE: auth.value}))
        assert r.status == 200 and r.cookies[AUTH_COOKIE].value == ""  # deleted
    finally:
        await srv.close()


async def test_a_signed_in_page_reads_and_streams_with_the_cookie_and_posts_with_the_csrf_header(tmp_path) -> None:
    srv = await serve(tmp_path)
    try:
        await alice_sessions(srv)
        cookies = await login(srv, ALICE_TOKEN)
        jar = cookie_header(cookies)
        r = await srv.client.get(f"/sessions/{WAIT}", headers=jar)
        assert r.status == 200 and (await r.json())["state"] == "WAITING_HUMAN"
        # EventSource sends no headers but cookies (and Last-Event-ID on a reconnect)
        for extra in ({}, {"Last-Event-ID": "1"}):
            r = await srv.client.get(f"/sessions/{DONE}/events", headers={**jar, **extra})
            assert r.status == 200 and r.content_type == "text/event-stream"
            body = await asyncio.wait_for(r.read(), 10)
            assert b"event: run_stopped" in body and (b"id: 1\n" in body) == (not extra)
        # a POST with the cookie alone: refused (CSRF); with a wrong header: refused; with the right one: done
        for headers in (jar, {**jar, CSRF_HEADER: "0" * 32}, {**jar, CSRF_HEADER: ""},
                        {"Cookie": f"{AUTH_COOKIE}={cookies[AUTH_COOKIE]}", CSRF_HEADER: cookies[CSRF_COOKIE]}):
            r = await srv.client.post("/sessions", json={"task": "x", "session_id": "csrf"}, headers=headers)
            assert r.status == 403 and r.content_type == "application/problem+json", await r.text()
            assert CSRF_HEADER in (await r.json())["detail"]
        assert (await srv.client.get("/sessions/csrf", headers=ALICE)).status == 404  # nothing was created
        ok = {**jar, CSRF_HEADER: cookies[CSRF_COOKIE]}
        r = await srv.client.post("/sessions", json={"task": "x", "session_id": "by-page"}, headers=ok)
        assert r.status == 201 and (await r.json())["tenant"] == "alice"
        # the page's own origin is fine
        r = await srv.client.post("/sessions", json={"task": "x", "session_id": "by-page-2"},
                                  headers={**ok, "Origin": srv.origin(), "Sec-Fetch-Site": "same-origin"})
        assert r.status == 201, await r.text()
        # Bob's CSRF token does not go with Alice's cookie
        bob = await login(srv, BOB_TOKEN)
        r = await srv.client.post("/sessions", json={"task": "x", "session_id": "mixed"},
                                  headers={"Cookie": f"{AUTH_COOKIE}={cookies[AUTH_COOKIE]}; "
                                                     f"{CSRF_COOKIE}={bob[CSRF_COOKIE]}",
                                           CSRF_HEADER: bob[CSRF_COOKIE]})
        assert r.status == 403
    finally:
        await srv.close()


CROSS_SITE = {
    "origin-evil": {"Origin": EVIL},
    "sec-fetch-cross-site": {"Sec-Fetch-Site": "cross-site"},
    "sec-fetch-same-site": {"Sec-Fetch-Site": "same-site"},
    "origin-null": {"Origin": "null"},
    "evil-and-same-origin-label": {"Origin": EVIL, "Sec-Fetch-Site": "same-origin"},
}


@pytest.mark.parametrize("label", sorted(CROSS_SITE))
async def test_a_cross_site_post_is_refused_even_with_cookie_and_csrf_header(tmp_path, label) -> None:
    srv = await serve(tmp_path)
    try:
        await alice_sessions(srv)
        cookies = await login(srv, ALICE_TOKEN)
        before = dump(srv.db)
        ok = {**cookie_header(cookies), CSRF_HEADER: cookies[CSRF_COOKIE], **CROSS_SITE[label]}
        for path, body in (("/sessions", {"task": "x", "session_id": "xs"}),
                           (f"/sessions/{WAIT}/approvals/c0", {"decision": "approve"}),
                           (f"/sessions/{WAIT}/control", {"kind": "cancel"}),
                           (f"/sessions/{WAIT}/runs", {})):
            r = await srv.client.post(path, json=body, headers=ok)
            assert r.status == 403 and r.content_type == "application/problem+json", (path, await r.text())
            assert "refused" in (await r.json())["detail"]
        await settle(srv, WAIT, "xs")
        assert dump(srv.db) == before and RAN == []
    finally:
        await srv.close()


async def test_a_bearer_post_needs_no_csrf_header(tmp_path) -> None:
    srv = await serve(tmp_path)
    try:
        r = await srv.client.post("/sessions", json={"task": "x", "session_id": "b1"}, headers=ALICE)
        assert r.status == 201 and (await r.json())["tenant"] == "alice"
        # a bearer wins over a cookie of another tenant, and needs no CSRF header either
        cookies = await login(srv, BOB_TOKEN)
        r = await srv.client.post("/sessions", json={"task": "x", "session_id": "b2"},
                                  headers={**ALICE, **cookie_header(cookies)})
        assert r.status == 201 and (await r.json())["tenant"] == "alice"
    finally:
        await srv.close()


async def test_a_cross_site_login_is_refused(tmp_path) -> None:
    """Signing a browser in is a state change: a page on another site must not sign the victim in as the
    attacker (login CSRF), which the module's own rule (a POST without a bearer that the browser labels
    cross-site is refused) covers."""
    srv = await serve(tmp_path)
    try:
        for headers in ({"Origin": EVIL}, {"Sec-Fetch-Site": "cross-site"}):
            r = await srv.client.post("/auth/login", json={"token": BOB_TOKEN}, headers=headers)
            assert r.status == 403, (headers, r.status, await r.text())
            assert AUTH_COOKIE not in r.cookies
    finally:
        await srv.close()


async def test_without_tokens_a_cross_site_post_is_refused_and_a_plain_post_works(tmp_path) -> None:
    srv = await serve(tmp_path, tenants=Tenants())
    try:
        for label, headers in CROSS_SITE.items():
            r = await srv.client.post("/sessions", json={"task": "x", "session_id": "xs"}, headers=headers)
            assert r.status == 403 and r.content_type == "application/problem+json", (label, await r.text())
        assert (await srv.client.get("/sessions/xs")).status == 404
        r = await srv.client.post("/sessions", json={"task": "x", "session_id": "plain"})
        assert r.status == 201 and (await r.json())["tenant"] == "default"
        r = await srv.client.post("/sessions", json={"task": "x", "session_id": "same"},
                                  headers={"Origin": srv.origin(), "Sec-Fetch-Site": "same-origin"})
        assert r.status == 201, await r.text()
        assert (await srv.client.get("/sessions/plain")).status == 200  # no sign-in needed to read
        r = await srv.client.post("/auth/login", json={"token": "anything"})
        assert r.status == 200 and "no tokens" in (await r.json())["note"]
    finally:
        await srv.close()


# -- CORS ----------------------------------------------------------------------------------------------------
def _cors_headers(r: Any) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "no-tokens"])
async def test_cors_is_off_by_default(tmp_path, tokens) -> None:
    srv = await serve(tmp_path, tenants=Tenants(TOKENS) if tokens else Tenants())
    try:
        auth = ALICE if tokens else {}
        for origin in ("https://ok.example", EVIL):
            r = await srv.client.options("/sessions", headers={"Origin": origin, **PREFLIGHT})
            assert r.status >= 400 and _cors_headers(r) == {}, (r.status, dict(r.headers))
            r = await srv.client.get("/sessions", headers={"Origin": origin, **auth})
            assert r.status == 200 and _cors_headers(r) == {}
            r = await srv.client.get("/healthz", headers={"Origin": origin})
            assert _cors_headers(r) == {}
    finally:
        await srv.close()


async def test_cors_answers_the_listed_origin_only(tmp_path) -> None:
    srv = await serve(tmp_path, cors_origins=["https://ok.example"])
    try:
        r = await srv.client.options("/sessions", headers={"Origin": "https://ok.example", **PREFLIGHT})
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == "https://ok.example"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
        assert "Origin" in r.headers.get("Vary", "")
        assert "Access-Control-Allow-Credentials" not in r.headers  # cross-origin callers use bearer tokens
        for origin in (EVIL, "https://ok.example.evil.example", "http://ok.example", None):
            r = await srv.client.options("/sessions", headers={**({"Origin": origin} if origin else {}), **PREFLIGHT})
            assert r.status == 403 and r.content_type == "application/problem+json", origin
            assert "Access-Control-Allow-Origin" not in r.headers
        r = await srv.client.post("/sessions", json={"task": "x", "session_id": "cors"},
                                  headers={"Origin": "https://ok.example", **ALICE})
        assert r.status == 201 and r.headers["Access-Control-Allow-Origin"] == "https://ok.example"
        assert "Location" in r.headers["Access-Control-Expose-Headers"]
        r = await srv.client.get("/sessions", headers={"Origin": EVIL, **ALICE})
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        r = await srv.client.get("/sessions", headers={"Origin": "https://ok.example"})
        assert r.status == 401  # CORS lets the origin call; it does not sign anyone in
    finally:
        await srv.close()


# -- binding -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "192.168.1.20", "10.0.0.1", "example.com", ""])
def test_check_bind_refuses_a_non_loopback_address_without_tokens(host) -> None:
    with pytest.raises(ConfigurationError, match="without tokens"):
        check_bind(host, Tenants())
    check_bind(host, Tenants(TOKENS))  # with tokens any host is fine


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_check_bind_lets_loopback_listen_without_tokens(host) -> None:
    check_bind(host, Tenants())
    check_bind(host, Tenants(TOKENS))


# -- the provider's API key ----------------------------------------------------------------------------------
def _fields(cfg: ProviderConfig) -> dict[str, Any]:
    import attrs

    return {f.name: getattr(cfg, f.name) for f in attrs.fields(ProviderConfig)}


@pytest.mark.parametrize("which", sorted(KEYS))
async def test_a_provider_api_key_reaches_no_response_event_or_page(tmp_path, which) -> None:
    """The provider (OpenAI-compatible, on a loopback server) fails with a retried 503 and then a 401 that
    echo the key in their bodies and headers; the sessions stop FAILED; then every route is fetched."""
    key = KEYS[which]
    upstream = ReplayServer(echoing(key), repeat_last=True)
    base = await upstream.start()
    cfg = ProviderConfig(model="m", api_key=key, base_url=base, retry=RetryPolicy(initial_delay=0.01))
    provider = create_provider("openai-compatible", ProviderConfig(**_fields(cfg)))
    srv = await serve(tmp_path, lambda store: Agent(provider, store=store))
    texts: list[str] = []

    async def fetch(method: str, path: str, **kw: Any) -> Any:
        r = await srv.client.request(method, path, headers={**ALICE, **kw.pop("headers", {})}, **kw)
        body = await asyncio.wait_for(r.read(), 10)
        texts.append(f"{r.status} {dict(r.headers)!r}\n" + body.decode("utf-8", "replace"))
        return r, body

    try:
        r, body = await fetch("POST", "/sessions", json={"task": "hi", "session_id": "k1"})
        assert r.status == 201
        snap = await wait_state(srv, "k1", "FAILED_TERMINAL")
        assert snap["stop"]["error"]["kind"] == "authentication" and REDACTED in snap["stop"]["detail"]
        # the key was sent upstream and echoed back: the test is not vacuous
        assert any(key in (q.headers.get("Authorization") or "") for q in upstream.requests)
        # a run followed live on its stream (deltas, retries, the stop)
        r, body = await fetch("POST", "/sessions/k2/runs/stream", json={"task": "hi"})
        assert r.status == 200 and b"event: run_stopped" in body
        await wait_state(srv, "k2", "FAILED_TERMINAL")
        for method, path, kw in [
            ("GET", "/sessions/k1", {}), ("GET", "/sessions/k2", {}), ("GET", "/sessions", {}),
            ("GET", "/sessions?state=FAILED_TERMINAL", {}),
            ("GET", "/sessions/k1/events", {}), ("GET", "/sessions/k1/events?after=1", {}),
            ("GET", "/sessions/k2/events", {"headers": {"Last-Event-ID": "2"}}),
            ("GET", "/sessions/k1/diagram", {}), ("GET", "/sessions/k1/diagram?format=json", {}),
            ("GET", "/review/k1", {}), ("GET", "/static/review.js", {}), ("GET", "/static/review.html", {}),
            ("GET", "/openapi.json", {}), ("GET", "/healthz", {}),
            ("POST", "/sessions/k1/runs", {"json": {}}), ("POST", "/sessions/k1/runs/stream", {"json": {}}),
            ("POST", "/sessions/k1/control", {"json": {"kind": "steer", "text": "again"}}),
            ("POST", "/sessions/k1/approvals/c0", {"json": {"decision": "approve"}}),
        ]:
            await fetch(method, path, **kw)
        await settle(srv, "k1", "k2")
        assert any("authentication" in t for t in texts) and any(REDACTED in t for t in texts)
        assert_nowhere(key, *texts)
    finally:
        await srv.close()
        await provider.aclose()
        await upstream.close()
    assert_nowhere(key, files=(tmp_path,))
