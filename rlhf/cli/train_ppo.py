"""Entry point of RL training: `torchrun ... -m rlhf.cli.train_ppo --pretrain ... ` (or srun).

Parses OpenRLHF-style flags into the typed config and runs PPO's run (`rlhf.trainers.ppo_run`). A command with the
RePULSe fork's flags runs as `rlhf.cli.train_repulse`.
"""

from __future__ import annotations

import os
import sys

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.flags import fork_flags_in
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.utils.preload import preload_this_program

JOB_MODULE = "rlhf.trainers.ppo_run"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)
PROG = "python -m rlhf.cli.train_ppo"


def main(argv: list[str] | None = None) -> None:
    """A command with the RePULSe fork's flags is the fork's `train_ppo` (`openrlhf.cli.train_ppo` there): it runs
    as `rlhf.cli.train_repulse`, said in one line, so the fork's scripts switch by changing the launcher."""
    fork = fork_flags_in(sys.argv[1:] if argv is None else list(argv))
    if fork:
        if argv is None:
            preload_this_program()  # before that line (`main_for` would restart after it)
        from rlhf.cli import train_repulse

        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            shown = ", ".join(fork[:3]) + (f" and {len(fork) - 3} more" if len(fork) > 3 else "")
            print(f"the RePULSe fork's flags ({shown}): running this command as python -m rlhf.cli.train_repulse",
                  flush=True)
        train_repulse.main(argv)
        return
    main_for(TrainPPOConfig, deferred(JOB_MODULE), PROG, argv)


def warm_imports(argv: list[str]) -> list[str]:
    """What a worker of this command imports (`rlhf.cli.warm_start`): the run, and vLLM's engine where it
    generates with vLLM; a fork command's as `rlhf.cli.train_repulse` says."""
    from rlhf.cli.warm_start import rollout_modules

    if fork_flags_in(argv):
        from rlhf.cli import train_repulse

        return train_repulse.warm_imports(argv)
    return [JOB_MODULE, *rollout_modules(TrainPPOConfig, argv, PROG)]


if __name__ == "__main__":
    main()
