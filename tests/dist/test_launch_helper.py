"""The tests' torchrun helper retries a launch whose rendezvous port another process took between picking and
binding it (seen as EADDRINUSE when two pytest-xdist workers start engines and launches at once)."""

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
