"""Training checkpoints: everything needed to continue a run identically, written atomically.

Layout of `--ckpt_path`:
    global_step{N}/actor, global_step{N}/critic   DeepSpeed engine states (weights, optimizer, LR schedule)
    global_step{N}/trainer_state.json              step, KL controller, reward normaliser, ptx position
    global_step{N}/rng/rank{r}.pt                  every rank's RNG states
    global_step{N}/COMPLETE                        written last; only complete checkpoints are loaded
    .tmp-global_step{N}/                           a checkpoint being written (renamed when complete)

The prompt position is the step count (the prompt sampler is a pure function of seed and step); the
ptx data position is stored in trainer_state.json.
A process killed mid-write leaves only a `.tmp-*` directory, which loading ignores.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

STEP_DIR = re.compile(r"^global_step(\d+)$")


def complete_checkpoints(ckpt_path: str) -> list[tuple[int, str]]:
    """(step, directory) of every complete checkpoint under `ckpt_path`, oldest first."""
    if not os.path.isdir(ckpt_path):
        return []
    found = []
    for name in os.listdir(ckpt_path):
        match = STEP_DIR.match(name)
        path = os.path.join(ckpt_path, name)
        if match and os.path.isfile(os.path.join(path, "COMPLETE")):
            found.append((int(match.group(1)), path))
    return sorted(found)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def prune(ckpt_path: str, max_num: int, max_gb: float) -> None:
    """Delete the oldest complete checkpoints beyond `max_num` or `max_gb` (always keeps the newest),
    and stale temporary directories. Called by one rank."""
    checkpoints = complete_checkpoints(ckpt_path)
    while len(checkpoints) > 1 and (len(checkpoints) > max_num or
                                    sum(_dir_bytes(p) for _, p in checkpoints) > max_gb * (1 << 30)):
        shutil.rmtree(checkpoints.pop(0)[1])


class CheckpointWriter:
    """Writes one checkpoint collectively: every rank calls `begin`, saves its parts, then `commit`."""

    def __init__(self, ckpt_path: str, step: int, is_writer: bool) -> None:
        self.final = os.path.join(ckpt_path, f"global_step{step}")
        self.tmp = os.path.join(ckpt_path, f".tmp-global_step{step}")
        self.is_writer = is_writer
        self.step = step

    def begin(self) -> str:
        """Create the temporary directory (writer rank) and return it; a barrier follows."""
        if self.is_writer:
            shutil.rmtree(self.tmp, ignore_errors=True)
            os.makedirs(os.path.join(self.tmp, "rng"))
        dist.barrier()
        return self.tmp

    def save_rank_state(self, rank: int) -> None:
        torch.save(rng_state(), os.path.join(self.tmp, "rng", f"rank{rank}.pt"))

    def save_trainer_state(self, state: dict) -> None:
        if self.is_writer:
            with open(os.path.join(self.tmp, "trainer_state.json"), "w") as f:
                json.dump(state, f)

    def commit(self) -> str:
        """After every rank finished writing: mark complete and rename into place atomically."""
        dist.barrier()
        if self.is_writer:
            with open(os.path.join(self.tmp, "COMPLETE"), "w") as f:
                f.write(f"{self.step}\n")
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(self.tmp, self.final)
        dist.barrier()
        return self.final


def load_trainer_state(path: str) -> dict:
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


def load_rank_state(path: str, rank: int) -> None:
    file = os.path.join(path, "rng", f"rank{rank}.pt")
    if not os.path.isfile(file):
        raise ValueError(f"checkpoint {path} has no RNG state for rank {rank}: it was written by a job with a "
                         "different world size")
    set_rng_state(torch.load(file, weights_only=False))
