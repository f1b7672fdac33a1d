"""train_kd end to end (torchrun, 1-3 CPU ranks) with a teacher fine-tuned by train_sft (4 steps), 3 steps per
run: DP=2 == DP=1 x accumulation 2, packed == padded with the teacher offloaded between forwards, and a teacher
on its own rank gives exactly the colocated steps. (Learning is shown by the KD example, tests/examples.)"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_runs import TRAIN, assert_same_steps, run_job, run_jobs, without_timings

BASE = [*TRAIN, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
        "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.1", "--zero_stage", "2"]
COMPARED = ("gpt_loss", "distil_loss", "grad_norm", "lr", "eval_gpt_loss", "eval_distil_loss")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The teacher and the 2-rank students in one launch, then the 1-rank and the 3-rank (teacher on its own
    rank) students."""
    tmp = tmp_path_factory.mktemp("kd")
    kd = [*BASE, "--teacher_model", str(tmp / "teacher"), "--max_steps", "3", "--eval_steps", "2"]
    teacher, dp2, packed = run_jobs(2, [("train_sft", tmp / "teacher", [*BASE, "--max_steps", "4"]),
                                        ("train_kd", tmp / "dp2", kd),
                                        ("train_kd", tmp / "packed", [*kd, "--packing_samples", "--teacher_offload"])],
                                    tmp)
    return {"dp2": dp2, "packed": packed, "dp1": run_job(1, "train_kd", tmp / "dp1", *kd),
            "own": run_job(3, "train_kd", tmp / "own", *kd, "--teacher_num_gpus_per_node", "1")}


def test_kd_dp_split_and_packing_give_the_same_steps(runs):
    ref = runs["dp2"]
    assert "kd: 1024 samples" in ref[2]
    assert [r["step"] for r in ref[0]] == [0, 1, 2, 3]
    assert ref[0][-1]["eval_distil_loss"] < ref[0][0]["eval_distil_loss"]
    for name in ("dp1", "packed"):
        assert_same_steps(ref, runs[name], COMPARED, rel=1e-5, abs_=1e-6, what=name)


def test_a_teacher_on_its_own_rank_gives_the_colocated_steps(runs):
    """2 student ranks with the teacher colocated == the same 2 students with the teacher on a third rank."""
    colocated, own = runs["dp2"], runs["own"]
    assert "teacher on ranks 2-2" in own[2]
    for a, b in zip(colocated[0], own[0], strict=True):
        assert without_timings(a) == without_timings(b)
    for name, w in colocated[1].items():
        assert torch.equal(own[1][name], w), name
