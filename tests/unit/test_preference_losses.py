"""DPO/IPO/cDPO and KTO: hand-computed losses, rewards and masks; the KTO loader and its mismatched pairs; the
OpenRLHF v0.9.5 defaults; the DPO NLL term by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms.preference import dpo_losses_B, kto_losses_B, kto_reference_point, response_mask_BT1


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
    from rlhf.data.supervised import load_unpaired_samples, mismatched
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
    from rlhf.config.preference import TrainDPOConfig, TrainKTOConfig

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


def test_dpo_nll_term_is_the_chosen_per_token_mean_by_hand():
    """OpenRLHF's NLL term: each chosen response's mean token log-prob, negated (rejected rows do not count)."""
    from types import SimpleNamespace

    from rlhf.trainers.preference import DPOTrainer

    trainer = object.__new__(DPOTrainer)
    trainer.beta, trainer.label_smoothing, trainer.ipo, trainer.nll_loss_coef = 0.1, 0.0, False, 0.5
    # two pairs: chosen sums -6 over 3 tokens and -2 over 4; rejected -9 over 3 and -5 over 5
    trainer.policy_logps = lambda batch: (torch.tensor([-6.0, -2.0, -9.0, -5.0]), torch.tensor([3.0, 4.0, 3.0, 5.0]))
    loss, chosen, rejected, nll = trainer._terms(SimpleNamespace(num_samples=2), torch.tensor([-7.0, -3.0, -8.0, -4.0]))
    assert nll.tolist() == pytest.approx([2.0, 0.5])
    assert chosen.tolist() == pytest.approx([0.1, 0.1]) and rejected.tolist() == pytest.approx([-0.1, -0.1])
    assert loss.tolist() == pytest.approx([-math.log(sig(0.1 * 2.0))] * 2)
