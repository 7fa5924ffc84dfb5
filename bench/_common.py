"""Shared helpers of the bench/ scripts: statistics, tables, result files, machine facts."""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"

PACKAGES = ("fsm-agent", "aiohttp", "orjson", "attrs", "cattrs", "transitions", "openai", "anthropic", "httpx",
            "httpx2", "pydantic", "langchain", "langchain-core", "langchain-openai", "langgraph",
            "langgraph-checkpoint", "langgraph-checkpoint-sqlite", "langgraph-checkpoint-postgres",
            "pydantic-ai-slim", "psycopg", "asyncpg")


def versions(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def source() -> dict[str, Any]:
    """Which fsm_agent code was measured: the tree this bench/ sits in (its git HEAD and changed files),
    or, for a copy without .git, the ``.source`` note written next to it when it was copied."""
    import subprocess

    note = REPO / ".source"
    if (REPO / ".git").exists():
        try:
            head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--short"], capture_output=True, text=True).stdout
            return {"tree": str(REPO), "commit": head,
                    "changed": [ln for ln in dirty.splitlines() if not ln.endswith(" bench/")]}
        except OSError:
            pass
    if note.exists():
        lines = note.read_text().splitlines()
        return {"tree": str(REPO), "commit": lines[0].split()[-1] if lines else None, "changed": lines[1:]}
    return {"tree": str(REPO), "commit": None, "changed": []}


def machine() -> dict[str, Any]:
    """Facts that decide how far to trust the numbers."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in load],
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source(),
    }


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), nearest-rank on sorted data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))
    return s[k]


def spread(xs: Sequence[float]) -> float:
    """Half the interquartile range relative to the median (a rough ± for a median of noisy rounds)."""
    if len(xs) < 3:
        return float("nan")
    q = statistics.quantiles(xs, n=4)
    m = statistics.median(xs)
    return (q[2] - q[0]) / 2 / m if m else float("nan")


def rotate(items: Sequence[Any], r: int) -> list[Any]:
    """Round ``r``'s order: a rotation, so every item is measured first, middle and last in turn."""
    if not items:
        return []
    r %= len(items)
    return list(items[r:]) + list(items[:r])


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if x != x:
            return "—"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.{digits - 1}f}" if abs(x) >= 1 else f"{x:.{digits}f}"
    return str(x)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> str:
    """A GitHub-flavoured markdown table (readable in a terminal too)."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines.append(f"\n### {title}\n")
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        lines.append("| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |")
    return "\n".join(lines)


def write_results(name: str, data: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>-<UTC time>.json`` and ``<name>-latest.json``; returns the first."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    blob = orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    path = RESULTS / f"{name}-{stamp}.json"
    path.write_bytes(blob)
    (RESULTS / f"{name}-latest.json").write_bytes(blob)
    return path


class CpuTimer:
    """Wall and CPU (this process) seconds of a block, after a full collection so that one
    runtime's garbage is not collected on the next one's clock."""

    def __enter__(self) -> CpuTimer:
        gc.collect()
        self.cpu0 = time.process_time()
        self.wall0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def say(*parts: Any) -> None:
    print(*parts, flush=True)
