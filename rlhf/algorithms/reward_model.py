"""Reward-model losses as pure tensor functions: the pairwise (Bradley-Terry) losses of outcome reward
models (OpenRLHF `PairWiseLoss`, `LogExpLoss`) and the token loss of process reward models (`PRMLoss`).

Pairwise losses return one loss per pair; reduce them as `loss_B.sum() / num_pairs` with the pair count
of the whole optimizer step, so any DP x accumulation split gives the global mean. The PRM loss takes the
same kind of global count. This module knows nothing of models, tokenizers or placeholder tokens: the
caller scores the sequences and gathers the placeholder positions.

Shapes: B preference pairs, N placeholder positions (already gathered), V vocabulary, R reward tokens.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a PRM label with this value is not trained on (OpenRLHF's convention)


def sigmoid_pairwise_loss_B(chosen_B: torch.Tensor, rejected_B: torch.Tensor,
                            margin_B: torch.Tensor | None = None) -> torch.Tensor:
    """-log sigmoid(chosen - rejected - margin) per pair (OpenRLHF `PairWiseLoss`, `--loss sigmoid`).

    Positive; it falls as the chosen reward exceeds the rejected one by more than `margin` (0 if None).
    """
    diff_B = chosen_B - rejected_B
    if margin_B is not None:
        diff_B = diff_B - margin_B
    return -F.logsigmoid(diff_B)


def logexp_pairwise_loss_B(chosen_B: torch.Tensor, rejected_B: torch.Tensor,
                           margin_B: torch.Tensor | None = None) -> torch.Tensor:
    """log(1 + exp(rejected - chosen)) per pair (OpenRLHF `LogExpLoss`, any `--loss` other than sigmoid).

    As in OpenRLHF, the margin is accepted and IGNORED (a warning says so), so this equals the sigmoid
    loss without a margin. It is computed as softplus, the same function, which stays finite where
    OpenRLHF's literal log(1 + exp(x)) overflows to inf (x > 88 in float32).
    """
    if margin_B is not None:
        warnings.warn("the logexp pairwise loss ignores the margin (as OpenRLHF's LogExpLoss does); use the "
                      "sigmoid loss for --margin_loss", stacklevel=2)
    return F.softplus(rejected_B - chosen_B)


PAIRWISE_LOSSES = {"sigmoid": sigmoid_pairwise_loss_B, "logexp": logexp_pairwise_loss_B}


def prm_token_losses_N(logits_NV: torch.Tensor, labels_N: torch.Tensor,
                       reward_token_ids: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_N, counted_N, correct_N) at the placeholder positions; the loss is float32, 0 where not counted.

    Hard labels (integer `labels_N`): with `reward_token_ids`, the index in it of the target token (OpenRLHF's
    dataset stores the token id and `PRMLoss` maps it to this index), and the loss is the cross-entropy over
    those R tokens' logits only; without, the target's vocabulary id and the cross-entropy over the whole
    vocabulary. Soft labels (floating
    `labels_N`) need exactly two reward tokens, (positive, negative): a label p in [0, 1] is the target
    probability of the positive token, so the loss is -(p log q_pos + (1 - p) log q_neg) with q the
    softmax over the two tokens' logits. Positions labelled IGNORE_INDEX (-100) are not counted.

    `correct_N` compares the argmax of the (restricted) logits with the target token; a soft label's
    target is the positive token when p >= 0.5 (OpenRLHF's argmax over (p, 1 - p), ties to the first).
    """
    counted_N = labels_N != IGNORE_INDEX
    if labels_N.is_floating_point():
        logp_NR, target_N, loss_N = _soft_label_losses(logits_NV, labels_N, counted_N, reward_token_ids)
    else:
        logp_NR = _restricted_logprobs(logits_NV, reward_token_ids)
        target_N = torch.where(counted_N, labels_N, 0)
        if ((target_N < 0) | (target_N >= logp_NR.shape[-1])).any():
            raise ValueError(f"hard PRM labels must be indices into the {logp_NR.shape[-1]} classes (the "
                             "--reward_tokens, or the vocabulary without them) or -100")
        loss_N = -logp_NR.gather(-1, target_N[:, None]).squeeze(-1)
    loss_N = torch.where(counted_N, loss_N, 0.0)
    correct_N = (logp_NR.argmax(-1) == target_N) & counted_N
    return loss_N, counted_N, correct_N


def prm_loss(logits_NV: torch.Tensor, labels_N: torch.Tensor, reward_token_ids: Sequence[int] | None,
             num_positions: float | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, accuracy): the summed `prm_token_losses_N` over `num_positions`, and the local accuracy.

    `num_positions`: the counted placeholder positions of the whole optimizer step (all micro-batches and
    DP ranks), so the pieces sum to the global mean; default: this call's counted positions (OpenRLHF's
    per-micro-batch mean), at least 1. The accuracy is over this call's counted positions.
    """
    loss_N, counted_N, correct_N = prm_token_losses_N(logits_NV, labels_N, reward_token_ids)
    num_counted = counted_N.sum().clamp(min=1)
    denominator = num_counted if num_positions is None else num_positions
    return loss_N.sum() / denominator, correct_N.sum() / num_counted


def _restricted_logprobs(logits_NV: torch.Tensor, reward_token_ids: Sequence[int] | None) -> torch.Tensor:
    if reward_token_ids is not None:
        ids_R = torch.as_tensor(list(reward_token_ids), device=logits_NV.device)
        logits_NV = logits_NV.index_select(-1, ids_R)
    return logits_NV.float().log_softmax(-1)


def _soft_label_losses(logits_NV: torch.Tensor, labels_N: torch.Tensor, counted_N: torch.Tensor,
                       reward_token_ids: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if reward_token_ids is None or len(reward_token_ids) != 2:
        raise ValueError("soft (float) PRM labels need exactly two --reward_tokens, the positive token first, "
                         f"got {reward_token_ids}")
    p_N = torch.where(counted_N, labels_N.float(), 1.0)
    if ((p_N < 0) | (p_N > 1)).any():
        raise ValueError("soft PRM labels must be probabilities in [0, 1] (or -100 to skip a placeholder)")
    logp_N2 = _restricted_logprobs(logits_NV, reward_token_ids)
    loss_N = -(p_N * logp_N2[:, 0] + (1 - p_N) * logp_N2[:, 1])
    return logp_N2, (p_N < 0.5).long(), loss_N
