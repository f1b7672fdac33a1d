"""benchmarks/gpu_throughput.sh at tiny scale on CPU (a 2-layer Qwen2 shape, 3 steps, fp32): every job reports every
stage, the SFT floor trains on the same batches as train_sft (same tokens per step, the same loss at every step:
same rows, order, micro-batches, weights and optimizer), and the throughput numbers follow from the token counts
and the FLOPs formula written out here (6N + 12·L·d·s per trained token, 2N + 4·L·d·s per forward-only one)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
import torch

from tests.distributed import ROOT, assert_clean_exit

ROW, STEPS, BATCH, PEAK = 64, 3, 8, 2.0
PROMPT, NEW, PROMPTS, SAMPLES = 16, 8, 4, 4


@pytest.fixture(scope="module")
def summary(tmp_path_factory, launch_server) -> dict:
    """The benchmark's jobs fork their rank from the preloaded launch server (`launch_server`)."""
    out = tmp_path_factory.mktemp("gpu_throughput") / "summary.json"
    env = {**os.environ, "DEVICE": "cpu", "SHAPES": "tiny", "JOBS": "sft floor dpo grpo", "ROW_TOKENS": str(ROW),
           "PROMPT_TOKENS": str(PROMPT), "STEPS": str(STEPS), "TRAIN_BATCH_SIZE": str(BATCH), "NEW_TOKENS": str(NEW),
           "ROLLOUT_PROMPTS": str(PROMPTS), "SAMPLES_PER_PROMPT": str(SAMPLES), "PEAK_TFLOPS": str(PEAK),
           "INSTALL": "0", "THROUGHPUT_JSON": str(out), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(["bash", "benchmarks/gpu_throughput.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_clean_exit(proc)
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == printed
    assert "| tiny | sft | ok |" in proc.stdout  # the table
    return printed


def benchmark(name: str):
    """A module of benchmarks/ (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flops_per_token(training: bool, seq_len: int) -> float:
    """N: every parameter of the tied tiny Qwen2 (its one embedding matrix counted once, as the output projection
    that multiplies every token; the input lookup costs nothing)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**benchmark("gpu_throughput_inputs").SHAPES["tiny"])
    assert config.tie_word_embeddings
    with torch.device("meta"):
        N = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    dense, attention = (6, 12) if training else (2, 4)
    return dense * N + attention * config.num_hidden_layers * config.hidden_size * seq_len


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


def test_chunked_linear_cross_entropy_matches_autograd():
    LinearCrossEntropy = benchmark("sft_floor").LinearCrossEntropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    W = torch.randn(50, 16, generator=g, requires_grad=True)
    targets, weights = torch.randint(0, 50, (37,), generator=g), (torch.rand(37, generator=g) > 0.3).float()
    ours = LinearCrossEntropy.apply(h, W, targets, weights, 8) * 0.7  # five chunks, the last one short
    ours.backward()
    grads = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    ref = (torch.nn.functional.cross_entropy(h @ W.T, targets, reduction="none") * weights).sum() * 0.7
    ref.backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grads, (h.grad, W.grad))


def test_floor_bf16_master_weights_follow_fp32(tmp_path, capsys):
    """The CUDA configuration's optimizer path (bf16 parameters, fp32 masters) on CPU, several loss chunks: the same
    first loss as fp32 up to bf16 rounding, and the same descent."""
    inputs, floor = benchmark("gpu_throughput_inputs"), benchmark("sft_floor")
    inputs.build_model_dir(str(tmp_path / "model"), "tiny", "cpu", torch.float32)
    data = inputs.write_rows(str(tmp_path), ROW, PROMPT, 3 * BATCH)
    losses = {}
    for dtype in ("fp32", "bf16"):
        floor.main(["--model", str(tmp_path / "model"), "--dataset", data["sft"], "--train_batch_size", str(BATCH),
              "--max_tokens_per_micro_batch", str(2 * ROW), "--steps", "3", "--learning_rate", "3e-3", "--dtype", dtype,
              "--device", "cpu", "--ce_chunk", "50", "--peak_tflops", "1"])
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["micro_batches_per_step"] == [BATCH // 2] * 3 and out["dtype"] == dtype
        losses[dtype] = out["losses"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=0.01)
    assert losses["fp32"][2] < losses["fp32"][0] - 0.3 and losses["bf16"][2] < losses["bf16"][0] - 0.3
