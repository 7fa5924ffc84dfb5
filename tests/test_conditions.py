"""The one condition vocabulary (``fsm_agent.conditions``) shared by the tool policy's ``when`` rules,
permission scopes and task checks: the ``host`` operator, and what a failed condition says."""

from __future__ import annotations

import pytest

from fsm_agent import Allow, ArgumentCondition, Deny, parse_condition
from fsm_agent_middleware.tool_policy import PolicyError, ToolPolicy

POLICY = ToolPolicy.from_dict({"rule": [{"tool": "fetch", "action": "allow",
                                         "when": [{"arg": "url", "host": ["example.com", "*.example.org"]}]}]})


@pytest.mark.parametrize(("url", "decision"), [
    ("https://example.com/x", Allow), ("http://EXAMPLE.com:8080", Allow), ("example.com/path", Allow),
    ("https://a.b.example.org/", Allow), ("https://example.org/", Deny), ("https://example.com.evil.net/", Deny),
    ("https://example.com@evil.net/", Deny), ("https://evil.net\\@example.com/", Deny), ("https://example.com\n", Deny),
    ("javascript:alert(1)", Deny), ("", Deny), (42, Deny),
])
def test_a_policy_rule_can_limit_the_host_of_a_url(url: object, decision: type) -> None:
    assert isinstance(POLICY.decide("fetch", {"url": url}), decision)


def test_host_patterns_are_checked_when_the_policy_loads() -> None:
    with pytest.raises(PolicyError) as info:
        ToolPolicy.from_dict({"rule": [{"tool": "fetch", "action": "allow",
                                        "when": [{"arg": "url", "host": ["exa mple.com", "*.*.com"]}]}]},
                             source="p.toml")
    assert info.value.problems == ["p.toml: rule 1: condition 1: 'host' needs host names, '*.' + a host name (its "
                                   "subdomains) or '*' (any host), not ['exa mple.com', '*.*.com']"]


def test_a_failed_condition_says_what_does_not_hold() -> None:
    problems: list[str] = []
    cond = parse_condition({"arg": "payment.amount", "gt": 0, "le": 100}, "here", problems)
    assert problems == [] and isinstance(cond, ArgumentCondition)
    assert cond.failure({"payment": {"amount": 40}}) is None
    assert cond.failure({"payment": {"amount": 400}}) == "'payment.amount' is 400: not le 100"
    assert cond.failure({}) == "'payment.amount' is missing (needs: gt 0, le 100)"
    assert cond.describe() == "'payment.amount' gt 0 and le 100"
