"""Packing variable-length sequences into one token stream with explicit boundaries, and unpacking
per-token results back to the right-padded layout. It knows nothing about models or attention.

Shape legend: B batch rows, T padded positions, S sequences, N packed tokens (sum of packed lengths).
`cu_seqlens` is always int32 [S + 1], starting at 0, giving segment boundaries in the packed stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedBatch:
    """S sequences packed into one row of N tokens.

    input_ids_1N:    int64 [1, N]  tokens of every sequence back to back (segments may end in padding)
    position_ids_1N: int64 [1, N]  position inside its own sequence, restarting at 0 per segment
    cu_seqlens:      int32 [S + 1] segment boundaries in the packed stream (padded lengths)
    seqlens:         tuple of S ints, the real (unpadded) length of every sequence
    max_seqlen:      int, longest segment (padded length), as flash-attn's `max_seqlen` wants it

    A segment is longer than its sequence only when packing was asked to pad every segment to a
    multiple (ring attention needs multiples of 2 * ring size); padding tokens sit at the segment end,
    so under causal attention they never influence the real tokens.
    """

    input_ids_1N: torch.Tensor
    position_ids_1N: torch.Tensor
    cu_seqlens: torch.Tensor
    seqlens: tuple[int, ...]
    max_seqlen: int

    @property
    def num_sequences(self) -> int:
        return len(self.seqlens)

    @property
    def num_tokens(self) -> int:
        """Packed tokens N, padding included."""
        return self.input_ids_1N.shape[1]

    def forward_kwargs(self) -> dict:
        """Keyword arguments for a transformers model running the `rlhf_varlen` attention (explicit
        boundaries; `attention_mask` stays None and the KV cache off)."""
        return {"input_ids": self.input_ids_1N, "position_ids": self.position_ids_1N, "attention_mask": None,
                "use_cache": False, "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen}


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def cu_seqlens_from_lengths(lengths: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """int32 [S + 1] cumulative boundaries 0, l0, l0 + l1, ..."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    if len(lengths):
        cu[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int32, device=device), 0)
    return cu


def seqlens_from_cu(cu_seqlens: torch.Tensor) -> list[int]:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


def max_seqlen_from_cu(cu_seqlens: torch.Tensor) -> int:
    """Longest segment described by `cu_seqlens` (0 when there are none)."""
    return max(seqlens_from_cu(cu_seqlens), default=0)


def position_ids_from_cu(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [N]: 0, 1, ... restarting at every segment start."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def segment_ids_from_cu(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [N]: index of the segment every packed token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.arange(len(lengths), device=cu_seqlens.device).repeat_interleave(lengths)


def pack_sequences(sequences: Sequence[torch.Tensor], pad_to_multiple_of: int = 1,
                   pad_token_id: int = 0) -> PackedBatch:
    """Pack 1-D token tensors into one row; each segment is padded at its end to `pad_to_multiple_of`."""
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    if any(seq.dim() != 1 or seq.numel() == 0 for seq in sequences):
        raise ValueError("pack_sequences takes non-empty 1-D token tensors")
    seqlens = tuple(int(seq.numel()) for seq in sequences)
    padded = [round_up(n, pad_to_multiple_of) for n in seqlens]
    pieces = []
    for seq, n_pad in zip(sequences, padded):
        pieces.append(seq)
        if n_pad > seq.numel():
            pieces.append(seq.new_full((n_pad - seq.numel(),), pad_token_id))
    cu_seqlens = cu_seqlens_from_lengths(padded, device=sequences[0].device)
    return PackedBatch(input_ids_1N=torch.cat(pieces)[None], position_ids_1N=position_ids_from_cu(cu_seqlens)[None],
                       cu_seqlens=cu_seqlens, seqlens=seqlens, max_seqlen=max(padded))


def right_padded_lengths(attention_mask_BT: torch.Tensor) -> list[int]:
    """Real lengths of a right-padded batch; ValueError if a row's mask is not 1...1 0...0 or is empty."""
    mask = attention_mask_BT.bool()
    lengths = mask.sum(-1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None] < lengths[:, None]
    if not torch.equal(mask, prefix):
        raise ValueError("attention_mask must be right-padded (ones then zeros per row) to pack it")
    if bool((lengths == 0).any()):
        raise ValueError("attention_mask has an all-zero row: every row needs at least one real token")
    return lengths.tolist()


def pack_padded(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, pad_to_multiple_of: int = 1,
                pad_token_id: int = 0) -> PackedBatch:
    """Pack the real tokens of a right-padded [B, T] batch (mask 1 = real token)."""
    lengths = right_padded_lengths(attention_mask_BT)
    return pack_sequences([row[:n] for row, n in zip(input_ids_BT, lengths)], pad_to_multiple_of, pad_token_id)


def unpack_to_list(values_N: torch.Tensor, packed: PackedBatch) -> list[torch.Tensor]:
    """Split per-token values [N, ...] (or [1, N, ...]) into S tensors of the real lengths."""
    values_N = _drop_leading_one(values_N, packed)
    starts = packed.cu_seqlens[:-1].tolist()
    return [values_N[start:start + n] for start, n in zip(starts, packed.seqlens)]


def unpack_to_padded(values_N: torch.Tensor, packed: PackedBatch, padded_len: int | None = None,
                     pad_value: float = 0.0) -> torch.Tensor:
    """Per-token values [N, ...] or [1, N, ...] -> right-padded [S, T, ...] (differentiable)."""
    values_N = _drop_leading_one(values_N, packed)
    T = padded_len if padded_len is not None else max(packed.seqlens)
    if T < max(packed.seqlens):
        raise ValueError(f"padded_len={T} is shorter than the longest sequence ({max(packed.seqlens)})")
    gather_idx, valid_BT = _padded_gather_index(packed, T, values_N.device)
    out = values_N[gather_idx.clamp(max=values_N.shape[0] - 1)]
    valid = valid_BT.reshape(valid_BT.shape + (1,) * (values_N.dim() - 1))
    return torch.where(valid, out, torch.full_like(out, pad_value))


def _padded_gather_index(packed: PackedBatch, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    starts_B = packed.cu_seqlens[:-1].to(device=device, dtype=torch.long)
    lengths_B = torch.tensor(packed.seqlens, device=device)
    offsets_T = torch.arange(T, device=device)
    return starts_B[:, None] + offsets_T[None], offsets_T[None] < lengths_B[:, None]


def _drop_leading_one(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == packed.num_tokens:
        values = values[0]
    if values.shape[0] != packed.num_tokens:
        raise ValueError(f"expected {packed.num_tokens} packed tokens, got a tensor of shape {tuple(values.shape)}")
    return values


def next_token_targets(packed: PackedBatch, fill_token_id: int = 0) -> torch.Tensor:
    """int64 [1, N]: the token that follows each packed token inside its own segment.

    The last token of every segment has no successor and gets `fill_token_id`; its log-prob is
    meaningless, as is the last position of a right-padded row.
    """
    targets_N = torch.roll(packed.input_ids_1N[0], shifts=-1)
    targets_N[packed.cu_seqlens[1:].long() - 1] = fill_token_id
    return targets_N[None]
