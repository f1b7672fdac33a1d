"""Every rank resumes from rank 0's choice of checkpoint and reports rank 0's errors; a checkpoint written in the
background (--async_save) is completed once every rank wrote its part, and one rank's failed write ends every rank
with a line (2 gloo ranks)."""

import json

from rlhf.config.errors import UsageError
from rlhf.utils import checkpoint_files as ckpt
from rlhf.utils.checkpoint_files import (
    MANIFEST,
    CheckpointWriter,
    pick_checkpoint,
)
from tests.distributed import run_on_ranks


def _commit_on_two_ranks(root: str) -> list:
    """Rank 0 and 1 write a checkpoint; then rank 0's choice (or error) reaches both ranks."""
    import torch.distributed as dist

    rank = dist.get_rank()
    writer = CheckpointWriter(root, 2, is_writer=rank == 0)
    writer.begin()
    writer.save_rank_state(rank)
    writer.save_trainer_state({"step": 2, "world_size": 2})
    writer.commit()
    chosen = ckpt.decided_by_rank0(lambda: pick_checkpoint(root, resuming=True, explicit_path=True,
                                                           restarted=False)[:2], rank)
    try:
        ckpt.decided_by_rank0(lambda: pick_checkpoint(root + "/nope", resuming=True, explicit_path=True,
                                                      restarted=False), rank)
    except UsageError as err:
        return [chosen, str(err)]
    return [chosen, None]


def test_every_rank_gets_rank0s_choice_and_errors(tmp_path):
    results = run_on_ranks(2, _commit_on_two_ranks, str(tmp_path))
    final = str(tmp_path / "global_step2")
    for chosen, error in results:
        assert tuple(chosen) == (2, final)
        assert error.startswith(f"--load_checkpoint: --ckpt_path {tmp_path}/nope does not exist")
    entries = json.loads((tmp_path / "global_step2" / MANIFEST).read_text())["files"]
    assert sorted(entries) == ["rng/rank0.pt", "rng/rank1.pt", "trainer_state.json"]


def _async_saves(root: str) -> list:
    """--async_save on 2 ranks: step 1's checkpoint is written in the background and completed by `finish`;
    step 2's write fails on rank 1 (a full disk): each rank ends with one line, and step 1's stays the newest."""
    import errno
    import os

    import torch
    import torch.distributed as dist

    from rlhf.config.shared_config import CheckpointConfig
    from rlhf.core.checkpointer import Checkpointer
    from rlhf.core.state import CheckpointedState
    from rlhf.utils.write_failure import CheckpointWriteError

    rank = dist.get_rank()
    weights = torch.full((4,), float(rank))

    class Engine:  # what a DeepSpeed engine's save_state does with a snapshot: a file per rank
        def save_state(self, directory, snapshot, what):
            os.makedirs(directory, exist_ok=True)
            snapshot.save({"w": weights}, os.path.join(directory, f"rank{rank}.pt"), what)

    class Logger:
        def continue_from(self, done, resuming):
            return None

    cfg = CheckpointConfig(ckpt_path=root, async_save=True)
    checkpointer = Checkpointer(cfg, default_ckpt_path="unused", rank=rank, world_size=2, logger=Logger())
    state = CheckpointedState(engines={"actor": Engine()})
    assert checkpointer.save(state, 1) is None
    weights.add_(10)  # the next step changes the weights while the copy is written
    finished = checkpointer.finish()
    assert checkpointer.finish() is None  # nothing pending any more
    if rank == 1:
        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        torch.save = full_disk
    checkpointer.save(state, 2)
    try:
        checkpointer.finish()
    except CheckpointWriteError as err:
        return [finished, str(err)]
    return [finished, None]


def test_async_saves_complete_once_every_rank_wrote_and_a_failed_one_ends_every_rank(tmp_path):
    import torch

    (done0, error0), (done1, error1) = run_on_ranks(2, _async_saves, str(tmp_path))
    step1, tmp2 = str(tmp_path / "global_step1"), str(tmp_path / ".tmp-global_step2")
    assert done0 == done1 == step1
    for rank in (0, 1):  # the weights as they were at the save
        assert torch.equal(torch.load(f"{step1}/actor/rank{rank}.pt")["w"], torch.full((4,), float(rank)))
    entries = json.loads((tmp_path / "global_step1" / MANIFEST).read_text())["files"]
    assert sorted(entries) == ["actor/rank0.pt", "actor/rank1.pt", "rng/rank0.pt", "rng/rank1.pt",
                               "trainer_state.json"]
    assert error1.startswith(f"no space left on {tmp2} (") and "the actor's DeepSpeed state" in error1
    # rank 0 names rank 1, or, where rank 1 had already removed the unfinished directory, says so
    assert error0 in (f"rank 1 could not write its part of {tmp2} (its error line says why); the checkpoint was not "
                      "completed, earlier ones are intact",) or "removed by another rank" in error0, error0
    assert [s for s, _ in ckpt.complete_checkpoints(str(tmp_path))] == [1]
    assert not (tmp_path / ".tmp-global_step2").exists()
