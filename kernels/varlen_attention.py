"""Attention over packed variable-length sequences with explicit boundaries (`cu_seqlens`): flash-attn's
varlen kernel on CUDA when it is installed, else PyTorch's built-in FlashAttention-2 varlen kernel
(`flash_ops`) on fp16/bf16 CUDA tensors, an exact per-segment SDPA loop anywhere else, and a naive
block-diagonal reference. It does not know about models, masks from position ids or process groups.

Shape legend: N packed tokens, H query heads, K key/value heads (H % K == 0, grouped-query attention
shares each kv head among H // K consecutive query heads), D head dim, S sequences.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import flash_ops
from .packing import segment_ids_from_cu

try:  # flash-attn needs CUDA to import; on CPU machines it is simply absent
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

BACKENDS = ("auto", "flash", "torch_flash", "sdpa")


def _check_inputs(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if q_NHD.dim() != 3 or k_NKD.shape != v_NKD.shape or k_NKD.shape[0] != q_NHD.shape[0]:
        raise ValueError(f"expected q [N, H, D] and k, v [N, K, D]; got {tuple(q_NHD.shape)}, "
                         f"{tuple(k_NKD.shape)}, {tuple(v_NKD.shape)}")
    if q_NHD.shape[1] % k_NKD.shape[1]:
        raise ValueError(f"{q_NHD.shape[1]} query heads are not a multiple of {k_NKD.shape[1]} kv heads")
    if int(cu_seqlens[-1]) != q_NHD.shape[0] or int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must run from 0 to the {q_NHD.shape[0]} packed tokens, got {cu_seqlens.tolist()}")


def varlen_attention(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, causal: bool = True, scale: float | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """Softmax attention inside each packed segment; returns [N, H, D] in q's dtype.

    backend "auto" uses flash-attn for fp16/bf16 CUDA tensors when flash_attn imports, else torch's own flash
    kernel where it supports the tensors (`flash_ops.flash_varlen_supported`), and the SDPA loop otherwise
    (fp32, CPU, pre-Ampere); "flash", "torch_flash" and "sdpa" force one of them (`varlen_backend_for`).
    """
    _check_inputs(q_NHD, k_NKD, v_NKD, cu_seqlens)
    chosen = varlen_backend_for(q_NHD, backend)
    cu = cu_seqlens.to(device=q_NHD.device, dtype=torch.int32)
    if chosen == "flash":
        return flash_attn_varlen_func(q_NHD, k_NKD, v_NKD, cu, cu, max_seqlen, max_seqlen, dropout_p=0.0,
                                      softmax_scale=scale, causal=causal)
    if chosen == "torch_flash":  # differentiable: autograd calls the op's registered backward
        scale = 1.0 / math.sqrt(q_NHD.shape[-1]) if scale is None else scale
        return flash_ops.flash_varlen_forward(q_NHD, k_NKD, v_NKD, cu, cu, max_seqlen, max_seqlen, causal, scale)[0]
    return varlen_attention_sdpa(q_NHD, k_NKD, v_NKD, cu_seqlens, causal=causal, scale=scale)


def varlen_backend_for(q_NHD: torch.Tensor, backend: str = "auto") -> str:
    """The backend `varlen_attention` runs for tensors like q: "flash", "torch_flash" or "sdpa"."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown varlen attention backend {backend!r}; choose one of {BACKENDS}")
    flash_ok = flash_attn_varlen_func is not None and q_NHD.is_cuda and q_NHD.dtype in (torch.float16, torch.bfloat16)
    if backend == "flash" and not flash_ok:
        raise ValueError("backend='flash' needs flash_attn installed and fp16/bf16 CUDA tensors")
    torch_flash_ok = flash_ops.flash_varlen_supported(q_NHD)
    if backend == "torch_flash" and not torch_flash_ok:
        raise ValueError("backend='torch_flash' needs fp16/bf16 CUDA tensors on an Ampere or newer GPU, head dim a "
                         "multiple of 8 up to 256")
    if backend != "auto":
        return backend
    return "flash" if flash_ok else "torch_flash" if torch_flash_ok else "sdpa"


def varlen_attention_sdpa(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cu_seqlens: torch.Tensor,
                          causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Exact on any device: one `scaled_dot_product_attention` call per segment (a Python loop over S)."""
    _check_inputs(q_NHD, k_NKD, v_NKD, cu_seqlens)
    enable_gqa = q_NHD.shape[1] != k_NKD.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q_HLD, k_KLD, v_KLD = (t[start:end].transpose(0, 1) for t in (q_NHD, k_NKD, v_NKD))
        o_HLD = F.scaled_dot_product_attention(q_HLD, k_KLD, v_KLD, is_causal=causal, scale=scale,
                                               enable_gqa=enable_gqa)
        outs.append(o_HLD.transpose(0, 1))
    return torch.cat(outs)


def varlen_attention_reference(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor,
                               cu_seqlens: torch.Tensor, causal: bool = True,
                               scale: float | None = None) -> torch.Tensor:
    """Naive float32 softmax over the whole packed row with a block-diagonal (and causal) mask."""
    _check_inputs(q_NHD, k_NKD, v_NKD, cu_seqlens)
    N, H, D = q_NHD.shape
    rep = H // k_NKD.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k_NHD, v_NHD = (t.float().repeat_interleave(rep, dim=1) for t in (k_NKD, v_NKD))
    scores_HNN = torch.einsum("qhd,khd->hqk", q_NHD.float(), k_NHD) * scale
    seg_N = segment_ids_from_cu(cu_seqlens.to(q_NHD.device))
    visible_NN = seg_N[:, None] == seg_N[None, :]
    if causal:
        pos_N = torch.arange(N, device=q_NHD.device)
        visible_NN &= pos_N[None, :] <= pos_N[:, None]
    probs_HNN = scores_HNN.masked_fill(~visible_NN, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs_HNN, v_NHD).to(q_NHD.dtype)
