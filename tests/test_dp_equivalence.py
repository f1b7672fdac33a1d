"""The first optimizer step on 2 ranks equals the same global batch on 1 rank (ZeRO-2 and ZeRO-3):
same token-mean PPO loss and the same updated weights."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from rlhf.assets import EMBEDDED_MODEL_DIR
from tests.distributed import run_on_ranks

GLOBAL_BATCH = 4
MICRO = 2


def synthetic_experiences(vocab: int):
    """Four samples of different lengths (so token-level aggregation matters), with advantages of
    both signs and old log-probs offset from the current ones (so some ratios are clipped)."""
    from rlhf.data.records import Experience

    g = torch.Generator().manual_seed(7)
    prompt_lens, response_lens = [3, 5, 2, 4], [6, 2, 9, 4]
    T = max(p + r for p, r in zip(prompt_lens, response_lens))
    seq = torch.zeros(GLOBAL_BATCH, T, dtype=torch.long)
    attn = torch.zeros(GLOBAL_BATCH, T, dtype=torch.long)
    action = torch.zeros(GLOBAL_BATCH, T - 1)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        seq[b, : p + r] = torch.randint(4, vocab, (p + r,), generator=g)
        attn[b, : p + r] = 1
        action[b, p - 1: p - 1 + r] = 1
    adv = torch.randn(GLOBAL_BATCH, T - 1, generator=g) * action
    old_offset = 0.3 * torch.randn(GLOBAL_BATCH, T - 1, generator=g)
    return Experience(seq, attn, action, old_offset, torch.zeros_like(old_offset), adv, torch.zeros(GLOBAL_BATCH))


def build_actor(zero_stage: int, lr: float, grad_accum_steps: int, layout=None, max_tokens: int | None = None,
                algo=None):
    """A DeepSpeed actor on the embedded tiny policy over the whole world (`layout`: padded by default;
    `max_tokens`: dynamic batching with that per-rank budget)."""
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.config.common import EngineConfig, OptimConfig
    from rlhf.config.ppo import AlgoConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.layout import PADDED
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.trainers.actor import Actor

    layout = layout or PADDED
    model = DeepSpeedModel(lambda: load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32,
                                                  layout.attn_implementation("sdpa")),
                           EngineConfig(zero_stage=zero_stage),
                           OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"), learning_rate=lr, bf16=False,
                           micro_batch_size=MICRO, grad_accum_steps=grad_accum_steps, num_optimizer_steps=1,
                           device=torch.device("cpu"), dp_group=dist.group.WORLD)
    infer = MicroBatcher(16, max_tokens, dist.group.WORLD, layout, "--rollout_max_tokens_per_gpu")
    train = MicroBatcher(MICRO, max_tokens, dist.group.WORLD, layout)
    return Actor(model, dist.group.WORLD, torch.device("cpu"), temperature=1.0, algo=algo or AlgoConfig(),
                 infer_batcher=infer, train_batcher=train)


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


@pytest.mark.parametrize("zero_stage", [2, pytest.param(3, marks=pytest.mark.long)])
def test_two_ranks_match_one_rank(zero_stage):
    single = run_on_ranks(1, one_step, zero_stage)[0]
    double = run_on_ranks(2, one_step, zero_stage)
    assert single["clip_frac"] > 0, "the synthetic batch should exercise clipping"
    assert abs(single["loss"]) > 1e-4
    for r in range(2):
        assert double[r]["loss"] == pytest.approx(single["loss"], abs=1e-6)
        assert double[r]["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    initial = load_file(os.path.join(EMBEDDED_MODEL_DIR, "model.safetensors"))
    moved = max(float((single["weights"][n] - initial[n]).abs().max()) for n in initial)
    assert moved > 1e-3, "the step must change the weights"
    for name, w in single["weights"].items():
        for r in range(2):
            torch.testing.assert_close(double[r]["weights"][name], w, atol=2e-6, rtol=1e-5, msg=name)


def one_critic_step(zero_stage: int) -> dict:
    """One critic optimizer step over the synthetic batch, split over however many ranks run it."""
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_REWARD_MODEL_DIR
    from rlhf.config.common import EngineConfig, OptimConfig
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


@pytest.mark.parametrize("zero_stage", [2])
def test_critic_two_ranks_match_one_rank(zero_stage):
    single = run_on_ranks(1, one_critic_step, zero_stage)[0]
    double = run_on_ranks(2, one_critic_step, zero_stage)
    assert abs(single["loss"]) > 1e-4
    for r in range(2):
        assert double[r]["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert double[r]["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    for name, w in single["weights"].items():
        for r in range(2):
            torch.testing.assert_close(double[r]["weights"][name], w, atol=2e-6, rtol=1e-5, msg=name)
