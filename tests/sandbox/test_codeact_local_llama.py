"""CodeAct end to end on the real local llama.cpp model (SmolLM2-135M) and a real sandbox.

The task needs a computation whose answer the model cannot guess: the sum of the squares of the
first 25 prime numbers (65,796). The model is tiny, so the task is made robust without faking it:
a system prompt, two worked examples in the history (for 5 and 8 primes, with their real results),
a helper module ``mathkit.py`` in each call's work dir, ``tool_choice="required"`` and three
attempts within the run. What is asserted is real: the model's own code, run in the real sandbox,
returned the right number to the model, the ledger recorded the call, and the session recorded the
sandbox's guarantees.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from fsm_agent import Agent, RunConfig
from fsm_agent.sandbox import SESSION_METADATA_KEY, Limits, codeact_tool
from fsm_agent.store import LedgerStatus, MemoryStore
from fsm_agent.types import AssistantMessage, TextBlock, ToolResultMessage, ToolUseBlock, UserMessage

from .conftest import absence, build

pytestmark = pytest.mark.llama

MATHKIT = '''def first_primes(n):
    """The first n prime numbers."""
    primes = []
    k = 2
    while len(primes) < n:
        if all(k % p for p in primes):
            primes.append(k)
        k += 1
    return primes
'''
SYSTEM = "You answer by calling the run_python tool with Python code, then give the number it returned."


def squares_of_first_primes(n: int) -> int:
    primes: list[int] = []
    k = 2
    while len(primes) < n:
        if all(k % p for p in primes):
            primes.append(k)
        k += 1
    return sum(p * p for p in primes)


def worked_example(i: int, n: int) -> list[Any]:
    code = f"from mathkit import first_primes; primes = first_primes({n}); total = sum(p * p for p in primes); total"
    value = squares_of_first_primes(n)
    return [UserMessage(f"What is the sum of the squares of the first {n} prime numbers?"),
            AssistantMessage((ToolUseBlock(f"example_{i}", "run_python", {"code": code}),)),
            ToolResultMessage(f"example_{i}", orjson.dumps({"ok": True, "return_value": value}).decode(),
                              name="run_python"),
            AssistantMessage((TextBlock(f"The sum is {value}."),))]


async def test_the_model_computes_with_python_in_the_sandbox(local_provider: Any, reachable_dir: Any) -> None:
    kind = "bubblewrap" if absence("bubblewrap") is None else "subprocess"
    why = absence(kind)
    if why:
        pytest.skip(why)
    store = MemoryStore()
    sandbox = build(kind, workdir_root=reachable_dir, limits=Limits(cpu_seconds=5, wall_seconds=15))
    tool = codeact_tool(sandbox, files={"mathkit.py": MATHKIT}, store=store)
    history = worked_example(1, 5) + worked_example(2, 8)
    agent = Agent(local_provider, tools=[tool], system_prompt=SYSTEM, store=store,
                  config=RunConfig(tool_choice="required", temperature=0.0, max_iterations=3, max_output_tokens=160))
    result = await agent.run(history + [UserMessage("What is the sum of the squares of the first 25 prime numbers?")],
                             session_id="llama-codeact")
    new = result.messages[len(history):]
    calls = [b for m in new if m.role == "assistant" for b in m.tool_calls]
    answers = [m for m in new if isinstance(m, ToolResultMessage)]
    assert calls, f"the model made no tool call: {result.stop}"
    right = [r for r in answers if not r.is_error and orjson.loads(r.text).get("return_value") == 65796]
    assert squares_of_first_primes(25) == 65796
    assert right, f"no call returned 65796: {[c.input for c in calls]} -> {[r.text[:200] for r in answers]}"
    good_call = next(c for c in calls if c.id == right[0].tool_call_id)
    assert "25" in good_call.input["code"]  # the model's own code, for this question
    ledger = await store.ledger("llama-codeact")
    assert ledger[good_call.id].status is LedgerStatus.COMPLETED and ledger[good_call.id].tool == "run_python"
    record = await store.get_session("llama-codeact")
    assert record is not None and record.metadata[SESSION_METADATA_KEY]["sandbox"] == kind
