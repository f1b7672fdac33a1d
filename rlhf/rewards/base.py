"""The reward interface every reward source implements. Knows nothing about ranks or placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class RewardInputs:
    """Samples to score. queries = prompt text + response text (what reward_func receives).

    sequences_BT / attention_mask_BT: the token ids (for reward models), right-padded.
    """

    queries: list[str]
    prompts: list[str]
    labels: list
    sequences_BT: torch.Tensor
    attention_mask_BT: torch.Tensor


@dataclass
class RewardResult:
    """rewards_B: float32 [B] training rewards; scores_B: float32 [B] scores used for filtering
    (equal to the rewards unless the source says otherwise); extra_logs: name -> [B] values to log; per_call:
    the extra logs the source gave as one value for the whole call (each query holds that value)."""

    rewards_B: torch.Tensor
    scores_B: torch.Tensor
    extra_logs: dict[str, torch.Tensor] = field(default_factory=dict)
    per_call: frozenset[str] = frozenset()


class RewardSource(Protocol):
    """Scores samples. A source whose `score` runs collectives (a sharded or ring-attention model) sets
    `collective = True`: then every rank of a ring calls it; otherwise only the ring's first rank does."""

    def score(self, batch: RewardInputs) -> RewardResult:
        """Score each sample. Called by the reward role's ranks, each data-parallel replica with its shard."""
        ...


def result_from_output(out, n: int, where: str) -> RewardResult:
    """Validate a reward function's or server's output: a list/tensor of rewards, or a dict with
    'rewards' and optionally 'scores' and 'extra_logs'. `where` names the source in errors."""
    if isinstance(out, dict):
        if "rewards" not in out:
            raise ValueError(f"{where} returned a dict without 'rewards' (keys: {sorted(out)})")
        rewards = as_vector(out["rewards"], "rewards", where, n)
        scores = as_vector(out["scores"], "scores", where, n) if "scores" in out else rewards.clone()
        given = out.get("extra_logs") or {}
        extra = {k: _extra_log(v, k, where, n) for k, v in given.items()}
        return RewardResult(rewards, scores, extra, frozenset(k for k, v in given.items() if _one_value(v, n)))
    rewards = as_vector(out, "rewards", where, n)
    return RewardResult(rewards, rewards.clone())


def _one_value(value, n: int) -> bool:
    """Whether an extra log is one value for the whole call rather than one per query."""
    return isinstance(value, (int, float)) or (torch.is_tensor(value) and value.numel() == 1 and n != 1)


def _extra_log(value, key: str, where: str, n: int) -> torch.Tensor:
    """One value per query, or one value for the whole call (OpenRLHF's reward functions often return
    e.g. `reward.mean().item()`): that batch value then stands for each of the call's queries."""
    if _one_value(value, n):
        return as_vector([float(value)] * n, f"extra_logs[{key!r}]", where, n)
    return as_vector(value, f"extra_logs[{key!r}]", where, n)


def as_vector(values, what: str, where: str, expected: int) -> torch.Tensor:
    try:
        vector = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{where} returned {what} that is not a list of numbers: {err}") from err
    if vector.numel() != expected:
        raise ValueError(f"{where} returned {vector.numel()} {what} for {expected} queries; "
                         "it must return exactly one per query, in order")
    if not torch.isfinite(vector).all():
        raise ValueError(f"{where} returned non-finite {what}: {vector.tolist()}")
    return vector
