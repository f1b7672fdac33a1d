"""Rank planning (pure) and launcher environment detection."""

import pytest

from rlhf.distributed.launch_env import _first_host, read_launch_env
from rlhf.distributed.topology import Placement, Role, plan_ranks


def test_colocated_plan_puts_every_role_everywhere():
    plan = plan_ranks(Placement.colocated((Role.ACTOR, Role.REF, Role.ROLLOUT)), 4)
    assert plan == {Role.ACTOR: (0, 1, 2, 3), Role.REF: (0, 1, 2, 3), Role.ROLLOUT: (0, 1, 2, 3)}


def test_disjoint_ranges_are_consecutive_in_role_order():
    placement = Placement({Role.ACTOR: 2, Role.REF: 2, Role.CRITIC: 1, Role.REWARD: 1},
                          (frozenset({Role.ACTOR, Role.REF}),))
    plan = plan_ranks(placement, 4)
    assert plan[Role.ACTOR] == plan[Role.REF] == (0, 1)
    assert plan[Role.CRITIC] == (2,)
    assert plan[Role.REWARD] == (3,)
    assert plan[Role.ROLLOUT] == (0, 1, 2, 3)


def test_plan_rejects_counts_that_do_not_fill_the_world():
    with pytest.raises(ValueError, match=r"add up to 3 .* but the world has 4 ranks"):
        plan_ranks(Placement({Role.ACTOR: 2, Role.CRITIC: 1}), 4)
    with pytest.raises(ValueError, match="colocated roles must use the same number of ranks"):
        plan_ranks(Placement({Role.ACTOR: 2, Role.REF: 1}, (frozenset({Role.ACTOR, Role.REF}),)), 3)


def test_launch_env_torchrun():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == (
        3, 8, 1, "h", 9, "torchrun")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT are not"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "2"})


def test_launch_env_slurm():
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                           "SLURM_JOB_NODELIST": "gpu[07-08,11]"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == (5, 16, 5, "gpu07", "slurm")
    assert _first_host("node3,node4") == "node3"
    with pytest.raises(ValueError, match="neither MASTER_ADDR nor SLURM_JOB_NODELIST"):
        read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_launch_env_single_process():
    assert read_launch_env({}).launcher == "single"


def test_a_rank_0_hosting_the_store_on_a_taken_port_names_it(monkeypatch):
    """srun (and any launch without torchrun's agent): rank 0 binds MASTER_PORT itself; another process holding it
    is a one-line usage error naming the port and the fix, not DistNetworkError's traceback."""
    import datetime
    import socket

    from rlhf.config.errors import UsageError
    from rlhf.distributed.launch_env import PORT_IN_USE, LaunchEnv, _store

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launch = LaunchEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=port,
                           launcher="slurm")
        with pytest.raises(UsageError, match=f"^MASTER_PORT {port} {PORT_IN_USE} .*set another MASTER_PORT"):
            _store(launch, datetime.timedelta(seconds=5))
