"""Preference losses as pure tensor functions: against a frozen reference policy, DPO (sigmoid), IPO, cDPO
(label smoothing) and KTO (OpenRLHF `DPOLoss`, `KTOLoss`); reference-free, SimPO (Meng et al. 2024) and
ORPO's odds-ratio term (Hong et al. 2024); the response mask they sum log-probs over, and the per-sample
terms the trainers divide by global counts.

A "sequence log-prob" is the sum over the response tokens of log p(token | prefix), float32 [B]; an "average
log-prob" is that sum divided by the response's token count. "Implicit reward" = beta x (policy - reference)
sequence log-prob (DPO, KTO) or beta x average log-prob (SimPO, ORPO).

Shapes: B samples (pairs for DPO), T tokens, T1 = T - 1 next-token positions (position t scores token t + 1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def response_mask_BT1(attention_mask_BT: torch.Tensor, prompt_lens_B: torch.Tensor) -> torch.Tensor:
    """float32 [B, T1]: 1 at position t when token t + 1 is a real token of the response (index >= the
    sample's prompt length), as OpenRLHF's `_get_batch_logps` (the prompt's tokens are never scored)."""
    T = attention_mask_BT.shape[1]
    index_T = torch.arange(T, device=attention_mask_BT.device)
    in_response_BT = attention_mask_BT.bool() & (index_T[None, :] >= prompt_lens_B.to(index_T.device)[:, None])
    return in_response_BT[:, 1:].float()


def masked_sum_B(values_BT1: torch.Tensor, mask_BT1: torch.Tensor) -> torch.Tensor:
    """float32 [B]: sum over the masked positions (masked-out values dropped with `where`, so -inf there
    cannot make NaN)."""
    return torch.where(mask_BT1.bool(), values_BT1.float(), 0.0).sum(-1)


def dpo_losses_B(policy_chosen_B: torch.Tensor, policy_rejected_B: torch.Tensor, ref_chosen_B: torch.Tensor,
                 ref_rejected_B: torch.Tensor, *, beta: float, label_smoothing: float = 0.0,
                 ipo: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_B, chosen_reward_B, rejected_reward_B) per pair.

    With h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected):
    DPO/cDPO: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) (eps = label_smoothing; 0 is DPO);
    IPO: (h - 1 / (2 beta))^2. Rewards are beta x (policy - reference), detached.
    """
    h_B = (policy_chosen_B - policy_rejected_B) - (ref_chosen_B - ref_rejected_B)
    if ipo:
        loss_B = (h_B - 1 / (2 * beta)) ** 2
    else:
        loss_B = -F.logsigmoid(beta * h_B) * (1 - label_smoothing) - F.logsigmoid(-beta * h_B) * label_smoothing
    return (loss_B, beta * (policy_chosen_B - ref_chosen_B).detach(),
            beta * (policy_rejected_B - ref_rejected_B).detach())


def kto_reference_point(kl_sum: float | torch.Tensor, kl_count: float | torch.Tensor) -> torch.Tensor:
    """z0 = max(0, mean over mismatched (prompt, other response) pairs of policy - reference sequence
    log-prob): the KTO paper's reference point, from sums already reduced over the data-parallel group."""
    return (torch.as_tensor(kl_sum, dtype=torch.float32) / max(float(kl_count), 1.0)).clamp(min=0)


def kto_losses_B(policy_B: torch.Tensor, ref_B: torch.Tensor, desirable_B: torch.Tensor, z0: torch.Tensor, *,
                 beta: float, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_B, reward_B) per sample: with r = policy - reference,
    desirable: w_d (1 - sigmoid(beta (r - z0))); undesirable: w_u (1 - sigmoid(beta (z0 - r))).
    `z0` is detached (no gradient flows through the reference point). reward_B = beta r, detached."""
    r_B = policy_B - ref_B
    z0 = z0.detach().to(r_B)
    desirable_B = desirable_B.to(r_B.device).bool()
    loss_B = torch.where(desirable_B, desirable_weight * (1 - torch.sigmoid(beta * (r_B - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r_B))))
    return loss_B, beta * r_B.detach()


def simpo_losses_B(chosen_avg_B: torch.Tensor, rejected_avg_B: torch.Tensor, *, beta: float,
                   gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_B, chosen_reward_B, rejected_reward_B) per pair of SimPO: -log sigmoid(beta (chosen_avg -
    rejected_avg) - gamma), with the policy's average log-probs (no reference) and gamma the target reward
    margin. Rewards are beta x the average log-prob, detached."""
    chosen_B, rejected_B = beta * chosen_avg_B, beta * rejected_avg_B
    return -F.logsigmoid(chosen_B - rejected_B - gamma), chosen_B.detach(), rejected_B.detach()


def cpo_losses_B(chosen_B: torch.Tensor, rejected_B: torch.Tensor, *, beta: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_B, chosen_reward_B, rejected_reward_B) per pair of CPO's preference term (Xu et al. 2024): -log
    sigmoid(beta (chosen - rejected)), with the policy's sequence log-prob sums (no reference). Rewards are beta
    x the sequence log-prob, detached."""
    chosen_B, rejected_B = beta * chosen_B, beta * rejected_B
    return -F.logsigmoid(chosen_B - rejected_B), chosen_B.detach(), rejected_B.detach()


LOG_ODDS_MAX_AVG_LOGPROB = -1e-6
"""ORPO: average log-probs are clamped to at most this before log(1 - p): at 0 (p = 1 in float32) the odds are
infinite. A response that certain contributes no odds-ratio gradient."""


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler's two branches)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def odds_ratio_losses_B(chosen_avg_B: torch.Tensor, rejected_avg_B: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(odds-ratio loss_B, log odds ratio_B) per pair of ORPO: with p = exp(average log-prob) and odds(p) =
    p / (1 - p), log OR = log odds(p_chosen) - log odds(p_rejected) and the loss is -log sigmoid(log OR)."""
    chosen_B = chosen_avg_B.clamp(max=LOG_ODDS_MAX_AVG_LOGPROB)
    rejected_B = rejected_avg_B.clamp(max=LOG_ODDS_MAX_AVG_LOGPROB)
    log_odds_B = (chosen_B - rejected_B) - (log1mexp(chosen_B) - log1mexp(rejected_B))
    return -F.logsigmoid(log_odds_B), log_odds_B.detach()
