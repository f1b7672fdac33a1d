"""The jobs under a real SLURM (tests/slurm_cluster.py: slurmctld, slurmd and munged of our own on this host, no GPUs),
not simulated SLURM_* variables: an sbatch of launch/train_cpu.sbatch (its `srun` of 2 train_sft tasks forms one
world) that ends COMPLETED, `scancel --signal USR1` making every task checkpoint and exit 0, the checkpoint moved
to another directory and resumed by a job of 1 task, a task killed with SIGKILL ending the step
(--kill-on-bad-exit) with the rank named, and a task stopped with SIGSTOP named with its stage by its peer's
heartbeat (the one test of a stopped rank under a real launcher). Each run is 4 SFT steps of the embedded demo on 2
CPU tasks."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from rlhf.utils.checkpoint_files import complete_checkpoints, verify_checkpoint
from tests.distributed import ROOT, free_port
from tests.slurm_cluster import private_slurm
from tests.tiny_runs import SUPERVISED, TRAIN, read_metrics, without_timings

SBATCH = os.path.join(ROOT, "launch", "train_cpu.sbatch")


@pytest.fixture(scope="module")
def slurm():
    with private_slurm() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def straight(slurm, tmp_path_factory):
    """SUPERVISED's 4 steps as an sbatch job of launch/train_cpu.sbatch: (job record, save path)."""
    out = tmp_path_factory.mktemp("straight")
    job = slurm.sbatch(f"--output={out}/job.out", SBATCH, *SUPERVISED, "--save_path", str(out / "model"),
                       env={"JOB": "train_sft", "MASTER_PORT": str(free_port())})
    return slurm.wait(job), out


def weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_sbatch_cpu_variant_completes(straight):
    """The sbatch's `srun` of 2 tasks forms one world of both (not two worlds of one) from SLURM's variables, takes
    the 4 steps and writes each rank's log."""
    info, out = straight
    text = (out / "job.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert "2 data-parallel replica(s)" in text
    assert [r["step"] for r in read_metrics(out / "model")] == [0, 1, 2, 3, 4]
    assert set(os.listdir(out / "model" / "logs")) >= {"rank0.log", "rank1.log"}


def test_usr1_checkpoints_and_the_job_resumes_in_another_directory_on_one_task(slurm, straight, tmp_path):
    """Where users stop and move a job: USR1 (what --signal=USR1@120 sends before the time limit) while the 2 tasks
    set up: they train to the next step boundary, checkpoint and exit 0 (COMPLETED). The checkpoint directory is
    moved elsewhere (a new allocation's storage), and a job of 1 task resumes it there and continues the straight
    2-task job's steps (the same samples, metrics to float rounding, weights within AdamW's bound); a copy resumed on
    1 rank by the product's launcher (`rlhf.cli.launch`, outside SLURM) takes exactly the sbatch job's steps, bit
    for bit. The exact resume at the same world size (SIGTERM, SIGUSR1, Ctrl-C, kill -9): test_preemption.py and
    test_chaos.py; moves of stage and placement, with PPO and DPO: test_checkpoint_move.py."""
    import shutil

    from tests.distributed import assert_clean_exit, run_torchrun
    from tests.tiny_runs import assert_same_steps

    first, ckpt = tmp_path / "first", tmp_path / "ckpt"
    env = {"JOB": "train_sft", "MASTER_PORT": str(free_port())}
    job = slurm.sbatch(f"--output={tmp_path}/first.out", SBATCH, *SUPERVISED, "--save_path", str(first),
                       "--ckpt_path", str(ckpt), env=env)
    deadline = time.monotonic() + 120
    # route_library_output opens logs/rank<r>.log right before the task installs its USR1 handler
    while not all((first / "logs" / f"rank{r}.log").exists() for r in (0, 1)):
        assert slurm.job(job)["JobState"] in ("PENDING", "RUNNING"), (tmp_path / "first.out").read_text()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1)
    sent = slurm.run("scancel", "--signal", "USR1", str(job))
    assert sent.returncode == 0, sent.stderr
    info = slurm.wait(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (tmp_path / "first.out").read_text()[-4000:]
    done = [r["step"] for r in read_metrics(first)][-1]
    assert done < 4, f"the signal came after the last step: {done}"
    assert [s for s, _ in complete_checkpoints(str(ckpt))] == [done]

    moved, out = tmp_path / "moved_ckpt", tmp_path / "resumed"
    shutil.copytree(ckpt, tmp_path / "launcher_ckpt")
    shutil.copytree(first, tmp_path / "launcher_resumed")
    shutil.move(ckpt, moved)
    shutil.copytree(first, out)  # the first job's save path: its metrics rows up to the checkpoint stay
    args = [*SUPERVISED, "--save_path", str(out), "--ckpt_path", str(moved), "--load_checkpoint"]
    info = slurm.wait(slurm.sbatch(f"--output={tmp_path}/resumed.out", "--ntasks-per-node=1", SBATCH, *args,
                                   env={"JOB": "train_sft", "MASTER_PORT": str(free_port())}))
    text = (tmp_path / "resumed.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert "the model's state moved from ZeRO-2 over 2 ranks to ZeRO-2 over 1 rank" in text, text[-3000:]
    assert "the run moved from 2 ranks to 1" in text
    assert f"resumed from {moved}/global_step{done} after {done} steps; step {done + 1} trains on samples " in text
    run = (read_metrics(out), weights(out))
    reference = (read_metrics(straight[1] / "model"), weights(straight[1] / "model"))
    assert [r["step"] for r in run[0]] == [0, 1, 2, 3, 4]
    assert_same_steps(reference, run, ("gpt_loss", "grad_norm", "lr", "eval_gpt_loss"), rel=1e-4, abs_=1e-6,
                      what="sbatch")
    launched = tmp_path / "launcher_resumed"
    proc = run_torchrun(1, "-m rlhf.cli.train_sft", *SUPERVISED, "--save_path", str(launched), "--ckpt_path",
                        str(tmp_path / "launcher_ckpt"), "--load_checkpoint", timeout=300, launcher="rlhf.cli.launch")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_clean_exit(proc, launched)
    assert "the model's state moved from ZeRO-2 over 2 ranks to ZeRO-2 over 1 rank" in proc.stdout + proc.stderr
    assert list(map(without_timings, read_metrics(launched))) == list(map(without_timings, run[0]))
    for name, w in run[1].items():
        assert torch.equal(weights(launched)[name], w), name


def task_pid(job_id: int, procid: int) -> int | None:
    """The pid of the job's task SLURM_PROCID=procid (this host's /proc: the process slurmstepd started, not a
    child of it), None while it has not started."""
    want = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={procid}".encode()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
            with open(f"/proc/{entry}/stat") as f:
                parent = f.read().rpartition(")")[2].split()[1]
            with open(f"/proc/{parent}/comm") as f:
                by_slurmstepd = f.read().strip() == "slurmstepd"
        except OSError:
            continue
        if by_slurmstepd and want <= env:
            return int(entry)
    return None



def endless_sft_job(slurm, tmp_path, dist_timeout: str, *extra: str) -> str:
    """An sbatch of SFT on 2 tasks that would run for hours, once it has logged 3 steps; returns the job id."""
    out = tmp_path / "run"
    args = [*TRAIN, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32",
            "--max_steps", "100000", "--max_epochs", "100000", "--zero_stage", "2", "--dist_timeout", dist_timeout,
            "--save_path", str(out), *extra]
    job = slurm.sbatch(f"--output={tmp_path}/job.out", SBATCH, *args,
                       env={"JOB": "train_sft", "MASTER_PORT": str(free_port())})
    deadline = time.monotonic() + 300  # a loaded machine starts slowly
    while not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 3:
        assert slurm.job(job)["JobState"] in ("PENDING", "RUNNING"), (tmp_path / "job.out").read_text()[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return job

def test_a_killed_task_ends_the_step_naming_its_rank(slurm, tmp_path):
    """SIGKILL of task 1 mid-run: srun --kill-on-bad-exit ends the step (task 0 too) at once and says which
    task it was; the job ends FAILED well within --dist_timeout."""
    job = endless_sft_job(slurm, tmp_path, "0.5")
    pid = task_pid(job, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    info = slurm.wait(job, timeout=60)
    seconds = time.monotonic() - killed
    text = (tmp_path / "job.out").read_text()
    print(f"task 1 SIGKILLed -> job {info['JobState']} {info['ExitCode']} after {seconds:.1f} s; job output:\n"
          + "\n".join(line for line in text.splitlines() if "error" in line.lower() or "rank" in line.lower()))
    assert info["JobState"] == "FAILED", info
    assert seconds < 30  # --dist_timeout 0.5 is 30 s: srun ended it, not a timeout
    assert task_pid(job, 0) is None  # no task left behind
    assert "task 1: Killed" in text, text[-3000:]


def test_a_stopped_task_is_named_by_its_peer_and_srun_ends_the_step(slurm, tmp_path):
    """SIGSTOP of task 1 (a frozen host): no exit for srun to see; rank 0's heartbeat names rank 1 and the stage of
    its last heartbeat after 7.5 s of silence (--dist_timeout 0.25 min = 15 s, less two 3.75 s periods: before gloo's
    own 15 s timeout in the collective it waits in, which would name no rank) and exits 1, upon which
    --kill-on-bad-exit ends the stopped task too (slurmstepd sends it SIGCONT and SIGTERM); the newest complete
    checkpoint (every 2 steps) is intact."""
    ckpt = tmp_path / "ckpt"
    job = endless_sft_job(slurm, tmp_path, "0.25", "--save_steps", "2", "--ckpt_path", str(ckpt))
    time.sleep(5)  # a heartbeat period (3.75 s) of training first, so task 1's last heartbeat is from the loop
    pid = task_pid(job, 1)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        info = slurm.wait(job, timeout=90)
    finally:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    seconds = time.monotonic() - stopped
    text = (tmp_path / "job.out").read_text()
    named = [line for line in text.splitlines() if "no heartbeat for more than 7.5 s from rank 1" in line]
    print(f"task 1 SIGSTOPped -> job {info['JobState']} {info['ExitCode']} after {seconds:.1f} s; {named}")
    assert info["JobState"] == "FAILED", info
    assert "srun: error: vm: task 0: Exited with exit code 1" in text, text[-3000:]
    assert len(named) == 1 and named[0].startswith("[rank 0] ") and "Timed out waiting" not in text, text[-3000:]
    # the stopped task was in a step, a checkpoint or an evaluation (every epoch: a few steps on this data), or
    # between two (a loaded machine may stop it there): the line names one of the loop's stages
    assert re.search(r"\(at its last heartbeat (in stage '(step|checkpoint|evaluate)[/']|outside any stage since "
                     r"\S+, after '(step|checkpoint|evaluate)')", named[0]), named[0]
    assert seconds < 15 + 15
    newest = complete_checkpoints(str(ckpt))[-1][1]
    assert verify_checkpoint(newest) is None
