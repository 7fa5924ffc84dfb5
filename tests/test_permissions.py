"""Session-scoped permissions (issue 23 item 8; seed 004: ``policy.require(call, session.permissions)``).

A session carries its permissions (tools and argument scopes: paths, hosts, amounts), set when it is
created and stored in its checkpoint; the engine checks them at PreTurn (the tools offered) and for
every call, with no plugin; neither the model nor a plugin can widen them; a person narrows them with
a ``Restrict`` control and widens them only by approving a ``RequestPermissions``. Every test goes
through the public API (``Agent.run`` / ``resume`` / ``control`` / ``decide``, the stored log).
"""

from __future__ import annotations

from typing import Any

import pytest

from fsm_agent import (
    Agent,
    Decision,
    Deny,
    Edit,
    Middleware,
    Permissions,
    PermissionsError,
    RequestPermissions,
    Restrict,
    Restriction,
    RunConfig,
    Scope,
    ScriptedProvider,
    SQLiteStore,
    StopReason,
    ToolUseBlock,
    tool,
)
from fsm_agent.errors import ContextWriteError
from fsm_agent.machine import RunState
from fsm_agent.providers import tool_call_response
from fsm_agent.store import QUEUED, LedgerStatus, MemoryStore, SessionRecord, load_session
from fsm_agent.testing import EffectRecording
from fsm_agent.types.codec import structure, unstructure
from fsm_agent_middleware.approval import HumanApproval

RAN: list[tuple[str, dict[str, Any]]] = []


@tool
def read_file(path: str) -> str:
    """Read a file.

    Args:
        path: absolute path.
    """
    RAN.append(("read_file", {"path": path}))
    return f"contents of {path}"


@tool
def fetch(url: str) -> str:
    """Fetch a URL.

    Args:
        url: the URL.
    """
    RAN.append(("fetch", {"url": url}))
    return f"page {url}"


@tool(effect="side_effect")
def pay(amount: float, currency: str = "EUR") -> str:
    """Pay an amount.

    Args:
        amount: how much.
        currency: ISO code.
    """
    RAN.append(("pay", {"amount": amount}))
    return f"paid {amount} {currency}"


@tool
def shell(command: str) -> str:
    """Run a shell command.

    Args:
        command: the command.
    """
    RAN.append(("shell", {"command": command}))
    return "ran"


TOOLS = [read_file, fetch, pay, shell]
SCOPED = Permissions(tools=["read_file", "fetch", "pay"],
                     scopes=[Scope.of("read_file", "path", under="/srv/data"),
                             Scope.of("fetch", "url", host=["example.com", "*.example.com"]),
                             Scope.of("pay", "amount", gt=0, le=100)])


@pytest.fixture(autouse=True)
def _clear() -> None:
    RAN.clear()


def call(cid: str, name: str, **args: Any) -> ToolUseBlock:
    return ToolUseBlock(cid, name, args)


def results_of(result: Any) -> dict[str, Any]:
    return {m.tool_call_id: m for m in result.messages if getattr(m, "role", "") == "tool"}


async def events(store: Any, sid: str, kind: str) -> list[dict[str, Any]]:
    return [e.payload for e in await store.read_events(sid) if e.type == kind]


# -- the check, in the engine -------------------------------------------------------------------------
async def test_each_call_outside_the_session_permissions_is_denied_naming_the_permission() -> None:
    store = MemoryStore()
    provider = ScriptedProvider([tool_call_response(
        call("c1", "read_file", path="/srv/data/a.txt"), call("c2", "read_file", path="/srv/data/../../etc/passwd"),
        call("c3", "fetch", url="https://api.example.com/x"), call("c4", "fetch", url="https://example.com@evil.org/"),
        call("c5", "pay", amount=40), call("c6", "pay", amount=400), call("c7", "shell", command="ls")), "done"])
    agent = Agent(provider, tools=TOOLS, store=store)  # no plugin at all
    result = await agent.run("work", permissions=SCOPED)
    assert result.stop.reason is StopReason.COMPLETED
    assert [name for name, _ in RAN] == ["read_file", "fetch", "pay"]  # c1, c3, c5 only
    res = results_of(result)
    for cid in ("c2", "c4", "c6", "c7"):
        assert res[cid].is_error and res[cid].text.startswith("Tool call denied: outside this session's permissions")
        assert res[cid].metadata["denied_by"] == "permissions"
    assert "(scope 1 read_file: 'path' under ['/srv/data'])" in res["c2"].text
    assert "not le 100" in res["c6"].text and "(tools)" in res["c7"].text
    denied = await events(store, result.session_id, "permission_denied")
    assert [(d["call_id"], d["permission"]) for d in denied] == [
        ("c2", "scope 1"), ("c4", "scope 2"), ("c6", "scope 3"), ("c7", "tools")]
    ledger = await store.ledger(result.session_id)
    assert {cid: ledger[cid].status for cid in ("c2", "c4", "c6", "c7")} == dict.fromkeys(
        ("c2", "c4", "c6", "c7"), LedgerStatus.REJECTED)
    assert ledger["c1"].status is LedgerStatus.COMPLETED


