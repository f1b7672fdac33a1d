"""RePULSe's losses and weights as pure tensor functions (README.md, RePULSe section): the target
sigma(s|x) ∝ p(s|x)·exp(beta·r(x,s)) approximated by self-normalised importance sampling over a prompt's
K proposal samples, the CTL update of the proposal q, the negative-training and REINFORCE (RLOO) updates
of the policy p, the reward transforms, and the held-out risk statistics. No models, configs or groups.

Shapes: P prompts, K samples per prompt (a prompt's samples contiguous), T1 response positions aligned
with next-token targets; masks are float 0/1 over response tokens. "Sequence log-prob" = sum over the
response tokens. Every weight returned here is detached.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def masked_sum_PK(values_PKT1: torch.Tensor, mask_PKT1: torch.Tensor) -> torch.Tensor:
    """float32 [P, K]: sum over response tokens (masked positions dropped with `where`: -inf there is safe)."""
    return torch.where(mask_PKT1.bool(), values_PKT1.float(), 0.0).sum(-1)


def masked_mean_PK(values_PKT1: torch.Tensor, mask_PKT1: torch.Tensor) -> torch.Tensor:
    """float32 [P, K]: mean over response tokens (a sample with none counts 0)."""
    return masked_sum_PK(values_PKT1, mask_PKT1) / mask_PKT1.float().sum(-1).clamp(min=1)


def snis_weights_PK(logp_seq_PK: torch.Tensor, beta_r_PK: torch.Tensor, logq_old_seq_PK: torch.Tensor) -> torch.Tensor:
    """Self-normalised importance weights of the K proposal samples of each prompt toward sigma:
    softmax over K of [log p(s) + beta·r(s) - log q_old(s)] (log q_old: stored at sampling time)."""
    return torch.softmax((logp_seq_PK + beta_r_PK - logq_old_seq_PK).detach().float(), dim=-1)


def log_psi_BT1(logq_BT1: torch.Tensor, logp_BT1: torch.Tensor, mask_BT1: torch.Tensor) -> torch.Tensor:
    """log psi_t = log q(s_t|s_<t) - sg[log p(s_t|s_<t)] on response positions, 0 elsewhere (any leading shape)."""
    return torch.where(mask_BT1.bool(), logq_BT1.float() - logp_BT1.detach().float(), 0.0)


def ctl_pi_weights_PKT1(logq_PKT1: torch.Tensor, logp_PKT1: torch.Tensor, logq_old_PKT1: torch.Tensor,
                        mask_PKT1: torch.Tensor) -> torch.Tensor:
    """CTL's per-position weights of a prompt's K samples under the current q (detached):
    w_pi_t = softmax over K of [sum_{tau<=t} (log p - log q_old) + log psi_t]. They need the whole group at once,
    so a step whose groups are split over micro-batches or ranks computes them before its forwards."""
    logp, logq_old = logp_PKT1.detach().float(), logq_old_PKT1.detach().float()
    prefix = torch.where(mask_PKT1.bool(), logp - logq_old, 0.0).cumsum(-1)
    return torch.softmax(prefix + log_psi_BT1(logq_PKT1.detach(), logp, mask_PKT1), dim=1)


def ctl_terms(logq_BT1: torch.Tensor, logp_BT1: torch.Tensor, mask_BT1: torch.Tensor, w_sigma_B: torch.Tensor,
              w_pi_BT1: torch.Tensor) -> torch.Tensor:
    """Per-sample CTL terms masked_mean_t[(w_sigma - w_pi_t) · log psi_t] [B] (the loss is minus their mean);
    both weights are given (detached), so a sample needs no other sample of its group."""
    weights = w_sigma_B.detach().float()[..., None] - w_pi_BT1.detach().float()
    return masked_mean_PK(weights * log_psi_BT1(logq_BT1, logp_BT1, mask_BT1), mask_BT1)


def dpg_terms(logq_BT1: torch.Tensor, logp_BT1: torch.Tensor, mask_BT1: torch.Tensor, w_sigma_B: torch.Tensor,
              w_pi_BT1: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample DPG terms masked_mean_t[w_sigma · log psi_t] [B] (the loss is minus their mean; `w_pi_BT1`
    unused: DPG has no per-position weights)."""
    return masked_mean_PK(w_sigma_B.detach().float()[..., None] * log_psi_BT1(logq_BT1, logp_BT1, mask_BT1),
                          mask_BT1)


