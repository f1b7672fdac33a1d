"""train_sft end to end on the embedded copy-task demonstrations (torchrun, 1-2 CPU ranks): learning on
held-out data, DP=2 == DP=1 x accumulation 2, packed == padded, resume == straight run bit for bit, and the
bad-input errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import run_torchrun
from tests.tiny_runs import CPU

SFT = [*CPU, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
       "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.1", "--max_steps", "32", "--zero_stage", "2"]


def train(nproc, out, *extra):
    proc = run_torchrun(nproc, "-m rlhf.cli.train_sft", *SFT, "--save_path", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], load_file(out / "model.safetensors"), proc.stdout


def _assert_same_run(a, b, rel):
    (rows_a, weights_a, _), (rows_b, weights_b, _) = a, b
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        for key in ("gpt_loss", "grad_norm", "lr", "eval_gpt_loss"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=rel), (ra["step"], key)
    for name, w in weights_a.items():
        torch.testing.assert_close(weights_b[name], w, rtol=rel, atol=rel, msg=name)


def test_sft_learns_and_splits_and_layouts_agree(tmp_path):
    """One 2-rank run is the reference: its held-out NLL must fall well below the initial model's; 1 rank
    with twice the micro-batches and a packed 2-rank run must give the same losses and weights."""
    ref = train(2, tmp_path / "dp2", "--eval_steps", "16")
    rows = ref[0]
    assert [r["step"] for r in rows] == [0, *range(1, 33)]
    initial, final = rows[0]["eval_gpt_loss"], rows[-1]["eval_gpt_loss"]
    assert final < 0.5 * initial, (initial, final)
    assert rows[-1]["gpt_loss"] < rows[1]["gpt_loss"]
    assert "sft: 1024 samples, 1 epoch(s) of 64 steps of 16 samples (32 steps); 2 data-parallel replica(s)" in ref[2]
    _assert_same_run(ref, train(1, tmp_path / "dp1", "--eval_steps", "16"), rel=1e-4)
    _assert_same_run(ref, train(2, tmp_path / "packed", "--eval_steps", "16", "--packing_samples"), rel=1e-4)


def test_sft_resume_equals_straight_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    straight = train(2, tmp_path / "straight", "--save_steps", "16", "--ckpt_path", str(ckpt))
    shutil.rmtree(ckpt / "global_step32")  # resume from the middle
    resumed = train(2, tmp_path / "resumed", "--load_checkpoint", "--ckpt_path", str(ckpt))
    assert f"resumed from {ckpt}/global_step16 after 16 steps" in resumed[2]
    assert [r["step"] for r in resumed[0]] == list(range(17, 33))
    by_step = {r["step"]: r for r in straight[0]}
    assert "eval_gpt_loss" in by_step[32]  # the demo's held-out set, once per epoch and at the end
    for b in resumed[0]:
        a = by_step[b["step"]]
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
            {k: v for k, v in b.items() if not k.startswith("time/")}
    for name, w in straight[1].items():
        assert torch.equal(resumed[1][name], w), name


@pytest.mark.parametrize("module", ["train_sft", "train_rm"])
def test_zero3_gradient_checkpointing_and_ring_attention_match_zero2(module, tmp_path):
    """The same 4 steps at ZeRO-2 (padded), ZeRO-3 with gradient checkpointing, and ring attention over the 2
    ranks (one data-parallel replica: twice the micro-batches per rank, so the global batch is the same)."""
    def run(out, *extra):
        args = [*SFT, "--max_steps", "4", "--eval_steps", "2", "--save_path", str(out), *extra]
        proc = run_torchrun(2, f"-m rlhf.cli.{module}", *args)
        assert proc.returncode == 0, proc.stderr[-6000:]
        with open(out / "metrics.jsonl") as f:
            return [json.loads(line) for line in f], load_file(out / "model.safetensors"), proc.stdout

    ref = run(tmp_path / "zero2")
    for other in (run(tmp_path / "zero3", "--zero_stage", "3", "--gradient_checkpointing"),
                  run(tmp_path / "ring", "--packing_samples", "--ring_attn_size", "2",
                      "--micro_train_batch_size", "16")):
        keys = ("gpt_loss", "eval_gpt_loss", "loss", "acc", "eval_acc", "eval_loss", "grad_norm", "lr")
        for a, b in zip(ref[0], other[0]):
            assert a["step"] == b["step"]
            for key in keys:
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (module, a["step"], key)
        for name, w in ref[1].items():
            torch.testing.assert_close(other[1][name], w, rtol=1e-4, atol=1e-5, msg=name)
