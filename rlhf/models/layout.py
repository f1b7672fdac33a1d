"""How a role's model sees a micro-batch: right-padded rows, all sequences packed into one padding-free
row (`--packing_samples`), or packed and sharded over a ring-attention group (`--ring_attn_size`).

Every forward of actor, critic, reward and reference model goes through `SequenceLayout.lay_out`,
and every per-token output comes back in the right-padded [B, T] layout through `LaidOut.to_padded`,
so losses and experience never depend on the layout. Shape legend: rlhf.data.records; N packed tokens,
n this rank's share of them (ring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.kernels import next_token_targets, pack_padded, unpack_to_padded, zigzag_shard, zigzag_unshard
from rlhf.models.attention import register_ring_attention, register_varlen_attention, ring_forward_kwargs


def position_ids_for(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Positions 0.. over real tokens (right padding: padding gets clamped positions)."""
    return (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class LaidOut:
    """One micro-batch ready for the model.

    kwargs:  the model call's keyword arguments.
    targets: int64, same leading shape as the model's per-token outputs: the next token of every position
             inside its own sequence (an arbitrary valid id where there is none: the last position).
    """

    kwargs: dict
    targets: torch.Tensor
    _restore: Callable[[torch.Tensor], torch.Tensor]

    def to_padded(self, per_token: torch.Tensor) -> torch.Tensor:
        """The model's per-token outputs (leading dims as `targets`) as right-padded [B, T, ...] (padding 0).
        Differentiable; with ring attention a collective over the ring (see `gather_ring`)."""
        return self._restore(per_token)


class _GatherRing(torch.autograd.Function):
    """all_gather along dim 0 in forward; backward keeps this rank's slice of the incoming gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.rows = dist.get_rank(group), local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def gather_ring(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every ring rank's rows of `local`, concatenated in rank order (collective over `group`).

    The backward hands each rank only the gradient of its own rows: correct because every rank of a ring
    computes the same loss from the gathered tensor (the ring's ranks hold the same samples), so each
    rank's parameter gradient is its share of the ring's and DeepSpeed's reduction adds the shares up.
    """
    return _GatherRing.apply(local, group)


@dataclass(frozen=True)
class SequenceLayout:
    """packing: pack the micro-batch into one row; ring_group: also shard it zigzag over this group."""

    packing: bool = False
    ring_group: dist.ProcessGroup | None = None
    ring_head_stride: int | None = None

    def __post_init__(self) -> None:
        if self.ring_group is not None and not self.packing:
            raise ValueError("ring attention shards packed sequences: it needs packing=True (--packing_samples)")

    @property
    def ring_size(self) -> int:
        return 1 if self.ring_group is None else dist.get_world_size(self.ring_group)

    def attn_implementation(self, default: str) -> str:
        """The transformers attention a model must be built with for this layout (registers ours)."""
        if self.ring_group is not None:
            return register_ring_attention()
        if self.packing:
            return register_varlen_attention()
        return default

    def token_cost(self, length: int) -> int:
        """Tokens one sequence of real `length` puts on each rank of a ring (the dynamic-batch budget unit)."""
        if self.ring_group is None:
            return length
        multiple = 2 * self.ring_size
        return -(-length // multiple) * multiple // self.ring_size

    def lay_out(self, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> LaidOut:
        B, T = sequences_BT.shape
        if not self.packing:
            targets_BT = torch.roll(sequences_BT, shifts=-1, dims=1)
            kwargs = {"input_ids": sequences_BT, "attention_mask": attention_mask_BT,
                      "position_ids": position_ids_for(attention_mask_BT), "use_cache": False}
            return LaidOut(kwargs, targets_BT, lambda x: x)
        if self.ring_group is None:
            packed = pack_padded(sequences_BT, attention_mask_BT)
            return LaidOut(packed.forward_kwargs(), next_token_targets(packed),
                           lambda x: unpack_to_padded(x, packed, T))
        group, size = self.ring_group, self.ring_size
        packed = pack_padded(sequences_BT, attention_mask_BT, pad_to_multiple_of=2 * size)
        targets = zigzag_shard(next_token_targets(packed), packed.cu_seqlens, dist.get_rank(group), size, dim=1)

        def restore(local: torch.Tensor) -> torch.Tensor:
            shards = gather_ring(local[0], group).chunk(size)
            return unpack_to_padded(zigzag_unshard(list(shards), packed.cu_seqlens), packed, T)

        return LaidOut(ring_forward_kwargs(packed, group, self.ring_head_stride), targets, restore)


PADDED = SequenceLayout()
