"""Loaders for the recorded corpus (tests/data/shared/corpus, or ``$FSM_AGENT_SHARED/corpus``): every
recording format of SOURCES.md, and the extracted bodies.

* :func:`bodies` — every recorded response (``corpus/bodies/MANIFEST.tsv``): status,
  content type, protocol, streaming flag, exact bytes.
* :func:`exchanges` — the request/response pairs of one recording, in order, from its
  own format (VCR YAML, pydantic-ai VCR, go-vcr, httprr, json request/response list,
  raw SSE, vercel chunk JSONL, bare JSON body). Requests are parsed JSON bodies or ``None``.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(os.environ.get("FSM_AGENT_SHARED", Path(__file__).resolve().parent / "data" / "shared"))
CORPUS = ROOT / "corpus"
CASES = ROOT / "cases"


@dataclass
class Body:
    path: str
    """Body file below corpus/bodies."""
    source: str
    """Recording file below corpus, plus #n."""
    protocol: str
    streaming: bool
    status: int
    content_type: str
    data: bytes = field(repr=False, default=b"")

    @property
    def recording(self) -> str:
        return self.source.split("#")[0]

    @property
    def position(self) -> int:
        return int(self.source.split("#")[1])

    @property
    def id(self) -> str:
        return self.path


@lru_cache(maxsize=1)
def bodies() -> tuple[Body, ...]:
    out = []
    lines = (CORPUS / "bodies" / "MANIFEST.tsv").read_text().splitlines()
    for line in lines[1:]:
        if not line.strip():
            continue
        path, source, protocol, streaming, status, ctype, _sha = line.split("\t")
        data = (CORPUS / "bodies" / path).read_bytes()
        out.append(Body(path, source, protocol, streaming == "yes", int(status), ctype, data))
    return tuple(out)


@lru_cache(maxsize=1)
def formats() -> dict[str, str]:
    """Recording file (relative to corpus/) -> format name, from SOURCES.md."""
    text = (CORPUS / "SOURCES.md").read_text()
    out = {}
    for m in re.finditer(r"^\| `([a-z_]+/[^`]+)` \|(.*)$", text, re.M):
        cells = [c.strip() for c in m.group(2).split("|")]
        # columns after file: origin, upstream path, commit, license, fmt, size, sha, what
        if len(cells) >= 5:
            out[m.group(1)] = cells[4]
    return out


@dataclass
class Exchange:
    request: Any
    """The request body as JSON, or None when the format has none."""
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def _resp_bytes(resp: dict[str, Any]) -> bytes:
    body = resp.get("body", {})
    headers = {k.lower(): v for k, v in (resp.get("headers") or {}).items()}
    if isinstance(body, dict) and "string" in body:
        s = body["string"]
        raw = s if isinstance(s, bytes) else s.encode("utf-8")
    elif "parsed_body" in resp:
        raw = json.dumps(resp["parsed_body"]).encode()
    elif isinstance(body, str):
        raw = body.encode()
    else:
        raw = b""
    enc = headers.get("content-encoding")
    if isinstance(enc, list):
        enc = enc[0]
    if enc == "gzip" or raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except OSError:
            pass
    return raw


def _req_json(req: dict[str, Any]) -> Any:
    if "parsed_body" in req:
        return req["parsed_body"]
    body = req.get("body")
    if isinstance(body, dict):
        body = body.get("string")
    if isinstance(body, bytes):
        body = body.decode()
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def _headers(h: Any) -> dict[str, str]:
    out = {}
    for k, v in (h or {}).items():
        out[k.lower()] = v[0] if isinstance(v, list) and v else v
    return out


def _httprr(raw: bytes) -> list[Exchange]:
    lines = raw.split(b"\n", 1)
    assert lines[0].startswith(b"httprr trace v1"), lines[0]
    rest = lines[1]
    out = []
    while rest:
        header, rest = rest.split(b"\n", 1)
        reqlen, resplen = map(int, header.split())
        req, resp, rest = rest[:reqlen], rest[reqlen:reqlen + resplen], rest[reqlen + resplen:]
        req_body = req.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in req else b""
        head, body = resp.split(b"\r\n\r\n", 1)
        status = int(head.split(b" ", 2)[1])
        hdrs = {}
        for hl in head.split(b"\r\n")[1:]:
            k, _, v = hl.decode().partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if hdrs.get("transfer-encoding") == "chunked":
            body = _dechunk(body)
        out.append(Exchange(json.loads(req_body) if req_body.strip() else None, status, body, hdrs))
    return out


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return out


