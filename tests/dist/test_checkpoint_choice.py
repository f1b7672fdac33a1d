"""Every rank resumes from rank 0's choice of checkpoint and reports rank 0's errors (2 gloo ranks)."""

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
