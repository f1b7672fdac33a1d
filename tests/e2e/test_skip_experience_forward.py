"""When a step's batch feeds exactly one actor update, the skipped experience forward gives the full path's update:
same losses, same weights, and the same rollout-mismatch metrics, now measured by the training forward."""

import pytest
from safetensors.torch import load_file

from tests.distributed import run_job_variants
from tests.tiny_runs import SMALL, assert_adam_weights_close, read_metrics

ONE_UPDATE = [*SMALL, "--train_batch_size", "16", "--micro_train_batch_size", "4", "--rollout_engine", "hf",
              "--zero_stage", "2", "--max_steps", "2", "--seed", "3", "--enable_vllm_is_correction"]
SKIPPED = "no experience forward"
LR = 1e-3


def test_skipped_forward_gives_the_full_paths_update(tmp_path):
    # one process start for both; the full path's module patches train_ppo when imported, so it runs second
    logs = run_job_variants(2, [("train_ppo", [*ONE_UPDATE, "--save_path", str(tmp_path / "skip")]),
                                ("tests.workers.full_experience_forward",
                                 [*ONE_UPDATE, "--save_path", str(tmp_path / "full")])],
                            tmp_path / "consoles", tmp_path / "skip", tmp_path / "full")
    (skip_log, skip_rows, skip), (full_log, full_rows, full) = (
        (log, read_metrics(tmp_path / name), load_file(tmp_path / name / "model" / "model.safetensors"))
        for log, name in zip(logs, ("skip", "full")))
    assert SKIPPED in skip_log and SKIPPED not in full_log
    assert len(skip_rows) == len(full_rows) == 2
    for s, f in zip(skip_rows, full_rows):
        assert s["reward_mean"] == f["reward_mean"]  # the same samples
        assert s["policy_loss"] == pytest.approx(f["policy_loss"], abs=1e-6)
        assert s["clip_frac"] == f["clip_frac"] == 0
        for name in ("rollout/logprob_abs_diff", "rollout/is_weight_mean", "rollout/is_clipped_frac"):
            assert s[name] == pytest.approx(f[name], abs=1e-6), name
        assert s["grad_norm"] == pytest.approx(f["grad_norm"], rel=1e-4)
    assert_adam_weights_close(full, skip, lr=LR, steps=2, agree=0.02)
    moved = max(float((skip[n] - w).abs().max()) for n, w in
                load_file(str(_initial_weights())).items() if n in skip)
    assert moved > 0.5 * LR  # the update itself is not a no-op


def _initial_weights():
    import os

    from rlhf.assets import EMBEDDED_MODEL_DIR

    return os.path.join(EMBEDDED_MODEL_DIR, "model.safetensors")
