"""Cutting a role's share of a batch into micro-batches: a fixed number of samples each, or
(`--use_dynamic_batch`) as many samples as fit a per-rank token budget, with the same number of
micro-batches on every rank of the role so collective forwards and backwards stay matched; and dealing an
optimizer step's samples to the role's data-parallel replicas (`MicroBatcher.replica_rows`).

Losses divide by the global token (or sequence) count of the optimizer step, so the gradient does not
depend on how the step is cut; `Actor.train_batch` and `Critic.train_batch` do that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.distributed.collectives import shard
from rlhf.kernels import count_micro_batches, split_into_micro_batches
from rlhf.models.layout import PADDED, SequenceLayout


@dataclass(frozen=True)
class MicroBatcher:
    """size: samples per micro-batch; max_tokens: the per-rank token budget (dynamic batching when set);
    group: the ranks that must run the same number of micro-batches; flag: named in budget errors."""

    size: int
    max_tokens: int | None = None
    group: dist.ProcessGroup | None = None
    layout: SequenceLayout = PADDED
    flag: str = "--train_max_tokens_per_gpu"

    def replica_rows(self, attention_mask_BT: torch.Tensor, num_replicas: int, replica: int) -> list[int]:
        """Replica `replica`'s rows of one optimizer step's samples, in the given order: a contiguous share, or with
        dynamic batching an equal number of rows dealt by length (`balanced_shares`), as OpenRLHF balances the
        replicas' tokens under --use_dynamic_batch. The sum over the replicas' gradients does not depend on the
        deal; the step's wall time is the slowest replica's."""
        B = attention_mask_BT.shape[0]
        if self.max_tokens is None:
            return list(range(B)[shard(B, num_replicas, replica)])
        costs = [self.layout.token_cost(int(n)) for n in attention_mask_BT.sum(-1)]
        return balanced_shares(costs, num_replicas)[replica]

    def split(self, attention_mask_BT: torch.Tensor) -> list[list[int]]:
        """Row indices of each micro-batch (collective over `group` with dynamic batching)."""
        B = attention_mask_BT.shape[0]
        if self.max_tokens is None:
            return [list(range(s, min(s + self.size, B))) for s in range(0, B, self.size)]
        lengths = [self.layout.token_cost(int(n)) for n in attention_mask_BT.sum(-1)]
        longest = max(lengths, default=0)
        # [micro-batches needed, longest sample, fewest samples (negated)], agreed over the group BEFORE
        # any rank may raise, so an error stops every rank instead of leaving the others in a collective
        need = count_micro_batches(lengths, self.max_tokens) if longest <= self.max_tokens else 1
        agreed = torch.tensor([need, longest, -B])
        if self.group is not None:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        count, longest, fewest = int(agreed[0]), int(agreed[1]), -int(agreed[2])
        if longest > self.max_tokens:
            raise ValueError(f"{self.flag} {self.max_tokens} is below a sample of {longest} tokens per rank; "
                             f"raise it to at least {longest} (prompt + response, / --ring_attn_size)")
        if fewest < count:
            raise RuntimeError(f"a rank holds {fewest} samples but the group runs {count} micro-batches: the ranks "
                               "of one role must hold the same number of samples")
        return split_into_micro_batches(lengths, self.max_tokens, count)


def balanced_shares(costs: list[int], num_shares: int) -> list[list[int]]:
    """The indices of `costs` dealt into `num_shares` shares of equal size, each in ascending order (pure). Largest
    cost first, each to the share with the smallest total that still has room (ties: the lower share). Raises as
    `shard` when the count does not split evenly."""
    shard(len(costs), num_shares, 0)  # the same refusal as a contiguous split's
    size = len(costs) // num_shares
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    totals = [0] * num_shares
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        open_share = min((s for s in range(num_shares) if len(shares[s]) < size), key=lambda s: (totals[s], s))
        shares[open_share].append(i)
        totals[open_share] += costs[i]
    return [sorted(share) for share in shares]


def trimmed(sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the columns that are padding in every row."""
    width = int(attention_mask_BT.sum(-1).max()) if attention_mask_BT.numel() else 0
    return sequences_BT[:, :width], attention_mask_BT[:, :width]


@torch.no_grad()
def forward_in_micro_batches(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sequences_BT: torch.Tensor,
                             attention_mask_BT: torch.Tensor, batcher: MicroBatcher, device: torch.device,
                             width: int | None = None) -> torch.Tensor:
    """`fn(ids, mask)` over each micro-batch (trimmed to its longest row, on `device`), put back in row
    order as float32 on the CPU: [B] when `width` is None, else [B, width] with per-token outputs
    [b, w <= width] zero-padded on the right."""
    B = sequences_BT.shape[0]
    out = torch.zeros(B) if width is None else torch.zeros(B, width)
    for rows in batcher.split(attention_mask_BT):
        ids, mask = trimmed(sequences_BT[rows], attention_mask_BT[rows])
        part = fn(ids.to(device), mask.to(device)).float().cpu()
        if width is None:
            out[rows] = part
        else:
            out[rows, :part.shape[1]] = part
    return out
