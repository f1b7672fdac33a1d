"""Supervised fine-tuning loss (OpenRLHF `SFTLoss`, token level) and the target mask of a multiturn
conversation, as pure tensor functions.

The loss is a token sum divided by a token count the caller passes in: the number of target tokens of
the whole optimizer step, over every micro-batch and DP rank. Summed over micro-batches and ranks, the
pieces then equal the token mean of the global batch, which is what OpenRLHF's `masked_mean` computes
when the whole batch fits in one micro-batch on one rank. This module knows nothing of tokenizers, chat
templates or process groups: the caller counts (and all-reduces) the tokens.

Shapes: B samples, T tokens, T1 = T - 1 next-token positions (position t scores token t + 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def nll_over_global_count(logprobs_BT1: torch.Tensor, loss_mask_BT1: torch.Tensor,
                          num_tokens: float | torch.Tensor) -> torch.Tensor:
    """-sum_{masked t} logprobs[t] / num_tokens, a float32 scalar (positive: lower is better).

    `logprobs_BT1`: log p(token t+1 | tokens <= t), float32 [B, T1]. `loss_mask_BT1`: bool or 0/1
    [B, T1], true where token t+1 is a target. `num_tokens`: the target-token count of the optimizer
    step (the sum of every micro-batch's and rank's `loss_mask_BT1.sum()`), > 0. Masked-out positions are
    dropped with `where`, so a -inf log-prob there cannot turn the sum into NaN.
    """
    if not isinstance(num_tokens, torch.Tensor):
        assert num_tokens > 0, f"num_tokens must be positive, got {num_tokens}"
    picked = torch.where(loss_mask_BT1.bool(), logprobs_BT1.float(), 0.0)
    return -picked.sum() / num_tokens


def assistant_loss_mask_T1(assistant_spans: Sequence[tuple[int, int]], seq_len: int) -> torch.Tensor:
    """bool [seq_len - 1]: true at position t when token t + 1 lies in one of `assistant_spans`.

    Each span is `(start, stop)`, half-open token indices of one assistant turn in the tokenized
    conversation (OpenRLHF's closed `response_ranges` entry (s, e) is (s, e + 1) here). Spans running past
    `seq_len` (a truncated conversation) are clipped; empty spans add nothing. A single-turn sample is the
    one span `(prompt_len, seq_len)`, which gives OpenRLHF's `loss_mask[prompt_len - 1 : -1]`.
    """
    mask_T1 = torch.zeros(max(seq_len - 1, 0), dtype=torch.bool)
    for start, stop in assistant_spans:
        if start < 1 or stop < start:
            raise ValueError(f"assistant span ({start}, {stop}) is invalid: spans are half-open token indices "
                             "with 1 <= start <= stop (token 0 has no earlier position to be predicted from)")
        mask_T1[start - 1:min(stop, seq_len) - 1] = True
    return mask_T1
