"""The tests' torchrun helper and `run_on_ranks` retry a launch whose rendezvous port another process took between
picking and binding it (seen as EADDRINUSE when two pytest-xdist workers start engines and launches at once)."""

import socket

import tests.distributed as helper


def test_a_taken_rendezvous_port_is_retried_on_a_new_one(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1], helper.free_port()]
        monkeypatch.setattr(helper, "free_port", lambda: ports.pop(0))
        proc = helper.run_torchrun(1, "-m this", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Beautiful is better than ugly." in proc.stdout
    assert ports == []  # the second port was used


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_a_world_whose_rendezvous_port_was_taken_starts_again_on_a_new_one(monkeypatch):
    """Rank 0 fails binding the taken port; rank 1, which would wait for that rendezvous until the timeout, is
    killed at once and the world starts again."""
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1], helper.free_port()]
        monkeypatch.setattr(helper, "free_port", lambda: ports.pop(0))
        start = time.monotonic()
        assert helper.run_on_ranks(2, _world_size, timeout=120) == [2, 2]
    assert ports == []  # the second port was used
    assert time.monotonic() - start < 60  # not the first world's timeout
