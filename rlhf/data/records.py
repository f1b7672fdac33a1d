"""Typed records passed between stages of one RL step.

Shape legend used across the package: B = samples in a batch, T = sequence positions (prompt +
response, right-padded), T1 = T - 1 next-token positions (index t scores token t + 1), P = prompts,
N = samples per prompt, V = vocabulary. Log-prob tensors are float32 and aligned with
`sequences_BT[:, 1:]`; `action_mask_BT1` is 1 exactly where that target token was generated
(EOS included) and 0 on prompt and padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, TypeVar

import torch

BatchT = TypeVar("BatchT", bound="TokenBatch")


class TokenBatch:
    """Select and trim for right-padded batch dataclasses. Every tensor field has the samples on dim 0;
    each 2-D field has T columns (aligned with the tokens) or T - 1 (next-token positions); fields named
    in `_masks` are attention masks [B, T] that say which columns hold tokens. None fields stay None."""

    _masks: ClassVar[tuple[str, ...]] = ("attention_mask_BT",)

    @property
    def num_samples(self) -> int:
        return getattr(self, fields(self)[0].name).shape[0]

    def select(self: BatchT, index: torch.Tensor | slice) -> BatchT:
        """The samples at `index` (int64 indices, a bool mask or a slice over dim 0)."""
        return replace(self, **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                                for f in fields(self)})

    def trimmed(self: BatchT) -> BatchT:
        """The same samples without the trailing columns that are padding in every row (one column kept
        at least)."""
        width = getattr(self, self._masks[0]).shape[1]
        used = torch.zeros(width, dtype=torch.bool)
        for name in self._masks:
            used |= getattr(self, name).bool().any(0)
        length = max(int(used.nonzero().max()) + 1 if used.any() else 0, 1)

        def trim(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                return t
            assert t.shape[1] in (width, width - 1), f"column count {t.shape[1]} is neither T={width} nor T-1"
            return t[:, :length] if t.shape[1] == width else t[:, :length - 1]

        return replace(self, **{f.name: trim(getattr(self, f.name)) for f in fields(self)})


@dataclass
class Rollout:
    """Samples produced by a rollout engine on this rank; samples of one prompt are contiguous.

    sequences_BT: int64 [B, T] prompt then response tokens, right-padded with the pad id.
    attention_mask_BT: int64 [B, T] 1 on real tokens.
    action_mask_BT1: float32 [B, T-1] 1 on generated target positions (several spans for an agent
        episode: the environment's tokens between turns are 0).
    rollout_logprobs_BT1: float32 [B, T-1] engine log-probs of generated tokens (0 elsewhere).
    """

    sequences_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT1: torch.Tensor
    rollout_logprobs_BT1: torch.Tensor
    prompt_lens_B: torch.Tensor
    response_lens_B: torch.Tensor
    finish_reasons: list[str]
    prompts: list[str]
    responses: list[str]
    labels: list = field(default_factory=list)  # per sample; an `EpisodeOutcome` each with --agent_func_path

    @property
    def num_samples(self) -> int:
        return self.sequences_BT.shape[0]


@dataclass(frozen=True)
class EpisodeOutcome:
    """What a multi-turn agent episode (`--agent_func_path`) returned; it takes the sample's place in
    `Rollout.labels`, so it travels with the sample through gathers and filtering.

    label: the dataset's label. reward: the sum of the per-turn rewards (OpenRLHF's episode reward).
    score: the last turn's score (dynamic filtering), else the reward. extra_logs: the last turn's logs.
    turns: model turns taken."""

    label: Any
    reward: float
    score: float
    extra_logs: dict[str, float] = field(default_factory=dict)
    turns: int = 1


@dataclass
class Experience(TokenBatch):
    """The step's samples with everything the losses need (global batch, identical on every rank).

    action_mask_BT1: float32 [B, T-1] action tokens that count in the losses (filtered groups are 0).
    old_logprobs_BT1 / rollout_logprobs_BT1 / ref_logprobs_BT1: float32 [B, T-1] actor at experience
        time (None when the experience step skipped it: the training forward's own, detached, stand in) /
        rollout engine / reference model (None without a reference model).
    values_BT1, returns_BT1: float32 [B, T-1] critic values and returns (None without a critic).
    advantages_BT1: float32 [B, T-1]; rewards_B: float32 [B] shaped sequence rewards; raw_rewards_B: float32 [B]
        the reward sources' rewards before any shaping.
    """

    sequences_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT1: torch.Tensor
    old_logprobs_BT1: torch.Tensor | None
    rollout_logprobs_BT1: torch.Tensor
    advantages_BT1: torch.Tensor
    rewards_B: torch.Tensor
    ref_logprobs_BT1: torch.Tensor | None = None
    values_BT1: torch.Tensor | None = None
    returns_BT1: torch.Tensor | None = None
    raw_rewards_B: torch.Tensor | None = None

    def slice(self, start: int, stop: int) -> Experience:
        """Samples [start, stop), trimmed to the longest real sequence among them."""
        return self.select(slice(start, stop)).trimmed()
