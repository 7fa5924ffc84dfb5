"""The review page's routes and files, without a browser: GET /review/{sid} serves the page,
/static/{name} serves only the shipped files (right types, mermaid cached for a year, the rest
no-cache, no traversal), the page loads only same-origin scripts under a strict CSP, and the
vendored Mermaid and its license are package data (found through importlib.resources, and in a
built wheel)."""

from __future__ import annotations

import hashlib
import importlib.resources
import re
import shutil
import subprocess
import sys
import zipfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fsm_agent.server.review import STATIC_FILES, add_review_routes

ROOT = Path(__file__).resolve().parents[2]
STATIC = importlib.resources.files("fsm_agent.server").joinpath("static")
MERMAID_VERSION = "12.3.0"
MERMAID_SHA256 = "336df803d87a38b70a01e736e666c8f7601d2ce42f5e47c8fafe5d721074b9a3"


@pytest.fixture
async def client() -> Any:
    app = web.Application()
    add_review_routes(app)
    c = TestClient(TestServer(app, host="127.0.0.1"))
    await c.start_server()
    yield c
    await c.close()


async def test_review_page_is_served_for_any_session_id(client: TestClient) -> None:
    for sid in ("s1", "0f3a9c", "with%20space"):
        r = await client.get(f"/review/{sid}")
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/html; charset=utf-8"
        assert r.headers["Cache-Control"] == "no-cache"
        assert await r.read() == STATIC.joinpath("review.html").read_bytes()


@pytest.mark.parametrize("name, ctype, cache", [
    ("review.html", "text/html; charset=utf-8", "no-cache"),
    ("review.js", "text/javascript; charset=utf-8", "no-cache"),
    ("mermaid.min.js", "text/javascript; charset=utf-8", "public, max-age=31536000, immutable"),
    ("LICENSE.mermaid", "text/plain; charset=utf-8", "no-cache"),
    ("README.md", "text/markdown; charset=utf-8", "no-cache"),
])
async def test_static_files_have_their_type_and_caching(client: TestClient, name: str, ctype: str, cache: str) -> None:
    r = await client.get(f"/static/{name}")
    assert r.status == 200
    assert r.headers["Content-Type"] == ctype
    assert r.headers["Cache-Control"] == cache
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert await r.read() == STATIC.joinpath(name).read_bytes()
    # the page asks for mermaid with a version query: same file
    if name == "mermaid.min.js":
        r = await client.get(f"/static/{name}?v={MERMAID_VERSION}")
        assert r.status == 200 and r.headers["Cache-Control"] == cache


def test_every_file_in_static_is_served_and_nothing_else() -> None:
    shipped = {p.name for p in STATIC.iterdir() if p.is_file()}
    assert shipped == set(STATIC_FILES)


@pytest.mark.parametrize("path", [
    "/static/..%2Fapp.py",
    "/static/..%2f..%2fagent.py",
    "/static/%2e%2e%2fapp.py",
    "/static/..",
    "/static/.",
    "/static/app.py",
    "/static/review.py",
    "/static/__init__.py",
    "/static/review.js%00",
    "/static/review.js.map",
    "/static/REVIEW.HTML",
    "/static/static%2Freview.js",
])
async def test_anything_else_under_static_is_a_404_problem(client: TestClient, path: str) -> None:
    r = await client.get(path)
    assert r.status == 404, path
    body = await r.read()
    assert b"def " not in body and b"import " not in body  # no Python source leaked
    if r.content_type == "application/problem+json":
        doc = await r.json()
        assert doc["status"] == 404 and doc["title"] == "Not Found"


async def test_unknown_static_name_answers_a_problem_document(client: TestClient) -> None:
    r = await client.get("/static/..%2Fapp.py")
    assert r.status == 404 and r.content_type == "application/problem+json"
    doc = await r.json()
    assert doc["status"] == 404 and doc["instance"].startswith("/static/")