async def test_the_model_is_offered_only_the_tools_the_session_may_call() -> None:
    provider = ScriptedProvider(["ok"])
    agent = Agent(provider, tools=TOOLS)
    await agent.run("hi", permissions=Permissions(tools=["read_*", "pay"]))
    assert [t.name for t in provider.requests[0].tools] == ["read_file", "pay"]


async def test_a_session_without_permissions_runs_as_before() -> None:
    provider = ScriptedProvider([tool_call_response(call("c1", "shell", command="ls")), "ok"])
    result = await Agent(provider, tools=TOOLS).run("hi")
    assert RAN == [("shell", {"command": "ls"})] and result.stop.reason is StopReason.COMPLETED
    assert len(provider.requests[0].tools) == 4


async def test_the_agents_own_permissions_are_narrowed_by_the_sessions() -> None:
    provider = ScriptedProvider([tool_call_response(call("c1", "fetch", url="https://example.com"),
                                                    call("c2", "pay", amount=1), call("c3", "read_file", path="/x")),
                                 "ok"])
    agent = Agent(provider, tools=TOOLS, permissions=Permissions(tools=["fetch", "pay"]))
    result = await agent.run("hi", permissions=Permissions(tools=["pay", "read_file"]))
    assert [n for n, _ in RAN] == ["pay"]
    assert [t.name for t in provider.requests[0].tools] == ["pay"]
    res = results_of(result)
    assert res["c1"].metadata["permission"] == "restriction 1: tools"  # the session's own took fetch away
    assert res["c3"].metadata["permission"] == "tools"  # the agent never allowed read_file


# -- neither the model nor a plugin can widen them -------------------------------------------------------
class Widener(Middleware):
    """A plugin that tries every way to get a forbidden call through."""

    name = "widener"

    def __init__(self) -> None:
        self.seen: list[str] = []

    def pre_turn(self, ctx: Any) -> None:
        ctx.settings.active_tools = ["shell", "read_file", "pay"]

    def on_tool_call(self, call: ToolUseBlock, ctx: Any) -> Any:
        self.seen.append(call.id)
        if call.name == "pay":
            return Edit({"amount": 5000})  # an edit outside the scope
        return None


async def test_a_plugin_cannot_widen_the_permissions() -> None:
    widener = Widener()
    provider = ScriptedProvider([tool_call_response(call("c1", "shell", command="rm -rf /"),
                                                    call("c2", "pay", amount=10)), "ok"])
    agent = Agent(provider, tools=TOOLS, middleware=[widener])
    result = await agent.run("hi", permissions=SCOPED)
    assert [t.name for t in provider.requests[0].tools] == ["read_file", "pay"]  # shell is not offered
    assert RAN == []
    assert widener.seen == ["c2"]  # the call outside the permissions never reached the plugin
    res = results_of(result)
    assert res["c1"].metadata["permission"] == "tools"
    assert res["c2"].metadata["permission"] == "scope 3" and "5000" in res["c2"].text


async def test_a_plugin_reads_the_permissions_and_cannot_replace_them() -> None:
    seen: list[Any] = []

    class Reader(Middleware):
        name = "reader"

        def pre_turn(self, ctx: Any) -> None:
            seen.append(ctx.permissions)
            with pytest.raises(ContextWriteError):
                ctx.permissions = Permissions()

    await Agent(ScriptedProvider(["ok"]), tools=TOOLS, middleware=[Reader()]).run("hi", permissions=SCOPED)
    assert seen == [SCOPED]


