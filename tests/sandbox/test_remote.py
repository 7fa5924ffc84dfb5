"""RemoteSandbox and HttpRemoteExecutor against a small real aiohttp service.

The service in this test implements the documented wire shape (``GET /guarantees``,
``POST /run``) and runs the code in one of the REAL local sandboxes (bubblewrap when installed,
else subprocess): a user's own executor service would look like it. Faults are injected on the
service side (an error status, a body off the wire shape, a dropped connection, a slow answer, a
stopped service) and the runs it made are counted, so "not retried" is a count.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from fsm_agent import Agent, ScriptedProvider, StopReason, ToolResultMessage
from fsm_agent.local import free_port
from fsm_agent.providers import tool_call_response
from fsm_agent.sandbox import (
    GuaranteeNotHeldError,
    HttpRemoteExecutor,
    Limits,
    RemoteSandbox,
    RemoteSandboxError,
    SandboxInputError,
    SandboxUnavailableError,
    codeact_tool,
)
from fsm_agent.sandbox._local import LocalSandbox
from fsm_agent.sandbox.remote import RemoteRequest, result_to_json
from fsm_agent.tools import ToolEffect

from .conftest import absence, build


class Service:
    """An executor service: the wire shape over a real local sandbox, with switchable faults."""

    def __init__(self, sandbox: LocalSandbox) -> None:
        self.sandbox = sandbox
        self.runs = 0
        self.fault: str | None = None
        self.bodies: list[dict[str, Any]] = []
        self.release = asyncio.Event()

    async def guarantees(self, request: web.Request) -> web.Response:
        g = await self.sandbox.start()
        return web.json_response({**g.to_json(), "sandbox": f"remote:{g.sandbox}"})

    async def run(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fault == "status":
            return web.json_response({"error": {"type": "internal", "message": "executor crashed"}}, status=500)
        if self.fault == "unavailable":
            return web.json_response({"error": {"type": "unavailable", "message": "no workers"}}, status=503)
        if self.fault == "drop":
            assert request.transport is not None
            request.transport.close()  # the connection drops mid-request
            await asyncio.sleep(1)
            return web.Response()
        if self.fault == "slow":
            await self.release.wait()  # until the test ends
        if body.get("version") != 1 or not isinstance(body.get("code"), str):
            return web.json_response({"error": {"type": "invalid_input", "message": "version 1 and code needed"}},
                                     status=400)
        try:
            limits = Limits(**body["limits"])
            files = {p: base64.b64decode(c) for p, c in body["files"].items()}
            self.runs += 1
            result = await self.sandbox.run(body["code"], files=files, limits=limits)
        except SandboxInputError as exc:
            return web.json_response({"error": {"type": "invalid_input", "message": str(exc)}}, status=400)
        doc = {"result": result_to_json(result)}
        if self.fault == "shape":
            doc = {"result": {"stdout": 5}}
        if self.fault == "overflow":  # a service that ignores the limits it was sent
            doc["result"].update(stdout="o" * (1 << 20), stderr="é" * (1 << 19), return_repr="r" * (1 << 20),
                                 files=[{"path": f"f{i}", "change": "created"} for i in range(2000)])
        if self.fault == "huge":
            doc["result"]["stdout"] = "h" * (2 << 20)
        return web.Response(body=orjson.dumps(doc), content_type="application/json")


@pytest.fixture
async def service(reachable_dir: Any) -> AsyncIterator[tuple[Service, str]]:
    kind = "bubblewrap" if absence("bubblewrap") is None else "subprocess"
    why = absence(kind)
    if why:
        pytest.skip(why)
    svc = Service(build(kind, workdir_root=reachable_dir))
    app = web.Application()
    app.router.add_get("/v1/guarantees", svc.guarantees)
    app.router.add_post("/v1/run", svc.run)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    yield svc, f"http://127.0.0.1:{port}/v1"
    svc.release.set()
    await runner.cleanup()


async def test_guarantees_and_a_run_round_trip(service: tuple[Service, str]) -> None:
    svc, url = service
    sb = RemoteSandbox(HttpRemoteExecutor(url), limits=Limits(cpu_seconds=3))
    assert sb.guarantees().not_holding() == sb.guarantees().NAMES  # not started: nothing claimed
    g = await sb.start()
    local = svc.sandbox.guarantees()
    assert g.sandbox == f"remote:{local.sandbox}" and g.holding() == local.holding()
    r = await sb.run("import os\nprint(open('in/data.txt').read())\nopen('out.txt', 'w').write('ok')\nos.getuid()",
                     files={"in/data.txt": "hello"})
    assert r.ok and r.stdout == "hello\n" and r.return_value in svc.sandbox.uids
    assert [(f.path, f.change) for f in r.files] == [("out.txt", "created")]
    assert svc.bodies[-1]["limits"]["cpu_seconds"] == 3 and svc.bodies[-1]["version"] == 1
    assert svc.bodies[-1]["files"] == {"in/data.txt": base64.b64encode(b"hello").decode()}
    r = await sb.run("while True:\n    pass", limits=Limits(cpu_seconds=1))
    assert r.limits_hit == ("cpu",) and not r.ok  # the limits sent are the ones applied
    await sb.aclose()


async def test_codeact_over_the_remote_sandbox_in_a_real_agent(service: tuple[Service, str]) -> None:
    svc, url = service
    sb = RemoteSandbox(HttpRemoteExecutor(url))
    tool = codeact_tool(sb)
    assert tool.effect is ToolEffect.SIDE_EFFECT  # a remote executor may keep state: never repeated silently
    script = [tool_call_response(("run_python", {"code": "2 ** 20"})), "done"]
    result = await Agent(ScriptedProvider(script), tools=[tool]).run("go")
    assert result.stop.reason is StopReason.COMPLETED
    (r,) = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert orjson.loads(r.text) == {"ok": True, "return_value": 1048576} and svc.runs == 1
    await sb.aclose()


@pytest.mark.parametrize(("fault", "error", "text"), [
    ("status", RemoteSandboxError, "HTTP 500: executor crashed"),
    ("unavailable", SandboxUnavailableError, "no workers"),
    ("shape", RemoteSandboxError, "does not match the wire shape"),
    ("drop", RemoteSandboxError, "ServerDisconnectedError"),
])
async def test_executor_faults_are_typed_errors_and_are_not_retried(service: tuple[Service, str], fault: str,
                                                                   error: type[Exception], text: str) -> None:
    svc, url = service
    svc.fault = fault
    sb = RemoteSandbox(HttpRemoteExecutor(url))
    with pytest.raises(error, match=text) as info:
        await sb.run("1")
    if fault == "status":
        assert isinstance(info.value, RemoteSandboxError) and info.value.status == 500
    assert len(svc.bodies) == 1  # sent once: a run is never repeated behind the caller's back
    await sb.aclose()


async def test_a_slow_executor_times_out_and_a_stopped_one_cannot_be_reached(service: tuple[Service, str]) -> None:
    svc, url = service
    svc.fault = "slow"
    sb = RemoteSandbox(HttpRemoteExecutor(url, timeout_margin=0.5))
    with pytest.raises(RemoteSandboxError, match="no answer within 1.5 s"):
        await sb.run("1", timeout=1.0)
    gone = RemoteSandbox(HttpRemoteExecutor(f"http://127.0.0.1:{free_port()}/v1", connect_timeout=2))
    with pytest.raises(RemoteSandboxError, match="ClientConnectorError"):
        await gone.start()
    await sb.aclose()
    await gone.aclose()


async def test_input_is_checked_locally_and_by_the_service(service: tuple[Service, str]) -> None:
    svc, url = service
    sb = RemoteSandbox(HttpRemoteExecutor(url))
    with pytest.raises(SandboxInputError, match="relative path"):
        await sb.run("1", files={"../x": "y"})
    executor = HttpRemoteExecutor(url)
    with pytest.raises(SandboxInputError, match="the remote sandbox refused the input: version 1"):
        await executor._call("POST", "/run", {"version": 2, "code": "1"}, 10)
    assert svc.runs == 0
    with pytest.raises(SandboxInputError, match="http:// or https://"):
        HttpRemoteExecutor("ftp://x")
    strict = RemoteSandbox(HttpRemoteExecutor(url), required=("disk_quota",))
    with pytest.raises(GuaranteeNotHeldError, match="disk_quota"):
        await strict.run("1")
    await strict.aclose()
    assert RemoteRequest("1").to_json()["limits"] == {
        "memory_bytes": 512 * 1024 * 1024, "cpu_seconds": 10, "wall_seconds": 30.0, "processes": 32,
        "file_size_bytes": 16 * 1024 * 1024, "open_files": 64, "output_bytes": 65536}
    await sb.aclose()
    await executor.aclose()


async def test_an_answer_beyond_the_limits_is_cut_or_refused(service: tuple[Service, str]) -> None:
    """The service is not trusted to keep the limits: its texts are cut to output_bytes, its files to
    1,000, and a body larger than max_body_bytes is refused without being read to its end."""
    svc, url = service
    svc.fault = "overflow"
    sb = RemoteSandbox(HttpRemoteExecutor(url), limits=Limits(output_bytes=4096))
    r = await sb.run("1")
    assert len(r.stdout.encode()) == 4096 and len(r.stderr.encode()) <= 4096 and r.stderr.startswith("é")
    assert r.return_repr == "r" * 4096 and len(r.files) == 1000 and r.files_truncated
    assert "output" in r.limits_hit
    svc.fault = "huge"
    small = RemoteSandbox(HttpRemoteExecutor(url, max_body_bytes=1 << 20))
    with pytest.raises(RemoteSandboxError, match="larger than 1048576 bytes"):
        await small.run("1")
    await sb.aclose()
    await small.aclose()
