"""KL estimators between the policy and the reference model, and the KL coefficient controllers
(RL_MATH.md, "KL estimators"). Shapes: B samples, T1 token positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def kl_k1(d: torch.Tensor) -> torch.Tensor:
    return d


def kl_k2(d: torch.Tensor) -> torch.Tensor:
    return d.square() / 2


def kl_k3(d: torch.Tensor) -> torch.Tensor:
    return torch.exp(-d) - 1 + d


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(logprobs_BT1: torch.Tensor, ref_logprobs_BT1: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate with d = logp - logp_ref, clamped to [-10, 10]."""
    d = logprobs_BT1.float() - ref_logprobs_BT1.float()
    return KL_ESTIMATORS[kind](d).clamp(-10.0, 10.0)


@dataclass
class KLController:
    """The KL coefficient beta: fixed (target None) or adaptive toward `target` over `horizon` samples.

    Adaptive rule: e = clip(kl / target - 1, -0.2, 0.2); beta *= 1 + e * n_samples / horizon.
    """

    value: float
    target: float | None = None
    horizon: int = 10000

    def update(self, current_kl: float, n_samples: int) -> None:
        if self.target is None:
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = state["value"], state["target"], state["horizon"]
