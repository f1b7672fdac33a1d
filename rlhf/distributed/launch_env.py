"""Reads how this process was launched (torchrun or srun) and initialises torch.distributed.

Owns the default process group only; every other group is created by `Topology`.
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.config.errors import UsageError
from rlhf.distributed.heartbeat import Heartbeat


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"
    local_world_size: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE; srun: tasks on this node)


def _first_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'gpu[01-04,07],cpu1' -> 'gpu01'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        raise ValueError(f"cannot read SLURM node list {nodelist!r}; set MASTER_ADDR explicitly")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed tasks-per-node list, e.g. '8(x2),4' -> [8, 8, 4] (one entry per node, node order)."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"cannot read SLURM tasks-per-node list {spec!r}; export LOCAL_WORLD_SIZE explicitly")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_local_world_size(env: dict[str, str]) -> int:
    """Tasks of this job step on this node under srun.

    Read from SLURM_STEP_TASKS_PER_NODE (srun's own step; else SLURM_TASKS_PER_NODE) at index SLURM_NODEID,
    else SLURM_NTASKS_PER_NODE (set when --ntasks-per-node was given), else SLURM_NTASKS / SLURM_NNODES when
    that divides evenly. An exported LOCAL_WORLD_SIZE wins over all of them.
    """
    if "LOCAL_WORLD_SIZE" in env:
        return int(env["LOCAL_WORLD_SIZE"])
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec:
        counts = _expand_tasks_per_node(spec)
        node = int(env.get("SLURM_NODEID", "0"))
        if node < len(counts):
            return counts[node]
    if "SLURM_NTASKS_PER_NODE" in env:
        return int(env["SLURM_NTASKS_PER_NODE"])
    ntasks, nnodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", "1"))
    if ntasks % nnodes:
        raise ValueError(f"cannot tell how many of the {ntasks} SLURM tasks run on this node ({nnodes} nodes, no "
                         "SLURM_TASKS_PER_NODE): run under srun, or export LOCAL_WORLD_SIZE")
    return ntasks // nnodes


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Detect torchrun (RANK/WORLD_SIZE) or SLURM (SLURM_PROCID/SLURM_NTASKS); else a single process."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ValueError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} are not: start with torchrun, "
                             "or export them")
        world_size = int(env["WORLD_SIZE"])
        return LaunchEnv(int(env["RANK"]), world_size, int(env.get("LOCAL_RANK", "0")), env["MASTER_ADDR"],
                         int(env["MASTER_PORT"]), "torchrun", int(env.get("LOCAL_WORLD_SIZE", world_size)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        addr = env.get("MASTER_ADDR") or (_first_host(nodelist) if nodelist else None)
        if addr is None:
            raise ValueError("SLURM_PROCID is set but neither MASTER_ADDR nor SLURM_JOB_NODELIST is: "
                             "run under srun, or export MASTER_ADDR")
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")),
                         addr, int(env.get("MASTER_PORT", "29500")), "slurm", slurm_local_world_size(env))
    return LaunchEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", "29500")), "single", 1)


def cuda_device_index(local_rank: int, local_world_size: int, num_visible: int) -> int:
    """This process's index among the CUDA devices it can see.

    Every local process sees all the node's GPUs (torchrun; srun with --gpus-per-node): its local rank.
    The scheduler bound one GPU to each task (srun --gpus-per-task=1 / --gpu-bind, CUDA_VISIBLE_DEVICES
    holds one device): index 0. Anything else is ambiguous and raises.
    """
    if num_visible >= local_world_size and local_rank < num_visible:
        return local_rank
    if num_visible == 1:
        return 0
    raise ValueError(f"local rank {local_rank} of {local_world_size} processes on this node sees {num_visible} CUDA "
                     "devices: give every process all the node's GPUs or exactly one (srun --gpus-per-task=1), "
                     "or set CUDA_VISIBLE_DEVICES per process")


HEARTBEAT = None
"""This process's `Heartbeat` (started by `init_distributed` in a world of several ranks)."""


def init_distributed(launch: LaunchEnv, timeout_minutes: float = 30) -> torch.device:
    """Initialise the default group (NCCL for CUDA tensors plus gloo for CPU tensors on a GPU machine,
    gloo on CPU) and return this rank's device. `timeout_minutes` (`--dist_timeout`): how long a
    collective (and the rendezvous) waits for ranks that do not arrive before it raises.

    Exports RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_* so libraries that read them (vLLM's
    external launcher, DeepSpeed) agree with us. On CUDA, LOCAL_RANK is exported as the device index
    (`cuda_device_index`): both libraries pick `cuda:LOCAL_RANK`, which is 0 where srun binds one GPU per
    task. Called once by every rank.
    """
    global FINISHED
    FINISHED = False
    device_index = launch.local_rank
    if torch.cuda.is_available():
        device_index = cuda_device_index(launch.local_rank, launch.local_world_size, torch.cuda.device_count())
    for key, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size),
                       ("LOCAL_RANK", device_index), ("LOCAL_WORLD_SIZE", launch.local_world_size),
                       ("MASTER_ADDR", launch.master_addr), ("MASTER_PORT", launch.master_port)):
        os.environ[key] = str(value)
    if torch.cuda.is_available():
        device = torch.device("cuda", device_index)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"  # NCCL for device tensors; small host-side bookkeeping goes over gloo
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store = _store(launch, timeout)
        dist.init_process_group(backend=backend, store=store, rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout)
        os.environ[RUN_TAG_ENV] = _run_tag(store, launch.rank)
        atexit.register(_destroy_groups_at_exit)  # before the heartbeat's join: atexit runs the last one first
        if launch.world_size > 1:  # a stopped peer ends the run within --dist_timeout, naming it
            global HEARTBEAT
            HEARTBEAT = Heartbeat(store, launch.rank, launch.world_size, timeout.total_seconds()).start()
    return device


