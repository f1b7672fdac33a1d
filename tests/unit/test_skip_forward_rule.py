"""When the experience step may skip the actor forward (one actor update per batch, no reference model)."""

import pytest

from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.trainers.experience import actor_forward_skippable
from tests.tiny_runs import SMALL

ONE_UPDATE = [*SMALL, "--train_batch_size", "16", "--micro_train_batch_size", "4", "--rollout_engine", "hf",
              "--zero_stage", "2", "--max_steps", "2", "--seed", "3", "--enable_vllm_is_correction"]


def _config(*flags: str) -> TrainPPOConfig:
    from rlhf.config.flags import parse_config

    return parse_config(TrainPPOConfig, list(flags))


@pytest.mark.parametrize("flags, skippable", [
    ((), True),
    (("--max_epochs", "2"), False),
    (("--train_batch_size", "8"), False),  # two optimizer steps per batch
    (("--freezing_actor_steps", "1"), False),
    (("--init_kl_coef", "0.01"), False),  # the reference model's KL reads the actor's log-probs
    (("--advantage_estimator", "gae", "--n_samples_per_prompt", "1", "--train_batch_size", "4"), True),
])
def test_when_the_forward_is_skipped(flags, skippable):
    cfg = _config(*ONE_UPDATE[:-1], *flags)
    assert actor_forward_skippable(cfg.batch, cfg.algo, cfg.schedule) is skippable
