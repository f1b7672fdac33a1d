"""Plain forms of production computations that tests compare against (the product itself calls the pieces)."""

import torch

from rlhf.models.lm_logprobs import policy_forward


def sequence_logprobs(model: torch.nn.Module, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """float32 [B, T-1]: log p(sequences[:, t+1] | sequences[:, :t+1]) under logits / temperature, padded."""
    return policy_forward(model, sequences_BT, attention_mask_BT, temperature).logprobs_BT1
