"""The review page and the diagram files in a real Chromium (Debian's /usr/bin/chromium through
Playwright, as test_browser.py): "Actual size" shows the diagram at its natural size; the controls
follow what the session can take; the path a run took is drawn heavier and coloured, in order, and
resumable stops apart from terminal failures; ``fsm-agent diagram`` writes an HTML page that
renders offline and a standalone SVG.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from fsm_agent import Agent, ScriptedProvider, tool
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteStore
from fsm_agent.types.run import StopReason
from fsm_agent.machine.phases import Phase
from fsm_agent_middleware.approval import HumanApproval

from .test_browser import _playwright, browser, create_session, expect_state, pay, scripted_agent, screenshot, serving

ROOT = Path(__file__).resolve().parents[2]
STATES = sorted([*(p.value for p in Phase), *(r.value for r in StopReason), "start"], key=len, reverse=True)
BLUE, BLUE_RGB = "#1d4ed8", "rgb(29, 78, 216)"


def edge_ends(edge_id: str) -> tuple[str, str]:
    """(from, to) of a flowchart edge id ``<diagram>-L_<FROM>_<TO>_<n>`` (state names hold underscores)."""
    body = re.sub(r"_\d+$", "", edge_id.split("-L_", 1)[1])
    for a in STATES:
        if body.startswith(a + "_") and body[len(a) + 1:] in STATES:
            return a, body[len(a) + 1:]
    raise AssertionError(edge_id)


EDGES_JS = """svg => [...svg.querySelectorAll('path[id*="-L_"]')].map(p => {
  const s = getComputedStyle(p);
  return {id: p.id, width: s.strokeWidth, stroke: s.stroke};
})"""


async def test_actual_size_shows_the_diagram_at_its_natural_size_and_fit_gives_it_back(tmp_path: Path) -> None:
    expect = _playwright().expect
    store = SQLiteStore(tmp_path / "s.db")
    async with serving(scripted_agent(store), store) as base, browser() as tabs:
        await create_session(base, "z1", "pay 5")
        page = await tabs.open(f"{base}/review/z1")
        await expect_state(page, "WAITING_HUMAN", 15_000)
        svg, area, zoom = page.locator("#diagram svg"), page.locator("#diagram"), page.locator("#btn-zoom")
        natural = await svg.evaluate("s => s.viewBox.baseVal.width")
        room = await area.evaluate("d => d.clientWidth")
        assert natural > room * 1.5                        # the machine is wider than its box
        assert (await svg.bounding_box())["width"] <= room + 1   # fitted
        await zoom.click()
        await expect(zoom).to_have_attribute("aria-pressed", "true")
        await expect(zoom).to_have_text("Fit to width")
        assert abs((await svg.bounding_box())["width"] - natural) <= 1
        assert await area.evaluate("d => d.scrollWidth > d.clientWidth")     # the box scrolls
        await screenshot(page, tmp_path, "actual-size.png")
        # the diagram redrawn after the next transitions keeps the size chosen
        await page.locator('.pending button[data-decision="approve"]').click()
        await expect_state(page, "COMPLETED", 15_000)
        natural = await svg.evaluate("s => s.viewBox.baseVal.width")
        assert abs((await svg.bounding_box())["width"] - natural) <= 1
        await zoom.click()
        await expect(zoom).to_have_text("Actual size")
        assert (await svg.bounding_box())["width"] <= room + 1
        assert tabs.errors == []


released = asyncio.Event()


@tool
async def lookup(order: str) -> str:
    """Look an order up (waits until the test lets it finish)."""
    await released.wait()
    return f"{order}: shipped"


async def test_the_controls_follow_what_the_session_can_take(tmp_path: Path) -> None:
    expect = _playwright().expect
    released.clear()
    store = SQLiteStore(tmp_path / "s.db")
    agent = Agent(ScriptedProvider([tool_call_response(("lookup", {"order": "A1"})), "A1 has shipped."]),
                  tools=[lookup], store=store)
    controls = ("#btn-interrupt", "#btn-cancel", "#btn-steer", "#btn-followup", "#steer-text")
    async with serving(agent, store) as base, browser() as tabs:
        await create_session(base, "c1", "Where is A1?")
        page = await tabs.open(f"{base}/review/c1")
        running = re.compile("^(PreTurn|Model|MidTurn|PostTurn)$")
        await expect(page.locator("#state")).to_have_text(running, timeout=15_000)     # running: all of them
        for c in controls:
            await expect(page.locator(c)).to_be_enabled()
        await expect(page.locator("#control-note")).to_be_hidden()
        released.set()
        await expect_state(page, "COMPLETED", 15_000)                                   # ended: none
        for c in controls:
            await expect(page.locator(c)).to_be_disabled()
        await expect(page.locator("#control-note")).to_have_text(
            "The session ended COMPLETED: it takes no more controls.")
        await screenshot(page, tmp_path, "ended-controls.png")
        fresh = await tabs.open(f"{base}/review/c1")                                   # opened after the end
        await expect(fresh.locator("#state")).to_have_text("COMPLETED", timeout=15_000)
        for c in controls:
            await expect(fresh.locator(c)).to_be_disabled()

    store2 = SQLiteStore(tmp_path / "s2.db")
    async with serving(scripted_agent(store2), store2) as base, browser() as tabs:
        await create_session(base, "w1", "pay 5")
        page = await tabs.open(f"{base}/review/w1")
        await expect_state(page, "WAITING_HUMAN", 15_000)        # stopped, resumable: nothing to interrupt
        await expect(page.locator("#btn-interrupt")).to_be_disabled()
        for c in controls[1:]:
            await expect(page.locator(c)).to_be_enabled()
        await expect(page.locator("#control-note")).to_contain_text("nothing runs to interrupt")
        assert tabs.errors == []


async def test_the_path_is_drawn_heavier_and_coloured_in_order_and_resumable_stops_apart(tmp_path: Path) -> None:
    expect = _playwright().expect
    store = SQLiteStore(tmp_path / "s.db")
    async with serving(scripted_agent(store), store) as base, browser() as tabs:
        await create_session(base, "p1", "pay 5")
        page = await tabs.open(f"{base}/review/p1")
        await expect_state(page, "WAITING_HUMAN", 15_000)
        await page.locator('.pending button[data-decision="approve"]').click()
        await expect_state(page, "COMPLETED", 15_000)
        await expect(page.locator("#diagram svg g.edgeLabel", has_text="complete #10")).to_have_count(1,
                                                                                                     timeout=15_000)
        moves = [(e.payload["from"], e.payload["to"]) for e in await store.read_events("p1", types=("transition",))]
        assert len(moves) == 10
        edges = await page.locator("#diagram svg").evaluate(EDGES_JS)
        heavy = [edge_ends(e["id"]) for e in edges if e["width"] == "4px" and e["stroke"] == BLUE_RGB]
        light = [e for e in edges if e["width"] == "1px" and e["stroke"] != BLUE_RGB]
        assert sorted(heavy) == sorted({("start", "Idle"), *moves})   # each edge taken, once
        assert len(heavy) + len(light) == len(edges)                    # every other edge is light
        # the order: each step's number on the edge it took
        labels = await page.locator("#diagram svg g.edgeLabel").all_text_contents()
        steps = sorted(int(n) for text in labels for n in re.findall(r"#(\d+)", text))
        assert steps == list(range(1, 11))
        assert "call_model #2, #8" in [t.strip() for t in labels]
        # stops by kind: resumable ones amber and dashed, terminal failures red and solid
        kind = {}
        for state in ("INTERRUPTED", "PAUSED_BUDGET", "FAILED_TERMINAL", "CANCELLED"):
            node = page.locator(f'#diagram svg g.node[id*="-flowchart-{state}-"]')
            kind[state] = await node.evaluate(
                "el => { const s = getComputedStyle(el.querySelector('rect, path, polygon')); "
                "return [s.fill, s.strokeDasharray]; }")
        assert kind["INTERRUPTED"] == kind["PAUSED_BUDGET"] and kind["FAILED_TERMINAL"] == kind["CANCELLED"]
        assert kind["INTERRUPTED"][0] == "rgb(254, 243, 199)" and kind["INTERRUPTED"][1] not in ("none", "")
        assert kind["FAILED_TERMINAL"][0] == "rgb(253, 226, 226)" and kind["FAILED_TERMINAL"][1] in ("none", "")
        await page.locator("#btn-zoom").click()
        await screenshot(page, tmp_path, "path.png")
        assert tabs.errors == []


def fsm_agent(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsm_agent.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


async def recorded_run(tmp_path: Path) -> Path:
    """The events of a run that waited for approval and completed, as `sessions show --events` prints them."""
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    agent = Agent(ScriptedProvider([tool_call_response(("pay", {"amount": 5})), "done"]), tools=[pay],
                  middleware=[HumanApproval("pay")], store=store)
    result = await agent.run("pay 5", session_id="r1")
    (call,) = result.stop.pending_actions
    from fsm_agent import Decision

    await agent.resume("r1", decisions={call.call.id: Decision.approve()})
    await store.close()
    shown = fsm_agent("sessions", "show", "r1", "--events", "--store", str(db))
    assert shown.returncode == 0, shown.stderr
    events = tmp_path / "events.jsonl"
    events.write_text(shown.stdout)
    return events


async def test_diagram_writes_an_html_page_that_renders_offline_and_a_standalone_svg(tmp_path: Path) -> None:
    expect = _playwright().expect
    events = await recorded_run(tmp_path)
    page_file, svg_file = tmp_path / "run.html", tmp_path / "run.svg"
    made = fsm_agent("diagram", "--trace", str(events), "--output", str(page_file))
    assert made.returncode == 0 and made.stderr == f"wrote {page_file}\n", made.stderr
    text = page_file.read_text()
    assert "<script src" not in text and "mermaid.min.js" not in text.split("<script>", 1)[0]
    async with browser() as tabs:
        requests: list[str] = []
        tabs.context.on("request", lambda r: requests.append(r.url))
        await tabs.context.route("http*://**", lambda route: route.abort())   # no network at all
        page = await tabs.open(page_file.as_uri())
        await expect(page.locator("body")).to_have_attribute("data-rendered", "true", timeout=30_000)
        edges = await page.locator("#diagram svg").evaluate(EDGES_JS)
        heavy = sorted(edge_ends(e["id"]) for e in edges if e["width"] == "4px" and e["stroke"] == BLUE_RGB)
        assert len(heavy) == 10 and ("MidTurn", "WAITING_HUMAN") in heavy and ("WAITING_HUMAN", "MidTurn") in heavy
        natural = await page.locator("#diagram svg").evaluate("s => s.viewBox.baseVal.width")
        assert abs((await page.locator("#diagram svg").bounding_box())["width"] - natural) <= 1
        await screenshot(page, tmp_path, "diagram-file.png")
        assert [u for u in requests if not u.startswith("file:")] == []
        assert tabs.errors == []

    made = await asyncio.to_thread(fsm_agent, "diagram", "--trace", str(events), "--output", str(svg_file))
    assert made.returncode == 0, made.stderr
    root = ET.fromstring(svg_file.read_bytes())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.find(".//{http://www.w3.org/2000/svg}foreignObject") is None      # text as SVG text
    styled = [p.get("style", "") for p in root.iter("{http://www.w3.org/2000/svg}path") if "-L_" in p.get("id", "")]
    assert sum("stroke-width:4px" in s and BLUE in s for s in styled) == 10
    labels = "".join(t for t in root.itertext())
    assert "wait_human #4" in labels and "complete #10" in labels
    # the plain machine as a page too; --check stays the Mermaid file's
    made = fsm_agent("diagram", "--format", "html", "--stdout")
    assert made.returncode == 0 and made.stdout.startswith("<!doctype html>") and "stateDiagram-v2" in made.stdout
    made = fsm_agent("diagram", "--check", "--format", "svg")
    assert made.returncode == 2 and "--check compares the committed Mermaid file" in made.stderr
