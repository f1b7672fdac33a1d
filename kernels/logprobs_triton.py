"""Fused Triton kernel for the log-prob of the target token and the entropy of softmax(logits), with an
online (chunked over the vocabulary) log-sum-exp: no float32 log-softmax is ever materialised, forward
or backward. Pure-PyTorch counterpart and reference: `logprobs.py`.

Shape legend: N rows (flattened batch * positions), V vocabulary, BLOCK_V vocabulary chunk per step.
Runs natively on CUDA. On CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1 set before
this module is imported), where fp32 is exact but bf16 is silently wrong: use it for tests only.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional; the pure-PyTorch path in logprobs.py covers every device
    triton = None

if triton is not None:

    @triton.jit
    def _logprobs_entropy_fwd_kernel(logits_ptr, targets_ptr, logprobs_ptr, entropy_ptr, lse_ptr, stride_row, V,
                                     BLOCK_V: tl.constexpr):
        """One program per row: running max m, sum s = sum exp(x - m), t = sum exp(x - m) * x."""
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        m = float("-inf")
        s = 0.0
        t = 0.0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            alpha = tl.exp(m - m_new)
            e = tl.exp(x - m_new)
            s = s * alpha + tl.sum(e, axis=0)
            t = t * alpha + tl.sum(e * tl.where(valid, x, 0.0), axis=0)  # e is 0 on padding lanes
            m = m_new
        lse = m + tl.log(s)
        target = tl.load(targets_ptr + row).to(tl.int64)
        x_target = tl.load(row_ptr + target).to(tl.float32)
        tl.store(logprobs_ptr + row, x_target - lse)
        tl.store(entropy_ptr + row, lse - t / s)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _logprobs_entropy_bwd_kernel(logits_ptr, targets_ptr, lse_ptr, entropy_ptr, dlogprobs_ptr, dentropy_ptr,
                                     dlogits_ptr, stride_row, stride_grad_row, V, BLOCK_V: tl.constexpr):
        """grad = dlogprob * (onehot - p) - dentropy * p * (log p + entropy), chunk by chunk."""
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(lse_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        g_logprob = tl.load(dlogprobs_ptr + row)
        g_entropy = tl.load(dentropy_ptr + row)
        target = tl.load(targets_ptr + row).to(tl.int64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < V
            x = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=0.0).to(tl.float32)
            logp = x - lse
            p = tl.exp(logp)
            grad = -p * (g_logprob + g_entropy * (logp + entropy))
            grad = tl.where(offs == target, grad + g_logprob, grad)
            tl.store(dlogits_ptr + row * stride_grad_row + offs, grad.to(dlogits_ptr.dtype.element_ty), mask=valid)


def _check_runnable(logits_NV: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed; use rlhf.kernels.chunked_logprobs_entropy instead")
    if not logits_NV.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton log-prob kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                           "rlhf.kernels.logprobs_triton is imported); on CPU use chunked_logprobs_entropy")


class _TritonLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, targets_N, block_v):
        N, V = logits_NV.shape
        logprobs_N, entropy_N, lse_N = (torch.empty(N, dtype=torch.float32, device=logits_NV.device) for _ in range(3))
        if N:
            _logprobs_entropy_fwd_kernel[(N,)](logits_NV, targets_N, logprobs_N, entropy_N, lse_N,
                                               logits_NV.stride(0), V, BLOCK_V=block_v)
        ctx.save_for_backward(logits_NV, targets_N, lse_N, entropy_N)
        ctx.block_v = block_v
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, dlogprobs_N, dentropy_N):
        logits_NV, targets_N, lse_N, entropy_N = ctx.saved_tensors
        N, V = logits_NV.shape
        dlogprobs_N = torch.zeros_like(lse_N) if dlogprobs_N is None else dlogprobs_N.float().contiguous()
        dentropy_N = torch.zeros_like(lse_N) if dentropy_N is None else dentropy_N.float().contiguous()
        dlogits_NV = torch.empty_like(logits_NV)
        if N:
            _logprobs_entropy_bwd_kernel[(N,)](logits_NV, targets_N, lse_N, entropy_N, dlogprobs_N, dentropy_N,
                                               dlogits_NV, logits_NV.stride(0), dlogits_NV.stride(0), V,
                                               BLOCK_V=ctx.block_v)
        return dlogits_NV, None, None


def fused_logprobs_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor,
                           block_v: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(logits)[target], entropy of softmax(logits)), both float32 with the leading shape.

    logits: [..., V] in any float dtype (read as is, math in fp32); targets: int [...] in [0, V).
    Differentiable in the logits; the gradient has the logits' dtype. block_v: power of two.
    """
    *lead, V = logits_BTV.shape
    logits_NV = logits_BTV.reshape(-1, V)
    _check_runnable(logits_NV)
    if logits_NV.stride(-1) != 1:
        logits_NV = logits_NV.contiguous()
    block_v = min(block_v, triton.next_power_of_2(V))
    logprobs_N, entropy_N = _TritonLogprobsEntropy.apply(logits_NV, targets_BT.reshape(-1).contiguous(), block_v)
    return logprobs_N.reshape(lead), entropy_N.reshape(lead)
