"""How long a refused command takes to answer: `python -m rlhf.cli.<job> --no_such_flag` for every training job,
against the floor of starting Python and importing torch (`python -c "import torch"`), median of --repeats runs
each, on this machine. A user's typo should cost seconds, not a model load.

    python benchmarks/refusal_latency.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

JOBS = ("train_ppo", "train_repulse", "train_sft", "train_rm", "train_prm", "train_kd", "train_dpo", "train_kto",
        "train_simpo", "train_orpo", "batch_inference")


def seconds(cmd: list[str], repeats: int, expect: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        assert proc.returncode == expect, (cmd, proc.returncode, proc.stderr[-2000:])
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    floor = seconds([sys.executable, "-c", "import torch"], args.repeats, 0)
    print(f"floor (python -c 'import torch'): {floor:.2f} s")
    for job in JOBS:
        took = seconds([sys.executable, "-m", f"rlhf.cli.{job}", "--no_such_flag"], args.repeats, 2)
        print(f"{job:<16} {took:5.2f} s  {took / floor:4.1f}x the floor")


if __name__ == "__main__":
    main()