async def test_traversal_through_raw_sockets_is_a_404(client: TestClient) -> None:
    # yarl normalises "/static/../x" before sending; send the raw request line ourselves.
    import asyncio

    for target in ("/static/../app.py", "/static/..%2Fapp.py", "/static/%2E%2E/%2E%2E/setup.cfg"):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        status_line = raw.split(b"\r\n", 1)[0]
        assert b" 404 " in status_line + b" ", (target, status_line)
        assert b"def create_app" not in raw and b"[metadata]" not in raw


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.inline_scripts: list[str] = []
        self.urls: list[str] = []
        self.metas: list[dict[str, str | None]] = []
        self.handlers: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.handlers += [k for k in a if k.startswith("on")]
        if tag == "script":
            self.scripts.append(a)
            self._in_script = True
        if tag == "meta":
            self.metas.append(a)
        for k in ("src", "href", "action", "data", "poster"):
            if a.get(k):
                self.urls.append(a[k] or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_scripts.append(data)


def _page() -> _Refs:
    refs = _Refs()
    refs.feed(STATIC.joinpath("review.html").read_text(encoding="utf-8"))
    return refs


def test_page_loads_only_same_origin_scripts_under_a_strict_csp() -> None:
    refs = _page()
    srcs = [s.get("src") or "" for s in refs.scripts]
    assert [s.split("?")[0] for s in srcs] == ["/static/mermaid.min.js", "/static/review.js"]
    assert srcs[0] == f"/static/mermaid.min.js?v={MERMAID_VERSION}"  # the immutable URL changes with the version
    assert refs.inline_scripts == [] and refs.handlers == []
    for url in refs.urls:  # every reference is a path on this origin
        assert (url.startswith("/") and not url.startswith("//")) or url == "data:,", url
    (csp,) = [m["content"] or "" for m in refs.metas if (m.get("http-equiv") or "").lower() == "content-security-policy"]
    directives = {d.split()[0]: d.split()[1:] for d in (x.strip() for x in csp.split(";")) if d}
    assert directives["default-src"] == ["'none'"]
    assert directives["script-src"] == ["'self'"]
    assert directives["connect-src"] == ["'self'"]
    assert "'unsafe-inline'" in directives["style-src"]  # mermaid's SVG carries inline styles; style only
    assert all("unsafe" not in v for k, vs in directives.items() if k != "style-src" for v in vs)
    html = STATIC.joinpath("review.html").read_text(encoding="utf-8")
    assert "http://" not in html and "https://" not in html and "@import" not in html


def test_script_uses_no_network_but_its_own_origin_and_never_inner_html() -> None:
    js = STATIC.joinpath("review.js").read_text(encoding="utf-8")
    assert not re.search(r"https?://", js)
    assert ".innerHTML" not in js and "outerHTML" not in js and "insertAdjacentHTML" not in js
    assert "document.write" not in js and "eval(" not in js and "new Function" not in js
    assert "startOnLoad: false" in js and "securityLevel: 'strict'" in js
    assert "credentials: 'same-origin'" in js and "'X-CSRF-Token'" in js and "fsm_csrf" in js


def test_mermaid_is_the_vendored_release_with_its_license() -> None:
    data = STATIC.joinpath("mermaid.min.js").read_bytes()
    assert hashlib.sha256(data).hexdigest() == MERMAID_SHA256
    assert data.startswith(b'"use strict";var __esbuild_esm_mermaid_nm;')  # the classic build, not the ESM one
    lic = STATIC.joinpath("LICENSE.mermaid").read_text(encoding="utf-8")
    assert lic.startswith("The MIT License (MIT)") and "Knut Sveidqvist" in lic
    readme = STATIC.joinpath("README.md").read_text(encoding="utf-8")
    assert MERMAID_VERSION in readme and MERMAID_SHA256 in readme and "npm pack mermaid@12" in readme


def test_wheel_ships_the_static_files(tmp_path: Path) -> None:
    """Built from a copy of the sources: the wheel holds every static file, byte for byte."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "fsm_agent", src / "fsm_agent", ignore=ignore)
    shutil.copytree(ROOT / "middleware", src / "middleware", ignore=ignore)
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(out), str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        for name in STATIC_FILES:
            arc = f"fsm_agent/server/static/{name}"
            assert arc in names, arc
            assert z.read(arc) == STATIC.joinpath(name).read_bytes()
        assert "fsm_agent/server/review.py" in names
