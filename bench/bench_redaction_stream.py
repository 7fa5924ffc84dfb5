"""Redaction across streaming deltas (issue 23 item 4): what holding text back costs, on recorded streams.

Every streamed SSE body of the recorded corpus (``tests/corpus.py`` ``bodies()``: status 200,
streaming, SSE) is decoded by fsm_agent's own protocol decoder into its stream events, as the
runtime would get them; the events then go through the ``redaction`` plugin's ``on_model_event``
(the filter observers, the server's live deltas and the command line's printer see), one event at
a time, with four configurations: the built-in rules, the built-in rules but the e-mail one (it
holds every trailing word: it could be followed by ``@``), two literal secrets only, and the
built-in rules with them.

Reported per configuration, over every text / thinking / tool-argument character of the corpus:

* **held** — characters held back right after each delta arrived (median, p95, p99, max over
  deltas) and the share of deltas that were released whole;
* **wait** — for each character, how many deltas later it was released (0: with its own delta;
  a character held to the end of its block counts the deltas until that end); median, p95, p99,
  max, and the share of characters released at once. In milliseconds, a wait is that many
  inter-delta gaps: the table gives them at 20 ms a delta (a 50 tokens/s model) — multiply for
  another rate;
* **CPU** — microseconds of ``on_model_event`` per delta (median over rounds of the total CPU
  time / deltas), against the per-delta masking it replaced (``mask_text`` of each delta alone,
  which never held anything and missed values split over deltas);
* **exact** — the number of blocks whose released deltas do not add up to the block masked whole
  (must be 0).

    .venv/bin/python bench/bench_redaction_stream.py            # 7 rounds
    .venv/bin/python bench/bench_redaction_stream.py --quick    # 3 rounds
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # tests/corpus.py

from _common import machine, median, pct, say, table, versions, write_results  # noqa: E402

from fsm_agent import Agent, ScriptedProvider  # noqa: E402
from fsm_agent.errors import ProviderError  # noqa: E402
from fsm_agent.providers.decode import decoder_for, looks_like_sse  # noqa: E402
from fsm_agent.types import (ContentBlockEnd, ErrorEvent, MessageComplete, RefusalDelta, StreamEvent,  # noqa: E402
                             TextDelta, ThinkingDelta, ToolCallArgumentsDelta, ToolCallEnd)
from fsm_agent_middleware.redaction import Redaction, StreamMasker  # noqa: E402

SECRETS = ["sk-live-ABCDEF123456", "hunter2-correct-horse"]
CONFIGS: dict[str, dict[str, Any]] = {
    "built-in rules": {},
    "built-in without email": {"kinds": ["private_key", "anthropic_key", "openai_key", "aws_access_key", "github_token",
                                         "bearer_token", "iban", "credit_card", "phone"]},
    "2 literals only": {"kinds": [], "literals": SECRETS},
    "built-in + 2 literals": {"literals": SECRETS},
}
MS_PER_DELTA = 20.0
"""The inter-delta gap the ms columns assume (a 50 tokens/s model, one token a delta)."""


def _text(ev: Any) -> str | None:
    if isinstance(ev, (TextDelta, ThinkingDelta, RefusalDelta)):
        return ev.text
    if isinstance(ev, ToolCallArgumentsDelta):
        return ev.arguments
    return None


def _key(ev: Any) -> tuple[str, int]:
    return (ev.TAG, -1 if isinstance(ev, RefusalDelta) else ev.index)


def streams() -> list[tuple[str, list[StreamEvent]]]:
    import corpus

    out = []
    for b in corpus.bodies():
        if not (b.streaming and b.status == 200 and looks_like_sse(b.data)):
            continue
        try:
            events = decoder_for(b.protocol).decode_stream_bytes(b.data)
        except (ProviderError, ValueError, KeyError):
            continue  # an error stream: nothing to release
        if any(_text(e) for e in events):
            out.append((b.path, events))
    return out


def measure(config: dict[str, Any], corpus_streams: list[tuple[str, list[StreamEvent]]]) -> dict[str, Any]:
    """One pass of every stream: through a fresh Redaction's ``on_model_event`` (CPU time, and the
    exactness check: a block's released deltas against the block masked whole), and through the
    same rules' :class:`StreamMasker` with placeholders as long as what they replace, so that the
    characters out count the input characters released (hold-back and wait of each character)."""
    held: list[int] = []
    waits: list[int] = []
    inexact = blocks = deltas = 0
    cpu = 0.0
    for _, events in corpus_streams:
        mw = Redaction(**config)
        ctx = Agent(ScriptedProvider([]), middleware=[mw]).new_context([])
        shadow: dict[tuple[str, int], tuple[StreamMasker, list[int]]] = {}  # per block: masker, arrival of each held char
        released: dict[tuple[str, int], list[str]] = {}
        original: dict[tuple[str, int], list[str]] = {}
        n = 0

        def flush(keys: list[tuple[str, int]]) -> None:
            for key in keys:
                _, pending = shadow.pop(key)
                waits.extend(n - c for c in pending)

        for ev in events:
            text = _text(ev)
            t0 = time.process_time()
            out = mw.on_model_event(ev, ctx)
            cpu += time.process_time() - t0
            for o in out if isinstance(out, tuple) else () if out is None else (out,):
                if (t := _text(o)) is not None:
                    released.setdefault(_key(o), []).append(t)
            if text is not None:
                n += 1
                deltas += 1
                key = _key(ev)
                original.setdefault(key, []).append(text)
                masker, pending = shadow.setdefault(key, (StreamMasker(mw.rules, _same_length), []))
                pending.extend([n] * len(text))
                got = len(masker.feed(text))
                waits.extend(n - c for c in pending[:got])
                del pending[:got]
                held.append(len(pending))
            elif isinstance(ev, (ContentBlockEnd, ToolCallEnd)):
                flush([k for k in shadow if k[1] == ev.index])
            elif isinstance(ev, (MessageComplete, ErrorEvent)):
                flush(list(shadow))
        for key, parts in original.items():
            blocks += 1
            if "".join(released.get(key, [])) != mw.mask_text("".join(parts), ctx):
                inexact += 1
    return {"held": held, "waits": waits, "cpu_s": cpu, "deltas": deltas, "blocks": blocks, "inexact": inexact}


def _same_length(kind: str, value: str) -> str:
    return "#" * len(value)


def baseline_cpu(corpus_streams: list[tuple[str, list[StreamEvent]]], config: dict[str, Any]) -> tuple[float, int]:
    """The masking this replaced: each delta masked alone (``mask_text``), nothing held."""
    cpu, n = 0.0, 0
    for _, events in corpus_streams:
        mw = Redaction(**config)
        ctx = Agent(ScriptedProvider([]), middleware=[mw]).new_context([])
        for ev in events:
            text = _text(ev)
            if text is None:
                continue
            t0 = time.process_time()
            mw.mask_text(text, ctx)
            cpu += time.process_time() - t0
            n += 1
    return cpu, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    corpus_streams = streams()
    chars = sum(len(_text(e) or "") for _, evs in corpus_streams for e in evs)
    say(f"bench_redaction_stream: {len(corpus_streams)} recorded streams with text, "
        f"{sum(1 for _, evs in corpus_streams for e in evs if _text(e) is not None):,} deltas, {chars:,} characters; "
        f"{rounds} rounds")
    results: dict[str, Any] = {}
    rows_hold, rows_wait, rows_cpu = [], [], []
    for name, config in CONFIGS.items():
        cpu_rounds, base_rounds = [], []
        last: dict[str, Any] = {}
        for _ in range(rounds):
            last = measure(config, corpus_streams)
            cpu_rounds.append(last["cpu_s"] / last["deltas"] * 1e6)
            b, n = baseline_cpu(corpus_streams, config)
            base_rounds.append(b / n * 1e6)
        held, waits = last["held"], last["waits"]
        results[name] = {"config": {k: (len(v) if k == "literals" else v) for k, v in config.items()},
                         "deltas": last["deltas"], "blocks": last["blocks"], "inexact_blocks": last["inexact"],
                         "held_chars": {"median": median(held), "p95": pct(held, 95), "p99": pct(held, 99),
                                        "max": max(held), "released_whole": sum(h == 0 for h in held) / len(held)},
                         "wait_deltas": {"median": median(waits), "p95": pct(waits, 95), "p99": pct(waits, 99),
                                         "max": max(waits), "at_once": sum(w == 0 for w in waits) / len(waits)},
                         "cpu_us_per_delta": cpu_rounds, "baseline_cpu_us_per_delta": base_rounds}
        rows_hold.append([name, median(held), pct(held, 95), pct(held, 99), max(held),
                          f"{100 * sum(h == 0 for h in held) / len(held):.1f} %", last["inexact"]])
        rows_wait.append([name, f"{100 * sum(w == 0 for w in waits) / len(waits):.1f} %", median(waits),
                          pct(waits, 95), pct(waits, 99), max(waits),
                          pct(waits, 95) * MS_PER_DELTA, pct(waits, 99) * MS_PER_DELTA])
        rows_cpu.append([name, median(cpu_rounds), median(base_rounds), median(cpu_rounds) / median(base_rounds)])
    say(table(["rules", "held median", "p95", "p99", "max", "deltas released whole", "inexact blocks"], rows_hold,
              "Characters held back after each delta"))
    say(table(["rules", "chars at once", "wait median", "p95", "p99", "max", "p95 ms @20ms", "p99 ms @20ms"],
              rows_wait, "Wait of each character, in deltas (and ms at 20 ms a delta)"))
    say(table(["rules", "µs/delta streaming", "µs/delta per-delta mask (before)", "ratio"], rows_cpu,
              "CPU of on_model_event per delta (median over rounds)"))
    path = write_results("bench_redaction_stream", {"machine": machine(), "versions": versions(),
                                                    "rounds": rounds, "streams": len(corpus_streams),
                                                    "ms_per_delta_assumed": MS_PER_DELTA, "results": results})
    say(f"\nwrote {path}")


if __name__ == "__main__":
    main()
