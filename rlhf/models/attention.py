"""Hooks the packed varlen attention and the ring (context-parallel) attention of `rlhf.kernels` into
transformers' attention interface. Sequence boundaries and the ring's process group are always passed
explicitly as model(**kwargs); they are never inferred from position ids, masks or module globals.

Shape legend: B batch (1 for packed input), N packed (or local) tokens, H query heads, K kv heads,
D head dim.
Packed:  `register_varlen_attention()`, build the model with `attn_implementation="rlhf_varlen"`, call it
         with `**packed.forward_kwargs()` (see `rlhf.kernels.PackedBatch`).
Ring:    `register_ring_attention()`, `attn_implementation="rlhf_ring"`, call it on every rank of the
         sequence-parallel group with `**ring_forward_kwargs(packed, group)` (pack with
         `pad_to_multiple_of=2 * ring size`); outputs are this rank's zigzag shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AttentionInterface

from rlhf.kernels import PackedBatch, ring_attention, varlen_attention, zigzag_shard

VARLEN_ATTENTION = "rlhf_varlen"
RING_ATTENTION = "rlhf_ring"


# attention arguments of some families that change the math and that these kernels do not implement
UNSUPPORTED_VARIANTS = {"s_aux": "attention sinks", "sinks": "attention sinks"}


def _check_packed_call(module: torch.nn.Module, name: str, query_BHND: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float,
                       kwargs: dict) -> torch.Tensor:
    """Validate what both packed attention functions need; returns cu_seq_lens_q."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        raise ValueError(f"attn_implementation={name!r} needs explicit sequence boundaries: call the model with "
                         "cu_seq_lens_q=... (PackedBatch.forward_kwargs() or ring_forward_kwargs())")
    cu_seqlens_k = kwargs.get("cu_seq_lens_k")
    if cu_seqlens_k is not None and cu_seqlens_k is not cu_seqlens and not torch.equal(cu_seqlens_k, cu_seqlens):
        raise ValueError(f"{name} attention supports self-attention only (cu_seq_lens_k == cu_seq_lens_q)")
    if query_BHND.shape[0] != 1:
        raise ValueError(f"packed input must be one row [1, N], got batch size {query_BHND.shape[0]}")
    if attention_mask is not None:
        raise ValueError("pass attention_mask=None with packed input; boundaries come from cu_seq_lens_q")
    if dropout:
        raise ValueError(f"{name} attention has no dropout; set attention_dropout=0 in the model config")
    for key, what in UNSUPPORTED_VARIANTS.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"{name} attention does not implement {what} ({module.__class__.__name__} passes "
                             f"{key}=...); train this model without --packing_samples / --ring_attn_size")
    return cu_seqlens


def _variants(kwargs: dict) -> dict:
    """The sliding window and logit soft-cap a layer passes (transformers' `sliding_window`, `softcap`)."""
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    return {"window": int(window) if window is not None else None,
            "softcap": float(softcap) if softcap is not None else None}


def varlen_attention_forward(module: torch.nn.Module, query_BHND: torch.Tensor, key_BKND: torch.Tensor,
                             value_BKND: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: packed [1, H, N, D] inputs -> [1, N, H, D] output, no weights.

    Needs `cu_seq_lens_q` (int32 [S + 1]) in kwargs; `sliding_window` and `softcap` (what Mistral, Gemma-2/3 and
    windowed Qwen2 layers pass) are applied; `max_length_q` is optional (without it, it is computed
    from the boundaries: a host sync per layer on CUDA). `attention_mask` must be None.
    """
    cu_seqlens = _check_packed_call(module, VARLEN_ATTENTION, query_BHND, attention_mask, dropout, kwargs)
    max_seqlen = kwargs.get("max_length_q")
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    q_NHD, k_NKD, v_NKD = (t[0].transpose(0, 1) for t in (query_BHND, key_BKND, value_BKND))
    out_NHD = varlen_attention(q_NHD, k_NKD, v_NKD, cu_seqlens, int(max_seqlen),
                               causal=getattr(module, "is_causal", True), scale=scaling, **_variants(kwargs))
    return out_NHD[None], None


def register_varlen_attention(name: str = VARLEN_ATTENTION) -> str:
    """Register `varlen_attention_forward` under `name` (idempotent); returns the name for `attn_implementation`."""
    AttentionInterface.register(name, varlen_attention_forward)
    return name


def ring_attention_forward(module: torch.nn.Module, query_BHND: torch.Tensor, key_BKND: torch.Tensor,
                           value_BKND: torch.Tensor, attention_mask: torch.Tensor | None,
                           scaling: float | None = None, dropout: float = 0.0,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function over a zigzag shard: [1, H, N, D] -> [1, N, H, D], no weights.

    Needs kwargs `ring_group` (the sequence-parallel ProcessGroup) and `cu_seq_lens_q` (the GLOBAL packed
    boundaries); optional `ring_head_stride` (kv heads per ring pass). Collective over `ring_group`.
    """
    cu_seqlens = _check_packed_call(module, RING_ATTENTION, query_BHND, attention_mask, dropout, kwargs)
    if "ring_group" not in kwargs:
        raise ValueError(f"attn_implementation={RING_ATTENTION!r} needs ring_group=<sequence-parallel group> "
                         "in the model call (ring_forward_kwargs())")
    q_NHD, k_NKD, v_NKD = (t[0].transpose(0, 1) for t in (query_BHND, key_BKND, value_BKND))
    out_NHD = ring_attention(q_NHD, k_NKD, v_NKD, cu_seqlens, kwargs["ring_group"],
                             causal=getattr(module, "is_causal", True), scale=scaling,
                             head_stride=kwargs.get("ring_head_stride"), layout_cache=kwargs.get("ring_layout_cache"),
                             **_variants(kwargs))
    return out_NHD[None], None


def register_ring_attention(name: str = RING_ATTENTION) -> str:
    """Register `ring_attention_forward` under `name` (idempotent); returns the name for `attn_implementation`."""
    AttentionInterface.register(name, ring_attention_forward)
    return name


def ring_forward_kwargs(packed: PackedBatch, group: dist.ProcessGroup | None,
                        head_stride: int | None = None) -> dict:
    """Model kwargs for this rank of `group`: its zigzag shard of tokens and positions, the global
    boundaries and the group. `packed` must be identical on every rank of the group."""
    ring_size, rank = dist.get_world_size(group), dist.get_rank(group)
    input_ids_1N, position_ids_1N = (zigzag_shard(t, packed.cu_seqlens, rank, ring_size, dim=1)
                                     for t in (packed.input_ids_1N, packed.position_ids_1N))
    return {"input_ids": input_ids_1N, "position_ids": position_ids_1N, "attention_mask": None, "use_cache": False,
            "cu_seq_lens_q": packed.cu_seqlens, "cu_seq_lens_k": packed.cu_seqlens, "ring_group": group,
            "ring_head_stride": head_stride, "ring_layout_cache": {}}
