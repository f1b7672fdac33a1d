"""Every shipped launch script and every command in README.md starts workers through `rlhf.cli.launch` (torchrun
with preemption that keeps work) or srun, never plain `torchrun`, which loses the step in progress on SIGTERM and
orphans its workers on SIGUSR1."""

import glob
import os
import re

from tests.distributed import ROOT

PLAIN_TORCHRUN = re.compile(r"(?<![\w.-])torchrun\s+--(nproc|nnodes)")


def test_no_shipped_command_uses_plain_torchrun():
    offenders = []
    for path in [*glob.glob(os.path.join(ROOT, "launch", "**", "*.sh"), recursive=True),
                 os.path.join(ROOT, "launch", "train_ppo.sbatch"), os.path.join(ROOT, "README.md")]:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if PLAIN_TORCHRUN.search(line) and "plain `torchrun`" not in line:
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert offenders == []
    assert PLAIN_TORCHRUN.search("exec torchrun --nproc_per_node 2 -m rlhf.cli.train_sft")
    assert not PLAIN_TORCHRUN.search("python -m rlhf.cli.launch --nproc_per_node 2 -m rlhf.cli.train_sft")
