"""The review page in a real Chromium (Debian's /usr/bin/chromium, driven by Playwright for Python).

The app runs on 127.0.0.1 (aiohttp AppRunner/TCPSite, a free port, SQLite in tmp_path) with an
agent whose tool needs approval. Two tabs open /review/{sid}; both show WAITING_HUMAN with the
diagram's active node highlighted and the pending call; a refused click leaves the box (the server
decides); approve in tab 1; both tabs reach COMPLETED with the highlight moved and the box gone
(tab 2 only learns it from the server). Also: the fallback when Mermaid cannot load, and the
sign-in form when the server has tokens (then every POST carries the CSRF header). Once with a
scripted provider (exact path), once with the real local llama.cpp model.

Screenshots go to tmp_path, and to <repo>/test-artifacts/ when FSM_ARTIFACTS is set; their paths
are printed. No browser or no Playwright is a failure naming the package, never a skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from attrs import evolve

from fsm_agent import Agent, Middleware, RunConfig, ScriptedProvider, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.server import create_app
from fsm_agent.store import SQLiteStore
from fsm_agent.tools.demo import calculator
from fsm_agent_middleware.approval import HumanApproval

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "browser-test-token-0123456789"


def _playwright() -> Any:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: install the Debian packages chromium and chromium-driver "
                    "(apt-get update && apt-get install -y chromium chromium-driver)")
    try:
        from playwright import async_api
    except ImportError:
        pytest.fail("Playwright for Python is missing: pip install playwright (in the `dev` extra); "
                    "never run `playwright install`, the test uses /usr/bin/chromium")
    return async_api


@tool
def pay(amount: int, to: str = "shop") -> str:
    """Pay an amount."""
    return f"paid {amount} to {to}"


def scripted_agent(store: Any) -> Agent:
    return Agent(ScriptedProvider([tool_call_response(("pay", {"amount": 5})), "done"]), tools=[pay],
                 middleware=[HumanApproval("pay")], store=store)


class ToolFirstThenAnswer(Middleware):
    """The small model must call a tool first (constrained mode) and answer in text once a tool
    result is in: the run waits for approval, then completes.

    The tool takes a second, as a real one would: the tab that reopened its event stream after
    its click is subscribed before the answer streams. (The server sends live deltas only to a
    stream that is subscribed before the last commit ahead of the model call; one that joins
    later gets the answer from the ``message`` event alone.)"""

    async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
        if any(m.role == "tool" for m in request.messages):
            request = evolve(request, tools=(), tool_choice=None)
        else:
            request = evolve(request, tool_choice="required")
        return await call_next(request)

    async def wrap_tool_call(self, call: Any, call_next: Any, ctx: Any) -> Any:
        await asyncio.sleep(1.5)
        return await call_next(call)


@contextlib.asynccontextmanager
async def serving(agent: Agent, store: Any, **kw: Any) -> AsyncIterator[str]:
    app = create_app(agent, store, **kw)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)  # port 0: the OS picks a free one
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def artifact_dirs(tmp_path: Path) -> list[Path]:
    dirs = [tmp_path / "artifacts"]
    if os.environ.get("FSM_ARTIFACTS"):
        dirs.append(ROOT / "test-artifacts")
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return dirs


async def screenshot(page: Any, tmp_path: Path, name: str) -> None:
    first, *rest = artifact_dirs(tmp_path)
    path = first / name
    await page.screenshot(path=str(path), full_page=True)
    for d in rest:
        shutil.copy2(path, d / name)
    print(f"screenshot: {', '.join(str(d / name) for d in (first, *rest))}")


class Tabs:
    """Pages of one browser context (they share cookies like tabs), with their console errors."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.errors: list[str] = []

    async def open(self, url: str) -> Any:
        page = await self.context.new_page()
        n = len(self.context.pages)
        page.on("pageerror", lambda e: self.errors.append(f"tab {n} page error: {e}"))
        page.on("console", lambda m: self.errors.append(f"tab {n} console {m.type}: {m.text}")
                if m.type == "error" else None)
        await page.goto(url)
        return page


