"""Process groups on 4 gloo ranks (rollout engines, rings, tensor-parallel and data groups), and a world formed from
SLURM variables without torchrun."""


from rlhf.distributed.topology import Placement, Role, Topology, plan_ranks
from tests.distributed import run_on_ranks


def _topology_facts(tp):
    import torch
    import torch.distributed as dist

    topo = Topology(plan_ranks(Placement.colocated((Role.ACTOR, Role.ROLLOUT)), dist.get_world_size()), tp)
    actor_sum = torch.tensor([1.0])
    dist.all_reduce(actor_sum, group=topo.group(Role.ACTOR))
    ring = Topology(plan_ranks(Placement.colocated((Role.ACTOR, Role.REF, Role.ROLLOUT)), dist.get_world_size()),
                    tp, ring_size=2)
    ring_sum = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(ring_sum, group=ring.ring_group(Role.ACTOR))
    tp = Topology(plan_ranks(Placement.colocated((Role.ACTOR, Role.REF, Role.ROLLOUT)), dist.get_world_size()),
                  tp_size=2)
    tp_sum, data_sum = torch.tensor([float(dist.get_rank() + 1)]), torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tp_sum, group=tp.tp_group(Role.ACTOR))
    dist.all_reduce(data_sum, group=tp.data_group(Role.REF))
    try:  # rank 2 would host the actor with data group (0, 2) and the critic with (2,)
        Topology({Role.ACTOR: (0, 1, 2, 3), Role.CRITIC: (2, 3), Role.ROLLOUT: (0, 1, 2, 3)}, tp_size=2)
        refused = ""
    except ValueError as err:
        refused = str(err)
    tp_facts = {"dp_size": tp.dp_size(Role.ACTOR), "dp_rank": tp.dp_rank(Role.ACTOR),
                "replica_rank": tp.replica_rank(Role.ACTOR), "tp_sum": float(tp_sum), "data_sum": float(data_sum),
                "same": tp.tp_group(Role.REF) is tp.tp_group(Role.ACTOR), "refused": refused}
    return {"tp": tp_facts, "engine": topo.engine_index, "engine_rank": topo.engine_rank,
            "actor_sum": float(actor_sum), "dp_rank": topo.dp_rank(Role.ACTOR),
            "ring": {"dp_size": ring.dp_size(Role.ACTOR), "dp_rank": ring.dp_rank(Role.ACTOR),
                     "ring_rank": ring.ring_rank(Role.ACTOR), "sum": float(ring_sum), "leads": ring.leads(Role.ACTOR),
                     "same_group_for_ref": ring.ring_group(Role.REF) is ring.ring_group(Role.ACTOR),
                     "no_ring": topo.ring_group(Role.ACTOR) is None and topo.ring_rank(Role.ACTOR) == 0}}


def test_topology_groups_on_four_ranks():
    facts = run_on_ranks(4, _topology_facts, 2)
    assert [f["engine"] for f in facts] == [0, 0, 1, 1]
    assert [f["engine_rank"] for f in facts] == [0, 1, 0, 1]
    assert all(f["actor_sum"] == 4.0 for f in facts)
    assert [f["dp_rank"] for f in facts] == [0, 1, 2, 3]
    rings = [f["ring"] for f in facts]
    assert [r["dp_size"] for r in rings] == [2, 2, 2, 2]
    assert [r["dp_rank"] for r in rings] == [0, 0, 1, 1]
    assert [r["ring_rank"] for r in rings] == [0, 1, 0, 1]
    assert [r["sum"] for r in rings] == [3.0, 3.0, 7.0, 7.0]
    assert [r["leads"] for r in rings] == [True, False, False, False]
    assert all(r["same_group_for_ref"] and r["no_ring"] for r in rings)
    tps = [f["tp"] for f in facts]  # --ds_tensor_parallel_size 2: groups (0, 1) and (2, 3), data groups (0, 2), (1, 3)
    assert [(t["dp_size"], t["dp_rank"], t["replica_rank"]) for t in tps] == [
        (2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]
    assert [t["tp_sum"] for t in tps] == [3.0, 3.0, 7.0, 7.0] and [t["data_sum"] for t in tps] == [4.0, 6.0, 4.0, 6.0]
    assert all(t["same"] for t in tps)
    assert all(t["refused"] == "--ds_tensor_parallel_size 2: rank 2 hosts roles whose data groups differ (actor with "
               "ranks [0, 2], critic with ranks [2]), which DeepSpeed's AutoTP cannot hold in one process; place each "
               "role on all of the ranks it shares or on ranks of its own" for t in tps)


SLURM_WORKER = """
import json, torch, torch.distributed as dist
from rlhf.distributed.launch_env import init_distributed, read_launch_env
launch = read_launch_env()
init_distributed(launch)
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(json.dumps({"launcher": launch.launcher, "rank": dist.get_rank(), "world": dist.get_world_size(),
                  "local_rank": launch.local_rank, "sum": float(value)}))
dist.destroy_process_group()
"""


def test_slurm_variables_form_the_world_without_torchrun():
    import json
    import os
    import subprocess
    import sys

    from tests.distributed import ROOT, free_port

    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT") and not k.startswith("TORCHELASTIC")}
    procs = [subprocess.Popen([sys.executable, "-c", SLURM_WORKER], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**base, "PYTHONPATH": ROOT, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2",
                                   "SLURM_LOCALID": str(r), "SLURM_JOB_NODELIST": "localhost",
                                   "MASTER_PORT": str(port)})
             for r in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [(o["launcher"], o["rank"], o["world"], o["local_rank"], o["sum"]) for o in outs] == [
        ("slurm", 0, 2, 0, 3.0), ("slurm", 1, 2, 1, 3.0)]
