"""Asynchronous training (--async_train): the last --vllm_num_engines x TP ranks only generate, a step ahead
(or --async_queue_size steps) of the ranks that train. The rank plan, the refusals, and the schedule itself: the
batch trained at step t was sampled with the weights of step t - queue size (seen in its samples, which equal a
run that never moves its weights, and in the gap between the engine's and the actor's log-probs that the
off-policy correction then weights)."""

import pytest

from rlhf.config.errors import UsageError
from rlhf.config.flags import parse_config
from rlhf.config.ppo import TrainPPOConfig
from rlhf.distributed.topology import Placement, Role, plan_ranks
from tests.distributed import run_torchrun
from tests.test_e2e import SMALL, read_metrics


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


RUN = [*SMALL, "--rollout_engine", "hf", "--zero_stage", "2", "--max_steps", "4", "--seed", "5",
       "--train_batch_size", "16", "--micro_train_batch_size", "4", "--enable_vllm_is_correction"]


@pytest.mark.long
def test_async_batches_are_stale_by_the_queue_size(tmp_path):
    def train(name, nproc, *extra):
        out = tmp_path / name
        proc = run_torchrun(nproc, "-m rlhf.cli.train_ppo", *RUN, "--save_path", str(out), *extra)
        assert proc.returncode == 0, proc.stderr[-6000:]
        return proc.stdout + proc.stderr, read_metrics(out)

    # lr 1e-12 leaves the fp32 weights as they are: every batch is the initial weights' samples
    _, frozen = train("frozen", 1, "--actor_learning_rate", "1e-12")
    log, one = train("async1", 2, "--actor_learning_rate", "1e-2", "--async_train", "--vllm_num_engines", "1")
    assert "asynchronous: ranks 1-1 generate (1 engine(s)) up to 1 step(s) ahead of ranks 0-0" in log
    _, two = train("async2", 2, "--actor_learning_rate", "1e-2", "--async_train", "--vllm_num_engines", "1",
                   "--async_queue_size", "2")
    reward = [r["reward_mean"] for r in frozen]
    # queue 1: the batches of steps 0 and 1 are the initial weights'; queue 2: steps 0, 1 and 2
    assert [r["reward_mean"] for r in one][:2] == reward[:2]
    assert [r["reward_mean"] for r in two][:3] == reward[:3]
    gap = "rollout/logprob_abs_diff"
    for queue, rows in ((1, one), (2, two)):
        assert rows[0][gap] < 1e-4  # trained with the weights that sampled it
        stale_steps = 0
        for t in range(1, len(rows)):
            # stale when an update since its weights moved them (a step whose groups all tie has no gradient)
            moved = any(rows[s]["grad_norm"] > 0 for s in range(max(0, t - queue), t))
            stale_steps += moved
            if moved:
                assert rows[t][gap] > 1e-3 and rows[t]["rollout/is_weight_mean"] != pytest.approx(1.0, abs=1e-4)
            else:
                assert rows[t][gap] < 1e-4, (queue, t)
        assert stale_steps >= 2, f"queue {queue}: too few updates to see staleness"
