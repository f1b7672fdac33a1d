"""RePULSe's config checks."""


import pytest

from rlhf.config.errors import UsageError


def test_repulse_config_checks():
    from rlhf.config.ppo_config import BatchConfig
    from rlhf.repulse.repulse_config import RepulseConfig, TrainRepulseConfig

    repulse_flags = dict(harmlessness_training_loss_type="neg_training", reinforce_baseline_type="expectation",
                         actor_loss_type="ctl", parameterization="policy_psi_q_p_s_t", target_dist_beta=-1.0)

    def cfg(**repulse):
        return TrainRepulseConfig(repulse=RepulseConfig(do_harmlessness_training=True,
                                                        **{**repulse_flags, **repulse}),
                                  batch=BatchConfig(rollout_batch_size=2, train_batch_size=8, micro_train_batch_size=4))

    assert cfg(duplicate_rollout_batch_by=4).schedule.samples_per_prompt == 4
    assert not cfg(duplicate_rollout_batch_by=4).schedule.uses_critic
    with pytest.raises(UsageError, match="--duplicate_rollout_batch_by \\(times --n_samples_per_prompt\\) must be > 1"):
        TrainRepulseConfig(repulse=RepulseConfig(do_harmlessness_training=True, **repulse_flags),
                           batch=BatchConfig(rollout_batch_size=8, train_batch_size=8, micro_train_batch_size=4))
    # a group may span micro-batches and ranks; only CTL needs it inside one optimizer step
    assert cfg(duplicate_rollout_batch_by=8).batch.micro_train_batch_size == 4
    with pytest.raises(UsageError, match="--train_batch_size 8 must be a multiple of the 16 samples of a prompt "
                                         "with --actor_loss_type ctl"):
        cfg(duplicate_rollout_batch_by=16)
    assert cfg(duplicate_rollout_batch_by=16, actor_loss_type="dpg").schedule.samples_per_prompt == 16
    assert cfg(duplicate_rollout_batch_by=16, harmlessness_training_loss_type="reinforce",
               alpha=0.0).schedule.samples_per_prompt == 16
    with pytest.raises(UsageError, match="the proposal trains with ctl or dpg"):
        RepulseConfig(do_harmlessness_training=True, **{**repulse_flags, "actor_loss_type": "sixo"})
    # the fork's defaults: nothing RePULSe-specific is assumed, each choice is asked for by name
    with pytest.raises(UsageError, match="--do_harmlessness_training needs one of neg_training, reinforce"):
        RepulseConfig(do_harmlessness_training=True)
    with pytest.raises(UsageError, match="needs --reinforce_baseline_type expectation"):
        RepulseConfig(do_harmlessness_training=True, harmlessness_training_loss_type="reinforce")
    with pytest.raises(UsageError, match="add --actor_loss_type ctl"):
        RepulseConfig(do_harmlessness_training=True, **{**repulse_flags, "actor_loss_type": "ppo"})
    with pytest.raises(UsageError, match="the proposal's target sigma need --target_dist_beta"):
        RepulseConfig(do_harmlessness_training=True, **{**repulse_flags, "target_dist_beta": None})
    with pytest.raises(UsageError, match="exists only with --do_harmlessness_training"):
        RepulseConfig(actor_loss_type="ctl", parameterization="policy_psi_q_p_s_t")
    from rlhf.config.ppo_config import AlgoConfig, PPOOptimConfig

    with pytest.raises(UsageError, match="does not use --use_kl_loss .*, --dynamic_filtering: drop them"):
        TrainRepulseConfig(
            repulse=RepulseConfig(do_harmlessness_training=True, duplicate_rollout_batch_by=4, **repulse_flags),
            algo=AlgoConfig(use_kl_loss=True, dynamic_filtering=True))
    reinforce = dict(repulse_flags, harmlessness_training_loss_type="reinforce", target_dist_beta=None)
    assert RepulseConfig(do_harmlessness_training=True, **repulse_flags).uses_proposal
    assert not RepulseConfig(do_harmlessness_training=True, use_base_as_proposal=True, **repulse_flags).uses_proposal
    assert not RepulseConfig(do_harmlessness_training=True, **reinforce).uses_proposal
    # q's learning rate: 0 is allowed (the fork's baselines pass it), a rate for no q is reported
    with pytest.warns(UserWarning, match="--actor_learning_rate 0.0003 has no effect: .* trains no proposal"):
        TrainRepulseConfig(repulse=RepulseConfig(do_harmlessness_training=True, duplicate_rollout_batch_by=4,
                                                 **reinforce),
                           optim=PPOOptimConfig(actor_learning_rate=3e-4),
                           batch=BatchConfig(rollout_batch_size=2, train_batch_size=8, micro_train_batch_size=4))
    TrainRepulseConfig(repulse=RepulseConfig(do_harmlessness_training=True, duplicate_rollout_batch_by=4, **reinforce),
                       optim=PPOOptimConfig(actor_learning_rate=0),
                       batch=BatchConfig(rollout_batch_size=2, train_batch_size=8, micro_train_batch_size=4))
    with pytest.raises(UsageError, match="--actor_learning_rate must be positive"):
        TrainRepulseConfig(optim=PPOOptimConfig(actor_learning_rate=0))
    # PPO runs take --duplicate_rollout_batch_by as samples per prompt (the fork's PPO commands do)
    ppo = TrainRepulseConfig(repulse=RepulseConfig(duplicate_rollout_batch_by=4),
                             batch=BatchConfig(rollout_batch_size=2, train_batch_size=8))
    assert ppo.schedule.samples_per_prompt == 4
    with pytest.warns(UserWarning, match="--alpha, --target_dist_beta only act with --do_harmlessness_training"):
        TrainRepulseConfig(repulse=RepulseConfig(alpha=1.0, target_dist_beta=-1.0))


