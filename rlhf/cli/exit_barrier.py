"""torchrun's barrier between the nodes' agents at the end of a successful run, without its race.

Each node's torchrun agent waits at the end for the others (so that no node's store leaves while another
node still needs it). torchrun's barrier has a race between nodes: the agent that hosts the store (node 0)
leaves as soon as it sees the last agent's check-in, and the last agent, still waiting for its own reply,
then loses the connection and logs `Error waiting on exit barrier` with a traceback, after a run that
succeeded everywhere. `exit_barrier` adds a second count, of the agents that are through the barrier, and
every agent stays until that count is full: the store's host therefore leaves only after every agent has
had its reply. A lost store after this agent is through is the host leaving: it says nothing.
`install` puts it in place of torchrun's in this process (`rlhf.cli.launch` calls it).
"""

from __future__ import annotations

import logging
import time

CHECKED_IN = "rlhf/exit_barrier/checked_in"
THROUGH = "rlhf/exit_barrier/through"
POLL_S = 0.02
LINGER_S = 30.0  # the longest an agent through the barrier waits for the others to be through too

logger = logging.getLogger(__name__)


def exit_barrier(store, world_size: int, timeout_s: float) -> None:
    """Every agent's check-in, then every agent through: raises what the store raises before this agent is
    through (the barrier failed), nothing after."""
    from torch.distributed.elastic.utils.store import store_timeout

    with store_timeout(store, timeout_s):
        if store.add(CHECKED_IN, 1) == world_size:
            store.set(CHECKED_IN + "/all", "1")
        store.wait([CHECKED_IN + "/all"])
    try:
        store.add(THROUGH, 1)
        deadline = time.monotonic() + min(LINGER_S, timeout_s)
        while store.add(THROUGH, 0) < world_size and time.monotonic() < deadline:
            time.sleep(POLL_S)
    except Exception:  # noqa: BLE001 - the store's host left: it does so only when every agent is through
        logger.debug("the store left after this agent was through the exit barrier", exc_info=True)


def install() -> None:
    """torchrun's agents in this process end with `exit_barrier` (the same logging, the same timeout)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def _exit_barrier(agent) -> None:
        start = time.time()
        agent._in_exit_barrier = True
        try:
            exit_barrier(agent._store, agent._worker_group.group_world_size, agent._exit_barrier_timeout)
        except SignalException:
            raise
        except Exception:  # noqa: BLE001 - torchrun's own choice: a failed exit barrier is logged, not raised
            logger.exception("Error waiting on exit barrier. Elapsed: %.1f s", time.time() - start)
        finally:
            agent._in_exit_barrier = False

    SimpleElasticAgent._exit_barrier = _exit_barrier
