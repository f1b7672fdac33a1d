"""Entry point of RL training: `torchrun ... -m rlhf.cli.train_ppo --pretrain ... ` (or srun).

Parses OpenRLHF-style flags into the typed config, validates inputs before any engine starts, builds
the topology, the roles, the rollout engine and the reward source, and runs the trainer.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import urllib.parse
import warnings

import torch
import torch.distributed as dist

from rlhf.config.errors import UsageError, usage_errors_exit
from rlhf.config.flags import parse_config
from rlhf.config.ppo import TrainPPOConfig
from rlhf.data.prompts import PromptSampler, load_prompts
from rlhf.distributed.launch import init_distributed, read_launch_env
from rlhf.distributed.topology import Role, Topology, plan_ranks
from rlhf.models.loading import check_liger_kernel, check_local_model, load_tokenizer, resolve_attention
from rlhf.models.value import check_scalar_head, save_scalar_head_model
from rlhf.rewards.base import RewardSource
from rlhf.train.checkpoint import Checkpointer, restarted_by_launcher
from rlhf.train.loop import Loop
from rlhf.trainers.build import (
    ROLE_NAMES,
    build_roles,
    check_model_lengths,
    check_ring_head_stride,
    describe_algorithm,
    describe_layout,
    placement_from_config,
)
from rlhf.trainers.ppo import PPOTrainer, Roles, total_steps
from rlhf.utils.checkpoint import check_resume_path
from rlhf.utils.console import route_library_output
from rlhf.utils.logging import MetricsLogger, WandbSettings, check_no_earlier_run
from rlhf.utils.preemption import PreemptionWatch
from rlhf.utils.seeding import seed_everything
from rlhf.utils.watchdog import Watchdog


def build_rollout_engine(cfg: TrainPPOConfig, device: torch.device, tokenizer):
    """vLLM in-process when installed (or asked for), else the HF-generate fallback with a warning."""
    from rlhf.engines.vllm_engine import VLLMEngine, vllm_available

    r, m = cfg.rollout, cfg.model
    dtype = m.dtype
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

    return RewardFuncFile(source, cfg.reward.reward_func_timeout)


def save_models(cfg: TrainPPOConfig, roles: Roles, topology: Topology, tokenizer) -> None:
    """Final HF-format models under --save_path: the actor (with tokenizer) and the critic."""
    out = cfg.logging.save_path
    if roles.actor is not None:
        roles.actor.model.save_hf(os.path.join(out, "model"), tokenizer, topology.leads(Role.ACTOR))
    if roles.critic is not None:
        is_writer = topology.leads(Role.CRITIC)
        state = roles.critic.model.gathered_state_dict(is_writer)
        if is_writer:
            module = roles.critic.model.module
            save_scalar_head_model(state, module.config, module.head_prefix, os.path.join(out, "critic"), tokenizer)


def for_this_machine(cfg: TrainPPOConfig) -> TrainPPOConfig:
    """The config with what this machine decides: fp16 needs CUDA (DeepSpeed's loss scaling);
    flash_attention_2 without CUDA and flash-attn runs SDPA, with a warning."""
    m = cfg.model
    if m.param_dtype == "fp16" and not torch.cuda.is_available():
        raise UsageError("--param_dtype fp16 needs CUDA (DeepSpeed's fp16 loss scaling); on CPU pass "
                         "--param_dtype bf16 or --param_dtype fp32")
    flag = "--flash_attn" if m.flash_attn else f"--attn_implementation {m.attn_implementation}"
    if m.attn == "flash_attention_2" and m.attn_implementation == "flash_attention_2" and not m.flash_attn:
        flag += " (the default)"
    attn = resolve_attention(m.attn, flag)
    if attn == m.attn:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(m, attn_implementation=attn, flash_attn=False))


def check_before_engines(cfg: TrainPPOConfig, world_size: int) -> dict[Role, tuple[int, ...]]:
    """The checks of flags and model files that need no engine (engines take minutes on real models), and
    the rank plan they validate. Reading the data and the reward file follows in `run`, also before."""
    cfg.check_world(world_size)
    plan = plan_ranks(placement_from_config(cfg), world_size)
    cfg.check_role_sizes({ROLE_NAMES[r]: len(ranks) for r, ranks in plan.items() if r is not Role.ROLLOUT},
                         trainable=("actor", "critic"))
    if cfg.engine.use_liger_kernel:
        check_liger_kernel()
    check_ring_head_stride(cfg)
    check_model_lengths(cfg)
    for path in cfg.reward.reward_paths:  # a reward model with a random head trains against noise
        check_local_model(path, "--reward_pretrain")
        check_scalar_head(path, cfg.model.value_head_prefix, "--reward_pretrain")
    check_writable("--save_path", cfg.logging.save_path)
    restarted = restarted_by_launcher()
    c = cfg.checkpoint
    if c.load_checkpoint:
        check_resume_path(c.ckpt_path, explicit_path=c.ckpt_path != TrainPPOConfig().checkpoint.ckpt_path,
                          restarted=restarted)
    elif not restarted:
        check_no_earlier_run(cfg.logging.save_path)
    if cfg.checkpoint.save_steps != -1:
        check_writable("--ckpt_path", cfg.checkpoint.ckpt_path)
    if cfg.reward.source.startswith(("http://", "https://")):
        check_reachable("--remote_rm_url", cfg.reward.source, min(cfg.reward.remote_rm_timeout, 5.0))
    return plan


def check_writable(flag: str, path: str) -> None:
    """Write a temporary file in directory `path` (or, while it does not exist, a temporary directory in its
    nearest existing parent, so a failed run leaves nothing behind): an unwritable output fails now, not
    after the first training step. Every rank calls it (a node may lack the mount)."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, f"{existing} is not a directory")
        if existing == os.path.abspath(path):
            with tempfile.NamedTemporaryFile(dir=existing, prefix=".write_test"):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".write_test"))
    except OSError as err:
        raise UsageError(f"{flag} {path} is not writable ({err.strerror or err}); choose a directory this "
                         "user can write") from err


