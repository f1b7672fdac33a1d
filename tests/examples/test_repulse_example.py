"""The RePULSe toy example (`launch/examples/repulse_toy_cpu.sh`: four methods at 3200 sampled responses each,
the exact log P(bad) and expected reward after every fit step), at one seed in CI (REPULSE_TOY_SEEDS=1): every
method reaches about the same reward, and RePULSe ends with the lowest log P(bad). The README's 3-seed table
comes from the script's default seeds 1-3; the thresholds below are set from the seed-1 figures.
"""

import json
import os
import subprocess

from tests.distributed import ROOT, assert_clean_exit

MIN_REWARD = 0.985
"""Final exact expected reward of every method (0.9915-0.998 at seeds 1-3 when measured; RePULSe's is the lowest)."""

MIN_LOG_P_BAD_GAP = 0.4
"""RePULSe's final log P(bad) below every other method's, at seed 1. Measured at seed 1: RePULSe -10.02, REINFORCE
-9.38, transformed REINFORCE -9.19, base as proposal -8.72 (smallest gap 0.64; the 3-seed means' gaps are 0.8-1.0,
but single seeds spread by about 1): about two thirds of the smallest gap."""


def test_repulse_toy_reaches_a_lower_log_p_bad_at_equal_reward(tmp_path):
    out = tmp_path / "toy"
    proc = subprocess.run(["bash", "launch/examples/repulse_toy_cpu.sh", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "REPULSE_TOY_SEEDS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_clean_exit(proc)
    summary = json.loads((out / "figures" / "summary.json").read_text())
    print(json.dumps({m: {"log_p_bad": v["log_p_bad"], "reward_mean": v["reward_mean"],
                          "samples": v["final_samples_drawn"]} for m, v in summary.items()}, indent=1))
    assert {v["final_samples_drawn"] for v in summary.values()} == {3200.0}  # the same sample budget
    # the summary is the last evaluation of each run (one seed: no interval)
    for method, name in (("RePULSe", "repulse"), ("REINFORCE", "reinforce")):
        with open(out / f"{name}_s1" / "metrics.jsonl") as f:
            last = [row for row in map(json.loads, f) if "log_p_bad" in row][-1]
        assert summary[method]["log_p_bad"]["mean"] == last["log_p_bad"], method
    for method, v in summary.items():
        assert v["num_seeds"] == 1 and v["reward_mean"]["mean"] > MIN_REWARD, method
    repulse = summary.pop("RePULSe")["log_p_bad"]["mean"]
    for method, v in summary.items():
        assert repulse < v["log_p_bad"]["mean"] - MIN_LOG_P_BAD_GAP, method
