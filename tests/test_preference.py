"""DPO/IPO/cDPO and KTO: hand-computed losses, rewards and masks; the KTO loader and its mismatched pairs; and
train_dpo / train_kto end to end on the embedded pairs (torchrun, 1-3 CPU ranks): held-out preference accuracy
rises above 80%, DP=2 == DP=1 x accumulation 2, packed == padded (reference offloaded), and a reference on its
own rank gives exactly the colocated steps."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlhf.algorithms.preference import dpo_losses_B, kto_losses_B, kto_reference_point, response_mask_BT1
from tests.distributed import run_torchrun
from tests.test_e2e import CPU

BASE = [*CPU, "--train_batch_size", "16", "--micro_train_batch_size", "4", "--max_len", "32", "--max_epochs", "1",
        "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.1", "--zero_stage", "2"]
DPO_COMPARED = ("loss", "acc", "chosen_reward", "reject_reward", "margin", "nll_loss", "grad_norm", "lr",
                "eval_loss", "eval_acc", "eval_margin")
KTO_COMPARED = ("kto_loss", "chosen_reward", "reject_reward", "kl", "grad_norm", "lr", "eval_loss", "eval_kl",
                "eval_acc")


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


def run(module, nproc, out, *extra):
    proc = run_torchrun(nproc, f"-m rlhf.cli.{module}", *BASE, "--save_path", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], load_file(out / "model.safetensors"), proc.stdout


def assert_same_steps(ref, other, compared):
    assert [r["step"] for r in other[0]] == [r["step"] for r in ref[0]]
    for a, b in zip(ref[0], other[0]):
        for key in compared:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key, a[key], b[key])
    for name, w in ref[1].items():
        torch.testing.assert_close(other[1][name], w, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # CI checks the learning through launch/examples/dpo_tiny_cpu.sh (tests/test_examples_supervised.py)
def test_dpo_raises_held_out_preference_accuracy(tmp_path):
    rows, _, stdout = run("train_dpo", 2, tmp_path / "dpo", "--max_steps", "24", "--eval_steps", "12",
                          "--nll_loss_coef", "0.1")
    assert "dpo: 1024 samples" in stdout
    first, last = rows[0], rows[-1]
    assert first["step"] == 0 and first["eval_acc"] == 0.0 and first["eval_loss"] == pytest.approx(math.log(2))
    assert last["step"] == 24 and last["eval_acc"] >= 0.8 and last["eval_margin"] > 0, last
    assert all("nll_loss" in r for r in rows[1:])


def test_dpo_dp_split_and_packing_give_the_same_steps(tmp_path):
    short = ("--max_steps", "3", "--eval_steps", "3", "--max_samples", "128", "--nll_loss_coef", "0.1")
    ref = run("train_dpo", 2, tmp_path / "dp2", *short)
    assert [r["step"] for r in ref[0]] == [0, 1, 2, 3]
    assert_same_steps(ref, run("train_dpo", 1, tmp_path / "dp1", *short), DPO_COMPARED)
    assert_same_steps(ref, run("train_dpo", 2, tmp_path / "packed", *short, "--packing_samples", "--ref_offload"),
                      DPO_COMPARED)


@pytest.mark.slow
def test_dpo_reference_on_its_own_rank_gives_the_colocated_steps(tmp_path):
    short = ("--max_steps", "3", "--eval_steps", "3", "--max_samples", "128", "--ipo", "--beta", "0.5")
    ref = run("train_dpo", 2, tmp_path / "colocated", *short)
    own = run("train_dpo", 3, tmp_path / "own", *short, "--ref_num_gpus_per_node", "1")
    assert "ref on ranks 2-2" in own[2]
    assert_same_steps(ref, own, DPO_COMPARED)


@pytest.mark.slow  # CI checks the learning through launch/examples/kto_tiny_cpu.sh
def test_kto_raises_held_out_pair_accuracy(tmp_path):
    rows, _, stdout = run("train_kto", 1, tmp_path / "kto", "--max_steps", "24", "--eval_steps", "12",
                          "--beta", "0.1", "--micro_train_batch_size", "8")
    assert "kto: 2048 samples" in stdout
    first, last = rows[0], rows[-1]
    assert first["step"] == 0 and first["eval_acc"] == 0.0 and first["eval_loss"] == pytest.approx(0.5)
    assert last["step"] == 24 and last["eval_acc"] >= 0.8 and last["eval_kl"] >= 0, last
    assert last["eval_chosen_reward"] > last["eval_reject_reward"]


@pytest.mark.slow
def test_kto_packing_gives_the_same_steps(tmp_path):
    short = ("--max_steps", "3", "--eval_steps", "3", "--max_samples", "128", "--desirable_loss_weight", "1.5")
    ref = run("train_kto", 2, tmp_path / "padded", *short)
    assert_same_steps(ref, run("train_kto", 2, tmp_path / "packed", *short, "--packing_samples", "--ref_offload"),
                      KTO_COMPARED)


def test_zero3_evaluation_with_unequal_shares_does_not_hang(tmp_path):
    """9 held-out pairs over 2 ranks in micro-batches of 4: 2 micro-batches on rank 0, 1 on rank 1. At ZeRO-3
    every forward gathers parameters over the group, so rank 1 must run a discarded copy; the metrics count
    each pair once (the same as one rank scoring all 9)."""
    from rlhf.assets import EMBEDDED_PAIRS_EVAL

    with open(EMBEDDED_PAIRS_EVAL) as f:
        (tmp_path / "eval.jsonl").write_text("".join(f.readlines()[:9]))
    short = ("--max_steps", "1", "--eval_steps", "1", "--zero_stage", "3", "--eval_dataset",
             str(tmp_path / "eval.jsonl"), "--eval_split", "train")
    two = run("train_dpo", 2, tmp_path / "dp2", *short)
    one = run("train_dpo", 1, tmp_path / "dp1", *short)
    for a, b in zip(two[0], one[0]):
        for key in ("eval_loss", "eval_acc", "eval_margin", "eval_chosen_reward"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


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
