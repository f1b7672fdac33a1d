"""Run (by `tests.distributed.run_job_variants`, or under torchrun) exactly like `-m rlhf.cli.train_ppo`, but always
with the experience-time actor forward (`actor_forward_skippable` forced False): the full path the skipped forward is
compared against.

    torchrun --nproc_per_node N tests/workers/full_experience_forward.py TRAIN_PPO_FLAGS...
"""

import rlhf.trainers.ppo_build
from rlhf.cli.train_ppo import main

rlhf.trainers.ppo_build.actor_forward_skippable = lambda batch, algo, schedule: False

if __name__ == "__main__":
    main()
