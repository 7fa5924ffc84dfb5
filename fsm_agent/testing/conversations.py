"""Random *valid* conversations for property tests and benches of anything that edits a history
(compaction, repair, trimming), and :func:`check_pairing`, the pairing invariant they must keep.

Shapes::

    conv = random_conversation(random.Random(seed))       # the same seed gives the same conversation
    conv.messages       # tuple[Message, ...]: what a correct runtime transcript can hold
    conv.goal           # the task, stated in the first user message
    conv.prohibitions   # "never ...", stated in the first user message
    conv.facts          # verified facts, each stated verbatim in exactly one tool result or summary
    conv.pending        # call ids left without a result at the very end (the pending tail)
    check_pairing(conv.messages) == []                    # always
    check_pairing(edited, unique_ids="list")              # the strict reading, see below

What a conversation holds:

* a :class:`SystemMessage`, then a first :class:`UserMessage` with the goal and the prohibitions;
* 1-8 turns (``turns``); a turn is a user message, then 0-4 tool steps (``steps``), then usually
  a final assistant text;
* a tool step is an assistant turn with optional text and 1-3 parallel calls (``parallel``),
  then one :class:`ToolResultMessage` per call. With probability ``split_calls`` (and 2+ calls)
  the calls are split across two consecutive assistant messages, as some providers stream them
  (the first with the text and some calls, the second with the rest); the results of both follow
  the second. With ``shuffle_results`` the results come in random order within the step;
* call ids: with probability ``reuse_ids`` a conversation uses *positional* ids (``call_0``,
  ``call_1``, ... restarting at every step), as Gemini through OpenAI-compatible endpoints,
  Ollama and several llama.cpp chat templates do; so the same id string recurs in later steps
  and turns, never twice in one step. Otherwise ids are unique provider-style ids
  (``toolu_...`` or ``call_...``);
* a cancelled call (probability ``cancelled`` per step, on one call of the step) gets the error
  result ``"cancelled"``; an interrupted one (``interrupted``) gets ``"outcome unknown:
  interrupted ..."`` with ``metadata={"synthetic": "interrupted"}``, as the driver writes it; the
  turn ends after such a step (the run stopped), sometimes with a partial assistant text
  (``provider_data={"interrupted": True}``);
* big tool results (probability ``big_results`` per result): 5-60 KB of JSON records, file
  content or a unified diff;
* facts (``facts``): each successful result may state one fact verbatim (``"the invoice total is
  4,217.50 EUR"``), inside a big result too, somewhere in the middle;
* with probability ``compacted`` the history was already compacted: after the goal message comes a
  user message whose text starts with :data:`SUMMARY_PREFIX` (``"[compacted summary]"``), with
  the goal, decisions, evidence (facts from the removed turns, verbatim, also in ``facts``) and
  to-dos. The prefix is this module's choice, made before ``middleware/compaction.py`` existed;
* with probability ``pending_tail`` the last turn ends in a tool step whose calls are not all
  answered yet (a run stopped while executing them, or a snapshot taken mid-step): the pending
  tail, listed in ``pending``.

**The pairing invariant** (:func:`check_pairing`). A *step* is an assistant message, plus the
assistant messages with tool calls that follow it directly (calls split across two messages);
system messages in between are ignored everywhere. An assistant message without tool calls, a
user message, or an assistant message after a tool result closes the step. Then:

1. every tool result follows its call: its id is the id of a call of the current step (the
   nearest step before it), not yet answered; otherwise it is an orphan (no such call, or the
   call's step was already closed by a user or assistant message) or a duplicate;
2. every call has exactly one result before the message that closes its step, unless it is the
   pending tail (the last step, with nothing after it but its own results);
3. ids are unique: ``unique_ids="step"`` (the default) requires the calls of one step to have
   distinct ids, so every result has exactly one call it can answer; the same id string may come
   back in a *later* step, once the earlier call is closed. That is what providers with
   positional ids send, and it is how ``middleware/repair.py`` matches (a result belongs to the
   nearest earlier assistant turn with a call of its id). ``unique_ids="list"`` is the strict
   reading: no id string twice in the whole list (use it on histories generated with
   ``reuse_ids=0``, or after :func:`~middleware.repair.normalize_tool_call_ids`).

Tool results in user messages (:class:`~fsm_agent.types.ToolResultBlock`) are not examined.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Collection, Sequence
from typing import Any, Literal

from attrs import frozen

from ..types import (
    AssistantMessage,
    Message,
    SystemMessage,
    TextBlock,
    ToolResultMessage,
    ToolUseBlock,
    UserMessage,
    pairing_problems,
)

__all__ = ["SUMMARY_PREFIX", "Conversation", "check_pairing", "conversation_strategy", "random_conversation"]

SUMMARY_PREFIX = "[compacted summary]"
"""How the text of a summary message of an already-compacted history starts."""

Range = tuple[int, int]


@frozen
class Conversation:
    """A generated conversation and what a correct compaction of it must keep."""

    messages: tuple[Message, ...]
    """The history: system prompt, goal message, turns; pairing holds (:func:`check_pairing`)."""
    goal: str
    """The task, stated verbatim in the first user message."""
    prohibitions: tuple[str, ...]
    """Things never to do, each stated verbatim in the first user message."""
    facts: tuple[str, ...]
    """Verified facts, each stated verbatim once: in a tool result or in the earlier summary."""
    pending: tuple[str, ...]
    """Ids of the calls of the last step that have no result (the pending tail); usually empty."""
    compacted: bool = False
    """True when the history starts with an earlier summary (a :data:`SUMMARY_PREFIX` message)."""


# -- vocabulary ---------------------------------------------------------------------------

_GOALS = (
    "Reconcile the March invoices for {org} against the bank export and file a short report",
    "Find why the nightly build of {proj} fails since Tuesday and fix it with a minimal patch",
    "Migrate the {proj} service config from YAML to TOML without changing behaviour",
    "Prepare the release notes for {proj} {ver} from the merged pull requests",
    "Investigate the latency spike on the {proj} API and propose a mitigation",
    "Clean up stale feature flags in {proj} and open one pull request per flag",
    "Audit the access logs of {org} for failed logins in the last 7 days and summarise them",
    "Upgrade {proj} to Python 3.12 and get the test suite green",
)
_PROHIBITIONS = (
    "never delete the production database",
    "never push directly to the main branch",
    "never send email to customers",
    "never run migrations against production",
    "never commit secrets or API keys",
    "never disable the test suite to make it pass",
    "never change the billing code",
    "never restart the payment service during business hours",
    "never share customer data outside the company",
)
_ORGS = ("ACME GmbH", "Globex Ltd", "Initech", "Umbrella SA", "Hooli", "Stark Industries")
_PROJECTS = ("ledger", "atlas", "hermes", "pipeline", "gateway", "inventory", "billing-api")
_WORDS = ("alpha", "beta", "cache", "delta", "event", "frame", "graph", "index", "journal", "kernel",
          "ledger", "merge", "node", "order", "parser", "queue", "record", "schema", "token", "update",
          "vector", "worker", "yield", "zone", "client", "server", "report", "invoice", "account")
_TOOLS = ("read_file", "run_shell", "search_code", "query_db", "http_get", "apply_patch", "list_dir",
          "run_tests", "git_log")
_SYSTEM = ("You are a careful engineering agent. Use the tools to act; verify before you claim. "
           "Follow the user's constraints exactly.")
_FOLLOWUPS = ("Go on.", "Continue with the next part.", "What did you find so far?",
              "Please double-check that and continue.", "OK, proceed.", "Now finish the remaining items.")
_ASSISTANT_TEXT = ("Let me look at that.", "I'll check the relevant files first.",
                   "Running the checks in parallel.", "Next I need the logs.",
                   "That narrows it down; one more look.", "")


def _fact(rng: random.Random) -> str:
    w, w2 = rng.choice(_WORDS), rng.choice(_WORDS)
    n = rng.randrange(10, 99999)
    kind = rng.randrange(10)
    if kind == 0:
        return f"the invoice total is {n:,}.{rng.randrange(100):02d} EUR"
    if kind == 1:
        return f"the failing test is tests/test_{w}.py::test_{w2}_{n}"
    if kind == 2:
        return f"the production database host is db-{n}.internal"
    if kind == 3:
        return f"the customer id for {rng.choice(_ORGS)} is C-{n}"
    if kind == 4:
        return f"the deploy window closes at {rng.randrange(24):02d}:{rng.randrange(60):02d} UTC on day {n % 28 + 1}"
    if kind == 5:
        return f"the bug was introduced in commit {rng.getrandbits(28):07x}{n:05d}"
    if kind == 6:
        return f"the {w} service listens on port {1024 + n % 60000}"
    if kind == 7:
        return f"the backup of the {w} volume is {n} MB"
    if kind == 8:
        return f"the API rate limit of {w2} is {n} requests per minute"
    return f"the config key {w}.{w2} is set to {n}"


def _ident(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits, k=n))


def _args(rng: random.Random, tool: str) -> dict[str, Any]:
    w = rng.choice(_WORDS)
    if tool in ("read_file", "apply_patch"):
        return {"path": f"src/{w}/{rng.choice(_WORDS)}.py"}
    if tool == "run_shell":
        return {"command": f"grep -rn {w} src | head -{rng.randrange(5, 50)}"}
    if tool == "query_db":
        return {"sql": f"SELECT * FROM {w} WHERE id > {rng.randrange(1000)} LIMIT 100"}
    if tool == "http_get":
        return {"url": f"https://internal.example/{w}/{rng.randrange(1000)}"}
    return {"query": w, "limit": rng.randrange(1, 50)}


# -- big results ----------------------------------------------------------------------------

def _big_json(rng: random.Random, size: int, fact: str | None) -> str:
    rows: list[str] = []
    total, at = 0, rng.randrange(1, 40)
    while total < size:
        row: dict[str, Any] = {"id": len(rows), "name": f"{rng.choice(_WORDS)}-{rng.randrange(10**6)}",
                               "status": rng.choice(("ok", "pending", "failed", "ok", "ok")),
                               "amount": round(rng.uniform(0, 10000), 2), "tags": rng.sample(_WORDS, 2)}
        if fact is not None and len(rows) == at:
            row["note"] = fact
        rows.append(json.dumps(row))
        total += len(rows[-1]) + 2
    if fact is not None and at >= len(rows):
        rows.insert(len(rows) // 2, json.dumps({"id": -1, "note": fact}))
    return "[" + ",\n".join(rows) + "]"


def _big_file(rng: random.Random, size: int, fact: str | None) -> str:
    lines: list[str] = []
    total, at = 0, rng.randrange(5, 200)
    while total < size:
        w, w2 = rng.choice(_WORDS), rng.choice(_WORDS)
        k = rng.randrange(4)
        if k == 0:
            line = f"def {w}_{w2}(self, {rng.choice(_WORDS)}: int = {rng.randrange(100)}) -> None:"
        elif k == 1:
            line = f"    {w} = self.{w2}.get({rng.randrange(1000)!r}, None)  # {rng.choice(_WORDS)}"
        elif k == 2:
            line = f"    if {w} is not None and {w2} > {rng.randrange(100)}:"
        else:
            line = f"        return {w}({w2}, retries={rng.randrange(5)})"
        if fact is not None and len(lines) == at:
            line = f"# NOTE: {fact}"
        lines.append(line)
        total += len(line) + 1
    if fact is not None and at >= len(lines):
        lines.insert(len(lines) // 2, f"# NOTE: {fact}")
    return "\n".join(lines)


def _big_diff(rng: random.Random, size: int, fact: str | None) -> str:
    lines: list[str] = []
    total, at = 0, rng.randrange(5, 200)
    while total < size:
        if rng.random() < 0.05 or not lines:
            p = f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"
            head = [f"diff --git a/{p} b/{p}", f"--- a/{p}", f"+++ b/{p}",
                    f"@@ -{rng.randrange(1, 900)},7 +{rng.randrange(1, 900)},8 @@"]
            lines += head
            total += sum(len(h) + 1 for h in head)
        sign = rng.choice((" ", " ", "+", "-"))
        line = f"{sign}    {rng.choice(_WORDS)} = {rng.choice(_WORDS)}({rng.randrange(1000)})"
        if fact is not None and len(lines) >= at:
            line, fact = f"+    # {fact}", None
        lines.append(line)
        total += len(line) + 1
    if fact is not None:
        lines.insert(len(lines) // 2, f"+    # {fact}")
    return "\n".join(lines)


def _result_text(rng: random.Random, tool: str, big: bool, fact: str | None) -> str:
    if big:
        size = rng.randrange(5_000, 60_001)
        kind = rng.randrange(3)
        return (_big_json, _big_file, _big_diff)[kind](rng, size, fact)
    head = rng.choice(("OK.", "Done.", f"{rng.randrange(1, 40)} matches.", "exit code 0.",
                       f"{rng.randrange(1, 500)} rows."))
    body = " ".join(rng.choices(_WORDS, k=rng.randrange(5, 120)))
    return f"{head} {fact}. {body}" if fact is not None else f"{head} {body}"


# -- the generator --------------------------------------------------------------------------

def random_conversation(rng: random.Random, *, turns: Range = (1, 8), steps: Range = (0, 4),
                        parallel: Range = (1, 3), split_calls: float = 0.3, shuffle_results: bool = True,
                        reuse_ids: float = 0.2, cancelled: float = 0.1, interrupted: float = 0.1,
                        big_results: float = 0.2, facts: bool = True, compacted: float = 0.1,
                        pending_tail: float = 0.1) -> Conversation:
    """A valid conversation drawn from ``rng`` (the module docstring says what it holds).

    Deterministic: the same ``rng`` state and options give the same conversation (only ``rng`` is
    used). Ranges are inclusive ``(low, high)``; probabilities are per conversation
    (``reuse_ids``, ``compacted``, ``pending_tail``), per step (``split_calls``, ``cancelled``,
    ``interrupted``) or per result (``big_results``).

    Raises:
        ValueError: a range with ``low > high`` or a negative low, ``parallel`` low below 1.
    """
    for name, (lo, hi) in (("turns", turns), ("steps", steps), ("parallel", parallel)):
        if lo > hi or lo < 0:
            raise ValueError(f"{name} must be (low, high) with 0 <= low <= high, got {(lo, hi)}")
    if parallel[0] < 1 or turns[0] < 1:
        raise ValueError("turns and parallel must be at least 1")

    org, proj = rng.choice(_ORGS), rng.choice(_PROJECTS)
    goal = rng.choice(_GOALS).format(org=org, proj=proj, ver=f"{rng.randrange(1, 9)}.{rng.randrange(20)}")
    prohibitions = tuple(rng.sample(_PROHIBITIONS, rng.randint(1, 3)))
    positional = rng.random() < reuse_ids
    id_prefix = rng.choice(("toolu_", "call_"))
    seen_facts: set[str] = set()
    fact_list: list[str] = []

    def new_fact() -> str | None:
        if not facts:
            return None
        for _ in range(5):
            f = _fact(rng)
            if f not in seen_facts:
                seen_facts.add(f)
                fact_list.append(f)
                return f
        return None

    msgs: list[Message] = [SystemMessage(_SYSTEM)]
    rules = "\n".join(f"- {p}" for p in prohibitions)
    msgs.append(UserMessage(f"Goal: {goal}.\nConstraints:\n{rules}"))
    is_compacted = rng.random() < compacted
    if is_compacted:
        evidence = [f for f in (new_fact() for _ in range(rng.randint(1, 4))) if f is not None]
        lines = [SUMMARY_PREFIX, f"Goal: {goal}.", "Constraints: " + "; ".join(prohibitions) + ".",
                 f"Decisions: work in src/{rng.choice(_WORDS)} first; keep the public API unchanged.",
                 f"Failures: {rng.choice(_TOOLS)} timed out once on {rng.choice(_WORDS)}.",
                 "Evidence:", *(f"- {f}" for f in evidence),
                 f"To-do: check {rng.choice(_WORDS)}; report to the user."]
        msgs.append(UserMessage("\n".join(lines)))

    n_turns = rng.randint(*turns)
    pending: tuple[str, ...] = ()
    tail = rng.random() < pending_tail
    for t in range(n_turns):
        last_turn = t == n_turns - 1
        if t > 0 or is_compacted:
            msgs.append(UserMessage(rng.choice(_FOLLOWUPS)))
        n_steps = rng.randint(*steps)
        if last_turn and tail:
            n_steps = max(n_steps, 1)
        stopped = False
        for s in range(n_steps):
            k = rng.randint(*parallel)
            if positional:
                ids = [f"call_{i}" for i in range(k)]
            else:
                ids = [id_prefix + _ident(rng, 24) for _ in range(k)]
            calls = [ToolUseBlock(i, tool, _args(rng, tool))
                     for i, tool in zip(ids, (rng.choice(_TOOLS) for _ in range(k)), strict=True)]
            text = rng.choice(_ASSISTANT_TEXT)
            if k >= 2 and rng.random() < split_calls:
                cut = rng.randint(1, k - 1)
                first: tuple[Any, ...] = ((TextBlock(text),) if text else ()) + tuple(calls[:cut])
                msgs.append(AssistantMessage(first))
                msgs.append(AssistantMessage(tuple(calls[cut:])))
            else:
                msgs.append(AssistantMessage(((TextBlock(text),) if text else ()) + tuple(calls)))
            fate = ["ok"] * k
            if rng.random() < cancelled:
                fate[rng.randrange(k)] = "cancelled"
            if rng.random() < interrupted:
                fate[rng.randrange(k)] = "interrupted"
            is_tail = last_turn and tail and s == n_steps - 1
            if is_tail:
                answered = rng.randint(0, k - 1)
                for p in rng.sample(range(k), k - answered):
                    fate[p] = "pending"
            results: list[ToolResultMessage] = []
            for c, f in zip(calls, fate, strict=True):
                if f == "ok":
                    fact = new_fact() if rng.random() < 0.5 else None
                    big = rng.random() < big_results
                    results.append(ToolResultMessage(c.id, _result_text(rng, c.name, big, fact), name=c.name))
                elif f == "cancelled":
                    results.append(ToolResultMessage(c.id, "cancelled", is_error=True, name=c.name,
                                                     metadata={"synthetic": "cancelled"}))
                elif f == "interrupted":
                    results.append(ToolResultMessage(
                        c.id, "outcome unknown: interrupted. The run stopped while this tool call was "
                        "running; it may or may not have taken effect.", is_error=True, name=c.name,
                        metadata={"synthetic": "interrupted"}))
            if shuffle_results:
                rng.shuffle(results)
            msgs.extend(results)
            if is_tail:
                pending = tuple(c.id for c, f in zip(calls, fate, strict=True) if f == "pending")
                break
            if "cancelled" in fate or "interrupted" in fate:
                stopped = True
                break
        if last_turn and tail:
            break
        if stopped:
            if rng.random() < 0.3:
                msgs.append(AssistantMessage((TextBlock("I was about to "),), {"interrupted": True}))
            continue
        msgs.append(AssistantMessage(rng.choice(("Done: ", "So far: ", "Result: "))
                                     + " ".join(rng.choices(_WORDS, k=rng.randrange(3, 30))) + "."))
    return Conversation(tuple(msgs), goal, prohibitions, tuple(fact_list), pending, is_compacted)


def conversation_strategy(**options: Any) -> Any:
    """A hypothesis strategy of :class:`Conversation` (``random_conversation(Random(seed),
    **options)`` over 64-bit seeds); needs ``hypothesis``, imported only here."""
    from hypothesis import strategies as st

    return st.integers(0, 2**64 - 1).map(lambda seed: random_conversation(random.Random(seed), **options))


# -- the invariant --------------------------------------------------------------------------

def check_pairing(messages: Sequence[Message], *, unique_ids: Literal["step", "list"] = "step",
                  pending: Collection[str] | None = None) -> list[str]:
    """The violations of the pairing invariant in ``messages``, ``[]`` if none:
    :func:`fsm_agent.types.pairing_problems` (its docstring states the invariant).

    Raises:
        ValueError: ``unique_ids`` is neither ``"step"`` nor ``"list"``.
    """
    return pairing_problems(messages, unique_ids=unique_ids, pending=pending)
