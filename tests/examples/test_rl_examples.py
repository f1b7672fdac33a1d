"""The launch/examples scripts (4 CPU ranks each, about two minutes): the reward must clearly rise, so
the learning figures the README states cannot silently go false. Not in the default run (marked
`slow`); `.ci/run` runs them after it with `python -m pytest -m examples tests/test_examples.py`."""

import json
import os
import subprocess

import pytest

from tests.distributed import ROOT

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("script,min_gain", [("ppo_tiny_cpu.sh", 0.3), ("grpo_tiny_cpu.sh", 0.3),
                                             ("reinforce_pp_tiny_cpu.sh", 0.3), ("ppo_packed_ring_cpu.sh", 0.3),
                                             ("agent_tiny_cpu.sh", 0.3)])
def test_example_reward_rises(tmp_path, script, min_gain):
    out = tmp_path / "run"
    proc = subprocess.run(["bash", f"launch/examples/{script}", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1500, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(out / "metrics.jsonl") as f:
        rewards = [json.loads(line)["reward_mean"] for line in f]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    print(f"{script}: reward_mean first fifth {first:.3f}, last fifth {last:.3f} over {len(rewards)} steps")
    assert last > first + min_gain
