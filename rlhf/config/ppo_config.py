"""The config tree of `train_ppo`: the shared sub-configs of `rlhf.config.shared_config` (PPO's variants of
model, optimizer and engine) and the RL ones (rollout, prompts, algorithm, batch, reward, placement).

Each field's metadata names the OpenRLHF flag that sets it (`flag`) and a one-line help text; the
flag parser in `rlhf.config.flags` is generated from this metadata, so a field and its flag cannot
drift apart. Components receive only their own sub-config. This module knows nothing of argparse.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import ClassVar

from rlhf.assets import EMBEDDED_MODEL_DIR, EMBEDDED_PROMPTS, EMBEDDED_REWARD
from rlhf.config.shared_config import (
    DEEPSPEED_PENDING_FLAGS,
    CheckpointConfig,
    EngineConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    RolePlacement,
    check_grad_accum,
    check_tensor_parallel,
    opt,
    replace_quietly,
    require,
    role_placement,
)

ADVANTAGE_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo")
GROUP_ESTIMATORS = ("reinforce_baseline", "rloo", "group_norm", "dr_grpo")
IS_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")


@dataclass(frozen=True, kw_only=True)
class PPOModelConfig(ModelConfig):
    """The policy, and where the critic starts."""

    critic_pretrain: str | None = opt(None, "critic initialisation (default: the first reward model, else --pretrain)")
    value_head_prefix: str = opt("score", "attribute name of the scalar head of critic and reward models")


@dataclass(frozen=True, kw_only=True)
class PPOOptimConfig(OptimConfig):
    """The shared optimizer settings plus the actor's and the critic's learning rates."""

    actor_learning_rate: float = opt(1e-6, "actor learning rate")
    critic_learning_rate: float = opt(9e-6, "critic learning rate")
    enable_ema: bool = opt(False, "keep an exponential moving average of the actor's weights (after every optimizer "
                           "step) and save it as the final model (and with --save_hf_ckpt); generation uses the "
                           "live weights")
    ema_beta: float = opt(0.992, "with --enable_ema: average = beta x average + (1 - beta) x weights")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.ema_beta <= 1, "--ema_beta must lie in [0, 1]")
        if self.ema_beta != 0.992 and not self.enable_ema:
            warnings.warn(f"--ema_beta {self.ema_beta} has no effect without --enable_ema", stacklevel=2)

    @property
    def actor_ema_beta(self) -> float | None:
        """The actor's EMA coefficient, None without --enable_ema."""
        return self.ema_beta if self.enable_ema else None



