"""(one rank of `rl_step.py`'s measured run; launched by it under torchrun) `rlhf.cli.train_ppo` with the
benchmark's probes installed, then this rank's probe record written to $RL_STEP_OUT/rank{RANK}.pt.

Environment: RL_STEP_OUT (directory), RL_STEP_IGNORE_EOS (1: every response runs to --generate_max_len).
Arguments: train_ppo's flags.
"""

from __future__ import annotations

import os
import sys

import torch
from rl_step_hooks import IGNORE_EOS, PROBE, install_ignore_eos, install_trainer_probes


def main() -> None:
    IGNORE_EOS["on"] = os.environ.get("RL_STEP_IGNORE_EOS") == "1"
    install_ignore_eos()
    install_trainer_probes()
    from rlhf.cli.train_ppo import main as train_ppo

    train_ppo(sys.argv[1:])
    torch.save(PROBE.record(), os.path.join(os.environ["RL_STEP_OUT"], f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()
