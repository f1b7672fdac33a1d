"""The config roots of the preference jobs: `train_dpo` and `train_kto` (against a frozen reference policy,
with OpenRLHF v0.9.5's flag names and per-job defaults) and the reference-free `train_simpo` and `train_orpo`
(defaults of their papers); the shared sub-configs, each job's loss settings and dataset columns. Knows
nothing of argparse or of training.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from rlhf.assets import EMBEDDED_PAIRS, EMBEDDED_PAIRS_EVAL
from rlhf.config.shared_config import (
    DEFAULT_MIN_LR_RATIO,
    CheckpointConfig,
    EngineConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    RolePlacement,
    check_grad_accum,
    check_tensor_parallel,
    opt,
    require,
    role_placement,
)
from rlhf.config.supervised_config import (
    SUPERVISED_PENDING_FLAGS,
    FormattedDataConfig,
    LearningRateConfig,
    PairDataConfig,
    SupervisedBatchConfig,
    _with_demo,
)


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    """The frozen reference policy the preference losses are measured against."""

    ref_pretrain: str | None = opt(None, "HF model directory of the reference (default: --pretrain)")
    ref_offload: bool = opt(False, "keep the reference's parameters in host memory outside its forward "
                            "(below ZeRO-3; at ZeRO-3 they are sharded over the ranks instead)")
    placement: RolePlacement = role_placement("ref", "the reference's own", "0: the reference is colocated "
                                              "with the trained model on every rank; else the last ranks of the world")

    def __post_init__(self) -> None:
        self.placement.check("ref")

    @property
    def num_ranks(self) -> int:
        """The reference's own ranks (0: colocated with the trained model)."""
        return self.placement.num_ranks