@dataclass(frozen=True, kw_only=True)
class PPOEngineConfig(EngineConfig):
    """The shared engine settings plus the hybrid engine's offloads and the experience-time token budget."""

    deepspeed_enable_sleep: bool = opt(False, "keep actor/critic optimizer states in host memory outside training")
    ref_reward_offload: bool = opt(False, "keep reference/reward parameters in host memory outside experience")
    rollout_max_tokens_per_gpu: int | None = opt(None, "token budget of an experience forward per rank "
                                                 "(--use_dynamic_batch; default: --train_max_tokens_per_gpu)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.deepspeed_enable_sleep and self.zero_stage == 0:
            warnings.warn("--deepspeed_enable_sleep has no effect at --zero_stage 0 (no ZeRO optimizer states to "
                          "offload); use --zero_stage 1-3 to free them between training stages", stacklevel=2)
        if self.ref_reward_offload and self.zero_stage == 3:
            warnings.warn("--ref_reward_offload has no effect at --zero_stage 3: reference and reward parameters "
                          "are already partitioned over their ranks", stacklevel=2)
        require(self.rollout_max_tokens_per_gpu is None or self.rollout_max_tokens_per_gpu >= 1,
                 "--rollout_max_tokens_per_gpu must be >= 1")


    @property
    def rollout_tokens_per_gpu(self) -> int:
        return self.rollout_max_tokens_per_gpu or self.train_max_tokens_per_gpu




@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Generation by the in-process rollout engines."""

    vllm_tensor_parallel_size: int = opt(1, "ranks per vLLM engine (consecutive ranks)")
    vllm_gpu_memory_utilization: float = opt(0.95, "fraction of GPU memory vLLM may take (CUDA)")
    vllm_kv_cache_bytes: int = opt(64 << 20, "KV-cache bytes per engine on CPU (vLLM needs an explicit size)")
    weight_sync_bucket_mb: int = opt(256, "MiB per broadcast bucket when pushing weights to ranks without the actor")
    enforce_eager: bool = opt(False, "run vLLM's model eagerly: no CUDA graphs, and on CPU no torch.compile "
                               "(CPU, compiled: +1-26 s at start, each call 0.77-1.03x eager's time; "
                               "benchmarks/vllm_cpu_modes.py)")
    vllm_enable_sleep: bool = opt(False, "vLLM releases its memory (sleep level 2) outside generation (CUDA)")
    enable_prefix_caching: bool = opt(False, "vLLM prefix caching")
    rollout_engine: str = opt("auto", "auto (vLLM if installed, else HF generate), vllm or hf")
    temperature: float = opt(1.0, "sampling temperature")
    top_p: float = opt(1.0, "nucleus sampling probability mass")
    generate_max_len: int = opt(1024, "maximum number of generated tokens per sample")
    max_len: int | None = opt(None, "vLLM's max_model_len, the tokens of prompt + response an engine plans for "
                              "(default: --prompt_max_len + --generate_max_len; as in OpenRLHF, nothing else reads it)")
    n_samples_per_prompt: int = opt(1, "samples per prompt (a group, for group estimators)")
    eval_temperature: float = opt(0.6, "sampling temperature of the --eval_dataset evaluation")
    eval_n_samples_per_prompt: int = opt(4, "samples per --eval_dataset prompt (pass@k uses all of them)")
    async_train: bool = opt(False, "generate on ranks of their own (--vllm_num_engines) while the other ranks "
                                   "train: up to --async_queue_size steps off-policy")
    async_queue_size: int = opt(1, "with --async_train: batches generated ahead of training at most (their "
                                   "staleness in steps)")
    vllm_num_engines: int | None = opt(None, "with --async_train: rollout engines on the world's last N x "
                                             "--vllm_tensor_parallel_size ranks (without it every rank hosts an "
                                             "engine and the count is world size / TP); 0: no vLLM, every rank "
                                             "generates with transformers (as --rollout_engine hf)")

    @property
    def rollout_ranks(self) -> int:
        """Ranks that only generate (--async_train), 0 when every rank generates."""
        return self.vllm_num_engines * self.vllm_tensor_parallel_size if self.async_train else 0

    def __post_init__(self) -> None:
        require(self.async_queue_size >= 1, "--async_queue_size must be >= 1")
        if self.async_train:
            require(self.vllm_num_engines is not None and self.vllm_num_engines >= 1,
                    "--async_train generates on ranks of their own: give --vllm_num_engines N (N x "
                    "--vllm_tensor_parallel_size ranks generate, the others train)")
            require(not self.vllm_enable_sleep, "--async_train keeps the engines generating while training runs: "
                                                "drop --vllm_enable_sleep (as OpenRLHF)")
        elif self.vllm_num_engines == 0:  # OpenRLHF: no vLLM engines, generate with the training model's library
            require(self.rollout_engine != "vllm", "--vllm_num_engines 0 means no vLLM engine, and --rollout_engine "
                                                   "vllm asks for one: drop one of them")
        elif self.vllm_num_engines is not None:
            warnings.warn("--vllm_num_engines is ignored: every rank hosts an engine; the count is world size / "
                          "--vllm_tensor_parallel_size (engines on ranks of their own: --async_train)", stacklevel=2)
        require(self.eval_temperature > 0, "--eval_temperature must be > 0")
        require(self.eval_n_samples_per_prompt >= 1, "--eval_n_samples_per_prompt must be >= 1")
        require(self.vllm_tensor_parallel_size >= 1, "--vllm_tensor_parallel_size must be >= 1")
        require(self.weight_sync_bucket_mb >= 1, "--weight_sync_bucket_mb must be >= 1")
        require(self.temperature > 0, "--temperature must be > 0")
        require(0 < self.top_p <= 1, "--top_p must lie in (0, 1]")
        require(self.generate_max_len >= 1, "--generate_max_len must be >= 1")
        require(self.max_len is None or self.max_len >= 1, "--max_len must be >= 1")
        require(self.n_samples_per_prompt >= 1, "--n_samples_per_prompt must be >= 1")
        require(self.rollout_engine in ("auto", "vllm", "hf"), "--rollout_engine: choose auto, vllm or hf")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompt dataset and chat formatting."""

    prompt_data: str | None = opt(None, "prompt datasets, comma separated: local JSON/JSONL/parquet files or "
                                  "directories, HF save_to_disk directories, or json@DIR (required with --pretrain; "
                                  "without it: the embedded demo prompts)")
    prompt_data_probs: str | None = opt(None, "sampling probabilities of the comma-separated --prompt_data sources, "
                                        "comma separated (mixed as the supervised jobs' --dataset_probs)")
    prompt_split: str = opt("train", "split to read when --prompt_data is a directory with splits")
    input_key: str = opt("input", "dataset column holding the prompt")
    label_key: str | None = opt(None, "dataset column passed to reward_func as labels")
    input_template: str | None = opt(None, "format string with one {} wrapped around each prompt")
    apply_chat_template: bool = opt(False, "format prompts with the tokenizer's chat template")
    tokenizer_chat_template: str | None = opt(None, "a Jinja chat template overriding the tokenizer's")
    prompt_max_len: int = opt(1024, "prompts longer than this many tokens are dropped, with a count")
    max_samples: int = opt(int(1e8), "read at most this many prompts")
    pretrain_data: str | None = opt(None, "JSON/JSONL texts (column --input_key) for the ptx loss")
    eval_dataset: str | None = opt(None, "held-out prompts evaluated during training (same columns and formatting "
                                   "as --prompt_data; a `datasource` column splits the metrics)")
    eval_split: str = opt("train", "split to read when --eval_dataset is a directory with splits")
    eval_max_samples: int = opt(int(1e8), "read at most this many evaluation prompts (not an OpenRLHF flag)")

    def __post_init__(self) -> None:
        require(self.prompt_max_len >= 1, "--prompt_max_len must be >= 1")
        require(self.max_samples >= 1, "--max_samples must be >= 1")
        require(self.eval_max_samples >= 1, "--eval_max_samples must be >= 1")
        if self.input_template is not None:
            require(
                self.input_template.count("{}") == 1,
                f"--input_template {self.input_template!r} must contain exactly one '{{}}' for the prompt",
            )


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """The RL objective: estimator, KL, policy/value losses and every stabiliser of RL_MATH.md."""

    advantage_estimator: str = opt("gae", f"one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    gamma: float = opt(1.0, "discount factor (gae, reinforce; forced to 1 for group estimators)")
    lambd: float = opt(1.0, "GAE lambda")
    no_advantage_std_norm: bool = opt(False, "whitening subtracts the mean but does not divide by the std")
    eps_clip: float = opt(0.2, "PPO clip range (symmetric)")
    eps_clip_low_high: tuple[float, float] | None = opt(None, "asymmetric clip range: LOW HIGH", nargs=2)
    dual_clip: float | None = opt(None, "dual-clip constant c > 1 for negative advantages")
    value_clip: float | None = opt(0.5, "clip range of value updates around the old values")
    policy_loss_type: str = opt("ppo", "ppo (token-level ratio) or gspo (sequence-level ratio)")
    init_kl_coef: float = opt(0.01, "KL coefficient beta (0 and no --use_kl_loss: no reference model)")
    kl_target: float | None = opt(None, "target KL of the adaptive controller (default: fixed beta)")
    kl_horizon: int = opt(10000, "samples over which the adaptive controller moves beta")
    kl_estimator: str = opt("k1", "k1, k2 or k3")
    use_kl_loss: bool = opt(False, "KL as a loss term (GRPO style) instead of a reward penalty")
    entropy_loss_coef: float | None = opt(None, "entropy bonus coefficient (not given: entropy is not computed; "
                                          "0: computed and logged only)")
    aux_loss_coef: float = opt(0.0, "MoE auxiliary loss coefficient (models that return aux_loss)")
    ptx_coef: float = opt(0.05, "pretraining NLL coefficient (needs --pretrain_data)")
    normalize_reward: bool = opt(False, "normalise rewards with running mean/std over all samples")
    reward_clip_range: tuple[float, float] | None = opt((-10.0, 10.0), "clamp rewards to LOW HIGH", nargs=2)
    overlong_buffer_len: int | None = opt(None, "DAPO overlong penalty buffer (tokens before the limit)")
    overlong_penalty_factor: float = opt(1.0, "DAPO overlong penalty at the limit")
    stop_properly_penalty_coef: float | None = opt(None, "truncated samples: reward*coef (0..1), or coef if < 0")
    dynamic_filtering: bool = opt(False, "drop prompt groups whose mean score is outside the range and sample more "
                                  "prompts until the step has --rollout_batch_size informative groups")
    dynamic_filtering_reward_range: tuple[float, float] = opt((0.0, 1.0), "kept groups: LOW < mean < HIGH",
                                                              nargs=2)
    dynamic_filtering_max_rounds: int = opt(8, "generation rounds per step at most with --dynamic_filtering (the "
                                            "first included); then rejected groups fill the batch, masked (not an "
                                            "OpenRLHF flag)")
    enable_vllm_is_correction: bool = opt(False, "importance-weight tokens by exp(logp_old - logp_rollout)")
    vllm_is_truncated_threshold: tuple[float, float] = opt((0.5, 5.0), "TIS/ICEPOP interval LOW HIGH", nargs=2)
    vllm_is_correction_type: str = opt("tis", "tis (truncate weights to the interval), icepop (zero tokens "
                                       "outside it) or seq-mask-tis (zero whole sequences whose geometric-mean "
                                       "weight is outside it; the others keep their token weights)")
    use_icepop: bool = opt(False, "same as --vllm_is_correction_type icepop")
    freezing_actor_steps: int = opt(-1, "train only the critic for this many steps (critic warm-up)")

    def __post_init__(self) -> None:
        require(self.advantage_estimator in ADVANTAGE_ESTIMATORS,
                 f"--advantage_estimator {self.advantage_estimator!r}: choose one of "
                 f"{', '.join(ADVANTAGE_ESTIMATORS)}")
        require(self.eps_clip > 0, "--eps_clip must be > 0")
        require(self.dynamic_filtering_max_rounds >= 1, "--dynamic_filtering_max_rounds must be >= 1")
        require(self.dual_clip is None or self.dual_clip > 1, "--dual_clip must be > 1")
        require(self.policy_loss_type in ("ppo", "gspo"), "--policy_loss_type: choose ppo or gspo")
        require(self.kl_estimator in ("k1", "k2", "k3"), "--kl_estimator: choose k1, k2 or k3")
        require(self.init_kl_coef >= 0, "--init_kl_coef must be >= 0")
        require(self.ptx_coef >= 0 and (self.entropy_loss_coef or 0) >= 0,
                 "--ptx_coef and --entropy_loss_coef must be >= 0")
        require(self.kl_target is None or self.kl_target > 0, "--kl_target must be > 0")
        require(0 <= self.gamma <= 1 and 0 <= self.lambd <= 1, "--gamma and --lambd must lie in [0, 1]")
        if self.stop_properly_penalty_coef is not None and self.stop_properly_penalty_coef >= 0:
            require(self.stop_properly_penalty_coef <= 1, "--stop_properly_penalty_coef must be <= 1 or < 0")
        require(self.vllm_is_correction_type in IS_CORRECTION_TYPES,
                f"--vllm_is_correction_type {self.vllm_is_correction_type!r}: choose tis, icepop or seq-mask-tis")
        require(not (self.use_icepop and self.vllm_is_correction_type == "seq-mask-tis"),
                "--use_icepop contradicts --vllm_is_correction_type seq-mask-tis: give one of them")
        lo, hi = self.vllm_is_truncated_threshold
        require(0 <= lo < hi, "--vllm_is_truncated_threshold needs 0 <= LOW < HIGH")
        if self.reward_clip_range is not None:
            require(self.reward_clip_range[0] < self.reward_clip_range[1], "--reward_clip_range needs LOW < HIGH")

    @property
    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the PPO clip."""
        if self.eps_clip_low_high is not None:
            return (float(self.eps_clip_low_high[0]), float(self.eps_clip_low_high[1]))
        return (self.eps_clip, self.eps_clip)

    @property
    def is_correction_type(self) -> str:
        """The rollout correction's kind: --vllm_is_correction_type, icepop with --use_icepop."""
        return "icepop" if self.use_icepop else self.vllm_is_correction_type

    @property
    def is_correction(self) -> tuple[float, float, str] | None:
        """(low, high, kind) of the off-policy correction against the rollout engine, None when off."""
        if not self.enable_vllm_is_correction:
            return None
        return (*self.vllm_is_truncated_threshold, self.is_correction_type)

    @property
    def needs_ref(self) -> bool:
        """A reference model exists only when some KL term uses it."""
        return self.init_kl_coef > 0 or self.use_kl_loss


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How many prompts, samples and tokens make one step, all as global counts."""

    num_episodes: int = opt(1, "passes over the prompt dataset")
    max_steps: int | None = opt(None, "stop after this many RL steps (default: until the episodes end)")
    rollout_batch_size: int = opt(1024, "prompts per RL step, over all ranks")
    micro_rollout_batch_size: int = opt(8, "samples per forward pass when computing experience, per rank")
    train_batch_size: int = opt(128, "samples per optimizer step, over all ranks")
    micro_train_batch_size: int = opt(4, "samples per forward/backward, per rank")
    max_epochs: int = opt(1, "passes over each step's experience")

    def __post_init__(self) -> None:
        for name in ("num_episodes", "rollout_batch_size", "micro_rollout_batch_size", "train_batch_size",
                     "micro_train_batch_size", "max_epochs"):
            require(getattr(self, name) >= 1, f"--{name} must be >= 1")
        require(self.max_steps is None or self.max_steps >= 1, "--max_steps must be >= 1")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """Where rewards come from: reward models, a reward_func file, or an HTTP endpoint."""

    reward_pretrain: str | None = opt(None, "reward model directories, comma separated (scores are summed)")
    remote_rm_url: str | None = opt(None, "http(s) URL of a reward server, or a .py file defining reward_func "
                                    "(default without --reward_pretrain: the embedded demo reward)")
    remote_rm_timeout: float = opt(30.0, "seconds per HTTP reward request")
    remote_rm_retries: int = opt(3, "attempts per HTTP reward request")
    reward_func_timeout: float = opt(300.0, "seconds one reward_func call (--remote_rm_url FILE.py) may take "
                                     "before the run fails with an error naming the file (0: no limit)")

    def __post_init__(self) -> None:
        require(self.reward_func_timeout >= 0, "--reward_func_timeout must be >= 0 (seconds; 0: no limit)")
        require(self.remote_rm_timeout > 0 and self.remote_rm_retries >= 1,
                 "--remote_rm_timeout must be > 0 and --remote_rm_retries >= 1")

    @property
    def reward_model_paths(self) -> list[str]:
        """Every directory named by --reward_pretrain."""
        return [p for p in (self.reward_pretrain or "").split(",") if p]

    @property
    def reward_paths(self) -> list[str]:
        """Reward model directories in use: none when --remote_rm_url is given (it wins, as in OpenRLHF)."""
        return [] if self.remote_rm_url else self.reward_model_paths

    @property
    def source(self) -> str:
        """The reward_func file or URL in use ("" when rewards come from reward models)."""
        return self.remote_rm_url or ""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Multi-turn agent rollouts (`rlhf.agents`): the episode's environment and its limits."""

    agent_func_path: str | None = opt(None, "a .py file defining an agent step(observation, action, label, **kwargs) "
                                      "or an OpenRLHF AgentInstance class; its episode rewards replace the reward "
                                      "models and reward function")
    agent_max_turns: int = opt(0, "model turns per episode at most (0: until done or the length limit; not an "
                                  "OpenRLHF flag)")
    agent_turn_max_tokens: int = opt(0, "tokens one turn may generate (0: all the budget left of --prompt_max_len + "
                                        "--generate_max_len, as OpenRLHF; not an OpenRLHF flag)")

    def __post_init__(self) -> None:
        require(self.agent_max_turns >= 0, "--agent_max_turns must be >= 0 (0: no limit)")
        require(self.agent_turn_max_tokens >= 0, "--agent_turn_max_tokens must be >= 0 (0: no limit)")
        if self.agent_func_path is not None:
            require(self.agent_func_path.endswith(".py"), f"--agent_func_path {self.agent_func_path}: give a .py file")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """How roles map to ranks: colocated (hybrid engine) or disjoint ranges sized per role."""

    colocate_all_models: bool = opt(False, "every role on every rank (also the default when no sizes are given)")
    colocate_actor_ref: bool = opt(False, "actor and reference share ranks")
    colocate_critic_reward: bool = opt(False, "critic and reward models share ranks")
    actor: RolePlacement = role_placement("actor", "the actor's", "0: every rank of the world")
    critic: RolePlacement = role_placement("critic", "the critic's", "0: every rank of the world")
    reward: RolePlacement = role_placement("reward", "the reward models'", "0: every rank of the world")
    ref: RolePlacement = role_placement("ref", "the reference model's", "0: every rank of the world")

    def __post_init__(self) -> None:
        for name, placement in self.by_role.items():
            placement.check(name)

    @property
    def by_role(self) -> dict[str, RolePlacement]:
        """Role name (a `Role`'s value) -> its placement."""
        return {"actor": self.actor, "critic": self.critic, "reward": self.reward, "ref": self.ref}

    def num_ranks(self, role: str) -> int:
        """Ranks requested for the role named `role` (0: span the world)."""
        if self.colocate_all_models:
            return 0
        return self.by_role[role].num_ranks


DEMO_LENGTHS = {"prompt_max_len": 16, "generate_max_len": 8}
"""Lengths the embedded demo runs with where the defaults (OpenRLHF's, sized for real models) are still set: the
demo policy has 256 positions; a copy-task prompt fits 16 tokens and its answer (four words and EOS) 8."""

DEMO_ROLLOUT_BATCH = 128
"""The demo's --rollout_batch_size on its own prompts where the default (1024) is still set: there are 512, so
one pass takes 4 steps of one --train_batch_size (128) each."""


@dataclass(frozen=True)
class Schedule:
    """What PPO's run reads of its updates and their cadence (`TrainPPOConfig.schedule`). PPO's code reads these,
    never the flags behind them, so a job built on `TrainPPOConfig` that gives the flags other meanings (RePULSe:
    `rlhf.repulse.repulse_config.TrainRepulseConfig.schedule`) changes PPO's run in this one place
    (tests/unit/test_repulse_config.py checks that PPO's modules read no flag behind it)."""

    ppo_update: bool  # whether the policy takes PPO's update (RePULSe gives it another)
    uses_critic: bool
    save_steps: int  # the checkpoint interval in steps, -1: none
    samples_per_prompt: int  # samples per prompt and step
    samples_per_prompt_flags: str  # the flags that set `samples_per_prompt` (for errors)
    actor_learning_rate: float  # the policy's
    episodes: int  # passes over the prompts
    policy_copies: tuple[str, ...] = ()  # trained copies of the policy beside PPO's roles, by role (RePULSe's q)


@dataclass(frozen=True, kw_only=True)
class TrainPPOConfig(JobConfig):
    """Everything `train_ppo` needs, one sub-config per component."""

    PENDING_FLAGS: ClassVar[tuple[str, ...]] = DEEPSPEED_PENDING_FLAGS
    """OpenRLHF train_ppo flags whose features are not built yet: refused, never silently ignored."""
    IGNORED_FLAGS: ClassVar[dict[str, str]] = {
        "actor_init_on_gpu": "OpenRLHF v0.9.5 defines it and nothing reads it; the actor is built on its ranks' "
                             "devices here",
        "vllm_generate_batch_size": "OpenRLHF v0.9.5 sets it (default --rollout_batch_size) and nothing reads it; "
                                    "each engine generates its share of a step's prompts in one call here",
    }
    IGNORED_SWITCHES: ClassVar[frozenset[str]] = frozenset({"actor_init_on_gpu"})

    model: PPOModelConfig = field(default_factory=PPOModelConfig)
    optim: PPOOptimConfig = field(default_factory=PPOOptimConfig)
    engine: PPOEngineConfig = field(default_factory=PPOEngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_grad_accum(self.model, self.engine)
        check_tensor_parallel(self.model, self.engine)
        if self.schedule.ppo_update:
            require(self.schedule.actor_learning_rate > 0, "--actor_learning_rate must be positive")
        self._check_async()
        require(not (self.optim.enable_ema and self.model.lora.enabled),
                "--enable_ema averages the actor's full weights, and with --lora_rank only adapters are trained "
                "(OpenRLHF pairs the adapted actor's parameters with a plain model's there): drop one of them")
        require(not (self.optim.enable_ema and self.engine.ds_tensor_parallel_size > 1),
                f"--enable_ema with --ds_tensor_parallel_size {self.engine.ds_tensor_parallel_size} is not built (the "
                "average would hold each rank's slice of the split layers): drop one of them")
        if self.logging.eval_steps != -1 and self.data.eval_dataset is None:
            warnings.warn(f"--eval_steps {self.logging.eval_steps} has no effect: there is no --eval_dataset",
                          stacklevel=2)
        n, algo = self.schedule.samples_per_prompt, self.algo
        if algo.advantage_estimator in GROUP_ESTIMATORS and self.schedule.ppo_update:
            require(n > 1, f"--advantage_estimator {algo.advantage_estimator} compares samples of one prompt: "
                            f"{self.schedule.samples_per_prompt_flags} must be > 1 (got {n})")
        require(not algo.dynamic_filtering or n > 1, "--dynamic_filtering filters prompt groups: "
                 "--n_samples_per_prompt must be > 1")
        require(self.batch.train_batch_size <= self.batch.rollout_batch_size * n,
                 f"--train_batch_size {self.batch.train_batch_size} exceeds the samples of one step "
                 f"(--rollout_batch_size x {self.schedule.samples_per_prompt_flags} = "
                 f"{self.batch.rollout_batch_size * n})")
        if algo.overlong_buffer_len is not None:
            require(0 < algo.overlong_buffer_len <= self.rollout.generate_max_len,
                     "--overlong_buffer_len must lie in (0, --generate_max_len]")
        if not self.schedule.uses_critic and (self.model.critic_pretrain or self.placement.num_ranks("critic")):
            warnings.warn(f"--advantage_estimator {algo.advantage_estimator} uses no critic: critic flags are "
                          "ignored", stacklevel=2)
        if self.model.pretrain is not None:
            require(self.prompts_given,
                     f"--pretrain {self.model.pretrain} is given but --prompt_data is not: name the prompt dataset "
                     "(the embedded demo prompts are used only when --pretrain is not given)")
            require(bool(self.reward.reward_model_paths or self.reward.remote_rm_url or self.agent.agent_func_path),
                     f"--pretrain {self.model.pretrain} is given but no reward source: add --reward_pretrain DIR "
                     "(reward models) or --remote_rm_url (an HTTP URL or a .py file defining reward_func)")
        require(not (self.agent.agent_func_path and (self.reward.reward_pretrain or self.reward.remote_rm_url)),
                f"--agent_func_path {self.agent.agent_func_path}: the agent's episode rewards are the rewards "
                "(OpenRLHF then ignores reward models and functions); drop --reward_pretrain and --remote_rm_url")
        if self.reward.reward_pretrain and self.reward.remote_rm_url:
            warnings.warn("--reward_pretrain is not used: rewards come from --remote_rm_url "
                          f"{self.reward.remote_rm_url} "
                          "(as in OpenRLHF); drop --remote_rm_url to score with the reward models", stacklevel=2)
        if algo.enable_vllm_is_correction and self.rollout.top_p < 1:
            # vLLM's processed log-probs are renormalised over the nucleus, the actor's over the whole vocabulary
            warnings.warn(f"--enable_vllm_is_correction with --top_p {self.rollout.top_p}: the engine's log-probs "
                          "are renormalised over the top-p nucleus while the actor's cover the whole vocabulary, "
                          "so the importance weights compare different distributions (biased low); use "
                          "--top_p 1 with the correction", stacklevel=2)
        if self.rollout.max_len is not None:
            longest = self.data.prompt_max_len + self.rollout.generate_max_len
            require(self.rollout.max_len >= longest,
                    f"--max_len {self.rollout.max_len} (vLLM's max_model_len) cannot hold a prompt of --prompt_max_len "
                    f"{self.data.prompt_max_len} tokens and a response of --generate_max_len "
                    f"{self.rollout.generate_max_len} (vLLM would cut responses short or refuse long prompts): give "
                    f"--max_len {longest} or more, or drop it (that sum is the default)")
        e = self.engine
        if e.use_dynamic_batch:
            longest = self.data.prompt_max_len + self.rollout.generate_max_len
            ring = e.ring_attn_size
            per_rank = -(-longest // (2 * ring)) * 2 if ring > 1 else longest  # a ring pads to 2R, then shards
            for flag, budget in (("--train_max_tokens_per_gpu", e.train_max_tokens_per_gpu),
                                 ("--rollout_max_tokens_per_gpu", e.rollout_tokens_per_gpu)):
                require(budget >= per_rank, f"{flag} {budget} cannot hold one sample of up to {longest} tokens "
                                             f"(--prompt_max_len + --generate_max_len), {per_rank} per rank with "
                                             f"--ring_attn_size {ring}: raise it to at least {per_rank}")

    def _check_async(self) -> None:
        """--async_train: what the generation ranks cannot do while the others train."""
        if not self.rollout.async_train:
            return
        refused = {"--dynamic_filtering": self.algo.dynamic_filtering,
                   "--eval_dataset": self.data.eval_dataset is not None}
        named = [flag for flag, on in refused.items() if on]
        require(not named, f"--async_train does not support {', '.join(named)} yet: their extra generation runs "
                           "inside the step, where the generation ranks are already a step ahead; drop one of them")

    @property
    def schedule(self) -> Schedule:
        """PPO's schedule from PPO's flags; a job built on this config that reads them otherwise (RePULSe)
        returns its own."""
        return Schedule(ppo_update=True, uses_critic=self.algo.advantage_estimator == "gae",
                        save_steps=self.checkpoint.save_steps, samples_per_prompt=self.rollout.n_samples_per_prompt,
                        samples_per_prompt_flags="--n_samples_per_prompt",
                        actor_learning_rate=self.optim.actor_learning_rate, episodes=self.batch.num_episodes)

    @property
    def prompts_given(self) -> bool:
        """Whether the run names its prompts (without --pretrain the embedded demo prompts are used)."""
        return self.data.prompt_data is not None

    @property
    def max_model_len(self) -> int:
        """Tokens of prompt + response each vLLM engine plans for: --max_len, else --prompt_max_len +
        --generate_max_len (OpenRLHF's rule)."""
        return self.rollout.max_len or self.data.prompt_max_len + self.rollout.generate_max_len

    @property
    def critic_init(self) -> str:
        """Where the critic starts (OpenRLHF's rule): --critic_pretrain, else the first reward model, else
        (rewards from --remote_rm_url) the policy with a fresh value head."""
        paths = self.reward.reward_paths
        return self.model.critic_pretrain or (paths[0] if paths else self.model.pretrain)

    def with_demo_defaults(self) -> TrainPPOConfig:
        """The config to run. Without --pretrain the embedded tiny demo supplies the policy and, where the
        user named none, the prompts and the reward. With --pretrain nothing is filled in (validated)."""
        if self.model.pretrain is not None:
            return self
        data, reward, rollout = self.data, self.reward, self.rollout
        batch = self.batch
        if data.prompt_data is None:
            data = replace(data, prompt_data=EMBEDDED_PROMPTS)
            if batch.rollout_batch_size == BatchConfig().rollout_batch_size:
                batch = replace_quietly(batch, rollout_batch_size=DEMO_ROLLOUT_BATCH)
        if not (reward.reward_model_paths or reward.remote_rm_url or self.agent.agent_func_path):
            reward = replace(reward, remote_rm_url=EMBEDDED_REWARD)
        if data.prompt_max_len == DataConfig().prompt_max_len:  # sized for real models; the demo has 256 positions
            data = replace_quietly(data, prompt_max_len=DEMO_LENGTHS["prompt_max_len"])
        if rollout.generate_max_len == RolloutConfig().generate_max_len:
            rollout = replace_quietly(rollout, generate_max_len=DEMO_LENGTHS["generate_max_len"])
        return replace_quietly(self, model=replace(self.model, pretrain=EMBEDDED_MODEL_DIR), data=data,
                               reward=reward, rollout=rollout, batch=batch)

    def check_world(self, world_size: int) -> None:
        """Validate rollout sharding against the world size (role sizes: `check_role_sizes`)."""
        b, tp = self.batch, self.rollout.vllm_tensor_parallel_size
        require(world_size % tp == 0,
                 f"world size {world_size} is not a multiple of --vllm_tensor_parallel_size {tp}")
        num_engines = world_size // tp
        if self.rollout.async_train:
            gen = self.rollout.rollout_ranks
            require(gen < world_size, f"--async_train: --vllm_num_engines {self.rollout.vllm_num_engines} x "
                                      f"--vllm_tensor_parallel_size {tp} = {gen} generation ranks leave none of the "
                                      f"{world_size} to train; use fewer engines or more ranks")
            num_engines = self.rollout.vllm_num_engines
        samples = b.rollout_batch_size * self.schedule.samples_per_prompt
        require(samples % b.train_batch_size == 0,
                 f"--train_batch_size {b.train_batch_size} must divide the samples per step ({samples})")
        if tp > 1:  # with one rank per engine the prompts may split unevenly (engines with none stay idle)
            require(b.rollout_batch_size % num_engines == 0,
                     f"--rollout_batch_size {b.rollout_batch_size} must be divisible by the number of rollout "
                     f"engines ({num_engines}" + (" = --vllm_num_engines)" if self.rollout.async_train else
                                                 f" = world size {world_size} / --vllm_tensor_parallel_size {tp})"))
            per_engine = b.rollout_batch_size // num_engines
            require(per_engine % tp == 0,
                     f"each engine's {per_engine} prompts must split evenly over its {tp} ranks "
                     "(samples of one prompt stay on one rank)")

    def check_role_sizes(self, rank_counts: dict[str, int], trainable: tuple[str, ...]) -> None:
        """Every role's data-parallel replicas (ranks / --ring_attn_size) must split the step's samples
        evenly; trainable ones also its batches."""
        b, ring = self.batch, self.engine.replica_size
        samples = b.rollout_batch_size * self.schedule.samples_per_prompt
        for role, count in rank_counts.items():
            require(count % ring == 0, f"the {count} {role} ranks do not split into {self.engine.replica_groups}; "
                                        "change the role's rank count or that size")
            dp = count // ring
            require(samples % dp == 0, f"the {samples} samples of a step do not split over the {dp} {role} ranks; "
                                        "change --rollout_batch_size or the role's rank count")
            if role in trainable:
                require(b.train_batch_size % (b.micro_train_batch_size * dp) == 0,
                         f"--train_batch_size {b.train_batch_size} must be a multiple of --micro_train_batch_size "
                         f"{b.micro_train_batch_size} x {dp} {role} ranks")
