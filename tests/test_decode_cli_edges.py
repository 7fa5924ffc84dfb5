"""``fsm-agent decode`` edges a first user hit: a stream event that is not JSON says so (with the
JSON decoder's message), a cut stream's partial answer is marked incomplete (no ``end_turn``), a
missing input file and a status outside 100-599 are usage errors (exit 2)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fsm_agent.cli import main

START = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
         b'"role":"assistant","model":"claude","content":[],"stop_reason":null,'
         b'"usage":{"input_tokens":5,"output_tokens":0}}}\n\n'
         b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
         b'"content_block":{"type":"text","text":""}}\n\n'
         b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
         b'"delta":{"type":"text_delta","text":"Hel"}}\n\n')


def decode(tmp_path: Path, raw: bytes, *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "body.sse"
    path.write_bytes(raw)
    out, err = io.StringIO(), io.StringIO()
    code = main(["decode", "--protocol", "anthropic", *flags, str(path)], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_an_event_that_is_not_json_is_named_so(tmp_path) -> None:
    code, _, err = decode(tmp_path, START + b'event: content_block_delta\ndata: {"type": oops\n\n')
    assert code == 1
    assert "stream frame 4 is not valid JSON (unexpected character" in err, err
    assert "not a JSON object" not in err


@pytest.mark.parametrize("tail", [b"", b'event: content_block_delta\ndata: {"type": oops\n\n'], ids=["cut", "bad"])
def test_what_a_cut_stream_decoded_is_marked_incomplete(tmp_path, tail) -> None:
    code, out, err = decode(tmp_path, START + tail)
    assert code == 1
    partial = json.loads(out)
    assert partial["incomplete"] is True and partial["stop_reason"] is None
    assert partial["message"]["content"][0]["text"] == "Hel"
    assert "end_turn" not in out and "decoded so far (incomplete" in err


def test_a_missing_input_file_is_a_usage_error(tmp_path) -> None:
    out, err = io.StringIO(), io.StringIO()
    missing = tmp_path / "nope.sse"
    assert main(["decode", "--protocol", "anthropic", str(missing)], out=out, err=err) == 2
    assert err.getvalue() == f"fsm-agent: cannot read {missing}: No such file or directory\n"


@pytest.mark.parametrize("status", ["99", "600", "0"])
def test_a_status_outside_100_to_599_is_a_usage_error(tmp_path, status) -> None:
    code, out, err = decode(tmp_path, b'{"error": {"message": "x"}}', "--status", status)
    assert (code, out) == (2, "")
    assert f"--status {status}: an HTTP status is 100 to 599" in err
