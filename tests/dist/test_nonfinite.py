"""A non-finite loss never reaches the weights: every rank stops at the same optimizer step with the
same message, or (--max_nonfinite_steps) skips the update and trains on as if it had not happened."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks, run_variants_on_ranks
from tests.tiny_actor import GLOBAL_BATCH, synthetic_experiences

MICRO = 1  # two micro-batches per rank on 2 ranks: the bad term is seen before the accumulation boundary


def _actor(zero_stage: int, max_nonfinite_steps: int):
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.config.ppo_config import AlgoConfig
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.layout import PADDED
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.trainers.actor import Actor

    torch.manual_seed(0)
    model = DeepSpeedModel(lambda: load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa"),
                           EngineConfig(zero_stage=zero_stage),
                           OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant",
                                       max_nonfinite_steps=max_nonfinite_steps),
                           learning_rate=1e-2, bf16=False, micro_batch_size=MICRO,
                           grad_accum_steps=GLOBAL_BATCH // (MICRO * dist.get_world_size()), num_optimizer_steps=4,
                           device=torch.device("cpu"), dp_group=dist.group.WORLD, name="actor")
    return Actor(model, dist.group.WORLD, torch.device("cpu"), temperature=1.0, algo=AlgoConfig(),
                 infer_batcher=MicroBatcher(16, None, dist.group.WORLD, PADDED),
                 train_batcher=MicroBatcher(MICRO, None, dist.group.WORLD, PADDED))


def _micro_batches(actor, poison_rank: int | None):
    """This rank's micro-batches of the synthetic batch; on `poison_rank` one advantage is NaN."""
    import torch.distributed as dist

    exp = synthetic_experiences(actor.model.module.config.vocab_size)
    current = actor.logprobs(exp.sequences_BT, exp.attention_mask_BT)
    exp.old_logprobs_BT1 = (current + exp.old_logprobs_BT1) * exp.action_mask_BT1
    dp, rank = dist.get_world_size(), dist.get_rank()
    per_rank = GLOBAL_BATCH // dp
    if rank == poison_rank:
        row = rank * per_rank
        exp.advantages_BT1[row, int(exp.action_mask_BT1[row].nonzero()[0])] = float("nan")
    mine = exp.slice(rank * per_rank, (rank + 1) * per_rank)
    return [mine.slice(s, s + MICRO) for s in range(0, per_rank, MICRO)]


def _weights(actor) -> dict[str, torch.Tensor]:
    return dict(actor.model.full_parameters())


def nonfinite_steps(zero_stage: int) -> dict:
    from rlhf.engines.deepspeed_engine import NonFiniteError

    out: dict = {}
    # default budget 0: every rank raises the same error and the weights stay as they were
    actor = _actor(zero_stage, 0)
    before = _weights(actor)
    try:
        actor.train_batch(_micro_batches(actor, poison_rank=1), kl_coef=0.0)
    except NonFiniteError as err:
        out["error"] = str(err)
    out["unchanged_after_error"] = all(torch.equal(before[n], w) for n, w in _weights(actor).items())
    # budget 1: the bad step is skipped (counted), then a clean step trains as on a fresh model
    actor = _actor(zero_stage, 1)
    out["skipped_stats"] = actor.train_batch(_micro_batches(actor, poison_rank=1), kl_coef=0.0)
    out["skipped"] = actor.model.nonfinite_skipped
    out["unchanged_after_skip"] = all(torch.equal(before[n], w) for n, w in _weights(actor).items())
    out["clean_stats"] = actor.train_batch(_micro_batches(actor, poison_rank=None), kl_coef=0.0)
    out["after_skip"] = _weights(actor)
    fresh = _actor(zero_stage, 1)
    out["fresh_stats"] = fresh.train_batch(_micro_batches(fresh, poison_rank=None), kl_coef=0.0)
    out["fresh"] = _weights(fresh)
    # a second bad step exceeds the budget of 1
    try:
        actor.train_batch(_micro_batches(actor, poison_rank=0), kl_coef=0.0)
    except NonFiniteError as err:
        out["error_over_budget"] = str(err)
    # a model with a non-finite weight is never saved
    with torch.no_grad():
        for p in actor.model.module.parameters():
            (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).view(-1)[:1] = float("nan")  # ZeRO-3: a shard
            break
    try:
        actor.model.gathered_state_dict(is_writer=True)
    except NonFiniteError as err:
        out["save_error"] = str(err)
    return out


ZERO_STAGES = [0, 2, 3]  # ZeRO-3 last: its model construction hooks stay installed in the process


