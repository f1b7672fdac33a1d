"""Global training metrics from per-rank values: every metric a role produces declares how its ranks'
values combine, and a metric produced without a declaration is an error (it would silently vanish).

Knows roles and the topology (which rank leads a role, which ranks share a ring), nothing about losses.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from rlhf.distributed.topology import Role, Topology


class Reduce(enum.Enum):
    """How the ranks of a role combine one metric."""

    SHARE = "summed over the role's replicas: each holds its share of the global value (loss terms)"
    LEAD = "taken from the role's first rank: the same on every rank (norms, learning rate, counters)"
    MEAN = "averaged over the role's data-parallel replicas"


def per_update_means(total: dict[str, float]) -> dict[str, float]:
    """Values summed over a role's optimizer steps (`add_update`) -> their mean per update."""
    updates = total.get("_updates", 0.0)
    return {k: v / updates for k, v in total.items() if k != "_updates"} if updates else {}


def add_update(total: dict[str, float], stats: dict[str, float]) -> None:
    """Add one optimizer step's metrics to `total` (a running sum with its count of updates)."""
    for k, v in stats.items():
        total[k] = total.get(k, 0.0) + v
    total["_updates"] = total.get("_updates", 0.0) + 1.0


def reduce_metrics(per_role: dict[Role, dict[str, float]], declared: dict[str, Reduce],
                   topology: Topology) -> dict[str, float]:
    """The global value of every declared metric some role produced on some rank (absent ones are left out).

    `per_role`: this rank's values for the roles it hosts (empty dicts or missing roles elsewhere). With ring
    attention the ranks of a ring hold the same samples, so only a ring's first rank contributes.
    Collective over the world: every rank calls it with the same `declared`.
    """
    names = sorted(declared)
    values = torch.zeros(2 * len(names), dtype=torch.float64)
    for role, stats in per_role.items():
        undeclared = sorted(set(stats) - set(declared))
        if undeclared:
            raise RuntimeError(f"{role.value} produced metrics {undeclared} with no declared reduction: declare "
                               "them in the job's metric table")
        if not stats or not topology.hosts(role):
            continue
        replica_lead = topology.replica_rank(role) == 0
        for i, name in enumerate(names):
            if name not in stats:
                continue
            how = declared[name]
            if how is Reduce.LEAD and topology.leads(role):
                values[i] += stats[name]
            elif how is Reduce.SHARE and replica_lead:
                values[i] += stats[name]
            elif how is Reduce.MEAN and replica_lead:
                values[i] += stats[name] / topology.dp_size(role)
            else:
                continue
            values[len(names) + i] = 1.0
    dist.all_reduce(values)
    return {name: float(values[i]) for i, name in enumerate(names) if values[len(names) + i] > 0}
