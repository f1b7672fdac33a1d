"""Compute kernels of spmd-rlhf, importable as `rlhf.kernels`. Never imports the rest of `rlhf`.

Each function here has a plain-PyTorch reference that runs on CPU. The Triton log-prob kernel is
imported lazily (on first use of its names), so `import rlhf.kernels` never imports triton.
"""

from .distill import kd_loss_chunked, kd_loss_reference
from .dynamic_batch import (
    balanced_micro_batches,
    count_micro_batches,
    dynamic_micro_batches,
    first_fit_decreasing,
    partition_across_ranks,
    split_into_micro_batches,
)
from .logprobs import (
    chunked_logprobs_entropy,
    token_entropy,
    token_entropy_reference,
    token_logprobs,
    token_logprobs_reference,
)
from .packing import (
    PackedBatch,
    cu_seqlens_from_lengths,
    max_seqlen_from_cu,
    next_token_targets,
    pack_padded,
    pack_sequences,
    position_ids_from_cu,
    segment_ids_from_cu,
    seqlens_from_cu,
    unpack_to_list,
    unpack_to_padded,
)
from .ring_attention import (
    check_zigzag_lengths,
    ring_attention,
    zigzag_indices,
    zigzag_local_cu_seqlens,
    zigzag_shard,
    zigzag_unshard,
)
from .varlen_attention import varlen_attention, varlen_attention_reference, varlen_attention_sdpa

__all__ = [
    "PackedBatch",
    "balanced_micro_batches",
    "check_zigzag_lengths",
    "chunked_logprobs_entropy",
    "count_micro_batches",
    "cu_seqlens_from_lengths",
    "dynamic_micro_batches",
    "first_fit_decreasing",
    "fused_logprobs_entropy",
    "kd_loss_chunked",
    "kd_loss_reference",
    "max_seqlen_from_cu",
    "next_token_targets",
    "pack_padded",
    "pack_sequences",
    "partition_across_ranks",
    "position_ids_from_cu",
    "ring_attention",
    "segment_ids_from_cu",
    "seqlens_from_cu",
    "split_into_micro_batches",
    "token_entropy",
    "token_entropy_reference",
    "token_logprobs",
    "token_logprobs_reference",
    "unpack_to_list",
    "unpack_to_padded",
    "varlen_attention",
    "varlen_attention_reference",
    "varlen_attention_sdpa",
    "zigzag_indices",
    "zigzag_local_cu_seqlens",
    "zigzag_shard",
    "zigzag_unshard",
]

_LAZY = {"fused_logprobs_entropy": "logprobs_triton"}  # imports triton: only on first use


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