def ctl_loss(logq_PKT1: torch.Tensor, logp_PKT1: torch.Tensor, logq_old_PKT1: torch.Tensor, mask_PKT1: torch.Tensor,
             beta_r_PK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contrastive twist learning of q (`--actor_loss_type ctl --parameterization policy_psi_q_p_s_t`) on whole
    groups: loss = -mean over P·K of `ctl_terms`, with w_sigma = `snis_weights_PK` (per sequence) and w_pi =
    `ctl_pi_weights_PKT1`. Only `logq_PKT1` carries gradients. Returns (loss, w_sigma [P, K], w_pi [P, K, T1])."""
    mask = mask_PKT1.float()
    w_sigma = snis_weights_PK(masked_sum_PK(logp_PKT1.detach(), mask), beta_r_PK,
                              masked_sum_PK(logq_old_PKT1.detach(), mask))
    w_pi = ctl_pi_weights_PKT1(logq_PKT1, logp_PKT1, logq_old_PKT1, mask)
    return -ctl_terms(logq_PKT1, logp_PKT1, mask, w_sigma, w_pi).mean(), w_sigma, w_pi


def dpg_loss(logq_PKT1: torch.Tensor, logp_PKT1: torch.Tensor, logq_old_PKT1: torch.Tensor, mask_PKT1: torch.Tensor,
             beta_r_PK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distributional policy gradient for q (`--actor_loss_type dpg`) on whole groups: -mean over P·K of
    `dpg_terms`. The fork also subtracts sum_v sg(q_v)·log psi_v at every position, whose gradient
    sum_v q_v·∇log q_v = ∇ sum_v q_v is 0 under policy_psi_q_p_s_t (log p detached): it is left out, so the
    gradient is the fork's and the logged value differs from its by the per-token KL(q || p).
    Returns (loss, w_sigma [P, K])."""
    mask = mask_PKT1.float()
    w_sigma = snis_weights_PK(masked_sum_PK(logp_PKT1.detach(), mask), beta_r_PK,
                              masked_sum_PK(logq_old_PKT1.detach(), mask))
    return -dpg_terms(logq_PKT1, logp_PKT1, mask, w_sigma).mean(), w_sigma


PROPOSAL_LOSSES: dict[str, Callable[..., tuple]] = {"ctl": ctl_loss, "dpg": dpg_loss}
"""--actor_loss_type -> the proposal's loss on whole groups; each returns (loss, ...) from the same arguments."""

PROPOSAL_TERMS: dict[str, Callable[..., torch.Tensor]] = {"ctl": ctl_terms, "dpg": dpg_terms}
"""--actor_loss_type -> the proposal's per-sample terms (the loss is minus their mean), given the weights."""


def rloo_baseline_PK(returns_PK: torch.Tensor) -> torch.Tensor:
    """Leave-one-out mean of the other K - 1 returns of the prompt (`--reinforce_baseline_type expectation`)."""
    K = returns_PK.shape[-1]
    if K < 2:
        raise ValueError("the leave-one-out baseline needs >= 2 samples per prompt (--duplicate_rollout_batch_by)")
    returns = returns_PK.double()  # the sum of K large returns must not overflow float32
    return ((returns.sum(-1, keepdim=True) - returns) / (K - 1)).to(returns_PK.dtype)


def policy_gradient_terms(mean_logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Per-sample REINFORCE terms -(R - b)·mean_t log p (advantages detached); the loss is their mean."""
    return -(advantages.detach().float() * mean_logp.float())


def negative_terms(mean_logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-sample negative-training terms w·mean_t log p(s~) (weights detached); the loss adds alpha x their
    mean over P·K."""
    return weights.detach().float() * mean_logp.float()


def reinforce_loss(mean_logp_PK: torch.Tensor, returns_PK: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the RLOO baseline on the policy's own samples: mean over P·K of -(R - b)·mean_t log p."""
    return policy_gradient_terms(mean_logp_PK, returns_PK - rloo_baseline_PK(returns_PK)).mean()


def base_as_proposal_weights_PK(beta_r_PK: torch.Tensor) -> torch.Tensor:
    """`--use_base_as_proposal`: the p-samples are the negatives, weighted by softmax over K of beta·r
    (q = p, so the importance ratio p/q is 1)."""
    return torch.softmax(beta_r_PK.detach().float(), dim=-1)


# ---- reward transforms on the policy's samples ---------------------------------------------------


LARGEST_SHAPED_REWARD = torch.finfo(torch.float32).max / 2**20
"""The largest |r'| a transform may give: float32 training sums up to 2^20 of them without overflowing."""


def minus_alpha_exp_beta_r(rewards: torch.Tensor, alpha: float, beta: float, threshold: float) -> torch.Tensor:
    """r' = r - alpha·exp(beta·r) (with beta < 0 it penalises low rewards most), computed in float64; a value
    beyond `LARGEST_SHAPED_REWARD` (alpha 0.5, beta -10, r -10 gives -1.34e43) is an error naming the flags, never
    an infinity that turns the group's baseline into NaN."""
    r = rewards.double()
    shaped = r - alpha * torch.exp(beta * r)
    too_large = ~(shaped.abs() <= LARGEST_SHAPED_REWARD).flatten()  # infinities too
    if too_large.any():
        i = int(too_large.nonzero()[0])
        raise ValueError(f"--reward_transform minus_alpha_exp_beta_r: r - {alpha:g}·exp({beta:g}·r) is "
                         f"{float(shaped.flatten()[i]):.3g} for the reward {float(r.flatten()[i]):.4g}, beyond "
                         f"what float32 training holds (|r'| <= {LARGEST_SHAPED_REWARD:.2g}): lower --rew_trans_alpha "
                         "or the magnitude of --rew_trans_beta (their defaults: --alpha, --target_dist_beta)")
    return shaped.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def minus_alpha_ind(rewards: torch.Tensor, alpha: float, beta: float, threshold: float) -> torch.Tensor:
    """r' = r - alpha·1[r < threshold]."""
    return rewards - alpha * (rewards < threshold).to(rewards.dtype)


REWARD_TRANSFORMS: dict[str, Callable[..., torch.Tensor]] = {
    "minus_alpha_exp_beta_r": minus_alpha_exp_beta_r,
    "minus_alpha_ind": minus_alpha_ind,
}


def policy_returns_PK(rewards_PK: torch.Tensor, logp_old_PKT1: torch.Tensor, ref_logp_PKT1: torch.Tensor,
                      mask_PKT1: torch.Tensor, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """R = r' - c_KL · sum_t (log p_old - log p_0) (k1, no gradient). Returns (R, the per-sample KL sum)."""
    kl_PK = masked_sum_PK(logp_old_PKT1.detach().float() - ref_logp_PKT1.detach().float(), mask_PKT1)
    return rewards_PK.float() - kl_coef * kl_PK, kl_PK


# ---- held-out risk statistics ----------------------------------------------------------------------


def prob_below(rewards: torch.Tensor, threshold: float) -> float:
    """P(r < threshold), the fraction of samples below it."""
    return float((rewards < threshold).float().mean())


def cvar(rewards: torch.Tensor, fraction: float) -> float:
    """Mean of the worst ceil(fraction · n) rewards (conditional value at risk of the lower tail)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"CVaR fraction must be in (0, 1], got {fraction}")
    n = max(1, math.ceil(fraction * rewards.numel()))
    return float(rewards.flatten().float().sort().values[:n].mean())
