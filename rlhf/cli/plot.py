"""Draw the main curves of one or more finished runs, as PNG (one figure per metric, every run one colour):

    python -m rlhf.cli.plot RUN_DIR [RUN_DIR...] [--out DIR] [--metrics KEY...] [--labels NAME...]

Each RUN_DIR is a run's --save_path (its metrics.jsonl). One run: the figures go to RUN_DIR/plots (what the run
itself wrote at its end, drawn again); several: to --out (default ./plots_compare), overlaid, each labelled by
its directory name or --labels. One process, no GPU; the drawing lives in `rlhf.utils.curves`.
"""

from __future__ import annotations

import argparse
import os

from rlhf.config.errors import UsageError, usage_errors_exit
from rlhf.core.run_summary import read_rows
from rlhf.utils.curves import MAIN_METRICS, plot_runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf.cli.plot", allow_abbrev=False,
                                     description="Plot the main curves of runs from their metrics.jsonl.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's --save_path (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="directory for the PNGs (default: RUN_DIR/plots for one "
                        "run, ./plots_compare for several)")
    parser.add_argument("--metrics", nargs="+", default=(), metavar="KEY",
                        help="the metrics to draw, and only those (default: those of " + ", ".join(MAIN_METRICS) +
                        ", every held-out eval* metric and the seconds per stage, where the runs have them)")
    parser.add_argument("--labels", nargs="+", default=None, metavar="NAME",
                        help="a legend name per RUN_DIR, in order (default: the directory names)")
    return parser.parse_args(argv)


def load_runs(dirs: list[str], labels: list[str] | None) -> dict[str, list[dict]]:
    """label -> metrics rows of each run directory."""
    if labels is not None and len(labels) != len(dirs):
        raise UsageError(f"--labels gives {len(labels)} names for {len(dirs)} run directories: give one per run")
    runs: dict[str, list[dict]] = {}
    for i, directory in enumerate(dirs):
        path = os.path.join(directory, "metrics.jsonl")
        if not os.path.isfile(path):
            raise UsageError(f"{directory}: no metrics.jsonl there; give a run's --save_path")
        rows = read_rows(path)
        if not rows:
            raise UsageError(f"{path} holds no rows (did the run log a step?)")
        label = labels[i] if labels else os.path.basename(os.path.abspath(directory))
        if label in runs:
            label = f"{label} ({directory})"
        runs[label] = rows
    return runs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with usage_errors_exit():
        runs = load_runs(args.runs, args.labels)
        out = args.out or (os.path.join(args.runs[0], "plots") if len(args.runs) == 1 else "plots_compare")
        if os.path.exists(out) and not os.path.isdir(out):
            raise UsageError(f"--out {out} is a file: give a directory")
        missing = [k for k in args.metrics if not any(k in row for rows in runs.values() for row in rows)]
        if missing:
            raise UsageError(f"--metrics {' '.join(missing)}: no run logged it")
        for path in plot_runs(runs, out, args.metrics, only=bool(args.metrics)):
            print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