@dataclass(frozen=True, kw_only=True)
class PreferenceBaseConfig(JobConfig):
    """What every preference root has: the trained model, its optimizer, engine and batches."""

    PENDING_FLAGS: ClassVar[tuple[str, ...]] = SUPERVISED_PENDING_FLAGS
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: LearningRateConfig = field(default_factory=lambda: LearningRateConfig(learning_rate=1e-5))
    engine: EngineConfig = field(default_factory=EngineConfig)
    batch: SupervisedBatchConfig = field(default_factory=lambda: SupervisedBatchConfig(max_epochs=1))
    aux_loss_coef: float = opt(0.0, "MoE auxiliary loss coefficient (models that return aux_loss)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_grad_accum(self.model, self.engine)
        check_tensor_parallel(self.model, self.engine)
        require(self.aux_loss_coef >= 0, "--aux_loss_coef must be >= 0")
        if self.aux_loss_coef:
            warnings.warn(f"--aux_loss_coef {self.aux_loss_coef} has no effect in the preference jobs of this build: "
                          "the MoE auxiliary loss is not added", stacklevel=2)


@dataclass(frozen=True, kw_only=True)
class PreferenceJobConfig(PreferenceBaseConfig):
    """What the preference roots with a frozen reference policy (DPO, KTO) check."""

    ref: ReferenceConfig = field(default_factory=ReferenceConfig)
    beta: float = opt(0.1, "strength of the KL regularisation towards the reference (the implicit reward's scale)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.beta > 0, "--beta must be positive")
        if self.ref.num_ranks:
            require(self.engine.ring_attn_size == 1, "a reference on its own ranks serves whole sequences: drop "
                    "--ring_attn_size or colocate the reference (--ref_num_gpus_per_node 0)")
            require(self.engine.ds_tensor_parallel_size == 1, "a reference on its own ranks with "
                    "--ds_tensor_parallel_size is not built (its service answers each trainer rank point to point): "
                    "drop one or colocate the reference (--ref_num_gpus_per_node 0)")
        if self.ref.ref_offload and (self.engine.zero_stage == 3 or self.ref.num_ranks):
            warnings.warn("--ref_offload has no effect " + ("at --zero_stage 3: the reference's parameters are "
                          "already sharded over the ranks" if not self.ref.num_ranks else
                          "with the reference on its own ranks"), stacklevel=2)

    @property
    def ref_path(self) -> str:
        return self.ref.ref_pretrain or self.model.pretrain


@dataclass(frozen=True, kw_only=True)
class DPOOptimConfig(LearningRateConfig):
    """train_dpo's optimizer settings: OpenRLHF v0.9.5 lets only this job set the cosine schedule's floor."""

    min_lr_ratio: float = opt(DEFAULT_MIN_LR_RATIO, "with --lr_scheduler cosine_with_min_lr: the learning rate decays "
                              "to this fraction of --learning_rate")

    @property
    def lr_floor_ratio(self) -> float:
        return self.min_lr_ratio


@dataclass(frozen=True, kw_only=True)
class TrainDPOConfig(PreferenceJobConfig):
    """Everything `train_dpo` needs."""

    optim: DPOOptimConfig = field(default_factory=lambda: DPOOptimConfig(learning_rate=1e-5))
    data: PairDataConfig = field(default_factory=lambda: PairDataConfig(max_len=512, eval_split="test"))
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(wandb_project="openrlhf_train_dpo"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(
        ckpt_path="./ckpt/checkpoints_dpo"))
    ipo: bool = opt(False, "IPO loss (h - 1 / (2 beta))^2 instead of DPO's sigmoid loss")
    label_smoothing: float = opt(0.0, "cDPO: the assumed share of flipped preference labels (0: plain DPO)")
    nll_loss_coef: float = opt(0.0, "add this x the chosen responses' per-token NLL (Llama 3.1's regulariser)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.label_smoothing < 0.5, "--label_smoothing must lie in [0, 0.5)")
        require(self.nll_loss_coef >= 0, "--nll_loss_coef must be >= 0")
        if self.ipo and self.label_smoothing:
            warnings.warn(f"--label_smoothing {self.label_smoothing} has no effect with --ipo (IPO's loss has no "
                          "label smoothing, as in OpenRLHF)", stacklevel=2)
        _no_margin_loss(self, "train_dpo")

    def with_demo_defaults(self) -> TrainDPOConfig:
        return _with_demo(self, EMBEDDED_PAIRS, EMBEDDED_PAIRS_EVAL, prompt_key=self.data.prompt_key or "prompt",
                          eval_split="train")


def _no_margin_loss(cfg, job: str) -> None:
    if cfg.data.margin_loss:
        warnings.warn(f"--margin_loss has no effect in {job} (it is a reward-model loss)", stacklevel=3)


@dataclass(frozen=True, kw_only=True)
class ReferenceFreePairConfig(PreferenceBaseConfig):
    """What the reference-free pair roots (SimPO, ORPO, CPO) share: preference pairs and the embedded demo."""

    data: PairDataConfig = field(default_factory=lambda: PairDataConfig(max_len=512, eval_split="test"))

    def with_demo_defaults(self):
        return _with_demo(self, EMBEDDED_PAIRS, EMBEDDED_PAIRS_EVAL, prompt_key=self.data.prompt_key or "prompt",
                          eval_split="train")


@dataclass(frozen=True, kw_only=True)
class TrainSimPOConfig(ReferenceFreePairConfig):
    """Everything `train_simpo` needs (defaults: the SimPO authors' beta 2.0 and gamma = 0.5 beta)."""

    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(wandb_project="train_simpo"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(
        ckpt_path="./ckpt/checkpoints_simpo"))
    beta: float = opt(2.0, "scale of the implicit reward, beta x the response's average log-prob")
    simpo_gamma: float = opt(1.0, "target reward margin gamma: the loss is -log sigmoid(beta (chosen - rejected "
                             "average log-prob) - gamma)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.beta > 0, "--beta must be positive")
        require(self.simpo_gamma >= 0, "--simpo_gamma must be >= 0")
        _no_margin_loss(self, "train_simpo")


@dataclass(frozen=True, kw_only=True)
class TrainORPOConfig(ReferenceFreePairConfig):
    """Everything `train_orpo` needs (default: the ORPO paper's lambda 0.1)."""

    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(wandb_project="train_orpo"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(
        ckpt_path="./ckpt/checkpoints_orpo"))
    orpo_lambda: float = opt(0.1, "weight lambda of the odds-ratio term: the loss is the chosen responses' NLL + "
                             "lambda x -log sigmoid(log odds ratio of chosen over rejected)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.orpo_lambda >= 0, "--orpo_lambda must be >= 0")
        _no_margin_loss(self, "train_orpo")


@dataclass(frozen=True, kw_only=True)
class UnpairedDataConfig(FormattedDataConfig):
    """Labelled responses (or preference pairs, split into a desirable and an undesirable response)."""

    input_key: str = opt("input", "column of the prompt")
    output_key: str | None = opt(None, "column of the response")
    label_key: str = opt("label", "column of the label: true for a desirable response, false for an undesirable one")
    chosen_key: str = opt("chosen", "rows without --label_key but with this and --rejected_key are preference "
                          "pairs: the chosen response is desirable, the rejected one undesirable")
    rejected_key: str = opt("rejected", "column of a pair's rejected response (see --chosen_key)")


@dataclass(frozen=True, kw_only=True)
class TrainKTOConfig(PreferenceJobConfig):
    """Everything `train_kto` needs."""

    data: UnpairedDataConfig = field(default_factory=lambda: UnpairedDataConfig(
        input_template="User: {}\nAssistant: ", eval_split="test"))
    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(wandb_project="openrlhf_train_kto"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(
        ckpt_path="./ckpt/checkpoints_kto"))
    beta: float = opt(0.01, "strength of the KL regularisation towards the reference (the implicit reward's scale)")
    desirable_loss_weight: float = opt(1.0, "weight of the desirable responses' loss")
    undesirable_loss_weight: float = opt(1.0, "weight of the undesirable responses' loss")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.desirable_loss_weight > 0 and self.undesirable_loss_weight > 0,
                "--desirable_loss_weight and --undesirable_loss_weight must be positive")

    def with_demo_defaults(self) -> TrainKTOConfig:
        return _with_demo(self, EMBEDDED_PAIRS, EMBEDDED_PAIRS_EVAL, input_key="prompt", eval_split="train")


@dataclass(frozen=True, kw_only=True)
class TrainCPOConfig(ReferenceFreePairConfig):
    """Everything `train_cpo` needs (defaults: TRL's CPOTrainer, beta 0.1 and alpha 1.0)."""

    logging: LoggingConfig = field(default_factory=lambda: LoggingConfig(wandb_project="train_cpo"))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(
        ckpt_path="./ckpt/checkpoints_cpo"))
    beta: float = opt(0.1, "scale of the implicit reward, beta x the response's log-prob")
    cpo_alpha: float = opt(1.0, "weight of the chosen responses' NLL: the loss is -log sigmoid(beta (chosen - "
                           "rejected log-prob)) + alpha x NLL(chosen)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.beta > 0, "--beta must be positive")
        require(self.cpo_alpha >= 0, "--cpo_alpha must be >= 0")
        _no_margin_loss(self, "train_cpo")
