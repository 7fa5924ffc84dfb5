"""`fsm-agent decode` never prints a traceback: any body, any protocol flag, binary junk, empty
input, huge lines, corpus bodies with a field's type mutated or cut anywhere.

The outcome is always JSON on stdout (exit 0) or lines on stderr starting ``fsm-agent decode:``
(exit 1), and never the one-line "internal error" that the CLI prints in place of a traceback for
a bug of its own.
"""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys

import pytest

from corpus import bodies
from fsm_agent.cli import main
from fsm_agent.providers.decode import PROTOCOLS
from providers.hostile import corpus_frames, dumps, mutate

FLAGS = [[], ["--events"], ["--status", "200"]]


def decode(protocol: str, raw: bytes, *flags: str, tmp_path) -> tuple[int, str, str]:
    path = tmp_path / "body"
    path.write_bytes(raw)
    out, err = io.StringIO(), io.StringIO()
    code = main(["decode", "--protocol", protocol, *flags, str(path)], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def assert_clean(code: int, out: str, err: str) -> None:
    assert code in (0, 1), (code, err)
    assert "Traceback" not in err and "internal error" not in err, err
    if code == 1:
        assert err.startswith("fsm-agent"), err
    if code == 0:
        assert out.strip(), err


JUNK = {
    "empty": b"",
    "whitespace": b" \n\r\n\t",
    "binary": bytes(random.Random(1).randrange(256) for _ in range(4096)),
    "nul": b"\x00" * 100,
    "bad-utf8-sse": b"data: {\"a\": \"\xff\xfe\"}\n\n",
    "sse-no-json": b"data: hello\n\ndata: [DONE]\n\n",
    "sse-comments-only": b": ping\n: ping\n\n",
    "sse-array": b"data: [1,2,3]\n\n",
    "sse-number": b"data: 5\n\n",
    "sse-null": b"data: null\n\n",
    "event-only": b"event: message_start\n\n",
    "json-array": b"[1, 2]",
    "json-string": b'"hello"',
    "json-deep": b"[" * 5000 + b"]" * 5000,
    "json-deep-ok": b'{"choices": [], "x": ' + b"[" * 500 + b"]" * 500 + b"}",
    "truncated-json": b'{"choices": [{"message": {"content": "hi',
    "crlf": b"data: {}\r\n\r\n",
    "lone-cr": b"data: {}\r\rdata: {}\r\r",
    "huge-int": b'{"usage": {"prompt_tokens": 123456789012345678901234567890}, "choices": []}',
    "error-object": b'{"error": {"message": "bad", "type": "invalid_request_error"}}',
    "error-string": b'{"error": "bad"}',
    "error-in-stream": b'event: error\ndata: {"error": {"message": "overloaded", "type": "overloaded_error"}}\n\n',
}


@pytest.mark.parametrize("flags", FLAGS, ids=["plain", "events", "status200"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", list(JUNK))
def test_junk_never_gives_a_traceback(name: str, protocol: str, flags: list[str], tmp_path) -> None:
    assert_clean(*decode(protocol, JUNK[name], *flags, tmp_path=tmp_path))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_line_over_the_event_limit_is_an_error_not_a_crash(protocol: str, tmp_path) -> None:
    raw = b"data: " + b"x" * (17 * 1024 * 1024) + b"\n\n"
    code, out, err = decode(protocol, raw, tmp_path=tmp_path)
    assert_clean(code, out, err)
    assert code == 1 and "byte limit" in err


def test_a_huge_json_line_decodes(tmp_path) -> None:
    raw = b'{"choices": [{"message": {"content": "' + b"a" * (20 * 1024 * 1024) + b'"}}]}'
    code, out, err = decode("openai-chat", raw, tmp_path=tmp_path)
    assert code == 0 and "Traceback" not in err


def _rebuild(events, pos: int, data: str) -> bytes:
    out = []
    for i, ev in enumerate(events):
        text = data if i == pos else ev.data
        out.append((f"event: {ev.event}\n" if ev.event != "message" else "") +
                   "".join(f"data: {line}\n" for line in text.split("\n")) + "\n")
    return "".join(out).encode()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_type_mutated_corpus_bodies_under_every_protocol_flag(protocol: str, tmp_path) -> None:
    frames = corpus_frames()
    rng = random.Random(f"decode-{protocol}")
    cases = [(s, pos) for s in frames.streams for pos in s.frames] + [(b, None) for b in frames.bodies]
    for _ in range(150):
        src, pos = rng.choice(cases)
        if pos is None:
            mutated, _what = mutate(src.obj, rng)
            raw = dumps(mutated).encode()
        else:
            mutated, _what = mutate(json.loads(src.events[pos].data), rng)
            raw = _rebuild(src.events, pos, dumps(mutated))
        for flags in FLAGS[:2]:
            assert_clean(*decode(protocol, raw, *flags, tmp_path=tmp_path))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_corpus_bodies_cut_anywhere(protocol: str, tmp_path) -> None:
    rng = random.Random(f"cut-{protocol}")
    for b in bodies():
        for _ in range(3):
            cut = rng.randrange(len(b.data) + 1)
            assert_clean(*decode(protocol, b.data[:cut], tmp_path=tmp_path))


def test_the_installed_command_on_stdin_junk_prints_no_traceback() -> None:
    for raw in (b"", JUNK["binary"], JUNK["json-deep"], b"data: \xff\n\n"):
        proc = subprocess.run([sys.executable, "-m", "fsm_agent.cli", "decode", "--protocol", "anthropic"],
                              input=raw, capture_output=True, timeout=60)
        assert proc.returncode == 1
        assert b"Traceback" not in proc.stderr and proc.stderr.startswith(b"fsm-agent decode:"), proc.stderr
