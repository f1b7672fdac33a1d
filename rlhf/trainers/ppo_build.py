"""Building `train_ppo`'s pieces from the config: placement, topology, role engines, rewards, engines.

Every function is called on every rank in the same order; ranks that do not host a role skip its
construction (DeepSpeed engines are built only over their role's group).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from rlhf.config.ppo_config import (
    AlgoConfig,
    BatchConfig,
    DataConfig,
    PPOEngineConfig,
    PPOModelConfig,
    PPOOptimConfig,
    RewardConfig,
    RolloutConfig,
    Schedule,
    TrainPPOConfig,
)
from rlhf.core.role_models import check_model_configs, micro_batcher, model_builder, role_model
from rlhf.data.pretrain import PtxData, tokenize_texts
from rlhf.data.prompts import load_texts
from rlhf.distributed.topology import Placement, Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel, check_sleep_supported
from rlhf.engines.rollout import rollout_engine_choice
from rlhf.engines.weight_sync import meta_param_specs
from rlhf.kernels.ring_attention import block_kernel_for
from rlhf.kernels.varlen_attention import varlen_backend_for
from rlhf.models.layout import SequenceLayout
from rlhf.models.loading import load_causal_lm, with_router_aux_loss
from rlhf.models.micro_batches import MicroBatcher
from rlhf.models.value import load_scalar_head_model, stored_reward_norm
from rlhf.rewards.base import RewardSource
from rlhf.rewards.models import RewardModelEnsemble
from rlhf.trainers.actor import Actor
from rlhf.trainers.critic import Critic
from rlhf.trainers.experience import ExperienceMaker, actor_forward_skippable
from rlhf.trainers.ppo_trainer import Roles


def policy_copies(schedule: Schedule) -> tuple[Role, ...]:
    """The trained copies of the policy a job adds beside PPO's roles (`Schedule.policy_copies`: RePULSe's
    proposal)."""
    return tuple(Role.define(name) for name in schedule.policy_copies)


def roles_needed(schedule: Schedule, algo: AlgoConfig) -> tuple[Role, ...]:
    roles = [Role.ACTOR, Role.REWARD]
    if schedule.uses_critic:
        roles.append(Role.CRITIC)
    if algo.needs_ref:
        roles.append(Role.REF)
    return (*roles, *policy_copies(schedule))


def placement_from_config(cfg: TrainPPOConfig) -> Placement:
    """Role rank counts from the --{role}_num_nodes/_num_gpus_per_node flags and colocation switches. The
    policy's trained copies (`policy_copies`) are on the actor's ranks unless given ranks of their own."""
    roles = roles_needed(cfg.schedule, cfg.algo)
    p = cfg.placement
    counts = {role: p.num_ranks(role.value) for role in roles}
    generating = cfg.rollout.rollout_ranks  # --async_train: ranks of their own
    if p.colocate_all_models or not any(counts.values()):
        return dataclasses.replace(Placement.colocated(roles + (Role.ROLLOUT,)), rollout_ranks=generating)
    colocate = []
    with_actor = {Role.ACTOR} | {role for role in policy_copies(cfg.schedule) if counts[role] == 0}
    if p.colocate_actor_ref and Role.REF in roles:
        with_actor.add(Role.REF)
    if len(with_actor) > 1:
        colocate.append(frozenset(with_actor))
    if p.colocate_critic_reward and Role.CRITIC in roles:
        colocate.append(frozenset({Role.CRITIC, Role.REWARD}))
    return Placement({**counts, Role.ROLLOUT: 0}, tuple(colocate), rollout_ranks=generating)


@dataclasses.dataclass(frozen=True)
class EngineInputs:
    """What every role's DeepSpeed engine of a PPO-family run is built from: the model, engine, optimizer and batch
    configs, the samples per prompt (the job's `Schedule`) and the run's real step count (`total_steps`, which
    sizes a trained model's LR schedule; --max_steps may be unset)."""

    model: PPOModelConfig
    engine: PPOEngineConfig
    optim: PPOOptimConfig
    batch: BatchConfig
    samples_per_prompt: int
    total_steps: int

    @classmethod
    def of(cls, cfg: TrainPPOConfig, total_steps: int) -> EngineInputs:
        return cls(cfg.model, cfg.engine, cfg.optim, cfg.batch, cfg.schedule.samples_per_prompt, total_steps)


def _engine(inputs: EngineInputs, topology: Topology, role: Role, build, device: torch.device, *,
            trainable: bool, learning_rate: float = 0.0, name: str | None = None,
            updates_per_batch: int = 1, ema_beta: float | None = None) -> DeepSpeedModel:
    """`updates_per_batch`: passes over each step's samples (sizes the LR schedule); `ema_beta`: see
    `role_model`."""
    b = inputs.batch
    dp = topology.dp_size(role)
    samples = b.rollout_batch_size * inputs.samples_per_prompt * updates_per_batch
    steps = inputs.total_steps if trainable else b.max_steps or 1_000_000
    return role_model(build, inputs.model, inputs.engine, inputs.optim, topology, role, device, trainable=trainable,
                      micro_batch_size=b.micro_train_batch_size if trainable else b.micro_rollout_batch_size,
                      grad_accum_steps=b.train_batch_size // (b.micro_train_batch_size * dp) if trainable else 1,
                      num_optimizer_steps=steps * b.max_epochs * samples // b.train_batch_size,
                      learning_rate=learning_rate, name=name or role.value, ema_beta=ema_beta)


def batchers_for(e: PPOEngineConfig, b: BatchConfig, topology: Topology, role: Role
                 ) -> tuple[MicroBatcher, MicroBatcher]:
    """(experience-time, training) micro-batchers of `role`, sample-count or token-budget based."""
    infer = micro_batcher(e, b.micro_rollout_batch_size, topology, role, e.rollout_tokens_per_gpu,
                          "--rollout_max_tokens_per_gpu" if e.rollout_max_tokens_per_gpu else
                          "--train_max_tokens_per_gpu")
    return infer, micro_batcher(e, b.micro_train_batch_size, topology, role)


def check_models(cfg: TrainPPOConfig) -> None:
    """Every model's positions hold --prompt_max_len + --generate_max_len (the policy's also a larger --max_len,
    which vLLM plans for); with ring attention, --ring_head_stride divides its key/value heads."""
    m = cfg.model
    paths = [("--pretrain", m.pretrain)] + [("--reward_pretrain", p) for p in cfg.reward.reward_paths]
    if cfg.schedule.uses_critic and m.critic_pretrain:
        paths.append(("--critic_pretrain", m.critic_pretrain))
    check_model_configs(paths, m, cfg.engine, longest=cfg.data.prompt_max_len + cfg.rollout.generate_max_len,
                        length_flags=f"--prompt_max_len {cfg.data.prompt_max_len} + --generate_max_len "
                                     f"{cfg.rollout.generate_max_len}")
    if cfg.rollout.max_len is not None:
        check_model_configs(paths[:1], m, cfg.engine, longest=cfg.max_model_len,
                            length_flags=f"--max_len {cfg.max_model_len} (vLLM's max_model_len)")


def describe_generation(rollout: RolloutConfig) -> str:
    kind, why = rollout_engine_choice(rollout)
    return f"generation: {'vLLM' if kind == 'vllm' else 'transformers generate'} ({why})"


def describe_algorithm(cfg: TrainPPOConfig, topology: Topology) -> str:
    """One line saying which algorithm runs: estimator, group size, KL and where it enters, the models
    that exist, and the active corrections."""
    a, n = cfg.algo, cfg.schedule.samples_per_prompt
    parts = [f"--advantage_estimator {a.advantage_estimator}", f"{n} sample{'s' if n > 1 else ''} per prompt"]
    if not a.needs_ref:
        parts.append("no KL term")
    else:
        where = "as a loss term (--use_kl_loss)" if a.use_kl_loss else "in the reward"
        controller = f"adaptive to target {a.kl_target}" if a.kl_target is not None else "fixed"
        parts.append(f"KL {a.kl_estimator} x {a.init_kl_coef} ({controller}) {where}")
    models = [f"actor {cfg.model.pretrain}"]
    if Role.CRITIC in topology.plan:
        models.append(f"critic from {cfg.critic_init}")
    if Role.REF in topology.plan:
        models.append("reference (frozen actor copy)")
    if cfg.agent.agent_func_path:
        models.append(f"rewards from the agent's episodes ({cfg.agent.agent_func_path})")
    else:
        models.append("reward " + (", ".join(cfg.reward.reward_paths) or cfg.reward.source))
    parts.append("models: " + "; ".join(models))
    if a.enable_vllm_is_correction:
        low, high = a.vllm_is_truncated_threshold
        kind = {"tis": "TIS (truncated)", "icepop": "ICEPOP (tokens outside zeroed)",
                "seq-mask-tis": "seq-mask-TIS (sequences whose geometric mean is outside zeroed)"}[a.is_correction_type]
        parts.append(f"rollout correction {kind} in [{low}, {high}]")
    if cfg.optim.enable_ema:
        parts.append(f"the saved actor is the moving average of its weights (--ema_beta {cfg.optim.ema_beta})")
    if actor_forward_skippable(cfg.batch, cfg.algo, cfg.schedule):
        parts.append("one actor update per batch (old log-probs from the training forward, no experience forward)")
    parts.append(describe_generation(cfg.rollout))
    return "algorithm: " + ", ".join(parts)


def describe_layout(cfg: TrainPPOConfig, topology: Topology, device: torch.device | None = None) -> str:
    """One line saying how the models see their batches (with the attention kernels that run on `device`) and
    how many data-parallel replicas each role has."""
    e, b = cfg.engine, cfg.batch
    device = device or torch.device("cpu")
    probe = torch.empty(1, 1, 64, dtype=cfg.model.dtype, device=device)  # a typical head dim: 8k <= 256
    parts = [f"packed samples (varlen attention: {varlen_backend_for(probe)})" if e.packing_samples else "padded rows"]
    if e.ring_attn_size > 1:
        parts.append(f"ring attention over {e.ring_attn_size} ranks (head stride {e.ring_head_stride}; "
                     f"{block_kernel_for(probe).name})")
    if e.use_dynamic_batch:
        parts.append(f"dynamic micro-batches of <= {e.train_max_tokens_per_gpu} tokens per rank in training, "
                     f"<= {e.rollout_tokens_per_gpu} in experience forwards")
    else:
        parts.append(f"micro-batches of {b.micro_train_batch_size} samples in training, "
                     f"{b.micro_rollout_batch_size} in experience forwards")
    if cfg.rollout.async_train:
        gen, train = topology.ranks(Role.ROLLOUT), topology.training_ranks
        parts.append(f"asynchronous: ranks {gen[0]}-{gen[-1]} generate ({topology.num_engines} engine(s)) up to "
                     f"{cfg.rollout.async_queue_size} step(s) ahead of ranks {train[0]}-{train[-1]}, which train")
    replicas = ", ".join(f"{r.value} {topology.dp_size(r)}" for r in Role
                         if r in topology.plan and r is not Role.ROLLOUT)
    if topology.tp_size > 1:
        parts.append(f"every model's linear layers split over {topology.tp_size} ranks (--ds_tensor_parallel_size, "
                     "DeepSpeed AutoTP)")
    return f"layout: {'; '.join(parts)}; data-parallel replicas: {replicas}"


def build_policy(inputs: EngineInputs, algo: AlgoConfig, temperature: float, topology: Topology, role: Role,
                 device: torch.device, learning_rate: float, updates_per_batch: int = 1,
                 ema_beta: float | None = None) -> Actor:
    """A trainable copy of --pretrain on `role`'s ranks (the actor, or a job's other policy), with its
    micro-batchers, sampling at `temperature` (--temperature: its log-probs are of the tempered distribution).
    `updates_per_batch`: its updates per step's samples (sizes the LR schedule); `ema_beta`: a moving average of
    its weights, which it saves (--enable_ema). Every rank of `role` calls it."""
    m = inputs.model
    infer, train = batchers_for(inputs.engine, inputs.batch, topology, role)

    def load(attn: str) -> torch.nn.Module:  # a trained model's base loads in 4 bits with QLoRA
        return with_router_aux_loss(load_causal_lm(m.pretrain, m.dtype, attn, m.trust_remote_code,
                                                   m.lora.load_in_4bit), algo.aux_loss_coef)

    model = _engine(inputs, topology, role, model_builder(m, inputs.engine, train.layout, load), device,
                    trainable=True, learning_rate=learning_rate, updates_per_batch=updates_per_batch,
                    ema_beta=ema_beta)
    return Actor(model, topology.data_group(role), device, temperature=temperature, algo=algo,
                 infer_batcher=infer, train_batcher=train)


def build_roles(cfg: TrainPPOConfig, topology: Topology, device: torch.device, total_steps: int,
                reward_source: RewardSource | None, tokenizer) -> Roles:
    """Role objects for this rank (None where it does not host the role)."""
    if cfg.engine.deepspeed_enable_sleep:
        check_sleep_supported(cfg.engine.zero_stage, cfg.engine.adam_offload)
    m, dtype = cfg.model, cfg.model.dtype
    actor = critic = ref_model = ref_batcher = None
    frozen: list[DeepSpeedModel] = []

    def causal_lm(attn: str, load_in_4bit: bool = False) -> torch.nn.Module:
        return load_causal_lm(m.pretrain, dtype, attn, m.trust_remote_code, load_in_4bit)

    four_bit = m.lora.load_in_4bit  # the trained models' bases only (QLoRA); frozen ones load as they are
    inputs = EngineInputs.of(cfg, total_steps)

    if topology.hosts(Role.ACTOR):
        actor = build_policy(inputs, cfg.algo, cfg.rollout.temperature, topology, Role.ACTOR, device,
                             cfg.schedule.actor_learning_rate, ema_beta=cfg.optim.actor_ema_beta)
    if Role.CRITIC in topology.plan and topology.hosts(Role.CRITIC):
        path = cfg.critic_init
        infer, train = batchers_for(cfg.engine, cfg.batch, topology, Role.CRITIC)
        model = _engine(inputs, topology, Role.CRITIC, model_builder(
            m, cfg.engine, train.layout, lambda attn: load_scalar_head_model(path, m.value_head_prefix, dtype, attn,
                                                                             m.trust_remote_code, "--critic_pretrain",
                                                                             fresh_head=True, load_in_4bit=four_bit)),
                        device, trainable=True, learning_rate=cfg.optim.critic_learning_rate)
        critic = Critic(model, topology.data_group(Role.CRITIC), device, cfg.algo.value_clip, infer_batcher=infer,
                        train_batcher=train)
    if Role.REF in topology.plan and topology.hosts(Role.REF):
        ref_batcher, _ = batchers_for(cfg.engine, cfg.batch, topology, Role.REF)
        frozen.append(_engine(inputs, topology, Role.REF, model_builder(m, cfg.engine, ref_batcher.layout, causal_lm),
                              device, trainable=False))
        ref_model = frozen[-1].engine
    reward = reward_source
    norms = stored_reward_norms(cfg.reward, cfg.algo)
    if cfg.reward.reward_paths and topology.hosts(Role.REWARD):
        reward_batcher, _ = batchers_for(cfg.engine, cfg.batch, topology, Role.REWARD)
        reward_models = _reward_models(inputs, cfg.reward.reward_paths, topology, device, reward_batcher.layout)
        frozen.extend(reward_models)
        reward = RewardModelEnsemble([m.engine for m in reward_models], device, reward_batcher, norms)
    experience = ExperienceMaker(cfg.algo, cfg.rollout, cfg.schedule, topology, actor=actor, critic=critic,
                                 ref_model=ref_model, reward=reward, device=device, ref_batcher=ref_batcher,
                                 running_reward_norm=cfg.algo.normalize_reward and norms is None,
                                 skip_actor_forward=actor_forward_skippable(cfg.batch, cfg.algo, cfg.schedule))
    specs = meta_param_specs(m.pretrain, dtype, m.trust_remote_code)
    ptx = None if actor is None else _ptx_data(cfg.data, cfg.algo.ptx_coef, cfg.batch.micro_train_batch_size,
                                               cfg.rollout.generate_max_len, cfg.seed, topology, tokenizer)
    return Roles(actor, critic, experience, specs, ptx,
                 frozen)


def stored_reward_norms(reward: RewardConfig, algo: AlgoConfig) -> list[tuple[float, float]] | None:
    """With --normalize_reward and reward models that all carry the mean/std stored by reward-model training
    (OpenRLHF's normalisation): those statistics, one pair per model. Otherwise None, and --normalize_reward
    (when set) normalises with running statistics over the run's rewards (a warning says why when reward
    models lack them). Reads only the models' config files; the same on every rank."""
    paths = reward.reward_paths
    if not (algo.normalize_reward and paths):
        return None
    norms = [stored_reward_norm(p) for p in paths]
    missing = [p for p, n in zip(paths, norms) if n is None]
    if missing:
        warnings.warn(f"--normalize_reward: {', '.join(missing)} stores no reward mean/std (train_rm writes them "
                      "when it evaluates): rewards are normalised with running statistics instead", stacklevel=2)
        return None
    return norms


def _reward_models(inputs: EngineInputs, paths: list[str], topology: Topology, device: torch.device,
                   layout: SequenceLayout) -> list[DeepSpeedModel]:
    """The frozen reward models of --reward_pretrain (one per path), on the reward role's ranks."""
    m, dtype = inputs.model, inputs.model.dtype
    return [_engine(inputs, topology, Role.REWARD, model_builder(
        m, inputs.engine, layout, lambda attn, p=path: load_scalar_head_model(p, m.value_head_prefix, dtype, attn,
                                                                              m.trust_remote_code)), device,
                    trainable=False)
            for path in paths]


def _ptx_data(data: DataConfig, ptx_coef: float, micro_batch_size: int, generate_max_len: int, seed: int,
              topology: Topology, tokenizer) -> PtxData | None:
    """This actor replica's walk over the pretraining texts of the ptx loss (None without one), in micro-batches
    of the training's size, each text cut to a sample's length (prompt + response)."""
    if data.pretrain_data is None or ptx_coef == 0:
        if data.pretrain_data is not None:
            warnings.warn("--pretrain_data is ignored because --ptx_coef is 0", stacklevel=2)
        return None
    texts = load_texts(data.pretrain_data, data.input_key, data.max_samples)
    batches = tokenize_texts(texts, tokenizer, micro_batch_size, data.prompt_max_len + generate_max_len,
                             data.pretrain_data)
    return PtxData(batches, topology.dp_size(Role.ACTOR), topology.dp_rank(Role.ACTOR), seed)
