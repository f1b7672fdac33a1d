"""Rewards from a user's Python file defining `reward_func(queries, prompts, labels)` (OpenRLHF's
`--remote_rm_url path/to/file.py` convention). The function may return a tensor or list of rewards,
or a dict with "rewards" and optionally "scores" and "extra_logs"."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from rlhf.rewards.base import RewardInputs, RewardResult, result_from_output


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


class RewardFuncFile:
    """A `RewardSource` backed by a reward_func file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.func = load_reward_func(path)

    def score(self, batch: RewardInputs) -> RewardResult:
        out = self.func(batch.queries, batch.prompts, batch.labels)
        return result_from_output(out, len(batch.queries), f"reward_func in {self.path}")
