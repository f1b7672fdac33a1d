"""Training checkpoints: everything needed to continue a run identically, written atomically and verified
before use.

Layout of `--ckpt_path`:
    global_step{N}/actor, global_step{N}/critic   DeepSpeed engine states (weights, optimizer, LR schedule)
    global_step{N}/trainer_state.json              step, KL controller, reward normaliser, ptx position
    global_step{N}/rng/rank{r}.pt                  every rank's RNG states (tensors and plain lists: they load
                                                   with `torch.load(weights_only=True)`)
    global_step{N}/MANIFEST.json                   every file's size, and a CRC-32 of the small ones
    global_step{N}/COMPLETE                        written last; only complete checkpoints are considered
    .tmp-global_step{N}/                           a checkpoint being written (renamed when complete)

Who writes what: every rank of a role's DP group writes its DeepSpeed shards (DeepSpeed decides the file
names), every rank its own RNG file, rank 0 trainer_state.json and, after a barrier (all writes done),
the manifest and COMPLETE. Rank 0 alone picks the checkpoint to resume from (the newest one that matches
its manifest) and the trainer broadcasts its choice, so every rank loads the same one.

The prompt position is the step count (the prompt sampler is a pure function of seed and step); the
ptx data position is stored in trainer_state.json.
A process killed mid-write leaves only a `.tmp-*` directory, which loading ignores and the next start
(`pick_checkpoint`) or save (`prune`) removes. This module does not know the trainer or its roles.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import random
import re
import shutil
import zlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from rlhf.config.errors import UsageError
from rlhf.utils.write_failure import CheckpointWriteError

T = TypeVar("T")
STEP_DIR = re.compile(r"^global_step(\d+)$")
TMP_DIR = re.compile(r"^\.tmp-global_step(\d+)$")
MANIFEST = "MANIFEST.json"
TRAINER_STATE = "trainer_state.json"
CHECKSUM_MAX_BYTES = 64 << 20
"""Files up to this size get a CRC-32 in the manifest; larger ones (DeepSpeed weight and optimizer
shards) only their size. Truncation, zero-length files after a crash and missing files all change sizes;
a CRC of every file costs rank 0 about 1.1 s per GiB (page cache; more from disk) at every save and every
resume, against 10 ms for a 1 GiB checkpoint this way (see the README)."""
LOW_SPACE_BYTES = 256 << 20
"""A failed write with less free space than this on the checkpoint's filesystem is reported as a full disk."""


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
    """This process's RNG states as tensors, strings, numbers and lists only, so that the file loads with
    `torch.load(weights_only=True)` (no pickled numpy or Python objects, no code run on load)."""
    version, mt_state, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "python": [version, torch.tensor(mt_state, dtype=torch.int64), gauss_next],
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian)],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, mt_state, gauss_next = state["python"]
    random.setstate((version, tuple(mt_state.tolist()), gauss_next))
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def remove_stale_tmp(ckpt_path: str) -> list[str]:
    """Delete `.tmp-global_step*` directories (checkpoints whose writing was interrupted) and return them.
    Called by one rank while no checkpoint is being written."""
    if not os.path.isdir(ckpt_path):
        return []
    stale = sorted(os.path.join(ckpt_path, n) for n in os.listdir(ckpt_path) if TMP_DIR.match(n))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def prune(ckpt_path: str, max_num: int, max_gb: float) -> None:
    """Delete the oldest complete checkpoints beyond `max_num` or `max_gb` (always keeps the newest),
    and stale temporary directories. Called by one rank after a checkpoint was committed."""
    remove_stale_tmp(ckpt_path)
    checkpoints = complete_checkpoints(ckpt_path)
    while len(checkpoints) > 1 and (len(checkpoints) > max_num or
                                    sum(_dir_bytes(p) for _, p in checkpoints) > max_gb * (1 << 30)):
        shutil.rmtree(checkpoints.pop(0)[1])


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(directory: str) -> list[str]:
    """Paths of the checkpoint's files relative to `directory` (the manifest and COMPLETE excluded)."""
    found = [os.path.relpath(os.path.join(root, f), directory) for root, _, files in os.walk(directory) for f in files]
    return sorted(f for f in found if f not in (MANIFEST, "COMPLETE"))


