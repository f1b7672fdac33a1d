"""Which samples each data-parallel rank trains on at each step: a resumable, deterministic sampler.

Global batch k is a window of `global_batch_size` indices of an epoch's permutation (torch.randperm
seeded with `seed + epoch`, as `DistributedSampler` does), and rank r takes every `dp_size`-th index of
that window starting at r. That is exactly what OpenRLHF's `DistributedSampler(shuffle=True,
drop_last=True)` plus a `DataLoader(batch_size=global_batch_size // dp_size, drop_last=True)` give each
rank, with the position being a plain step count: a run resumed from `state_dict()` sees the batches an
uninterrupted run would, even with another DP size. Knows nothing of the samples themselves.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class DistributedBatchSampler:
    """Yields this rank's sample indices of global batch `step`, step after step, across epochs.

    Every rank builds it with the same `num_samples`, `global_batch_size` and `seed` (they then agree
    on every global batch); `dp_rank` picks the share. The incomplete last batch of an epoch is dropped.
    """

    def __init__(self, num_samples: int, global_batch_size: int, dp_size: int, dp_rank: int, seed: int, *,
                 shuffle: bool = True) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside a data-parallel group of {dp_size}")
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise ValueError(f"--train_batch_size {global_batch_size} must be a positive multiple of the "
                             f"data-parallel size {dp_size}; change it or the number of GPUs")
        if num_samples < global_batch_size:
            raise ValueError(f"only {num_samples} samples but --train_batch_size is {global_batch_size}; lower it "
                             "or add data")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.step = 0  # the next global batch `next()` returns
        self._order: tuple[int, list[int]] | None = None  # (epoch, its permutation)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def rank_batch_size(self) -> int:
        """Samples of each global batch on one rank."""
        return self.global_batch_size // self.dp_size

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(self.num_samples)
            self._order = (epoch, order.tolist())
        return self._order[1]

    def global_batch(self, step: int) -> list[int]:
        """All sample indices of global batch `step` (0-based, counting across epochs), same on every rank."""
        epoch, index = divmod(step, self.steps_per_epoch)
        start = index * self.global_batch_size
        return self._permutation(epoch)[start:start + self.global_batch_size]

    def indices(self, step: int) -> list[int]:
        """This rank's `rank_batch_size` indices of global batch `step`; the ranks' shares are disjoint and
        together make the global batch."""
        return self.global_batch(step)[self.dp_rank::self.dp_size]

    def next(self) -> list[int]:
        """This rank's indices of the batch at the current position, then move on one step."""
        out = self.indices(self.step)
        self.step += 1
        return out

    def __iter__(self) -> Iterator[list[int]]:
        """`next()` forever (stop after as many steps as the run has)."""
        while True:
            yield self.next()

    def state_dict(self) -> dict:
        return {"step": self.step, "num_samples": self.num_samples, "global_batch_size": self.global_batch_size,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position. The data size, global batch size, seed and shuffling must be
        those of the saved run (the DP size may differ), else the batches would differ: a ValueError."""
        keys = ("num_samples", "global_batch_size", "seed", "shuffle")
        changed = [f"{k} {state[k]} -> {getattr(self, k)}" for k in keys if k in state and state[k] != getattr(self, k)]
        if changed:
            raise ValueError(f"cannot resume the data order: {', '.join(changed)} since the checkpoint; resume with "
                             "the same data, --train_batch_size and --seed, or start a new run")
        self.step = int(state["step"])
