"""Streamed structured output (issue 23 item 12): what reading a partial answer costs per delta, as the answer grows.

A generated JSON answer (an object holding an array of records: strings with escapes, integers,
floats, nested arrays) of 1,000 to 64,000 characters is fed in deltas of ``--delta`` characters
(default 8, about a token). Per answer length, the CPU microseconds per delta (median over rounds
of the whole stream's CPU time / its deltas) of:

* **parse** — fsm_agent's :class:`~fsm_agent.types.partial_json.PartialJSON`: ``feed`` plus a
  ``snapshot`` whenever the value changed (what each ``OutputPartial`` event needs);
* **parse + check** — :class:`~fsm_agent.structured.PartialOutput` (the runtime's path): the
  above plus :func:`~fsm_agent.structured.validate_partial` of each snapshot against the schema
  (jsonschema, every member of the value so far);
* **re-parse** — the approach that parses the whole text so far at each delta, as pydantic-ai's
  ``stream_output`` does (``pydantic_core.from_json(text, allow_partial=True)``), measured the
  same way; ``ABSENT`` when pydantic_core is not installed.

``growth`` is the per-delta cost at the longest answer over the cost at the shortest: a reader
whose cost per delta does not depend on the length stays near 1; one that re-reads the text grows
with it (64 × longer answer: about 64 ×). No assertion: it prints markdown tables and writes
``bench/results/bench_partial_json-*.json``.

    .venv/bin/python bench/bench_partial_json.py            # 5 rounds, up to 64,000 characters
    .venv/bin/python bench/bench_partial_json.py --quick    # 3 rounds, up to 16,000 characters
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import orjson  # noqa: E402
from _common import machine, median, say, table, versions, write_results  # noqa: E402

from fsm_agent import OutputSchema  # noqa: E402
from fsm_agent.structured import PartialOutput  # noqa: E402
from fsm_agent.types import TextDelta  # noqa: E402
from fsm_agent.types.partial_json import PartialJSON  # noqa: E402

SCHEMA = OutputSchema("catalog", {
    "type": "object", "required": ["items"],
    "properties": {"items": {"type": "array", "items": {
        "type": "object", "required": ["id", "name", "price", "tags"], "additionalProperties": False,
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 200},
                       "price": {"type": "number", "minimum": 0}, "tags": {"type": "array", "items": {"type": "string"}},
                       "note": {"type": "string"}}}}},
})


def answer(chars: int) -> str:
    """A JSON answer of about ``chars`` characters that matches :data:`SCHEMA`."""
    items: list[dict[str, Any]] = []
    i = 0
    while True:
        items.append({"id": i, "name": f"Item {i} \u00e9l\u00e8ve \"quoted\"", "price": round(i * 1.37, 2),
                      "tags": ["red", f"size-{i % 7}"], "note": "line one\nline two \u2713"})
        text = orjson.dumps({"items": items}).decode()
        if len(text) >= chars:
            return text
        i += 1


def deltas(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def run_parse(pieces: list[str]) -> None:
    p = PartialJSON()
    for piece in pieces:
        if p.feed(piece):
            p.snapshot()


def run_parse_check(pieces: list[str]) -> None:
    reader = PartialOutput(SCHEMA, "bench", 1)
    for piece in pieces:
        reader.feed(TextDelta(0, piece))


def reparse_runner() -> Callable[[list[str]], None] | None:
    try:
        from pydantic_core import from_json
    except ImportError:
        return None

    def run(pieces: list[str]) -> None:
        text = ""
        for piece in pieces:
            text += piece
            from_json(text, allow_partial=True)
    return run


def cpu_per_delta(fn: Callable[[list[str]], None], pieces: list[str]) -> float:
    gc.collect()
    t0 = time.process_time()
    fn(pieces)
    return (time.process_time() - t0) / len(pieces) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds, answers up to 16,000 characters")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--delta", type=int, default=8, help="characters per delta (default 8)")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    lengths = [1_000, 4_000, 16_000] if args.quick else [1_000, 4_000, 16_000, 64_000]
    runners: dict[str, Callable[[list[str]], None] | None] = {
        "parse": run_parse, "parse + check": run_parse_check, "re-parse (pydantic_core)": reparse_runner()}
    texts = {n: answer(n) for n in lengths}
    for text in texts.values():  # the reader gets back what was written
        p = PartialJSON()
        for piece in deltas(text, args.delta):
            p.feed(piece)
        assert p.done and p.snapshot() == orjson.loads(text)
    samples: dict[str, dict[int, list[float]]] = {k: {n: [] for n in lengths} for k in runners}
    for r in range(rounds):
        for n in lengths:
            pieces = deltas(texts[n], args.delta)
            names = list(runners)
            for name in names[r % len(names):] + names[:r % len(names)]:  # alternate who goes first
                fn = runners[name]
                if fn is not None:
                    samples[name][n].append(cpu_per_delta(fn, pieces))
    rows = []
    results: dict[str, Any] = {}
    for name, fn in runners.items():
        if fn is None:
            rows.append([name, *(["ABSENT"] * len(lengths)), "ABSENT"])
            continue
        per = {n: median(samples[name][n]) for n in lengths}
        growth = per[lengths[-1]] / per[lengths[0]] if per[lengths[0]] else float("nan")
        rows.append([name, *(f"{per[n]:.1f}" for n in lengths), f"{growth:.1f} ×"])
        results[name] = {"us_per_delta": per, "growth": growth, "rounds": samples[name]}
    say(table(["reader", *(f"{n:,} chars (µs/delta)" for n in lengths), f"growth ({lengths[-1] // lengths[0]} × longer)"],
              rows, title=f"CPU per delta of {args.delta} characters, median of {rounds} rounds"))
    path = write_results("bench_partial_json", {
        "delta_chars": args.delta, "lengths": lengths, "deltas": {n: len(deltas(texts[n], args.delta)) for n in lengths},
        "results": results, "machine": machine(), "versions": versions(["fsm-agent", "jsonschema", "pydantic-core", "orjson"]),
    })
    say(f"\nwritten {path}")


if __name__ == "__main__":
    main()
