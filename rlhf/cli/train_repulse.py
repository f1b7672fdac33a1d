"""Entry point of the RePULSe research fork's `train_ppo`: `torchrun ... -m rlhf.cli.train_repulse --pretrain ...`
(or srun), with the fork's flags; `python -m rlhf.cli.train_ppo` runs a fork command here too. The fork's README
commands run after changing `python -m openrlhf.cli.train_ppo` to either module. The run is
`rlhf.repulse.repulse_run`, imported once the flags have parsed (a refused command answers before the engines'
libraries load).
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.repulse.repulse_config import TrainRepulseConfig

JOB_MODULE = "rlhf.repulse.repulse_run"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)
PROG = "python -m rlhf.cli.train_repulse"


def main(argv: list[str] | None = None) -> None:
    main_for(TrainRepulseConfig, deferred(JOB_MODULE), PROG, argv)


def warm_imports(argv: list[str]) -> list[str]:
    """What a worker of this command imports (`rlhf.cli.warm_start`): the run, and vLLM's engine where it
    generates with vLLM."""
    from rlhf.cli.warm_start import rollout_modules

    return [JOB_MODULE, *rollout_modules(TrainRepulseConfig, argv, PROG)]


if __name__ == "__main__":
    main()
