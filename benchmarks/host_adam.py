"""AdamW's step on the host: torch's default implementation against its fused one, over one flat tensor (what a
ZeRO-1/2/3 optimizer holds per rank: one fp32 partition per parameter group), as `DeepSpeedModel` builds it
(`rlhf.engines.deepspeed_engine.fused_adam`: fused with --adam_offload).

    python benchmarks/host_adam.py [--sizes 2.1e6 14.7e6 1e8] [--threads 1 1 2] [--steps 5]

Each size runs with the matching thread count (1: as each rank of a 2-rank CPU run; the defaults are the
partitions of `rl_step.py`'s 4m and 30m models on 2 ranks, and a 100M one). Both optimizers take the same
parameters and gradients; two warm-up steps, then the mean of `--steps`. Printed per size: seconds per step of
each, their ratio, and the largest difference between the two parameters after the same steps (the fused kernel
rounds differently in the last bit).
"""

from __future__ import annotations

import argparse
import time

import torch


def seconds_per_step(numel: int, fused: bool, steps: int) -> tuple[float, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=g))
    param.grad = torch.randn(numel, generator=g) * 1e-2
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), fused=True if fused else None)
    for _ in range(2):
        optimizer.step()
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps, param.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[2.1e6, 14.7e6, 1e8])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 1, 2])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if len(args.threads) != len(args.sizes):
        parser.error(f"--threads takes one count per size ({len(args.sizes)}), got {len(args.threads)}")
    print(f"torch {torch.__version__}; AdamW over one flat fp32 tensor, {args.steps} steps after 2 of warm-up")
    print("| elements | threads | default s/step | fused s/step | default / fused | max weight difference |")
    print("| --- | --- | --- | --- | --- | --- |")
    for numel, threads in zip(args.sizes, args.threads):
        torch.set_num_threads(threads)
        default_s, default_w = seconds_per_step(int(numel), False, args.steps)
        fused_s, fused_w = seconds_per_step(int(numel), True, args.steps)
        diff = float((default_w - fused_w).abs().max())
        print(f"| {numel / 1e6:.1f}M | {threads} | {default_s:.4f} | {fused_s:.4f} | **{default_s / fused_s:.1f}x** | "
              f"{diff:.2g} |", flush=True)


if __name__ == "__main__":
    main()
