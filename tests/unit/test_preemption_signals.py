"""The worker's side of the stop signals (`rlhf.utils.preemption`), with real signals in this process: SIGTERM
interrupts a blocking call inside a step's abandonable window (`interruptible`), and nowhere else; Ctrl-C is
SIGTERM's hurry plus exit status 130, and a second press more than a second later ends the process at once."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rlhf.utils import preemption
from tests.distributed import ROOT


@pytest.fixture
def watch(monkeypatch):
    """A watch with its handlers installed, and pytest's own handlers back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in preemption.PreemptionWatch.SIGNALS}
    monkeypatch.setattr(preemption, "_ACTIVE", None)
    yield preemption.PreemptionWatch(watch_parent=False)
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _signal_in(seconds: float, sig: signal.Signals = signal.SIGTERM) -> None:
    threading.Timer(seconds, os.kill, (os.getpid(), sig)).start()


def test_sigterm_interrupts_a_blocking_call_only_inside_a_steps_window(watch):
    start = time.monotonic()
    with preemption.abandonable(), pytest.raises(preemption.CutShort):
        with preemption.interruptible():
            _signal_in(0.3)
            time.sleep(30)  # a reward function that would take 30 s
    assert time.monotonic() - start < 5 and watch.hurry and watch.requested
    with preemption.abandonable(), pytest.raises(preemption.CutShort):  # signalled before: at once
        with preemption.interruptible():
            pass
    watch.hurry = watch.requested = False
    start = time.monotonic()
    with preemption.interruptible():  # outside a step's window (an evaluation): the call runs to its end
        _signal_in(0.3)
        time.sleep(1.0)
    assert time.monotonic() - start >= 1.0 and watch.hurry


CTRL_C = """
import os, signal, sys, time
from rlhf.utils import preemption
watch = preemption.PreemptionWatch(watch_parent=False)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.1)
print(watch.requested, watch.hurry, watch.cause(), flush=True)
if sys.argv[1] == "twice":
    time.sleep(1.2)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
os._exit(preemption.exit_status())
"""


@pytest.mark.parametrize("presses", ["once", "twice"])
def test_ctrl_c_hurries_exits_130_and_a_second_press_ends_at_once(presses):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CTRL_C, presses], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": ROOT, "RANK": "0"})
    assert proc.returncode == 130, proc.stderr
    assert proc.stdout.strip() == "True True interrupted (Ctrl-C)"
    assert proc.stderr.count("[rank 0] Ctrl-C: ending this step") == 1
    assert ("Ctrl-C again: stopping now, without a checkpoint" in proc.stderr) == (presses == "twice")
    assert "Traceback" not in proc.stderr and time.monotonic() - start < 30


def test_the_launcher_counts_presses_and_statuses_as_the_workers_do():
    from rlhf.cli import launch

    assert (launch.SECOND_PRESS_S, launch.INTERRUPTED_STATUS) == (preemption.SECOND_PRESS_S,
                                                                 preemption.INTERRUPTED_STATUS)