def write_manifest(directory: str) -> dict:
    """Record every file's size (and the CRC-32 of files up to CHECKSUM_MAX_BYTES) in MANIFEST.json."""
    entries = {}
    for rel in _files(directory):
        path = os.path.join(directory, rel)
        size = os.path.getsize(path)
        entries[rel] = {"size": size, "crc32": _crc32(path) if size <= CHECKSUM_MAX_BYTES else None}
    manifest = {"version": 1, "files": entries}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def verify_checkpoint(path: str) -> str | None:
    """None when the checkpoint at `path` matches its manifest, its trainer_state.json parses and it holds an
    RNG file for each rank that wrote it; otherwise what is wrong, naming the file."""
    manifest_file = os.path.join(path, MANIFEST)
    try:
        with open(manifest_file) as f:
            entries = json.load(f)["files"]
    except FileNotFoundError:
        return f"{manifest_file} is missing (an interrupted write, or written by an older version)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest_file} cannot be read: {err!r}"
    for rel, entry in entries.items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            return f"{file} is missing (listed in {MANIFEST})"
        size = os.path.getsize(file)
        if size != entry["size"]:
            return f"{file} has {size} bytes, {MANIFEST} says {entry['size']} (truncated or overwritten)"
        if entry["crc32"] is not None and (crc := _crc32(file)) != entry["crc32"]:
            return f"{file} has CRC-32 {crc}, {MANIFEST} says {entry['crc32']} (corrupted)"
    try:
        world_size = int(load_trainer_state(path)["world_size"])
    except (ValueError, KeyError, TypeError) as err:
        return str(err) if isinstance(err, ValueError) else f"{path}/trainer_state.json has no world_size"
    for rel in [f"rng/rank{r}.pt" for r in range(world_size)]:
        if rel not in entries:
            return f"{os.path.join(path, rel)} was never written (not in {MANIFEST})"
    return None


def check_resume_path(ckpt_path: str, *, explicit_path: bool, restarted: bool) -> None:
    """`UsageError` when --load_checkpoint names (`explicit_path`) a --ckpt_path that does not exist (not
    after a torchrun restart, whose first attempt may have died before its first checkpoint). Any rank."""
    if explicit_path and not restarted and not os.path.exists(ckpt_path):
        raise UsageError(f"--load_checkpoint: --ckpt_path {ckpt_path} does not exist; pass the --ckpt_path of the "
                         "run to continue, or drop --load_checkpoint to start a new run")


def identity_mismatch(path: str, saved: dict | None, identity: dict | None, why: str) -> str | None:
    """What makes the checkpoint at `path` (whose trainer state recorded `saved`) another run's than the one
    described by `identity` (`rlhf.core.run.run_identity`: the job, --pretrain's weights and tokenizer files, the
    flags that shape the engine states), as one line with the fix; None when it is this run's (or either side
    recorded nothing: a checkpoint of an older version)."""
    if not saved or not identity:
        return None
    if saved.get("job") != identity.get("job"):
        return (f"{why}: checkpoint {path} was written by the {saved.get('job')!r} job and this is the "
                f"{identity.get('job')!r} job: resume it with the job that wrote it, or start a new --ckpt_path")
    want, got = saved.get("pretrain_fingerprint"), identity.get("pretrain_fingerprint")
    if want is not None and got is not None and want != got:
        return (f"{why}: checkpoint {path} continues a run of --pretrain {saved.get('pretrain')} and this run's "
                f"--pretrain {identity.get('pretrain')} holds other weights (fingerprint {got[:12]}, the run's "
                f"{want[:12]}): pass the run's --pretrain, or start a new --ckpt_path")
    want, got = saved.get("tokenizer_fingerprint"), identity.get("tokenizer_fingerprint")
    if want is not None and got is not None and want != got:
        differ = sorted(name for name in set(want) | set(got) if want.get(name) != got.get(name))
        return (f"{why}: checkpoint {path} continues a run of --pretrain {saved.get('pretrain')} and this run's "
                f"--pretrain {identity.get('pretrain')} has another tokenizer ({', '.join(differ)} "
                "differ: its token ids mean other text): pass the run's --pretrain, or start a new --ckpt_path")
    want, got = saved.get("state_flags") or {}, identity.get("state_flags") or {}
    changed = [flag for flag in want if flag in got and want[flag] != got[flag]]
    if changed:
        was = ", ".join(f"{flag} {want[flag]}" for flag in changed)
        now = ", ".join(f"{flag} {got[flag]}" for flag in changed)
        return (f"{why}: checkpoint {path} was written with {was} and this run has {now} (its engine states are "
                f"typed or chosen by them): resume with {was}, or start a new --ckpt_path")
    return None


