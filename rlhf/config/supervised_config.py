"""The config roots of the supervised jobs (`train_sft`, `train_rm`, `train_prm`, `train_kd`): the shared
sub-configs of `rlhf.config.shared_config`, a learning rate, a global batch, and each job's dataset columns, with
OpenRLHF v0.9.5's flag names and per-job defaults. Knows nothing of argparse or of training.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import ClassVar

from rlhf.assets import (
    EMBEDDED_MODEL_DIR,
    EMBEDDED_PAIRS,
    EMBEDDED_PAIRS_EVAL,
    EMBEDDED_PRM,
    EMBEDDED_PRM_EVAL,
    EMBEDDED_PRM_PLACEHOLDER,
    EMBEDDED_PRM_REWARD_TOKENS,
    EMBEDDED_SFT,
    EMBEDDED_SFT_EVAL,
)
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
    require,
    role_placement,
)

SUPERVISED_PENDING_FLAGS = DEEPSPEED_PENDING_FLAGS
"""OpenRLHF flags of the supervised jobs whose features are not built yet: refused, never silently ignored."""

DEMO_TEMPLATE = "{} "
"""The embedded demo data's --input_template: its word-level tokenizer splits on spaces, so prompt and
response need one between them (OpenRLHF's default "User: {}\\nAssistant: " is not in its vocabulary)."""


@dataclass(frozen=True, kw_only=True)
class LearningRateConfig(OptimConfig):
    """The shared optimizer settings and the one learning rate of a supervised job."""

    learning_rate: float = opt(5e-6, "learning rate")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.learning_rate > 0, "--learning_rate must be positive")


@dataclass(frozen=True, kw_only=True)
class SupervisedBatchConfig:
    """Global batch, micro-batches and passes over the dataset."""

    train_batch_size: int = opt(128, "samples per optimizer step, over all ranks")
    micro_train_batch_size: int = opt(8, "samples per forward/backward, per rank")
    max_epochs: int = opt(2, "passes over the dataset")
    max_steps: int | None = opt(None, "stop after this many optimizer steps (default: until the epochs end)")

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "micro_train_batch_size", "max_epochs"):
            require(getattr(self, name) >= 1, f"--{name} must be >= 1")
        require(self.max_steps is None or self.max_steps >= 1, "--max_steps must be >= 1")


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """Where a supervised job's samples come from and how they are formatted (every supervised job)."""

    dataset: str | None = opt(None, "training data: comma-separated local JSON/JSONL/parquet files or directories, "
                              "HF save_to_disk directories, or json@DIR (not given with --pretrain: an error; "
                              "without --pretrain: the embedded demo data)")
    dataset_probs: str | None = opt(None, "sampling probabilities of the --dataset sources, comma separated")
    dataset_split: str = opt("train", "split to read from directories and saved datasets with splits")
    eval_dataset: str | None = opt(None, "held-out data in the same format (evaluated every --eval_steps, or once "
                                   "per epoch with --eval_steps -1)")
    eval_split: str = opt("train", "split of --eval_dataset")
    max_samples: int = opt(1_000_000, "read at most this many samples (per source, then in all)")
    max_len: int = opt(2048, "maximum tokens per sample (longer ones are cut, as in OpenRLHF)")

    def __post_init__(self) -> None:
        require(self.max_samples >= 1, "--max_samples must be >= 1")
        require(self.max_len >= 2, "--max_len must be >= 2")


@dataclass(frozen=True, kw_only=True)
class FormattedDataConfig(DatasetConfig):
    """A dataset whose prompts are formatted with a template or the tokenizer's chat template."""

    input_template: str | None = opt(None, "format string with one {} wrapped around each prompt")
    apply_chat_template: bool = opt(False, "format with the tokenizer's chat template")
    tokenizer_chat_template: str | None = opt(None, "a Jinja chat template overriding the tokenizer's")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.input_template is not None:
            require(self.input_template.count("{}") == 1,
                    f"--input_template {self.input_template!r} must contain exactly one '{{}}' for the prompt")