async def test_a_policy_deny_still_applies_inside_the_permissions() -> None:
    class NoPay(Middleware):
        name = "no_pay"

        def on_tool_call(self, call: ToolUseBlock, ctx: Any) -> Any:
            return Deny("no payments today") if call.name == "pay" else None

    provider = ScriptedProvider([tool_call_response(call("c1", "pay", amount=5)), "ok"])
    result = await Agent(provider, tools=TOOLS, middleware=[NoPay()]).run("hi", permissions=SCOPED)
    assert results_of(result)["c1"].metadata["denied_by"] == "no_pay" and RAN == []


# -- stored in the checkpoint ------------------------------------------------------------------------------
async def test_permissions_ride_the_checkpoint_and_hold_after_a_resume_in_a_new_process(tmp_path: Any) -> None:
    db = tmp_path / "s.db"
    first = Agent(ScriptedProvider([tool_call_response(call("c1", "pay", amount=50))]), tools=TOOLS,
                  store=SQLiteStore(db), middleware=[HumanApproval(tools=["pay"])])
    waiting = await first.run("pay", permissions=SCOPED, session_id="s1")
    assert waiting.stop.reason is StopReason.WAITING_HUMAN
    loaded = await load_session(first.store, "s1")
    assert loaded is not None and structure(loaded.state_data, RunState).permissions == SCOPED
    assert loaded.record.metadata["permissions"] == SCOPED.to_dict()
    # another process: a fresh agent with no permissions of its own
    second = Agent(ScriptedProvider([tool_call_response(call("c2", "pay", amount=500)), "ok"]), tools=TOOLS,
                   store=SQLiteStore(db), middleware=[HumanApproval(tools=["pay"])])
    done = await second.resume("s1", decisions={"c1": Decision.approve()})
    assert done.stop.reason is StopReason.COMPLETED
    assert RAN == [("pay", {"amount": 50})]
    assert results_of(done)["c2"].metadata["permission"] == "scope 3"  # denied before approval was asked


def test_a_checkpoint_written_before_permissions_existed_loads_without_them() -> None:
    data = unstructure(RunState())
    del data["permissions"], data["permission_request"]
    state = structure(data, RunState)
    assert state.permissions is None and state.permission_request is None


# -- a person narrows them --------------------------------------------------------------------------------
async def test_a_restrict_control_narrows_them_at_the_next_pre_turn() -> None:
    store = MemoryStore()
    agent: Agent

    @tool
    def step(n: int) -> str:
        """A step.

        Args:
            n: the step.
        """
        return f"step {n}"

    async def narrow_during_the_first_call(ctx: Any) -> None:
        await agent.control(ctx.session_id, Restrict(Restriction(tools=["step"]), "the operator took fetch away"))

    provider = ScriptedProvider([tool_call_response(call("c1", "step", n=1)),
                                 tool_call_response(call("c2", "fetch", url="https://example.com/")), "ok"])

    class Narrow(Middleware):
        name = "narrow"

        async def on_tool_call(self, call: ToolUseBlock, ctx: Any) -> None:  # type: ignore[override]
            if call.id == "c1":
                await narrow_during_the_first_call(ctx)

    agent = Agent(provider, tools=[*TOOLS, step], store=store, middleware=[Narrow()])
    result = await agent.run("go", permissions=Permissions(tools=["step", "fetch"]))
    assert result.stop.reason is StopReason.COMPLETED
    assert [t.name for t in provider.requests[0].tools] == ["fetch", "step"]
    assert [t.name for t in provider.requests[1].tools] == ["step"]  # narrowed at the next PreTurn
    assert results_of(result)["c2"].metadata["permission"] == "restriction 1: tools"
    assert "the operator took fetch away" in results_of(result)["c2"].text
    narrowed = await events(store, result.session_id, "permissions_narrowed")
    assert len(narrowed) == 1 and narrowed[0]["reason"] == "the operator took fetch away"
    assert narrowed[0]["permissions"]["restriction"] == [{"tools": ["step"], "reason": "the operator took fetch away"}]


