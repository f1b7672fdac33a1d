"""Reward sources behind one interface: `RewardSource.score(queries, prompts, labels) -> RewardResult`."""

from rlhf.rewards.base import RewardResult, RewardSource
from rlhf.rewards.reward_func import RewardFuncFile

__all__ = ["RewardResult", "RewardSource", "RewardFuncFile"]
