"""Pretraining text for the ptx loss (`--pretrain_data`, `--ptx_coef`): tokenized micro-batches walked
like any dataset, sharded over the actor's data-parallel replicas, with a position that checkpoints.

Each pass over the data visits every micro-batch once, in an order shuffled by the seed and the pass
number. The k-th batch a replica draws is the global position k * dp_size + dp_rank, so the replicas
of one optimizer step see different batches and consecutive steps move on through the data. Knows
nothing about models or the loss.
"""

from __future__ import annotations

import random

import torch


class PtxData:
    """Right-padded (ids_BT, mask_BT) micro-batches for one data-parallel replica.

    Every rank of the actor calls `next()` the same number of times (one per training micro-batch),
    so `position` (draws per replica so far) is equal on all of them and is what a checkpoint stores.
    """

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], dp_size: int, dp_rank: int,
                 seed: int) -> None:
        if not batches:
            raise ValueError("PtxData needs at least one micro-batch")
        self.batches, self.dp_size, self.dp_rank, self.seed = batches, dp_size, dp_rank, seed
        self.position = 0
        self._orders: dict[int, list[int]] = {}

    def _order(self, data_pass: int) -> list[int]:
        if data_pass not in self._orders:
            order = list(range(len(self.batches)))
            random.Random(self.seed * 1_000_003 + data_pass).shuffle(order)
            self._orders = {data_pass: order}  # only the current pass is ever needed again
        return self._orders[data_pass]

    def index(self, position: int) -> int:
        """Which micro-batch this replica draws at its `position`-th call."""
        data_pass, offset = divmod(position * self.dp_size + self.dp_rank, len(self.batches))
        return self._order(data_pass)[offset]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batches[self.index(self.position)]
        self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"position": self.position, "dp_size": self.dp_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the micro-batches drawn so far. Saved by another number of replicas (a resume at
        another world size or placement): the replicas go on from the same global position, rounded down to a
        whole draw of this run's replicas (at most `dp_size - 1` micro-batches are drawn again)."""
        drawn = int(state["position"]) * int(state.get("dp_size", self.dp_size))
        self.position = drawn // self.dp_size


def tokenize_texts(texts: list[str], tokenizer, micro_batch_size: int, max_len: int,
                   source: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive `micro_batch_size` texts per micro-batch (an incomplete last one is dropped),
    right-padded and truncated to `max_len` tokens."""
    out = []
    for start in range(0, len(texts) - micro_batch_size + 1, micro_batch_size):
        enc = tokenizer(texts[start:start + micro_batch_size], padding=True, truncation=True, padding_side="right",
                        max_length=max_len, return_tensors="pt")
        out.append((enc["input_ids"], enc["attention_mask"]))
    if not out:
        raise ValueError(f"--pretrain_data {source}: fewer than --micro_train_batch_size ({micro_batch_size}) texts")
    return out