def check_resumable(ckpt_path: str, *, why: str, identity: dict | None = None) -> None:
    """Before any engine starts: the newest intact checkpoint under `ckpt_path` (if any exist) can be resumed
    by this run, the checks `pick_checkpoint` and the resume make later, read only (nothing is removed).
    `UsageError` when checkpoints exist but none is intact, or the one to resume was written by another job,
    from another --pretrain (`identity`, see `identity_mismatch`) or without engine states. Another world size,
    ZeRO stage or placement is no reason: the engine states move on load. `why`: what asks for the resume.
    Any rank."""
    problems = []
    for _, path in reversed(complete_checkpoints(ckpt_path)):
        problem = verify_checkpoint(path)
        if problem is not None:
            problems.append((path, problem))
            continue
        saved = load_trainer_state(path)
        mismatch = identity_mismatch(path, saved.get("identity"), identity, why)
        if mismatch:
            raise UsageError(mismatch)
        if not saved.get("has_engine_states", True):
            raise UsageError(f"{why}: checkpoint {path} holds no DeepSpeed states (written with --disable_ds_ckpt) "
                             "and cannot be resumed exactly; start a new --ckpt_path (its HF weights can be "
                             "--pretrain)")
        return
    if problems:
        raise UsageError(f"{why}: no intact checkpoint under {ckpt_path}:\n" +
                         "\n".join(f"  {p}: {why_bad}" for p, why_bad in problems))


def pick_checkpoint(ckpt_path: str, *, resuming: bool, explicit_path: bool,
                    restarted: bool) -> tuple[int, str | None, list[str]]:
    """(steps done, checkpoint directory or None, lines to print) for a starting run: removes stale
    temporary directories, then, when `resuming`, picks the newest checkpoint that passes
    `verify_checkpoint`; every newer one that fails is named with what is wrong. Raises `UsageError` when
    `--load_checkpoint` names (`explicit_path`) a directory that does not exist (except after a torchrun
    restart, whose first attempt may have died before its first checkpoint), and `ValueError` when
    checkpoints exist but none is intact. Called by rank 0 only."""
    notes = [f"removed {p}: a checkpoint whose writing was interrupted" for p in remove_stale_tmp(ckpt_path)]
    if not resuming:
        return 0, None, notes
    why = "torchrun restart" if restarted else "--load_checkpoint"
    check_resume_path(ckpt_path, explicit_path=explicit_path, restarted=restarted)
    found = complete_checkpoints(ckpt_path)
    problems = []
    for done, path in reversed(found):
        problem = verify_checkpoint(path)
        if problem is None:
            notes += [f"checkpoint {p} is damaged, skipping it: {why_bad}" for p, why_bad in problems]
            return done, path, notes
        problems.append((path, problem))
    if problems:
        raise ValueError(f"{why}: no intact checkpoint under {ckpt_path}:\n" +
                         "\n".join(f"  {p}: {why_bad}" for p, why_bad in problems))
    notes.append(f"{why}: no checkpoint under {ckpt_path}, starting from step 0")
    return 0, None, notes


