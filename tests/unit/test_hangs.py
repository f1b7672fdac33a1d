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
    from rlhf.cli.launch import cpu_preload, split_flag

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
