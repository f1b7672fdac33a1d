"""Per-token log-probs of a causal LM on right-padded sequences (shape legend: rlhf.data.records)."""

from __future__ import annotations

import torch

from rlhf.kernels import token_logprobs


def position_ids_for(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Positions 0.. over real tokens (right padding: padding gets clamped positions)."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)


def sequence_logprobs(model: torch.nn.Module, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """float32 [B, T-1]: log p(sequences[:, t+1] | sequences[:, :t+1]) under logits / temperature."""
    out = model(input_ids=sequences_BT, attention_mask=attention_mask_BT,
                position_ids=position_ids_for(attention_mask_BT), use_cache=False)
    logits_BTV = out.logits[:, :-1]
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    return token_logprobs(logits_BTV, sequences_BT[:, 1:])
