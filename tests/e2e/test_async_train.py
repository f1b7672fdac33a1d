"""Asynchronous training end to end: the batch trained at step t was sampled with the weights of step t - queue size
(its samples equal a run that never moves its weights, and the engine-actor log-prob gap appears exactly on the
steps after an update)."""

import pytest

from tests.distributed import run_job_variants
from tests.tiny_runs import SMALL, read_metrics

RUN = [*SMALL, "--rollout_engine", "hf", "--zero_stage", "2", "--max_steps", "4", "--seed", "5",
       "--train_batch_size", "16", "--micro_train_batch_size", "4", "--enable_vllm_is_correction",
       "--lr_warmup_ratio", "0"]  # no warmup: a step with a gradient moves the weights (warmup's first lr is 0)


def test_async_batches_are_stale_by_the_queue_size(tmp_path):
    def train(name, nproc, *extra):
        out = tmp_path / name
        log, = run_job_variants(nproc, [("train_ppo", [*RUN, "--save_path", str(out), *extra])],
                                tmp_path / f"consoles-{name}", out)
        return log, read_metrics(out)

    # lr 1e-12 leaves the fp32 weights as they are: every batch is the initial weights' samples
    _, frozen = train("frozen", 1, "--actor_learning_rate", "1e-12")
    asynchronous = [*RUN, "--actor_learning_rate", "1e-2", "--async_train", "--vllm_num_engines", "1"]
    log, _ = run_job_variants(2, [  # both 2-rank runs in one process start
        ("train_ppo", [*asynchronous, "--save_path", str(tmp_path / "async1")]),
        ("train_ppo", [*asynchronous, "--async_queue_size", "2", "--save_path", str(tmp_path / "async2")])],
        tmp_path / "consoles-async", tmp_path / "async1", tmp_path / "async2")
    assert "asynchronous: ranks 1-1 generate (1 engine(s)) up to 1 step(s) ahead of ranks 0-0" in log
    one, two = read_metrics(tmp_path / "async1"), read_metrics(tmp_path / "async2")
    reward = [r["reward_mean"] for r in frozen]
    # queue 1: the batches of steps 0 and 1 are the initial weights'; queue 2: steps 0, 1 and 2
    assert [r["reward_mean"] for r in one][:2] == reward[:2]
    assert [r["reward_mean"] for r in two][:3] == reward[:3]
    gap = "rollout/logprob_abs_diff"
    for queue, rows in ((1, one), (2, two)):
        assert rows[0][gap] < 1e-4  # trained with the weights that sampled it
        stale_steps = 0
        for t in range(1, len(rows)):
            # stale when an update since its weights moved them: Adam moves the weights at a step once any
            # gradient so far was non-zero (its momentum carries on through a step whose groups all tie)
            moved = any(rows[r]["grad_norm"] > 0 for s in range(max(0, t - queue), t) for r in range(s + 1))
            stale_steps += moved
            if moved:
                assert rows[t][gap] > 1e-3 and rows[t]["rollout/is_weight_mean"] != pytest.approx(1.0, abs=1e-4)
            else:
                assert rows[t][gap] < 1e-4, (queue, t)
        assert stale_steps >= 2, f"queue {queue}: too few updates to see staleness"
