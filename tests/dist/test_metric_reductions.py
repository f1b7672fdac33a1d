"""Each metric is reduced over its role's ranks as it declares (sum, mean or lead rank), on gloo ranks."""

from __future__ import annotations

import pytest

from tests.distributed import run_on_ranks


def reduced() -> dict:
    import torch.distributed as dist

    from rlhf.core.metrics import Reduce, reduce_metrics
    from rlhf.distributed.topology import Role, Topology

    rank = dist.get_rank()
    topology = Topology({Role.ACTOR: (0, 1, 2, 3), Role.CRITIC: (2, 3)})
    declared = {"loss": Reduce.SHARE, "norm": Reduce.LEAD, "acc": Reduce.MEAN, "value_loss": Reduce.SHARE}
    per_role = {Role.ACTOR: {"loss": 0.25 * (rank + 1), "norm": 10.0 + rank, "acc": float(rank)}}
    if rank >= 2:
        per_role[Role.CRITIC] = {"value_loss": float(rank)}
    out = {"metrics": reduce_metrics(per_role, declared, topology)}
    try:
        reduce_metrics({Role.ACTOR: {"surprise": 1.0}}, declared, topology)
    except RuntimeError as err:
        out["error"] = str(err)
    return out


def test_metric_reductions_follow_their_declarations():
    for r in run_on_ranks(4, reduced):
        assert r["metrics"] == {"loss": pytest.approx(0.25 * (1 + 2 + 3 + 4)), "norm": 10.0,
                                "acc": pytest.approx((0 + 1 + 2 + 3) / 4), "value_loss": 5.0}
        assert r["error"].startswith("actor produced metrics ['surprise'] with no declared reduction")
