"""The memory plan against measured peaks on CUDA: short SFT and PPO runs (bf16, ZeRO-2, packed) of the 37.7M-parameter
random Llama of benchmarks/memory_plan.py on up to 2 GPUs; each stage's planned peak must lie within 25% of rank 0's
torch.cuda.max_memory_allocated. Prints the table as one `MEMORY_PLAN {json}` line, which benchmarks/gpu_smoke.sh
records."""

from __future__ import annotations

import json

import torch

from tests.e2e.test_memory_plan_measured import check_within_tolerance, inputs, run_and_read  # noqa: F401 (fixture)


def test_planned_peaks_within_25_percent_on_cuda(inputs, tmp_path, monkeypatch):  # noqa: F811 (the fixture)
    ranks = min(2, torch.cuda.device_count())
    tables = {job: run_and_read(job, 2, "packed", inputs, tmp_path / job, monkeypatch, True, ranks)
              for job in ("sft", "ppo")}
    print("MEMORY_PLAN " + json.dumps({
        job: {stage: {"measured_mib": round(v["measured"] / 2**20, 1), "planned_mib": round(v["estimated"] / 2**20, 1),
                      "planned/measured": round(v["estimated"] / v["measured"], 3) if v["measured"] else None}
              for stage, v in table.items()}
        for job, table in tables.items()}), flush=True)
    for table in tables.values():  # every table printed before the first failure
        assert table, "no stage measured"
        check_within_tolerance(table)
