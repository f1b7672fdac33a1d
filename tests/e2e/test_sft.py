"""train_sft end to end on the embedded copy-task demonstrations (torchrun, 1-2 CPU ranks), 4 steps per run: DP=2 ==
DP=1 x accumulation 2, packed == padded, ZeRO-3 with gradient checkpointing == ZeRO-2, ring attention and tensor
parallelism (--ds_tensor_parallel_size 2) over the 2 ranks == one replica's padded steps, and a run resumed from its
step-2 checkpoint == the straight run bit for bit; the tensor-parallel run's checkpoint resumed without tensor
parallelism continues its steps. (Learning is shown by the pipeline example's SFT stage,
tests/examples.)"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.tiny_runs import SUPERVISED, SUPERVISED_LAYOUTS, assert_same_steps, run_job, run_jobs, without_timings

SFT = SUPERVISED
COMPARED = ("gpt_loss", "grad_norm", "lr", "eval_gpt_loss")
LAYOUTS = SUPERVISED_LAYOUTS


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The 2-rank variants in one launch (ZeRO-3 last: its model-construction hooks stay in the process), the
    1-rank one, and the resumed run in a fresh launch of its own."""
    tmp = tmp_path_factory.mktemp("sft")
    ckpt = tmp / "ckpt"
    two = {"dp2": [*SFT, "--save_steps", "2", "--ckpt_path", str(ckpt)]}
    two.update({name: [*SFT, *flags] for name, (nproc, flags) in LAYOUTS.items() if nproc == 2})
    two["tensor_parallel"] += ["--save_steps", "2", "--ckpt_path", str(tmp / "ckpt_tp")]
    out = dict(zip(two, run_jobs(2, [("train_sft", tmp / name, args) for name, args in two.items()], tmp)))
    out["dp1"] = run_job(1, "train_sft", tmp / "dp1", *SFT, *LAYOUTS["dp1"][1])
    for directory in (ckpt, tmp / "ckpt_tp"):
        shutil.rmtree(directory / "global_step4")  # resume from the middle
    resumes = {"resumed": [*SFT, "--load_checkpoint", "--ckpt_path", str(ckpt)],  # the same layout
               "tp_moved": [*SFT, "--load_checkpoint", "--ckpt_path", str(tmp / "ckpt_tp")]}  # TP-2 -> 2 replicas
    out.update(zip(resumes, run_jobs(2, [("train_sft", tmp / name, args) for name, args in resumes.items()], tmp)))
    out["ckpt"], out["ckpt_tp"] = ckpt, tmp / "ckpt_tp"
    return out


def test_sft_splits_layouts_and_zero3_take_the_same_steps(runs):
    ref = runs["dp2"]
    assert [r["step"] for r in ref[0]] == [0, 1, 2, 3, 4]
    assert "sft: 1024 samples, 1 epoch(s) of 64 steps of 16 samples (4 steps); 2 data-parallel replica(s)" in ref[2]
    assert ref[0][-1]["eval_gpt_loss"] < ref[0][0]["eval_gpt_loss"]
    assert ("1 data-parallel replica(s), each split over 2 ranks (--ds_tensor_parallel_size: the models' linear "
            "layers, by DeepSpeed AutoTP)") in runs["tensor_parallel"][2]
    for name in LAYOUTS:
        assert_same_steps(ref, runs[name], COMPARED, rel=1e-4, abs_=1e-6, what=name)


def test_sft_resume_equals_straight_run(runs):
    straight, resumed, ckpt = runs["dp2"], runs["resumed"], runs["ckpt"]
    assert f"resumed from {ckpt}/global_step2 after 2 steps" in resumed[2]
    assert [r["step"] for r in resumed[0]] == [3, 4]
    by_step = {r["step"]: r for r in straight[0]}
    for b in resumed[0]:
        a = by_step[b["step"]]
        assert without_timings(a) == without_timings(b)
    for name, w in straight[1].items():
        assert torch.equal(resumed[1][name], w), name


def test_a_tensor_parallel_checkpoint_resumes_without_tensor_parallelism(runs):
    """The TP-2 run's step-2 checkpoint resumed by 2 data-parallel replicas (no --ds_tensor_parallel_size): the
    state moves (its slices merged, then each replica's share set) and steps 3-4 are the TP-2 run's to float
    rounding (the same samples; the gradients summed over other ranks)."""
    straight, moved, ckpt = runs["tensor_parallel"], runs["tp_moved"], runs["ckpt_tp"]
    assert (f"the model's state moved from ZeRO-2 over 1 x 2 ranks (data x tensor parallel) to ZeRO-2 over 2 ranks "
            f"(through {ckpt}/global_step2/model/universal)") in moved[2], moved[2][-3000:]
    assert [r["step"] for r in moved[0]] == [3, 4]
    assert_same_steps((straight[0][-2:], straight[1]), moved, COMPARED, rel=1e-4, abs_=1e-6, what="TP-2 -> DP-2 resume")


def test_another_jobs_checkpoint_is_refused_before_the_engines(runs, tmp_path):
    """train_ppo --load_checkpoint on train_sft's --ckpt_path: one line naming both jobs and the fix, within
    seconds (it used to fail 74 s in with DeepSpeed's bare AssertionError)."""
    from tests.distributed import run_torchrun
    from tests.tiny_runs import CPU

    proc = run_torchrun(1, "-m rlhf.cli.train_ppo", *CPU, "--load_checkpoint", "--ckpt_path", str(runs["ckpt"]),
                        "--save_path", str(tmp_path / "ppo"))
    assert proc.returncode != 0
    want = (f"error: --load_checkpoint: checkpoint {runs['ckpt']}/global_step2 was written by the 'train_sft' job "
            "and this is the 'train_ppo' job: resume it with the job that wrote it, or start a new --ckpt_path")
    assert want in proc.stderr
    assert "Traceback" not in proc.stderr.split("error: --load_checkpoint")[0]
    assert "rl steps" not in proc.stdout  # refused before any engine or step