@dataclass(frozen=True, kw_only=True)
class SFTDataConfig(FormattedDataConfig):
    """SFT columns and loss masks."""

    input_key: str = opt("input", "column of the prompt (or of the messages with --apply_chat_template)")
    output_key: str | None = opt(None, "column of the response")
    multiturn: bool = opt(False, "loss on every assistant turn of a conversation (with --apply_chat_template)")
    pretrain_mode: bool = opt(False, "loss on every token of --input_key (continued pretraining)")


DEMO_MAX_LEN = 64
"""--max_len of the embedded demo where the default (OpenRLHF's, sized for real models) is still set: the demo
model has 256 positions; its copy-task rows are shorter than 64 tokens."""


def _with_demo(cfg, data_path: str, eval_path: str, **data_changes):
    """`cfg` with the embedded demo model and, where no --dataset was given, the demo data (its template where
    the default one is still set), and `DEMO_MAX_LEN` where the default --max_len is still set. With --pretrain
    nothing is filled in; --dataset is then required."""
    if cfg.model.pretrain is not None:
        require(cfg.data.dataset is not None, f"--pretrain {cfg.model.pretrain} is given but --dataset is not: "
                "name the training data (the embedded demo data is used only without --pretrain)")
        return cfg
    data = cfg.data
    if data.dataset is None:
        changes = {"dataset": data_path, "eval_dataset": data.eval_dataset or eval_path, **data_changes}
        if isinstance(data, FormattedDataConfig) and not data.apply_chat_template \
                and data.input_template == type(cfg)().data.input_template:  # the job's default template
            changes["input_template"] = DEMO_TEMPLATE
        data = replace(data, **changes)
    if data.max_len == type(cfg)().data.max_len:
        data = replace(data, max_len=DEMO_MAX_LEN)
    return replace(cfg, model=replace(cfg.model, pretrain=EMBEDDED_MODEL_DIR), data=data)


