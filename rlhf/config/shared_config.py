"""Sub-configs every job shares (model, optimizer, DeepSpeed engine and layout, logging, checkpoints) and
the field helper `opt`. Frozen keyword-only dataclasses validated on construction; each field's metadata
names its OpenRLHF flag. A job's root config (`rlhf.config.ppo_config`, `rlhf.config.supervised_config`) holds these
next to its own sub-configs, and may give a field another default by passing an instance as the field
default (e.g. the checkpoint directory per job): the flag parser reads defaults from the root's instances.
This module knows nothing of argparse or of any job.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    import torch

from rlhf.config.errors import UsageError

PARAM_DTYPES = ("bf16", "fp16", "fp32")
DEFAULT_MIN_LR_RATIO = 0.1
"""cosine_with_min_lr's floor as a fraction of the learning rate (OpenRLHF v0.9.5's, fixed but in train_dpo)."""

DEEPSPEED_PENDING_FLAGS: tuple[str, ...] = ()
"""OpenRLHF's DeepSpeed flags not built yet, refused by every training job (none left)."""

DEEPCOMPILE_NEEDS_CUDA = (
    "--deepcompile needs CUDA: DeepSpeed's DeepCompile runtime is CUDA and NCCL code (deepspeed/ops/csrc/includes/"
    "deepcompile.h holds CUDA streams and events, ops/csrc/compile/deepcompile.cpp NCCL communicators), and on CPU "
    "engine.compile() fails building its 'dc' extension (cuda.h: No such file or directory); drop the flag here")


def opt(default: Any, help: str, flag: str | None = None, nargs: str | int | None = None) -> Any:
    """A config field with its CLI metadata. `flag` defaults to the field name."""
    meta = {"help": help, "flag": flag, "nargs": nargs}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


T = TypeVar("T")


