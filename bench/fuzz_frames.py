"""Hostile-input fuzzing of the three protocol parsers: type-mutated frames from every corpus body.

Each case takes one frame of the recorded corpus (``tests/corpus.py``): the JSON object of one
``data:`` event of a recorded stream, or one whole non-stream body (error bodies included), and
applies one mutation at a random path (``tests/providers/hostile.py`` ``mutate``): the value
replaced by one of another JSON type (numbers, strings, lists, objects, null, containers nested
300-1000 deep), a key deleted, an object nulled out. A stream frame is fed back in its stream
(the events before it, the mutated event, the events after it, ``finish()``) through the
protocol's stream parser; a body goes through ``HttpProvider.decode_body`` and, for an error
body, through ``classify_error`` too. A normal result must also serialize (``unstructure`` +
``orjson.dumps``), as a session store and ``fsm-agent decode`` do.

Counted per protocol: frames, normal results, typed errors (a ``ProviderError``; by class), of
them those made by the last-line guard (``fsm_agent.providers.wire.guard``: a stray exception the
protocol's shapes did not prevent, a gap to close), untyped exceptions (anything else: must be 0)
and hangs (a case past ``--timeout`` seconds, SIGALRM: must be 0). Untyped and guarded cases are
listed with the mutation that caused them. Exit code 1 when any case was untyped or hung.

    .venv/bin/python bench/fuzz_frames.py                  # 100,000 frames, seed 0
    .venv/bin/python bench/fuzz_frames.py --frames 5000 --seed 7
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # corpus.py, providers/hostile.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tree this script sits in

from providers.hostile import (  # noqa: E402
    PROTOCOLS,
    Hang,
    corpus_frames,
    dumps,
    mutate,
    run_body,
    run_stream,
    time_limit,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--tail", type=int, default=None,
                    help="feed only this many events after the mutated one (default: the whole stream)")
    ap.add_argument("--json", metavar="FILE", help="also write the counts as JSON")
    args = ap.parse_args()

    frames = corpus_frames()
    cases = [("stream", s, pos) for s in frames.streams for pos in s.frames]
    cases += [("body", b, None) for b in frames.bodies]
    rng = random.Random(args.seed)
    counts = {p: collections.Counter() for p in PROTOCOLS}
    typed = {p: collections.Counter() for p in PROTOCOLS}
    untyped: list[str] = []
    guarded: list[str] = []
    hangs: list[str] = []
    t0 = time.perf_counter()
    for n in range(args.frames):
        kind, src, pos = rng.choice(cases)
        proto = src.protocol
        if kind == "stream":
            obj = json.loads(src.events[pos].data)
        else:
            obj = src.obj
        mutated, what = mutate(obj, rng)
        data = dumps(mutated)
        try:
            with time_limit(args.timeout):
                results = [run_stream(src, pos, data, args.tail)] if kind == "stream" else run_body(src, data)
        except Hang:
            hangs.append(f"{proto} {src.id} #{pos}: {what}")
            counts[proto]["hangs"] += 1
            counts[proto]["frames"] += 1
            continue
        counts[proto]["frames"] += 1
        counts[proto][f"{kind} frames"] += 1
        for r in results:
            if r == "ok":
                counts[proto]["normal results"] += 1
            elif r.startswith("GUARD"):  # typed, but only by the last-line guard: a gap in the shapes
                counts[proto]["typed errors"] += 1
                counts[proto]["typed by the guard"] += 1
                typed[proto]["ProviderProtocolError"] += 1
                guarded.append(f"{proto} {src.id} #{pos}: {what}: {r}")
            elif r.startswith("UNTYPED"):
                counts[proto]["untyped exceptions"] += 1
                untyped.append(f"{proto} {src.id} #{pos}: {what}: {r}")
            else:
                counts[proto]["typed errors"] += 1
                typed[proto][r] += 1
        if (n + 1) % 10_000 == 0:
            print(f"... {n + 1} frames, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    elapsed = time.perf_counter() - t0

    cols = ["frames", "stream frames", "body frames", "normal results", "typed errors", "typed by the guard",
            "untyped exceptions", "hangs"]
    print(f"fuzz_frames: {args.frames} frames, seed {args.seed}, {elapsed:.0f} s, "
          f"corpus: {len(frames.streams)} streams, {len(frames.bodies)} JSON bodies")
    print("| protocol | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    total = collections.Counter()
    for p in PROTOCOLS:
        total.update(counts[p])
        print(f"| {p} | " + " | ".join(str(counts[p][c]) for c in cols) + " |")
    print("| all | " + " | ".join(str(total[c]) for c in cols) + " |")
    for p in PROTOCOLS:
        print(f"typed errors, {p}: " + ", ".join(f"{k} {v}" for k, v in typed[p].most_common()))
    for line in guarded[:30]:
        print("GUARD", line)
    for line in untyped[:50]:
        print("UNTYPED", line)
    for line in hangs[:20]:
        print("HANG", line)
    if args.json:
        Path(args.json).write_text(json.dumps({"frames": args.frames, "seed": args.seed, "seconds": elapsed,
                                               "counts": counts, "typed": typed, "untyped": untyped, "guarded": guarded,
                                               "hangs": hangs}, indent=2, default=dict))
    return 1 if untyped or hangs else 0


if __name__ == "__main__":
    sys.exit(main())
