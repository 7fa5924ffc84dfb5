"""Cassettes (fsm_agent.testing.Cassette): a test's provider exchanges recorded from a real loopback
server that streams in small pieces, then replayed with the server gone, matched by the normalised
request (not by order); a changed request fails with the differences named; vcrpy's record modes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from fsm_agent import Agent, StopReason
from fsm_agent.errors import ConfigurationError, ProviderConnectionError, RateLimitError
from fsm_agent.providers import ProviderConfig, RetryPolicy, create_provider, sse
from fsm_agent.testing import Cassette, CassetteMismatch, RecordedResponse, ReplayServer, use_cassette
from fsm_agent.types import (AssistantMessage, MessageComplete, MessageRequest, TextDelta, ToolResultMessage,
                             UserMessage)
from fsm_agent.types.content import ToolUseBlock

KEY = "sk-test-0123456789abcdef"


def chunk(text: str, finish: str | None = None, *, crlf: bool = False) -> bytes:
    data = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]}
    if finish:
        data["usage"] = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    end = b"\r\n\r\n" if crlf else b"\n\n"
    return b"data: " + orjson.dumps(data) + end


def stream_body(*words: str) -> bytes:
    return b"".join(chunk(w) for w in words) + chunk("", "stop") + b": keep-alive\n\ndata: [DONE]\n\n"


def sse_response(body: bytes, **kw: Any) -> RecordedResponse:
    return RecordedResponse(200, body, "text/event-stream", **kw)


def provider(base_url: str, **kw: Any) -> Any:
    kw.setdefault("retry", RetryPolicy(max_attempts=1))
    return create_provider("openai-compatible", ProviderConfig(base_url=base_url + "/v1", model="m", api_key=KEY, **kw))


async def stream(base_url: str, request: MessageRequest) -> tuple[str, list[str]]:
    p = provider(base_url)
    try:
        kinds, text = [], ""
        async for ev in p.chat_stream(request):
            kinds.append(type(ev).__name__)
            if isinstance(ev, TextDelta):
                text += ev.text
            if isinstance(ev, MessageComplete):
                assert ev.full_response.text == text
        return text, kinds
    finally:
        await p.aclose()


def ask(text: str, **kw: Any) -> MessageRequest:
    return MessageRequest("m", [UserMessage(text)], **kw)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every piece of body the SSE decoder is fed, in order (one per network read)."""
    seen: list[bytes] = []
    feed = sse.SSEDecoder.feed

    def spy(self: Any, data: bytes) -> Any:
        seen.append(bytes(data))
        return feed(self, data)

    monkeypatch.setattr(sse.SSEDecoder, "feed", spy)
    return seen


async def test_a_stream_is_recorded_read_by_read_and_replayed_the_same_with_the_server_gone(
        tmp_path: Path, reads: list[bytes]) -> None:
    body = stream_body("Bon", "jour ", "caf\u00e9", " !")
    path = tmp_path / "c.json"
    split = body.index("\u00e9".encode()) + 1                      # the first piece ends inside "é"
    server = ReplayServer([sse_response(body, chunk_delay=0.02)], chunk_sizes=[split, 13, 7, 29])
    async with server:
        with use_cassette(path) as cas:              # "once" and no file: records
            live = await stream(server.base_url, ask("Say hello"))
        assert len(server.requests) == 1 and cas.recorded == 1
    recorded_reads = list(reads)
    assert len(recorded_reads) >= 3 and b"".join(recorded_reads) == body
    assert recorded_reads[0].endswith(b"caf\xc3")                   # the reader met a split character

    saved = json.loads(path.read_text())
    (ex,) = saved
    assert ex["request"]["body"]["messages"] == [{"role": "user", "content": "Say hello"}]
    assert ex["request"]["headers"]["authorization"] == "REDACTED" and KEY not in path.read_text()
    assert ex["response"]["body"].encode() == body                 # the body as it came, byte for byte
    assert ex["response"]["reads"] == [len(r) for r in recorded_reads]
    assert ex["response"]["complete"] is True and ex["response"]["status_code"] == 200
    assert len(ex["response"]["times"]) == len(recorded_reads)
    assert ex["response"]["times"] == sorted(ex["response"]["times"])

    # replayed: the server is closed (its port refuses), another base URL port, the same reads
    reads.clear()
    with use_cassette(path, record_mode="none") as cas:
        replayed = await stream("http://127.0.0.1:9", ask("Say hello"))
    assert replayed == live and live[0] == "Bonjour caf\u00e9 !"
    assert reads == recorded_reads
    assert cas.played == [0] and cas.all_played and cas.recorded == 0


