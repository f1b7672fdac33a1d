"""Save and resume a job's registered state (`CheckpointedState`) with the file-level machinery of
`rlhf.utils.checkpoint_files` (atomic rename, manifest, fallback to the newest intact checkpoint, pruning,
metrics truncation). Knows nothing about any job: engines and components arrive by name.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from rlhf.config.shared_config import CheckpointConfig
from rlhf.core.state import CheckpointedState
from rlhf.utils.checkpoint_files import (
    TRAINER_STATE,
    CheckpointWriter,
    decided_by_rank0,
    load_rank_state,
    load_trainer_state,
    pick_checkpoint,
    prune,
    rng_state,
)
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.snapshot import Snapshot
from rlhf.utils.write_failure import CheckpointWriteError


def restarted_by_launcher() -> bool:
    """Whether torchrun restarted the workers (--max-restarts): such a run resumes without --load_checkpoint."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


class Checkpointer:
    """Writes and finds checkpoints under --ckpt_path. Construct on every rank; `save` and `resume` are
    collective over the world. `default_ckpt_path`: the job's default --ckpt_path (a user-chosen directory
    that is empty is an error when resuming; the default one may be)."""

    def __init__(self, cfg: CheckpointConfig, *, default_ckpt_path: str, rank: int, world_size: int,
                 logger: MetricsLogger, identity: dict | None = None) -> None:
        """`identity`: what the run is (`rlhf.core.run.run_identity`), recorded in every checkpoint
        and checked before a resume (`rlhf.utils.checkpoint_files.identity_mismatch`)."""
        self.cfg, self.rank, self.world_size, self.logger = cfg, rank, world_size, logger
        self.identity = identity
        self.explicit_path = cfg.ckpt_path != default_ckpt_path
        self.pending: tuple[CheckpointWriter, Snapshot] | None = None  # --async_save: the checkpoint being written

    def save(self, state: CheckpointedState, done_steps: int) -> str | None:
        """Everything needed to continue after `done_steps` steps; returns the checkpoint's directory. With
        --async_save the state is copied and written in the background (one checkpoint in flight: a save first
        waits for the previous one), completed by a later `settle`, and None is returned."""
        c = self.cfg
        if c.async_save:
            self.settle(wait=True)
        writer = CheckpointWriter(c.ckpt_path, done_steps, is_writer=self.rank == 0)
        tmp = writer.begin()
        snapshot = Snapshot(writer.writing) if c.async_save else None
        for name, engine in state.engines.items():
            if engine is not None and not c.disable_ds_ckpt:
                what = f"the {name}'s DeepSpeed state"
                with writer.writing(what):
                    engine.save_state(os.path.join(tmp, name), snapshot, what)
        if c.save_hf_ckpt and state.hf_export is not None:
            with writer.writing("the model in HF format"):
                state.hf_export(os.path.join(tmp, "hf"))
        trainer_state = {"step": done_steps, "world_size": self.world_size, "has_engine_states": not c.disable_ds_ckpt,
                         "identity": self.identity}
        for name, component in state.components.items():
            trainer_state[name] = component.state_dict() if component is not None else None
        if snapshot is None:
            writer.save_rank_state(self.rank)
            writer.save_trainer_state(trainer_state)
            return self._commit(writer)
        snapshot.save(rng_state(), writer.rank_state_file(self.rank), f"rng/rank{self.rank}.pt")
        if writer.is_writer:
            snapshot.save_text(json.dumps(trainer_state), os.path.join(tmp, TRAINER_STATE), TRAINER_STATE)
        snapshot.start()
        self.pending = (writer, snapshot)
        return None

    def settle(self, wait: bool) -> str | None:
        """With a checkpoint being written in the background (--async_save): once every rank has written its part
        (`wait`: wait for this rank's), complete it (manifest, COMPLETE, rename) and return its directory; None
        while a rank is still writing, or when none is pending. Once a rank's write has failed, every rank waits
        for its own writing to end and the unfinished directory is removed; then the rank that failed raises its
        `CheckpointWriteError`, and the others their own error or one naming it. Collective over the world (every
        rank has the same checkpoint pending); the loop calls it at every step's end."""
        if self.pending is None:
            return None
        writer, snapshot = self.pending
        if wait:
            snapshot.wait()
        done = snapshot.done()
        flags = torch.tensor([0.0 if done else 1.0, self.rank + 1.0 if done and snapshot.error is not None else 0.0])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        writing, failed_rank = bool(flags[0].item()), int(flags[1].item()) - 1
        if failed_rank < 0 and writing:
            return None
        self.pending = None
        if failed_rank < 0:
            return self._commit(writer)
        snapshot.wait()  # this rank's writing ends too (it may fail now that the directory is being removed)
        dist.barrier()
        if self.rank == 0:  # what ranks still wrote while the failed one removed the directory
            shutil.rmtree(writer.tmp, ignore_errors=True)
        error = snapshot.error
        if isinstance(error, CheckpointWriteError):
            raise error
        if error is not None:
            raise CheckpointWriteError(f"writing {writer.tmp} failed: {error}")
        raise CheckpointWriteError(f"rank {failed_rank} could not write its part of {writer.tmp} (its error line "
                                   "says why); the checkpoint was not completed, earlier ones are intact")

    def finish(self) -> str | None:
        """Complete the checkpoint being written in the background, if any (see `settle`)."""
        return self.settle(wait=True)

    def _commit(self, writer: CheckpointWriter) -> str:
        final = writer.commit()
        if self.rank == 0:
            prune(self.cfg.ckpt_path, self.cfg.max_ckpt_num, self.cfg.max_ckpt_mem)
        dist.barrier()
        return final

    def resume(self, state: CheckpointedState) -> int:
        """Load the newest intact checkpoint when --load_checkpoint is set (or torchrun restarted the workers);
        returns the steps done. Rank 0 removes stale temporary checkpoints, picks the checkpoint (verified
        against its manifest) and lines metrics.jsonl up with it, then broadcasts the choice (or its error),
        so every rank loads the same checkpoint or raises the same error."""
        restarted = restarted_by_launcher()
        resuming = self.cfg.load_checkpoint or restarted

        def pick() -> tuple[int, str | None]:
            done, path, notes = pick_checkpoint(self.cfg.ckpt_path, resuming=resuming, restarted=restarted,
                                                explicit_path=self.explicit_path)
            for note in filter(None, [*notes, self.logger.continue_from(done, resuming)]):
                print(note, flush=True)
            return done, path

        done, path = decided_by_rank0(pick, self.rank)
        if path is None:
            return 0
        saved = load_trainer_state(path)
        if not saved["has_engine_states"]:
            raise ValueError(f"checkpoint {path} cannot be resumed: it holds no engine states (--disable_ds_ckpt)")
        moves = []
        for name, engine in state.engines.items():
            if engine is not None:
                try:
                    moves.append(engine.load_state(os.path.join(path, name), universal=self.cfg.use_ds_universal_ckpt))
                except (OSError, RuntimeError) as err:
                    raise ValueError(f"loading {os.path.join(path, name)} (the {name}'s DeepSpeed state) failed: "
                                     f"{err}") from err
        for name, component in state.components.items():
            if component is None:
                continue
            if saved.get(name) is None:
                raise ValueError(f"checkpoint {path} holds no state for {name!r}: it was written by a run with other "
                                 "settings; resume with the same flags or start a new --ckpt_path")
            component.load_state_dict(saved[name])
        if saved["world_size"] == self.world_size:
            load_rank_state(path, self.rank)
        if self.rank == 0:
            for line in filter(None, moves):
                print(line, flush=True)
            if saved["world_size"] != self.world_size:
                print(f"the run moved from {saved['world_size']} ranks to {self.world_size}: the ranks keep the "
                      "random states they started with (sampling seeds are per prompt, not per rank)", flush=True)
            print(f"resumed from {path} after {done} steps" + next_samples_note(state, done), flush=True)
        return done


def next_samples_note(state: CheckpointedState, done: int, shown: int = 16) -> str:
    """"; step N trains on samples i, j, ..." (their places in the training data), or "" when the job does not
    say."""
    if state.next_samples is None:
        return ""
    ids = state.next_samples(done)
    listed = ", ".join(map(str, ids[:shown])) + (f", ... ({len(ids)} in all)" if len(ids) > shown else "")
    return f"; step {done + 1} trains on samples {listed}"
