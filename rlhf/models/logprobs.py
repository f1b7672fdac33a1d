"""Per-token log-probs (and optionally entropy) of a causal LM on right-padded sequences.
Shape legend: rlhf.data.records."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.algorithms.losses import entropy_from_logits_BT
from rlhf.kernels import token_logprobs


def position_ids_for(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Positions 0.. over real tokens (right padding: padding gets clamped positions)."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class PolicyOutput:
    """logprobs_BT1: float32 [B, T-1]; entropy_BT1: float32 [B, T-1] or None; aux_loss: MoE loss or None."""

    logprobs_BT1: torch.Tensor
    entropy_BT1: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def policy_forward(model: torch.nn.Module, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False) -> PolicyOutput:
    """Log-probs of sequences[:, t+1] given sequences[:, :t+1] under logits / temperature."""
    out = model(input_ids=sequences_BT, attention_mask=attention_mask_BT,
                position_ids=position_ids_for(attention_mask_BT), use_cache=False)
    logits_BTV = out.logits[:, :-1]
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    return PolicyOutput(token_logprobs(logits_BTV, sequences_BT[:, 1:]),
                        entropy_from_logits_BT(logits_BTV) if with_entropy else None,
                        getattr(out, "aux_loss", None))


def sequence_logprobs(model: torch.nn.Module, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """float32 [B, T-1]: log p(sequences[:, t+1] | sequences[:, :t+1]) under logits / temperature."""
    return policy_forward(model, sequences_BT, attention_mask_BT, temperature).logprobs_BT1
