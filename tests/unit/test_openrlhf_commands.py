"""The train_ppo_ray commands of OpenRLHF v0.9.5's example scripts (examples/scripts/*.sh of that tag) parse into
the config each script means."""


import pytest

from rlhf.config.flags import parse_config
from rlhf.config.ppo_config import TrainPPOConfig
from tests.openrlhf_commands import DAPO, PPO_HYBRID_ENGINE, PPO_WITH_REWARD_FN, at_tiny_scale


@pytest.mark.parametrize("argv,world", [(PPO_HYBRID_ENGINE, 2), (PPO_WITH_REWARD_FN, 2), (DAPO, 2)])
def test_openrlhf_example_commands_parse_to_what_they_mean(argv, world, tmp_path):
    with pytest.warns(UserWarning, match="--vllm_num_engines is ignored"):
        cfg = parse_config(TrainPPOConfig, at_tiny_scale(argv, tmp_path))
    cfg.check_world(world)
    assert cfg.model.param_dtype == "bf16" and cfg.engine.zero_stage == 3 and cfg.engine.packing_samples
    assert cfg.data.input_key == "context_messages" and cfg.data.apply_chat_template
    if argv is DAPO:
        assert cfg.algo.advantage_estimator == "group_norm" and cfg.algo.use_kl_loss and cfg.algo.dynamic_filtering
        assert cfg.algo.clip_range == (0.2, 0.27) and cfg.rollout.n_samples_per_prompt == 8
    else:  # the scripts rely on the defaults for the estimator: PPO with a critic, KL in the reward
        assert cfg.algo.advantage_estimator == "gae" and cfg.uses_critic and not cfg.algo.use_kl_loss
        assert cfg.algo.init_kl_coef == 0.01 and cfg.algo.lambd == 1.0 and cfg.algo.value_clip == 0.5
