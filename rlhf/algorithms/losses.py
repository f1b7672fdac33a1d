"""Policy and value losses as pure tensor functions (RL_MATH.md, "Losses").

Per-token losses are reduced with an explicit global normaliser (the number of action tokens of the
whole optimizer step over every micro-batch and DP rank), so any DP x accumulation split gives the
same gradient. Shapes: B samples, T1 token positions, V vocabulary.
"""

from __future__ import annotations

import torch

LOG_RATIO_LIMIT = 20.0
"""log(pi / pi_old) is clamped to +-20 before exp (as OpenRLHF after v0.9.5): a token whose log-prob moved that
far (a stale batch, a diverged step) gives a ratio of at most e^20 instead of overflowing the loss."""


def ppo_clip_loss_BT1(logprobs_BT1: torch.Tensor, old_logprobs_BT1: torch.Tensor, advantages_BT1: torch.Tensor,
                      clip_low: float, clip_high: float,
                      dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss -min(rho*A, clip(rho, 1-lo, 1+hi)*A), and a 0/1 clipped indicator.

    With `dual_clip` c > 1, tokens with A < 0 have their loss capped at -c*A.
    """
    ratio = torch.exp((logprobs_BT1 - old_logprobs_BT1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = ratio * advantages_BT1
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages_BT1
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        capped = torch.minimum(loss, -dual_clip * advantages_BT1)
        loss = torch.where(advantages_BT1 < 0, capped, loss)
    return loss, (clipped < unclipped).float()


def gspo_loss_BT1(logprobs_BT1: torch.Tensor, old_logprobs_BT1: torch.Tensor, advantages_BT1: torch.Tensor,
                  action_mask_BT1: torch.Tensor, clip_low: float,
                  clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: one ratio per sequence, exp(mean_t(logp - logp_old)), applied to every token of it.

    The token form keeps gradients flowing per token (ratio_t = sg(s_seq) * exp(logp_t - sg(logp_t))).
    Reduce it with a sequence-level mean.
    """
    count = action_mask_BT1.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = ((logprobs_BT1 - old_logprobs_BT1) * action_mask_BT1).sum(-1, keepdim=True) / count
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(seq_log_ratio.detach() + logprobs_BT1 - logprobs_BT1.detach())
    unclipped = ratio * advantages_BT1
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages_BT1
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def value_loss_BT1(values_BT1: torch.Tensor, old_values_BT1: torch.Tensor, returns_BT1: torch.Tensor,
                   value_clip: float | None) -> torch.Tensor:
    """0.5 * max((V - G)^2, (V_old + clip(V - V_old, +-eps) - G)^2); unclipped without `value_clip`."""
    unclipped = (values_BT1 - returns_BT1).square()
    if value_clip is None:
        return 0.5 * unclipped
    clipped_values = old_values_BT1 + (values_BT1 - old_values_BT1).clamp(-value_clip, value_clip)
    return 0.5 * torch.maximum(unclipped, (clipped_values - returns_BT1).square())


def _tis_BT1(log_ratio_BT1: torch.Tensor, action_mask_BT1: torch.Tensor, low: float,
             high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS: every token's ratio truncated to [low, high]."""
    w = torch.exp(log_ratio_BT1)
    return w.clamp(low, high), (w < low) | (w > high)


def _icepop_BT1(log_ratio_BT1: torch.Tensor, action_mask_BT1: torch.Tensor, low: float,
                high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ICEPOP: a token whose ratio lies outside [low, high] gets weight 0, the others their ratio."""
    w = torch.exp(log_ratio_BT1)
    outside = (w < low) | (w > high)
    return w * (~outside).float(), outside


def _seq_mask_tis_BT1(log_ratio_BT1: torch.Tensor, action_mask_BT1: torch.Tensor, low: float,
                      high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """seq-mask-tis (OpenRLHF v0.9.5's `PolicyLoss`): a sequence whose geometric-mean ratio exp(mean_t log_ratio)
    over its action tokens lies outside [low, high] gets weight 0 on every token; the tokens of the others keep
    their own ratio, not truncated (v0.9.5's comment says "TIS (token-level clamp)", its code does not clamp)."""
    count_B1 = action_mask_BT1.sum(-1, keepdim=True).clamp(min=1)
    seq_ratio_B1 = torch.exp((log_ratio_BT1 * action_mask_BT1).sum(-1, keepdim=True) / count_B1)
    outside_B1 = (seq_ratio_B1 < low) | (seq_ratio_B1 > high)
    return torch.exp(log_ratio_BT1) * (~outside_B1).float(), outside_B1.expand_as(log_ratio_BT1)


IS_CORRECTIONS = {"tis": _tis_BT1, "icepop": _icepop_BT1, "seq-mask-tis": _seq_mask_tis_BT1}
"""--vllm_is_correction_type -> (log_ratio_BT1, action_mask_BT1, low, high) -> (weights_BT1, outside_BT1)."""


def importance_weights_BT1(old_logprobs_BT1: torch.Tensor, rollout_logprobs_BT1: torch.Tensor,
                           action_mask_BT1: torch.Tensor, low: float, high: float,
                           kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy correction against the rollout engine from the ratios exp(logp_old - logp_roll): the token
    weights of the `kind` in `IS_CORRECTIONS` and a 0/1 indicator of the tokens it cut (a ratio, or with
    seq-mask-tis the token's sequence, outside [low, high]). Detached, float."""
    log_ratio = (old_logprobs_BT1 - rollout_logprobs_BT1).detach()
    weights, outside = IS_CORRECTIONS[kind](log_ratio, action_mask_BT1, low, high)
    return weights, outside.float()


def rollout_mismatch_BT1(old_logprobs_BT1: torch.Tensor, rollout_logprobs_BT1: torch.Tensor,
                         action_mask_BT1: torch.Tensor,
                         correction: tuple[float, float, str] | None) -> dict[str, torch.Tensor]:
    """Per-token values whose action-token means are the rollout-mismatch metrics: how far the engine's
    log-probs are from the actor's and, with the off-policy `correction` (low, high, kind), the weights it
    applies and which tokens it cut (see `importance_weights_BT1`). Detached."""
    old, rollout = old_logprobs_BT1.detach(), rollout_logprobs_BT1
    values = {"rollout/logprob_abs_diff": (old - rollout).abs()}
    if correction is not None:
        low, high, kind = correction
        weights, outside = importance_weights_BT1(old, rollout, action_mask_BT1, low, high, kind)
        values["rollout/is_weight_mean"] = weights
        values["rollout/is_clipped_frac"] = outside
    return values


def token_sum_over_global_count(values_BT1: torch.Tensor, mask_BT1: torch.Tensor,
                                global_num_tokens: float) -> torch.Tensor:
    """Sum of masked per-token values divided by the global token count of the optimizer step."""
    return (values_BT1 * mask_BT1).sum() / global_num_tokens


def sequence_mean_over_global_count(values_BT1: torch.Tensor, mask_BT1: torch.Tensor,
                                    global_num_sequences: float) -> torch.Tensor:
    """Sum over sequences of each sequence's token mean, divided by the global sequence count."""
    per_seq = (values_BT1 * mask_BT1).sum(-1) / mask_BT1.sum(-1).clamp(min=1)
    return per_seq.sum() / global_num_sequences


def policy_token_loss_BT1(logprobs_BT1: torch.Tensor, old_logprobs_BT1: torch.Tensor,
                          rollout_logprobs_BT1: torch.Tensor | None, advantages_BT1: torch.Tensor,
                          action_mask_BT1: torch.Tensor, *, loss_type: str, clip_low: float, clip_high: float,
                          dual_clip: float | None, is_correction: tuple[float, float, str] | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The actor's per-token loss (OpenRLHF v0.9.5's `PolicyLoss`), its 0/1 clipped indicator and a 0/1 indicator
    of tokens whose log-ratio was clamped (`LOG_RATIO_LIMIT`). PPO: the clipped ratio against the old policy,
    times the rollout correction's weights (`is_correction`: (low, high, kind of `IS_CORRECTIONS`)). GSPO: one
    ratio per sequence,
    against the rollout engine's log-probs when the correction is on (and no token weights), else the old
    policy's."""
    if loss_type == "gspo":
        base = rollout_logprobs_BT1 if is_correction is not None else old_logprobs_BT1
        token_loss, clipped = gspo_loss_BT1(logprobs_BT1, base, advantages_BT1, action_mask_BT1, clip_low, clip_high)
        count = action_mask_BT1.sum(-1, keepdim=True).clamp(min=1)
        seq_log_ratio = ((logprobs_BT1 - base) * action_mask_BT1).sum(-1, keepdim=True) / count
        clamped = (seq_log_ratio.abs() > LOG_RATIO_LIMIT).expand_as(logprobs_BT1)
        return token_loss, clipped, clamped.float().detach()
    token_loss, clipped = ppo_clip_loss_BT1(logprobs_BT1, old_logprobs_BT1, advantages_BT1, clip_low, clip_high,
                                            dual_clip)
    if is_correction is not None:
        low, high, kind = is_correction
        weights, _ = importance_weights_BT1(old_logprobs_BT1, rollout_logprobs_BT1, action_mask_BT1, low, high, kind)
        token_loss = token_loss * weights
    clamped = ((logprobs_BT1 - old_logprobs_BT1).abs() > LOG_RATIO_LIMIT).float().detach()
    return token_loss, clipped, clamped
