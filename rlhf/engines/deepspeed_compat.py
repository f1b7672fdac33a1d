"""The DeepSpeed calls that assume one world-wide data-parallel group, scoped for role subgroups.

ZeRO-3 on a process subgroup (actor on ranks 0-1, critic on 2-3) breaks on (1) bare `barrier()`
calls while the ZeRO-3 optimizer sets up its partitions, which wait for ranks of other roles, and
(2) `assert_ints_same_as_other_ranks` in the partitioned-parameter coordinator, a debugging
cross-check that broadcasts from global rank 0, which is not a member of every role's group.
(1) is scoped to the role's group while an engine is built. (2) is skipped: every rank of a role runs
the same forwards in the same order by construction (the trainer's stages are SPMD), which is what
the check verifies. Building a transformers model under ZeRO-3 on a subgroup needs two more scopes
(`zero3_construction`), and ZeRO++ hierarchical partitioning (--zpg) one more (`hpz_scoped_to`).
`tests/unit/test_deepspeed_compat.py` fails if DeepSpeed or transformers move any of these.

One more DeepSpeed limit lives here: its JIT op builder cannot read arch-specific TORCH_CUDA_ARCH_LIST entries
(`9.0a`), so DeepCompile's op is built under a list without them (`arch_list_for_deepspeed_builds`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

SHM_OP_BUILD_S = 600.0
"""How long the watchdog waits on the one-time build of DeepSpeed's CPU communication op before it speaks (the
build takes 1-2 minutes on 2 cores, more on a loaded machine)."""


def build_cpu_comm_op(rank: int) -> None:
    """Without CUDA, DeepSpeed JIT-compiles its shared-memory communication op (`deepspeed_shm_comm`) the first
    time a process initialises it on a machine, silently, for a minute or two. Build it here when it is not
    built yet, saying so on rank 0 and telling the watchdog (`launch/install.sh cpu` builds it ahead); DeepSpeed
    then loads the cached op. Every rank calls it (torch's extension lock lets one build while the others wait)."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    directory = _get_build_directory(builder.NAME, verbose=False)
    if os.path.isfile(os.path.join(directory, builder.NAME + ".so")):
        return
    from rlhf.utils import watchdog

    if rank == 0:
        print(f"building DeepSpeed's CPU communication op ({builder.NAME}) into {directory}: once per machine, "
              "1-2 minutes (`bash launch/install.sh cpu` builds it ahead)", flush=True)
    with watchdog.stage(f"building DeepSpeed's {builder.NAME} op", patience_s=SHM_OP_BUILD_S):
        builder.load(verbose=False)


def arch_list_deepspeed_reads(arch_list: str) -> str:
    """`arch_list` (TORCH_CUDA_ARCH_LIST's form: entries split by ';' or spaces, each X.Y with an optional
    +PTX) with arch-specific suffixes dropped: `9.0a` -> `9.0`, `10.0f+PTX` -> `10.0+PTX`. DeepSpeed's JIT op
    builder (0.19.8) reads each entry as integers and fails on `9.0a` (`invalid literal for int() with base
    10: '0a'`), which CUDA images for Hopper set."""
    out = []
    for entry in arch_list.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        arch, ptx = (entry[:-4], "+PTX") if entry.endswith("+PTX") else (entry, "")
        major, _, minor = arch.partition(".")
        digits = "".join(c for c in minor if c.isdigit()) or "0"
        name = f"{major}.{digits}{ptx}"
        if name not in out:
            out.append(name)
    return ";".join(out)


@contextmanager
def arch_list_for_deepspeed_builds(rank: int) -> Iterator[None]:
    """While DeepSpeed JIT-builds an op (DeepCompile's), TORCH_CUDA_ARCH_LIST without the arch-specific
    suffixes its builder cannot parse (`arch_list_deepspeed_reads`); the user's value comes back afterwards.
    Says so on rank 0 when it changes anything."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    readable = arch_list_deepspeed_reads(value) if value else value
    if readable == value or value is None:
        yield
        return
    if rank == 0:
        print(f"TORCH_CUDA_ARCH_LIST={value!r} has arch-specific entries DeepSpeed's op builder cannot read: "
              f"DeepCompile's op is built for {readable!r}", flush=True)
    os.environ["TORCH_CUDA_ARCH_LIST"] = readable
    try:
        yield
    finally:
        os.environ["TORCH_CUDA_ARCH_LIST"] = value


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


@contextmanager
def hpz_scoped_to(group: dist.ProcessGroup | None) -> Iterator[None]:
    """While a ZeRO-3 model is built and its engine started, DeepSpeed's ZeRO++ secondary-partition group (a
    module global it reads only then: `zero.Init`, the stage-3 optimizer and the frozen engine's offload) is
    `group`. Left alone, DeepSpeed would create that group itself, once per process, from consecutive ranks of
    the whole world: a collective that ranks of other roles never join, with groups that need not lie inside
    the model's data-parallel group, and a second model on the same rank would fail its "already initialized"
    assertion. No effect when `group` is None (--zpg 1)."""
    from deepspeed.utils import groups

    if group is None:
        yield
        return
    previous = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = group
    try:
        yield
    finally:
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = previous


def use_tensor_parallel_groups(tp_group: dist.ProcessGroup | None, data_group: dist.ProcessGroup | None) -> None:
    """Give DeepSpeed's AutoTP this rank's tensor-parallel and data groups before an engine with
    `tensor_parallel.autotp_size` starts; with None, clear what an earlier job of this process left (before any
    other engine starts). Left alone, the engine replaces any `mpu` with DeepSpeed's module-global groups and
    creates them itself (`groups._init_tp_mesh_device`): a device mesh over the whole world, which ranks of
    other roles never join, with data groups that span every role. DeepSpeed reads these globals while it builds
    the engine and later (gradient norms, checkpoint names), so every tensor-parallel model of a rank must share
    them (`Topology` refuses a placement where they would differ); and since the engine also makes the module
    itself the global `mpu`, a later job's engine would read a former job's groups unless they are cleared."""
    from deepspeed.utils import groups

    if tp_group is None and groups._TENSOR_MODEL_PARALLEL_GROUP is None:
        return
    groups._TENSOR_MODEL_PARALLEL_GROUP = tp_group
    groups._MODEL_PARALLEL_GROUP = tp_group
    groups._DATA_PARALLEL_GROUP = data_group
    if tp_group is None and groups.mpu is groups:
        groups.mpu = None


def _skip_order_check(ints: list[int]) -> None:
    """Replaces DeepSpeed's world-wide submodule-order cross-check (see module docstring)."""


def install_subgroup_patches() -> None:
    """Disable the coordinator's world-wide order check. Call only when roles use subgroups."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    if not hasattr(coordinator, "assert_ints_same_as_other_ranks"):
        raise RuntimeError("DeepSpeed no longer defines partitioned_param_coordinator.assert_ints_same_as_other_ranks;"
                           " revisit rlhf/engines/deepspeed_compat.py")
    coordinator.assert_ints_same_as_other_ranks = _skip_order_check


class _RankInGroupDistributed:
    """`torch.distributed` whose get_rank() answers the rank inside one group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def get_rank(self, group=None) -> int:
        return dist.get_rank(self._group if group is None else group)

    def __getattr__(self, name: str):
        return getattr(dist, name)


class _TorchWithGroupRank:
    """The `torch` module as seen by transformers' ZeRO-3 weight loader during one construction."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.distributed = _RankInGroupDistributed(group)

    def __getattr__(self, name: str):
        return getattr(torch, name)


@contextmanager
def zero3_construction(config: dict, group: dist.ProcessGroup | None,
                       hpz_group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Build a transformers model under ZeRO-3 with its parameters partitioned over `group` (and with --zpg,
    secondary partitions over `hpz_group`, see `hpz_scoped_to`).

    (a) transformers opens its own `deepspeed.zero.Init` over the whole world; for a role on a subgroup
    that broadcasts to ranks that are building other roles and deadlocks. We open the Init over the
    role's group and mark transformers' ZeRO-3 state as entered so it opens no second one
    (`modeling_utils.set_zero3_state`, a private helper). (b) transformers' ZeRO-3 loader reads the
    checkpoint only where `torch.distributed.get_rank() == 0` (global rank), so on a group without
    global rank 0 nobody would load; during construction its module sees the rank inside the group.
    """
    import deepspeed
    import transformers.integrations.deepspeed as hf_deepspeed
    from transformers import initialization
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.modeling_utils import set_zero3_state

    keep_alive = HfDeepSpeedConfig(config)  # noqa: F841 - transformers reads it while loading weights
    original_torch = hf_deepspeed.torch
    if group is not None:
        hf_deepspeed.torch = _TorchWithGroupRank(group)
    try:
        with initialization.no_init_weights(), hpz_scoped_to(hpz_group), \
                deepspeed.zero.Init(config_dict_or_path=config, data_parallel_group=group,
                                    zero_param_parallel_group=hpz_group), set_zero3_state():
            yield
    finally:
        hf_deepspeed.torch = original_torch
