"""A rank left waiting in a collective prints its stage and gives up after --dist_timeout (2 gloo ranks)."""

import io
import os
import time

import torch

from rlhf.utils import watchdog
from rlhf.utils.watchdog import Watchdog
from tests.distributed import free_port, run_on_ranks


def _one_rank_sleeps_in_a_stage(port: int) -> dict:
    """Rank 1 sleeps 8 s inside a stage; rank 0 waits for it in an all_reduce under a 4 s --dist_timeout."""
    import torch.distributed as dist

    from rlhf.distributed.launch_env import finish_heartbeat, init_distributed, read_launch_env

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    init_distributed(read_launch_env(), timeout_minutes=4 / 60)
    finish_heartbeat()  # this test is about the watchdog and gloo's timeout: rank 0 leaves first on purpose
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


def _finish_after_a_collective(port: int) -> dict:
    """init_distributed (its heartbeat on), one all_reduce, finish_distributed, then the exit handlers it
    registered, in atexit's order (the last registered first)."""
    import atexit

    import torch.distributed as dist

    from rlhf.distributed import launch_env

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    registered = []
    register, atexit.register = atexit.register, registered.append
    try:
        launch_env.init_distributed(launch_env.read_launch_env(), timeout_minutes=1)
    finally:
        atexit.register = register
    total = torch.ones(1)
    dist.all_reduce(total)
    engine_group, closed = dist.new_group([0, 1]), []

    def close_engine() -> None:  # as vLLM's engine shutdown: its own group first, then the default one
        closed.append(dist.is_initialized())
        dist.destroy_process_group(engine_group)
        dist.destroy_process_group()

    launch_env.close_before_groups(close_engine)
    launch_env.finish_distributed()
    after_finish = {"initialized": dist.is_initialized(), "heartbeat_alive": launch_env.HEARTBEAT._thread.is_alive()}
    for handler in reversed(registered):
        handler()
    return {"total": total.item(), "after_finish": after_finish, "initialized_at_exit": dist.is_initialized(),
            "engine_closed_with_groups_alive": closed}


def test_finish_ends_the_heartbeat_thread_and_exit_destroys_the_groups():
    # nothing of gloo's or ours is left running for interpreter finalization (which can abort a finished run); the
    # groups stay until exit, for a process that runs another job; an engine that destroys groups of its own at
    # shutdown (vLLM) is shut down first, while they exist (after them: "Invalid process group specified")
    assert run_on_ranks(2, _finish_after_a_collective, free_port()) == [
        {"total": 2.0, "after_finish": {"initialized": True, "heartbeat_alive": False},
         "initialized_at_exit": False, "engine_closed_with_groups_alive": [True]}] * 2


def _a_peer_closes_during_a_collective() -> tuple[int | None, str]:
    """Rank 1 leaves the group (its connections close, as when a rank is killed); rank 0's next all_reduce inside
    `peer_lost_exit` ends with one line naming its stage. (exit status, stderr) of rank 0; (None, "") of rank 1."""
    import contextlib

    import torch.distributed as dist

    from rlhf.distributed.peer_lost import peer_lost_exit

    dist.barrier()
    if dist.get_rank() == 1:
        dist.destroy_process_group()
        return None, ""
    time.sleep(1)
    err, status = io.StringIO(), None
    with contextlib.redirect_stderr(err), watchdog.stage("step"), watchdog.stage("train"):
        try:
            with peer_lost_exit():
                dist.all_reduce(torch.ones(4))
        except SystemExit as stop:
            status = stop.code
    return status, err.getvalue()


def test_a_peer_that_died_during_a_collective_is_one_line_naming_the_stage():
    (status, err), _ = run_on_ranks(2, _a_peer_closes_during_a_collective)
    assert status == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "[rank 0] a peer rank's connection closed while this rank was in stage 'step/train' since "), err
    assert "that rank died (killed, or out of memory; the launcher's line names it)" in lines[0]
    assert "Connection closed by peer" in lines[0] and "Traceback" not in err