@lru_cache(maxsize=None)
def exchanges(recording: str) -> tuple[Exchange, ...]:
    """The exchanges of ``recording`` (path relative to corpus/, e.g. ``openai_chat/x.yaml``)."""
    fmt = formats().get(recording, "")
    path = CORPUS / recording
    raw = path.read_bytes()
    if fmt in ("vcr_yaml", "vcr_yaml_pydantic_ai"):
        doc = yaml.safe_load(raw) if b"!!binary" not in raw else yaml.load(raw, Loader=yaml.SafeLoader)
        out = []
        for it in doc["interactions"]:
            resp = it["response"]
            status = resp.get("status", {}).get("code", 200) if isinstance(resp.get("status"), dict) else 200
            out.append(Exchange(_req_json(it["request"]), status, _resp_bytes(resp), _headers(resp.get("headers"))))
        return tuple(out)
    if fmt == "go_vcr_yaml":
        doc = yaml.safe_load(raw)
        out = []
        for it in doc["interactions"]:
            resp = it["response"]
            body = resp.get("body", "")
            out.append(Exchange(_req_json(it["request"]), int(resp.get("code", 200)),
                                body.encode() if isinstance(body, str) else body, _headers(resp.get("headers"))))
        return tuple(out)
    if fmt == "httprr":
        return tuple(_httprr(raw))
    if fmt == "json_req_resp_list":
        out = []
        for it in json.loads(raw):
            resp = it["response"]
            body = resp.get("body")
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            req = it["request"].get("body")
            out.append(Exchange(req, int(resp.get("status_code", 200)), data, _headers(resp.get("headers"))))
        return tuple(out)
    if fmt == "raw_sse":
        return (Exchange(None, 200, raw),)
    if fmt == "jsonl_chunks":
        return tuple(Exchange(None, b.status, b.data) for b in bodies() if b.recording == recording)
    if fmt == "json_body":  # no status stored: the manifest has the one the source names
        return tuple(Exchange(None, b.status, b.data) for b in bodies() if b.recording == recording)
    # observed payloads and anything else: use the extracted bodies
    return tuple(Exchange(None, b.status, b.data) for b in bodies() if b.recording == recording)


def recordings(directory: str) -> list[str]:
    """Recording files (relative to corpus/) in ``directory`` that SOURCES.md lists."""
    return sorted(r for r in formats() if r.startswith(directory + "/"))


def case(name: str) -> Path:
    return CASES / name


def b64(s: str) -> bytes:
    return base64.b64decode(s)


def case_messages(raw: list[dict[str, Any]]) -> list[Any]:
    """The cases' neutral OpenAI-like history (CASES.md "Conventions") as fsm_agent messages.

    ``reasoning_content`` becomes a thinking block from the openai-chat protocol; content given as a
    list of blocks keeps its text and tool_use blocks in order.
    """
    from fsm_agent.types import (
        AssistantMessage,
        SystemMessage,
        TextBlock,
        ThinkingBlock,
        ToolResultMessage,
        ToolUseBlock,
        UserMessage,
    )

    out: list[Any] = []
    for m in raw:
        role, content = m["role"], m.get("content")
        if role == "system":
            out.append(SystemMessage(content))
        elif role == "user":
            out.append(UserMessage(content))
        elif role == "tool":
            out.append(ToolResultMessage(m["tool_call_id"], content))
        else:
            blocks: list[Any] = []
            if m.get("reasoning_content"):
                blocks.append(ThinkingBlock(m["reasoning_content"], source="openai-chat"))
            if isinstance(content, str):
                blocks.append(TextBlock(content))
            for b in content if isinstance(content, list) else []:
                blocks.append(TextBlock(b["text"]) if b["type"] == "text"
                              else ToolUseBlock(b["id"], b["name"], b["input"]))
            blocks += [ToolUseBlock(c["id"], c["name"], c["arguments"]) for c in m.get("tool_calls") or []]
            out.append(AssistantMessage(tuple(blocks)))
    return out
