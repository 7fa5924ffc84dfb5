"""Recording real traffic (credentials scrubbed) and replaying it through the real HTTP path."""

from __future__ import annotations

import orjson

from fsm_agent import Agent, StopReason, create_provider
from fsm_agent.providers import ProviderConfig
from fsm_agent.testing import RecordedResponse, ReplayServer, load_recording
from fsm_agent.tools.demo import calculator
from test_cli import ANSWER, TOOL_TURN

SECRET = "sk-live-abcdef0123456789"


async def test_record_then_replay_gives_the_same_run(tmp_path) -> None:
    rec_path = tmp_path / "exchanges.json"
    live = ReplayServer([RecordedResponse(200, TOOL_TURN, "text/event-stream"),
                         RecordedResponse(429, b'{"error":{"message":"slow down","type":"requests"}}',
                                          headers={"retry-after-ms": "10", "set-cookie": "s=1"}),
                         RecordedResponse(200, ANSWER, "text/event-stream")], seed=9)
    base = await live.start()
    p = create_provider("openai-compatible", ProviderConfig(base_url=base + "/v1?key=" + SECRET, model="m",
                                                            api_key=SECRET, record_to=str(rec_path)))
    try:
        first = await Agent(p, tools=[calculator]).run("17*23?")
    finally:
        await p.aclose()
        await live.close()
    assert first.stop.reason is StopReason.COMPLETED and first.output == "17 * 23 = 391."

    text = rec_path.read_text()
    assert SECRET not in text  # scrubbed everywhere: headers, URL, bodies
    exchanges = load_recording(rec_path)
    assert [e["response"]["status_code"] for e in exchanges] == [200, 429, 200]
    assert exchanges[0]["request"]["headers"]["authorization"] == "REDACTED"
    assert "key=REDACTED" in exchanges[0]["request"]["url"]
    assert exchanges[1]["response"]["headers"]["set-cookie"] == "REDACTED"
    assert exchanges[0]["request"]["body"]["tools"][0]["function"]["name"] == "calculator"
    assert exchanges[0]["response"]["body"] == TOOL_TURN.decode()

    replay = ReplayServer.from_recording(rec_path, seed=3)
    base = await replay.start()
    p = create_provider("openai-compatible", ProviderConfig(base_url=base, model="m", api_key="other"))
    try:
        again = await Agent(p, tools=[calculator]).run("17*23?")
    finally:
        await p.aclose()
        await replay.close()
    assert again.output == first.output and again.usage == first.usage
    assert [m.role for m in again.messages] == [m.role for m in first.messages]
    assert orjson.loads(replay.requests[0].body)["messages"] == exchanges[0]["request"]["body"]["messages"]
