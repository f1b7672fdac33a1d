"""A reward_func that never returns ends the run on every rank; `rlhf.cli.launch` relays SIGTERM/SIGUSR1 to the
workers (as SIGUSR1) and waits for them, and stops workers that outlast the grace period."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.distributed import LAUNCHER_PORT_TAKEN, ROOT, free_port

HANGING_REWARD = """
import os, threading
import torch

def reward_func(queries, prompts, labels):
    if os.environ.get("RANK", "1") == "1":
        threading.Event().wait()  # never returns
    return torch.zeros(len(queries))
"""


@pytest.mark.vllm
def test_hanging_reward_func_ends_the_run_on_every_rank(tmp_path):
    """Rank 1's reward_func never returns: rank 0's watchdog names the stage it waits in, rank 1 fails
    with the timeout error after 4 s, and torchrun stops rank 0; the job exits non-zero within seconds."""
    pytest.importorskip("vllm")
    from tests.e2e.test_preemption import GRPO

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


def _launch_worker(tmp_path, grace: str, checkpoint_s: str, worker: str = WORKER,
                   launcher_flags: tuple[str, ...] = ("--shutdown_timeout=1",)) -> subprocess.Popen:
    """Two ranks of `worker` under rlhf.cli.launch, once both are ready (each wrote tmp_path/readyR)."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    for attempt in range(3):  # a port taken between free_port() and the launch (the launcher refuses it): another
        cmd = [sys.executable, "-m", "rlhf.cli.launch", "--grace_period", grace, "--nproc_per_node=2",
               *launcher_flags, "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), str(tmp_path),
               checkpoint_s]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True)
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            if proc.poll() is not None or time.monotonic() >= deadline:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                stderr = proc.communicate()[1]
                assert LAUNCHER_PORT_TAKEN in stderr and attempt < 2, stderr[-3000:]
                break
            time.sleep(0.1)
        else:
            return proc
    raise AssertionError("unreachable: the last attempt returns or fails above")


@pytest.mark.parametrize("sig,target", [(signal.SIGTERM, "launcher"), (signal.SIGUSR1, "launcher"),
                                        (signal.SIGTERM, "group")])
def test_launcher_relays_preemption_and_waits_for_the_workers(tmp_path, sig, target):
    """The workers take 3 s after the signal (torchrun alone would kill them after its 1 s shutdown timeout,
    or die at once on SIGUSR1); the launcher relays either signal as SIGUSR1 (finish the step: there is time),
    waits for them and exits 0. `group`: the signal goes to the launcher's whole process group, as `timeout`
    and a terminal send it, so the workers also get it directly (SIGTERM: they abandon a step that can be)."""
    proc = _launch_worker(tmp_path, "60", "3")
    sent = time.monotonic()
    os.killpg(proc.pid, sig) if target == "group" else os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    seconds = time.monotonic() - sent
    assert proc.returncode == 0, err[-3000:]
    got = ("SIGUSR1", "SIGTERM") if target == "group" else ("SIGUSR1",)
    assert all(any((tmp_path / f"{name}{r}").exists() for name in got) for r in range(2))
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
    assert not any((tmp_path / f"{name}{r}").exists() for name in ("SIGTERM", "SIGUSR1") for r in range(2))
    assert 2 <= seconds < 15, seconds


FAILING_WORKER = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(60)
"""


@pytest.mark.parametrize("how,line,status", [("exit", "exited with code 3", 3),
                                             ("kill", "was killed by SIGKILL", 128 + signal.SIGKILL)])
def test_a_failed_rank_is_one_line_naming_it_not_torchruns_traceback(tmp_path, how, line, status):
    script = tmp_path / "worker.py"
    script.write_text(FAILING_WORKER)
    cmd = [sys.executable, "-m", "rlhf.cli.launch", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script), how]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == status, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("[rlhf.cli.launch] the run failed: ")]
    assert len(lines) == 1 and "rank 1 (pid " in lines[0], lines
    assert lines[0].split(") ", 1)[1].startswith(f"{line} first;"), lines
    assert "rank 0" not in lines[0]  # stopped by torchrun (SIGTERM), not a failure of its own
    assert "Traceback" not in proc.stderr and "failed (exitcode" not in proc.stderr, proc.stderr[-3000:]


STOPPED_PEER_WORKER = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGSTOP)  # a frozen rank: it stays stopped until someone continues it
    time.sleep(600)
time.sleep(1)
sys.exit(3)
"""


