"""Reward shaping and sample filtering before advantages: length penalties, clipping, running
normalisation and dynamic filtering of groups. Pure functions except `RunningMoments`, a small
state object whose statistics are fed from global all-reduces by the caller."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def overlong_penalty(response_lens_B: torch.Tensor, generate_max_len: int, buffer_len: int,
                     factor: float) -> torch.Tensor:
    """DAPO: -min(len - (max - buffer), buffer) / buffer * factor for responses past max - buffer; else 0."""
    exceed = (response_lens_B.float() - (generate_max_len - buffer_len)).clamp(max=buffer_len)
    return torch.where(exceed > 0, -exceed / buffer_len * factor, torch.zeros_like(exceed))


def stop_properly_penalty(rewards_B: torch.Tensor, truncated_B: torch.Tensor, coef: float) -> torch.Tensor:
    """ProRL: truncated samples get reward * coef (coef in [0, 1]) or exactly coef (coef < 0)."""
    penalised = rewards_B * coef if coef >= 0 else torch.full_like(rewards_B, coef)
    return torch.where(truncated_B.bool(), penalised, rewards_B)


def group_filter(scores_PN: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """bool [P]: groups whose mean score lies strictly inside (low, high) (dynamic filtering)."""
    mean = scores_PN.float().mean(-1)
    return (mean > low) & (mean < high)


@dataclass
class RunningMoments:
    """Running mean/std of rewards over every sample seen (all ranks), for `--normalize_reward`."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, total: float, total_sq: float, count: float) -> None:
        """Merge a batch given by its global sum, sum of squares and count (Chan et al.)."""
        if count <= 0:
            return
        batch_mean = total / count
        batch_m2 = max(total_sq - count * batch_mean * batch_mean, 0.0)
        delta = batch_mean - self.mean
        new_count = self.count + count
        self.mean += delta * count / new_count
        self.m2 += batch_m2 + delta * delta * self.count * count / new_count
        self.count = new_count

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count > 0 else 1.0

    def normalize(self, rewards_B: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        return (rewards_B - self.mean) / (self.std + eps)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]
