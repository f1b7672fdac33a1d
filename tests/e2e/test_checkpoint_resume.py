"""Checkpoints of a PPO run (critic, reference, adaptive KL controller, reward normalisation, ptx data): 4 steps
straight == 2 steps, checkpoint, resume, 2 steps (weights and metrics), where the checkpointed and resumed runs
also have every sleep/offload switch on, and the resume skips a damaged newer checkpoint, removes a leftover
temporary one and drops the lost attempt's rows from metrics.jsonl; a third run writes the same checkpoints in the
background (--async_save): every file byte for byte the saving run's; a process killed while writing a checkpoint
leaves the previous one loadable."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlhf.assets import TINY_DIR
from rlhf.utils.checkpoint_files import complete_checkpoints, pick_checkpoint
from tests.distributed import ROOT, run_job_variants
from tests.tiny_runs import EAGER, TRAIN

PPO = [*TRAIN, *EAGER, "--pretrain", f"{TINY_DIR}/policy", "--reward_pretrain", f"{TINY_DIR}/reward_model",
       "--prompt_data", f"{TINY_DIR}/prompts.jsonl", "--advantage_estimator", "gae", "--init_kl_coef", "0.01",
       "--kl_target", "0.01", "--kl_horizon", "50", "--normalize_reward", "--n_samples_per_prompt", "1",
       "--rollout_batch_size", "8", "--micro_rollout_batch_size", "4", "--train_batch_size", "4",
       "--micro_train_batch_size", "2", "--max_epochs", "2", "--generate_max_len", "6", "--prompt_max_len", "16",
       "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--lr_warmup_ratio", "0.25",
       "--max_steps", "4", "--seed", "5", "--zero_stage", "2", "--ptx_coef", "0.1", "--pretrain_data",
       f"{TINY_DIR}/prompts.jsonl"]
SLEEP = ["--deepspeed_enable_sleep", "--ref_reward_offload", "--vllm_enable_sleep"]
COMPARED = ("reward_mean", "reward_shaped_mean", "kl", "kl_coef", "policy_loss", "value_loss", "grad_norm", "lr",
            "ptx_loss")


def results(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], load_file(out / "model" / "model.safetensors")


def train(out, *extra, stdout=None):
    log, = run_job_variants(2, [("train_ppo", [*PPO, "--save_path", str(out), *extra])],
                            out.parent / f"consoles-{out.name}", out)
    if stdout is not None:
        stdout.append(log)
    return results(out)


@pytest.mark.vllm
def test_resume_equals_uninterrupted(tmp_path):
    """The straight and the saving run share one process start (`run_job_variants`); the resume
    runs in processes of its own, as after a real stop."""
    pytest.importorskip("vllm")
    ckpt, in_background = tmp_path / "ckpt", tmp_path / "ckpt_async"
    saving = [*PPO, "--save_steps", "2", *SLEEP]
    run_job_variants(2, [("train_ppo", [*PPO, "--save_path", str(tmp_path / "straight")]),
                         ("train_ppo", [*saving, "--save_path", str(tmp_path / "saving"), "--ckpt_path", str(ckpt)]),
                         ("train_ppo", [*saving, "--save_path", str(tmp_path / "async"), "--ckpt_path",
                                        str(in_background), "--async_save"])],
                     tmp_path / "consoles", tmp_path / "straight", tmp_path / "saving", tmp_path / "async")
    (straight_metrics, straight), (saved_metrics, saved) = results(tmp_path / "straight"), results(tmp_path / "saving")
    assert [s for s, _ in complete_checkpoints(str(ckpt))] == [2, 4]
    # --async_save: the same checkpoints, file for file and byte for byte (step 4's completed as the run ended),
    # and the same training
    assert [s for s, _ in complete_checkpoints(str(in_background))] == [2, 4]
    for step in (2, 4):
        files = {os.path.relpath(os.path.join(d, f), ckpt / f"global_step{step}")
                 for d, _, names in os.walk(ckpt / f"global_step{step}") for f in names}
        assert {os.path.relpath(os.path.join(d, f), in_background / f"global_step{step}")
                for d, _, names in os.walk(in_background / f"global_step{step}") for f in names} == files
        for rel in files:
            assert (in_background / f"global_step{step}" / rel).read_bytes() == \
                (ckpt / f"global_step{step}" / rel).read_bytes(), (step, rel)
    assert [{k: m[k] for k in COMPARED} for m in results(tmp_path / "async")[0]] == \
        [{k: m[k] for k in COMPARED} for m in saved_metrics]
    # as if the job died while writing step 6's checkpoint, and step 4's lost rank 1's RNG state: resume
    # falls back to step 2, removes the leftover, and metrics.jsonl (the saving run's) keeps steps 1, 2
    rank1 = ckpt / "global_step4" / "rng" / "rank1.pt"
    rank1.write_bytes(rank1.read_bytes()[:64])
    (ckpt / ".tmp-global_step6" / "rng").mkdir(parents=True)
    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "saving" / "metrics.jsonl", tmp_path / "resumed" / "metrics.jsonl")
    stdout = []
    resumed_metrics, resumed = train(tmp_path / "resumed", "--load_checkpoint", "--ckpt_path", str(ckpt), *SLEEP,
                                     stdout=stdout)
    assert f"removed {ckpt}/.tmp-global_step6: a checkpoint whose writing was interrupted" in stdout[0]
    assert f"checkpoint {ckpt}/global_step4 is damaged, skipping it: {rank1} has 64 bytes" in stdout[0]
    assert f"resumed from {ckpt}/global_step2 after 2 steps" in stdout[0]
    assert [m["step"] for m in resumed_metrics] == [1, 2, 3, 4]
    assert resumed_metrics[:2] == saved_metrics[:2]
    resumed_metrics = resumed_metrics[2:]
    for a, b, c in zip(straight_metrics[2:], saved_metrics[2:], resumed_metrics):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
            assert c[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    assert straight_metrics[3]["kl_coef"] != straight_metrics[0]["kl_coef"]  # the controller state mattered
    for name, weight in straight.items():
        torch.testing.assert_close(saved[name], weight, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=0, msg=name)


KILLED_WRITER = """
import os, signal, sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from rlhf.utils.checkpoint_files import CheckpointWriter
for step, die in ((2, False), (4, True)):
    w = CheckpointWriter(sys.argv[1], step, is_writer=True)
    tmp = w.begin()
    with open(os.path.join(tmp, "weights.bin"), "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
    w.save_rank_state(0)
    w.save_trainer_state({{"step": step, "world_size": 1}})
    w.commit()
"""


def test_killed_while_writing_leaves_previous_checkpoint(tmp_path):
    from tests.distributed import free_port

    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER.format(port=free_port()), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert os.path.isdir(tmp_path / ".tmp-global_step4")
    assert complete_checkpoints(str(tmp_path)) == [(2, str(tmp_path / "global_step2"))]
    with open(tmp_path / "global_step2" / "trainer_state.json") as f:
        assert json.load(f)["step"] == 2
    with open(tmp_path / "global_step2" / "MANIFEST.json") as f:
        assert json.load(f)["files"]["weights.bin"]["size"] == 1 << 20
    done, path, notes = pick_checkpoint(str(tmp_path), resuming=True, explicit_path=True, restarted=False)
    assert (done, path) == (2, str(tmp_path / "global_step2"))
    assert notes == [f"removed {tmp_path}/.tmp-global_step4: a checkpoint whose writing was interrupted"]
    assert not os.path.exists(tmp_path / ".tmp-global_step4")
