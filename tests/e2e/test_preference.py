"""train_dpo / train_kto end to end on the embedded pairs (torchrun, 1-3 CPU ranks), 3 steps per run, evaluated before
the first step and after the last on 9 held-out pairs (2 micro-batches on rank 0, 1 on rank 1): before any step the
policy is its reference, so the DPO loss is log 2 and KTO's 0.5; DP=2 == DP=1 x accumulation 2 (each held-out pair
counted once) == tensor parallel over 2 ranks (policy and reference split); ZeRO-3 with packing and the reference
offloaded == ZeRO-2 padded (at ZeRO-3 rank 1 runs a discarded copy of rank 0's extra evaluation forward, or the
gather hangs); a reference on its own rank == colocated; KTO packed == padded; the reference-free SimPO, ORPO and
CPO: DP=2 == DP=1 and packed == padded. (Learning is shown by the DPO, KTO, SimPO and ORPO examples, tests/examples;
CPO's terms by tests/unit/test_preference_losses.py.)"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.tiny_runs import TRAIN, assert_same_steps, run_job, run_jobs

BASE = [*TRAIN, "--train_batch_size", "16", "--micro_train_batch_size", "4", "--max_len", "32", "--max_epochs", "1",
        "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.1", "--zero_stage", "2", "--max_steps", "3",
        "--eval_steps", "3", "--max_samples", "128", "--eval_split", "train"]
DPO_COMPARED = ("loss", "acc", "chosen_reward", "reject_reward", "margin", "nll_loss", "grad_norm", "lr",
                "eval_loss", "eval_acc", "eval_margin", "eval_chosen_reward")
PAIR_COMPARED = ("loss", "acc", "chosen_reward", "reject_reward", "margin", "grad_norm", "lr", "eval_loss", "eval_acc",
                 "eval_margin", "eval_chosen_reward", "eval_reject_reward")
ORPO_COMPARED = (*PAIR_COMPARED, "nll_loss", "or_loss", "log_odds_ratio")
KTO_COMPARED = ("kto_loss", "chosen_reward", "reject_reward", "kl", "grad_norm", "lr", "eval_loss", "eval_kl",
                "eval_acc")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The 2-rank runs in one launch (ZeRO-3 last), the 1-rank runs in another, then the 3-rank DPO (reference on
    its own rank)."""
    from rlhf.assets import EMBEDDED_PAIRS_EVAL

    tmp = tmp_path_factory.mktemp("preference")
    with open(EMBEDDED_PAIRS_EVAL) as f:
        (tmp / "eval.jsonl").write_text("".join(f.readlines()[:9]))
    base = [*BASE, "--eval_dataset", str(tmp / "eval.jsonl")]
    dpo = [*base, "--nll_loss_coef", "0.1", "--ipo", "--beta", "0.5"]
    out = {}
    kto = [*base, "--desirable_loss_weight", "1.5"]
    simpo = [*base, "--beta", "2.5", "--simpo_gamma", "0.5"]
    orpo = [*base, "--orpo_lambda", "0.5"]
    cpo = [*base, "--beta", "0.5", "--cpo_alpha", "0.5"]
    ckpt = str(tmp / "dpo_ckpt")  # the straight DPO run also checkpoints: saving changes nothing it computes
    two = {"dpo": ("train_dpo", [*dpo, "--save_steps", "1", "--ckpt_path", ckpt]), "kto": ("train_kto", kto),
           "kto_packed": ("train_kto", [*kto, "--packing_samples", "--ref_offload"]),
           "simpo": ("train_simpo", simpo), "simpo_packed": ("train_simpo", [*simpo, "--packing_samples"]),
           "orpo": ("train_orpo", orpo), "orpo_packed": ("train_orpo", [*orpo, "--packing_samples"]),
           "cpo": ("train_cpo", cpo), "cpo_packed": ("train_cpo", [*cpo, "--packing_samples"]),
           "dpo_tp": ("train_dpo", [*dpo, "--ds_tensor_parallel_size", "2"]),  # policy and reference split
           "dpo_zero3_packed": ("train_dpo", [*dpo, "--zero_stage", "3", "--packing_samples", "--ref_offload"])}
    # resumed from the 2-rank ZeRO-2 run's step 2 on 1 rank at ZeRO-3 (last: ZeRO-3 runs end a launch)
    one = {"dpo_dp1": ("train_dpo", dpo), "simpo_dp1": ("train_simpo", simpo), "orpo_dp1": ("train_orpo", orpo),
           "cpo_dp1": ("train_cpo", cpo),
           "dpo_moved": ("train_dpo", [*dpo, "--load_checkpoint", "--ckpt_path", ckpt, "--zero_stage", "3"])}
    for nproc, runs in ((2, two), (1, one)):
        out.update(zip(runs, run_jobs(nproc, [(module, tmp / name, args) for name, (module, args) in runs.items()],
                                      tmp)))
        shutil.rmtree(os.path.join(ckpt, "global_step3"), ignore_errors=True)  # the move resumes after step 2
    out["dpo_own_ref"] = run_job(3, "train_dpo", tmp / "dpo_own_ref", *dpo, "--ref_num_gpus_per_node", "1")
    return out


