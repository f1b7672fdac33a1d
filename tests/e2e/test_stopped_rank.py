"""A stopped rank ends the run: SIGSTOP one of two SFT ranks mid-run with --dist_timeout 0.25 (15 s); the
other rank's heartbeat names it and its stage after 7.5 s of silence (the timeout less two 3.75 s periods, so
before gloo's own timeout, which names no rank) and exits 1, torchrun then stops the run, and the last complete
checkpoint is intact."""

import datetime
import os
import re
import signal
import subprocess
import sys
import time

from rlhf.utils.checkpoint_files import complete_checkpoints, verify_checkpoint
from tests.distributed import ROOT, free_port
from tests.tiny_runs import CPU

SFT = [*CPU, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_steps", "100000",
       "--max_epochs", "100000", "--save_steps", "2", "--zero_stage", "2", "--dist_timeout", "0.25"]


def worker_of_rank(launcher_pid: int, rank: int) -> int:
    """The pid of the worker whose RANK is `rank` among the launcher's children."""
    for pid in subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split():
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return int(pid)
    raise AssertionError(f"no worker of rank {rank}")


def test_a_stopped_rank_ends_the_run_naming_it(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "rlhf.cli.train_sft", *SFT, "--save_path", str(out),
           "--ckpt_path", str(ckpt)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    stopped = None
    try:
        deadline = time.time() + 300
        while len(complete_checkpoints(str(ckpt))) < 2:  # a few steps and two checkpoints first
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-4000:]
            time.sleep(0.2)
        time.sleep(10)  # training for a few heartbeat periods (3.75 s), so rank 1's last one is from training
        stopped = worker_of_rank(proc.pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        _, err = proc.communicate(timeout=180)
        elapsed = time.time() - t0
    finally:
        if stopped is not None:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(stopped, sig)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    named = "no heartbeat for more than 7.5 s from rank 1"
    lines = [line for line in err.splitlines() if named in line]
    assert len(lines) == 1 and lines[0].startswith("[rank 0] "), err[-3000:]
    # the stopped rank was in a step, a checkpoint (every 2 steps) or an evaluation (every epoch: a few steps on
    # this data), or between two (a loaded machine may stop it there): the message names one of the loop's stages
    assert re.search(r"\(at its last heartbeat (in stage '(step|checkpoint|evaluate)[/']|outside any stage since "
                     r"\S+, after '(step|checkpoint|evaluate)')", lines[0]), lines[0]
    # torchrun logs the moment rank 0 exited ("... Sending process P closing signal SIGTERM" to rank 1)
    closing = next(line for line in err.splitlines() if "closing signal SIGTERM" in line)
    stamp = datetime.datetime.strptime(f"{datetime.date.today().year}{closing.split()[0][1:]} {closing.split()[1]}",
                                       "%Y%m%d %H:%M:%S.%f")
    rank0_exit = stamp.timestamp() - t0
    print(f"SIGSTOP of rank 1 -> rank 0 exited after {rank0_exit:.1f} s, torchrun (exit {proc.returncode}) after "
          f"{elapsed:.1f} s (its 30 s SIGTERM grace for the stopped rank); rank 0: {lines[0]}")
    assert 7.5 - 3.75 <= rank0_exit < 7.5 + 3.75 + 20  # the silence allowed, give or take a period (+ slack for
    # a loaded machine: the heartbeat thread needs the GIL and a core)
    assert "Timed out waiting" not in err  # the heartbeat, not gloo's timeout, ended it
    newest = complete_checkpoints(str(ckpt))[-1][1]
    assert verify_checkpoint(newest) is None
