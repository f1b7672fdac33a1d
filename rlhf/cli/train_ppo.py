"""Entry point of RL training: `torchrun ... -m rlhf.cli.train_ppo --pretrain ... ` (or srun).

Parses OpenRLHF-style flags into the typed config, validates inputs before any engine starts, builds
the topology, the roles, the rollout engine and the reward source, and runs the trainer.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings

import torch
import torch.distributed as dist

from rlhf.config.flags import parse_config
from rlhf.config.schema import TrainPPOConfig
from rlhf.data.prompts import PromptSampler, load_prompts
from rlhf.distributed.launch import init_distributed, read_launch_env
from rlhf.distributed.topology import Role, Topology, plan_ranks
from rlhf.models.loading import check_liger_kernel, load_tokenizer
from rlhf.models.value import save_scalar_head_model
from rlhf.rewards.base import RewardSource
from rlhf.trainers.build import (
    ROLE_NAMES,
    build_roles,
    check_ring_head_stride,
    describe_layout,
    placement_from_config,
)
from rlhf.trainers.ppo import PPOTrainer, Roles, total_steps
from rlhf.utils.logging import MetricsLogger, WandbSettings
from rlhf.utils.preemption import PreemptionWatch
from rlhf.utils.seeding import seed_everything


def build_rollout_engine(cfg: TrainPPOConfig, device: torch.device, tokenizer):
    """vLLM in-process when installed (or asked for), else the HF-generate fallback with a warning."""
    from rlhf.engines.vllm_engine import VLLMEngine, vllm_available

    r, m = cfg.rollout, cfg.model
    dtype = torch.bfloat16 if m.bf16 else torch.float32
    use_vllm = r.rollout_engine == "vllm" or (r.rollout_engine == "auto" and vllm_available())
    if use_vllm:
        return VLLMEngine(m.pretrain, dtype=dtype, tp_size=r.vllm_tensor_parallel_size, seed=cfg.seed,
                          max_model_len=cfg.data.prompt_max_len + r.generate_max_len,
                          kv_cache_bytes=r.vllm_kv_cache_bytes, gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                          enforce_eager=r.enforce_eager, enable_prefix_caching=r.enable_prefix_caching,
                          enable_sleep=r.vllm_enable_sleep, trust_remote_code=m.trust_remote_code)
    if r.rollout_engine == "auto":
        warnings.warn("vLLM is not installed: generating with transformers (slower); install the cpu or gpu "
                      "extra for vLLM", stacklevel=2)
    if r.vllm_tensor_parallel_size > 1:
        raise ValueError("--vllm_tensor_parallel_size > 1 needs vLLM; the HF fallback engine runs one rank each")
    from rlhf.engines.hf_engine import HFGenerateEngine

    return HFGenerateEngine(m.pretrain, dtype=dtype, device=device, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, attn_implementation=m.attn,
                            trust_remote_code=m.trust_remote_code)


def build_reward_source(cfg: TrainPPOConfig) -> RewardSource | None:
    """The reward_func file or HTTP client (reward models are built per rank with the roles)."""
    source = cfg.reward.source
    if not source:
        return None
    if source.startswith(("http://", "https://")):
        from rlhf.rewards.remote import RemoteRewardClient

        return RemoteRewardClient(source, cfg.reward.remote_rm_timeout, cfg.reward.remote_rm_retries)
    from rlhf.rewards.reward_func import RewardFuncFile

    return RewardFuncFile(source)


def save_models(cfg: TrainPPOConfig, roles: Roles, topology: Topology, tokenizer) -> None:
    """Final HF-format models under --save_path: the actor (with tokenizer) and the critic."""
    out = cfg.logging.save_path
    if roles.actor is not None:
        roles.actor.model.save_hf(os.path.join(out, "model"), tokenizer, topology.leads(Role.ACTOR))
    if roles.critic is not None:
        state = dict(roles.critic.model.full_parameters())
        if topology.leads(Role.CRITIC):
            module = roles.critic.model.module
            save_scalar_head_model(state, module.config, module.head_prefix, os.path.join(out, "critic"), tokenizer)


def run(cfg: TrainPPOConfig) -> None:
    launch = read_launch_env()
    cfg.check_world(launch.world_size)
    plan = plan_ranks(placement_from_config(cfg), launch.world_size)
    cfg.check_role_sizes({ROLE_NAMES[r]: len(ranks) for r, ranks in plan.items() if r is not Role.ROLLOUT},
                         trainable=("actor", "critic"))
    # Validate the user's inputs before any engine starts (engines take minutes on real models).
    if cfg.engine.use_liger_kernel:
        check_liger_kernel()
    check_ring_head_stride(cfg)
    reward_source = build_reward_source(cfg)
    tokenizer = load_tokenizer(cfg.model.pretrain, cfg.model.trust_remote_code)
    sampler = PromptSampler(load_prompts(cfg.data, tokenizer), cfg.batch.rollout_batch_size, cfg.seed)
    device = init_distributed(launch)
    preemption = PreemptionWatch()  # from here on SIGTERM/SIGUSR1 mean "checkpoint and stop"
    topology = Topology(plan, rollout_tp=cfg.rollout.vllm_tensor_parallel_size, ring_size=cfg.engine.ring_attn_size)
    is_writer = launch.rank == 0
    if is_writer and cfg.model.pretrain == TrainPPOConfig().model.pretrain:
        print("no --pretrain given: training the embedded tiny demo policy", flush=True)
    if is_writer:
        print(describe_layout(cfg, topology), flush=True)
    engine = build_rollout_engine(cfg, device, tokenizer)
    seed_everything(cfg.seed + launch.rank, cfg.full_determinism)  # vLLM re-seeds globally
    steps = total_steps(cfg, sampler)
    roles = build_roles(cfg, topology, device, steps, reward_source, tokenizer)
    log = cfg.logging
    wandb = WandbSettings(log.use_wandb, log.wandb_project, log.wandb_group, log.wandb_run_name,
                          dataclasses.asdict(cfg)) if log.use_wandb else None
    logger = MetricsLogger(log.save_path, log.use_tensorboard, steps, enabled=is_writer, wandb=wandb)
    trainer = PPOTrainer(cfg, topology, roles, engine, sampler, tokenizer, logger, device)
    start = trainer.resume()
    logger.skip(start)
    trainer.sync_weights()
    try:
        if trainer.fit(start, preemption):
            save_models(cfg, roles, topology, tokenizer)
    finally:
        logger.close()
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    try:
        run(parse_config(TrainPPOConfig, argv, prog="python -m rlhf.cli.train_ppo"))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
