"""How steady this machine is: the same fixed work timed again and again in one process, with nothing else of
ours running, so that a benchmark's run-to-run spread can be set against the machine's own.

    python benchmarks/machine_noise.py [--repeats 20] [--threads 1]

Two kinds of work, each about 0.25-0.6 s on a 2-core CPU machine: a pure-Python loop (the interpreter: what a
rollout engine's scheduler and a trainer's bookkeeping spend) and a loop of small fp32 matrix products (what a
4M-parameter decode step spends), with `--threads` torch threads (1: as each rank of a 2-rank CPU run). Printed per
kind: min, median and max seconds, and (max - min) / median. Identical work, so any spread is the machine's
(frequency, other tenants of the host, the scheduler), not the program's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def python_loop() -> float:
    start = time.perf_counter()
    total = 0
    for i in range(3_000_000):
        total += i * i
    return time.perf_counter() - start


def matmul_loop(x: torch.Tensor, w: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(3000):
        torch.relu(x @ w)[:, :x.shape[1]].add_(x)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, w = torch.randn(16, 256), torch.randn(256, 1024)
    kinds = {"python loop": python_loop, "fp32 matmul loop": lambda: matmul_loop(x, w)}
    for fn in kinds.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):  # interleaved: a slow spell of the machine shows in both kinds
        for kind, fn in kinds.items():
            times[kind].append(fn())
    print(f"{args.repeats} repeats each, interleaved, {args.threads} torch thread(s)")
    for kind, ts in times.items():
        median = statistics.median(ts)
        print(f"{kind}: min {min(ts):.3f} s, median {median:.3f} s, max {max(ts):.3f} s, "
              f"spread (max - min) / median {(max(ts) - min(ts)) / median:.0%}")


if __name__ == "__main__":
    main()
