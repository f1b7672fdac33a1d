"""PPO's run (`PPORun`, the core run's parts of RL training, and `run`): validates inputs before any engine starts,
builds the topology, the roles, the rollout engine and the reward source, and runs the trainer. Its entry point is
`rlhf.cli.train_ppo`; RePULSe's run (`rlhf.cli.train_repulse`) is built on it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import urllib.parse
import warnings
from collections.abc import Sequence

import torch

from rlhf.agents import load_agent
from rlhf.config.errors import UsageError
from rlhf.config.ppo_config import (
    DEMO_LENGTHS,
    DEMO_ROLLOUT_BATCH,
    AgentConfig,
    PPOModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainPPOConfig,
)
from rlhf.core.run import Assembled, JobParts, Started, run_job
from rlhf.data.prompts import Prompt, PromptSampler, load_prompts
from rlhf.distributed.launch_env import LaunchEnv
from rlhf.distributed.topology import Role, Topology, plan_ranks
from rlhf.engines.rollout import NO_VLLM, rollout_engine_choice
from rlhf.models.loading import check_liger_kernel, check_local_model, load_tokenizer
from rlhf.models.value import check_scalar_head, save_scalar_head_model
from rlhf.rewards.base import RewardSource
from rlhf.rewards.remote import MAX_BACKOFF_S, retry_sleeps_s
from rlhf.trainers.async_ppo_trainer import AsyncPPOTrainer
from rlhf.trainers.ppo_build import (
    build_roles,
    check_models,
    describe_algorithm,
    describe_layout,
    placement_from_config,
)
from rlhf.trainers.ppo_trainer import PPOTrainer, Roles, total_steps
from rlhf.trainers.prompt_eval import PromptEvaluator, prompt_unit
from rlhf.utils.seeding import seed_everything


def build_rollout_engine(rollout: RolloutConfig, model: PPOModelConfig, device: torch.device, tokenizer, *, seed: int,
                         max_model_len: int, sequences_per_call: int = 0):
    """vLLM in-process or transformers' generate, as `rollout_engine_choice` says (a warning where vLLM is
    missing and nothing chose). max_model_len: `TrainPPOConfig.max_model_len`; sequences_per_call: the samples one
    engine generates per step (0: unknown; sizes the KV-cache check on CPU)."""
    from rlhf.engines.vllm_engine import VLLMEngine

    r, m = rollout, model
    kind, why = rollout_engine_choice(r)
    if kind == "vllm":
        return VLLMEngine(m.pretrain, dtype=m.dtype, tp_size=r.vllm_tensor_parallel_size, seed=seed,
                          max_model_len=max_model_len,
                          kv_cache_bytes=r.vllm_kv_cache_bytes, gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                          enforce_eager=r.enforce_eager, enable_prefix_caching=r.enable_prefix_caching,
                          enable_sleep=r.vllm_enable_sleep, trust_remote_code=m.trust_remote_code,
                          sequences_per_call=sequences_per_call)
    if why == NO_VLLM:
        warnings.warn("vLLM is not installed: generating with transformers (slower); install the cpu or gpu "
                      "extra for vLLM", stacklevel=2)
    if r.vllm_tensor_parallel_size > 1:
        raise ValueError("--vllm_tensor_parallel_size > 1 needs vLLM; the HF fallback engine runs one rank each")
    from rlhf.engines.hf_engine import HFGenerateEngine, stop_token_ids

    return HFGenerateEngine(m.pretrain, dtype=m.dtype, device=device,
                            eos_token_id=stop_token_ids(m.pretrain, tokenizer),
                            pad_token_id=tokenizer.pad_token_id, attn_implementation=m.attn,
                            trust_remote_code=m.trust_remote_code)


def build_reward_source(reward: RewardConfig, agent: AgentConfig) -> RewardSource | None:
    """The reward_func file or HTTP client (reward models are built per rank with the roles), or the agent's
    rewards."""
    if agent.agent_func_path:
        from rlhf.agents import AgentRewards

        return AgentRewards()
    source = reward.source
    if not source:
        return None
    if source.startswith(("http://", "https://")):
        from rlhf.rewards.remote import RemoteRewardClient

        return RemoteRewardClient(source, reward.remote_rm_timeout, reward.remote_rm_retries)
    from rlhf.rewards.reward_func import RewardFuncFile

    return RewardFuncFile(source, reward.reward_func_timeout)


def save_models(save_path: str, roles: Roles, topology: Topology, tokenizer) -> None:
    """Final HF-format models under --save_path: the actor (with tokenizer) and the critic. With --lora_rank
    each is its adapter (with the critic's value head), as OpenRLHF saves it; `rlhf.cli.lora_combiner` merges
    one into its base (--is_rm for the critic)."""
    if roles.actor is not None:
        roles.actor.model.save_hf(os.path.join(save_path, "model"), tokenizer, topology.leads(Role.ACTOR))
    if roles.critic is not None and roles.critic.model.adapted:
        roles.critic.model.save_hf(os.path.join(save_path, "critic"), tokenizer, topology.leads(Role.CRITIC))
    elif roles.critic is not None:
        is_writer = topology.leads(Role.CRITIC)
        state = roles.critic.model.gathered_state_dict(is_writer)
        if is_writer:
            module = roles.critic.model.module
            save_scalar_head_model(state, module.config, module.head_prefix, os.path.join(save_path, "critic"),
                                   tokenizer)


def check_before_engines(cfg: TrainPPOConfig, world_size: int) -> dict[Role, tuple[int, ...]]:
    """The checks of flags and model files that need no engine (engines take minutes on real models), and
    the rank plan they validate (with the policy's trained copies a job adds, `Schedule.policy_copies`).
    Reading the data and the reward file follows in `PPORun.prepare`, also before."""
    cfg.check_world(world_size)
    plan = plan_ranks(placement_from_config(cfg), world_size)
    cfg.check_role_sizes({r.value: len(ranks) for r, ranks in plan.items() if r is not Role.ROLLOUT},
                         trainable=("actor", "critic", *cfg.schedule.policy_copies))
    if cfg.engine.use_liger_kernel:
        check_liger_kernel()
    check_models(cfg)
    for path in cfg.reward.reward_paths:  # a reward model with a random head trains against noise
        check_local_model(path, "--reward_pretrain")
        check_scalar_head(path, cfg.model.value_head_prefix, "--reward_pretrain")
    if cfg.reward.source.startswith(("http://", "https://")):
        check_reachable("--remote_rm_url", cfg.reward.source, min(cfg.reward.remote_rm_timeout, 5.0))
        warn_if_retries_outlast(cfg.reward, cfg.dist_timeout)
    return plan


def warn_if_retries_outlast(reward: RewardConfig, dist_timeout_min: float) -> None:
    """A warning where the reward client's sleeps between its tries alone (a server that is down refuses each try at
    once) outlast --dist_timeout: the ranks that wait for this one in the next collective would time out first, and
    the run would fail while the client still retries."""
    sleeps = retry_sleeps_s(reward.remote_rm_retries)
    if sleeps > dist_timeout_min * 60:
        warnings.warn(f"--remote_rm_retries {reward.remote_rm_retries}: the reward client sleeps {sleeps:g} s in all "
                      f"between its tries (at most {MAX_BACKOFF_S:g} s each), longer than --dist_timeout "
                      f"{dist_timeout_min:g} min: the other ranks would time out first while a rank still retries; "
                      "raise --dist_timeout or lower --remote_rm_retries", stacklevel=2)


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


class PPORun(JobParts):
    """The core run's parts of RL training: the checks and inputs, the rank plan, the rollout engine, the roles
    and the trainer. A job built on PPO's run (RePULSe) returns its own `Schedule` from its config root and
    overrides the hooks `train_prompts`, `eval_prompts`, `algorithm_line`, `evaluators`, `make_trainer` and
    `save`."""

    name, bar = "rl", {"reward": "reward_mean"}
    summary = ("kl", "response_length", "policy_loss", "value_loss")
    summary_prefixes = ("reward_extra/",)
    demo_line = ("no --pretrain given: training the embedded tiny demo policy (--prompt_max_len "
                 f"{DEMO_LENGTHS['prompt_max_len']} --generate_max_len {DEMO_LENGTHS['generate_max_len']}, and "
                 f"--rollout_batch_size {DEMO_ROLLOUT_BATCH} on its 512 prompts, unless given)")

    def train_prompts(self, cfg: TrainPPOConfig, tokenizer) -> list[Prompt]:
        return load_prompts(cfg.data, tokenizer, seed=cfg.seed)

    def eval_prompts(self, cfg: TrainPPOConfig, tokenizer) -> dict[str, list[Prompt]]:
        """The evaluations' prompts, read before any engine starts: "eval" (--eval_dataset), where given."""
        if cfg.data.eval_dataset is None:
            return {}
        return {"eval": load_prompts(dataclasses.replace(cfg.data, prompt_data=cfg.data.eval_dataset,
                                                         prompt_data_probs=None, prompt_split=cfg.data.eval_split,
                                                         max_samples=cfg.data.eval_max_samples), tokenizer,
                                     "--eval_dataset")}

    def prepare(self, cfg: TrainPPOConfig, launch: LaunchEnv) -> dict[Role, tuple[int, ...]]:
        plan = check_before_engines(cfg, launch.world_size)
        self.reward_source = build_reward_source(cfg.reward, cfg.agent)
        self.agent = load_agent(cfg.agent.agent_func_path) if cfg.agent.agent_func_path else None
        self.tokenizer = load_tokenizer(cfg.model.pretrain, cfg.model.trust_remote_code,
                                        use_fast=not cfg.model.disable_fast_tokenizer)
        self.sampler = PromptSampler(self.train_prompts(cfg, self.tokenizer), cfg.batch.rollout_batch_size, cfg.seed)
        self.prompts_for_eval = self.eval_prompts(cfg, self.tokenizer)
        return plan

    def topology(self, cfg: TrainPPOConfig, plan: dict[Role, tuple[int, ...]]) -> Topology:
        return Topology(plan, rollout_tp=cfg.rollout.vllm_tensor_parallel_size, ring_size=cfg.engine.ring_attn_size,
                        hpz_size=cfg.engine.hpz_size, tp_size=cfg.engine.ds_tensor_parallel_size)

    def algorithm_line(self, run: Started) -> str:
        return describe_algorithm(run.cfg, run.topology)

    def describe(self, run: Started) -> list[str]:
        return [self.algorithm_line(run), describe_layout(run.cfg, run.topology, run.device)]

    def evaluators(self, run: Started, roles: Roles, steps: int) -> list:
        """PPO's evaluation: --eval_dataset every --eval_steps (-1: before the first step and after the last)."""
        if "eval" not in self.prompts_for_eval:
            return []
        cfg = run.cfg
        every = cfg.logging.eval_steps if cfg.logging.eval_steps > 0 else steps
        return [PromptEvaluator(cfg.rollout, self.prompts_for_eval["eval"], prompt_unit(run.topology), every,
                                f"--eval_dataset {cfg.data.eval_dataset}")]

    def make_trainer(self, run: Started, roles: Roles, engine, steps: int) -> PPOTrainer:
        cfg = run.cfg
        trainer_cls = AsyncPPOTrainer if cfg.rollout.async_train else PPOTrainer
        return trainer_cls(cfg, run.topology, roles, engine, self.sampler, self.tokenizer, run.device,
                           evaluators=self.evaluators(run, roles, steps), agent=self.agent)

    def save(self, run: Started, roles: Roles) -> None:
        save_models(run.cfg.logging.save_path, roles, run.topology, self.tokenizer)

    def build(self, run: Started) -> Assembled:
        cfg, topology, device = run.cfg, run.topology, run.device
        per_engine = -(-cfg.batch.rollout_batch_size // topology.num_engines) * cfg.schedule.samples_per_prompt
        engine = build_rollout_engine(cfg.rollout, cfg.model, device, self.tokenizer, seed=cfg.seed,
                                      max_model_len=cfg.max_model_len, sequences_per_call=per_engine)
        seed_everything(cfg.seed + run.launch.rank, cfg.full_determinism)  # again: vLLM re-seeds globally
        steps = total_steps(cfg.schedule, cfg.batch, self.sampler)
        roles = build_roles(cfg, topology, device, steps, self.reward_source, self.tokenizer)
        trainer = self.make_trainer(run, roles, engine, steps)
        periods = [e.period for e in trainer.evaluators]
        return Assembled(trainer, steps, math.gcd(*periods) if periods else None, cfg.schedule.save_steps,
                         save=lambda: self.save(run, roles), after_resume=trainer.sync_weights)


def run(cfg: TrainPPOConfig, parse_warnings: Sequence[warnings.WarningMessage] = ()) -> None:
    """Train. `parse_warnings`: warnings raised while the flags were parsed, shown now that the console
    routing is in place (rank 0 shows ours; library ones are collected)."""
    run_job(PPORun(), cfg, parse_warnings)