def test_the_forks_flags_belong_to_train_repulse_only(capsys):
    """RePULSe lives beside PPO: `train_ppo` does not know the fork's flags and names the module that does;
    the fork's bookkeeping flags are accepted (with a note) by that module only."""
    from rlhf.config.flags import FORK_BOOKKEEPING_FLAGS, REPULSE_FLAGS, flag_specs, parse_config
    from rlhf.config.ppo_config import TrainPPOConfig
    from rlhf.repulse.repulse_config import FORK_IGNORED_FLAGS, TrainRepulseConfig

    ppo = {s.flag for s in flag_specs(TrainPPOConfig)}
    assert set(REPULSE_FLAGS) == {s.flag for s in flag_specs(TrainRepulseConfig)} - ppo
    assert set(FORK_BOOKKEEPING_FLAGS) == set(FORK_IGNORED_FLAGS)
    with pytest.raises(SystemExit) as exc:
        parse_config(TrainPPOConfig, ["--do_harmlessness_training", "--rm_type", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--do_harmlessness_training is a flag of python -m rlhf.cli.train_repulse" in err
    assert "--rm_type is a flag of python -m rlhf.cli.train_repulse" in err  # no look-alike hint
    with pytest.warns(UserWarning, match="--rm_type is ignored: the RePULSe fork's reward-model plumbing"):
        assert parse_config(TrainRepulseConfig, ["--rm_type", "x", "--duplicate_rollout_batch_by", "2"]
                            ).schedule.samples_per_prompt == 2


SCHEDULE_FLAGS = {("rollout", "n_samples_per_prompt"), ("batch", "num_episodes"), ("checkpoint", "save_steps"),
                  ("optim", "actor_learning_rate")}
"""The flags behind `rlhf.config.ppo_config.Schedule` that RePULSe reads otherwise (as `cfg.<sub-config>.<flag>`)."""


def test_ppo_reads_its_schedule_never_the_flags_behind_it():
    """PPO's run, builders, planner and config checks read `cfg.schedule`: a read of a flag behind it would run
    RePULSe's command with PPO's meaning of the flag (--num_episodes is q's updates per step there, for
    example). Only the `schedule` property itself reads them."""
    import ast
    import glob

    from tests.distributed import ROOT

    paths = [*glob.glob(f"{ROOT}/rlhf/trainers/*.py"), *glob.glob(f"{ROOT}/rlhf/planning/*.py"),
             f"{ROOT}/rlhf/config/ppo_config.py"]
    offenders = []
    for path in paths:
        tree = ast.parse(open(path).read())
        schedule = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "schedule"]
        allowed = {id(n) for f in schedule for n in ast.walk(f)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and id(node) not in allowed
                    and (node.value.attr, node.attr) in SCHEDULE_FLAGS):
                offenders.append(f"{path.removeprefix(ROOT + '/')}:{node.lineno}: .{node.value.attr}.{node.attr}")
    assert offenders == []
    assert len(paths) > 20 and len(schedule) == 1