def finish_heartbeat() -> None:
    """This rank's work is done (after the run's last collective): its peers stop watching it."""
    if HEARTBEAT is not None:
        HEARTBEAT.stop()


FINISHED = False
"""Set by `finish_distributed`: this process's last run reached its end, so its groups go at exit."""


def finish_distributed() -> None:
    """This rank's work is done (after the run's last collective): its peers stop watching it, its heartbeat
    thread ends, and at interpreter exit (not now: a process may run several jobs, and DeepSpeed keeps the
    groups it saw) every process group is destroyed while the interpreter is still whole. Gloo's worker
    threads left to interpreter finalization can abort a process whose run succeeded (`terminate called
    without an active exception`, exit -6; torch asks for `destroy_process_group` before a program ends). A run
    that fails skips it: destroying a group whose peer is gone can wait for gloo's timeout."""
    global FINISHED
    finish_heartbeat()
    if HEARTBEAT is not None:
        HEARTBEAT.join()
    FINISHED = True


_CLOSE_BEFORE_GROUPS: list[Callable[[], None]] = []


def close_before_groups(close: Callable[[], None]) -> None:
    """Run `close()` at interpreter exit after a finished run, before the process groups are destroyed (the
    newest first). For an engine that tears down process groups of its own when it shuts down (vLLM's engine
    core destroys its groups and then the default one, from a finalizer that would otherwise run after
    ours and find them gone: `ValueError: Invalid process group specified`, a traceback after a good run)."""
    _CLOSE_BEFORE_GROUPS.append(close)


def _destroy_groups_at_exit() -> None:
    if not FINISHED:
        return
    while _CLOSE_BEFORE_GROUPS:
        _CLOSE_BEFORE_GROUPS.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()


PORT_IN_USE = "is already in use on this machine"
"""How a taken rendezvous port is reported, by the launcher (`rlhf.cli.launch`) and by a rank 0 that hosts the store."""

RUN_TAG_ENV = "RLHF_RUN_TAG"
"""Set by `init_distributed`: a tag every rank of this run (this restart attempt) shares and no other run has."""


def _run_tag(store: dist.Store, rank: int) -> str:
    """Rank 0's random tag, read by every rank from the rendezvous store: it names this run's machine-wide
    resources (vLLM's CPU shared-memory segments) apart from those of other runs and of crashed ones."""
    if rank == 0:
        store.set("run_tag", uuid.uuid4().hex[:12])
    return store.get("run_tag").decode()


def _store(launch: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys prefixed by the restart attempt.

    Under `torchrun --max-restarts` the agent keeps one store across attempts; without the prefix a
    restarted worker would read its peers' addresses from the failed attempt and never connect.
    Under torchrun the agent hosts the store; otherwise rank 0 does.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    hosts = not agent_hosts and launch.rank == 0
    try:
        store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=hosts,
                              timeout=timeout)
    except dist.DistNetworkError as err:
        if not hosts or "EADDRINUSE" not in str(err):
            raise
        raise UsageError(f"MASTER_PORT {launch.master_port} {PORT_IN_USE} ({launch.master_addr}; another run, or one "
                         "still ending): set another MASTER_PORT (the launcher's --master_port)") from None
    return dist.PrefixStore(f"rlhf/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