async def test_requests_are_matched_by_their_normalised_content_not_their_order(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    server = ReplayServer([sse_response(stream_body("Paris")), sse_response(stream_body("Rome"))])
    history = [UserMessage("What is 2+2? Use the tool."),
               AssistantMessage([ToolUseBlock("call_7f3a9c2e11b4", "calc", {"x": "2+2"})]),
               ToolResultMessage("call_7f3a9c2e11b4", "4")]
    async with server:
        with use_cassette(path):
            assert (await stream(server.base_url, ask("Capital of France?")))[0] == "Paris"
            assert (await stream(server.base_url, MessageRequest("m", history)))[0] == "Rome"
    # the other order; the call id is another random one (as the constrained tool mode makes):
    # the pairing of call and result is compared, not the value
    other = [history[0], AssistantMessage([ToolUseBlock("call_00aa11bb22cc", "calc", {"x": "2+2"})]),
             ToolResultMessage("call_00aa11bb22cc", "4")]
    with use_cassette(path, record_mode="none") as cas:
        assert (await stream("http://127.0.0.1:9", MessageRequest("m", other)))[0] == "Rome"
        assert (await stream("http://127.0.0.1:9", ask("Capital of France?")))[0] == "Paris"
    assert cas.played == [1, 0]
    # results paired with other calls make another request
    two = [UserMessage("Two sums."), AssistantMessage([ToolUseBlock("call_aaaaaaaaaaaa", "calc", {"x": "1+1"}),
                                                       ToolUseBlock("call_bbbbbbbbbbbb", "calc", {"x": "2+2"})])]
    straight = [*two, ToolResultMessage("call_aaaaaaaaaaaa", "2"), ToolResultMessage("call_bbbbbbbbbbbb", "4")]
    crossed = [*two, ToolResultMessage("call_bbbbbbbbbbbb", "2"), ToolResultMessage("call_aaaaaaaaaaaa", "4")]
    async with ReplayServer([sse_response(stream_body("ok"))]) as server:
        with use_cassette(path, record_mode="new_episodes"):
            await stream(server.base_url, MessageRequest("m", straight))
    with use_cassette(path, record_mode="none"), pytest.raises(CassetteMismatch) as info:
        await stream("http://127.0.0.1:9", MessageRequest("m", crossed))
    # (the wire puts results in the order of their calls: the contents moved)
    assert [d[0] for d in info.value.differences] == ["body.messages[2].content", "body.messages[3].content"]
    assert 'body.messages[2].content: "2" -> "4"' in str(info.value)


async def test_a_changed_request_fails_with_what_changed_and_how_to_re_record(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    async with ReplayServer([sse_response(stream_body("391"))]) as server:
        with use_cassette(path):
            await stream(server.base_url, ask("What is 17*23?", temperature=0.0))
    with use_cassette(path, record_mode="none"), pytest.raises(CassetteMismatch) as info:
        await stream("http://127.0.0.1:9", ask("What is 17*24?", temperature=0.0, max_tokens=50))
    err = info.value
    text = str(err)
    assert 'body.messages[0].content: "What is 17*23?" -> "What is 17*24?"' in text
    assert "body.max_tokens: (missing) -> 50" in text
    assert '\n-        "content": "What is 17*23?"\n+        "content": "What is 17*24?"\n' in text   # a unified diff
    assert '\n+    "max_tokens": 50,\n' in text
    assert "--cassette-mode=all" in text and "new_episodes" in text
    assert err.closest_index == 0 and [d[0] for d in err.differences] == ["body.messages[0].content",
                                                                          "body.max_tokens"]
    # ignored fields do not count
    with use_cassette(path, record_mode="none", ignore=["body.max_tokens"]), pytest.raises(CassetteMismatch) as info:
        await stream("http://127.0.0.1:9", ask("What is 17*24?", temperature=0.0, max_tokens=50))
    assert [d[0] for d in info.value.differences] == ["body.messages[0].content"]
    # sent more often than recorded
    with use_cassette(path, record_mode="none"):
        await stream("http://127.0.0.1:9", ask("What is 17*23?", temperature=0.0))
        with pytest.raises(CassetteMismatch, match="already played"):
            await stream("http://127.0.0.1:9", ask("What is 17*23?", temperature=0.0))
    with use_cassette(path, record_mode="none", allow_repeats=True):
        for _ in range(2):
            assert (await stream("http://127.0.0.1:9", ask("What is 17*23?", temperature=0.0)))[0] == "391"


async def test_an_agent_run_raises_the_mismatch_instead_of_ending_in_a_stop(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    async with ReplayServer([sse_response(stream_body("Hi there"))]) as server:
        p = provider(server.base_url)
        with use_cassette(path):
            result = await Agent(p).run("Say hi")
        await p.aclose()
    assert result.stop.reason is StopReason.COMPLETED and result.output == "Hi there"
    p = provider("http://127.0.0.1:9")
    with use_cassette(path, record_mode="none"):
        assert (await Agent(p).run("Say hi")).output == "Hi there"
        with pytest.raises(CassetteMismatch, match=r'body.messages\[0\].content: "Say hi" -> "Say bye"'):
            await Agent(p).run("Say bye")
    await p.aclose()


async def test_record_modes(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "c.json"
    with pytest.raises(ConfigurationError, match="record_mode 'none' only replays"):
        with use_cassette(path, record_mode="none"):
            pass
    with pytest.raises(ConfigurationError, match="record_mode 'sometimes'"):
        Cassette(path, record_mode="sometimes")
    server = ReplayServer([sse_response(stream_body(w)) for w in ("one", "two", "three", "four")])
    async with server:
        base = server.base_url
        with use_cassette(path):                               # once, no file: records
            await stream(base, ask("1"))
        with use_cassette(path):                               # once, a file: replays only
            assert (await stream(base, ask("1")))[0] == "one"
            with pytest.raises(CassetteMismatch):
                await stream(base, ask("2"))
        assert len(server.requests) == 1
        with use_cassette(path, record_mode="new_episodes") as cas:   # keeps "1", records "2"
            assert (await stream(base, ask("1")))[0] == "one"
            assert (await stream(base, ask("2")))[0] == "two"
        assert cas.recorded == 1 and len(server.requests) == 2
        assert [e["request"]["body"]["messages"][0]["content"] for e in json.loads(path.read_text())] == ["1", "2"]
        with use_cassette(path, record_mode="all") as cas:     # re-records: only what this run sent
            assert (await stream(base, ask("2")))[0] == "three"
        assert len(server.requests) == 3
        saved = json.loads(path.read_text())
        assert [e["request"]["body"]["messages"][0]["content"] for e in saved] == ["2"]
        with use_cassette(path, record_mode="none") as cas:
            assert (await stream(base, ask("2")))[0] == "three"
            assert cas.all_played
        assert len(server.requests) == 3
    with use_cassette(path, record_mode="none") as cas:
        pass
    with pytest.raises(AssertionError, match="1 recorded request"):
        cas.assert_all_played()


async def test_a_dropped_stream_and_an_error_status_replay_as_they_happened(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    body = stream_body("partial ", "answer", "never", "sent")
    cut = body.index(b"never")
    served = [sse_response(body, drop_after=cut),
              RecordedResponse(429, b'{"error": {"message": "slow down", "type": "rate_limit"}}',
                               headers={"retry-after": "7"})]
    outcomes = []
    for mode, base in (("once", None), ("none", "http://127.0.0.1:9")):
        server = ReplayServer(served, chunk_sizes=[40])
        async with server:
            with use_cassette(path, record_mode=mode):
                p = provider(base or server.base_url)
                seen = []
                with pytest.raises(ProviderConnectionError) as dropped:
                    async for ev in p.chat_stream(ask("stream")):
                        if isinstance(ev, TextDelta):
                            seen.append(ev.text)
                with pytest.raises(RateLimitError) as limited:
                    await p.chat(ask("json"))
                await p.aclose()
        outcomes.append(("".join(seen), dropped.value.partial.text if dropped.value.partial else None,
                         limited.value.retry_after, limited.value.status, "slow down" in str(limited.value)))
    assert outcomes[0] == outcomes[1] == ("partial answer", "partial answer", 7.0, 429, True)
    saved = json.loads(path.read_text())
    assert saved[0]["response"]["complete"] is False and saved[1]["response"]["status_code"] == 429


async def test_a_body_that_is_not_utf8_is_kept_exactly(tmp_path: Path, reads: list[bytes]) -> None:
    body = chunk("ok") + b": \xff\xfe not utf-8 comment\n\n" + chunk("", "stop", crlf=True) + b"data: [DONE]\r\n\r\n"
    path = tmp_path / "c.json"
    async with ReplayServer([sse_response(body)], chunk_sizes=[17]) as server:
        with use_cassette(path):
            assert (await stream(server.base_url, ask("x")))[0] == "ok"
    live = list(reads)
    reads.clear()
    saved = json.loads(path.read_text())
    assert saved[0]["response"]["body"] is None and saved[0]["response"]["body_base64"]
    with use_cassette(path, record_mode="none"):
        assert (await stream("http://127.0.0.1:9", ask("x")))[0] == "ok"
    assert reads == live and b"".join(reads) == body


async def test_realtime_replay_waits_the_recorded_gaps_so_a_stall_times_out_again(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    body = stream_body("a", "b")
    async with ReplayServer([sse_response(body, chunk_delay=0.5)], chunk_sizes=[len(chunk("a"))]) as server:
        with use_cassette(path):
            await stream(server.base_url, ask("x"))
    p = create_provider("openai-compatible", ProviderConfig(base_url="http://127.0.0.1:9/v1", model="m",
                                                            api_key=KEY, chunk_timeout=0.2))
    from fsm_agent.errors import ProviderTimeoutError
    with use_cassette(path, record_mode="none", realtime=True):
        with pytest.raises(ProviderTimeoutError, match="stream stalled"):
            async for _ in p.chat_stream(ask("x")):
                pass
    with use_cassette(path, record_mode="none"):              # no waiting: the same stream, at once
        assert "".join([ev.text async for ev in p.chat_stream(ask("x")) if isinstance(ev, TextDelta)]) == "ab"
    await p.aclose()


def test_one_cassette_at_a_time(tmp_path: Path) -> None:
    with use_cassette(tmp_path / "a.json"):
        with pytest.raises(ConfigurationError, match="one cassette at a time"):
            with use_cassette(tmp_path / "b.json"):
                pass
    with use_cassette(tmp_path / "b.json"):  # the first one left: a new one can be used
        pass
