"""PNG plots of a run's main curves from the rows of its metrics.jsonl (matplotlib, Agg canvas, no display):
one figure per metric, steps on x, each run one colour (several runs overlay, the usual way to compare two
settings); noisy per-step metrics get their moving average drawn over the raw curve. Written by every training
job at its end (SAVE_PATH/plots/) and by `python -m rlhf.cli.plot RUN_DIR [RUN_DIR...]`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence

MAIN_METRICS = (
    "reward_mean", "kl", "response_length", "policy_loss", "value_loss",  # RL
    "gpt_loss", "loss", "acc", "margin", "nll_loss", "kto_loss", "prm_loss", "distil_loss",  # supervised, pairs
    "perf/tokens_per_s",
)
"""The metrics plotted when present, after the caller's own keys; every held-out metric (`eval...`) too."""

MARGINS = dict(left=0.12, right=0.97, bottom=0.12, top=0.92)
"""The axes' place in each 6.4 x 4 inch figure: room for tick labels of up to 8 characters, the axis labels and the
title. Fixed rather than `tight_layout`, which measures every tick label's text and took a third of a run's plotting
time (0.16 s a figure on one CPU core, 11 figures at the end of a typical run)."""

STAGE_TIMES = "stage_time"
"""The figure of seconds per stage (`time/<stage>`), every stage one line."""


def series(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every metrics row with a finite number under `key` (a NaN is logged as null)."""
    out = []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((int(row["step"]), float(value)))
    return out


def _points(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    points = series(rows, key)
    return [s for s, _ in points], [v for _, v in points]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the up to `window - 1` values before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plotted_metrics(runs: dict[str, Sequence[dict]], keys: Sequence[str] = (), only: bool = False) -> list[str]:
    """`keys`, then (unless `only`) `MAIN_METRICS` and the held-out metrics, in that order, each once, where some
    run has them."""
    present = {k for rows in runs.values() for row in rows for k in row}
    held_out = sorted(k for k in present if k.startswith("eval"))
    wanted = keys if only else [*keys, *MAIN_METRICS, *held_out]
    return [k for k in dict.fromkeys(wanted) if k in present]


def file_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + ".png"


def plot_runs(runs: dict[str, Sequence[dict]], out_dir: str, keys: Sequence[str] = (), only: bool = False
              ) -> list[str]:
    """Draw each metric of `plotted_metrics` for every run (label -> rows) into `out_dir`, and (unless `only`)
    the stage times; returns the files written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for key in plotted_metrics(runs, keys, only):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for i, (label, rows) in enumerate(runs.items()):
            steps, values = _points(rows, key)
            if not steps:
                continue
            colour = colours[i % len(colours)]
            window = max(1, len(values) // 20)
            if window > 1:
                ax.plot(steps, values, color=colour, alpha=0.3, linewidth=0.8)
                ax.plot(steps, moving_average(values, window), color=colour, linewidth=1.8,
                        label=f"{label} (mean of {window} steps)")
            else:
                ax.plot(steps, values, color=colour, linewidth=1.8, marker="o" if len(steps) < 20 else None,
                        markersize=3, label=label)
        _finish(ax, fig, key, key)
        written.append(_save(fig, out_dir, file_name(key)))
    stage_file = None if only else _plot_stage_times(runs, out_dir, colours)
    if stage_file:
        written.append(stage_file)
    return written


def _plot_stage_times(runs: dict[str, Sequence[dict]], out_dir: str, colours: list[str]) -> str | None:
    """Seconds per stage and step: a colour per stage, a line style per run."""
    import matplotlib.pyplot as plt

    stages = sorted({k for rows in runs.values() for row in rows for k in row if k.startswith("time/")},
                    key=lambda k: (k == "time/step", k))  # the whole step last, in black
    if not stages:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    styles = ("-", "--", ":", "-.")
    for r, (label, rows) in enumerate(runs.items()):
        for s, key in enumerate(stages):
            steps, values = _points(rows, key)
            if steps:
                window = max(1, len(values) // 20)
                name = key[5:] if len(runs) == 1 else f"{label}: {key[5:]}"
                colour = "black" if key == "time/step" else colours[s % len(colours)]
                ax.plot(steps, moving_average(values, window), color=colour,
                        linestyle=styles[r % len(styles)], linewidth=1.5, label=name)
    _finish(ax, fig, "seconds", "seconds per stage and step (moving mean)")
    return _save(fig, out_dir, STAGE_TIMES + ".png")


def _finish(ax, fig, ylabel: str, title: str) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.subplots_adjust(**MARGINS)


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.savefig(path)
    plt.close(fig)
    return path
