"""RePULSe's figures from finished runs: reading the evaluation rows of each run's metrics.jsonl (and its
gcg.json), lining seeds up, 95% t-intervals over seeds, the per-method summary, and drawing the PNGs
(matplotlib, Agg canvas, no display). It knows the row format the trainer writes, not how the numbers were
produced; `rlhf.cli.plot_repulse` is its command line.

Row format: a row with the key `log_p_bad` is an evaluation row and holds `samples_drawn` (cumulative
responses sampled, policy and proposal together), `log_p_bad` (natural log), `reward_mean` and `return_mean`;
every other row is ignored. Held-out keys (`heldout_return_mean`, `heldout_p_below`, `heldout_cvar`) come
from the last row that has them. A JSON null (how the metrics logger writes NaN) reads as NaN.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf.config.errors import UsageError

CURVE_KEYS = ("samples_drawn", "log_p_bad", "reward_mean", "return_mean")
"""Keys every evaluation row must have."""

FINAL_KEYS = ("log_p_bad", "reward_mean", "return_mean")
"""Metrics summarised at a method's last aligned evaluation row."""

HELDOUT_KEYS = ("heldout_return_mean", "heldout_p_below", "heldout_cvar")
"""Held-out sampling results a run may log once, on its last row."""

GCG_FILE = "gcg.json"
GCG_KEY = "attack_success_rate"

T_975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
    20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
    29: 2.045, 30: 2.042,
}
"""Student t 0.975-quantile by degrees of freedom (two-sided 95%); beyond 30 the normal 1.96 is used."""


# ---------------------------------------------------------------- statistics


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: from `T_975` for df 1..30, 1.96 beyond."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return T_975.get(df, 1.96)


def mean_half_width(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval) of seed values: t_{0.975, n-1} · s / sqrt(n) with s the
    sample standard deviation (n-1). One value has half-width 0 (no interval, not a tight one); a NaN or
    infinite value makes both NaN or infinite."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_half_width needs at least one value")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0 if math.isfinite(mean) else math.nan
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile_975(n - 1) * s / math.sqrt(n)


# ---------------------------------------------------------------- loading


@dataclass(frozen=True, kw_only=True)
class RunMetrics:
    """One seed's run: its evaluation rows in file order (each list has one entry per row), the held-out
    results (None when no row has all of `HELDOUT_KEYS`) and the GCG attack success rate (None without
    gcg.json)."""

    path: str
    """The run directory."""
    curves: dict[str, list[float]]
    """`CURVE_KEYS` -> values, one per evaluation row."""
    heldout: dict[str, float] | None = None
    gcg_attack_success_rate: float | None = None

    @property
    def num_rows(self) -> int:
        return len(self.curves["log_p_bad"])


def parse_runs_item(item: str) -> tuple[str, list[str]]:
    """`LABEL=DIR1,DIR2,...` -> (label, directories); UsageError naming the item when it is malformed."""
    label, sep, dirs = item.partition("=")
    paths = [p.strip() for p in dirs.split(",")]
    if not sep or not label.strip() or not any(paths) or not all(paths):
        raise UsageError(f"--runs item {item!r} is malformed: write it as METHOD=DIR1,DIR2,... (a method label, "
                         "'=', then its seed runs' directories separated by commas, none empty)")
    if len(set(paths)) != len(paths):
        raise UsageError(f"--runs item {item!r} names a run directory twice: give each seed's run once")
    return label.strip(), paths


