"""A short chaos run (benchmarks/chaos.py, the benchmark's job and fault injection): PPO with a critic through
`rlhf.cli.launch --max-restarts`, rewards from `serve_rm`, hit in turn by the reward server killed and restarted
(the client's retries ride it out), a full checkpoint disk (one line naming it; torchrun restarts the workers, which
resume from the newest complete checkpoint; kill -9 of a rank where a tmpfs cannot be mounted) and SIGTERM to the
launcher with the newest checkpoint then cut in half (the relaunch falls back to the one before): the final weights
and every step's metrics equal a run nothing hit, bit for bit."""

import importlib.util
import json
import os
import subprocess
import warnings

import pytest
import torch

from rlhf.assets import TINY_DIR
from tests.distributed import ROOT, run_job_variants

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

STEPS = 20  # a step takes a fraction of a second: room for four faults, each after a new step
spec = importlib.util.spec_from_file_location("chaos", os.path.join(ROOT, "benchmarks", "chaos.py"))
chaos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chaos)


def test_a_run_hit_by_each_kind_of_fault_ends_on_the_weights_and_metrics_of_the_straight_run(tmp_path):
    ckpt = str(tmp_path / "chaos_ckpt")
    mounted = chaos.mount_tmpfs(ckpt, 256)
    if not mounted:  # not root: said in the summary; a killed rank makes torchrun restart the workers instead
        warnings.warn("test_chaos: kill -9 of a rank instead of a full disk (mounting a tmpfs needs root); "
                      "tests/unit/test_checkpoint_integrity.py covers the full disk's line", stacklevel=1)
    kinds = ["rmkill", "diskfull" if mounted else "kill9", "truncate"]
    reward = chaos.RewardServer(TINY_DIR, open(tmp_path / "reward_server.log", "w"))
    try:
        reward.start()
        # no SIGSTOP here, which --dist_timeout 0.5 (a 7.5 s heartbeat) is for: 2 minutes let the rank that does not
        # wait on the restarted reward server outwait it on a loaded machine (30 s did not, under 3 test workers),
        # and the client retries for most of them (a restart takes 20 s and more under load: 8 tries, 11.5 s, did not)
        flags = chaos.ppo_flags(TINY_DIR, STEPS, reward.url, dist_timeout_min=2)
        straight = tmp_path / "straight"  # in forked ranks: one process start fewer than a launch
        run_job_variants(2, [("train_ppo", [*flags, "--save_path", str(straight), "--ckpt_path",
                                            str(tmp_path / "straight_ckpt")])], tmp_path / "consoles", straight)
        # each fault at the first new step after the last one (spread over 20 steps of a fraction of a second, the
        # last fault found the run at its end): the three faults early in the run, one after another
        run = chaos.Chaos(flags, str(tmp_path / "chaos"), STEPS, len(kinds), kinds, 0, reward, ckpt, in_order=True,
                          spread=False)
        run.run()
    finally:
        reward.stop()
        if mounted:
            subprocess.run(["umount", ckpt], check=False)
    console = (tmp_path / "chaos_console.log").read_text()
    assert [e["fault"] for e in run.events] == kinds, run.events
    assert all(e.get("then") != "no save failed" for e in run.events), run.events
    assert run.launches == 2, console[-4000:]  # the launcher's SIGTERM is the only fault that ends a launch
    assert len(run.resumes) == sum(map(chaos.ends_workers, run.events)), console[-4000:]
    if mounted:
        assert "error: no space left on " in console and "free space or pass another --ckpt_path" in console
    assert "Traceback" not in console, console[-4000:]
    assert run.events[-1]["then"].startswith("truncated ") and "is damaged, skipping it" in console
    rows = [[json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (straight, tmp_path / "chaos")]
    compared = ("step", "reward_mean", "policy_loss", "critic_loss", "kl", "grad_norm")
    assert [r["step"] for r in rows[1]] == list(range(1, STEPS + 1))
    assert [{k: r.get(k) for k in compared} for r in rows[1]] == [{k: r.get(k) for k in compared} for r in rows[0]]
    a, b = chaos.weights(str(straight)), chaos.weights(str(tmp_path / "chaos"))
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(b[name], tensor), name
