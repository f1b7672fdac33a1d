"""Ring attention pieces in one process: the zigzag shard round trip, ring size 1 (plain attention, row tiles and
gradients), the flash block kernel's wiring against a reference op, and the block kernel choice.

Shape legend: G global packed tokens, N local tokens, H/K query/kv heads, D head dim."""

import pytest
import torch
from rlhf.kernels import (
    cu_seqlens_from_lengths,
    ring_attention,
    varlen_attention_reference,
    zigzag_indices,
    zigzag_local_cu_seqlens,
    zigzag_shard,
    zigzag_unshard,
)

from tests.ring_cases import CASES, case_inputs, simulated_ring


def test_zigzag_shard_round_trip():
    cu = cu_seqlens_from_lengths([8, 16])
    assert zigzag_indices(cu, 0, 2).tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    assert zigzag_indices(cu, 1, 2).tolist() == [2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19]
    assert zigzag_local_cu_seqlens(cu, 2).tolist() == [0, 4, 12]
    x = torch.randn(24, 3)
    torch.testing.assert_close(zigzag_unshard([zigzag_shard(x, cu, r, 2) for r in range(2)], cu), x)
    with pytest.raises(ValueError, match="multiple of 8"):
        zigzag_indices(cu_seqlens_from_lengths([8, 12]), 0, 4)


def test_ring_size_one_is_plain_attention():
    q, k, v, w, cu, _ = case_inputs([5, 11], 1, 4, 2, seed=7)
    out = ring_attention(q, k, v, cu, group=None)
    torch.testing.assert_close(out, varlen_attention_reference(q, k, v, cu), atol=1e-5, rtol=1e-5)


def test_ring_size_one_row_tiles_and_gradients(monkeypatch):
    import importlib

    ring_module = importlib.import_module("rlhf.kernels.ring_attention")  # the package attribute is the function
    monkeypatch.setattr(ring_module, "ROWS_PER_TILE", 3)  # several score tiles per block, ragged last one
    q, k, v, w, cu, _ = case_inputs([5, 11, 16], 1, 4, 2, seed=8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, cu, group=None, head_stride=1)
    ref = varlen_attention_reference(q, k, v, cu)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _reference_flash_ops():
    """A CPU stand-in with the contract of aten::_flash_attention_forward/backward (varlen, GQA, lse float32
    [H, n], causal aligned to the bottom-right corner, backward from a given output and lse), fp32 math."""

    def segments(cu_q, cu_k):
        return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())

    def scores_of(q, k, qs, qe, ks, ke, causal, scale):
        rep = q.shape[1] // k.shape[1]
        s = torch.einsum("nhd,mhd->hnm", q[qs:qe].float(), k[ks:ke].float().repeat_interleave(rep, 1)) * scale
        if causal:
            n, m = qe - qs, ke - ks
            s = s.masked_fill(torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n), float("-inf"))
        return s

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
        assert dropout == 0.0 and not debug and q.shape[-1] % 8 == 0
        rep = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
        for qs, qe, ks, ke in segments(cu_q, cu_k):
            assert qe - qs <= max_q and ke - ks <= max_k
            s = scores_of(q, k, qs, qe, ks, ke, causal, scale)
            lse[:, qs:qe] = s.logsumexp(-1)
            out[qs:qe] = torch.einsum("hnm,mhd->nhd", s.softmax(-1), v[ks:ke].float().repeat_interleave(rep, 1))
        return out.to(q.dtype), lse, torch.empty(0), torch.empty(0), torch.empty(0)

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, seed, offset, *, scale):
        rep = q.shape[1] // k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32)
        dk, dv = (torch.zeros(k.shape[0], q.shape[1], k.shape[2]) for _ in range(2))
        delta = (dout.float() * out.float()).sum(-1).T  # [H, n]
        for qs, qe, ks, ke in segments(cu_q, cu_k):
            p = (scores_of(q, k, qs, qe, ks, ke, causal, scale) - lse[:, qs:qe, None]).exp()
            do = dout[qs:qe].float()
            dv[ks:ke] = torch.einsum("hnm,nhd->mhd", p, do)
            ds = p * (torch.einsum("nhd,mhd->hnm", do, v[ks:ke].float().repeat_interleave(rep, 1))
                      - delta[:, qs:qe, None])
            dq[qs:qe] = torch.einsum("hnm,mhd->nhd", ds, k[ks:ke].float().repeat_interleave(rep, 1)) * scale
            dk[ks:ke] = torch.einsum("hnm,nhd->mhd", ds, q[qs:qe].float()) * scale
        def fold(t):  # GQA: sum over each kv head's queries
            return t.reshape(t.shape[0], k.shape[1], rep, -1).sum(2)

        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)

    return forward, backward


