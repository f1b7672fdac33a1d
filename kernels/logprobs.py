"""Per-token log-probabilities of target tokens from logits.

Shapes: B batch, T positions, V vocabulary. `token_logprobs` processes the sequence in chunks so
that at most one chunk's float32 log-softmax exists at a time; the reference materialises it all.
"""

from __future__ import annotations

import torch


def token_logprobs_reference(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] in float32, materialising the full [B, T, V] log-softmax."""
    return logits_BTV.float().log_softmax(-1).gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """Same values as the reference, computed `chunk_tokens` positions at a time (float32)."""
    B, T, V = logits_BTV.shape
    flat_logits = logits_BTV.reshape(B * T, V)
    flat_targets = targets_BT.reshape(B * T)
    out = []
    for start in range(0, B * T, chunk_tokens):
        chunk = flat_logits[start:start + chunk_tokens].float()
        picked = chunk.gather(-1, flat_targets[start:start + chunk_tokens, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out).reshape(B, T) if out else flat_logits.new_zeros(B, T, dtype=torch.float32)
