"""The commands of the RePULSe research fork's README (tests/repulse_fork_commands.txt, verbatim): every one parses
into what it means; the realistic ones (Sec 4.3) and the GCG evaluation stop at the model load with an error saying
the model must be a local path (nothing is downloaded here)."""


import pytest

from rlhf.assets import TINY_DIR
from rlhf.config.errors import UsageError
from rlhf.config.flags import parse_config
from rlhf.core.run import for_this_machine
from rlhf.repulse.gcg_config import EvaluateGCGConfig
from rlhf.repulse.repulse_config import TrainRepulseConfig
from tests.repulse_fork import GCG, REALISTIC, TOY, TRAIN, flag_value, set_flag


def test_the_file_holds_the_forks_commands():
    assert (len(TOY), len(REALISTIC), len(GCG)) == (10, 21, 1)
    methods = {h.rsplit(" / ", 1)[1] for h, _ in TOY}
    assert methods == {"PPO", "REINFORCE", "REINFORCE with reward transformation", "Base model proposal", "RePULSe"}


def test_every_fork_command_is_recognised_by_train_ppo(monkeypatch, capsys):
    """`python -m rlhf.cli.train_ppo` (the module the rule "replace the launcher" gives for the fork's
    `openrlhf.cli.train_ppo`) runs each of the fork's 31 training commands as train_repulse, saying so once."""
    from rlhf.cli import train_ppo, train_repulse

    ran = []
    monkeypatch.setattr(train_repulse, "main", ran.append)
    monkeypatch.setenv("RANK", "0")
    for _, argv in TRAIN:
        train_ppo.main(argv)
    assert ran == [argv for _, argv in TRAIN] and len(ran) == 31
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 31 and all(line.startswith("the RePULSe fork's flags (--") and line.endswith(
        "running this command as python -m rlhf.cli.train_repulse") for line in lines)
    monkeypatch.setenv("RANK", "1")  # the other ranks run it without a word
    train_ppo.main(TRAIN[0][1])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("heading,argv", TRAIN, ids=[f"{i}" for i in range(len(TRAIN))])
def test_every_train_command_parses_into_what_it_means(heading, argv):
    cfg = parse_config(TrainRepulseConfig, argv)
    rp = cfg.repulse
    method = heading.rsplit(" / ", 1)[1]
    assert rp.do_harmlessness_training == (method != "PPO")
    assert cfg.schedule.samples_per_prompt == int(flag_value(argv, "--duplicate_rollout_batch_by"))
    assert cfg.batch.rollout_batch_size * cfg.schedule.samples_per_prompt % cfg.batch.train_batch_size == 0
    if method == "PPO":
        assert cfg.schedule.uses_critic
        assert cfg.optim.critic_learning_rate == float(flag_value(argv, "--critic_learning_rate"))
        assert cfg.batch.num_episodes == int(flag_value(argv, "--num_episodes"))
    elif method == "RePULSe":
        assert rp.uses_proposal and rp.actor_loss_type == "ctl" and rp.alpha > 0
        assert cfg.optim.actor_learning_rate > 0 and rp.base_actor_learning_rate > 0
    elif method == "Base model proposal":
        assert rp.negatives_used and not rp.uses_proposal
    else:  # REINFORCE, with or without the transform
        assert rp.harmlessness_training_loss_type == "reinforce" and not rp.uses_proposal
        assert (rp.reward_transform == "minus_alpha_exp_beta_r") == ("transformation" in method.lower())
    assert cfg.algo.init_kl_coef == float(flag_value(argv, "--init_kl_coef"))
    assert rp.analytic_bad_word_calc == heading.startswith("Toy")
    assert rp.evaluate_heldout_sampling == (not heading.startswith("Toy"))


@pytest.mark.parametrize("heading,argv", REALISTIC, ids=[f"{i}" for i in range(len(REALISTIC))])
def test_realistic_commands_stop_only_at_the_model_download(heading, argv):
    """Every check before the engines passes up to the model load, which names --pretrain and says the model
    must be a local path."""
    from rlhf.trainers.ppo_run import check_before_engines

    cfg = for_this_machine(parse_config(TrainRepulseConfig, argv).with_demo_defaults())
    world = 1
    with pytest.raises(UsageError, match=f"--pretrain {flag_value(argv, '--pretrain')}: the model must be a local "
                                         "path.*huggingface-cli download"):
        check_before_engines(cfg, world)


def test_the_gcg_command_stops_only_at_the_model_download(tmp_path):
    """With the trained checkpoint and the goals file replaced by local ones, the fork's GCG command stops at
    --pretrain (a hub name). The fork's module name (`evaluate_gcg_sz`) is ours with the package changed."""
    import importlib

    from tests.repulse_fork import COMMAND_LIST

    fork_module = next(m for _, m, _ in COMMAND_LIST if "evaluate_gcg" in m)
    main = importlib.import_module(fork_module.replace("openrlhf.", "rlhf.")).main
    argv = list(GCG[0])
    set_flag(argv, "--ckpt_path", f"{TINY_DIR}/policy")
    set_flag(argv, "--file_path", f"{TINY_DIR}/gcg_goals.csv")
    parse_config(EvaluateGCGConfig, argv)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--save_path", str(tmp_path)])
    assert exit_info.value.code == 2


"""The toy's sizes, shrunk: 8 samples per step instead of 500, 2 fit steps of 2 episodes instead of 50 of 5-10,
prompts of at most 8 tokens (the tiny policy has 256 positions, distilgpt2 1024)."""
