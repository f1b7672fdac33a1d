"""train_kd end to end (torchrun, 1-3 CPU ranks) with a teacher trained by train_sft: the student learns
from it, DP=2 == DP=1 x accumulation 2, packed == padded (with the teacher offloaded between forwards), a
teacher on its own rank gives exactly the colocated steps, and a teacher with another vocabulary is refused
before any engine starts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import run_torchrun
from tests.tiny_runs import CPU

BASE = [*CPU, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
        "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.1", "--zero_stage", "2"]
COMPARED = ("gpt_loss", "distil_loss", "grad_norm", "lr", "eval_gpt_loss", "eval_distil_loss")


def run(module, nproc, out, *extra):
    proc = run_torchrun(nproc, f"-m rlhf.cli.{module}", *BASE, "--save_path", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], load_file(out / "model.safetensors"), proc.stdout


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    out = tmp_path_factory.mktemp("kd") / "teacher"
    run("train_sft", 2, out, "--max_steps", "32")
    return out


def test_student_learns_from_the_teacher(teacher, tmp_path):
    rows, _, stdout = run("train_kd", 2, tmp_path / "kd", "--teacher_model", str(teacher), "--max_steps", "32",
                          "--eval_steps", "16")
    assert "kd: 1024 samples" in stdout
    first, last = rows[0], rows[-1]
    assert first["step"] == 0 and last["step"] == 32
    assert last["eval_gpt_loss"] < 0.5 * first["eval_gpt_loss"], (first, last)
    assert last["eval_distil_loss"] < first["eval_distil_loss"] - 0.5, (first, last)


def test_kd_dp_split_and_packing_give_the_same_steps(teacher, tmp_path):
    short = ("--teacher_model", str(teacher), "--max_steps", "4", "--eval_steps", "2")
    ref = run("train_kd", 2, tmp_path / "dp2", *short)
    for other in (run("train_kd", 1, tmp_path / "dp1", *short),
                  run("train_kd", 2, tmp_path / "packed", *short, "--packing_samples", "--teacher_offload")):
        assert [r["step"] for r in other[0]] == [r["step"] for r in ref[0]] == [0, 1, 2, 3, 4]
        for a, b in zip(ref[0], other[0]):
            for key in COMPARED:
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
        for name, w in ref[1].items():
            torch.testing.assert_close(other[1][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_a_teacher_on_its_own_rank_gives_the_colocated_steps(teacher, tmp_path):
    """2 student ranks with the teacher colocated == the same 2 students with the teacher on a third rank."""
    short = ("--teacher_model", str(teacher), "--max_steps", "3", "--eval_steps", "2")
    colocated = run("train_kd", 2, tmp_path / "colocated", *short)
    own = run("train_kd", 3, tmp_path / "own", *short, "--teacher_num_gpus_per_node", "1")
    assert "teacher on ranks 2-2" in own[2]
    assert [r["step"] for r in own[0]] == [0, 1, 2, 3]
    for a, b in zip(colocated[0], own[0]):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
            {k: v for k, v in b.items() if not k.startswith("time/")}
    for name, w in colocated[1].items():
        assert torch.equal(own[1][name], w), name
