"""SIGUSR1/SIGTERM make the job checkpoint and exit 0 (workers signalled: tests/e2e/test_slurm.py); workers
whose plain torchrun died of SIGUSR1 checkpoint and exit. A checkpoint written on a signal is checked against its
manifest (every file's size and CRC); resuming from one is proved once, by the run that SIGTERM interrupts mid-step,
which must then equal the straight run. (A job that torchrun restarts (--max-restarts) after a worker died resumes
from the newest complete checkpoint on its own: tests/e2e/test_chaos.py, with the other faults.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlhf.assets import TINY_DIR
from rlhf.cli.launch import child_pids
from rlhf.utils.checkpoint_files import complete_checkpoints, verify_checkpoint
from tests.distributed import ROOT, assert_clean_output, free_port, run_job_variants
from tests.tiny_runs import EAGER, TRAIN

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

GRPO = [*TRAIN, *EAGER, "--init_kl_coef", "0", "--advantage_estimator", "group_norm",
        "--pretrain", f"{TINY_DIR}/policy", "--remote_rm_url", f"{TINY_DIR}/reward.py",
        "--prompt_data", f"{TINY_DIR}/prompts.jsonl", "--label_key", "label", "--n_samples_per_prompt", "4",
        "--rollout_batch_size", "4", "--train_batch_size", "16", "--micro_train_batch_size", "4",
        "--generate_max_len", "6", "--prompt_max_len", "16", "--actor_learning_rate", "1e-3", "--seed", "2"]


def launch(out, ckpt, *extra, launcher=("torch.distributed.run",), env=None):
    """train_ppo under torchrun (or `launcher=("rlhf.cli.launch", ...flags)`); flags in `extra` come last."""
    cmd = [sys.executable, "-m", *launcher, "--nproc_per_node=2", "--max-restarts=0",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "rlhf.cli.train_ppo", *GRPO,
           "--save_path", str(out), "--ckpt_path", str(ckpt), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})})


def wait_for(condition, proc, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"job ended early: {proc.stderr.read()[-4000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.5)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's parent is now init, which may reap it late)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def logged_steps(out):
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_usr1_to_plain_torchrun_leaves_workers_that_checkpoint_and_exit(tmp_path):
    """Plain torchrun dies at once on SIGUSR1 (a signal it does not handle); its workers notice their launcher
    is gone, checkpoint the step they are in and exit (nobody is left to stop them): a complete, intact checkpoint."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = launch(out, ckpt, "--max_steps", "200")
    wait_for(lambda: len(logged_steps(out)) >= 2, proc)
    pids = child_pids(proc.pid)  # the workers
    os.kill(proc.pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)  # the pipes close once the workers, which hold them too, exit
    assert proc.returncode == -signal.SIGUSR1
    assert not [p for p in pids if running(p)], err[-4000:]
    # the first rank to notice stops both at the step's end (the other may exit before its next look)
    assert "is gone: checkpointing at the end of this step, then exiting" in err, err[-4000:]
    steps = logged_steps(out)
    assert [s for s, _ in complete_checkpoints(str(ckpt))] == [steps[-1]]
    assert steps[-1] < 200
    assert verify_checkpoint(str(ckpt / f"global_step{steps[-1]}")) is None


SLOW_REWARD = """
import importlib.util, time
spec = importlib.util.spec_from_file_location("tiny_reward", {path!r})
tiny = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny)

def reward_func(queries, prompts, labels):
    time.sleep(5)  # a step longer than torchrun's shutdown timeout (1 s below)
    return tiny.reward_func(queries, prompts, labels)
"""


def test_signal_to_the_launcher_checkpoints_and_exits_0(tmp_path):
    """SIGTERM goes to the launcher (as from `kill`, `timeout` or a scheduler), not to the workers, and each
    step outlasts torchrun's shutdown timeout: the workers still finish the step, checkpoint, and the launcher
    exits 0; the checkpoint is complete and intact. (SIGUSR1 takes the same relay: tests/e2e/test_hangs_launcher.py
    relays both signals to stand-in workers.)"""
    sig = signal.SIGTERM
    out, ckpt, reward = tmp_path / "run", tmp_path / "ckpt", tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD.format(path=f"{TINY_DIR}/reward.py"))
    launcher = ("rlhf.cli.launch", "--grace_period", "120", "--shutdown_timeout", "1")
    proc = launch(out, ckpt, "--max_steps", "200", "--remote_rm_url", str(reward), launcher=launcher)
    wait_for(lambda: len(logged_steps(out)) >= 2, proc)
    sent = time.monotonic()
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=300)
    seconds = time.monotonic() - sent
    (tmp_path / "stderr.txt").write_text(err)
    assert proc.returncode == 0, err[-4000:]
    assert f"preempted by {sig.name}: the workers checkpointed and exited" in err
    assert seconds < 60, seconds
    steps = logged_steps(out)
    assert [s for s, _ in complete_checkpoints(str(ckpt))] == [steps[-1]]
    assert verify_checkpoint(str(ckpt / f"global_step{steps[-1]}")) is None