def check_reachable(flag: str, url: str, timeout_s: float) -> None:
    """One TCP connection to the host and port of an http(s) `url` (no request is sent, so the server
    scores nothing); an unreachable server is a usage error now, before the engines start."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as err:
        raise UsageError(f"{flag} {url}: bad port ({err})") from err
    if not parts.hostname:
        raise UsageError(f"{flag} {url}: no host in the URL; give e.g. http://host:5000/get_reward")
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        raise UsageError(f"{flag} {url}: cannot connect to {parts.hostname}:{port} within {timeout_s:g}s "
                         f"({err.strerror or err}); start the reward server first or fix the URL") from err


def run(cfg: TrainPPOConfig, parse_warnings: list[warnings.WarningMessage] = ()) -> None:
    """Train. `parse_warnings`: warnings raised while the flags were parsed, shown now that the console
    routing is in place (rank 0 shows ours; library ones are collected)."""
    launch = read_launch_env()
    route_library_output(cfg.logging, launch.rank)  # library warnings: once on the console, all in a file
    # From here on SIGTERM/SIGUSR1 mean "checkpoint at the first step boundary and stop" (one during setup
    # is remembered, not fatal).
    preemption = PreemptionWatch()
    for w in parse_warnings:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    demo = cfg.model.pretrain is None
    cfg = for_this_machine(cfg.with_demo_defaults())
    plan = check_before_engines(cfg, launch.world_size)
    reward_source = build_reward_source(cfg)
    tokenizer = load_tokenizer(cfg.model.pretrain, cfg.model.trust_remote_code)
    sampler = PromptSampler(load_prompts(cfg.data, tokenizer), cfg.batch.rollout_batch_size, cfg.seed)
    device = init_distributed(launch, cfg.dist_timeout)
    Watchdog(launch.rank, cfg.watchdog_interval).start()  # prints where this rank is stuck, if it is
    topology = Topology(plan, rollout_tp=cfg.rollout.vllm_tensor_parallel_size, ring_size=cfg.engine.ring_attn_size)
    is_writer = launch.rank == 0
    if is_writer and demo:
        print("no --pretrain given: training the embedded tiny demo policy", flush=True)
    if is_writer:
        print(describe_algorithm(cfg, topology), flush=True)
        print(describe_layout(cfg, topology), flush=True)
    engine = build_rollout_engine(cfg, device, tokenizer)
    seed_everything(cfg.seed + launch.rank, cfg.full_determinism)  # vLLM re-seeds globally
    steps = total_steps(cfg, sampler)
    roles = build_roles(cfg, topology, device, steps, reward_source, tokenizer)
    log = cfg.logging
    wandb = WandbSettings(log.use_wandb, log.wandb_project, log.wandb_group, log.wandb_run_name,
                          dataclasses.asdict(cfg)) if log.use_wandb else None
    logger = MetricsLogger(log.save_path, log.use_tensorboard, steps, enabled=is_writer, wandb=wandb)
    trainer = PPOTrainer(cfg, topology, roles, engine, sampler, tokenizer, device)
    checkpointer = Checkpointer(cfg.checkpoint, default_ckpt_path=TrainPPOConfig().checkpoint.ckpt_path,
                                rank=launch.rank, world_size=launch.world_size, logger=logger)
    loop = Loop(steps, log.logging_steps, cfg.checkpoint.save_steps, None, logger, checkpointer, launch.rank)
    start = loop.resume(trainer)
    trainer.sync_weights()
    try:
        if loop.fit(trainer, start, preemption):
            save_models(cfg, roles, topology, tokenizer)
    finally:
        logger.close()
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    """Flag and input mistakes exit 2 with one `error:` line from rank 0 (see `rlhf.config.errors`);
    failures after torch.distributed is initialised keep their traceback."""
    with usage_errors_exit(started=dist.is_initialized):
        with warnings.catch_warnings(record=True) as parse_warnings:
            warnings.simplefilter("default")
            cfg = parse_config(TrainPPOConfig, argv, prog="python -m rlhf.cli.train_ppo")
        run(cfg, parse_warnings)


if __name__ == "__main__":
    main()
