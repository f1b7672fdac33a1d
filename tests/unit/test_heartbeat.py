"""The heartbeat that ends a run whose peer stopped (`rlhf.distributed.heartbeat`), on an in-memory store with
a fake clock: a peer whose counter stops moving for longer than the timeout ends this rank with one line naming
it and its last stage; a rank paused itself does not blame its peer; a finished peer is not waited for; a store that
stops answering ends it too."""

import io
import os
import subprocess
import sys

import torch.distributed as dist

from rlhf.distributed.heartbeat import Heartbeat
from rlhf.utils import watchdog
from tests.distributed import ROOT


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def pair(store, clock, out, exits):
    return [Heartbeat(store, rank, 2, timeout_s=30, period_s=5, clock=clock, out=out, exit=exits.append)
            for rank in (0, 1)]


def test_a_stopped_peer_ends_the_rank_naming_it_and_its_stage():
    store, clock, out, exits = dist.HashStore(), Clock(), io.StringIO(), []
    zero, one = pair(store, clock, out, exits)
    with watchdog.stage("step"), watchdog.stage("train"):
        for _ in range(4):  # both beat: nobody is silent
            clock.now += 5
            assert one.check() == [] and zero.check() == []
        for _ in range(4):  # rank 1 stopped (SIGSTOP): its counter no longer moves; 20 s (30 less two 5 s periods)
            # of silence is not yet too long
            clock.now += 5
            assert zero.check() == []
        clock.now += 5
        assert zero.check() == [1]
    assert exits == [1]
    line = out.getvalue()
    assert line.startswith("\n[rank 0] no heartbeat for more than 20 s from rank 1 (at its last heartbeat in "
                           "stage 'step/train' since ")
    assert "; this rank is in stage 'step/train' since " in line and line.endswith(
        ": ending the run (exit 1); the last complete checkpoint is intact\n")
    clock.now += 10  # rank 1 continued (the launcher's SIGCONT): it ends at its first tick, with rank 0's reason
    assert one.check() == [] and exits == [1, 1]
    line = out.getvalue()[len(line):]
    assert line.startswith("\n[rank 1] rank 0 ended the run (no heartbeat for more than 20 s from rank 1 (at its "
                           "last heartbeat in stage 'step/train' since "), line
    assert "); this rank was not running for 35 s before (stopped, or its host froze); this rank is " in line, line


def test_a_rank_that_was_itself_paused_does_not_blame_its_peer():
    """A rank stopped (SIGSTOP) and continued 40 s later, the launcher's SIGCONT before its SIGTERM: its first tick
    finds the peer's counter where it was 40 s ago, which is this rank's pause, not the peer's silence."""
    store, clock, out, exits = dist.HashStore(), Clock(), io.StringIO(), []
    zero, one = pair(store, clock, out, exits)
    for _ in range(2):
        clock.now += 5
        assert zero.check() == [] and one.check() == []  # rank 1 has seen rank 0's newest counter
    clock.now += 40  # rank 1 is stopped; rank 0 too is not ticking here, so its counter stands still
    assert one.check() == [] and exits == []
    for _ in range(4):  # 20 s of rank 0's silence counted from rank 1's first tick after the pause: not yet too long
        clock.now += 5
        assert one.check() == []
    clock.now += 5
    assert one.check() == [0] and exits == [1]
    assert "[rank 1] no heartbeat for more than 20 s from rank 0" in out.getvalue()


def test_a_finished_peer_is_not_waited_for_and_a_silent_store_ends_the_rank():
    store, clock, out, exits = dist.HashStore(), Clock(), io.StringIO(), []
    zero, one = pair(store, clock, out, exits)
    one.stop()
    for _ in range(20):
        clock.now += 5
        assert zero.check() == []
    assert exits == []

    class DeadStore:
        def set(self, key, value):
            raise dist.DistStoreError("connection reset by peer")

    lost = Heartbeat(DeadStore(), 0, 2, timeout_s=30, clock=clock, out=out, exit=exits.append)  # period 7.5 s
    for _ in range(3):  # 15 s: max(30 - 2 x 7.5, 30 / 2) is not yet exceeded
        clock.now += 5
        lost.check()
    assert exits == []
    clock.now += 5
    lost.check()
    assert exits == [1] and "the rendezvous store has not answered for 20 s" in out.getvalue()


EXIT_WHILE_BEATING = """
import datetime, time
import torch.distributed as dist
from rlhf.distributed.heartbeat import Heartbeat
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
Heartbeat(store, 0, 2, 600.0, period_s=0.0001).start()  # its thread is almost always inside a store call
time.sleep(0.3)
"""


def test_a_process_exits_cleanly_while_its_heartbeat_thread_is_in_a_store_call():
    """A daemon thread inside a TCPStore call when Python finalizes aborts the process (`terminate called without
    an active exception`, exit -6, 8 times in 10 without the join at exit): the heartbeat's thread is joined
    before that."""
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", EXIT_WHILE_BEATING], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_stage_change_is_in_the_heartbeat_within_a_second_not_a_period():
    """The heartbeat names the stage a rank entered since its last periodic tick (here 60 s away): a peer that
    names a stopped rank's stage names the one it was in, not the one of a period before."""
    import time

    from rlhf.distributed import heartbeat

    store = dist.HashStore()
    beat = Heartbeat(store, 0, 1, timeout_s=600, period_s=60, exit=lambda status: None).start()
    try:
        assert "in stage 'step/train'" not in store.get("heartbeat/0").decode()
        with watchdog.stage("step"), watchdog.stage("train"):
            time.sleep(heartbeat.MIN_BEAT_S + 1.0)
            assert store.get("heartbeat/0").decode().split("|", 1)[1].startswith("in stage 'step/train' since ")
    finally:
        beat.join()
    assert beat._changed.set not in watchdog._LISTENERS
