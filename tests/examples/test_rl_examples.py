"""The RL learning runs behind the README's figures: the quickstart (GRPO, 2 CPU ranks, the README's first
command) and the launch/examples scripts of PPO, REINFORCE++-baseline and the multi-turn agent (about two
to four minutes each): the reward must clearly rise, and each run prints its first- and last-fifth means
(`python -m pytest tests/examples -rP`), the figures the README states.

Not run here, each covered elsewhere: `grpo_tiny_cpu.sh` (the quickstart's copy task and algorithm; its KL
loss is checked by tests/e2e/test_train_ppo.py), `ppo_packed_ring_cpu.sh` (the PPO example with packing,
dynamic batches and ring attention, which tests/e2e/test_ppo_layouts.py proves equal to padded steps).
"""

import json
import os
import subprocess

import pytest

from tests.distributed import ROOT, assert_clean_exit

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

MIN_GAIN = 0.3
"""Last fifth minus first fifth of the steps' mean reward (the README's figures: gains of 0.56 to 0.90)."""


def _reward_by_fifths(cmd: list[str], out) -> tuple[float, float]:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert_clean_exit(proc, out)
    with open(out / "metrics.jsonl") as f:
        rewards = [json.loads(line)["reward_mean"] for line in f]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    print(f"{cmd[1]}: reward_mean first fifth {first:.3f}, last fifth {last:.3f} over {len(rewards)} steps")
    return first, last


def test_quickstart_learns(tmp_path):
    """The README's quickstart: GRPO on the copy task."""
    first, last = _reward_by_fifths(["bash", "launch/quickstart.sh", str(tmp_path / "quick")], tmp_path / "quick")
    assert last > first + MIN_GAIN


@pytest.mark.parametrize("script", ["ppo_tiny_cpu.sh", "reinforce_pp_tiny_cpu.sh", "agent_tiny_cpu.sh"])
def test_example_reward_rises(tmp_path, script):
    first, last = _reward_by_fifths(["bash", f"launch/examples/{script}", str(tmp_path / "run")], tmp_path / "run")
    assert last > first + MIN_GAIN
