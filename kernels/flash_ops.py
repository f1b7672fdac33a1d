"""PyTorch's built-in FlashAttention-2 variable-length kernels (`aten::_flash_attention_forward` and
`_flash_attention_backward`, the FlashAttention-2 code vendored into every CUDA build of torch) as block
kernels: the forward returns the log-sum-exp that ring attention merges blocks with, and the backward takes
an output and log-sum-exp from outside (the ring passes the final, all-block ones, so each block's gradient
is its share of the whole row's). Needs no flash-attn package.

Measured on torch 2.11 (H100, benchmarks/gpu_smoke.sh `flash_block_kernel`): the varlen log-sum-exp is
float32 [H, total_q]; outputs match an fp32 reference to bf16 rounding. Shapes: q [n, H, D], k/v [m, K, D]
with H % K == 0 (query head h reads kv head h // (H / K)), cu_seqlens int32 [S + 1] on q's device.
"""

from __future__ import annotations

import torch

_MIN_CAPABILITY = (8, 0)  # FlashAttention-2: Ampere and newer


def _ops():
    """(forward, backward): the aten ops; a test substitutes a CPU reference with the same contract."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


def flash_varlen_supported(q: torch.Tensor) -> bool:
    """Whether the built-in flash kernel can take q (and k/v of the same dtype and head dim)."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 256 or not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    return bool(available()) and torch.cuda.get_device_capability(q.device) >= _MIN_CAPABILITY


def flash_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                         max_q: int, max_k: int, causal: bool, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(output [n, H, D] in q's dtype, log-sum-exp float32 [H, n], rng state for the backward). With causal,
    query i of a segment sees keys 0..i of the same segment (use it only where cu_q == cu_k)."""
    forward, _ = _ops()
    out, lse, seed, offset, _ = forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
    return out, lse, (seed, offset)


def flash_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                          causal: bool, scale: float, rng: tuple[torch.Tensor, torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's dtype given the output and log-sum-exp the softmax is normalised by (out in q's
    dtype, lse float32 [H, n]); delta = rowsum(dout * out) is formed inside the kernel."""
    _, backward = _ops()
    dq, dk, dv = backward(dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), cu_q, cu_k, max_q, max_k,
                          0.0, causal, rng[0], rng[1], scale=scale)
    return dq, dk, dv
