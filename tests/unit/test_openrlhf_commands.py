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
        assert cfg.algo.advantage_estimator == "gae" and cfg.schedule.uses_critic and not cfg.algo.use_kl_loss
        assert cfg.algo.init_kl_coef == 0.01 and cfg.algo.lambd == 1.0 and cfg.algo.value_clip == 0.5


def test_dry_run_shows_openrlhfs_placement_of_the_example_commands_beside_ours():
    """`--dry_run` prints what OpenRLHF's Ray placement of the same flags would be (the commands at full size) and
    what differs in the single program's plan."""
    import warnings

    from rlhf.distributed.topology import Role
    from rlhf.planning.openrlhf_placement import comparison_lines, openrlhf_groups

    def parsed(argv):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return parse_config(TrainPPOConfig, argv)

    hybrid = parsed(PPO_HYBRID_ENGINE)
    assert openrlhf_groups(hybrid) == [("actor + reference + critic + reward + 4 vLLM engine(s) of TP 2", 8)]
    split = [a for a in PPO_HYBRID_ENGINE if a != "--colocate_all_models"]  # every role and the engines apart
    assert openrlhf_groups(parsed(split)) == [("actor", 8), ("reference", 8), ("critic", 8), ("reward", 8),
                                              ("4 vLLM engine(s) of TP 2", 8)]
    reward_fn = parsed(PPO_WITH_REWARD_FN)  # a reward function gets no GPUs; the engines get their own
    assert openrlhf_groups(reward_fn) == [("actor + reference", 2), ("critic", 2), ("2 vLLM engine(s) of TP 2", 4)]
    plan = {Role.ACTOR: tuple(range(32)), Role.REF: tuple(range(32)), Role.CRITIC: tuple(range(32)),
            Role.REWARD: tuple(range(32)), Role.ROLLOUT: tuple(range(32))}
    lines = comparison_lines(parsed(split), plan, 32)
    assert lines[0] == "OpenRLHF's placement of these flags (train_ppo_ray, one GPU per Ray bundle): 40 GPUs"
    assert "  rollout: 16 engine(s) of TP 2 inside the training ranks' own processes (asleep while the models " \
           "train), instead of --vllm_num_engines 4 on GPUs of their own: the engine count is the world size / TP" \
           in lines
    assert "  GPU count: OpenRLHF would ask Ray for 40 GPUs; this run has the 32 ranks the launcher started" in lines
    assert not any("no --*_num_gpus_per_node" in line for line in lines)  # every size was given
    bare = parsed(["--pretrain", "m", "--reward_pretrain", "r", "--prompt_data", "p"])  # OpenRLHF's 8 per role
    assert openrlhf_groups(bare) == [("actor", 8), ("reference", 8), ("critic", 8), ("reward", 8)]
    assert "  actor, critic, reward, ref: no --*_num_gpus_per_node given, so every rank of the world (OpenRLHF: 8 " \
           "GPUs each)" in comparison_lines(bare, plan, 32)