@pytest.mark.parametrize("ring_size", [1, 2, 4])
def test_flash_block_kernel_wiring_against_a_reference_op(monkeypatch, ring_size):
    """The flash block path (varlen boundaries of every zigzag block, lse layout, final-output backward) with a
    CPU stand-in for the aten op gives the einsum blocks' outputs and gradients over simulated rings."""
    import importlib

    flash_ops = importlib.import_module("rlhf.kernels.flash_ops")
    monkeypatch.setattr(flash_ops, "_ops", _reference_flash_ops)
    monkeypatch.setattr(flash_ops, "flash_varlen_supported", lambda q: True)
    for i, (lengths, num_heads, num_kv_heads, head_stride) in enumerate(CASES):
        q, k, v, w, cu, real_G = case_inputs(lengths, ring_size, num_heads, num_kv_heads, seed=20 + i)
        flash = simulated_ring(q, k, v, w, cu, ring_size, "flash", head_stride)
        einsum = simulated_ring(q, k, v, w, cu, ring_size, "einsum", head_stride)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = varlen_attention_reference(q, k, v, cu, causal=True)
        want = (ref.detach(), *torch.autograd.grad((ref * w).sum(), (q, k, v)))
        for name, got_f, got_e, expected in zip(("out", "dq", "dk", "dv"), flash, einsum, want):
            rows = real_G if name == "out" else slice(None)
            torch.testing.assert_close(got_e[rows], expected[rows], atol=1e-5, rtol=1e-5, msg=f"einsum {name} case {i}")
            torch.testing.assert_close(got_f[rows], expected[rows], atol=1e-5, rtol=1e-5, msg=f"flash {name} case {i}")


def test_block_kernel_choice_and_errors():
    import importlib

    ring = importlib.import_module("rlhf.kernels.ring_attention")
    assert ring.block_kernel_for(torch.zeros(1, 1, 8)).name.startswith("fp32 einsum")
    assert ring.describe_block_kernel(torch.device("cpu"), torch.bfloat16, 64).startswith("fp32 einsum")
    with pytest.raises(ValueError, match="fp16/bf16 CUDA"):
        ring.block_kernel_for(torch.zeros(1, 1, 8), "flash")
    with pytest.raises(ValueError, match="unknown ring block kernel"):
        ring.block_kernel_for(torch.zeros(1, 1, 8), "triton")


@pytest.mark.parametrize("ring_size", [2, 4])
def test_sliding_window_and_softcap_ring_equals_reference(ring_size):
    """Every rank's einsum blocks with a 5-token window and a soft-cap of 0.8 (Mistral / Gemma-2 layers), merged
    over the ring, equal the unsharded reference in output and gradients; a window of one token is the value."""
    import importlib

    lengths, window, softcap = [5, 11, 16], 5, 0.8
    q, k, v, w, cu, real_G = case_inputs(lengths, ring_size, 4, 2, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = varlen_attention_reference(q, k, v, cu, window=window, softcap=softcap)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    plain = varlen_attention_reference(q, k, v, cu)
    assert float((plain - ref).detach()[real_G].abs().max()) > 0.1  # the window and the cap both matter here
    out, *grads = simulated_ring(q.detach(), k.detach(), v.detach(), w, cu, ring_size, "einsum", window=window,
                                 softcap=softcap)
    torch.testing.assert_close(out[real_G], ref.detach()[real_G], atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    only_self, *_ = simulated_ring(q.detach(), k.detach(), v.detach(), w, cu, ring_size, "einsum", window=1)
    torch.testing.assert_close(only_self, v.detach().repeat_interleave(2, dim=1), atol=1e-6, rtol=0)
    ring_module = importlib.import_module("rlhf.kernels.ring_attention")
    with pytest.raises(ValueError, match="no sliding window or soft-cap"):
        ring_module.block_kernel_for(q, "flash", window=window)