def _number(value: object, where: str, key: str) -> float:
    """A row value as float (null -> NaN); UsageError naming the row and key otherwise."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{where}: {key} is {value!r}, not a number; fix or remove the row")
    return float(value)


def _read_rows(metrics_path: str) -> list[tuple[int, dict]]:
    """(line number, row) for each non-empty line. A last line that does not parse (cut by a crash) is
    dropped; one elsewhere is an error."""
    with open(metrics_path, encoding="utf-8") as f:
        lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip()]
    rows = []
    for k, (i, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if k == len(lines) - 1:
                break
            raise UsageError(f"{metrics_path}:{i}: not a JSON object ({err}); fix or remove the line") from err
        if not isinstance(row, dict):
            raise UsageError(f"{metrics_path}:{i}: not a JSON object; fix or remove the line")
        rows.append((i, row))
    return rows


def _read_gcg(run_dir: str) -> float | None:
    path = os.path.join(run_dir, GCG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}: not valid JSON ({err}); rerun evaluate_gcg or remove the file") from err
    if not isinstance(data, dict) or GCG_KEY not in data:
        raise UsageError(f"{path}: no {GCG_KEY!r} key; rerun evaluate_gcg or remove the file")
    return _number(data[GCG_KEY], path, GCG_KEY)


def load_run(run_dir: str) -> RunMetrics:
    """Read one run directory: its metrics.jsonl evaluation rows, held-out results and gcg.json.
    UsageError naming the path when the directory or metrics.jsonl is missing, a row is malformed, or
    there is no evaluation row."""
    if not os.path.isdir(run_dir):
        raise UsageError(f"run directory {run_dir} does not exist: pass the --save_path of a finished run")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        raise UsageError(f"{metrics_path} not found: {run_dir} is not a run directory; pass the --save_path "
                         "the trainer wrote metrics.jsonl to")
    curves: dict[str, list[float]] = {key: [] for key in CURVE_KEYS}
    heldout = None
    for i, row in _read_rows(metrics_path):
        where = f"{metrics_path}:{i}"
        if all(key in row for key in HELDOUT_KEYS):
            heldout = {key: _number(row[key], where, key) for key in HELDOUT_KEYS}
        if "log_p_bad" not in row:
            continue
        missing = [key for key in CURVE_KEYS if key not in row]
        if missing:
            raise UsageError(f"{where}: evaluation row (it has log_p_bad) lacks {', '.join(missing)}; fix or "
                             "remove the row")
        for key in CURVE_KEYS:
            curves[key].append(_number(row[key], where, key))
    if not curves["log_p_bad"]:
        raise UsageError(f"{metrics_path} has no evaluation rows (rows with log_p_bad): train the run with "
                         "evaluation enabled (--analytic_bad_word_calc) or pass another directory")
    return RunMetrics(path=run_dir, curves=curves, heldout=heldout, gcg_attack_success_rate=_read_gcg(run_dir))


# ---------------------------------------------------------------- alignment and summary


@dataclass(frozen=True, kw_only=True)
class MethodCurves:
    """A method's seeds lined up by evaluation-row index, truncated to the shortest seed: for each key of
    `CURVE_KEYS`, the mean and 95% half-width over seeds at each aligned row."""

    label: str
    num_seeds: int
    mean: dict[str, list[float]]
    half_width: dict[str, list[float]]

    @property
    def num_rows(self) -> int:
        return len(self.mean["log_p_bad"])


def align_seeds(label: str, runs: Sequence[RunMetrics]) -> tuple[MethodCurves, list[str]]:
    """Line a method's seeds up on their evaluation rows by index and take mean and half-width over seeds.
    Seeds with different numbers of rows are cut to the shortest. Returns the curves and the warnings to
    show (truncation, seeds disagreeing on samples_drawn)."""
    num_rows = min(run.num_rows for run in runs)
    warnings = []
    if any(run.num_rows != num_rows for run in runs):
        counts = ", ".join(f"{run.path}: {run.num_rows}" for run in runs)
        warnings.append(f"method {label}: its seeds have different numbers of evaluation rows ({counts}); "
                        f"using the first {num_rows} of each")
    mean: dict[str, list[float]] = {key: [] for key in CURVE_KEYS}
    half_width: dict[str, list[float]] = {key: [] for key in CURVE_KEYS}
    for i in range(num_rows):
        for key in CURVE_KEYS:
            m, h = mean_half_width([run.curves[key][i] for run in runs])
            mean[key].append(m)
            half_width[key].append(h)
    disagree = [i for i in range(num_rows) if len({run.curves["samples_drawn"][i] for run in runs}) > 1]
    if disagree:
        warnings.append(f"method {label}: its seeds log different samples_drawn at evaluation row {disagree[0]} "
                        f"(and {len(disagree) - 1} more); the x axis uses their mean")
    return MethodCurves(label=label, num_seeds=len(runs), mean=mean, half_width=half_width), warnings


def _interval(values: Sequence[float]) -> dict[str, float | None]:
    m, h = mean_half_width(values)
    return {"mean": _finite_or_none(m), "half_width": _finite_or_none(h)}


def _finite_or_none(x: float) -> float | None:
    """NaN/inf as None, so summary.json stays strict JSON (the metrics logger writes NaN as null too)."""
    return x if math.isfinite(x) else None


def method_summary(runs: Sequence[RunMetrics], curves: MethodCurves) -> dict:
    """One method's entry of summary.json: seed count, run directories, the last aligned row's index and
    samples drawn, then {mean, half_width} over seeds of each `FINAL_KEYS` metric at that row, of each
    held-out metric when every seed has them, and of the GCG attack success rate when every seed has one."""
    last = curves.num_rows - 1
    entry: dict = {
        "num_seeds": len(runs),
        "runs": [run.path for run in runs],
        "num_eval_rows": curves.num_rows,
        "final_samples_drawn": _finite_or_none(curves.mean["samples_drawn"][last]),
    }
    for key in FINAL_KEYS:
        entry[key] = _interval([run.curves[key][last] for run in runs])
    if all(run.heldout is not None for run in runs):
        for key in HELDOUT_KEYS:
            entry[key] = _interval([run.heldout[key] for run in runs])
    if all(run.gcg_attack_success_rate is not None for run in runs):
        entry["gcg_attack_success_rate"] = _interval([run.gcg_attack_success_rate for run in runs])
    return entry


def load_methods(items: Sequence[str]) -> dict[str, list[RunMetrics]]:
    """Parse and load every `--runs` item, in the order given: label -> its seeds' runs. UsageError for a
    malformed item, a label given twice, or a run that does not load."""
    methods: dict[str, list[RunMetrics]] = {}
    for item in items:
        label, paths = parse_runs_item(item)
        if label in methods:
            raise UsageError(f"--runs: method {label!r} is given twice; list all its seeds in one item "
                             f"({label}=DIR1,DIR2,...)")
        methods[label] = [load_run(path) for path in paths]
    return methods


def has_all_heldout(methods: dict[str, list[RunMetrics]]) -> bool:
    """Whether every run of every method logged the held-out keys."""
    return all(run.heldout is not None for runs in methods.values() for run in runs)


def has_all_gcg(methods: dict[str, list[RunMetrics]]) -> bool:
    """Whether every run of every method has a gcg.json."""
    return all(run.gcg_attack_success_rate is not None for runs in methods.values() for run in runs)


# ---------------------------------------------------------------- drawing


def _save(fig, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # Agg canvas: renders to a file, needs no display
    fig.savefig(path, dpi=120)


def draw_training_curves(curves: Sequence[MethodCurves], path: str, title: str | None = None) -> None:
    """PNG with two panels against samples drawn: log P(bad) and mean reward; per method the mean over
    seeds with its 95% t-interval shaded."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    panels = fig.subplots(1, 2)
    for ax, key, ylabel in ((panels[0], "log_p_bad", "log P(bad output)"),
                            (panels[1], "reward_mean", "mean reward")):
        for method in curves:
            x = method.mean["samples_drawn"]
            y, h = method.mean[key], method.half_width[key]
            (line,) = ax.plot(x, y, marker="o", markersize=3, label=f"{method.label} (n={method.num_seeds})")
            ax.fill_between(x, [a - b for a, b in zip(y, h)], [a + b for a, b in zip(y, h)],
                            color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_xlabel("samples drawn (policy + proposal)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    panels[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    _save(fig, path)


def draw_frontier(methods: dict[str, list[RunMetrics]], summary: dict[str, dict], path: str,
                  title: str | None = None) -> None:
    """PNG of per-method final results with 95% t-interval error bars: return vs log P(bad); held-out
    return vs held-out CVaR when every run has them; GCG attack success rate when every run has gcg.json."""
    from matplotlib.figure import Figure

    panels_wanted = ["final"] + (["heldout"] if has_all_heldout(methods) else []) + \
        (["gcg"] if has_all_gcg(methods) else [])
    fig = Figure(figsize=(5.2 * len(panels_wanted), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels_wanted), squeeze=False)[0]
    for ax, panel in zip(axes, panels_wanted):
        if panel == "gcg":
            _gcg_panel(ax, summary)
            continue
        x_key, y_key = ("log_p_bad", "return_mean") if panel == "final" else ("heldout_cvar", "heldout_return_mean")
        for label, entry in summary.items():
            ax.errorbar(_nan(entry[x_key]["mean"]), _nan(entry[y_key]["mean"]), xerr=_nan(entry[x_key]["half_width"]),
                        yerr=_nan(entry[y_key]["half_width"]), fmt="o", capsize=4,
                        label=f"{label} (n={entry['num_seeds']})")
        ax.set_xlabel("final log P(bad output)" if panel == "final" else "held-out CVaR of reward")
        ax.set_ylabel("final mean return" if panel == "final" else "held-out mean return")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    _save(fig, path)


def _gcg_panel(ax, summary: dict[str, dict]) -> None:
    labels = list(summary)
    means = [_nan(summary[k]["gcg_attack_success_rate"]["mean"]) for k in labels]
    errs = [_nan(summary[k]["gcg_attack_success_rate"]["half_width"]) for k in labels]
    ax.bar(range(len(labels)), means, yerr=errs, capsize=4, color=[f"C{i}" for i in range(len(labels))])
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("GCG attack success rate")
    ax.grid(alpha=0.3, axis="y")


def _nan(x: float | None) -> float:
    return math.nan if x is None else x
