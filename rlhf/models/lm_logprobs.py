"""Per-token log-probs (and optionally entropy) of a causal LM on right-padded sequences, in any
`SequenceLayout` (padded, packed, ring). Shape legend: rlhf.data.records."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.kernels import chunked_logprobs_entropy, token_logprobs
from rlhf.models.layout import PADDED, SequenceLayout


@dataclass
class PolicyOutput:
    """logprobs_BT1: float32 [B, T-1]; entropy_BT1: float32 [B, T-1] or None; aux_loss: MoE loss or None.
    Positions from a row's last real token on are meaningless (0 in packed layouts): mask them."""

    logprobs_BT1: torch.Tensor
    entropy_BT1: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 log-prob of each target and entropy of each position, never materialising a float32
    log-softmax: the fused Triton kernel on CUDA, the chunked PyTorch path elsewhere."""
    if logits.is_cuda:
        from rlhf.kernels.logprobs_triton import triton

        if triton is not None:
            from rlhf.kernels import fused_logprobs_entropy

            return fused_logprobs_entropy(logits, targets)
    return chunked_logprobs_entropy(logits, targets)


def policy_forward(model: torch.nn.Module, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False,
                   layout: SequenceLayout = PADDED) -> PolicyOutput:
    """Log-probs of sequences[:, t+1] given sequences[:, :t+1] under logits / temperature."""
    laid = layout.lay_out(sequences_BT, attention_mask_BT)
    out = model(**laid.kwargs)
    logits = out.logits
    if temperature != 1.0:
        logits = logits / temperature
    entropy_BT1 = None
    if with_entropy or torch.is_grad_enabled():  # the fused/chunked backward never holds fp32 logits either
        logprobs, entropy = logprobs_entropy(logits, laid.targets)
        if with_entropy:
            entropy_BT1 = laid.to_padded(entropy)[:, :-1]
    else:
        logprobs = token_logprobs(logits, laid.targets)
    return PolicyOutput(laid.to_padded(logprobs)[:, :-1], entropy_BT1, getattr(out, "aux_loss", None))
