"""The memory plan against measured peaks: a short PPO run on 2 CPU ranks of the 37.7M-parameter random Llama of
benchmarks/memory_plan.py (which measures the whole SFT/DPO/PPO x ZeRO x layout grid); each stage's planned
peak must lie within 25% of the resident set's growth that rank 0 measured (`MemoryPeaks`). On CUDA the same
check reads max_memory_allocated: tests/gpu/test_memory_plan_cuda.py, run by benchmarks/gpu_smoke.sh."""

from __future__ import annotations

import os
import sys

import pytest

from tests.distributed import ROOT, run_job_variants, run_torchrun

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import memory_plan as bench  # noqa: E402  (benchmarks/ is a directory of scripts, not a package)

TOLERANCE = 0.25


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return bench.build_inputs(str(tmp_path_factory.mktemp("memory_plan")))


def run_and_read(job: str, zero: int, layout: str, inputs, save, monkeypatch, cuda: bool = False, ranks: int = 2
                 ) -> dict:
    """Rank 0's stage -> {measured, estimated} of one run on `ranks` ranks under torchrun (with the benchmark's
    allocator setting): the CUDA test's, whose ranks must be new interpreters."""
    for key, value in bench.ENV.items():
        if key != "PYTHONPATH":
            monkeypatch.setenv(key, value)
    argv = bench.job_argv(job, zero, layout, inputs, str(save), cuda)
    proc = run_torchrun(ranks, " ".join(argv[:2]), *argv[2:])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return bench.read_peaks(str(save))["0"]


def run_forked_and_read(job: str, zero: int, layout: str, inputs, save, console_dir, ranks: int = 2) -> dict:
    """`run_and_read` on CPU ranks forked from the tests' preloaded server (no imports to pay), the allocator
    setting made by `tests/workers/memory_plan_job.py`. A peak counts from the rank's baseline, taken after the
    fork, so the server's pages are not in it."""
    module, *argv = bench.job_argv(job, zero, layout, inputs, str(save))[1:]
    threshold = bench.ENV["MALLOC_MMAP_THRESHOLD_"]
    run_job_variants(ranks, [("tests.workers.memory_plan_job", [threshold, module, *argv])], console_dir, save)
    return bench.read_peaks(str(save))["0"]


def check_within_tolerance(table: dict) -> None:
    for stage, v in table.items():
        assert v["measured"] > 0 and v["estimated"] > 0, (stage, v)
        assert abs(v["estimated"] / v["measured"] - 1) <= TOLERANCE, (stage, v)


def test_planned_peaks_within_25_percent_on_cpu(inputs, tmp_path):
    # PPO with ring attention at ZeRO-2: every stage, a frozen reference, the rollout engine and the ring split
    # (one run: CI's budget; the other jobs, stages and layouts are in benchmarks/README.md)
    table = run_forked_and_read("ppo", 2, "ring", inputs, tmp_path / "save", tmp_path / "console")
    for stage, v in table.items():
        print(f"{stage}: planned {v['estimated'] / 2**20:.0f} MiB, measured {v['measured'] / 2**20:.0f} MiB")
    assert set(table) == {"generation", "experience", "train", "weight_sync"}
    check_within_tolerance(table)

