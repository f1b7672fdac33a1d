"""The actor's experience-time log-probs and its optimizer step do not depend on how a batch is laid out
or cut: packed (`--packing_samples`), token-budget micro-batches (`--use_dynamic_batch`) and ring
attention (`--ring_attn_size`) all equal the padded, fixed-micro-batch step on one rank, on the same
global batch: same log-probs, loss, entropy, KL, ptx (SFT) loss, gradient norm and updated weights."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.tiny_actor import GLOBAL_BATCH, MICRO, synthetic_experiences
from tests.tiny_runs import assert_adam_weights_close

LR = 1e-2
# name -> (packing, ring size, per-rank token budget for dynamic batching or None)
VARIANTS = {
    "padded": (False, 1, None),
    "packed": (True, 1, None),
    "packed_dynamic": (True, 1, 16),
    "ring": (True, 2, None),
    "ring_dynamic": (True, 2, 8),  # budget per rank: a ring of 2 carries 16 tokens per micro-batch
}


def _one_variant(name: str, zero_stage: int) -> dict:
    import torch.distributed as dist

    from rlhf.config.ppo_config import AlgoConfig
    from rlhf.distributed.topology import Role, Topology
    from rlhf.models.layout import SequenceLayout
    from tests.tiny_actor import build_actor

    packing, ring, budget = VARIANTS[name]
    topology = Topology({Role.ACTOR: tuple(range(dist.get_world_size()))}, ring_size=ring)
    layout = SequenceLayout(packing=packing, ring_group=topology.ring_group(Role.ACTOR),
                            ring_head_stride=1 if ring > 1 else None)
    dp, dp_rank = topology.dp_size(Role.ACTOR), topology.dp_rank(Role.ACTOR)
    algo = AlgoConfig(use_kl_loss=True, init_kl_coef=0.05, kl_estimator="k3", entropy_loss_coef=0.01, ptx_coef=0.5)
    actor = build_actor(zero_stage, LR, GLOBAL_BATCH // (MICRO * dp), layout=layout, max_tokens=budget, algo=algo)
    exp = synthetic_experiences(actor.model.module.config.vocab_size)
    current = actor.logprobs(exp.sequences_BT, exp.attention_mask_BT)
    exp.old_logprobs_BT1 = (current + exp.old_logprobs_BT1) * exp.action_mask_BT1
    exp.ref_logprobs_BT1 = (current - 0.2 * exp.old_logprobs_BT1.flip(0)) * exp.action_mask_BT1
    per_replica = GLOBAL_BATCH // dp
    mine = exp.slice(dp_rank * per_replica, (dp_rank + 1) * per_replica)
    micro = [mine.select(torch.tensor(rows)).trimmed() for rows in actor.train_batcher.split(mine.attention_mask_BT)]
    # one SFT (ptx) batch, used by every micro-batch: its loss term does not depend on the cut
    from rlhf.data.pretrain import PtxData

    ptx = exp.slice(0, 3)
    stats = actor.train_batch(micro, kl_coef=0.05,
                              ptx=PtxData([(ptx.sequences_BT, ptx.attention_mask_BT)], dp_size=1, dp_rank=0, seed=0))
    share = topology.ring_rank(Role.ACTOR) == 0  # the ranks of a ring report the same loss
    terms = torch.tensor([stats[k] if share else 0.0 for k in ("policy_loss", "entropy", "train_kl", "ptx_loss")],
                         dtype=torch.float64)
    dist.all_reduce(terms)
    weights = dict(actor.model.full_parameters())
    return {"logprobs": current * exp.action_mask_BT1, "policy_loss": float(terms[0]), "entropy": float(terms[1]),
            "kl": float(terms[2]), "ptx": float(terms[3]), "grad_norm": stats["grad_norm"], "weights": weights,
            "micro_sizes": [len(rows) for rows in actor.train_batcher.split(mine.attention_mask_BT)]}


def run_variants(names: list[str], zero_stage: int) -> dict:
    return {name: _one_variant(name, zero_stage) for name in names}


def _assert_same_step(got: dict, ref: dict, what: str) -> None:
    torch.testing.assert_close(got["logprobs"], ref["logprobs"], atol=2e-5, rtol=0, msg=f"{what}: log-probs")
    for key in ("policy_loss", "entropy", "kl", "ptx"):
        assert got[key] == pytest.approx(ref[key], abs=2e-6), f"{what}: {key}"
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), f"{what}: grad norm"
    assert_adam_weights_close(ref["weights"], got["weights"], lr=LR, steps=1, what=what, agree=0.02)


def _hand_terms() -> dict:
    """The step's entropy, KL and ptx terms computed here from a plain (non-DeepSpeed) forward of the initial
    policy, as `_one_variant` builds them: token means over the batch's action tokens of the entropy of
    softmax(logits) and of k3 = exp(-d) - 1 + d (d = log p - log p_ref), and the mean next-token NLL of the ptx
    batch (the first 3 samples, every token)."""
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.models.loading import load_causal_lm

    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa").eval()
    exp = synthetic_experiences(model.config.vocab_size)
    ids, mask, action = exp.sequences_BT, exp.attention_mask_BT, exp.action_mask_BT1
    with torch.no_grad():
        logp_BTV = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
    current = logp_BTV.gather(-1, ids[:, 1:, None])[..., 0]
    entropy = -(logp_BTV.exp() * logp_BTV).sum(-1)
    old = (current + exp.old_logprobs_BT1) * action
    d = current - (current - 0.2 * old.flip(0)) * action
    k3 = torch.exp(-d) - 1 + d
    target = mask[:3, 1:].float()
    nll = -(current[:3] * target).sum() / target.sum()
    return {"entropy": float((entropy * action).sum() / action.sum()), "kl": float((k3 * action).sum() / action.sum()),
            "ptx": float(nll)}


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_on_ranks(1, run_variants, ["padded", "packed", "packed_dynamic"], 2)[0]


def test_single_rank_layouts_match_padded(one_rank):
    ref = one_rank["padded"]
    assert ref["policy_loss"] != 0
    for key, value in _hand_terms().items():  # the terms the step adds to the loss, computed by hand
        assert ref[key] == pytest.approx(value, rel=1e-5), key
    assert one_rank["packed_dynamic"]["micro_sizes"] != ref["micro_sizes"], "the budget must change the cut"
    for name in ("packed", "packed_dynamic"):
        _assert_same_step(one_rank[name], ref, name)


def test_two_ranks_dynamic_and_ring_match_one_rank(one_rank):
    ref = one_rank["padded"]
    two = run_on_ranks(2, run_variants, ["packed_dynamic", "ring", "ring_dynamic"], 2)
    for rank in range(2):
        for name in ("packed_dynamic", "ring", "ring_dynamic"):
            _assert_same_step(two[rank][name], ref, f"{name} rank {rank}")
    # ring_dynamic: one ring (dp 1) holds all 4 samples, cut by a 16-token ring budget
    assert len(two[0]["ring_dynamic"]["micro_sizes"]) > 1


def test_four_ranks_ring_of_two_zero3_matches_one_rank(one_rank):
    four = run_on_ranks(4, run_variants, ["ring", "ring_dynamic"], 3)
    for rank in range(4):
        for name in ("ring", "ring_dynamic"):
            _assert_same_step(four[rank][name], one_rank["padded"], f"{name} rank {rank}")


def _budget_errors():
    import torch.distributed as dist

    from rlhf.models.micro_batches import MicroBatcher

    longest = 6 if dist.get_rank() == 0 else 20  # only rank 1 holds a sample over the budget
    mask = (torch.arange(20)[None] < torch.tensor([5, longest])[:, None]).long()
    try:
        MicroBatcher(2, max_tokens=10, group=dist.group.WORLD).split(mask)
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_sample_over_the_budget_on_one_rank_stops_every_rank():
    # no rank may be left waiting in a collective: both raise, naming the longest sample of the group
    messages = run_on_ranks(2, _budget_errors)
    assert messages == ["--train_max_tokens_per_gpu 10 is below a sample of 20 tokens per rank; raise it to at "
                        "least 20 (prompt + response, / --ring_attn_size)"] * 2