def test_dpo_layouts_splits_and_placements_take_the_same_steps(runs):
    ref = runs["dpo"]
    assert "dpo: 128 samples" in ref[2]
    assert [r["step"] for r in ref[0]] == [0, 1, 2, 3]
    # IPO: (log-ratio margin - 1 / (2 beta))^2 = 1 with a zero margin
    assert ref[0][0]["eval_loss"] == pytest.approx(1.0) and ref[0][0]["eval_margin"] == 0.0
    assert all("nll_loss" in r for r in ref[0][1:])
    assert_same_steps(ref, runs["dpo_dp1"], DPO_COMPARED, rel=1e-5, abs_=1e-6, what="dp1")
    assert_same_steps(ref, runs["dpo_zero3_packed"], DPO_COMPARED, rel=1e-4, abs_=1e-6, what="zero3 packed")
    assert_same_steps(ref, runs["dpo_tp"], DPO_COMPARED, rel=1e-4, abs_=1e-6, what="tensor parallel")
    assert "ref on ranks 2-2" in runs["dpo_own_ref"][2]
    assert_same_steps(ref, runs["dpo_own_ref"], DPO_COMPARED, rel=1e-5, abs_=1e-6, what="own reference rank")


def test_dpo_resumed_on_one_rank_at_zero3_continues_the_two_rank_zero2_run(runs):
    """The 2-rank ZeRO-2 run's checkpoint after step 2, resumed on 1 rank at ZeRO-3: its step 3 and final evaluation
    are the straight run's (rounding aside), with no conversion step by the user."""
    ref, moved = runs["dpo"], runs["dpo_moved"]
    assert "the model's state moved from ZeRO-2 over 2 ranks to ZeRO-3 over 1 rank" in moved[2]
    assert "resumed from" in moved[2] and "after 2 steps" in moved[2]
    assert [r["step"] for r in moved[0]] == [3]
    assert_same_steps((ref[0][3:], ref[1]), moved, DPO_COMPARED, rel=1e-4, abs_=1e-6, what="moved")


def test_kto_packing_gives_the_same_steps(runs):
    ref = runs["kto"]
    assert [r["step"] for r in ref[0]] == [0, 1, 2, 3]
    # before any step every answer's loss is 1 - sigmoid(0) = 0.5, weighted 1.5 (desirable) or 1 (undesirable),
    # over as many desirable as undesirable answers
    assert ref[0][0]["eval_loss"] == pytest.approx(0.5 * (1.5 + 1.0) / 2)
    assert_same_steps(ref, runs["kto_packed"], KTO_COMPARED, rel=1e-5, abs_=1e-6, what="packed")


@pytest.mark.parametrize("job", ["simpo", "orpo", "cpo"])
def test_reference_free_pairs_split_and_packing_give_the_same_steps(runs, job):
    ref = runs[job]
    assert f"{job}: 128 samples" in ref[2] and "ref on ranks" not in ref[2]
    assert [r["step"] for r in ref[0]] == [0, 1, 2, 3]
    compared = {"orpo": ORPO_COMPARED, "cpo": (*PAIR_COMPARED, "nll_loss")}.get(job, PAIR_COMPARED)
    for row in ref[0][1:]:
        assert row["margin"] == pytest.approx(row["chosen_reward"] - row["reject_reward"], abs=1e-6)
        if job == "orpo":  # the logged terms are global means of per-pair terms, so the loss is their sum
            assert row["loss"] == pytest.approx(row["nll_loss"] + 0.5 * row["or_loss"], rel=1e-6)
    assert_same_steps(ref, runs[f"{job}_dp1"], compared, rel=1e-5, abs_=1e-6, what="dp1")
    assert_same_steps(ref, runs[f"{job}_packed"], compared, rel=1e-5, abs_=1e-6, what="packed")
