"""The RL learning runs behind the README's figures: the quickstart (GRPO, 2 CPU ranks, the README's first
command) and the launch/examples scripts of PPO, REINFORCE++-baseline and the multi-turn agent (about one to
two minutes each): the reward must clearly rise (the agent's also well above its first answers' share), and each
run prints its first- and last-fifth means (`python -m pytest tests/examples -rP`), the figures the README states.

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


def _fifths(rows: list[dict], key: str) -> tuple[float, float]:
    fifth = len(rows) // 5
    return sum(r[key] for r in rows[:fifth]) / fifth, sum(r[key] for r in rows[-fifth:]) / fifth


def _reward_by_fifths(cmd: list[str], out) -> tuple[float, float, str]:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert_clean_exit(proc, out)
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    first, last = _fifths(rows, "reward_mean")
    print(f"{cmd[1]}: reward_mean first fifth {first:.3f}, last fifth {last:.3f} over {len(rows)} steps")
    for key in ("reward_extra/first_guess_right", "reward_extra/agent_turns"):  # the agent's
        if key in rows[0]:
            print(f"{cmd[1]}: {key} first fifth {_fifths(rows, key)[0]:.3f}, last fifth {_fifths(rows, key)[1]:.3f}")
    return first, last, proc.stdout


def test_quickstart_learns(tmp_path):
    """The README's quickstart: GRPO on the copy task; its curves drawn at the end and named in the summary."""
    first, last, stdout = _reward_by_fifths(["bash", "launch/quickstart.sh", str(tmp_path / "quick")],
                                            tmp_path / "quick")
    assert last > first + MIN_GAIN
    plots = tmp_path / "quick" / "plots"
    assert {"reward_mean.png", "response_length.png", "stage_time.png"} <= set(os.listdir(plots))
    assert f"; plots {plots};" in stdout


@pytest.mark.parametrize("script", ["ppo_tiny_cpu.sh", "reinforce_pp_tiny_cpu.sh", "agent_tiny_cpu.sh"])
def test_example_reward_rises(tmp_path, script):
    first, last, _ = _reward_by_fifths(["bash", f"launch/examples/{script}", str(tmp_path / "run")], tmp_path / "run")
    assert last > first + MIN_GAIN
    if script == "agent_tiny_cpu.sh":  # the hint turn learned too: the reward ends well above the first answers'
        with open(tmp_path / "run" / "metrics.jsonl") as f:  # share (at most half: half the prompts hide the digit)
            rows = [json.loads(line) for line in f]
        assert last > _fifths(rows, "reward_extra/first_guess_right")[1] + 0.25