@contextlib.asynccontextmanager
async def browser() -> AsyncIterator[Tabs]:
    api = _playwright()
    async with api.async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM)
        try:
            context = await b.new_context(viewport={"width": 1400, "height": 1000})
            yield Tabs(context)
        finally:
            await b.close()


async def create_session(base: str, sid: str, task: str, headers: dict[str, str] | None = None) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/sessions", json={"task": task, "session_id": sid}, headers=headers) as r:
            assert r.status == 201, await r.text()


WATCH_STREAMING = """() => {
  window.__streamed = [];
  const s = document.getElementById('streaming');
  new MutationObserver(() => { if (!s.hidden && s.textContent) window.__streamed.push(s.textContent); })
    .observe(s, {childList: true, characterData: true, subtree: true, attributes: true});
}"""


def active_node(page: Any, state: str) -> Any:
    return page.locator(f'#diagram svg g.active-node[id*="-flowchart-{state}-"]')


async def expect_state(page: Any, state: str, timeout: float) -> None:
    """#state shows ``state`` and the rendered diagram highlights exactly that node (the page's
    active-node marker, on the node Mermaid styled with the server's s_active class)."""
    expect = _playwright().expect
    await expect(page.locator("#state")).to_have_text(state, timeout=timeout)
    await expect(active_node(page, state)).to_have_count(1, timeout=timeout)
    # the re-rendered diagram (fetched after the transition) has the server's highlight there too
    await expect(page.locator(f'#diagram svg g.active-node.s_active[id*="-flowchart-{state}-"]')).to_have_count(
        1, timeout=timeout)
    await expect(page.locator("#diagram svg g.active-node")).to_have_count(1)
    await expect(page.locator("#diagram svg g.s_active")).to_have_count(1)


async def expect_stream_closed(page: Any, timeout: float) -> None:
    # after the terminal event the page closes its EventSource (else it reconnects forever)
    expect = _playwright().expect
    await expect(page.locator("#conn")).to_have_text("closed (run stopped)", timeout=timeout)
    assert await page.evaluate("window.fsmReview.streamOpen") is False


async def review_two_tabs(tmp_path: Path, base: str, sid: str, tool_name: str, timeout: float,
                          tabs: Tabs, name: str, watch_streaming: bool = False) -> dict[str, Any]:
    expect = _playwright().expect
    tab1 = await tabs.open(f"{base}/review/{sid}")
    tab2 = await tabs.open(f"{base}/review/{sid}")
    call_id = ""
    for tab in (tab1, tab2):
        await expect_state(tab, "WAITING_HUMAN", timeout)
        box = tab.locator(".pending")
        await expect(box).to_have_count(1, timeout=timeout)
        call_id = await box.get_attribute("data-call-id") or ""
        assert call_id
        await expect(box.locator("h3 code")).to_have_text(tool_name)
        for decision in ("approve", "edit", "reject", "respond"):
            await expect(box.locator(f'button[data-decision="{decision}"]')).to_have_count(1)
        await expect_stream_closed(tab, timeout)
    assert await tab2.locator(".pending").get_attribute("data-call-id") == call_id
    await screenshot(tab1, tmp_path, f"{name}-waiting.png")

    # a click whose POST fails shows the problem and leaves the box: only the server removes it
    async def refuse(route: Any) -> None:
        await route.fulfill(status=409, content_type="application/problem+json",
                            body=json.dumps({"type": "about:blank", "title": "Not waiting", "status": 409,
                                             "detail": "refused by the test"}))
    await tab2.route("**/approvals/**", refuse)
    await tab2.locator('.pending button[data-decision="approve"]').click()
    await expect(tab2.locator(".pending .error")).to_have_text("409 Not waiting: refused by the test", timeout=timeout)
    await expect(tab2.locator(".pending")).to_have_count(1)
    await expect(tab2.locator('.pending button[data-decision="approve"]')).to_be_enabled()
    await tab2.unroute("**/approvals/**")
    tabs.errors = [e for e in tabs.errors if "409" not in e]  # the refused POST's own console line
    # an edit that is not a JSON object is refused in the page, before any request
    await tab2.locator(".pending summary").click()
    await tab2.locator(".pending textarea").fill("{not json")
    await tab2.locator('.pending button[data-decision="edit"]').click()
    await expect(tab2.locator(".pending .error")).to_contain_text("not valid JSON")
    await expect(tab2.locator(".pending")).to_have_count(1)

    if watch_streaming:  # record what the transient streaming line shows in tab 1
        await tab1.evaluate(WATCH_STREAMING)

    # approve in tab 1: both tabs follow the server to COMPLETED; tab 2 never clicked again
    await tab1.locator('.pending button[data-decision="approve"]').click()
    for tab in (tab1, tab2):
        await expect_state(tab, "COMPLETED", timeout)
        await expect(tab.locator(".pending")).to_have_count(0, timeout=timeout)
        await expect(tab.locator("#none-pending")).to_be_visible()
        await expect(tab.locator('#events li[data-type="resume"]')).to_have_count(1, timeout=timeout)
        await expect(tab.locator("#events li").last).to_have_attribute("data-type", "run_stopped", timeout=timeout)
        await expect_stream_closed(tab, timeout)
        await expect(active_node(tab, "WAITING_HUMAN")).to_have_count(0)
    await screenshot(tab1, tmp_path, f"{name}-completed-tab1.png")
    await screenshot(tab2, tmp_path, f"{name}-completed-tab2.png")
    seq1, seq2 = [await t.evaluate("window.fsmReview.lastSeq") for t in (tab1, tab2)]
    assert seq1 == seq2 and seq1 > 0
    events1 = await tab1.locator("#events li").evaluate_all("els => els.map(e => e.dataset.seq)")
    assert events1 == [str(i) for i in range(1, seq1 + 1)]  # every log event once, in order
    assert tabs.errors == []
    streamed = await tab1.evaluate("window.__streamed || []") if watch_streaming else []
    return {"tab1": tab1, "tab2": tab2, "call_id": call_id, "last_seq": seq1, "streamed": streamed}


