"""Asynchronous training (--async_train): the rank plan (generation ranks last, the roles share the rest) and the
refusals."""

import pytest

from rlhf.config.errors import UsageError
from rlhf.config.flags import parse_config
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.distributed.topology import Placement, Role, plan_ranks


def test_generation_ranks_come_last_and_the_roles_share_the_rest():
    colocated = Placement({Role.ACTOR: 0, Role.REWARD: 0, Role.ROLLOUT: 0},
                          (frozenset({Role.ACTOR, Role.REWARD, Role.ROLLOUT}),), rollout_ranks=2)
    assert plan_ranks(colocated, 4) == {Role.ACTOR: (0, 1), Role.REWARD: (0, 1), Role.ROLLOUT: (2, 3)}
    sized = Placement({Role.ACTOR: 2, Role.CRITIC: 1, Role.REWARD: 0, Role.ROLLOUT: 0}, rollout_ranks=1)
    assert plan_ranks(sized, 4) == {Role.ACTOR: (0, 1), Role.CRITIC: (2,), Role.REWARD: (0, 1, 2),
                                    Role.ROLLOUT: (3,)}
    with pytest.raises(ValueError, match=r"add up to 3 .* but 2 ranks train \(4 minus 2 generation ranks\)"):
        plan_ranks(Placement({Role.ACTOR: 2, Role.CRITIC: 1, Role.ROLLOUT: 0}, rollout_ranks=2), 4)
    with pytest.raises(ValueError, match="leave no training rank"):
        plan_ranks(colocated, 2)


def test_async_flags_are_checked():
    with pytest.raises(UsageError, match="give --vllm_num_engines"):
        parse_config(TrainPPOConfig, ["--async_train"])
    with pytest.raises(UsageError, match="does not support --dynamic_filtering"):
        parse_config(TrainPPOConfig, ["--async_train", "--vllm_num_engines", "1", "--dynamic_filtering",
                                      "--n_samples_per_prompt", "2"])
    with pytest.raises(UsageError, match="drop --vllm_enable_sleep"):
        parse_config(TrainPPOConfig, ["--async_train", "--vllm_num_engines", "1", "--vllm_enable_sleep"])
    cfg = parse_config(TrainPPOConfig, ["--async_train", "--vllm_num_engines", "2", "--rollout_batch_size", "4",
                                        "--train_batch_size", "4"])
    assert cfg.rollout.rollout_ranks == 2
    with pytest.raises(UsageError, match="leave none of the 2 to train"):
        cfg.check_world(2)
    cfg.check_world(3)
