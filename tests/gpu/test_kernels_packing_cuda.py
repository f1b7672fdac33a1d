"""flash-attn's and torch's flash varlen kernels on CUDA equal the varlen reference (with gradients).

Shape legend: N packed tokens, H/K query/kv heads, D head dim."""

import pytest
import torch
from rlhf.kernels import (
    cu_seqlens_from_lengths,
    varlen_attention,
    varlen_attention_reference,
    varlen_attention_sdpa,
)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_flash_attn_varlen_matches_reference(num_kv_heads):
    pytest.importorskip("flash_attn")
    lengths = [37, 5, 120, 64]
    cu_seqlens = cu_seqlens_from_lengths(lengths, device="cuda")
    g = torch.Generator().manual_seed(num_kv_heads)
    N = sum(lengths)
    q = torch.randn(N, 4, 64, generator=g).cuda().bfloat16().requires_grad_()
    k, v = (torch.randn(N, num_kv_heads, 64, generator=g).cuda().bfloat16().requires_grad_() for _ in range(2))
    out = varlen_attention(q, k, v, cu_seqlens, max(lengths), backend="flash")
    ref = varlen_attention_reference(q.float(), k.float(), v.float(), cu_seqlens)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    grads_ref = torch.autograd.grad(varlen_attention_sdpa(q.float(), k.float(), v.float(), cu_seqlens).sum(),
                                    (q, k, v))
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


def test_torch_flash_varlen_matches_reference_with_gradients():
    """PyTorch's built-in flash varlen kernel (what runs without the flash-attn package) against the fp32
    reference, outputs and dq/dk/dv, GQA."""
    from rlhf.kernels.varlen_attention import varlen_backend_for

    lengths = [37, 5, 120, 64]
    cu = cu_seqlens_from_lengths(lengths).cuda()
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(sum(lengths), h, 64, generator=g).cuda() for h in (8, 2, 2, 8))
    assert varlen_backend_for(q.bfloat16()) in ("flash", "torch_flash")
    got_in = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    got = varlen_attention(*got_in, cu, max(lengths), backend="torch_flash")
    got_grads = torch.autograd.grad((got.float() * w).sum(), got_in)
    ref_in = [t.requires_grad_() for t in (q, k, v)]
    ref = varlen_attention_reference(*ref_in, cu)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_in)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    for a, b in zip(got_grads, ref_grads):
        assert float((a.float() - b).abs().max() / b.abs().max()) < 2e-2


def test_packed_attention_on_cuda_never_stalls_the_host():
    """A packed forward calls the kernel once per layer: on CUDA it must not read cu_seqlens back to the host (each
    read stalls the CPU until the GPU has caught up, once per layer and micro-batch)."""
    lengths = [37, 5, 120, 64]
    cu = cu_seqlens_from_lengths(lengths).cuda()
    q, k, v = (torch.randn(sum(lengths), h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        varlen_attention(q, k, v, cu, max(lengths))
    finally:
        torch.cuda.set_sync_debug_mode("default")