async def test_two_tabs_approve_scripted(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    async with serving(scripted_agent(store), store) as base, browser() as tabs:
        await create_session(base, "web1", "pay 5")
        out = await review_two_tabs(tmp_path, base, "web1", "pay", 15_000, tabs, "scripted")
        tab1 = out["tab1"]
        expect = _playwright().expect
        await expect(tab1.locator("#usage")).to_have_text("20 in / 10 out tokens · cost unknown")
        await expect(tab1.locator("#goal")).to_have_text("pay 5")
        # the arguments were shown pretty-printed, and the log agrees with what the page shows
        log = await store.read_events("web1")
        assert out["last_seq"] == log[-1].seq
        (resume,) = [e for e in log if e.type == "resume"]
        assert resume.payload["decisions"][out["call_id"]]["kind"] == "approve"


async def test_fallback_without_mermaid(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    async with serving(scripted_agent(store), store) as base, browser() as tabs:
        await create_session(base, "web2", "pay 5")
        await tabs.context.route("**/static/mermaid.min.js*", lambda route: route.abort())
        page = await tabs.open(f"{base}/review/web2")
        expect = _playwright().expect
        await expect(page.locator("#state")).to_have_text("WAITING_HUMAN", timeout=15_000)
        await expect(page.locator("#diagram-fallback")).to_be_visible(timeout=15_000)
        await expect(page.locator("#diagram-source")).to_contain_text("flowchart TB")
        await expect(page.locator("#diagram-source")).to_contain_text("class WAITING_HUMAN s_active")
        await expect(page.locator("#diagram-states li.current strong")).to_have_text("WAITING_HUMAN")
        assert await page.locator("#diagram-states li").count() > 10
        await expect(page.locator(".pending")).to_have_count(1)
        await screenshot(page, tmp_path, "fallback.png")
        assert [e for e in tabs.errors if "mermaid" not in e and "ERR_FAILED" not in e] == []


async def test_sign_in_then_approve_with_the_csrf_cookie(tmp_path: Path) -> None:
    from fsm_agent.server.auth import Tenants

    store = SQLiteStore(tmp_path / "s.db")
    async with serving(scripted_agent(store), store, tenants=Tenants({TOKEN: "acme"})) as base, browser() as tabs:
        await create_session(base, "web3", "pay 5", {"Authorization": f"Bearer {TOKEN}"})
        page = await tabs.open(f"{base}/review/web3")
        expect = _playwright().expect
        await expect(page.locator("#signin")).to_be_visible(timeout=15_000)
        await expect(page.locator("#main")).to_be_hidden()
        await page.locator("#signin-token").fill("wrong-token-wrong-token")
        await page.locator("#signin-form button[type=submit]").click()
        await expect(page.locator("#signin-error")).to_contain_text("401", timeout=15_000)
        await page.locator("#signin-token").fill(TOKEN)
        await page.locator("#signin-form button[type=submit]").click()
        await expect_state(page, "WAITING_HUMAN", 15_000)  # reloaded, signed in by cookie
        await expect(page.locator("#signin")).to_be_hidden()
        cookies = {c["name"]: c for c in await tabs.context.cookies()}
        assert cookies["fsm_auth"]["httpOnly"] and not cookies["fsm_csrf"]["httpOnly"]
        sent: list[dict[str, str]] = []
        page.on("request", lambda r: sent.append(r.headers) if "/approvals/" in r.url else None)
        await page.locator('.pending button[data-decision="approve"]').click()
        await expect_state(page, "COMPLETED", 15_000)
        await expect(page.locator(".pending")).to_have_count(0)
        assert sent and sent[0].get("x-csrf-token") == cookies["fsm_csrf"]["value"]
        tabs.errors = [e for e in tabs.errors if "401" not in e]  # the unsigned requests and the wrong token
        assert tabs.errors == []


@pytest.mark.llama
async def test_two_tabs_approve_local_model(tmp_path: Path, local_provider: Any) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    agent = Agent(local_provider, tools=[calculator], store=store,
                  middleware=[ToolFirstThenAnswer(), HumanApproval("calculator")],
                  config=RunConfig(temperature=0.0, max_output_tokens=100, max_iterations=4))
    async with serving(agent, store) as base, browser() as tabs:
        await create_session(base, "llm1", "Use the calculator to compute 17 * 23.")
        out = await review_two_tabs(tmp_path, base, "llm1", "calculator", 90_000, tabs, "local", watch_streaming=True)
        log = await store.read_events("llm1")
        calls = [e.payload for e in log if e.type == "tool_call" and e.payload["status"] == "completed"]
        assert [c["call_id"] for c in calls] == [out["call_id"]]  # the approved call ran, once
        usage = await out["tab1"].locator("#usage").text_content()
        assert usage and not usage.startswith("0 in")  # llama.cpp reports real token counts
        # the answer streamed live (delta events, no id) into the transient line, which the final
        # message then replaced
        answer = [e.payload["message"] for e in log if e.type == "message"][-1]
        text = "".join(p.get("text", "") for p in answer["content"])
        streamed = out["streamed"]
        assert len(streamed) > 1 and all(s.startswith("streaming: ") for s in streamed), streamed
        assert text.startswith(streamed[-1][len("streaming: "):]) and text, (streamed[-1], text)
        assert await out["tab1"].locator("#streaming").is_hidden()


async def test_controls_cancel_a_waiting_session(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    async with serving(scripted_agent(store), store) as base, browser() as tabs:
        await create_session(base, "web4", "pay 5")
        page = await tabs.open(f"{base}/review/web4")
        expect = _playwright().expect
        await expect_state(page, "WAITING_HUMAN", 15_000)
        await expect_stream_closed(page, 15_000)
        sent: list[str] = []
        page.on("request", lambda r: sent.append(r.post_data or "") if r.url.endswith("/control") else None)
        await page.locator("#btn-steer").click()  # no text: refused in the page, nothing sent
        await expect(page.locator("#control-error")).to_have_text("Write a message first.")
        await page.locator("#btn-cancel").click()
        await expect(page.locator("#control-status")).to_have_text("cancel sent.", timeout=15_000)
        await expect_state(page, "CANCELLED", 15_000)
        await expect(page.locator(".pending")).to_have_count(0, timeout=15_000)
        await expect(page.locator('#events li[data-type="control"]')).to_have_count(1)
        await expect_stream_closed(page, 15_000)
        assert [json.loads(b) for b in sent] == [{"kind": "cancel"}]
        await screenshot(page, tmp_path, "cancelled.png")
        assert tabs.errors == []
