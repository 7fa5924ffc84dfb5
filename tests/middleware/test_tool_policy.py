"""ToolPolicy: the documented example file decides as a reviewer reads it, the first matching rule
wins, denials reach the model as error results, "ask" stops WAITING_HUMAN, and a broken file is
rejected at load time with its name and rule numbers."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

import fsm_agent_middleware.tool_policy as tool_policy_module
from conftest import Recorder
from fsm_agent import (
    Agent,
    Allow,
    AskApproval,
    Deny,
    Middleware,
    RunConfig,
    ScriptedProvider,
    StopReason,
    ToolResultMessage,
    tool,
)
from fsm_agent.providers import tool_call_response
from fsm_agent.tools.demo import calculator
from fsm_agent_middleware.approval import HumanApproval
from fsm_agent_middleware.budget import Budget
from fsm_agent_middleware.tool_policy import PolicyError, ToolPolicy

EXAMPLE = Path(__file__).parent / "data" / "policy.toml"
DEFAULT_DENY = "no rule of the tool policy allows tool {!r} (default: deny)"


@pytest.fixture(scope="module")
def example() -> ToolPolicy:
    return ToolPolicy.from_file(EXAMPLE)


def test_the_docstring_example_is_the_data_file() -> None:
    m = re.search(r"\n( +# policy-example\n.*?# end-policy-example\n)", tool_policy_module.__doc__ or "", re.S)
    assert m is not None
    assert textwrap.dedent(m.group(1)) == EXAMPLE.read_text()


@pytest.mark.parametrize("tool_name,args,expected", [
    ("shell", {"cmd": "ls"}, Deny("shell commands are not allowed (rule 1 'no shell')")),
    ("exec_python", {}, Deny("shell commands are not allowed (rule 1 'no shell')")),
    ("read_file", {"path": "/srv/data/a.txt"}, Allow()),
    ("read_file", {"path": "/srv"}, Allow()),
    ("read_file", {"path": "/srv/../etc/passwd"}, Deny(DEFAULT_DENY.format("read_file"))),  # starts_with would pass
    ("read_file", {"path": "/srvx/a"}, Deny(DEFAULT_DENY.format("read_file"))),
    ("read_file", {"path": "srv/a"}, Deny(DEFAULT_DENY.format("read_file"))),
    ("read_file", {}, Deny(DEFAULT_DENY.format("read_file"))),
    ("write_file", {"path": "/srv/out/report.md"}, Allow()),
    ("write_file", {"path": "/srv/out/run.sh"}, Deny(DEFAULT_DENY.format("write_file"))),
    ("pay", {"amount": 100, "currency": "EUR"}, Allow()),
    ("pay", {"amount": 100.5, "currency": "USD"},
     AskApproval("payments over 100 need a person's approval (rule 5)", ("approve", "reject"))),
    ("pay", {"amount": 0, "currency": "EUR"}, Deny(DEFAULT_DENY.format("pay"))),
    ("pay", {"amount": True, "currency": "EUR"}, Deny(DEFAULT_DENY.format("pay"))),  # a bool is not a number
    ("pay", {"amount": "50", "currency": "EUR"}, Deny(DEFAULT_DENY.format("pay"))),
    ("pay", {"amount": 50, "currency": "GBP"}, Deny(DEFAULT_DENY.format("pay"))),
    ("search", {"query": "cheap flights"}, Allow()),
    ("search", {"query": "x; rm -rf /"}, Deny(DEFAULT_DENY.format("search"))),  # fullmatch, not search
    ("calculator", {"expression": "1+1"}, Allow()),
    ("Calculator", {}, Deny(DEFAULT_DENY.format("Calculator"))),  # globs are case-sensitive
])
def test_example_policy_decisions(example: ToolPolicy, tool_name: str, args: dict[str, Any], expected: Any) -> None:
    assert example.decide(tool_name, args) == expected


@pytest.mark.parametrize("condition,args,holds", [
    ({"equals": 1}, {"v": 1}, True),
    ({"equals": 1}, {"v": True}, False),
    ({"not_equals": "a"}, {"v": "b"}, True),
    ({"not_equals": "a"}, {}, False),  # a missing argument fails every operator but exists
    ({"in": [1, 2]}, {"v": 2}, True),
    ({"not_in": [1, 2]}, {"v": 3}, True),
    ({"not_in": [False]}, {"v": 0}, True),
    ({"lt": 5}, {"v": 4.9}, True),
    ({"ge": 5}, {"v": 5}, True),
    ({"gt": 5}, {"v": 5}, False),
    ({"starts_with": ["/a/", "/b/"]}, {"v": "/b/x"}, True),
    ({"ends_with": ".py"}, {"v": 3}, False),
    ({"contains": "rm -rf"}, {"v": "sudo rm -rf /"}, True),
    ({"contains": "x"}, {"v": ["x", "y"]}, True),
    ({"matches": "[a-z]+"}, {"v": "abc1"}, False),
    ({"under": "/srv/"}, {"v": "/srv/a/../b"}, True),
    ({"exists": True}, {"v": None}, True),
    ({"exists": False}, {"w": 1}, True),
    ({"arg": "o.mode", "equals": "fast"}, {"o": {"mode": "fast"}}, True),
    ({"arg": "paths.1", "under": "/tmp"}, {"paths": ["/etc", "/tmp/x"]}, True),
    ({"arg": "paths.5", "exists": False}, {"paths": []}, True),
])
def test_operators(condition: dict[str, Any], args: dict[str, Any], holds: bool) -> None:
    policy = ToolPolicy([{"tool": "t", "action": "allow", "when": [{"arg": "v", **condition}]}], default="deny")
    assert isinstance(policy.decide("t", args), Allow) is holds


def test_first_matching_rule_wins_and_the_default_is_configurable() -> None:
    deny_first = [{"tool": "*", "action": "deny", "reason": "frozen"}, {"tool": "calc", "action": "allow"}]
    assert ToolPolicy(deny_first).decide("calc", {}) == Deny("frozen (rule 1)")
    allow_first = list(reversed(deny_first))
    assert ToolPolicy(allow_first).decide("calc", {}) == Allow()
    assert ToolPolicy([], default="allow").decide("x", {}) == Allow()
    assert ToolPolicy([], default="ask").decide("x", {}) == AskApproval(
        "no rule of the tool policy allows tool 'x' (default: ask)", ("approve", "edit", "reject", "respond"))
    assert ToolPolicy([{"tool": "x", "action": "ask"}]).decide("x", {}) == AskApproval(
        "tool 'x' needs approval (rule 1)")


# -- real runs -----------------------------------------------------------------------------------
RAN: list[str] = []


@tool
def read_file(path: str) -> str:
    """Read a file."""
    RAN.append(path)
    return f"contents of {path}"


@tool
def pay(amount: float, currency: str) -> str:
    """Pay an amount."""
    RAN.append(f"pay {amount}")
    return "paid"


async def test_run_denial_reaches_the_model_as_an_error_result(example: ToolPolicy) -> None:
    RAN.clear()
    both = tool_call_response(("read_file", {"path": "/srv/a"}), ("read_file", {"path": "/etc/shadow"}))
    provider = ScriptedProvider([both, "done"])
    result = await Agent(provider, tools=[read_file], middleware=[example]).run("go")
    assert result.stop.reason is StopReason.COMPLETED
    assert RAN == ["/srv/a"]
    denied = ToolResultMessage(both.tool_calls[1].id,
                               "Tool call denied by policy (tool_policy): " + DEFAULT_DENY.format("read_file"),
                               is_error=True, name="read_file", metadata={"denied_by": "tool_policy"})
    assert [m for m in result.messages if isinstance(m, ToolResultMessage)][1] == denied
    assert provider.requests[1].messages[-1] == denied  # what the model read next


async def test_run_ask_rule_stops_waiting_human_with_the_call_pending(example: ToolPolicy) -> None:
    RAN.clear()
    big = tool_call_response(("pay", {"amount": 250, "currency": "EUR"}))
    rec = Recorder()
    result = await Agent(ScriptedProvider([big, "done"]), tools=[pay], middleware=[example],
                         observers=[rec]).run("go")
    assert result.stop.reason is StopReason.WAITING_HUMAN
    assert result.stop.detail == "1 tool call(s) need approval: pay"
    (action,) = result.stop.pending_actions
    assert (action.call, action.reason, action.allowed_decisions) == (
        big.tool_calls[0], "payments over 100 need a person's approval (rule 5)", ("approve", "reject"))
    assert RAN == [] and rec.transitions()[-1] == ("MidTurn", "wait_human", "WAITING_HUMAN")


def test_policy_sits_outside_approval_and_budget_whatever_the_list_order() -> None:
    agent = Agent(ScriptedProvider([]), middleware=[Budget(), HumanApproval("*"), ToolPolicy()])
    assert [m.middleware_name for m in agent.middleware] == ["tool_policy", "approval", "budget"]


# -- loading and validation ----------------------------------------------------------------------
def write(tmp_path: Path, text: str, name: str = "policy.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def problems(path: Path) -> list[str]:
    with pytest.raises(PolicyError) as exc:
        ToolPolicy.from_file(path)
    assert str(exc.value) == "\n".join(exc.value.problems)
    return exc.value.problems


def test_every_problem_is_reported_with_the_file_and_rule_number(tmp_path: Path) -> None:
    p = write(tmp_path, """
        default = "maybe"
        owner = "me"

        [[rule]]
        tool = "a"
        acton = "deny"

        [[rule]]
        tool = "b"
        action = "allow"
        when = [{ arg = "x", matches = "(" }, { arg = "y", in = 3 }, { arg = "z", lt = "9" }]

        [[rule]]
        tool = ["c", ""]
        action = "deny"
        allowed_decisions = ["approve"]
        when = [{ arg = "p", under = "srv" }, { arg = "q", exists = "yes" }, { arg = "r" }, { arg = "s", like = 1 }]

        [[rule]]
        tool = "d"
        action = "ask"
        allowed_decisions = ["approve", "ignore"]
        when = { arg = "x", equals = 1 }
    """)
    f = str(p)
    assert problems(p) == [
        f"{f}: unknown top-level key 'owner' (use version, default, rule)",
        f"{f}: 'default' must be one of allow, deny, ask, not 'maybe'",
        f"{f}: rule 1: unknown key 'acton' (rule keys: tool, action, when, reason, name, allowed_decisions)",
        f"{f}: rule 1: 'action' must be one of allow, deny, ask, not None",
        f"{f}: rule 2: condition 1: 'matches' is not a valid regular expression "
        f"(missing ), unterminated subpattern at position 0): '('",
        f"{f}: rule 2: condition 2: 'in' needs a list of values",
        f"{f}: rule 2: condition 3: 'lt' needs a number, not '9'",
        f"{f}: rule 3: 'tool' must be a glob pattern or a list of them",
        f"{f}: rule 3: condition 1: 'under' needs absolute paths (starting with '/'), not 'srv'",
        f"{f}: rule 3: condition 2: 'exists' needs true or false, not 'yes'",
        f"{f}: rule 3: condition 3: no operator given for argument 'r'",
        f"{f}: rule 3: condition 4: unknown operator 'like' (use one of: equals, not_equals, in, not_in, lt, le, "
        "gt, ge, starts_with, ends_with, contains, matches, under, host, exists)",
        f"{f}: rule 3: 'allowed_decisions' only applies to action = \"ask\"",
        f"{f}: rule 4: 'when' must be a list of conditions",
        f"{f}: rule 4: 'allowed_decisions' must be a non-empty list from approve, edit, reject, respond",
    ]


def test_syntax_errors_and_unreadable_files(tmp_path: Path) -> None:
    bad = write(tmp_path, 'default = "deny"\n[[rule]\n')
    (problem,) = problems(bad)
    assert problem.startswith(f"{bad}: invalid TOML: ")
    missing = tmp_path / "nope.toml"
    assert problems(missing) == [f"{missing}: cannot read the policy file: No such file or directory"]
    assert problems(write(tmp_path, "version = 2\n")) == [
        f"{tmp_path / 'policy.toml'}: unsupported version 2 (this reader knows version 1)"]
    bad_json = write(tmp_path, '{"rule": [', name="p.json")
    assert problems(bad_json)[0].startswith(f"{bad_json}: invalid JSON: ")


def test_json_file_with_the_same_structure(tmp_path: Path) -> None:
    p = tmp_path / "policy.json"
    p.write_text(json.dumps({"default": "allow", "rule": [{"tool": "rm*", "action": "deny", "name": "no rm"}]}))
    policy = ToolPolicy.from_file(p)
    assert policy.decide("rmdir", {}) == Deny("tool 'rmdir' is not allowed (rule 1 'no rm')")
    assert policy.decide("ls", {}) == Allow()
    assert repr(policy) == f"ToolPolicy(source={str(p)!r}, rules=1, default='allow')"


def test_rules_given_in_code_are_validated_the_same_way() -> None:
    with pytest.raises(PolicyError) as exc:
        ToolPolicy([{"tool": "x", "action": "allow"}, "deny everything"], default="allow")
    assert exc.value.problems == ["<rules>: rule 2: a rule must be a table ([[rule]])"]


# -- the real local model ------------------------------------------------------------------------


@pytest.mark.llama
async def test_llama_denied_calculator_is_an_error_result_the_model_reads(local_provider: Any) -> None:
    seen: list[Any] = []

    class Spy(Middleware):
        async def wrap_model_call(self, request: Any, call_next: Any, ctx: Any) -> Any:
            seen.append(request)
            return await call_next(request)

    policy = ToolPolicy([{"tool": "calc*", "action": "deny", "reason": "arithmetic is done by hand here"}],
                        default="allow")
    cfg = RunConfig(tool_choice="required", temperature=0.0, max_output_tokens=100, max_iterations=2)
    result = await Agent(local_provider, tools=[calculator], middleware=[Spy(), policy], config=cfg).run(
        "Use the calculator to compute 17 * 23.")
    assert result.stop.reason is StopReason.PAUSED_BUDGET and result.turns == 2
    assert result.tool_calls == 0  # the calculator never ran
    results = [m for m in result.messages if isinstance(m, ToolResultMessage)]
    assert len(results) == 2
    for r in results:
        assert (r.text, r.is_error, r.name) == (
            "Tool call denied by policy (tool_policy): arithmetic is done by hand here (rule 1)", True, "calculator")
    assert seen[1].messages[-1] == results[0]  # the second call's context ends with the denial
