"""Diagrams as files that open anywhere, offline: a self-contained HTML page (the Mermaid source
and the bundled Mermaid renderer in one file) and a standalone SVG (rendered by a headless
Chromium through Playwright).

The renderer is the one the review page serves (``fsm_agent/server/static/mermaid.min.js``,
Mermaid 12.3.0, MIT; see that folder's ``README.md``), inlined: the page loads nothing from any
network. ``fsm-agent diagram --output FILE.html`` (or ``.svg``, or ``--format``) writes them.
"""

from __future__ import annotations

import html
import importlib.resources
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import ConfigurationError

__all__ = ["FORMATS", "format_of", "mermaid_js", "render_html", "render_svg"]

FORMATS = ("mermaid", "html", "svg")
"""What ``fsm-agent diagram`` writes: the Mermaid source, a self-contained HTML page, an SVG."""

_SUFFIXES = {".html": "html", ".htm": "html", ".svg": "svg"}


def format_of(path: Path | None, given: str | None) -> str:
    """The format to write: ``given``, else the one ``path``'s suffix names (``.html``/``.htm``,
    ``.svg``), else ``"mermaid"``."""
    if given:
        return given
    if path is not None:
        return _SUFFIXES.get(path.suffix.lower(), "mermaid")
    return "mermaid"


@lru_cache(maxsize=1)
def mermaid_js() -> str:
    """The bundled Mermaid renderer (the classic build that sets ``window.mermaid``), made safe to
    inline in a ``<script>`` element.

    Raises:
        ConfigurationError: the file is missing from this installation.
    """
    try:
        text = importlib.resources.files("fsm_agent").joinpath("server", "static", "mermaid.min.js").read_text(
            encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigurationError("fsm_agent/server/static/mermaid.min.js is missing from this installation; "
                                 "reinstall fsm-agent, or write the Mermaid source (--format mermaid)") from exc
    # Inside <script>, "</script" would end the element and "<!--" can change how the HTML parser
    # reads the rest; both only occur in the renderer's string and regex literals, where \x3C is "<".
    return text.replace("</script", "<\\/script").replace("<!--", "\\x3C!--")


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>{title}</title>
<style>
  body {{ margin: 1rem; font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; color: #1f2937; }}
  #diagram {{ overflow: auto; }}
  #diagram svg {{ max-width: none; height: auto; }}
  #error {{ color: #b91c1c; white-space: pre-wrap; }}
  pre {{ background: #f8fafc; border: 1px solid #d1d5db; border-radius: 4px; padding: .5rem; overflow: auto; }}
</style>
</head>
<body>
<div id="diagram" role="img" aria-label="{title}"></div>
<p id="error" role="alert"></p>
<details><summary>Mermaid source</summary><pre id="source">{source}</pre></details>
<script>{mermaid}</script>
<script>
(async () => {{
  const source = document.getElementById('source').textContent;
  try {{
    window.mermaid.initialize({{ startOnLoad: false, securityLevel: 'strict', theme: 'default',
      fontFamily: 'system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif' }});
    const {{ svg }} = await window.mermaid.render('fsmdiagram', source);
    const node = new DOMParser().parseFromString(svg, 'image/svg+xml').documentElement;
    // its natural size: Mermaid's width="100%" and inline max-width would shrink it to the window
    const box = (node.getAttribute('viewBox') || '').split(/[\\s,]+/).map(Number);
    if (box.length === 4 && box[2] > 0) {{
      node.setAttribute('width', String(Math.ceil(box[2])));
      node.setAttribute('height', String(Math.ceil(box[3])));
      node.style.maxWidth = 'none';
    }}
    document.getElementById('diagram').replaceChildren(document.importNode(node, true));
    document.body.dataset.rendered = 'true';
  }} catch (e) {{
    document.getElementById('error').textContent = 'The diagram could not be rendered: ' + (e && e.message || e);
    document.querySelector('details').open = true;
    document.body.dataset.rendered = 'error';
  }}
}})();
</script>
</body>
</html>
"""


def render_html(source: str, title: str = "fsm_agent diagram") -> str:
    """A self-contained HTML page that renders the Mermaid ``source`` with the bundled Mermaid, at
    its natural size, with no network (the source is also shown, folded). On success the page's
    ``<body>`` gets ``data-rendered="true"``; on a render error, ``"error"`` and the message.

    Raises:
        ConfigurationError: the bundled renderer is missing.
    """
    return _PAGE.format(title=html.escape(title), source=html.escape(source), mermaid=mermaid_js())


def _chromium() -> str | None:
    """A Chromium to render with: ``$FSM_AGENT_CHROMIUM``, Debian's ``/usr/bin/chromium``, or one on
    ``PATH``; ``None``: Playwright's own."""
    found = os.environ.get("FSM_AGENT_CHROMIUM")
    if found:
        return found
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def render_svg(source: str, title: str = "fsm_agent diagram", *, timeout: float = 60.0) -> str:
    """A standalone SVG of the Mermaid ``source`` (text as SVG text, styles inside), rendered by the
    bundled Mermaid in a headless Chromium, offline.

    Raises:
        ConfigurationError: Playwright or a Chromium is missing (the message says what to install),
            or the source does not render.
    """
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        raise ConfigurationError("an SVG is rendered by a headless Chromium through Playwright: pip install "
                                 "playwright, and a Chromium (Debian: apt-get install chromium; or `playwright "
                                 "install chromium`); or write a self-contained .html, which needs neither") from exc
    page_html = render_html(source, title).replace(
        "startOnLoad: false,", "startOnLoad: false, htmlLabels: false, flowchart: { htmlLabels: false },", 1)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium())
            try:
                page = browser.new_page()
                page.route("**/*", lambda route: route.abort())  # offline: nothing is fetched
                page.set_content(page_html, wait_until="domcontentloaded", timeout=timeout * 1000)
                page.wait_for_selector("body[data-rendered]", timeout=timeout * 1000)
                if page.get_attribute("body", "data-rendered") != "true":
                    raise ConfigurationError(f"the diagram does not render: {page.text_content('#error')}")
                svg: Any = page.eval_on_selector(
                    "#diagram svg", "n => { n.setAttribute('xmlns', 'http://www.w3.org/2000/svg'); return n.outerHTML; }")
            finally:
                browser.close()
    except PlaywrightError as exc:
        raise ConfigurationError(f"could not render the SVG in a headless Chromium ({str(exc).splitlines()[0]}); "
                                 "install one (Debian: apt-get install chromium; or `playwright install chromium`), "
                                 "set $FSM_AGENT_CHROMIUM to its path, or write a .html instead") from exc
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + str(svg) + "\n"
