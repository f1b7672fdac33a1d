"""A stuck rank is named, not silent: the watchdog prints each rank's stage after `--watchdog_interval`
seconds without progress, collectives give up after `--dist_timeout`, and a reward_func that never
returns fails after `--reward_func_timeout` with an error naming the file."""

import io
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlhf.rewards.base import RewardInputs
from rlhf.rewards.reward_func import RewardFuncFile, RewardFuncTimeout
from rlhf.utils import watchdog
from rlhf.utils.watchdog import Watchdog
from tests.distributed import ROOT, free_port, run_on_ranks

HANGING_REWARD = """
import os, threading
import torch

def reward_func(queries, prompts, labels):
    if os.environ.get("RANK", "1") == "1":
        threading.Event().wait()  # never returns
    return torch.zeros(len(queries))
"""


def inputs(n: int) -> RewardInputs:
    return RewardInputs(["q"] * n, ["p"] * n, [None] * n, torch.zeros(n, 2, dtype=torch.long),
                        torch.ones(n, 2, dtype=torch.long))


def test_watchdog_names_the_stage_and_resets_on_progress():
    now, out = [100.0], io.StringIO()
    watchdog.set_step(7)
    with watchdog.stage("experience"):
        dog = Watchdog(1, 10.0, clock=lambda: now[0], out=out)
        now[0] = 109.0
        assert dog.check() is None
        now[0] = 110.0
        line = dog.check()
        assert line.startswith("[rank 1] no progress for 10 s: in stage 'experience' since ")
        assert line.endswith("(step 7)")
        now[0] = 115.0
        assert dog.check() is None  # one line per interval
        now[0] = 120.0
        assert dog.check().startswith("[rank 1] no progress for 20 s: in stage 'experience'")
        with watchdog.stage("reward_func"):  # progress: the count starts again
            now[0] = 125.0
            assert dog.check() is None
            now[0] = 134.0
            assert dog.check() is None
            now[0] = 135.0
            assert dog.check().startswith("[rank 1] no progress for 10 s: in stage 'experience/reward_func'")
    now[0] = 140.0
    assert dog.check() is None  # leaving the stages is progress too
    now[0] = 150.0
    assert "no progress for 10 s: outside any stage since" in dog.check()
    assert "after 'experience' (step 7)" in out.getvalue().splitlines()[-1]
    assert len(out.getvalue().splitlines()) == 4
    assert Watchdog(0, 0).start()._thread is None  # 0 disables it


def _one_rank_sleeps_in_a_stage(port: int) -> dict:
    """Rank 1 sleeps 8 s inside a stage; rank 0 waits for it in an all_reduce under a 4 s --dist_timeout."""
    import torch.distributed as dist

    from rlhf.distributed.launch import init_distributed, read_launch_env

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    init_distributed(read_launch_env(), timeout_minutes=4 / 60)
    rank, out, start = dist.get_rank(), io.StringIO(), time.monotonic()
    dog = Watchdog(rank, 1.0, out=out).start()
    error, error_after = None, None
    with watchdog.stage("experience"):
        if rank == 1:
            with watchdog.stage("reward_func"):
                time.sleep(8)
        else:
            try:
                dist.all_reduce(torch.ones(1))
            except RuntimeError as err:
                error, error_after = str(err), time.monotonic() - start
    dog.stop()
    return {"lines": out.getvalue().splitlines(), "error": error, "error_after": error_after}


def test_waiting_rank_prints_its_stage_and_times_out():
    rank0, rank1 = run_on_ranks(2, _one_rank_sleeps_in_a_stage, free_port())
    assert rank0["lines"][0].startswith("[rank 0] no progress for 1 s: in stage 'experience' since ")
    assert rank1["lines"][0].startswith("[rank 1] no progress for 1 s: in stage 'experience/reward_func' since ")
    assert 3 <= len(rank0["lines"]) <= 6  # about one a second until the timeout
    assert rank0["error"] is not None and 3.5 <= rank0["error_after"] <= 10, rank0


def test_reward_func_timeout_names_the_file(tmp_path):
    path = tmp_path / "hang.py"
    path.write_text(HANGING_REWARD)
    start = time.monotonic()
    with pytest.raises(RewardFuncTimeout, match=f"reward_func in {path} did not return within 1 s"):
        RewardFuncFile(str(path), timeout_s=1.0).score(inputs(2))
    assert time.monotonic() - start < 3


def test_reward_func_timeout_off_the_main_thread(tmp_path):
    """A server thread cannot take signals: the call runs in a worker thread that is given up on."""
    import threading

    path = tmp_path / "hang.py"
    path.write_text(HANGING_REWARD)
    seen = {}

    def score() -> None:
        start = time.monotonic()
        try:
            RewardFuncFile(str(path), timeout_s=1.0).score(inputs(2))
        except RewardFuncTimeout as err:
            seen["error"], seen["seconds"] = str(err), time.monotonic() - start

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(10)
    assert "did not return within 1 s" in seen["error"] and seen["seconds"] < 3


def test_reward_func_may_use_signals_itself(tmp_path):
    """Run in the main thread (as in OpenRLHF), a function's own SIGALRM timeout keeps working."""
    path = tmp_path / "alarm.py"
    path.write_text("import signal\n\ndef reward_func(q, p, l):\n"
                    "    old = signal.signal(signal.SIGALRM, lambda *a: None)\n"
                    "    signal.signal(signal.SIGALRM, old)\n    return [0.5] * len(q)\n")
    assert RewardFuncFile(str(path), timeout_s=5.0).score(inputs(2)).rewards_B.tolist() == [0.5, 0.5]
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # our handler is gone after the call


