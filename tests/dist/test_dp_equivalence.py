"""The first optimizer step on 2 ranks equals the same global batch on 1 rank (ZeRO-2 and ZeRO-3):
same token-mean PPO loss and the same updated weights."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from rlhf.assets import EMBEDDED_MODEL_DIR
from tests.distributed import run_variants_on_ranks
from tests.tiny_actor import GLOBAL_BATCH, MICRO, build_actor, synthetic_experiences
from tests.tiny_runs import assert_adam_weights_close


def one_step(zero_stage: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    dp, rank = dist.get_world_size(), dist.get_rank()
    actor = build_actor(zero_stage, 1e-2, GLOBAL_BATCH // (MICRO * dp))
    model = actor.model
    exp = synthetic_experiences(model.module.config.vocab_size)
    current = actor.logprobs(exp.sequences_BT, exp.attention_mask_BT)
    exp.old_logprobs_BT1 = (current + exp.old_logprobs_BT1) * exp.action_mask_BT1
    per_rank = GLOBAL_BATCH // dp
    mine = exp.slice(rank * per_rank, (rank + 1) * per_rank)
    micro = [mine.slice(s, s + MICRO) for s in range(0, per_rank, MICRO)]
    stats = actor.train_batch(micro, kl_coef=0.0)
    loss = torch.tensor([stats["policy_loss"]], dtype=torch.float64)
    dist.all_reduce(loss)
    weights = {name: t for name, t in model.full_parameters()}
    # Adam's first step is nearly invariant to the gradient's scale, so compare the gradient norm too.
    return {"loss": float(loss), "clip_frac": stats["clip_frac"], "grad_norm": stats["grad_norm"],
            "weights": weights}


def one_critic_step(zero_stage: int) -> dict:
    """One critic optimizer step over the synthetic batch, split over however many ranks run it."""
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_REWARD_MODEL_DIR
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.layout import PADDED
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.models.value import load_scalar_head_model
    from rlhf.trainers.critic import Critic

    torch.manual_seed(0)
    dp, rank = dist.get_world_size(), dist.get_rank()
    model = DeepSpeedModel(lambda: load_scalar_head_model(EMBEDDED_REWARD_MODEL_DIR, "score", torch.float32, "sdpa"),
                           EngineConfig(zero_stage=zero_stage),
                           OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"), learning_rate=1e-2,
                           bf16=False, micro_batch_size=MICRO, grad_accum_steps=GLOBAL_BATCH // (MICRO * dp),
                           num_optimizer_steps=1, device=torch.device("cpu"), dp_group=dist.group.WORLD)
    critic = Critic(model, dist.group.WORLD, torch.device("cpu"), value_clip=0.2,
                    infer_batcher=MicroBatcher(16, None, dist.group.WORLD, PADDED),
                    train_batcher=MicroBatcher(MICRO, None, dist.group.WORLD, PADDED))
    exp = synthetic_experiences(model.module.config.vocab_size)
    values = critic.values(exp.sequences_BT, exp.attention_mask_BT)
    g = torch.Generator().manual_seed(11)
    exp.values_BT1 = (values + 0.1 * torch.randn(values.shape, generator=g)) * exp.action_mask_BT1
    exp.returns_BT1 = torch.randn(values.shape, generator=g) * exp.action_mask_BT1
    per_rank = GLOBAL_BATCH // dp
    mine = exp.slice(rank * per_rank, (rank + 1) * per_rank)
    stats = critic.train_batch([mine.slice(s, s + MICRO) for s in range(0, per_rank, MICRO)])
    loss = torch.tensor([stats["value_loss"]], dtype=torch.float64)
    dist.all_reduce(loss)
    return {"loss": float(loss), "grad_norm": stats["critic_grad_norm"],
            "weights": dict(model.full_parameters())}


# (what, ZeRO stage); ZeRO-3 last: its model construction hooks stay installed in the process
VARIANTS = [("critic", 2), ("actor", 2), ("actor", 3)]


@pytest.fixture(scope="module")
def steps() -> dict:
    """Every variant's step on 1 rank and on 2 ranks (one process start per world size)."""
    fns = {"actor": one_step, "critic": one_critic_step}
    variants = [(fns[what], stage) for what, stage in VARIANTS]
    one, two = run_variants_on_ranks(1, variants), run_variants_on_ranks(2, variants)
    return {v: (single[0], double) for v, single, double in zip(VARIANTS, one, two)}


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_match_one_rank(steps, zero_stage):
    single, double = steps["actor", zero_stage]
    assert single["clip_frac"] > 0, "the synthetic batch should exercise clipping"
    assert abs(single["loss"]) > 1e-4
    for r in range(2):
        assert double[r]["loss"] == pytest.approx(single["loss"], abs=1e-6)
        assert double[r]["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    initial = load_file(os.path.join(EMBEDDED_MODEL_DIR, "model.safetensors"))
    moved = max(float((single["weights"][n] - initial[n]).abs().max()) for n in initial)
    assert moved > 1e-3, "the step must change the weights"
    for r in range(2):  # float32 summation order differs between 1 and 2 ranks: AdamW's bound, not a guess
        assert_adam_weights_close(single["weights"], double[r]["weights"], 1e-2, 1, what=f"actor ZeRO-{zero_stage}")


def test_critic_two_ranks_match_one_rank(steps):
    single, double = steps["critic", 2]
    assert abs(single["loss"]) > 1e-4
    for r in range(2):
        assert double[r]["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert double[r]["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    for r in range(2):
        assert_adam_weights_close(single["weights"], double[r]["weights"], 1e-2, 1, what="critic ZeRO-2")
