"""train_prm end to end on the embedded step-labelled answers (torchrun, 2 CPU ranks): held-out step accuracy
rises, and serve_rm's process-reward source scores good steps above bad ones with the trained model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rlhf.assets import EMBEDDED_PRM_EVAL, EMBEDDED_PRM_PLACEHOLDER, EMBEDDED_PRM_REWARD_TOKENS
from tests.distributed import run_job_variants
from tests.tiny_runs import TRAIN

PRM = [*TRAIN, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
       "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.1", "--max_steps", "64", "--zero_stage", "2",
       "--eval_steps", "32"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("prm") / "run"
    run_job_variants(2, [("train_prm", [*PRM, "--save_path", str(out)])], out.parent / "consoles", out)
    with open(out / "metrics.jsonl") as f:
        return out, [json.loads(line) for line in f]


def test_prm_held_out_step_accuracy_rises(trained):
    _, rows = trained
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 64
    assert rows[0]["eval_acc"] < 0.6 and rows[-1]["eval_acc"] > 0.75, (rows[0], rows[-1])
    assert rows[-1]["eval_prm_loss"] < rows[0]["eval_prm_loss"]


def test_serve_rm_prm_source_scores_good_steps_above_bad_ones(trained):
    from rlhf.cli.serve_rm import build_source
    from rlhf.rewards.base import RewardInputs

    out, _ = trained
    source, tok = build_source(SimpleNamespace(
        reward_pretrain=str(out), remote_rm_url=None, value_head_prefix="score", bf16=False, batch_size=8,
        prm=True, placeholder_token=EMBEDDED_PRM_PLACEHOLDER, reward_tokens=list(EMBEDDED_PRM_REWARD_TOKENS),
        prm_reduction="min", normalize_reward=False))
    with open(EMBEDDED_PRM_EVAL) as f:
        rows = [json.loads(line) for line in f][:64]
    texts = [r["input"] for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    inputs = RewardInputs(texts, texts, [None] * len(texts), enc["input_ids"], enc["attention_mask"])
    steps = source.step_scores(inputs)
    good = torch.cat([s[torch.tensor([lab == EMBEDDED_PRM_REWARD_TOKENS[0] for lab in r["label"]])]
                      for s, r in zip(steps, rows)])
    bad = torch.cat([s[torch.tensor([lab != EMBEDDED_PRM_REWARD_TOKENS[0] for lab in r["label"]])]
                     for s, r in zip(steps, rows)])
    assert good.mean() > bad.mean() + 0.2, (float(good.mean()), float(bad.mean()))
    result = source.score(inputs)
    torch.testing.assert_close(result.rewards_B, torch.stack([s.min() for s in steps]))
    assert result.extra_logs["prm_steps"].tolist() == [float(len(r["label"])) for r in rows]
    with pytest.raises(ValueError, match="contain no placeholder token"):
        plain = tok(["x copy 3 : 3"], return_tensors="pt", add_special_tokens=False)
        source.score(RewardInputs(["x"], ["x"], [None], plain["input_ids"], plain["attention_mask"]))
