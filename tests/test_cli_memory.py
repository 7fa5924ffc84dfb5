"""``fsm-agent memory list|search|show|delete``: the operator's view of the episodic memory, per tenant,
on episodes the memory plugin saved from real runs into the session store's file."""

from __future__ import annotations

import io
import json

import pytest

from fsm_agent import Agent, ScriptedProvider, tool
from fsm_agent.cli import main
from fsm_agent.providers import tool_call_response
from fsm_agent.store import SQLiteEpisodeStore, SQLiteStore
from fsm_agent_middleware.memory import EpisodicMemory


@tool
def lookup_invoice(number: int) -> dict:
    """Look up an invoice."""
    return {"number": number, "amount": 420}


@pytest.fixture
async def path(tmp_path):
    db = tmp_path / "sessions.db"
    memory = SQLiteEpisodeStore(db)
    for sid, tenant, task in (("acme-1", "acme", "Pay invoice 17"), ("acme-2", "acme", "Book a flight to Paris"),
                              ("beta-1", "beta", "Pay invoice 99")):
        provider = ScriptedProvider([tool_call_response(("lookup_invoice", {"number": 17})), "Done."])
        agent = Agent(provider, tools=[lookup_invoice], middleware=[EpisodicMemory(memory)], store=SQLiteStore(db))
        await agent.run(task, session_id=sid, metadata={"tenant": tenant})
    await memory.close()
    return str(db)


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_list_every_tenant_or_one(path) -> None:
    code, out, _ = cli("memory", "list", "--store", path)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["EPISODE", "TENANT", "OUTCOME", "UPDATED", "GOAL"]
    assert [line.split()[0] for line in lines[1:]] == ["beta-1", "acme-2", "acme-1"]
    code, out, _ = cli("memory", "list", "--store", path, "--tenant", "acme", "--json")
    rows = json.loads(out)
    assert code == 0 and [(r["episode_id"], r["tenant"], r["goal"]) for r in rows] == [
        ("acme-2", "acme", "Book a flight to Paris"), ("acme-1", "acme", "Pay invoice 17")]
    assert rows[1]["steps"][0]["tool"] == "lookup_invoice" and rows[1]["outcome"] == "COMPLETED"


def test_search_is_per_tenant_and_ranked(path) -> None:
    code, out, _ = cli("memory", "search", "paying an invoice", "--tenant", "acme", "--store", path, "--json")
    hits = json.loads(out)
    # both of acme's ran lookup_invoice; the one whose goal is an invoice comes first; beta's is not there
    assert code == 0 and [h["episode"]["episode_id"] for h in hits] == ["acme-1", "acme-2"]
    assert hits[0]["score"] > hits[1]["score"] > 0
    code, out, _ = cli("memory", "search", "invoice", "--tenant", "beta", "--store", path)
    assert code == 0 and [line.split()[1] for line in out.splitlines()[1:]] == ["beta-1"]


def test_show_one_episode(path) -> None:
    code, out, _ = cli("memory", "show", "acme-1", "--store", path)
    assert code == 0
    assert "episode acme-1 (tenant acme, session acme-1)" in out
    assert "Goal: Pay invoice 17" in out and "Outcome: COMPLETED" in out
    assert '- lookup_invoice({"number":17}) ok:' in out
    code, out, _ = cli("memory", "show", "acme-1", "--store", path, "--json")
    assert json.loads(out)["session_id"] == "acme-1"
    code, _, err = cli("memory", "show", "acme-1", "--tenant", "beta", "--store", path)
    assert code == 2 and "no episode 'acme-1' of tenant 'beta'" in err
    code, _, err = cli("memory", "show", "nope", "--store", path)
    assert code == 2 and "no episode 'nope'" in err


def test_delete_one_or_a_tenants_all(path) -> None:
    code, _, err = cli("memory", "delete", "acme-1", "--tenant", "beta", "--store", path)
    assert code == 2 and "of tenant 'beta'" in err  # another tenant's episode is not deleted
    code, out, _ = cli("memory", "delete", "acme-1", "--tenant", "acme", "--store", path)
    assert code == 0 and out == "deleted episode acme-1\n"
    code, _, _ = cli("memory", "delete", "acme-1", "--store", path)
    assert code == 2
    code, out, _ = cli("memory", "delete", "--all", "--tenant", "beta", "--store", path)
    assert code == 0 and out == "deleted 1 episode(s) of tenant beta\n"
    code, out, _ = cli("memory", "list", "--store", path, "--json")
    assert [r["episode_id"] for r in json.loads(out)] == ["acme-2"]
    code, out, _ = cli("sessions", "list", "--store", path, "--json")
    assert len(json.loads(out)) == 3  # the sessions themselves are kept


@pytest.mark.parametrize("argv, says", [
    (("memory", "delete", "--store", "{path}"), "give an EPISODE_ID, or --all"),
    (("memory", "delete", "x", "--all", "--tenant", "a", "--store", "{path}"), "give an EPISODE_ID, or --all"),
    (("memory", "delete", "--all", "--store", "{path}"), "give --tenant"),
    (("memory", "list", "--limit", "0", "--store", "{path}"), "limit is an integer from 1"),
    (("memory", "search", "x", "--tenant", "", "--store", "{path}"), "tenant"),
    (("memory", "list", "--store", "{missing}"), "no store at"),
])
def test_usage_errors_exit_2_and_say_what_to_do(path, tmp_path, argv, says) -> None:
    argv = [a.format(path=path, missing=str(tmp_path / "missing.db")) for a in argv]
    code, _, err = cli(*argv)
    assert code == 2 and says in err, err


def test_the_default_store_is_the_cli_session_store(path, monkeypatch) -> None:
    monkeypatch.setenv("FSM_AGENT_STORE", path)
    code, out, _ = cli("memory", "list", "--tenant", "beta")
    assert code == 0 and "beta-1" in out
