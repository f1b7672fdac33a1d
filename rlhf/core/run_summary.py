"""The block every training job ends with, on rank 0: what the run learned, how fast it ran, how its memory
compared with the plan, and where its outputs are. Read from the rows of metrics.jsonl (every step the run
logged, those before a resume included), so the figures are the ones a user would compute from the file.

A per-step metric is shown as the mean of the first fifth of its rows -> the mean of the last fifth (at least
one row each); a metric logged only at evaluations (held-out ones) as the first evaluation -> the last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from rlhf.utils.curves import series

STAGE_ORDER = ("generation", "experience", "train", "weight_sync")
"""The stages of a step shown first in the throughput line (others follow by name)."""


def read_rows(path: str) -> list[dict]:
    """The rows of a metrics.jsonl (a line cut by a crash is skipped)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def first_last(points: Sequence[tuple[int, float]]) -> tuple[float, float, str]:
    """(start, end, how): the means of the first and last fifth of `points` (one point each when there are
    fewer than ten), and the steps they cover."""
    n = max(1, len(points) // 5)
    head, tail = points[:n], points[-n:]
    start, end = sum(v for _, v in head) / n, sum(v for _, v in tail) / n
    if n == 1:
        return start, end, f"step {head[0][0]} -> {tail[0][0]}"
    return start, end, f"steps {head[0][0]}-{head[-1][0]} -> {tail[0][0]}-{tail[-1][0]}"


def _number(v: float) -> str:
    return f"{v:.3f}" if 0.01 <= abs(v) < 1e4 or v == 0 else f"{v:.3g}"


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s:02d} s" if minutes else f"{s} s"


def learned_lines(rows: Sequence[dict], keys: Sequence[str]) -> list[str]:
    """One line per key of `keys` (in order, each once) and per held-out metric (`eval...`) that the rows
    hold: start -> end and the steps behind them."""
    held_out = sorted({k for row in rows for k in row if k.startswith("eval")})
    names = list(dict.fromkeys([*keys, *held_out]))
    lines = []
    width = max((len(k) for k in names), default=0)
    for key in names:
        points = series(rows, key)
        if not points:
            continue
        start, end, how = first_last(points)
        lines.append(f"  {key:<{width}}  {_number(start)} -> {_number(end)}  ({how})")
    return lines


def throughput_line(rows: Sequence[dict]) -> str | None:
    """Trained tokens/s and each stage's share of the step time, over the steps after the first (its start-up
    costs are not throughput), or over the one step there was."""
    timed = [r for r in rows if isinstance(r.get("time/step"), (int, float)) and r["time/step"] > 0]
    timed = timed[1:] or timed
    if not timed:
        return None
    step_s = sum(r["time/step"] for r in timed)
    tokens = sum(r.get("perf/tokens_per_s", 0.0) * r["time/step"] for r in timed)
    stages = sorted({k[5:] for r in timed for k in r if k.startswith("time/") and k != "time/step"},
                    key=lambda s: (STAGE_ORDER.index(s) if s in STAGE_ORDER else len(STAGE_ORDER), s))
    shares = [f"{s} {100 * sum(r.get(f'time/{s}', 0.0) for r in timed) / step_s:.0f}%" for s in stages]
    line = f"  speed: {step_s / len(timed):.3g} s/step"
    if tokens:
        line += f", {tokens / step_s:,.0f} trained tokens/s"
    return line + (" (" + ", ".join(shares) + ")" if shares else "")


def memory_line(table: dict[str, dict[str, dict[str, int]]] | None) -> str | None:
    """The largest measured peak over the ranks per stage against the largest planned one (GiB)."""
    if not table:
        return None
    stages = list(dict.fromkeys(s for t in table.values() for s in t))
    cells = []
    for s in stages:
        measured = max(t.get(s, {}).get("measured", 0) for t in table.values()) / 2**30
        planned = max(t.get(s, {}).get("estimated", 0) for t in table.values()) / 2**30
        cells.append(f"{s} {measured:.2f}/{planned:.2f}" if planned else f"{s} {measured:.2f}/-")
    return "  memory peak/plan, GiB (largest rank): " + ", ".join(cells) if cells else None


def summary_block(rows: Sequence[dict], keys: Sequence[str], *, name: str, wall_s: float,
                  outputs: Sequence[tuple[str, str]], memory: dict | None = None, resumed_after: int = 0) -> list[str]:
    """The lines rank 0 prints when a job ends. `keys`: the job's main metrics (its progress bar's and its
    extras); `wall_s`: this process's time; `resumed_after`: the steps its checkpoint held (the rows hold those
    too); `outputs`: (what, path) of what the run wrote, shown where the path exists; `memory`: rank -> stage ->
    measured and estimated bytes (memory_peaks.json)."""
    last = max((int(r["step"]) for r in rows), default=0)
    resumed = f", resumed after step {resumed_after}" if resumed_after else ""
    lines = [f"{name} run summary: {last} steps, {_duration(wall_s)} in this process{resumed}"]
    lines += learned_lines(rows, keys)
    for line in (throughput_line(rows), memory_line(memory)):
        if line:
            lines.append(line)
    shown = [f"{what} {path}" for what, path in outputs if path and os.path.exists(path)]
    if shown:
        lines.append("  outputs: " + "; ".join(shown))
    return lines
