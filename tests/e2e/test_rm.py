"""train_rm end to end on the embedded copy-task pairs (torchrun, 1-2 CPU ranks): held-out accuracy,
DP=2 == DP=1 x accumulation 2, packed == padded, and the saved model loading as a transformers
sequence classifier, in serve_rm and in train_ppo with the stored normalisation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import run_torchrun
from tests.tiny_runs import CPU

RM = [*CPU, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
      "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.1", "--max_steps", "64", "--zero_stage", "2",
      "--eval_steps", "32"]
COMPARED = ("loss", "acc", "chosen_reward", "reject_reward", "grad_norm", "lr", "eval_loss", "eval_acc",
            "eval_reward_mean", "eval_reward_std")


def train(nproc, out, *extra):
    proc = run_torchrun(nproc, "-m rlhf.cli.train_rm", *RM, "--save_path", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], load_file(out / "model.safetensors"), proc.stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "dp2"
    return out, train(2, out)


def test_rm_reaches_90_percent_held_out(trained):
    rows = trained[1][0]
    assert rows[0]["step"] == 0 and rows[0]["eval_acc"] < 0.7  # the fresh head guesses
    assert rows[-1]["step"] == 64 and rows[-1]["eval_acc"] >= 0.9, rows[-1]


def test_rm_dp_split_and_packing_give_the_same_steps(tmp_path):
    short = ("--max_steps", "4", "--eval_steps", "2")
    ref = train(2, tmp_path / "dp2", *short)
    for other in (train(1, tmp_path / "dp1", *short), train(2, tmp_path / "packed", *short, "--packing_samples")):
        assert [r["step"] for r in other[0]] == [r["step"] for r in ref[0]] == [0, 1, 2, 3, 4]
        for a, b in zip(ref[0], other[0]):
            for key in COMPARED:
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
        for name, w in ref[1].items():
            torch.testing.assert_close(other[1][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_saved_rm_loads_as_classifier_in_serve_rm_and_in_ppo_with_its_normalisation(trained):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.cli.serve_rm import build_source
    from rlhf.config.flags import parse_config
    from rlhf.config.ppo import TrainPPOConfig
    from rlhf.models.value import stored_reward_norm
    from rlhf.rewards.base import RewardInputs
    from rlhf.trainers.build import stored_reward_norms

    out, ref = trained
    final = ref[0][-1]
    mean, std = stored_reward_norm(str(out))
    assert (mean, std) == (pytest.approx(final["eval_reward_mean"]), pytest.approx(final["eval_reward_std"]))
    tok = AutoTokenizer.from_pretrained(out)
    texts = ["x copy 3 : 3 3 3 3 </s>", "x copy 3 : 5 a 7 b </s>"]
    classifier = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        hf = torch.stack([classifier(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
                          for t in texts])
    assert hf[0] > hf[1]  # it learned the task
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
    assert stored_reward_norms(cfg) == [(mean, std)]  # the reward models normalise; no running statistics
