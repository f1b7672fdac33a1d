"""Where one training step's time goes: torch.profiler around a single step of a product job or of the SFT floor,
summarised as one JSON object (no trace file: it must travel back from a GPU machine in one small file).

    python -m torch.distributed.run --nproc_per_node 1 benchmarks/step_profile.py --step 3 --out prof.json \
        -m rlhf.cli.train_sft FLAGS...        # the product: profiles the job's step 3 (rank 0 writes)
    python benchmarks/sft_floor.py ... --profile_step 3 --profile_out floor.json   # the floor, the same summary

The summary: the step's wall time; on CUDA the device's busy time (the union of its kernels' intervals is not
available from the averages, so the sum of kernel times, an upper bound of the busy time on one stream) and its
share of the wall time; the host's reads of device values (`aten::_local_scalar_dense`: `.item()`, `float()`,
`bool()` of a tensor) and the explicit synchronizes, each a stall of the host until the device has caught up; the
kernel launches; and the top operators by the host's own time and by the device's. `gpu_throughput.sh` runs it with
`PROFILE=1` (jobs `sft_prof` and `floor_prof`).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

HOST_READS = ("aten::_local_scalar_dense",)
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def summarize(prof: torch.profiler.profile, wall_s: float, top: int = 15) -> dict:
    """The summary of a finished profile of one step that took `wall_s` seconds (module docstring)."""
    averages = prof.key_averages()
    by_name = {e.key: e for e in averages}

    def count(names: tuple[str, ...]) -> int:
        return sum(by_name[n].count for n in names if n in by_name)

    def host_ms(names: tuple[str, ...]) -> float:
        return sum(by_name[n].cpu_time_total for n in names if n in by_name) / 1e3

    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in averages
                    if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    rows = [e for e in averages if e.key not in LAUNCHES]

    def table(attr: str) -> list[dict]:
        ranked = sorted(rows, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:top]
        return [{"op": e.key, "calls": e.count, "ms": round(getattr(e, attr, 0.0) / 1e3, 3)} for e in ranked
                if getattr(e, attr, 0.0) > 0]

    return {"wall_ms": round(wall_s * 1e3, 2),
            "device_kernel_ms": round(device_us / 1e3, 2),
            "device_busy_share": round(device_us / 1e6 / wall_s, 3) if device_us else None,
            "host_reads": count(HOST_READS), "host_reads_ms": round(host_ms(HOST_READS), 2),
            "syncs": count(SYNCS), "syncs_ms": round(host_ms(SYNCS), 2),
            "kernel_launches": count(LAUNCHES),
            "top_host_self": table("self_cpu_time_total"),
            "top_device_self": table("self_device_time_total")}


@contextmanager
def profiled(out_path: str):
    """Profile the block (host, and CUDA where there is one) and write its `summarize` to `out_path`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump(summarize(prof, wall), f, indent=1)


def profile_job_step(step: int, out_path: str) -> None:
    """Make `rlhf.core.loop.Loop.fit` profile its job's step `step` (1: the first) on rank 0 (the other ranks run
    as usual)."""
    from rlhf.core.loop import Loop

    fit = Loop.fit

    def profiling_fit(self: Loop, job: Any, *args, **kwargs):
        plain: Callable[[int], dict] = job.step

        def step_once(n: int) -> dict:
            if n + 1 != step or int(os.environ.get("RANK", "0")) != 0:  # Loop.fit counts from 0
                return plain(n)
            with profiled(out_path):
                return plain(n)

        job.step = step_once
        return fit(self, job, *args, **kwargs)

    Loop.fit = profiling_fit


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "-m" not in argv:
        raise SystemExit("usage: step_profile.py --step K --out PATH -m MODULE [ARGS...]")
    split = argv.index("-m")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", type=int, required=True,
                        help="the step to profile (1: the first, as metrics.jsonl numbers them)")
    parser.add_argument("--out", required=True, help="where rank 0 writes the summary (JSON)")
    args = parser.parse_args(argv[:split])
    module, rest = argv[split + 1], argv[split + 2:]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    profile_job_step(args.step, args.out)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
