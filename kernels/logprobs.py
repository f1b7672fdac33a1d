"""Per-token log-probabilities of target tokens, and entropies, from logits, in plain PyTorch.

Shapes: B batch, T positions, V vocabulary, N flattened rows (B * T). `token_logprobs` and
`token_entropy` process the rows in chunks so that at most one chunk's float32 log-softmax exists at a
time in the forward (autograd still keeps each chunk's float32 copy for the backward); the references
materialise it all. `chunked_logprobs_entropy` also recomputes chunk by chunk in its backward, so it
keeps only the logits, targets and two floats per row: the CPU counterpart of the Triton kernel in
`logprobs_triton.py`.
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


def token_entropy_reference(logits_BTV: torch.Tensor) -> torch.Tensor:
    """-sum p log p of softmax(logits) in float32, materialising the full [B, T, V] log-softmax."""
    logp = logits_BTV.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def token_entropy(logits_BTV: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """Same values as `token_entropy_reference`, `chunk_tokens` rows at a time (float32 [B, T])."""
    *lead, V = logits_BTV.shape
    flat_logits = logits_BTV.reshape(-1, V)
    out = [_entropy_from_lse(chunk.float(), torch.logsumexp(chunk.float(), -1))
           for chunk in flat_logits.split(chunk_tokens)]
    return torch.cat(out).reshape(lead) if out else flat_logits.new_zeros(lead, dtype=torch.float32)


def _entropy_from_lse(x_NV: torch.Tensor, lse_N: torch.Tensor) -> torch.Tensor:
    # H = lse - E_p[x], with p = exp(x - lse)
    return lse_N - (torch.exp(x_NV - lse_N[:, None]) * x_NV).sum(-1)


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, targets_N, chunk_tokens):
        logprobs, entropy, lses = [], [], []
        for x, t in zip(logits_NV.split(chunk_tokens), targets_N.split(chunk_tokens)):
            x = x.float()
            lse = torch.logsumexp(x, -1)
            logprobs.append(x.gather(-1, t[:, None]).squeeze(-1) - lse)
            entropy.append(_entropy_from_lse(x, lse))
            lses.append(lse)
        logprobs_N, entropy_N = torch.cat(logprobs), torch.cat(entropy)
        ctx.save_for_backward(logits_NV, targets_N, torch.cat(lses), entropy_N)
        ctx.chunk_tokens = chunk_tokens
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, dlogprobs_N, dentropy_N):
        logits_NV, targets_N, lse_N, entropy_N = ctx.saved_tensors
        dlogprobs_N = torch.zeros_like(lse_N) if dlogprobs_N is None else dlogprobs_N.float()
        dentropy_N = torch.zeros_like(lse_N) if dentropy_N is None else dentropy_N.float()
        dlogits_NV = torch.empty_like(logits_NV)
        n = ctx.chunk_tokens
        for start in range(0, logits_NV.shape[0], n):
            rows = slice(start, start + n)
            dlogits_NV[rows] = logprobs_entropy_grad(logits_NV[rows].float(), targets_N[rows], lse_N[rows],
                                                     entropy_N[rows], dlogprobs_N[rows], dentropy_N[rows])
        return dlogits_NV, None, None


def logprobs_entropy_grad(x_NV: torch.Tensor, targets_N: torch.Tensor, lse_N: torch.Tensor, entropy_N: torch.Tensor,
                          dlogprobs_N: torch.Tensor, dentropy_N: torch.Tensor) -> torch.Tensor:
    """d/dx of sum(dlogprobs * logprob + dentropy * entropy), float32 [N, V].

    d logprob / dx = onehot(target) - p;  d entropy / dx = -p * (log p + entropy).
    """
    logp = x_NV - lse_N[:, None]
    p = torch.exp(logp)
    grad = -p * (dlogprobs_N[:, None] + dentropy_N[:, None] * (logp + entropy_N[:, None]))
    return grad.scatter_add(-1, targets_N[:, None], dlogprobs_N[:, None])


def chunked_logprobs_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor,
                             chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of target, entropy), both float32 [B, T]; forward AND backward run `chunk_tokens` rows
    at a time, so no full float32 [B, T, V] tensor is ever alive (the gradient has the logits' dtype)."""
    *lead, V = logits_BTV.shape
    if logits_BTV.numel() == 0:
        zeros = logits_BTV.new_zeros(lead, dtype=torch.float32)
        return zeros, zeros.clone()
    logprobs_N, entropy_N = _ChunkedLogprobsEntropy.apply(logits_BTV.reshape(-1, V), targets_BT.reshape(-1),
                                                          chunk_tokens)
    return logprobs_N.reshape(lead), entropy_N.reshape(lead)
