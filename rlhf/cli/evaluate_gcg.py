"""Entry point of the RePULSe fork's GCG attack evaluation: `python -m rlhf.cli.evaluate_gcg --pretrain POLICY
--file_path goals.csv ...`, plain or under a launcher (torchrun, deepspeed, srun), whose ranks split the goals. The
attack, its flags and its results file are described in `rlhf.repulse.gcg_run`; without --pretrain the embedded
tiny policy attacks the embedded goals.
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.repulse.gcg_config import EvaluateGCGConfig

JOB_MODULE = "rlhf.repulse.gcg_run"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)


def main(argv: list[str] | None = None) -> None:
    main_for(EvaluateGCGConfig, deferred(JOB_MODULE), "python -m rlhf.cli.evaluate_gcg", argv)


if __name__ == "__main__":
    main()