def replace_quietly(config: T, **changes: Any) -> T:
    """`dataclasses.replace` without the validation's warnings: the config's notes were shown when its flags
    were parsed, and a derived config (demo defaults, this machine's attention) would repeat them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dataclasses.replace(config, **changes)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise UsageError(message)


@dataclass(frozen=True, kw_only=True)
class RolePlacement:
    """The ranks of one role: num_nodes x num_gpus_per_node (0 per node: no ranks of its own). A job's config
    holds one per placeable role through `role_placement`, which names its flags after the role as OpenRLHF
    does (--actor_num_nodes, --actor_num_gpus_per_node)."""

    num_nodes: int = opt(1, "nodes of {whose} rank range")
    num_gpus_per_node: int = opt(0, "{whose} ranks per node ({zero})")

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.num_gpus_per_node

    def check(self, role: str) -> None:
        """Validates the sizes, naming the flags of `role` (the name given to `role_placement`)."""
        require(self.num_nodes >= 1, f"--{role}_num_nodes must be >= 1")
        require(self.num_gpus_per_node >= 0, f"--{role}_num_gpus_per_node must be >= 0")


def role_placement(role: str, whose: str, zero: str) -> Any:
    """A config field with the placement of `role`: flags --{role}_num_nodes and --{role}_num_gpus_per_node,
    help texts about `whose` ranks and what 0 ranks per node means (`zero`)."""
    return field(default_factory=RolePlacement,
                 metadata={"flag_prefix": f"{role}_", "help_vars": {"whose": whose, "zero": zero}})


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters (peft) on the trained models (actor, critic, the supervised jobs' model); frozen models
    (reference, reward, teacher) never get them. OpenRLHF's flags and defaults."""

    lora_rank: int = opt(0, "rank of the LoRA adapters (0: train every weight, no adapters)")
    lora_alpha: int = opt(16, "LoRA scale numerator: the update is lora_alpha / lora_rank x B @ A")
    target_modules: tuple[str, ...] = opt(("all-linear",), "names of the modules that get adapters (all-linear: "
                                          "every linear layer but the output layer and value head)", nargs="*")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input")
    load_in_4bit: bool = opt(False, "QLoRA: load the base weights in 4-bit NF4 (bitsandbytes; CUDA only; needs "
                             "--lora_rank > 0 and bf16)")

    def __post_init__(self) -> None:
        require(self.lora_rank >= 0, "--lora_rank must be >= 0 (0: no adapters)")
        require(self.lora_alpha > 0, "--lora_alpha must be > 0")
        require(0 <= self.lora_dropout < 1, "--lora_dropout must lie in [0, 1)")
        require(len(self.target_modules) > 0 and all(self.target_modules),
                "--target_modules needs at least one module name, e.g. --target_modules q_proj v_proj "
                "(default: all-linear)")
        require(not self.load_in_4bit or self.lora_rank > 0,
                "--load_in_4bit freezes the base weights in 4 bits: add --lora_rank (e.g. --lora_rank 64) so "
                "adapters are trained")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to load and how to run it (every job)."""

    pretrain: str | None = opt(None, "HF model directory of the model to train (not given: the embedded tiny demo "
                               "model, with the job's demo data where no dataset flag is given)")
    param_dtype: str = opt("bf16", "parameter dtype of every model: bf16, fp16 (CUDA) or fp32")
    bf16: bool = opt(False, "same as --param_dtype bf16 (older OpenRLHF scripts)")
    attn_implementation: str = opt("flash_attention_2", "transformers attention implementation (eager, sdpa, "
                                   "flash_attention_2, flex_attention); flash_attention_2 without CUDA and "
                                   "flash-attn: SDPA, with a warning")
    flash_attn: bool = opt(False, "same as --attn_implementation flash_attention_2 (older OpenRLHF scripts)")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    gradient_checkpointing_use_reentrant: bool = opt(False, "with --gradient_checkpointing: torch's reentrant "
                                                     "checkpoint variant (default: the non-reentrant one)")
    disable_fast_tokenizer: bool = opt(False, "load the slow (Python/sentencepiece) tokenizer instead of the fast "
                                       "one (use_fast=False)")
    trust_remote_code: bool = opt(False, "allow model/tokenizer code shipped inside the model directory")
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        require(not self.lora.load_in_4bit or self.param_dtype == "bf16",
                f"--load_in_4bit computes in bf16: drop --param_dtype {self.param_dtype} (bf16 is the default)")
        require(self.pretrain is None or bool(self.pretrain), "--pretrain must name a local HF model directory")
        require(self.param_dtype in PARAM_DTYPES, f"--param_dtype {self.param_dtype!r}: choose bf16, fp16 or fp32")
        require(not (self.bf16 and self.param_dtype != "bf16"),
                 f"--bf16 contradicts --param_dtype {self.param_dtype}: "
                 "give one of them")
        require(
            self.attn_implementation in ("eager", "sdpa", "flash_attention_2", "flex_attention"),
            f"--attn_implementation {self.attn_implementation!r}: choose eager, sdpa, flash_attention_2 "
            "or flex_attention",
        )

    @property
    def attn(self) -> str:
        return "flash_attention_2" if self.flash_attn else self.attn_implementation

    @property
    def dtype(self) -> torch.dtype:
        """torch dtype of parameters (and of vLLM's weights)."""
        import torch  # here, not at import: a refused command answers without loading torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.param_dtype]


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW, LR schedule and gradient clipping (every job; the learning rates are per job)."""

    lr_warmup_ratio: float = opt(0.03, "fraction of optimizer steps spent in linear warm-up")
    lr_scheduler: str = opt("cosine_with_min_lr", "transformers LR scheduler name (cosine_with_min_lr decays to "
                            "0.1 x the learning rate, as OpenRLHF)")
    adam_betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas", nargs=2)
    l2: float = opt(0.0, "AdamW weight decay")
    max_norm: float = opt(1.0, "gradient clipping norm (0 disables)")
    max_nonfinite_steps: int = opt(0, "optimizer steps with a non-finite loss or gradient to skip (gradients "
                                   "dropped, no update) before the run stops; 0: the first one stops it")

    def __post_init__(self) -> None:
        require(0 <= self.lr_warmup_ratio < 1, "--lr_warmup_ratio must lie in [0, 1)")
        require(0 <= self.lr_floor_ratio <= 1, "--min_lr_ratio must lie in [0, 1]")
        require(len(self.adam_betas) == 2, "--adam_betas takes two numbers, e.g. --adam_betas 0.9 0.95")
        require(self.max_norm >= 0, "--max_norm must be >= 0")
        require(self.max_nonfinite_steps >= 0, "--max_nonfinite_steps must be >= 0")

    @property
    def lr_floor_ratio(self) -> float:
        """cosine_with_min_lr's floor as a fraction of the learning rate: 0.1, which OpenRLHF v0.9.5 hard-codes in
        every job but train_dpo (its --min_lr_ratio, `DPOOptimConfig`)."""
        return DEFAULT_MIN_LR_RATIO


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """DeepSpeed and sequence layout (packing, dynamic batches, ring attention, Liger) of trainable models."""

    zero_stage: int = opt(2, "DeepSpeed ZeRO stage (0-3)")
    adam_offload: bool = opt(False, "keep AdamW states on the host (ZeRO offload)")
    overlap_comm: bool = opt(False, "overlap gradient reduction with backward")
    local_rank: int = opt(-1, "accepted for compatibility with deepspeed launchers; the environment wins")
    packing_samples: bool = opt(False, "pack each micro-batch's sequences into one padding-free row (varlen "
                                "attention: flash-attn on CUDA, exact per-sequence SDPA on CPU)")
    use_dynamic_batch: bool = opt(False, "cut micro-batches by token budget instead of sample count")
    train_max_tokens_per_gpu: int = opt(16192, "token budget of a training micro-batch per rank "
                                        "(--use_dynamic_batch)")
    ring_attn_size: int = opt(1, "ranks per ring-attention (sequence-parallel) group; > 1 packs the samples (as "
                              "--use_dynamic_batch does)")
    ring_head_stride: int = opt(1, "kv heads per ring pass (more heads per pass: fewer, larger messages)")
    use_liger_kernel: bool = opt(False, "patch models with Liger's fused kernels (RMSNorm, RoPE, SwiGLU; CUDA only)")
    zpg: int = opt(1, "ZeRO++ hierarchical partitioning (DeepSpeed zero_hpz_partition_size): at --zero_stage 3 each "
                   "group of this many consecutive ranks of a model keeps a secondary copy of its parameter shards, "
                   "so forward gathers stay inside the group (e.g. the GPUs of one node); 1: off")
    deepcompile: bool = opt(False, "compile the trained models with DeepSpeed's DeepCompile (engine.compile(); "
                            "CUDA only)")
    ds_tensor_parallel_size: int = opt(1, "DeepSpeed AutoTP tensor parallelism: each model's linear layers split "
                                       "over this many consecutive ranks of its role, which see the same samples "
                                       "(a role's data-parallel size is its ranks / this); --zero_stage 0-2")
    grad_accum_dtype: str | None = opt(None, "dtype gradients are accumulated and reduced in (DeepSpeed "
                                       "data_types.grad_accum_dtype): fp32, bf16 or fp16 (default: the parameter "
                                       "dtype; needs --zero_stage 1-3 to differ from it)")

    def __post_init__(self) -> None:
        require(self.zero_stage in (0, 1, 2, 3), f"--zero_stage {self.zero_stage}: choose 0, 1, 2 or 3")
        require(self.zpg >= 1, f"--zpg {self.zpg} must be >= 1 (1: no ZeRO++ hierarchical partitioning)")
        if self.zpg > 1 and self.zero_stage != 3:
            warnings.warn(f"--zpg {self.zpg} has no effect at --zero_stage {self.zero_stage}: ZeRO++ hierarchical "
                          "partitioning splits ZeRO-3's parameter shards; use --zero_stage 3", stacklevel=2)
        require(self.grad_accum_dtype in (None, *PARAM_DTYPES),
                f"--grad_accum_dtype {self.grad_accum_dtype!r}: choose fp32, bf16 or fp16")
        require(self.ring_attn_size >= 1, "--ring_attn_size must be >= 1")
        require(self.ring_head_stride >= 1, "--ring_head_stride must be >= 1")
        tp = self.ds_tensor_parallel_size
        require(tp >= 1, f"--ds_tensor_parallel_size {tp} must be >= 1 (1: no tensor parallelism)")
        if tp > 1:
            require(self.zero_stage < 3, f"--ds_tensor_parallel_size {tp} at --zero_stage 3 is not built: ZeRO-3 "
                    "builds each model already partitioned, before AutoTP could split its layers; use --zero_stage "
                    "0-2 (tensor parallelism inside a ZeRO-0/1/2 data-parallel group, as OpenRLHF)")
            require(self.ring_attn_size == 1, f"--ds_tensor_parallel_size {tp} with --ring_attn_size "
                    f"{self.ring_attn_size} is not built: choose one of them")
        needs_packing = [flag for flag, on in (("--ring_attn_size > 1", self.ring_attn_size > 1),
                                               ("--use_dynamic_batch", self.use_dynamic_batch)) if on]
        if needs_packing and not self.packing_samples:  # as OpenRLHF v0.9.5: packing on, with a warning
            verb = "work" if len(needs_packing) > 1 else "works"
            warnings.warn(f"{' and '.join(needs_packing)} {verb} on packed sequences: turning on --packing_samples",
                          stacklevel=2)
            object.__setattr__(self, "packing_samples", True)
        require(self.train_max_tokens_per_gpu >= 1, "--train_max_tokens_per_gpu must be >= 1")

    @property
    def replica_size(self) -> int:
        """Consecutive ranks of a role that hold the same samples: a ring (--ring_attn_size) or a tensor-parallel
        group (--ds_tensor_parallel_size). A role's data-parallel size is its ranks / this."""
        return self.ring_attn_size * self.ds_tensor_parallel_size

    @property
    def replica_groups(self) -> str:
        """What a replica is, for messages: "rings of --ring_attn_size R" or "tensor-parallel groups of
        --ds_tensor_parallel_size N"."""
        if self.ds_tensor_parallel_size > 1:
            return f"tensor-parallel groups of --ds_tensor_parallel_size {self.ds_tensor_parallel_size}"
        return f"rings of --ring_attn_size {self.ring_attn_size}"

    @property
    def hpz_size(self) -> int:
        """Ranks per ZeRO++ secondary-partition group: --zpg at ZeRO-3, else 1 (none)."""
        return self.zpg if self.zero_stage == 3 else 1


def check_tensor_parallel(model: ModelConfig, engine: EngineConfig) -> None:
    """--ds_tensor_parallel_size against what AutoTP here cannot split (every training job's root calls it)."""
    tp = engine.ds_tensor_parallel_size
    require(tp == 1 or not model.lora.enabled, f"--ds_tensor_parallel_size {tp} with --lora_rank is not built: "
            "AutoTP would split the base layers under peft's adapters; drop one of them")


def check_grad_accum(model: ModelConfig, engine: EngineConfig) -> None:
    """--grad_accum_dtype against the parameter dtype and ZeRO stage (every training job's root calls it)."""
    accum = engine.grad_accum_dtype
    if accum is None or accum == model.param_dtype:
        return
    require(engine.zero_stage > 0, f"--grad_accum_dtype {accum} differs from --param_dtype {model.param_dtype}, "
            "which DeepSpeed without ZeRO cannot do (it accumulates in the parameter dtype): use --zero_stage 1-3 "
            "or drop --grad_accum_dtype")
    bf16_optimizer = engine.zero_stage == 1 and model.param_dtype == "bf16" and accum == "fp32"
    require(not bf16_optimizer or engine.adam_offload,
            "--grad_accum_dtype fp32 with bf16 parameters at --zero_stage 1 makes DeepSpeed switch to its "
            "BF16_Optimizer, whose gradients this build's non-finite checks and offload do not read: use "
            "--zero_stage 2 (or 3), or --adam_offload")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where results, metrics and logs go."""

    save_path: str = opt("./ckpt", "output directory: metrics.jsonl and the final model")
    use_tensorboard: str | None = opt(None, "TensorBoard log directory")
    use_wandb: str | None = opt(None, "log to Weights & Biases (value: API key, or 'True' for an existing login)")
    wandb_project: str = opt("openrlhf_train_ppo", "wandb project")
    wandb_group: str | None = opt(None, "wandb group")
    wandb_run_name: str | None = opt(None, "wandb run name")
    wandb_org: str | None = opt(None, "wandb entity (team or user) the run is logged under (default: your default "
                                "entity)")
    logging_steps: int = opt(1, "log every N steps")
    eval_steps: int = opt(-1, "with --eval_dataset, evaluate every N steps, besides before the first step and "
                          "after the last (-1: train_ppo only then; the supervised and preference jobs also once "
                          "per epoch)")
    verbose: bool = opt(False, "show all third-party library output on the console, unfiltered, from every rank")
    perf: bool = opt(False, "at the end print a throughput summary: tokens/s, TFLOP/s per rank, MFU and seconds per "
                     "stage, averaged over the steps after the first (every step logs them as perf/* and time/*)")
    peak_tflops: float | None = opt(None, "one device's peak TFLOP/s for perf/mfu (not an OpenRLHF flag; default: "
                                    "the GPU's dense bf16 peak from a table of common GPUs; on CPU no MFU)")
    no_plots: bool = opt(False, "do not draw the main curves into SAVE_PATH/plots at the end (not an OpenRLHF flag; "
                         "metrics.jsonl keeps them: `python -m rlhf.cli.plot SAVE_PATH` draws them later)")

    def __post_init__(self) -> None:
        require(self.logging_steps >= 1, "--logging_steps must be >= 1")
        require(self.peak_tflops is None or self.peak_tflops > 0, "--peak_tflops must be > 0")
        require(self.eval_steps == -1 or self.eval_steps >= 1, "--eval_steps must be -1 (the default schedule) or >= 1")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Training checkpoints for exact resume."""

    save_steps: int = opt(-1, "write a checkpoint every N steps (-1: never)")
    ckpt_path: str = opt("./ckpt/checkpoints_ppo_ray", "directory of training checkpoints")
    load_checkpoint: bool = opt(False, "resume from the newest complete checkpoint under --ckpt_path, if any")
    max_ckpt_num: int = opt(3, "keep at most this many checkpoints")
    max_ckpt_mem: float = opt(1e8, "keep checkpoints within this many GiB (the newest is always kept)")
    disable_ds_ckpt: bool = opt(False, "do not write optimizer states (the run then cannot resume exactly)")
    save_hf_ckpt: bool = opt(False, "also write the trained model in HF format into each checkpoint")
    async_save: bool = opt(False, "write each checkpoint in the background: the step waits only while its state "
                           "is copied into host memory (one checkpoint's size per rank, held until written), and the "
                           "checkpoint is complete once every rank has written it, at a later step's end or the "
                           "run's; the HF export (--save_hf_ckpt) is still written at once (not an OpenRLHF flag)")
    use_ds_universal_ckpt: bool = opt(False, "resume through DeepSpeed's universal checkpoint form (one file per "
                                      "parameter, made from the checkpoint on first use and kept beside it) even "
                                      "when the layout is unchanged; a resume at another world size, ZeRO stage or "
                                      "placement uses it without this flag")

    def __post_init__(self) -> None:
        require(self.save_steps == -1 or self.save_steps >= 1, "--save_steps must be -1 or >= 1")
        require(self.max_ckpt_num >= 1, "--max_ckpt_num must be >= 1")
        require(self.max_ckpt_mem > 0, "--max_ckpt_mem must be > 0")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The settings of every run that starts through `rlhf.core.run.start`. `IGNORED_FLAGS`: a job's own flags
    accepted with a note (flag -> why; `IGNORED_SWITCHES` take no value), beside the ones every job ignores."""

    IGNORED_FLAGS: ClassVar[dict[str, str]] = {}
    IGNORED_SWITCHES: ClassVar[frozenset[str]] = frozenset()

    seed: int = opt(42, "random seed (every rank derives its streams from it)")
    full_determinism: bool = opt(False, "use deterministic torch algorithms")
    dist_timeout: float = opt(30.0, "minutes a collective waits for the other ranks before the run fails")
    watchdog_interval: float = opt(120.0, "every N seconds without progress, each rank prints to stderr the "
                                   "stage it is in and since when (0: off)")
    dry_run: ClassVar[bool] = False  # a job with a memory plan has the flag (`JobConfig`)

    def __post_init__(self) -> None:
        require(self.dist_timeout > 0, "--dist_timeout must be > 0 (minutes)")
        require(self.watchdog_interval >= 0, "--watchdog_interval must be >= 0 (seconds; 0 turns it off)")


@dataclass(frozen=True, kw_only=True)
class JobConfig(RunConfig):
    """The run-wide settings every job's root config starts with: a run's, and the memory plan's."""

    dry_run: bool = opt(False, "check the flags and inputs, print the rank plan and each rank's estimated peak memory "
                        "per stage, say whether it fits --gpu_memory_gb, and exit: no engine starts, no weights "
                        "load (not an OpenRLHF flag)")
    gpu_memory_gb: float | None = opt(None, "GiB of one device the memory plan checks against (default: the visible "
                                      "GPU's; on CPU the plan says fits only with this given; not an OpenRLHF flag)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.gpu_memory_gb is None or self.gpu_memory_gb > 0, "--gpu_memory_gb must be > 0 (GiB)")
