"""Attention over packed variable-length sequences with explicit boundaries (`cu_seqlens`): flash-attn's
varlen kernel on CUDA when it is installed, else PyTorch's built-in FlashAttention-2 varlen kernel
(`flash_ops`) on fp16/bf16 CUDA tensors, an exact per-segment SDPA loop anywhere else, and a naive
block-diagonal reference. It does not know about models, masks from position ids or process groups.

Two variants the model families need: `window` (sliding-window attention, transformers' meaning: query i sees
keys i - window + 1 .. i of its segment; Mistral, Gemma-2/3, Qwen2's optional window) and `softcap` (Gemma-2's
logit soft-capping, scores -> softcap * tanh(scores / softcap) before the softmax). flash-attn's kernel takes
both; PyTorch's built-in flash kernel takes neither here, so with either set "auto" runs flash-attn where it can
and the SDPA loop (a masked segment, or explicit scores under a soft-cap) elsewhere.

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
    if cu_seqlens.device.type != "cpu":  # reading a device tensor would stall the host once per layer
        return
    if int(cu_seqlens[-1]) != q_NHD.shape[0] or int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must run from 0 to the {q_NHD.shape[0]} packed tokens, got {cu_seqlens.tolist()}")


def check_attention_variants(window: int | None, softcap: float | None, causal: bool) -> None:
    """Refuses a sliding window that is not positive or not causal, and a soft-cap that is not positive."""
    if window is not None and (window <= 0 or not causal):
        raise ValueError(f"sliding window {window}: needs a positive window and causal attention")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"soft-cap {softcap}: must be positive (None: no soft-capping)")


def varlen_attention(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, causal: bool = True, scale: float | None = None,
                     backend: str = "auto", window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Softmax attention inside each packed segment; returns [N, H, D] in q's dtype.

    backend "auto" uses flash-attn for fp16/bf16 CUDA tensors when flash_attn imports, else torch's own flash
    kernel where it supports the tensors (`flash_ops.flash_varlen_supported`), and the SDPA loop otherwise
    (fp32, CPU, pre-Ampere); "flash", "torch_flash" and "sdpa" force one of them (`varlen_backend_for`).
    window / softcap: sliding-window attention and logit soft-capping (module docstring); None = off.
    """
    _check_inputs(q_NHD, k_NKD, v_NKD, cu_seqlens)
    check_attention_variants(window, softcap, causal)
    chosen = varlen_backend_for(q_NHD, backend, variants=window is not None or softcap is not None)
    cu = cu_seqlens.to(device=q_NHD.device, dtype=torch.int32)
    if chosen == "flash":
        return flash_attn_varlen_func(q_NHD, k_NKD, v_NKD, cu, cu, max_seqlen, max_seqlen, dropout_p=0.0,
                                      softmax_scale=scale, causal=causal,
                                      window_size=(window - 1, 0) if window is not None else (-1, -1),
                                      softcap=softcap or 0.0)
    if chosen == "torch_flash":  # differentiable: autograd calls the op's registered backward
        scale = 1.0 / math.sqrt(q_NHD.shape[-1]) if scale is None else scale
        return flash_ops.flash_varlen_forward(q_NHD, k_NKD, v_NKD, cu, cu, max_seqlen, max_seqlen, causal, scale)[0]
    return varlen_attention_sdpa(q_NHD, k_NKD, v_NKD, cu_seqlens, causal=causal, scale=scale, window=window,
                                 softcap=softcap)


