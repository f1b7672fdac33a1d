"""Reads how this process was launched (torchrun or srun) and initialises torch.distributed.

Owns the default process group only; every other group is created by `Topology`.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


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


def read_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Detect torchrun (RANK/WORLD_SIZE) or SLURM (SLURM_PROCID/SLURM_NTASKS); else a single process."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ValueError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} are not: start with torchrun, "
                             "or export them")
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                         env["MASTER_ADDR"], int(env["MASTER_PORT"]), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        addr = env.get("MASTER_ADDR") or (_first_host(nodelist) if nodelist else None)
        if addr is None:
            raise ValueError("SLURM_PROCID is set but neither MASTER_ADDR nor SLURM_JOB_NODELIST is: "
                             "run under srun, or export MASTER_ADDR")
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")),
                         addr, int(env.get("MASTER_PORT", "29500")), "slurm")
    return LaunchEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", "29500")), "single")


def init_distributed(launch: LaunchEnv, timeout_minutes: float = 30) -> torch.device:
    """Initialise the default group (NCCL for CUDA tensors plus gloo for CPU tensors on a GPU machine,
    gloo on CPU) and return this rank's device. `timeout_minutes` (`--dist_timeout`): how long a
    collective (and the rendezvous) waits for ranks that do not arrive before it raises.

    Exports RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* so libraries that read them (vLLM's external
    launcher, DeepSpeed) agree with us. Called once by every rank.
    """
    for key, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size),
                       ("LOCAL_RANK", launch.local_rank), ("LOCAL_WORLD_SIZE", os.environ.get(
                           "LOCAL_WORLD_SIZE", launch.world_size)),
                       ("MASTER_ADDR", launch.master_addr), ("MASTER_PORT", launch.master_port)):
        os.environ[key] = str(value)
    if torch.cuda.is_available():
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"  # NCCL for device tensors; small host-side bookkeeping goes over gloo
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend=backend, store=_store(launch, timeout), rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
    return device


def _store(launch: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys prefixed by the restart attempt.

    Under `torchrun --max-restarts` the agent keeps one store across attempts; without the prefix a
    restarted worker would read its peers' addresses from the failed attempt and never connect.
    Under torchrun the agent hosts the store; otherwise rank 0 does.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                          is_master=not agent_hosts and launch.rank == 0, timeout=timeout)
    return dist.PrefixStore(f"rlhf/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