SIGTERM_REWARD = """
import importlib.util, os, signal, threading, time
spec = importlib.util.spec_from_file_location("tiny_reward", {path!r})
tiny = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny)
calls = 0

def reward_func(queries, prompts, labels):
    global calls
    calls += 1
    if os.environ.get("SIGTERM_AT_CALL") == str(calls) and os.environ["RANK"] == "0":
        # rank 0 only, 1 s into a reward call that would take 10 minutes, in the middle of the step's experience
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        try:
            time.sleep(600)
        except Exception:  # a reward function's own handler does not swallow the interruption
            pass
    return tiny.reward_func(queries, prompts, labels)
"""
ABANDON = ["--rollout_engine", "hf", "--normalize_reward", "--init_kl_coef", "0.01", "--kl_target", "0.1",
           "--max_steps", "4"]
COMPARED = ("reward_mean", "kl", "kl_coef", "policy_loss", "grad_norm", "lr")


def test_sigterm_mid_step_abandons_it_and_the_resumed_run_equals_the_straight_one(tmp_path):
    """SIGTERM (rank 0 only) 1 s into a 10-minute reward call of step 3's experience: the call is interrupted, every
    rank drops the step, rolls back what it had changed (RNG, reward statistics, KL controller), checkpoints step 2
    and exits 0; resumed, steps 3-4 and the weights equal a run never interrupted. The resumed run's workers are
    forked from `rlhf.cli.launch` (its warm start) and the others are new interpreters: the equality holds across
    the two starts too."""
    from safetensors.torch import load_file

    reward = tmp_path / "reward.py"
    reward.write_text(SIGTERM_REWARD.format(path=f"{TINY_DIR}/reward.py"))
    straight = tmp_path / "straight"  # the reference, in forked ranks (one process start fewer than a launch)
    argv = [*GRPO, *ABANDON, "--remote_rm_url", str(reward), "--save_path", str(straight),
            "--ckpt_path", str(tmp_path / "straight_ckpt")]
    runs = {"straight": (run_job_variants(2, [("train_ppo", argv)], tmp_path / "consoles", straight)[0], straight)}
    for name, env in (("abandoned", {"SIGTERM_AT_CALL": "3"}), ("resumed", {})):
        out, ckpt = tmp_path / "run", tmp_path / "ckpt"
        extra = ["--load_checkpoint"] if name == "resumed" else []
        launcher = ("rlhf.cli.launch",) if name == "resumed" else ("torch.distributed.run",)
        proc = launch(out, ckpt, *ABANDON, "--remote_rm_url", str(reward), *extra, env=env, launcher=launcher)
        stdout, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        assert_clean_output(stdout, err, out)
        runs[name] = stdout, out
        if name == "resumed":
            assert "[rlhf.cli.launch] workers are forked from this launcher" in err, err[-3000:]
    said = "preempted (SIGTERM) during step 3: its work dropped; checkpoint after step 2 written"
    assert said in runs["abandoned"][0]
    assert f"resumed from {tmp_path / 'ckpt'}/global_step2" in runs["resumed"][0]
    straight, resumed = [[json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                         for _, out in (runs["straight"], runs["resumed"])]
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [1, 2, 3, 4]
    assert straight[3]["kl_coef"] != straight[2]["kl_coef"]  # the controller moved: its rollback matters
    for a, b in zip(straight, resumed):
        assert {k: b[k] for k in COMPARED} == {k: a[k] for k in COMPARED}, a["step"]
    for name, w in load_file(runs["straight"][1] / "model" / "model.safetensors").items():
        assert torch.equal(load_file(runs["resumed"][1] / "model" / "model.safetensors")[name], w), name
