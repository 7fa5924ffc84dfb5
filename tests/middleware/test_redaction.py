"""Redaction: nothing sensitive reaches the model (checked on the requests it received), placeholders are
stable, allowed tools get the originals back, observers and logs see masked text."""

from __future__ import annotations

import io
import logging
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession, web

from conftest import Recorder
from fsm_agent import (
    Agent,
    ConfigurationError,
    Middleware,
    Ordering,
    RunConfig,
    ScriptedProvider,
    create_provider,
    tool,
)
from fsm_agent.providers import ProviderConfig, RetryPolicy, tool_call_response
from fsm_agent.testing import RecordedResponse, ReplayServer
from fsm_agent.types import (
    AssistantMessage,
    MessageComplete,
    ModelStreamEvent,
    SystemMessage,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolResultMessage,
    UserMessage,
    dumps,
)
from fsm_agent_middleware.redaction import Redaction, RedactionFilter, iban_valid, luhn_valid

EMAIL = "alice.smith@example.com"
KEY = "sk-proj-A1b2C3d4E5f6G7h8I9j0K1l2"
CARD = "4111 1111 1111 1111"
OPS = "ops@example.org"
TASK = f"My email is {EMAIL}, my key is {KEY} and my card is {CARD}. Mail me the key."
MASKED_TASK = ("My email is [REDACTED:email:2], my key is [REDACTED:openai_key:1] and my card is "
               "[REDACTED:credit_card:1]. Mail me the key.")
ORIGINALS = (EMAIL, KEY, CARD, OPS, "4111111111111111")


def mail_tools() -> tuple[list[Any], list[dict[str, str]]]:
    calls: list[dict[str, str]] = []

    @tool
    def send_email(to: str, body: str) -> str:
        """Send an e-mail."""
        calls.append({"tool": "send_email", "to": to, "body": body})
        return f"sent to {to}"

    @tool
    def note(text: str) -> str:
        """Keep a note."""
        calls.append({"tool": "note", "text": text})
        return "noted"

    return [send_email, note], calls


async def run_with_ctx(agent: Agent, *messages: Any) -> tuple[Any, Any]:
    ctx = agent.new_context(list(messages))
    result = await agent.driver(ctx).run()
    return result, ctx


