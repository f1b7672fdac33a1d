"""The two DeepSpeed calls that assume one world-wide data-parallel group, scoped for role subgroups.

ZeRO-3 on a process subgroup (actor on ranks 0-1, critic on 2-3) breaks on (1) bare `barrier()`
calls while the ZeRO-3 optimizer sets up its partitions, which wait for ranks of other roles, and
(2) `assert_ints_same_as_other_ranks` in the partitioned-parameter coordinator, a debugging
cross-check that broadcasts from global rank 0, which is not a member of every role's group.
(1) is scoped to the role's group while an engine is built. (2) is skipped: every rank of a role runs
the same forwards in the same order by construction (the trainer's stages are SPMD), which is what
the check verifies. `tests/test_deepspeed_compat.py` fails if DeepSpeed moves either call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def barriers_scoped_to(group: dist.ProcessGroup | None) -> Iterator[None]:
    """While an engine is built, DeepSpeed's group-less barriers wait on `group` only.
    No effect when `group` is None (the whole world)."""
    import deepspeed.comm as ds_comm

    if group is None:
        yield
        return
    original_barrier = ds_comm.barrier

    def barrier(group_arg=None, *args, **kwargs):
        return original_barrier(group if group_arg is None else group_arg, *args, **kwargs)

    ds_comm.barrier = barrier
    try:
        yield
    finally:
        ds_comm.barrier = original_barrier


def _skip_order_check(ints: list[int]) -> None:
    """Replaces DeepSpeed's world-wide submodule-order cross-check (see module docstring)."""


def install_subgroup_patches() -> None:
    """Disable the coordinator's world-wide order check. Call only when roles use subgroups."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    if not hasattr(coordinator, "assert_ints_same_as_other_ranks"):
        raise RuntimeError("DeepSpeed no longer defines partitioned_param_coordinator.assert_ints_same_as_other_ranks;"
                           " revisit rlhf/engines/deepspeed_compat.py")
    coordinator.assert_ints_same_as_other_ranks = _skip_order_check
