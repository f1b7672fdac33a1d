"""train_rm end to end on the embedded copy-task pairs (torchrun, 1-2 CPU ranks), 4 steps per run: DP=2 == DP=1 x
accumulation 2, packed == padded, ZeRO-3 with gradient checkpointing == ZeRO-2, ring attention and tensor
parallelism over the 2 ranks == one replica's padded steps (a scalar head under AutoTP); the saved model loads as a
transformers sequence classifier, in serve_rm and in train_ppo with the stored normalisation. (Learning is shown by
the pipeline example's reward-model stage, tests/examples.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.tiny_runs import CPU, SUPERVISED, SUPERVISED_LAYOUTS, assert_same_steps, run_job, run_jobs

RM = SUPERVISED
COMPARED = ("loss", "acc", "chosen_reward", "reject_reward", "grad_norm", "lr", "eval_loss", "eval_acc",
            "eval_reward_mean", "eval_reward_std")
LAYOUTS = SUPERVISED_LAYOUTS


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The 2-rank variants in one launch (ZeRO-3 last: its model-construction hooks stay in the process), and the
    1-rank one."""
    tmp = tmp_path_factory.mktemp("rm")
    two = {"dp2": RM, **{name: [*RM, *flags] for name, (nproc, flags) in LAYOUTS.items() if nproc == 2}}
    out = dict(zip(two, run_jobs(2, [("train_rm", tmp / name, args) for name, args in two.items()], tmp)))
    out["dp1"] = run_job(1, "train_rm", tmp / "dp1", *RM, *LAYOUTS["dp1"][1])
    out["dp2_path"] = tmp / "dp2"
    return out


def test_rm_splits_layouts_and_zero3_take_the_same_steps(runs):
    ref = runs["dp2"]
    assert [r["step"] for r in ref[0]] == [0, 1, 2, 3, 4]
    assert ref[0][0]["eval_acc"] < 0.7  # the fresh head guesses
    for name in LAYOUTS:
        rel = 1e-5 if name in ("dp1", "packed") else 1e-4
        assert_same_steps(ref, runs[name], COMPARED, rel=rel, abs_=1e-6, what=name)


def test_saved_rm_loads_as_classifier_in_serve_rm_and_in_ppo_with_its_normalisation(runs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.cli.serve_rm import build_source
    from rlhf.config.flags import parse_config
    from rlhf.config.ppo_config import TrainPPOConfig
    from rlhf.models.value import stored_reward_norm
    from rlhf.rewards.base import RewardInputs
    from rlhf.trainers.ppo_build import stored_reward_norms

    out, final = runs["dp2_path"], runs["dp2"][0][-1]
    mean, std = stored_reward_norm(str(out))
    assert (mean, std) == (pytest.approx(final["eval_reward_mean"]), pytest.approx(final["eval_reward_std"]))
    tok = AutoTokenizer.from_pretrained(out)
    texts = ["x copy 3 : 3 3 3 3 </s>", "x copy 3 : 5 a 7 b </s>"]
    classifier = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        hf = torch.stack([classifier(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
                          for t in texts])
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    inputs = RewardInputs(texts, texts, [None, None], enc["input_ids"], enc["attention_mask"])
    args = dict(reward_pretrain=str(out), remote_rm_url=None, value_head_prefix="score", bf16=False, batch_size=4,
                prm=False)
    raw = build_source(SimpleNamespace(**args, normalize_reward=False))[0].score(inputs).rewards_B
    normalized = build_source(SimpleNamespace(**args, normalize_reward=True))[0].score(inputs).rewards_B
    torch.testing.assert_close(raw, hf.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(normalized, (raw - mean) / std, rtol=1e-5, atol=1e-6)
    cfg = parse_config(TrainPPOConfig, [*CPU, "--pretrain", str(out), "--prompt_data", "x.jsonl", "--reward_pretrain",
                                        str(out), "--normalize_reward"])
    # the reward models normalise; no running statistics
    assert stored_reward_norms(cfg.reward, cfg.algo) == [(mean, std)]