@dataclass(frozen=True, kw_only=True)
class TrainSFTConfig(JobConfig):
    """Everything `train_sft` needs."""

    PENDING_FLAGS: ClassVar[tuple[str, ...]] = SUPERVISED_PENDING_FLAGS
    IGNORED_FLAGS: ClassVar[dict[str, str]] = {
        "train_split": "OpenRLHF v0.9.5 defines it but reads the training split from --dataset_split; so does "
                       "train_sft here",
    }
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: LearningRateConfig = field(default_factory=LearningRateConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: SFTDataConfig = field(default_factory=lambda: SFTDataConfig(input_template="User: {}\nAssistant: "))
    batch: SupervisedBatchConfig = field(default_factory=SupervisedBatchConfig)
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(wandb_project="openrlhf_train_sft"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(
        ckpt_path="./ckpt/checkpoints_sft"))
    aux_loss_coef: float = opt(0.0, "MoE auxiliary loss coefficient (models that return aux_loss)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_grad_accum(self.model, self.engine)
        check_tensor_parallel(self.model, self.engine)
        require(self.aux_loss_coef >= 0, "--aux_loss_coef must be >= 0")
        if self.data.multiturn and not self.data.apply_chat_template:
            require(False, "--multiturn finds the assistant turns with the chat template: add --apply_chat_template")

    def with_demo_defaults(self) -> TrainSFTConfig:
        return _with_demo(self, EMBEDDED_SFT, EMBEDDED_SFT_EVAL, output_key=self.data.output_key or "output")



@dataclass(frozen=True, kw_only=True)
class PairDataConfig(FormattedDataConfig):
    """Preference-pair columns."""

    prompt_key: str | None = opt(None, "column of the prompt (not given: chosen/rejected hold whole texts)")
    chosen_key: str = opt("chosen", "column of the preferred response")
    rejected_key: str = opt("rejected", "column of the rejected response")
    margin_loss: bool = opt(False, "subtract each pair's margin (column 'margin') inside the sigmoid loss")


@dataclass(frozen=True, kw_only=True)
class ScalarHeadModelConfig(ModelConfig):
    """The model, and the name of the scalar head put on it."""

    value_head_prefix: str = opt("score", "attribute name of the scalar head (saved as <prefix>.weight)")


PAIRWISE_LOSS_NAMES = ("sigmoid", "logexp")


@dataclass(frozen=True, kw_only=True)
class TrainRMConfig(JobConfig):
    """Everything `train_rm` needs."""

    PENDING_FLAGS: ClassVar[tuple[str, ...]] = SUPERVISED_PENDING_FLAGS
    IGNORED_FLAGS: ClassVar[dict[str, str]] = {
        "compute_fp32_loss": "the pairwise loss always runs in float32 here (the scalar head's rewards are cast to "
                             "float32 before it), which is what this flag asks OpenRLHF for",
    }
    IGNORED_SWITCHES: ClassVar[frozenset[str]] = frozenset({"compute_fp32_loss"})
    model: ScalarHeadModelConfig = field(default_factory=ScalarHeadModelConfig)
    optim: LearningRateConfig = field(default_factory=lambda: LearningRateConfig(learning_rate=9e-6))
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: PairDataConfig = field(default_factory=lambda: PairDataConfig(max_len=512))
    batch: SupervisedBatchConfig = field(default_factory=lambda: SupervisedBatchConfig(micro_train_batch_size=1,
                                                                                       max_epochs=1))
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(wandb_project="openrlhf_train_rm"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(ckpt_path="./ckpt/checkpoints_rm"))
    loss: str = opt("sigmoid", "pairwise loss: sigmoid (-log sigmoid(chosen - rejected [- margin])) or logexp "
                    "(log(1 + exp(rejected - chosen)), no margin)")
    aux_loss_coef: float = opt(0.0, "MoE auxiliary loss coefficient (models that return aux_loss)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_grad_accum(self.model, self.engine)
        check_tensor_parallel(self.model, self.engine)
        require(self.loss in PAIRWISE_LOSS_NAMES, f"--loss {self.loss!r}: choose sigmoid or logexp")
        require(self.aux_loss_coef >= 0, "--aux_loss_coef must be >= 0")
        if self.aux_loss_coef:
            warnings.warn(f"--aux_loss_coef {self.aux_loss_coef} has no effect in train_rm: the scalar-head model "
                          "does not return the MoE auxiliary loss in this build", stacklevel=2)
        if self.data.margin_loss and self.loss == "logexp":
            warnings.warn("--margin_loss has no effect with --loss logexp (its loss has no margin, as in OpenRLHF); "
                          "use --loss sigmoid", stacklevel=2)

    def with_demo_defaults(self) -> TrainRMConfig:
        return _with_demo(self, EMBEDDED_PAIRS, EMBEDDED_PAIRS_EVAL, prompt_key=self.data.prompt_key or "prompt")


@dataclass(frozen=True, kw_only=True)
class PRMDataConfig(DatasetConfig):
    """Step-labelled answers: one --placeholder_token after each step, one label per placeholder."""

    input_key: str = opt("input", "column of the text with a placeholder token after each step")
    label_key: str = opt("label", "column of the per-step labels (reward-token strings, or probabilities of the "
                         "first reward token)")
    placeholder_token: str | None = opt(None, "the token after each step whose logits are scored (required)")
    reward_tokens: tuple[str, ...] | None = opt(None, "the label tokens, the positive one first (not given: the "
                                                "labels are vocabulary tokens and every token competes)",
                                                nargs="*")


@dataclass(frozen=True, kw_only=True)
class TrainPRMConfig(JobConfig):
    """Everything `train_prm` needs."""

    PENDING_FLAGS: ClassVar[tuple[str, ...]] = SUPERVISED_PENDING_FLAGS
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: LearningRateConfig = field(default_factory=lambda: LearningRateConfig(learning_rate=1e-6))
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: PRMDataConfig = field(default_factory=lambda: PRMDataConfig(eval_split="test"))
    batch: SupervisedBatchConfig = field(default_factory=lambda: SupervisedBatchConfig(micro_train_batch_size=1,
                                                                                       max_epochs=1))
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(wandb_project="openrlhf_train_prm"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(
        ckpt_path="./ckpt/checkpoints_prm"))
    aux_loss_coef: float = opt(0.0, "MoE auxiliary loss coefficient (models that return aux_loss)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_grad_accum(self.model, self.engine)
        check_tensor_parallel(self.model, self.engine)
        require(self.aux_loss_coef >= 0, "--aux_loss_coef must be >= 0")

    def with_demo_defaults(self) -> TrainPRMConfig:
        cfg = _with_demo(self, EMBEDDED_PRM, EMBEDDED_PRM_EVAL, eval_split="train",
                         placeholder_token=self.data.placeholder_token or EMBEDDED_PRM_PLACEHOLDER,
                         reward_tokens=self.data.reward_tokens or EMBEDDED_PRM_REWARD_TOKENS)
        require(cfg.data.placeholder_token is not None, "--placeholder_token is required: the token after each "
                "step (e.g. --placeholder_token ки for Math-Shepherd data)")
        return cfg


@dataclass(frozen=True, kw_only=True)
class TeacherConfig:
    """The frozen teacher of knowledge distillation."""

    teacher_model: str | None = opt(None, "HF model directory of the teacher (required; it must share the "
                                    "student's tokenizer/vocabulary)")
    kd_coef: float = opt(0.4, "loss = (1 - kd_coef) x NLL + kd_coef x distillation (the cross-entropy to the "
                          "teacher's distribution: forward KL plus the teacher's entropy, the same gradient)")
    teacher_offload: bool = opt(False, "keep the teacher's parameters in host memory outside its forward "
                                "(below ZeRO-3; at ZeRO-3 they are sharded over the ranks instead)")
    placement: RolePlacement = role_placement("teacher", "the teacher's own", "0: the teacher is colocated with "
                                              "the student on every rank; else the last ranks of the world")

    def __post_init__(self) -> None:
        require(0 <= self.kd_coef <= 1, "--kd_coef must lie in [0, 1]")
        self.placement.check("teacher")

    @property
    def num_ranks(self) -> int:
        """The teacher's own ranks (0: colocated with the student)."""
        return self.placement.num_ranks


@dataclass(frozen=True, kw_only=True)
class TrainKDConfig(JobConfig):
    """Everything `train_kd` needs."""

    PENDING_FLAGS: ClassVar[tuple[str, ...]] = SUPERVISED_PENDING_FLAGS
    model: ModelConfig = field(default_factory=ModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    optim: LearningRateConfig = field(default_factory=LearningRateConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: SFTDataConfig = field(default_factory=lambda: SFTDataConfig(input_template="User: {}\nAssistant: ",
                                                                      output_key="output", eval_split="test"))
    batch: SupervisedBatchConfig = field(default_factory=lambda: SupervisedBatchConfig(max_epochs=1))
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(wandb_project="openrlhf_train_kd"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(ckpt_path="./ckpt/checkpoints_kd"))
    aux_loss_coef: float = opt(0.0, "MoE auxiliary loss coefficient (models that return aux_loss)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_grad_accum(self.model, self.engine)
        check_tensor_parallel(self.model, self.engine)
        require(self.aux_loss_coef >= 0, "--aux_loss_coef must be >= 0")
        if self.aux_loss_coef:
            warnings.warn(f"--aux_loss_coef {self.aux_loss_coef} has no effect in train_kd: its loss is the NLL and "
                          "the distillation term only (as in OpenRLHF)", stacklevel=2)
        if self.teacher.num_ranks:
            require(self.engine.ring_attn_size == 1, "a teacher on its own ranks serves whole sequences: drop "
                    "--ring_attn_size or colocate the teacher (--teacher_num_gpus_per_node 0)")
            require(self.engine.ds_tensor_parallel_size == 1, "a teacher on its own ranks with "
                    "--ds_tensor_parallel_size is not built (its service answers each student rank point to point): "
                    "drop one or colocate the teacher (--teacher_num_gpus_per_node 0)")
        if self.teacher.teacher_offload and self.engine.zero_stage == 3:
            warnings.warn("--teacher_offload has no effect at --zero_stage 3: the teacher's parameters are already "
                          "sharded over the ranks", stacklevel=2)
        if self.data.multiturn and not self.data.apply_chat_template:
            require(False, "--multiturn finds the assistant turns with the chat template: add --apply_chat_template")

    def with_demo_defaults(self) -> TrainKDConfig:
        require(self.teacher.teacher_model is not None, "--teacher_model is required: the HF directory of the "
                "teacher (e.g. a model trained with train_sft); it must share the student's vocabulary")
        return _with_demo(self, EMBEDDED_SFT, EMBEDDED_SFT_EVAL, eval_split="train")
