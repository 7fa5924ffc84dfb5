"""`fsm-agent decode` on the recorded corpus: each body under its own protocol and under each other one.

stdout is data: a body of another protocol must leave it empty, say on stderr what the body
looks like, and exit 1, never with a traceback.
"""

from __future__ import annotations

import asyncio
import io
import sys

import pytest

from corpus import CORPUS, bodies
from fsm_agent.cli import main
from fsm_agent.providers.decode import PROTOCOLS, sniff_protocol

BODIES = bodies()
WRONG = [pytest.param(b, p, id=f"{b.path}-as-{p}") for b in BODIES for p in PROTOCOLS if p != b.protocol]


def decode(protocol: str, path: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["decode", "--protocol", protocol, str(CORPUS / "bodies" / path)], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_the_corpus_has_bodies_of_every_protocol() -> None:
    assert {b.protocol for b in BODIES} == set(PROTOCOLS)


@pytest.mark.parametrize(("body", "protocol"), WRONG)
def test_a_body_of_another_protocol_prints_nothing_on_stdout(body, protocol: str) -> None:
    code, out, err = decode(protocol, body.path)
    assert code == 1
    assert out == ""
    assert err.startswith("fsm-agent decode: ") and "Traceback" not in err


@pytest.mark.parametrize("body", [pytest.param(b, id=b.path) for b in BODIES])
def test_sniffing_never_contradicts_the_recorded_protocol(body) -> None:
    assert sniff_protocol(body.data) in (body.protocol, None)


@pytest.mark.parametrize("body", [pytest.param(b, id=b.path) for b in BODIES if b.status == 200 and b.streaming])
def test_a_good_stream_of_its_own_protocol_still_decodes(body) -> None:
    code, out, err = decode(body.protocol, body.path)
    if code == 0:
        assert out.startswith("{"), err
    else:  # a stream that reports an error inside HTTP 200: the error is on stderr
        assert "fsm-agent decode:" in err


def test_the_error_names_the_protocol_the_body_has() -> None:
    body = next(b for b in BODIES if b.protocol == "anthropic" and b.streaming and b.status == 200)
    code, out, err = decode("openai-chat", body.path)
    assert (code, out) == (1, "")
    assert "this body is anthropic, not openai-chat; try --protocol anthropic" in err


async def test_the_command_writes_no_byte_to_stdout() -> None:
    body = next(b for b in BODIES if b.protocol == "openai-chat" and b.streaming and b.status == 200)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fsm_agent.cli", "decode", "--protocol", "anthropic",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate(body.data)
    assert proc.returncode == 1
    assert out == b""
    assert b"this body is openai-chat, not anthropic" in err and b"Traceback" not in err
