"""The agents' exit barrier (`rlhf.cli.exit_barrier`): the store's host leaves only after every agent is through.

Two agents in threads of this process share a real TCPStore; the host's thread drops its store (the server) as soon
as its barrier returns, as a node's torchrun agent does when it exits, and the last agent to check in is slow to
read its reply. torchrun's own barrier loses that agent's connection (the race a two-node run showed); ours does not.
"""

from __future__ import annotations

import gc
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.utils import store as store_util

from rlhf.cli import exit_barrier


class _SlowReader:
    """A store client that waits 0.3 s before asking for what it waits on (a busy node)."""

    def __init__(self, store) -> None:
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    def wait(self, keys, *args):
        time.sleep(0.3)
        return self.store.wait(keys, *args)


def _host_leaves_at_once(barrier) -> tuple[list[BaseException], list[str]]:
    """The errors of the last agent to check in, and the order in which the two agents returned."""
    host = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    last = _SlowReader(dist.TCPStore("127.0.0.1", host.port, 2, False, timeout=timedelta(seconds=10)))
    errors, order = [], []

    def run_host() -> None:
        nonlocal host
        barrier(host, 2)
        order.append("host")
        host = None  # the server goes with it
        gc.collect()

    def run_last() -> None:
        try:
            barrier(last, 2)
        except Exception as err:  # noqa: BLE001 - what the test looks at
            errors.append(err)
        order.append("last")

    threads = [threading.Thread(target=run_host), threading.Thread(target=run_last)]
    threads[0].start()
    time.sleep(0.1)  # the host is waiting when the last agent checks in
    threads[1].start()
    for thread in threads:
        thread.join(30)
    return errors, order


def test_the_host_stays_until_the_last_agent_has_its_reply():
    errors, _ = _host_leaves_at_once(lambda store, n: store_util.barrier(store, n, "torchrun", 10))
    assert len(errors) == 1 and "closed" in str(errors[0]), errors  # torchrun's barrier: the race is real
    errors, order = _host_leaves_at_once(lambda store, n: exit_barrier.exit_barrier(store, n, 10))
    assert errors == [] and sorted(order) == ["host", "last"]


def test_install_replaces_torchruns_barrier():
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    before = SimpleElasticAgent._exit_barrier
    try:
        exit_barrier.install()
        assert SimpleElasticAgent._exit_barrier is not before
        assert SimpleElasticAgent._exit_barrier.__module__ == exit_barrier.__name__
    finally:
        SimpleElasticAgent._exit_barrier = before
