"""benchmarks/gpu_throughput.sh at tiny scale on CPU (a 2-layer Qwen2 shape, 3 steps, fp32): every job reports every
stage, the SFT floor trains on the same batches as train_sft (same tokens per step, the same loss at every step:
same rows, order, micro-batches, weights and optimizer), and the throughput numbers follow from the token counts
and the FLOPs formula written out here (6N + 12·L·d·s per trained token, 2N + 4·L·d·s per forward-only one)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.distributed import ROOT

ROW, STEPS, BATCH, PEAK = 64, 3, 8, 2.0
PROMPT, NEW, PROMPTS, SAMPLES = 16, 8, 4, 4


@pytest.fixture(scope="module")
def summary(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_throughput") / "summary.json"
    env = {**os.environ, "DEVICE": "cpu", "SHAPES": "tiny", "JOBS": "sft floor dpo grpo", "ROW_TOKENS": str(ROW),
           "PROMPT_TOKENS": str(PROMPT), "STEPS": str(STEPS), "TRAIN_BATCH_SIZE": str(BATCH), "NEW_TOKENS": str(NEW),
           "ROLLOUT_PROMPTS": str(PROMPTS), "SAMPLES_PER_PROMPT": str(SAMPLES), "PEAK_TFLOPS": str(PEAK),
           "INSTALL": "0", "THROUGHPUT_JSON": str(out), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(["bash", "benchmarks/gpu_throughput.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == printed
    assert "| tiny | sft | ok |" in proc.stdout  # the table
    return printed


def flops_per_token(training: bool, seq_len: int) -> float:
    """N: every parameter of the tied tiny Qwen2 (its one embedding matrix counted once, as the output projection
    that multiplies every token; the input lookup costs nothing)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=512, tie_word_embeddings=True)
    with torch.device("meta"):
        N = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    dense, attention = (6, 12) if training else (2, 4)
    return dense * N + attention * 2 * 64 * seq_len


def test_every_job_and_stage_ran(summary):
    jobs = summary["results"]["tiny"]
    assert {job: r["status"] for job, r in jobs.items() if isinstance(r, dict)} == dict.fromkeys(
        ("sft", "floor", "dpo", "grpo"), "ok")
    assert set(jobs["sft"]["stages"]) == set(jobs["dpo"]["stages"]) == {"train"}
    assert {"generation", "experience", "train"} <= set(jobs["grpo"]["stages"])
    for job in ("sft", "dpo", "grpo"):
        assert jobs[job]["steps"] == STEPS
        assert all(st["seconds"] > 0 and (st["tflops"] or 0) >= 0 for st in jobs[job]["stages"].values())
        assert jobs[job]["stages"]["train"]["tflops"] > 0
    assert jobs["grpo"]["stages"]["generation"]["tflops"] > 0 and jobs["grpo"]["generated_tokens_per_s"] > 0
    assert summary["shapes"]["tiny"]["params_N"] == (flops_per_token(True, 0)) / 6


def test_floor_trains_on_the_same_batches(summary):
    jobs = summary["results"]["tiny"]
    assert jobs["sft"]["tokens_per_step"] == jobs["floor"]["tokens_per_step"] == [BATCH * ROW] * STEPS
    assert jobs["floor"]["micro_batches_per_step"] == [BATCH * ROW // (4 * ROW)] * STEPS  # the 4-row budget
    # the same rows in the same order through the same weights and AdamW: every step's loss, not just the first
    assert jobs["floor"]["losses"] == pytest.approx(jobs["sft"]["losses"], rel=2e-5)
    assert jobs["floor"]["losses"][0] != jobs["floor"]["losses"][-1]  # the weights moved
    assert jobs["sft_over_floor"] == pytest.approx(jobs["sft"]["tokens_per_s"] / jobs["floor"]["tokens_per_s"])


def test_tflops_and_mfu_follow_from_tokens_and_the_formula(summary):
    jobs = summary["results"]["tiny"]
    train = flops_per_token(True, ROW)
    for job in ("sft", "floor"):
        assert jobs[job]["tflops"] == pytest.approx(jobs[job]["tokens_per_s"] * train / 1e12, rel=1e-6), job
    # DPO: each trained token is also a forward of the frozen reference
    dpo = jobs["dpo"]
    assert dpo["tokens_per_step"] == [2 * BATCH * ROW] * STEPS  # chosen and rejected
    forward = flops_per_token(False, ROW)
    assert dpo["tflops"] == pytest.approx(dpo["tokens_per_s"] * (train + forward) / 1e12, rel=1e-6)
    grpo = jobs["grpo"]
    assert all(PROMPTS * SAMPLES * (PROMPT + 1) <= t <= PROMPTS * SAMPLES * (PROMPT + NEW)
               for t in grpo["tokens_per_step"])
    for job in ("sft", "floor", "dpo", "grpo"):
        assert jobs[job]["mfu"] == pytest.approx(jobs[job]["tflops"] / PEAK, rel=1e-9), job
    assert summary["peak_tflops"] == PEAK
