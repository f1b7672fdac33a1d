"""Draw RePULSe's figures from finished runs, as PNG:

    python -m rlhf.cli.plot_repulse --runs "REINFORCE=DIR1,DIR2,DIR3" "RePULSe=DIR4,DIR5,DIR6" --out OUT_DIR \
        [--title TEXT]

Each --runs item is a method label and its seeds' run directories (each with the metrics.jsonl the trainer
writes, and optionally gcg.json). Writes OUT_DIR/training_curves.png (samples drawn vs log P(bad) and vs mean
reward, mean over seeds with a shaded 95% t-interval), OUT_DIR/frontier.png (final return vs final log
P(bad); held-out return vs CVaR and GCG attack success rate when every run has them) and OUT_DIR/summary.json.
One process, no GPU. The reading and statistics live in `rlhf.repulse.plots`.
"""

from __future__ import annotations

import argparse
import json
import os

from rlhf.config.errors import UsageError, usage_errors_exit
from rlhf.repulse import plots


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf.cli.plot_repulse", allow_abbrev=False,
                                     description="Plot training curves and frontiers of RePULSe runs over seeds.")
    parser.add_argument("--runs", nargs="+", action="extend", required=True, metavar="METHOD=DIR1,DIR2,...",
                        help="a method label and its seeds' run directories (the runs' --save_path); repeat "
                        "the item (or the flag) for each method")
    parser.add_argument("--out", required=True, help="directory to write the PNGs and summary.json to")
    parser.add_argument("--title", default=None, help="title over each figure")
    return parser.parse_args(argv)


def write_outputs(methods: dict[str, list[plots.RunMetrics]], out: str, title: str | None) -> None:
    """Align seeds, print notes and warnings, then write both figures and summary.json (one line each)."""
    curves, summary = [], {}
    for label, runs in methods.items():
        method_curves, warnings = plots.align_seeds(label, runs)
        for warning in warnings:
            print(f"warning: {warning}", flush=True)
        if len(runs) == 1:
            print(f"note: method {label} has one seed: its 95% interval has half-width 0 (no interval)", flush=True)
        curves.append(method_curves)
        summary[label] = plots.method_summary(runs, method_curves)
    if not plots.has_all_heldout(methods):
        print("note: not every run logged heldout_return_mean/heldout_p_below/heldout_cvar: frontier.png has no "
              "held-out panel", flush=True)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "training_curves.png")
    plots.draw_training_curves(curves, path, title)
    print(f"wrote {path}", flush=True)
    path = os.path.join(out, "frontier.png")
    plots.draw_frontier(methods, summary, path, title)
    print(f"wrote {path}", flush=True)
    path = os.path.join(out, "summary.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with usage_errors_exit():
        methods = plots.load_methods(args.runs)
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise UsageError(f"--out {args.out} is a file: give a directory")
        write_outputs(methods, args.out, args.title)


if __name__ == "__main__":
    main()