@pytest.mark.parametrize("text,expected", [
    ("key sk-ant-api03-ABCDEFGHIJKLMNOPQRSTUVWXYZ012345 end", "key [REDACTED:anthropic_key:1] end"),
    (f"key {KEY}.", "key [REDACTED:openai_key:1]."),
    ("aws AKIAIOSFODNN7EXAMPLE", "aws [REDACTED:aws_access_key:1]"),
    ("gh ghp_0123456789abcdefghijklmnopqrstuvwxyzAB x", "gh [REDACTED:github_token:1] x"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2ln", "Authorization: Bearer [REDACTED:bearer_token:1]"),
    ("a bearer of bad news", "a bearer of bad news"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----\nafter", "[REDACTED:private_key:1]\nafter"),
    ("cut -----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNz", "cut [REDACTED:private_key:1]"),
    (f"to {EMAIL}, cc bob@corp.io, again {EMAIL}", "to [REDACTED:email:1], cc [REDACTED:email:2], again [REDACTED:email:1]"),
    (f"card {CARD} / 4111-1111-1111-1111 / 3782 822463 10005", "card [REDACTED:credit_card:1] / [REDACTED:credit_card:2] / [REDACTED:credit_card:3]"),
    ("not a card 4111 1111 1111 1112", "not a card 4111 1111 1111 1112"),
    ("iban DE89 3704 0044 0532 0130 00 and GB82WEST12345698765432", "iban [REDACTED:iban:1] and [REDACTED:iban:2]"),
    ("bad iban DE89 3704 0044 0532 0130 01", "bad iban DE89 3704 0044 0532 0130 01"),
    ("call +1 555 123 4567 or (555) 123-4567 or 555.123.4567", "call [REDACTED:phone:1] or [REDACTED:phone:2] or [REDACTED:phone:3]"),
    ("on 2026-11-30 with python 3.11.2 at 12:30, id 1732960000", "on 2026-11-30 with python 3.11.2 at 12:30, id 1732960000"),
])
def test_builtin_rules_mask_exactly_the_sensitive_part(text: str, expected: str) -> None:
    r = Redaction()
    ctx = Agent(ScriptedProvider([])).new_context([])
    assert r.mask_text(text, ctx) == expected
    assert r.mask_text(expected, ctx) == expected  # placeholders are never masked again


def test_checksums() -> None:
    assert luhn_valid("4111 1111 1111 1111") and luhn_valid("378282246310005")
    assert not luhn_valid("4111 1111 1111 1112") and not luhn_valid("4242")
    assert iban_valid("DE89 3704 0044 0532 0130 00") and iban_valid("GB82WEST12345698765432")
    assert not iban_valid("DE89 3704 0044 0532 0130 01") and not iban_valid("XX00")


def test_literals_extra_patterns_and_kind_selection() -> None:
    r = Redaction(kinds=["email"], patterns={"ticket": r"ticket=(?P<secret>\d+)"}, literals={"hunter2": "password"})
    ctx = Agent(ScriptedProvider([])).new_context([])
    assert r.mask_text(f"pw hunter2 ticket=991 {EMAIL} {CARD}", ctx) == \
        f"pw [REDACTED:password:1] ticket=[REDACTED:ticket:1] [REDACTED:email:1] {CARD}"
    assert ctx.state(r)["originals"] == {"[REDACTED:password:1]": "hunter2", "[REDACTED:ticket:1]": "991",
                                         "[REDACTED:email:1]": EMAIL}
    with pytest.raises(ConfigurationError, match=r"unknown redaction kinds \['emails'\]"):
        Redaction(kinds=["emails"])
    with pytest.raises(ConfigurationError, match="redaction kind 'Bad-Kind' must match"):
        Redaction(patterns={"Bad-Kind": "x"})


def test_repr_shows_options_but_never_literal_values() -> None:
    r = Redaction(kinds=["email", "phone"], patterns={"ticket": "t"}, literals=["hunter2", "swordfish"],
                  restore_in_tool_args={"send_email", "crm"})
    assert repr(r) == ("Redaction(kinds=['email', 'phone'], patterns=['ticket'], literals=2, "
                       "restore_in_tool_args=['crm', 'send_email'], mask_events=True, mask_record=True)")
    assert "hunter2" not in repr(r)


async def test_no_original_reaches_the_model_and_only_the_allowed_tool_gets_it() -> None:
    tools, calls = mail_tools()
    provider = ScriptedProvider([
        tool_call_response(("send_email", {"to": "[REDACTED:email:2]", "body": "your key: [REDACTED:openai_key:1]"}),
                           ("note", {"text": "mailed [REDACTED:email:2]"})),
        "Done, I mailed [REDACTED:email:2].",
    ])
    mw = Redaction(restore_in_tool_args={"send_email"})
    agent = Agent(provider, tools=tools, middleware=[mw])
    result, ctx = await run_with_ctx(agent, SystemMessage(f"Support agent. Escalations: {OPS}"), UserMessage(TASK))
    assert result.stop.reason.value == "COMPLETED"
    # the tool on the allow-list ran with the originals; the other one got the placeholder
    assert calls == [{"tool": "send_email", "to": EMAIL, "body": f"your key: {KEY}"},
                     {"tool": "note", "text": "mailed [REDACTED:email:2]"}]
    # what the model received, request by request
    assert len(provider.requests) == 2
    for req in provider.requests:
        wire = dumps(req.messages, tuple)
        for original in ORIGINALS:
            assert original.encode() not in wire
    first, second = provider.requests
    assert first.messages == (SystemMessage("Support agent. Escalations: [REDACTED:email:1]"), UserMessage(MASKED_TASK))
    tool_results = [m for m in second.messages if isinstance(m, ToolResultMessage)]
    assert [m.text for m in tool_results] == ["sent to [REDACTED:email:2]", "noted"]
    # the transcript (conversation of record) was not touched
    assert result.messages[1] == UserMessage(TASK)
    assert [m.text for m in result.messages if isinstance(m, ToolResultMessage)] == [f"sent to {EMAIL}", "noted"]
    state = ctx.state(mw)
    assert state["restored"] == [{"call_id": provider.script[0].tool_calls[0].id, "tool": "send_email",
                                  "placeholders": ["[REDACTED:email:2]", "[REDACTED:openai_key:1]"]}]
    assert state["originals"] == {"[REDACTED:email:1]": OPS, "[REDACTED:email:2]": EMAIL,
                                  "[REDACTED:openai_key:1]": KEY, "[REDACTED:credit_card:1]": CARD}


class LoopDetection(Middleware):
    """Stand-in for the loop detector: innermost too, adds a notice quoting a tool result."""

    name = "loop_detection"
    ordering = Ordering(position="innermost")

    def pre_turn(self, ctx: Any) -> None:
        ctx.messages.append(UserMessage(f"Notice: the tool keeps returning {EMAIL!r}"))


async def test_redaction_masks_what_other_innermost_pre_turn_middleware_add() -> None:
    provider = ScriptedProvider(["ok"])
    agent = Agent(provider, middleware=[Redaction(), LoopDetection()])  # listed first, still runs last
    assert [m.middleware_name for m in agent.middleware] == ["loop_detection", "redaction"]
    await agent.run("hi")
    assert provider.requests[0].messages[-1] == UserMessage("Notice: the tool keeps returning '[REDACTED:email:1]'")


async def test_without_restore_tools_get_placeholders_also_for_values_the_model_wrote() -> None:
    """A value the model wrote itself (never sent to it) is masked in its answer of record, tool-call
    arguments included: a tool not allowed the originals gets the placeholder, as the model's next
    request and the transcript show it."""
    tools, calls = mail_tools()
    provider = ScriptedProvider([tool_call_response(("send_email", {"to": "bob@corp.io", "body": "[REDACTED:email:1]"})),
                                 "ok"])
    result = await Agent(provider, tools=tools, middleware=[Redaction()]).run(f"Forward {EMAIL} to Bob")
    assert calls == [{"tool": "send_email", "to": "[REDACTED:email:2]", "body": "[REDACTED:email:1]"}]
    assistant = provider.requests[1].messages[1]
    assert isinstance(assistant, AssistantMessage)
    assert assistant.tool_calls[0].input == {"to": "[REDACTED:email:2]", "body": "[REDACTED:email:1]"}
    assert provider.requests[1].messages[2].text == "sent to [REDACTED:email:2]"
    recorded = result.messages[1]
    assert isinstance(recorded, AssistantMessage)
    assert recorded.tool_calls[0].input == {"to": "[REDACTED:email:2]", "body": "[REDACTED:email:1]"}


async def test_observers_see_masked_stream_events_and_the_run_records_the_answer_masked() -> None:
    tools, _ = mail_tools()
    rec = Recorder()
    provider = ScriptedProvider([tool_call_response(("note", {"text": "call +1 555 123 4567"})),
                                 "Write to carol@example.net"])
    result = await Agent(provider, tools=tools, middleware=[Redaction()], observers=[rec]).run("hi")
    events = [e.event for e in rec.of(ModelStreamEvent)]
    # a block's deltas add up to it masked (the streaming masker may hold a tail back until the block ends)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Write to [REDACTED:email:1]"
    assert "".join(e.arguments for e in events if isinstance(e, ToolCallArgumentsDelta)) == '{"text":"call [REDACTED:phone:1]"}'
    assert [e.call.input for e in events if isinstance(e, ToolCallEnd)] == [{"text": "call [REDACTED:phone:1]"}]
    assert [e.full_response.text for e in events if isinstance(e, MessageComplete)] == ["", "Write to [REDACTED:email:1]"]
    assert result.output == "Write to [REDACTED:email:1]"  # the answer of record is masked the same way
    assert "carol@example.net" not in repr(result.messages) and "555 123 4567" not in repr(result.messages)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def test_placeholders_split_across_deltas_over_http_never_carry_the_original() -> None:
    sse = (_chunk({"role": "assistant", "content": "Noted: [REDACTED:em"}) + _chunk({"content": "ail:1]."})
           + _chunk({}, "stop") + b"data: [DONE]\n\n")
    rec = Recorder()
    async with ReplayServer([RecordedResponse(200, sse, "text/event-stream")]) as server:
        config = ProviderConfig(base_url=server.base_url, model="m", api_key="k", retry=RetryPolicy(max_attempts=1))
        async with create_provider("openai-compatible", config) as provider:
            result = await Agent(provider, middleware=[Redaction()], observers=[rec]).run(f"I am {EMAIL}")
    (received,) = server.requests
    assert EMAIL.encode() not in received.body
    assert received.json()["messages"] == [{"role": "user", "content": "I am [REDACTED:email:1]"}]
    deltas = [e.event.text for e in rec.of(ModelStreamEvent) if isinstance(e.event, TextDelta)]
    assert "".join(deltas) == "Noted: [REDACTED:email:1]." and all(EMAIL not in d for d in deltas)
    assert EMAIL not in repr(rec.events)
    assert result.output == "Noted: [REDACTED:email:1]."


def test_log_filter_masks_messages_args_and_tracebacks() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(Redaction(literals=["hunter2"]).log_filter())
    log = logging.getLogger("tests.redaction.child")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("user %s sent key %s with password %s", EMAIL, KEY, "hunter2")
        try:
            raise ValueError(f"card {CARD} declined")
        except ValueError:
            log.exception("payment for %s failed", EMAIL)
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "WARNING user [REDACTED:email] sent key [REDACTED:openai_key] with password [REDACTED:secret]"
    assert lines[1] == "ERROR payment for [REDACTED:email] failed"
    assert lines[-1] == "ValueError: card [REDACTED:credit_card] declined"
    assert not any(o in stream.getvalue() for o in (EMAIL, KEY, CARD, "hunter2"))
    assert isinstance(handler.filters[0], RedactionFilter)
    assert repr(handler.filters[0]) == (
        "RedactionFilter(kinds=['secret', 'private_key', 'anthropic_key', 'openai_key', 'aws_access_key', "
        "'github_token', 'bearer_token', 'email', 'iban', 'credit_card', 'phone'])")


class RecordingProxy:
    """Forwards every request to ``upstream`` and keeps the bodies it received (what the model was sent)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.bodies: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        headers = {"Content-Type": "application/json"}
        async with (ClientSession() as session,
                    session.post(self.upstream + request.path_qs, data=body, headers=headers) as up):
            resp = web.StreamResponse(status=up.status,
                                      headers={"Content-Type": up.headers.get("Content-Type", "application/json")})
            await resp.prepare(request)
            async for piece in up.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp

    async def __aenter__(self) -> RecordingProxy:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.mark.llama
async def test_real_llama_server_never_receives_the_originals(llama_server: Any) -> None:
    task = f"My e-mail is {EMAIL} and my card is {CARD}. Repeat my e-mail address."
    async with (RecordingProxy(llama_server.root_url) as proxy,
                create_provider("llamacpp", ProviderConfig(base_url=proxy.url + "/v1")) as provider):
        agent = Agent(provider, middleware=[Redaction()], config=RunConfig(max_output_tokens=30, temperature=0.0))
        result = await agent.run(task)
    assert result.stop.reason.value == "COMPLETED"
    (body,) = proxy.bodies
    for original in ORIGINALS:
        assert original.encode() not in body
    assert orjson.loads(body)["messages"] == [
        {"role": "user", "content": "My e-mail is [REDACTED:email:1] and my card is [REDACTED:credit_card:1]. "
                                    "Repeat my e-mail address."}]
    assert EMAIL not in result.output  # the model never had it
    assert result.messages[0] == UserMessage(task)
