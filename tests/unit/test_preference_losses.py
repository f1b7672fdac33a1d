"""DPO/IPO/cDPO, KTO, SimPO and ORPO: hand-computed losses, rewards and masks; the KTO loader and its mismatched
pairs; the OpenRLHF v0.9.5 defaults; the DPO NLL term by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms.preference_losses import (
    dpo_losses_B,
    kto_losses_B,
    kto_reference_point,
    log1mexp,
    odds_ratio_losses_B,
    response_mask_BT1,
    simpo_losses_B,
)


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_dpo_ipo_cdpo_losses_and_rewards_by_hand():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.5))
    h = (-3.0 - -5.0) - (-4.0 - -4.5)  # 1.5
    loss, chosen, rejected = dpo_losses_B(pc, pr, rc, rr, beta=0.1)
    assert float(loss) == pytest.approx(-math.log(sig(0.15)))
    assert (float(chosen), float(rejected)) == (pytest.approx(0.1), pytest.approx(-0.05))
    loss, _, _ = dpo_losses_B(pc, pr, rc, rr, beta=0.1, label_smoothing=0.2)
    assert float(loss) == pytest.approx(-0.8 * math.log(sig(0.15)) - 0.2 * math.log(sig(-0.15)))
    loss, _, _ = dpo_losses_B(pc, pr, rc, rr, beta=0.1, ipo=True)
    assert float(loss) == pytest.approx((h - 1 / 0.2) ** 2)


def test_simpo_loss_and_rewards_by_hand():
    # average log-probs -0.5 (chosen) and -1.25 (rejected), beta 2, gamma 1: -log sigmoid(2 x 0.75 - 1)
    loss, chosen, rejected = simpo_losses_B(torch.tensor([-0.5, -2.0]), torch.tensor([-1.25, -1.0]), beta=2.0,
                                            gamma=1.0)
    assert loss.tolist() == pytest.approx([-math.log(sig(0.5)), -math.log(sig(-3.0))])
    assert chosen.tolist() == [-1.0, -4.0] and rejected.tolist() == [-2.5, -2.0]


def test_orpo_odds_ratio_by_hand():
    # p = 0.5 and 0.2: odds 1 and 0.25, log odds ratio log 4
    chosen, rejected = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.2)])
    loss, log_odds = odds_ratio_losses_B(chosen, rejected)
    assert float(log_odds) == pytest.approx(math.log(4.0))
    assert float(loss) == pytest.approx(-math.log(sig(math.log(4.0))))  # = log(1.25)
    # the gradient of the loss wrt the chosen average log-prob: -(1 - sigmoid(log OR)) x d log odds / dx, where
    # d log odds(p) / d log p = 1 / (1 - p) = 2 at p = 0.5
    x = chosen.clone().requires_grad_()
    odds_ratio_losses_B(x, rejected)[0].backward()
    assert float(x.grad) == pytest.approx(-(1 - 0.8) * 2.0)
    # both branches of log(1 - e^x), and a certain response (average log-prob 0) stays finite
    assert log1mexp(torch.tensor([-1e-3, -0.1, -5.0])).tolist() == pytest.approx(
        [math.log(-math.expm1(-1e-3)), math.log(1 - math.exp(-0.1)), math.log1p(-math.exp(-5.0))], rel=1e-6)
    loss, log_odds = odds_ratio_losses_B(torch.tensor([0.0]), torch.tensor([-1.0]))
    assert math.isfinite(float(loss)) and float(log_odds) > 10


def test_kto_losses_reference_point_and_weights_by_hand():
    # mismatched pairs: policy - reference of -0.4, 1.0 and 0.6 -> mean 0.4 (a negative mean clamps to 0)
    z0 = kto_reference_point(torch.tensor(-0.4 + 1.0 + 0.6), 3)
    assert float(z0) == pytest.approx(0.4)
    assert float(kto_reference_point(-1.2, 3)) == 0.0
    policy, ref = torch.tensor([-2.0, -3.0]), torch.tensor([-3.0, -2.5])  # r = 1.0 and -0.5
    loss, reward = kto_losses_B(policy, ref, torch.tensor([True, False]), z0, beta=0.5, desirable_weight=2.0,
                                undesirable_weight=0.5)
    assert loss.tolist() == pytest.approx([2.0 * (1 - sig(0.5 * (1.0 - 0.4))), 0.5 * (1 - sig(0.5 * (0.4 + 0.5)))])
    assert reward.tolist() == pytest.approx([0.5, -0.25])


def test_response_mask_skips_the_prompt_and_padding():
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    got = response_mask_BT1(mask, torch.tensor([2, 1]))
    # position t scores token t + 1: sample 0 scores tokens 2..4, sample 1 tokens 1..2
    assert got.tolist() == [[0, 1, 1, 1], [1, 1, 0, 0]]


def test_kto_loader_splits_pairs_and_reads_labels(tmp_path):
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.data.sources import Row
    from rlhf.data.supervised_samples import load_unpaired_samples, mismatched
    from rlhf.models.loading import load_tokenizer

    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    rows = [Row("d.jsonl", 1, {"input": "copy 3 :", "chosen": "3 3 3 3", "rejected": "a b c d"}),
            Row("d.jsonl", 2, {"input": "copy 4 :", "output": "4 4 4 4", "label": False})]
    args = dict(input_key="input", output_key="output", label_key="label", chosen_key="chosen",
                rejected_key="rejected", input_template="{} ", apply_chat_template=False, max_len=32)
    samples, _ = load_unpaired_samples(rows, tok, **args)
    assert [(s.desirable, s.pair) for s in samples] == [(True, 0), (False, 0), (False, None)]
    ids = samples[0].sft.input_ids
    assert tok.decode(ids[:samples[0].prompt_len]).split() == ["copy", "3", ":"]
    kl = mismatched(samples[0], samples[1], tok.eos_token_id, 32)  # prompt 3 with the answer "a b c d"
    assert tok.decode(kl.input_ids).split() == ["copy", "3", ":", "a", "b", "c", "d", tok.eos_token]
    assert kl.loss_mask.tolist() == [False, False, True, True, True, True, True]
    with pytest.raises(ValueError, match="d.jsonl, row 1: label column 'label' holds 'yes'"):
        load_unpaired_samples([Row("d.jsonl", 1, {"input": "copy 3 :", "output": "3", "label": "yes"})], tok,
                              **args)


def test_defaults_are_openrlhf_v095():
    from rlhf.config.flags import parse_config
    from rlhf.config.preference_config import TrainDPOConfig, TrainKTOConfig

    dpo = parse_config(TrainDPOConfig, [])
    assert (dpo.beta, dpo.optim.learning_rate, dpo.data.max_len, dpo.data.eval_split, dpo.batch.max_epochs,
            dpo.data.prompt_key, dpo.data.input_template, dpo.checkpoint.ckpt_path, dpo.logging.wandb_project,
            dpo.ipo, dpo.label_smoothing, dpo.nll_loss_coef) == (
        0.1, 1e-5, 512, "test", 1, None, None, "./ckpt/checkpoints_dpo", "openrlhf_train_dpo", False, 0.0, 0.0)
    kto = parse_config(TrainKTOConfig, [])
    assert (kto.beta, kto.optim.learning_rate, kto.data.max_len, kto.data.input_key, kto.data.output_key,
            kto.data.label_key, kto.data.input_template, kto.desirable_loss_weight, kto.undesirable_loss_weight,
            kto.checkpoint.ckpt_path) == (
        0.01, 1e-5, 2048, "input", None, "label", "User: {}\nAssistant: ", 1.0, 1.0, "./ckpt/checkpoints_kto")
    assert (dpo.batch.train_batch_size, dpo.batch.micro_train_batch_size, dpo.optim.max_norm) == (128, 8, 1.0)


def test_reference_free_jobs_defaults_and_no_reference_flags(capsys):
    """SimPO's and ORPO's defaults (their papers'), and no reference flag: one would do nothing."""
    from rlhf.config.errors import UsageError
    from rlhf.config.flags import parse_config
    from rlhf.config.preference_config import TrainORPOConfig, TrainSimPOConfig

    simpo, orpo = parse_config(TrainSimPOConfig, []), parse_config(TrainORPOConfig, [])
    assert (simpo.beta, simpo.simpo_gamma, simpo.optim.learning_rate, simpo.data.max_len) == (2.0, 1.0, 1e-5, 512)
    assert (orpo.orpo_lambda, orpo.checkpoint.ckpt_path) == (0.1, "./ckpt/checkpoints_orpo")
    for root, flag in ((TrainSimPOConfig, "--ref_pretrain"), (TrainORPOConfig, "--beta"),
                       (TrainORPOConfig, "--ref_offload")):
        with pytest.raises(SystemExit):
            parse_config(root, [flag, "1"] if flag != "--ref_offload" else [flag])
        assert f"unknown flag {flag}" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--simpo_gamma must be >= 0"):
        parse_config(TrainSimPOConfig, ["--simpo_gamma", "-1"])


def test_pair_trainers_terms_by_hand():
    """The pair trainers' per-pair terms from sequence log-prob sums and token counts: DPO's NLL term is each
    chosen response's mean token log-prob, negated (OpenRLHF; rejected rows do not count); SimPO and ORPO use
    the average log-probs (sum / count); CPO the sums, with ORPO's NLL term. CPO's defaults are TRL's."""
    from types import SimpleNamespace

    from rlhf.config.errors import UsageError
    from rlhf.config.flags import parse_config
    from rlhf.config.preference_config import TrainCPOConfig
    from rlhf.trainers.preference_trainers import CPOTrainer, DPOTrainer, ORPOTrainer, SimPOTrainer

    # two pairs: chosen sums -6 over 3 tokens and -2 over 4; rejected -9 over 3 and -5 over 5
    logps = lambda batch: (torch.tensor([-6.0, -2.0, -9.0, -5.0]), torch.tensor([3.0, 4.0, 3.0, 5.0]))  # noqa: E731
    batch = SimpleNamespace(num_samples=2)
    dpo = object.__new__(DPOTrainer)
    dpo.beta, dpo.label_smoothing, dpo.ipo, dpo.nll_loss_coef, dpo.policy_logps = 0.1, 0.0, False, 0.5, logps
    t = dpo.pair_terms(batch, torch.tensor([-7.0, -3.0, -8.0, -4.0]))
    assert t.logged_B["nll_loss"].tolist() == pytest.approx([2.0, 0.5])
    assert t.chosen_B.tolist() == pytest.approx([0.1, 0.1]) and t.rejected_B.tolist() == pytest.approx([-0.1, -0.1])
    assert t.logged_B["loss"].tolist() == pytest.approx([-math.log(sig(0.1 * 2.0))] * 2)
    assert t.objective_B.tolist() == pytest.approx([-math.log(sig(0.2)) + 1.0, -math.log(sig(0.2)) + 0.25])

    simpo = object.__new__(SimPOTrainer)
    simpo.beta, simpo.gamma, simpo.policy_logps = 2.0, 0.5, logps
    t = simpo.pair_terms(batch, None)  # averages: chosen -2, -0.5; rejected -3, -1
    assert t.chosen_B.tolist() == [-4.0, -1.0] and t.rejected_B.tolist() == [-6.0, -2.0]
    assert t.objective_B.tolist() == pytest.approx([-math.log(sig(2.0 - 0.5)), -math.log(sig(1.0 - 0.5))])

    orpo = object.__new__(ORPOTrainer)
    orpo.orpo_lambda, orpo.policy_logps = 0.25, logps
    t = orpo.pair_terms(batch, None)

    def log_odds(avg: float) -> float:
        return avg - math.log(1 - math.exp(avg))

    ratio = [log_odds(-2.0) - log_odds(-3.0), log_odds(-0.5) - log_odds(-1.0)]
    assert t.logged_B["log_odds_ratio"].tolist() == pytest.approx(ratio)
    assert t.logged_B["nll_loss"].tolist() == [2.0, 0.5]
    assert t.objective_B.tolist() == pytest.approx([nll - 0.25 * math.log(sig(r)) for nll, r in zip((2.0, 0.5), ratio)])
    assert t.chosen_B.tolist() == [-0.5, -0.125] and t.rejected_B.tolist() == [-0.75, -0.25]

    cpo = object.__new__(CPOTrainer)
    cpo.beta, cpo.cpo_alpha, cpo.policy_logps = 0.5, 2.0, logps
    t = cpo.pair_terms(batch, None)  # sums: chosen -6, -2; rejected -9, -5 (CPO's term reads sums, not averages)
    assert t.chosen_B.tolist() == [-3.0, -1.0] and t.rejected_B.tolist() == [-4.5, -2.5]
    assert t.logged_B["loss"].tolist() == pytest.approx([-math.log(sig(1.5)), -math.log(sig(1.5))])
    assert t.logged_B["nll_loss"].tolist() == [2.0, 0.5]
    assert t.objective_B.tolist() == pytest.approx([-math.log(sig(1.5)) + 4.0, -math.log(sig(1.5)) + 1.0])
    assert parse_config(TrainCPOConfig, []).beta == 0.1 and parse_config(TrainCPOConfig, []).cpo_alpha == 1.0
    with pytest.raises(UsageError, match="--cpo_alpha must be >= 0"):
        parse_config(TrainCPOConfig, ["--cpo_alpha", "-1"])
