"""The plan where people look: ``fsm-agent sessions show`` (text and JSON), ``fsm-agent diagram
--plan``, the server's ``GET /sessions/{sid}/diagram`` (``?view=plan``, and ``plan`` /
``plan_mermaid`` in the JSON), and the review page, where the vendored Mermaid renders the flowchart
in a real Chromium (so the diagram's syntax, escaping included, is checked by Mermaid itself).

Sessions are made by a real PlanAct run on a scripted model and stored in SQLite: a three-node plan
whose second node fails its check once and is replanned, paused by the iteration budget while the
rewritten node runs. The CLI runs in its own process.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fsm_agent import Agent, NodeStatus, Plan, PlanNode, ScriptedProvider, SQLiteStore, StopReason
from fsm_agent.diagrams import latest_plan, render_plan
from fsm_agent.providers import text_response
from fsm_agent.server import create_app
from fsm_agent.types import MessageRequest, Replan, ReplanTrigger
from fsm_agent_middleware.planact import PlanAct
from fsm_agent_middleware.verifier import Verdict

PLAN = {"nodes": [{"id": "a", "goal": "Find the first number", "depends_on": [], "acceptance": "a number"},
                  {"id": "b", "goal": 'Find the "second" <number> #2 & {more}', "depends_on": ["a"],
                   "acceptance": "a number"},
                  {"id": "c", "goal": "Add them", "depends_on": ["a", "b"], "acceptance": "the sum"}]}
REPLAN = {"nodes": [{"id": "b", "goal": "Look the second number up", "depends_on": ["a"], "acceptance": "a number"},
                    {"id": "c", "goal": "Add them", "depends_on": ["b"], "acceptance": "the sum"}]}


def routed(request: MessageRequest) -> Any:
    name = request.output_schema.name if request.output_schema is not None else ""
    if name in ("plan", "replan"):
        return text_response(orjson.dumps(PLAN if name == "plan" else REPLAN).decode())
    if name == "verdict":
        return text_response('{"ok": true, "reason": "fine"}')
    return text_response("an answer")


def reject_b_once() -> Any:
    seen: list[str] = []

    def check(ctx: Any, node: PlanNode) -> Verdict | None:
        seen.append(node.id)
        return Verdict(False, "no number in it") if seen.count("b") == 1 and node.id == "b" else None

    return check


def planact_agent(store: Any) -> Agent:
    return Agent(ScriptedProvider([routed], repeat_last=True), store=store, middleware=[PlanAct(check=reject_b_once())])


async def paused_session(path: Path, sid: str = "p1") -> Plan:
    """A session paused mid-plan: a passed, b failed once, replanned (v2) and running."""
    store = SQLiteStore(path)
    try:
        result = await planact_agent(store).run("Add two numbers", session_id=sid, max_iterations=2)
        assert result.stop.reason is StopReason.PAUSED_BUDGET, result.stop.detail
        plan = latest_plan(await store.read_events(sid))
    finally:
        await store.close()
    assert plan is not None and plan.version == 2 and plan.current is not None and plan.current.id == "b"
    return plan


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fsm_agent.cli", *args, env={**os.environ},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


# -- the flowchart ---------------------------------------------------------------------------
def test_render_plan_classes_nodes_by_status_draws_dependencies_and_escapes_labels() -> None:
    plan = Plan('Goal with %%{init} "quotes"', (
        PlanNode("a", "First", status=NodeStatus.PASSED, attempts=1),
        PlanNode("b", 'Say "hi" <b>#1</b>', ("a",), status=NodeStatus.SKIPPED, attempts=1),
        PlanNode("b2", "Second", ("a",), status=NodeStatus.RUNNING, attempts=2),
        PlanNode("c", "Third", ("b2",))), version=2,
        history=(Replan(2, ReplanTrigger.FAILED, "b failed {badly}", 3, "b", ("b",), ("b2",)),))
    text = render_plan(plan)
    assert text.startswith("---\ntitle: plan v2, 1 replan, 1 of 3 nodes passed\n---\nflowchart TD\n")
    assert '    n2["b · skipped<br/>Say #quot;hi#quot; #lt;b#gt;#35;1#lt;/b#gt;<br/>1 attempt"]' in text
    assert '    n3["b2 · running<br/>Second<br/>2 attempts"]' in text
    assert "    n1 -.-> n2\n    n1 --> n3\n    n3 --> n4\n" in text
    assert "    class n3 running\n" in text and "    class n1 passed\n" in text and "    class n4 pending\n" in text
    assert "%%{" not in text.replace("%% goal", "").replace("%% replan", "")  # no directive smuggled in a comment
    assert "    %% replan to v2 (failed b): b failed (badly)\n" in text
    assert render_plan(plan) == text  # deterministic


def test_latest_plan_reads_the_last_plan_updated_event() -> None:
    one, two = Plan("g", (PlanNode("a", "x"),)), Plan("g", (PlanNode("a", "x", status=NodeStatus.PASSED),))
    from fsm_agent.types import unstructure

    events = [{"type": "plan_updated", "payload": {"plan": unstructure(one), "reason": "r1"}},
              {"type": "transition", "payload": {}},
              {"type": "plan_updated", "payload": {"plan": orjson.loads(orjson.dumps(unstructure(two))), "reason": "r2"}}]
    assert latest_plan(events) == two and latest_plan(events[:2]) == one and latest_plan([]) is None


# -- the command line ------------------------------------------------------------------------
async def test_sessions_show_prints_the_plan_and_diagram_renders_it(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    plan = await paused_session(db)
    code, out, err = await cli("sessions", "show", "p1", "--store", str(db))
    assert code == 0, err
    lines = out.splitlines()
    at = lines.index("plan v2 (1 replan): 1 of 3 nodes passed — Add two numbers")
    assert lines[at + 1:at + 4] == ["  [passed ] a: Find the first number, 1 attempt", "            check: fine",
                                    "  [running] b: Look the second number up (after a), 1 attempt"]
    assert "  [pending] c: Add them (after b)" in lines
    assert "  replan -> v2 at turn 2 (failed b): node b failed its check: no number in it" in lines
    code, out, err = await cli("sessions", "show", "p1", "--store", str(db), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"]["version"] == 2 and [n["status"] for n in doc["plan"]["nodes"]] == [
        n.status.value for n in plan.nodes]
    code, out, err = await cli("sessions", "show", "p1", "--store", str(db), "--events")
    events = tmp_path / "events.jsonl"
    events.write_text(out)
    code, out, err = await cli("diagram", "--plan", str(events))
    assert code == 0, err
    assert out == render_plan(plan)


HOSTILE = "bad \x1b[31mverdict\x1b[0m\r\nFAKE: passed \u202eRTL\x07 \x1b]0;title\x07"


async def test_sessions_show_and_the_diagram_print_no_control_character(tmp_path: Path) -> None:
    """A check's verdict and the task carry escape sequences, line breaks and a bidi override: the
    terminal gets each as one printable line (nothing a model or a user wrote can move the cursor,
    retitle the window or forge a line), in ``sessions show`` and ``diagram --plan`` alike."""
    import unicodedata

    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    try:
        agent = Agent(ScriptedProvider([routed], repeat_last=True), store=store, middleware=[
            PlanAct(check=lambda ctx, node: Verdict(False, HOSTILE) if node.id == "b" else None, max_replans=0)])
        result = await agent.run(f"Add {HOSTILE}", session_id="h")
        assert result.stop.reason is StopReason.WAITING_HUMAN and "\x1b" in result.stop.detail
    finally:
        await store.close()
    code, out, err = await cli("sessions", "show", "h", "--store", str(db))
    assert code == 0, err
    assert not [ch for ch in out if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf")]
    lines = out.splitlines()
    assert "            check: bad [31mverdict[0m FAKE: passed RTL ]0;title" in lines
    assert next(x for x in lines if x.startswith("goal: ")) == "goal: Add bad [31mverdict[0m FAKE: passed RTL ]0;title"
    assert next(x for x in lines if x.startswith("stop: ")).endswith("(0 of 0 replans for failed or stale nodes)")
    code, out, err = await cli("sessions", "show", "h", "--store", str(db), "--events")
    events = tmp_path / "events.jsonl"
    events.write_text(out)
    code, out, err = await cli("diagram", "--plan", str(events))
    assert code == 0, err
    assert not [ch for ch in out if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf")]
    assert "    %% goal: Add bad [31mverdict[0m FAKE: passed RTL ]0;title\n" in out


async def test_diagram_plan_on_a_session_without_a_plan_says_so(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"type": "transition", "payload": {"from": "Idle", "trigger": "start",
                                                                    "to": "PreTurn"}}) + "\n")
    code, out, err = await cli("diagram", "--plan", str(events))
    assert code == 2 and out == ""
    assert "holds no plan_updated event: the session ran without the planact plugin" in err
    assert "Traceback" not in err


async def test_the_cli_prints_only_the_answers_and_reports_plan_changes_on_stderr() -> None:
    """A planner's and a grader's JSON stream to observers too; the CLI prints the Model phase only."""
    from test_cli import chunk, run_cli

    def body(text: str) -> bytes:
        return (chunk({"role": "assistant", "content": text[:7]}) + chunk({"content": text[7:]})
                + chunk({}, "stop", {"prompt_tokens": 20, "completion_tokens": 5}) + b"data: [DONE]\n\n")

    plan = {"nodes": [{"id": "a", "goal": "Find the number", "depends_on": [], "acceptance": "a number"},
                      {"id": "b", "goal": "Double it", "depends_on": ["a"], "acceptance": "twice the number"}]}
    verdict = '{"ok": true, "reason": "right"}'
    code, out, err, server = await run_cli(
        "--middleware", "planact", "--no-default-middleware", "Double the number",
        responses=[body(orjson.dumps(plan).decode()), body("The number is 21."), body(verdict),
                   body("Twice 21 is 42."), body(verdict)])
    assert code == 0, err
    assert "The number is 21." in out and "Twice 21 is 42." in out
    assert "nodes" not in out and '"ok"' not in out
    assert "plan v1: planned by the planner: 2 nodes; node a started" in err
    assert "plan v1: node b passed: right; every node passed" in err
    assert "stop: COMPLETED — plan v1: every node passed (2 nodes, 0 replans)" in err
    assert len(server.requests) == 5


# -- the server ------------------------------------------------------------------------------
async def test_the_diagram_route_serves_the_plan(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    plan = await paused_session(db)
    store = SQLiteStore(db)
    client = TestClient(TestServer(create_app(lambda s: planact_agent(s), store), host="127.0.0.1"))
    await client.start_server()
    try:
        r = await client.get("/sessions/p1/diagram", params={"view": "plan"})
        assert r.status == 200 and await r.text() == render_plan(plan)
        machine = await (await client.get("/sessions/p1/diagram")).text()
        assert "flowchart TB" in machine and "class PAUSED_BUDGET s_active" in machine
        j = await (await client.get("/sessions/p1/diagram", params={"format": "json"})).json()
        assert j["mermaid"] == machine and j["plan_mermaid"] == render_plan(plan)
        assert j["plan"]["version"] == 2 and j["plan"]["history"][0]["trigger"] == "failed"
        r = await client.get("/sessions/p1/diagram", params={"view": "tree"})
        assert r.status == 400 and "view must be 'machine' or 'plan'" in (await r.json())["detail"]
        # a session without a plan
        await Agent(ScriptedProvider(["hi"]), store=store).run("hello", session_id="plain")
        r = await client.get("/sessions/plain/diagram", params={"view": "plan"})
        assert r.status == 404 and "has no plan" in (await r.json())["detail"]
        j = await (await client.get("/sessions/plain/diagram", params={"format": "json"})).json()
        assert j["plan"] is None and j["plan_mermaid"] is None
    finally:
        await client.close()


# -- the review page, in a real browser --------------------------------------------------------
async def test_the_review_page_renders_the_plan_with_mermaid(tmp_path: Path) -> None:
    from server.test_browser import _playwright, browser, screenshot, serving

    db = tmp_path / "s.db"
    await paused_session(db)
    store = SQLiteStore(db)
    expect = _playwright().expect
    async with serving(planact_agent(store), store) as base, browser() as tabs:
        page = await tabs.open(f"{base}/review/p1")
        await expect(page.locator("#plan-area")).to_be_visible(timeout=15_000)
        await expect(page.locator("#plan-title")).to_have_text("Plan v2 (1 of 3 nodes passed)")
        await expect(page.locator("#plan-diagram svg")).to_have_count(1, timeout=15_000)
        svg = page.locator("#plan-diagram svg")
        await expect(svg).to_contain_text("b · running")
        await expect(svg).to_contain_text("a · passed")
        await expect(page.locator("#plan-source")).to_be_hidden()
        await expect(page.locator("#plan-diagram")).to_have_attribute("aria-label", "Plan diagram; current node: b")
        await expect(page.locator('#events li[data-type="plan_updated"]').first).to_be_visible(timeout=15_000)
        await screenshot(page, tmp_path, "plan-review.png")
        plain = await tabs.open(f"{base}/review/nope")
        await expect(plain.locator("#plan-area")).to_be_hidden()
        assert tabs.errors == [] or all("404" in e for e in tabs.errors), tabs.errors
    await store.close()


@pytest.mark.parametrize("goal", ['Say "hi" <b>#1</b> & {x}', "%%{init: {'theme': 'dark'}}%% a", "line\nbreak --> x"])
async def test_mermaid_shows_any_label_a_planner_could_write_as_text(tmp_path: Path, goal: str) -> None:
    """The vendored Mermaid (the review page's) renders a plan whose node goal is hostile text: the
    label shows the text as written (no element injected, no directive obeyed: the theme stays)."""
    from server.test_browser import browser, serving

    store = SQLiteStore(tmp_path / "s.db")
    plan = Plan(goal, (PlanNode("a", goal, status=NodeStatus.RUNNING), PlanNode("b", "next", ("a",))),
                history=(Replan(2, ReplanTrigger.STEER, goal, 1),), version=2)
    async with serving(planact_agent(store), store) as base, browser() as tabs:
        page = await tabs.open(f"{base}/review/none")
        await page.wait_for_function("window.mermaid && typeof window.mermaid.render === 'function'")
        out = await page.evaluate("""async (src) => {
            const { svg } = await window.mermaid.render('probe', src);
            const doc = new DOMParser().parseFromString(svg, 'text/html');
            return { labels: [...doc.querySelectorAll('.nodeLabel')].map((e) => e.textContent),
                     injected: doc.querySelectorAll('svg b').length, style: doc.querySelector('style').textContent };
        }""", render_plan(plan))
    await store.close()
    assert out["labels"] == [f"a · running{' '.join(goal.split())}", "b · pendingnext"]
    assert out["injected"] == 0
    assert "#probe{font-family:" in out["style"] and "fill:#333;" in out["style"]  # the default theme, not 'dark'