def test_a_stopped_rank_is_ended_at_once_when_another_fails(tmp_path):
    """Rank 1 is stopped (SIGSTOP) when rank 0 fails: torchrun ends the other workers with SIGTERM and waits up to
    its shutdown timeout (30 s) before SIGKILL, and a stopped process acts on no signal but SIGKILL until it is
    continued. The launcher continues each worker it stops (SIGCONT after the signal, as SLURM does), so rank 1
    ends at once and the run ends in seconds, naming rank 0."""
    script = tmp_path / "worker.py"
    script.write_text(STOPPED_PEER_WORKER)
    cmd = [sys.executable, "-m", "rlhf.cli.launch", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    seconds = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("[rlhf.cli.launch] the run failed: ")]
    assert len(lines) == 1 and lines[0].startswith("[rlhf.cli.launch] the run failed: rank 0 (pid "), lines
    assert seconds < 20, seconds  # the launcher's start, rank 0's 1 s; not torchrun's 30 s shutdown timeout


def test_a_master_port_in_use_is_one_line_naming_it(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("print('never run')\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "rlhf.cli.launch", "--nproc_per_node=2",
                               "--master_addr=127.0.0.1", f"--master_port={port}", str(script)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 1 and "never run" not in proc.stdout
    assert f"[rlhf.cli.launch] --master_port {port} is already in use on this machine" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


CTRL_C_WORKER = """
import os, sys, time
from rlhf.utils import preemption
watch = preemption.PreemptionWatch(watch_parent=False)
with open(os.path.join(sys.argv[1], "starts"), "a") as f:
    f.write(os.environ["RANK"] + " ")
open(os.path.join(sys.argv[1], "ready" + os.environ["RANK"]), "w").close()
while not watch.requested:
    time.sleep(0.05)
time.sleep(float(sys.argv[2]))  # "the step's end and the checkpoint"
open(os.path.join(sys.argv[1], ("hurry" if watch.hurry else "calm") + os.environ["RANK"]), "w").close()
sys.stdout.flush()
os._exit(preemption.exit_status())
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_checkpoints_and_exits_130_and_a_second_press_stops_at_once(tmp_path, presses):
    """Ctrl-C reaches the launcher's whole process group, as a terminal sends it: the workers (the product's
    `PreemptionWatch`) drop the step, "checkpoint" (2 s) and exit 130, and so does the launcher, in one line each
    and no traceback, with restarts allowed (torchrun restarted the workers after their 130 and the run went on).
    A second press 1.5 s later stops them at once, before their checkpoint."""
    proc = _launch_worker(tmp_path, "600", "2" if presses == 1 else "60", CTRL_C_WORKER,
                          launcher_flags=("--max-restarts=2",))
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    if presses == 2:
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    seconds = time.monotonic() - sent
    assert proc.returncode == 130, err[-3000:]
    assert sorted((tmp_path / "starts").read_text().split()) == ["0", "1"]  # started once: no restart
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "[rlhf.cli.launch] got Ctrl-C (SIGINT): asked 2 worker(s) to checkpoint and exit" in err
    assert err.count("[rank 0] Ctrl-C: ending this step") == 1, err  # the terminal's and the launcher's: one press
    if presses == 1:
        assert all((tmp_path / f"hurry{r}").exists() for r in range(2))  # Ctrl-C drops a step, as SIGTERM
        assert "[rlhf.cli.launch] interrupted by Ctrl-C: the workers checkpointed and exited" in err, err[-3000:]
        assert 2 <= seconds < 15, seconds
    else:
        assert not any((tmp_path / f"{name}{r}").exists() for name in ("hurry", "calm") for r in range(2))
        assert "[rlhf.cli.launch] Ctrl-C again: stopping the workers without a checkpoint" in err, err[-3000:]
        assert seconds < 15, seconds


def test_ctrl_c_while_the_launcher_imports_is_one_line_and_status_130(tmp_path):
    """On a CPU machine the launcher imports the workers' libraries before torchrun starts (its warm start, 5 s and
    more): a Ctrl-C then ends it with one line and status 130, no traceback, no worker started."""
    cmd = [sys.executable, "-m", "rlhf.cli.launch", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "rlhf.cli.train_sft", "--max_steps", "1",
           "--save_path", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "[rlhf.cli.launch] interrupted by Ctrl-C while importing the workers' libraries: no worker had started" \
        in err, err[-3000:]
    assert "Traceback" not in err and not (tmp_path / "run").exists(), err[-3000:]