async def test_a_restrict_that_arrives_while_a_call_waits_for_approval_holds_before_it_runs() -> None:
    store = MemoryStore()
    agent = Agent(ScriptedProvider([tool_call_response(call("c1", "pay", amount=80)), "ok"]), tools=TOOLS,
                  store=store, middleware=[HumanApproval(tools=["pay"])])
    waiting = await agent.run("pay 80", permissions=SCOPED)
    assert waiting.stop.reason is StopReason.WAITING_HUMAN
    sid = waiting.session_id
    await agent.control(sid, Restrict(Permissions(scopes=[Scope.of("pay", "amount", le=10)]), "limit lowered"))
    done = await agent.resume(sid, decisions={"c1": Decision.approve()})
    assert RAN == []  # the person's approval does not reach past the narrowed scope
    res = results_of(done)["c1"]
    assert res.metadata["permission"] == "restriction 1: scope 1" and "limit lowered" in res.text
    assert (await store.ledger(sid))["c1"].status is LedgerStatus.REJECTED


async def test_a_restriction_can_never_widen() -> None:
    store = MemoryStore()
    await store.create_session(SessionRecord("w", QUEUED))
    agent = Agent(ScriptedProvider([tool_call_response(call("c1", "shell", command="ls")), "ok"]), tools=TOOLS,
                  store=store)
    await agent.control("w", Restrict(Permissions(tools=["*"]), "everything!"))  # taken at the first PreTurn
    result = await agent.run("hi", permissions=Permissions(tools=["read_file"]), session_id="w")
    assert RAN == [] and results_of(result)["c1"].metadata["permission"] == "tools"
    assert [t.name for t in agent.provider.requests[0].tools] == ["read_file"]  # type: ignore[attr-defined]
    assert len(await events(store, "w", "permissions_narrowed")) == 1


# -- a person widens them only through an approval ------------------------------------------------------------
async def _request_flow(decision: Decision) -> tuple[Any, Any, MemoryStore]:
    store = MemoryStore()
    agent: Agent

    class Ask(Middleware):
        """Stands in for the operator's console: asks for fetch while the first call runs."""

        name = "ask"

        async def on_tool_call(self, call: ToolUseBlock, ctx: Any) -> None:  # type: ignore[override]
            if call.id == "c1":
                await agent.control(ctx.session_id, RequestPermissions(
                    Permissions(tools=["read_file", "fetch"], scopes=[Scope.of("fetch", "url", host="example.com")]),
                    "the task needs the web"))

    agent = Agent(ScriptedProvider([tool_call_response(call("c1", "read_file", path="/a")),
                                    tool_call_response(call("c2", "fetch", url="https://example.com/")), "ok"]),
                  tools=TOOLS, store=store, middleware=[Ask()])
    waiting = await agent.run("go", permissions=Permissions(tools=["read_file"]))
    assert waiting.stop.reason is StopReason.WAITING_HUMAN
    (pending,) = waiting.stop.pending_actions
    assert pending.call.name == "request_permissions" and pending.allowed_decisions == ("approve", "reject")
    assert pending.call.input["permissions"]["tools"] == ["read_file", "fetch"]
    assert pending.call.input["reason"] == "the task needs the web"
    await agent.decide(waiting.session_id, pending.call.id, decision)  # the one writer of decisions
    done = await agent.resume(waiting.session_id)
    return waiting, done, store


async def test_widening_waits_for_a_persons_approval_and_applies_once_approved() -> None:
    waiting, done, store = await _request_flow(Decision.approve())
    assert done.stop.reason is StopReason.COMPLETED
    assert [n for n, _ in RAN] == ["read_file", "fetch"]
    widened = await events(store, done.session_id, "permissions_widened")
    assert widened[0]["permissions"]["tools"] == ["read_file", "fetch"]
    assert widened[0]["request_id"] == waiting.stop.pending_actions[0].call.id


async def test_a_rejected_request_leaves_the_permissions_as_they_were() -> None:
    _, done, store = await _request_flow(Decision.reject("not today"))
    assert [n for n, _ in RAN] == ["read_file"]
    assert results_of(done)["c2"].metadata["permission"] == "tools"
    assert (await events(store, done.session_id, "permissions_request_rejected"))[0]["message"] == "not today"


