"""Reward sources behind one interface: `RewardSource.score(RewardInputs) -> RewardResult`."""

from rlhf.rewards.base import RewardInputs, RewardResult, RewardSource
from rlhf.rewards.models import RewardModelEnsemble
from rlhf.rewards.remote import RemoteRewardClient
from rlhf.rewards.reward_func import RewardFuncFile

__all__ = ["RewardInputs", "RewardResult", "RewardSource", "RewardModelEnsemble", "RemoteRewardClient",
           "RewardFuncFile"]