def test_reward_func_errors_and_results_pass_through(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def reward_func(q, p, l):\n    if q[0] == 'boom':\n        raise KeyError('boom')\n"
                    "    return [1.0] * len(q)\n")
    reward = RewardFuncFile(str(path), timeout_s=5.0)
    assert reward.score(inputs(3)).rewards_B.tolist() == [1.0, 1.0, 1.0]
    batch = inputs(1)
    batch.queries[0] = "boom"
    with pytest.raises(KeyError, match="boom"):
        reward.score(batch)


@pytest.mark.vllm
def test_hanging_reward_func_ends_the_run_on_every_rank(tmp_path):
    """Rank 1's reward_func never returns: rank 0's watchdog names the stage it waits in, rank 1 fails
    with the timeout error after 4 s, and torchrun stops rank 0; the job exits non-zero within seconds."""
    pytest.importorskip("vllm")
    from tests.test_preemption import GRPO

    path = tmp_path / "hang.py"
    path.write_text(HANGING_REWARD)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "rlhf.cli.train_ppo", *GRPO, "--remote_rm_url", str(path),
           "--save_path", str(tmp_path / "run"), "--max_steps", "2", "--reward_func_timeout", "4",
           "--watchdog_interval", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    _, err = proc.communicate(timeout=600)
    (tmp_path / "stderr.txt").write_text(err)
    assert proc.returncode != 0
    # Rank 1's traceback goes to its log file (the console shows library output, torch's excepthook
    # included, from rank 0 only); torchrun's summary on the console names rank 1 as the root cause.
    rank1_log = (tmp_path / "run" / "logs" / "rank1.log").read_text()
    assert f"RewardFuncTimeout: reward_func in {path} did not return within 4 s" in err + rank1_log, err[-4000:]
    assert "[rank 0] no progress for 1 s: in stage 'step/experience' since " in err, err[-4000:]
    assert "[rank 1] no progress for 1 s: in stage 'step/experience/reward_func' since " in err, err[-4000:]
    waited = [int(line.split("no progress for ")[1].split()[0]) for line in err.splitlines()
              if line.startswith("[rank 0] no progress for") and "'step/experience'" in line]
    assert max(waited) < 30, waited  # rank 0 stopped soon after rank 1's 4 s timeout, not after --dist_timeout


WORKER = """
import os, signal, sys, time
got = []
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: got.append(signal.Signals(signum).name))
open(os.path.join(sys.argv[1], "ready" + os.environ["RANK"]), "w").close()
while not got:
    time.sleep(0.05)
time.sleep(float(sys.argv[2]))  # "checkpointing": longer than torchrun's shutdown timeout (1 s)
open(os.path.join(sys.argv[1], got[0] + os.environ["RANK"]), "w").close()
"""


def _launch_worker(tmp_path, grace: str, checkpoint_s: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "rlhf.cli.launch", "--grace_period", grace, "--nproc_per_node=2",
           "--shutdown_timeout=1", "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script),
           str(tmp_path), checkpoint_s]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize("sig,target", [(signal.SIGTERM, "launcher"), (signal.SIGUSR1, "launcher"),
                                        (signal.SIGTERM, "group")])
def test_launcher_relays_preemption_and_waits_for_the_workers(tmp_path, sig, target):
    """The workers take 3 s after the signal (torchrun alone would kill them after its 1 s shutdown timeout,
    or die at once on SIGUSR1); the launcher waits for them and exits 0. `group`: the signal goes to the
    launcher's whole process group, as `timeout` and a terminal send it."""
    proc = _launch_worker(tmp_path, "60", "3")
    sent = time.monotonic()
    os.killpg(proc.pid, sig) if target == "group" else os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    seconds = time.monotonic() - sent
    assert proc.returncode == 0, err[-3000:]
    assert all((tmp_path / f"{sig.name}{r}").exists() for r in range(2))
    assert f"got {sig.name}: asked 2 worker(s) to checkpoint and exit (grace period 60 s)" in err
    assert 3 <= seconds < 15, seconds


def test_launcher_stops_workers_that_outlast_the_grace_period(tmp_path):
    proc = _launch_worker(tmp_path, "2", "60")
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    seconds = time.monotonic() - sent
    assert proc.returncode != 0
    assert "did not exit within the grace period (2 s, --grace_period)" in err, err[-3000:]
    assert not any((tmp_path / f"SIGTERM{r}").exists() for r in range(2))
    assert 2 <= seconds < 15, seconds


def test_launcher_flags():
    from rlhf.cli.launch import split_grace_period

    assert split_grace_period(["--grace_period", "30", "--nproc_per_node=2", "-m", "x", "--grace_period", "1"]) \
        == (30.0, ["--nproc_per_node=2", "-m", "x", "--grace_period", "1"])
    assert split_grace_period(["--nproc_per_node=2", "x.py"])[0] == 600.0
    with pytest.raises(ValueError, match="--signals_to_handle"):
        split_grace_period(["--signals_to_handle=SIGTERM", "-m", "x"])
    with pytest.raises(ValueError, match="must be > 0"):
        split_grace_period(["--grace_period=0", "-m", "x"])