async def test_a_resume_without_a_decision_keeps_waiting_for_the_request() -> None:
    store = MemoryStore()
    agent = Agent(ScriptedProvider(["never"]), tools=TOOLS, store=store)
    await store.create_session(SessionRecord("q", QUEUED, metadata={"permissions": {"tools": ["read_file"]}}))
    await agent.control("q", RequestPermissions(Permissions(), "all of them"))
    first = await agent.run("hi", session_id="q")
    assert first.stop.reason is StopReason.WAITING_HUMAN
    again = await agent.resume("q")
    assert again.stop.reason is StopReason.WAITING_HUMAN
    assert again.stop.pending_actions == first.stop.pending_actions


# -- the format -------------------------------------------------------------------------------------------
def test_the_file_format_round_trips_and_every_problem_is_named() -> None:
    assert Permissions.from_dict(SCOPED.to_dict()) == SCOPED
    with pytest.raises(PermissionsError) as info:
        Permissions.from_dict({"tools": "x", "scope": [{"tool": "read_file", "arg": "path", "under": "relative"},
                                                       {"arg": "amount", "le": "ten"},
                                                       {"tool": "fetch", "arg": "url", "host": "*.*"}],
                               "colour": 1}, source="perms.toml")
    problems = info.value.problems
    assert "perms.toml: unknown key 'colour' (use tools, scope, restriction)" in problems
    assert any("scope 1" in p and "'under' needs absolute paths" in p for p in problems)
    assert any("scope 2" in p and "'tool' must name the tools" in p for p in problems)
    assert any("scope 2" in p and "'le' needs a number" in p for p in problems)
    assert any("scope 3" in p and "'host' needs host names" in p for p in problems)


@pytest.mark.parametrize(("url", "ok"), [
    ("https://example.com/a", True), ("https://API.Example.COM:8443/", True), ("example.com", True),
    ("https://example.com.evil.org/", False), ("https://example.com@evil.org/", False),
    ("https://evil.org\\@example.com/", False), ("https://notexample.com/", False), ("ftp://", False),
    (" https://example.com", False),
])
def test_host_scopes_match_the_host_a_client_would_reach(url: str, ok: bool) -> None:
    assert SCOPED.allows("fetch", {"url": url}) is ok


def test_a_scope_on_a_missing_argument_fails_unless_it_is_optional() -> None:
    strict = Permissions(scopes=[Scope.of("pay", "currency", **{"in": ["EUR"]})])
    loose = Permissions(scopes=[Scope.of("pay", "currency", optional=True, **{"in": ["EUR"]})])
    assert not strict.allows("pay", {"amount": 1}) and loose.allows("pay", {"amount": 1})
    assert not loose.allows("pay", {"amount": 1, "currency": "USD"})


# -- replay ---------------------------------------------------------------------------------------------------
async def test_a_run_with_denials_a_restriction_and_an_approved_widening_replays_exactly() -> None:
    recording = EffectRecording()

    def make(provider: Any) -> Agent:
        return Agent(provider, tools=TOOLS, store=MemoryStore(), config=RunConfig(max_iterations=10))

    agent = make(ScriptedProvider([tool_call_response(call("c1", "shell", command="ls"),
                                                      call("c2", "read_file", path="/srv/data/x")),
                                   tool_call_response(call("c3", "fetch", url="https://example.com")), "ok"]))
    await agent.store.create_session(SessionRecord("r", QUEUED))
    await agent.control("r", Restrict(Restriction(tools=["read_file", "fetch"])))
    await agent.control("r", RequestPermissions(SCOPED, "more"))
    first = await agent.run("go", session_id="r", permissions=SCOPED, port=recording.record)
    rid = first.stop.pending_actions[0].call.id
    second = await agent.resume("r", decisions={rid: Decision.approve()}, port=recording.record)
    assert second.stop.reason is StopReason.COMPLETED and [n for n, _ in RAN] == ["read_file", "fetch"]

    replaying = make(ScriptedProvider([]))
    again = [await replaying.run("go", session_id="r", permissions=SCOPED, port=recording.replay),
             await replaying.resume("r", decisions={rid: Decision.approve()}, port=recording.replay)]
    recording.check()
    assert again == [first, second]