def decided_by_rank0(decide: Callable[[], T], rank: int, group: dist.ProcessGroup | None = None) -> T:
    """`decide()` run on rank 0 of `group` (`rank`: this rank's place in it; default group: the world) and its
    result broadcast to every rank of the group. A ValueError or OSError it raises is raised on every rank (a
    `UsageError` as a `UsageError`, an OSError as a RuntimeError with rank 0's message), so no rank waits for a
    decision that never comes. Collective over the group."""
    box: list = [None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    if rank == 0:
        try:
            box[0] = ("ok", decide())
        except (ValueError, OSError) as err:
            kind = "usage" if isinstance(err, UsageError) else "value" if isinstance(err, ValueError) else "os"
            dist.broadcast_object_list([(kind, f"{err}")], src=src, group=group)
            raise
    dist.broadcast_object_list(box, src=src, group=group)
    kind, value = box[0]
    if kind != "ok":
        raise {"usage": UsageError, "value": ValueError}.get(kind, RuntimeError)(value)
    return value


FILE_WRITE_MARKERS = ("iostream error", "unexpected pos")
"""In torch.save's errors for a failed file write, which carry no errno: `basic_ios::clear: iostream error`, and
the zip writer's `[enforce fail at inline_container.cc] unexpected pos N vs M` raised while closing after it."""


def describe_write_failure(directory: str, what: str, err: BaseException, removed: bool = False) -> str:
    """One line for a failed checkpoint write: 'no space left on DIR' when a file write failed on a (nearly) full
    disk. torch.save reports a full disk without an errno (FILE_WRITE_MARKERS; the first error is often the
    context of a second one raised while the zip file closes), so the whole chain of errors is read and the free
    space checked as well; an error that is not a file write (a collective whose peer died, e.g. the rank that
    met the full disk) is reported as it is, even on a full disk. `removed`: the unfinished checkpoint's directory
    is gone, removed by another rank whose own write failed first (its line says why)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    chain, link = [], err
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    writes = [e for e in chain if isinstance(e, OSError) or any(m in str(e) for m in FILE_WRITE_MARKERS)]
    low = free is not None and free < LOW_SPACE_BYTES
    full = any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for e in chain) or (bool(writes) and low)
    room = "unknown" if free is None else f"{free / (1 << 20):.0f} MiB"
    if full:
        return (f"no space left on {directory} ({room} free) while writing {what}; the checkpoint was not "
                f"completed (its partial files are removed), earlier ones are intact; free space or pass another "
                f"--ckpt_path ({writes[-1] if writes else err})")
    if removed:
        return (f"writing {what} into {directory} failed: the unfinished checkpoint's directory was removed by "
                f"another rank whose write failed first (its error line says why); earlier checkpoints are intact "
                f"({room} free; {err})")
    return f"writing {what} into {directory} failed ({room} free): {err}"


class CheckpointWriter:
    """Writes one checkpoint collectively: every rank calls `begin`, saves its parts (inside `writing`),
    then `commit`. A failed write raises `CheckpointWriteError` on the rank that met it; that rank never
    reaches `commit`'s barrier, so no rank marks the checkpoint complete."""

    def __init__(self, ckpt_path: str, step: int, is_writer: bool) -> None:
        self.final = os.path.join(ckpt_path, f"global_step{step}")
        self.tmp = os.path.join(ckpt_path, f".tmp-global_step{step}")
        self.is_writer = is_writer
        self.step = step

    def begin(self) -> str:
        """Create the temporary directory (writer rank) and return it; a barrier follows."""
        if self.is_writer:
            with self.writing("the checkpoint directory"):
                shutil.rmtree(self.tmp, ignore_errors=True)
                os.makedirs(os.path.join(self.tmp, "rng"))
        dist.barrier()
        return self.tmp

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Turn OSError/RuntimeError raised by the writes inside into a `CheckpointWriteError` naming
        `what`, the directory and, for a full disk, 'no space left'; the unfinished checkpoint's directory is
        removed."""
        try:
            yield
        except (OSError, RuntimeError) as err:
            if isinstance(err, CheckpointWriteError):
                raise
            present = os.path.isdir(self.tmp)
            # gone, or going (a path inside it missing while another rank's failure removes it); `begin` failed:
            # it was never made
            removed = (not present or self._inside_missing(err)) and what != "the checkpoint directory"
            message = describe_write_failure(self.tmp if present else os.path.dirname(self.tmp), what, err, removed)
            shutil.rmtree(self.tmp, ignore_errors=True)  # a full disk gets its space back; nothing loads a .tmp-*
            raise CheckpointWriteError(message) from err

    def _inside_missing(self, err: BaseException) -> bool:
        """Whether `err` says a path inside the temporary directory does not exist (DeepSpeed's and torch.save's
        'Parent directory ... does not exist', or a FileNotFoundError)."""
        text = str(err)
        return self.tmp in text and (isinstance(err, FileNotFoundError) or "does not exist" in text)

    def rank_state_file(self, rank: int) -> str:
        return os.path.join(self.tmp, "rng", f"rank{rank}.pt")

    def save_rank_state(self, rank: int) -> None:
        with self.writing(f"rng/rank{rank}.pt"):
            torch.save(rng_state(), self.rank_state_file(rank))

    def save_trainer_state(self, state: dict) -> None:
        if self.is_writer:
            with self.writing(TRAINER_STATE), open(os.path.join(self.tmp, TRAINER_STATE), "w") as f:
                json.dump(state, f)

    def commit(self) -> str:
        """After every rank finished writing: record the manifest, mark complete and rename into place
        atomically (writer rank; barriers before and after)."""
        dist.barrier()
        if self.is_writer:
            with self.writing(MANIFEST):
                write_manifest(self.tmp)
            with self.writing("COMPLETE"), open(os.path.join(self.tmp, "COMPLETE"), "w") as f:
                f.write(f"{self.step}\n")
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(self.tmp, self.final)
        dist.barrier()
        return self.final


def load_trainer_state(path: str) -> dict:
    file = os.path.join(path, "trainer_state.json")
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{file} cannot be read: {err}") from err


def load_rank_state(path: str, rank: int) -> None:
    """Restore this rank's RNG states. `weights_only=True`: the file holds only tensors and plain values, so
    loading a checkpoint from elsewhere cannot run code through it."""
    file = os.path.join(path, "rng", f"rank{rank}.pt")
    if not os.path.isfile(file):
        raise ValueError(f"checkpoint {path} has no RNG state for rank {rank} ({file}): it was written by a job "
                         "with a different world size")
    try:
        state = torch.load(file, weights_only=True)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as err:  # weights_only refusals: UnpicklingError
        raise ValueError(f"{file} cannot be loaded: {err}") from err
    set_rng_state(state)