def varlen_backend_for(q_NHD: torch.Tensor, backend: str = "auto", variants: bool = False) -> str:
    """The backend `varlen_attention` runs for tensors like q: "flash", "torch_flash" or "sdpa".
    variants: a sliding window or soft-cap is set (torch's built-in flash kernel is then not a choice)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown varlen attention backend {backend!r}; choose one of {BACKENDS}")
    flash_ok = flash_attn_varlen_func is not None and q_NHD.is_cuda and q_NHD.dtype in (torch.float16, torch.bfloat16)
    if backend == "flash" and not flash_ok:
        raise ValueError("backend='flash' needs flash_attn installed and fp16/bf16 CUDA tensors")
    torch_flash_ok = flash_ops.flash_varlen_supported(q_NHD) and not variants
    if backend == "torch_flash" and not torch_flash_ok:
        raise ValueError("backend='torch_flash' needs fp16/bf16 CUDA tensors on an Ampere or newer GPU, head dim a "
                         "multiple of 8 up to 256, and no sliding window or soft-cap")
    if backend != "auto":
        return backend
    return "flash" if flash_ok else "torch_flash" if torch_flash_ok else "sdpa"


def visible_keys(length: int, causal: bool, window: int | None, device: torch.device) -> torch.Tensor | None:
    """bool [L, L] keys each query of an L-token segment sees (None: all, or plain causal left to the kernel)."""
    if window is None:
        return None
    pos = torch.arange(length, device=device)
    distance = pos[:, None] - pos[None, :]
    return (distance >= 0) & (distance < window) if causal else distance.abs() < window


def _softcapped_attention(q_HLD: torch.Tensor, k_KLD: torch.Tensor, v_KLD: torch.Tensor, causal: bool,
                          scale: float, softcap: float, visible_LL: torch.Tensor | None) -> torch.Tensor:
    """Explicit scores for one segment: softcap * tanh(q.k * scale / softcap), masked, softmax (float32)."""
    rep = q_HLD.shape[0] // k_KLD.shape[0]
    k_HLD, v_HLD = (t.repeat_interleave(rep, dim=0) for t in (k_KLD, v_KLD))
    scores_HLL = torch.tanh(torch.matmul(q_HLD.float(), k_HLD.float().transpose(1, 2)) * (scale / softcap)) * softcap
    if visible_LL is None and causal:
        visible_LL = torch.ones(scores_HLL.shape[-2:], dtype=torch.bool, device=q_HLD.device).tril()
    if visible_LL is not None:
        scores_HLL = scores_HLL.masked_fill(~visible_LL, float("-inf"))
    return torch.matmul(scores_HLL.softmax(-1), v_HLD.float()).to(q_HLD.dtype)


def varlen_attention_sdpa(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cu_seqlens: torch.Tensor,
                          causal: bool = True, scale: float | None = None, window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """Exact on any device: one `scaled_dot_product_attention` call per segment (a Python loop over S); with a
    window, each segment's call takes its window mask; with a soft-cap, the segment's scores are explicit.

    The segments are cut with one `split` (its backward is one `cat` of the segments' gradients, where S slices
    would each fill a zero tensor of all N tokens and add it), and each call gets 4-D [1, H, L, D] views: on CPU
    that is the shape PyTorch's fused flash kernel takes (3-D inputs fall back to the unfused math path)."""
    _check_inputs(q_NHD, k_NKD, v_NKD, cu_seqlens)
    check_attention_variants(window, softcap, causal)
    enable_gqa = q_NHD.shape[1] != k_NKD.shape[1]
    scale_value = 1.0 / math.sqrt(q_NHD.shape[-1]) if scale is None else scale
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outs = []
    for segment in zip(*(t.split(lengths) for t in (q_NHD, k_NKD, v_NKD))):
        q_HLD, k_KLD, v_KLD = (t.transpose(0, 1) for t in segment)
        visible_LL = visible_keys(q_HLD.shape[1], causal, window, q_NHD.device)
        if softcap is not None:
            o_HLD = _softcapped_attention(q_HLD, k_KLD, v_KLD, causal, scale_value, softcap, visible_LL)
        else:
            o_HLD = F.scaled_dot_product_attention(q_HLD[None], k_KLD[None], v_KLD[None], attn_mask=visible_LL,
                                                   is_causal=causal and visible_LL is None, scale=scale,
                                                   enable_gqa=enable_gqa)[0]
        outs.append(o_HLD.transpose(0, 1))
    return torch.cat(outs)


def varlen_attention_reference(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor,
                               cu_seqlens: torch.Tensor, causal: bool = True,
                               scale: float | None = None, window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor:
    """Naive float32 softmax over the whole packed row with a block-diagonal (and causal, windowed) mask."""
    _check_inputs(q_NHD, k_NKD, v_NKD, cu_seqlens)
    check_attention_variants(window, softcap, causal)
    N, H, D = q_NHD.shape
    rep = H // k_NKD.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k_NHD, v_NHD = (t.float().repeat_interleave(rep, dim=1) for t in (k_NKD, v_NKD))
    scores_HNN = torch.einsum("qhd,khd->hqk", q_NHD.float(), k_NHD) * scale
    if softcap is not None:
        scores_HNN = torch.tanh(scores_HNN / softcap) * softcap
    seg_N = segment_ids_from_cu(cu_seqlens.to(q_NHD.device))
    visible_NN = seg_N[:, None] == seg_N[None, :]
    pos_N = torch.arange(N, device=q_NHD.device)
    if causal:
        visible_NN &= pos_N[None, :] <= pos_N[:, None]
    if window is not None:
        visible_NN &= pos_N[:, None] - pos_N[None, :] < window
    probs_HNN = scores_HNN.masked_fill(~visible_NN, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs_HNN, v_NHD).to(q_NHD.dtype)
