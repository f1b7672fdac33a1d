"""AdamW's step on the host: torch's default implementation against its fused one, over one flat tensor (what a
ZeRO-1/2/3 optimizer holds per rank: one fp32 partition per parameter group), as `DeepSpeedModel` builds it
(`rlhf.engines.deepspeed_engine.fused_adam`: fused with --adam_offload).

    python benchmarks/host_adam.py [--sizes 2.1e6 14.7e6 1e8] [--threads 1 1 2] [--steps 5]

Run it with the allocator a job runs with (`LD_PRELOAD` as `rlhf.utils.preload` sets it); the header says which.

Each size runs with the matching thread count (1: as each rank of a 2-rank CPU run; the defaults are the
partitions of `rl_step.py`'s 4m and 30m models on 2 ranks, and a 100M one). Both optimizers take the same
parameters and gradients; two warm-up steps, then the mean of `--steps`. Printed per size: seconds per step of
each, their ratio, and the largest difference between the two parameters after the same steps (the fused kernel
rounds differently in the last bit). Then, per size, the check `DeepSpeedModel.step` makes of the reduced gradient
partition before every update: `torch.isfinite(t).all()` against `rlhf.engines.deepspeed_engine.all_finite` (one
summing pass; the element-wise check only when the sum is not finite), seconds per check and their ratio.
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


def seconds_per_check(numel: int, check, repeats: int) -> float:
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-2
    assert check(grad)
    start = time.perf_counter()
    for _ in range(repeats):
        check(grad)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[2.1e6, 14.7e6, 1e8])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 1, 2])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if len(args.threads) != len(args.sizes):
        parser.error(f"--threads takes one count per size ({len(args.sizes)}), got {len(args.threads)}")
    with open("/proc/self/maps") as maps:  # the allocator decides much of the default's time (benchmarks/README.md)
        allocator = "tcmalloc" if "tcmalloc" in maps.read() else "the C library's malloc"
    print(f"torch {torch.__version__}; {allocator}; AdamW over one flat fp32 tensor, {args.steps} steps after 2 of "
          "warm-up")
    print("| elements | threads | default s/step | fused s/step | default / fused | max weight difference |")
    print("| --- | --- | --- | --- | --- | --- |")
    for numel, threads in zip(args.sizes, args.threads):
        torch.set_num_threads(threads)
        default_s, default_w = seconds_per_step(int(numel), False, args.steps)
        fused_s, fused_w = seconds_per_step(int(numel), True, args.steps)
        diff = float((default_w - fused_w).abs().max())
        print(f"| {numel / 1e6:.1f}M | {threads} | {default_s:.4f} | {fused_s:.4f} | **{default_s / fused_s:.1f}x** | "
              f"{diff:.2g} |", flush=True)
    from rlhf.engines.deepspeed_engine import all_finite

    print(f"\nthe gradient partition's non-finite check before each update, mean of {4 * args.steps} checks")
    print("| elements | threads | isfinite(t).all() s | all_finite s | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for numel, threads in zip(args.sizes, args.threads):
        torch.set_num_threads(threads)
        elementwise = seconds_per_check(int(numel), lambda t: bool(torch.isfinite(t).all()), 4 * args.steps)
        summed = seconds_per_check(int(numel), all_finite, 4 * args.steps)
        print(f"| {numel / 1e6:.1f}M | {threads} | {elementwise:.5f} | {summed:.5f} | "
              f"**{elementwise / summed:.1f}x** |", flush=True)


if __name__ == "__main__":
    main()