def test_nonfinite_loss_stops_or_skips_on_every_rank():
    variants = run_variants_on_ranks(2, [(nonfinite_steps, stage) for stage in ZERO_STAGES])
    for zero_stage, r in ((s, r) for s, results in zip(ZERO_STAGES, variants) for r in results):
        assert r["error"].startswith("optimizer step 1: actor policy_loss is nan on rank 1; stopping before the "
                                     "non-finite values reach the weights (--max_nonfinite_steps 0"), \
            (zero_stage, r["error"])
        assert r["unchanged_after_error"], zero_stage
        assert r["skipped"] == 1 and r["skipped_stats"]["nonfinite_skipped"] == 1.0
        assert "policy_loss" not in r["skipped_stats"]
        assert r["unchanged_after_skip"]
        assert r["clean_stats"]["nonfinite_skipped"] == 0.0
        # (ZeRO-0 in fp32 reports no norm: nan on both)
        assert r["clean_stats"]["grad_norm"] == pytest.approx(r["fresh_stats"]["grad_norm"], rel=1e-6, nan_ok=True)
        assert r["clean_stats"]["policy_loss"] == pytest.approx(r["fresh_stats"]["policy_loss"], rel=1e-6)
        for name, w in r["fresh"].items():
            torch.testing.assert_close(r["after_skip"][name], w, msg=name)
        assert r["error_over_budget"].startswith("optimizer step 3: actor policy_loss is nan on rank 0")
        assert "1 used" in r["error_over_budget"]
        assert r["save_error"].startswith("actor weights are non-finite (")
        assert r["save_error"].endswith("refusing to save them")


def critic_nan_step() -> dict:
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_REWARD_MODEL_DIR
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel, NonFiniteError
    from rlhf.models.layout import PADDED
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.models.value import load_scalar_head_model
    from rlhf.trainers.critic import Critic

    model = DeepSpeedModel(lambda: load_scalar_head_model(EMBEDDED_REWARD_MODEL_DIR, "score", torch.float32, "sdpa"),
                           EngineConfig(zero_stage=2), OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"),
                           learning_rate=1e-2, bf16=False, micro_batch_size=2, grad_accum_steps=2,
                           num_optimizer_steps=1, device=torch.device("cpu"), dp_group=dist.group.WORLD,
                           name="critic")
    critic = Critic(model, dist.group.WORLD, torch.device("cpu"), value_clip=0.2,
                    infer_batcher=MicroBatcher(16, None, dist.group.WORLD, PADDED),
                    train_batcher=MicroBatcher(2, None, dist.group.WORLD, PADDED))
    exp = synthetic_experiences(model.module.config.vocab_size)
    exp.values_BT1 = critic.values(exp.sequences_BT, exp.attention_mask_BT) * exp.action_mask_BT1
    exp.returns_BT1 = exp.values_BT1.clone()
    exp.returns_BT1[3, int(exp.action_mask_BT1[3].nonzero()[0])] = float("inf")
    before = dict(model.full_parameters())
    try:
        critic.train_batch([exp.slice(0, 2), exp.slice(2, 4)])
    except NonFiniteError as err:
        return {"error": str(err), "unchanged": all(torch.equal(before[n], w) for n, w in model.full_parameters())}
    return {}


def test_critic_nonfinite_loss_stops_before_the_update():
    (result,) = run_on_ranks(1, critic_nan_step)
    assert result["error"].startswith("optimizer step 1: critic value_loss is inf on rank 0; stopping before")
    assert result["unchanged"]


def nan_gradient_step(zero_stage: int, bf16: bool, offload: bool) -> dict:
    """One optimizer step of 2 micro-batches per rank whose loss is finite everywhere, but rank 1's first
    micro-batch sends a NaN back through the logits: the update must be stopped before it is applied."""
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel, NonFiniteError
    from rlhf.models.loading import load_causal_lm

    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = DeepSpeedModel(lambda: load_causal_lm(EMBEDDED_MODEL_DIR, dtype, "sdpa"),
                           EngineConfig(zero_stage=zero_stage, adam_offload=offload),
                           OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"),
                           learning_rate=1e-2, bf16=bf16, micro_batch_size=1, grad_accum_steps=2,
                           num_optimizer_steps=2, device=torch.device("cpu"), dp_group=dist.group.WORLD,
                           name="actor")
    before = dict(model.full_parameters())
    model.train()
    ids = torch.randint(3, model.module.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    out: dict = {}
    try:
        for i in range(2):
            logits = model.engine(input_ids=ids[i:i + 1], attention_mask=torch.ones_like(ids[i:i + 1])).logits
            if dist.get_rank() == 1 and i == 0:
                logits.register_hook(lambda g: g.index_fill(-1, torch.tensor([5]), float("nan")))
            loss = logits.float().logsumexp(-1).mean()
            assert torch.isfinite(loss)
            model.backward(loss, last_micro_batch=i == 1)
            model.step(None)
    except NonFiniteError as err:
        out["error"] = str(err)
    out["unchanged"] = all(torch.equal(before[n], w) for n, w in model.full_parameters())
    return out


GRADIENT_VARIANTS = [(0, True, False), (1, False, False), (2, True, False), (2, False, True), (3, True, False),
                     (3, False, True)]  # (ZeRO stage, bf16, optimizer offload)


def test_nonfinite_gradient_with_finite_loss_stops_before_the_update():
    variants = run_variants_on_ranks(2, [(nan_gradient_step, *v) for v in GRADIENT_VARIANTS])
    for variant, r in ((v, r) for v, results in zip(GRADIENT_VARIANTS, variants) for r in results):
        assert r["error"].startswith("optimizer step 1: actor gradient is non-finite (every loss term was finite; "
                                     "checked after the reduction over the 2 ranks, before the update); stopping "
                                     "before the non-finite values reach the weights"), (variant, r)
        assert r["unchanged"], variant
