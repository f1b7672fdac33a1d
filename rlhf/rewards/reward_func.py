"""Rewards from a user's Python file defining `reward_func(queries, prompts, labels)` (OpenRLHF's
`--remote_rm_url path/to/file.py` convention). The function may return a tensor or list of rewards,
or a dict with "rewards" and optionally "scores" and "extra_logs"."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from rlhf.rewards.base import RewardResult


def load_reward_func(path: str) -> Callable:
    """Import `path` and return its `reward_func`, or raise ValueError naming what is wrong."""
    if not os.path.isfile(path):
        raise ValueError(f"--remote_rm_url {path}: file not found (expected a .py file defining reward_func)")
    spec = importlib.util.spec_from_file_location("rlhf_user_reward", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--remote_rm_url {path}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    func = getattr(module, "reward_func", None)
    if not callable(func):
        raise ValueError(f"--remote_rm_url {path} defines no function reward_func(queries, prompts, labels); "
                         "add one that returns one reward per query")
    return func


def _as_vector(values, what: str, path: str, expected: int) -> torch.Tensor:
    try:
        vector = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"reward_func in {path} returned {what} that is not a list of numbers: {err}") from err
    if vector.numel() != expected:
        raise ValueError(f"reward_func in {path} returned {vector.numel()} {what} for {expected} queries; "
                         "it must return exactly one per query, in order")
    if not torch.isfinite(vector).all():
        raise ValueError(f"reward_func in {path} returned non-finite {what}: {vector.tolist()}")
    return vector


class RewardFuncFile:
    """A `RewardSource` backed by a reward_func file, called on each rank for its own samples."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.func = load_reward_func(path)

    def score(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        out = self.func(queries, prompts, labels)
        n = len(queries)
        if isinstance(out, dict):
            if "rewards" not in out:
                raise ValueError(f"reward_func in {self.path} returned a dict without 'rewards' "
                                 f"(keys: {sorted(out)})")
            rewards = _as_vector(out["rewards"], "rewards", self.path, n)
            scores = _as_vector(out["scores"], "scores", self.path, n) if "scores" in out else rewards.clone()
            extra = {k: _as_vector(v, f"extra_logs[{k!r}]", self.path, n)
                     for k, v in (out.get("extra_logs") or {}).items()}
            return RewardResult(rewards, scores, extra)
        rewards = _as_vector(out, "rewards", self.path, n)
        return RewardResult(rewards, rewards.clone())
