"""A stuck rank is named, not silent: the watchdog prints the stage after `--watchdog_interval` seconds without
progress, and a reward_func that never returns fails after `--reward_func_timeout` naming the file; the launcher's
flags."""

import io
import signal
import time

import pytest
import torch

from rlhf.rewards.base import RewardInputs
from rlhf.rewards.reward_func import RewardFuncFile, RewardFuncTimeout
from rlhf.utils import watchdog
from rlhf.utils.watchdog import Watchdog

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


def test_launcher_flags():
    from rlhf.cli.launch import split_grace_period

    assert split_grace_period(["--grace_period", "30", "--nproc_per_node=2", "-m", "x", "--grace_period", "1"]) \
        == (30.0, ["--nproc_per_node=2", "-m", "x", "--grace_period", "1"])
    assert split_grace_period(["--nproc_per_node=2", "x.py"])[0] == 600.0
    with pytest.raises(ValueError, match="--signals_to_handle"):
        split_grace_period(["--signals_to_handle=SIGTERM", "-m", "x"])
    with pytest.raises(ValueError, match="must be > 0"):
        split_grace_period(["--grace_period=0", "-m", "x"])


def test_launcher_preloads_what_vllm_cpu_asks_for_where_found(tmp_path):
    """`rlhf.cli.launch` adds tcmalloc and libiomp5 to the workers' LD_PRELOAD where they exist (first directory
    that has one wins), keeps what is there, adds nothing already preloaded, and `--no_preload` is its own flag
    (before the program only)."""
    from rlhf.cli.launch import split_flag
    from rlhf.utils.preload import OPT_OUT, RESTARTED, cpu_preload, restart_preload

    os_dir, venv = tmp_path / "usr", tmp_path / "venv"
    os_dir.mkdir()
    venv.mkdir()
    (os_dir / "libtcmalloc_minimal.so.4").write_text("")
    (venv / "libiomp5.so").write_text("")
    preload, added = cpu_preload("/opt/mine.so", [str(venv), str(os_dir)])
    assert added == [f"{os_dir}/libtcmalloc_minimal.so.4", f"{venv}/libiomp5.so"]
    assert preload == f"/opt/mine.so:{os_dir}/libtcmalloc_minimal.so.4:{venv}/libiomp5.so"
    assert cpu_preload(f"{venv}/libiomp5.so", [str(venv)]) == (f"{venv}/libiomp5.so", [])
    assert cpu_preload("", [str(tmp_path / "none")]) == ("", [])
    assert split_flag(["--no_preload", "--nproc_per_node=2", "-m", "x", "--no_preload"], "--no_preload") == \
        (True, ["--nproc_per_node=2", "-m", "x", "--no_preload"])
    assert split_flag(["-m", "x", "--no_preload"], "--no_preload")[0] is False
    # a job started without the launcher restarts itself with them: on a CPU build of torch only, once, unless
    # the environment opts out (the launcher's --no_preload sets OPT_OUT for its workers)
    both = (f"{os_dir}/libtcmalloc_minimal.so.4:{venv}/libiomp5.so",
            [f"{os_dir}/libtcmalloc_minimal.so.4", f"{venv}/libiomp5.so"])
    search = [str(venv), str(os_dir)]
    assert restart_preload({}, True, search) == both
    assert restart_preload({OPT_OUT: "0"}, True, search) == both
    assert restart_preload({"LD_PRELOAD": f"{venv}/libiomp5.so"}, True, search) == \
        (f"{venv}/libiomp5.so:{os_dir}/libtcmalloc_minimal.so.4", [f"{os_dir}/libtcmalloc_minimal.so.4"])
    for environ, cpu_build in (({}, False), ({}, None), ({OPT_OUT: "1"}, True), ({RESTARTED: "1"}, True),
                               ({"LD_PRELOAD": both[0]}, True)):
        assert restart_preload(environ, cpu_build, search) is None, (environ, cpu_build)


def test_a_job_without_the_launcher_restarts_itself_with_the_preloads():
    """`preload_this_program` (a job's first act, before torch loads) restarts the same program with the libraries
    `rlhf.cli.launch` preloads, in the same process: after the restart they are mapped into it, the program runs
    once more and not again, and rank 0 says so in one line. Nothing happens with RLHF_NO_PRELOAD=1."""
    import os
    import subprocess
    import sys

    from rlhf.utils.preload import OPT_OUT, RESTARTED, cpu_preload, search_dirs

    _, expected = cpu_preload("", search_dirs())
    program = ("import os; from rlhf.utils.preload import preload_this_program; print('start', os.getpid()); "
               "preload_this_program(); maps = open('/proc/self/maps').read(); "
               "print('mapped', sorted(set(os.path.basename(p) for p in os.environ.get('LD_PRELOAD', '').split(':') "
               "if p and os.path.basename(p) in maps)))")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", OPT_OUT, RESTARTED)}
    done = subprocess.run([sys.executable, "-c", program], env={**env, "RANK": "0"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    starts = [line for line in done.stdout.splitlines() if line.startswith("start")]
    names = sorted(os.path.basename(p) for p in expected)
    assert done.stdout.splitlines()[-1] == f"mapped {names}"
    if expected:  # CI installs both; a machine with neither has nothing to restart for
        assert len(starts) == 2 and len(set(starts)) == 1, done.stdout  # twice, in one process
        assert done.stderr.count("[rlhf] restarting with LD_PRELOAD") == 1, done.stderr
    quiet = subprocess.run([sys.executable, "-c", program], env={**env, "RANK": "0", OPT_OUT: "1"},
                           capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and quiet.stdout.count("start") == 1 and "mapped []" in quiet.stdout, quiet
    assert "restarting" not in quiet.stderr
