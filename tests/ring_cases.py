"""The ring-attention cases that the unit, dist and gpu levels share: sequence-length mixes with their head
layouts, seeded inputs for them, the check of every rank's (out, dq, dk, dv) against unsharded varlen attention,
and every rank's ring pass simulated in one process.

Shape legend: G global packed tokens, N local tokens, H/K query/kv heads, D head dim."""

import torch
from rlhf.kernels import (
    cu_seqlens_from_lengths,
    varlen_attention_reference,
    zigzag_shard,
    zigzag_unshard,
)
from rlhf.kernels.packing import round_up

# (real lengths, query heads, kv heads, head_stride)
CASES = [
    ([16], 2, 2, None),
    ([8, 24], 4, 2, None),
    ([5, 11, 16], 4, 1, None),
    ([5, 11, 16], 4, 2, 1),
]


def case_inputs(lengths, ring_size, num_heads, num_kv_heads, seed):
    """Global q, k, v [G, *, 8], output weights that ignore padding, and padded cu_seqlens."""
    padded = [round_up(n, 2 * ring_size) for n in lengths]
    cu_seqlens = cu_seqlens_from_lengths(padded)
    G = sum(padded)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(G, num_heads, 8, generator=g)
    k = torch.randn(G, num_kv_heads, 8, generator=g)
    v = torch.randn(G, num_kv_heads, 8, generator=g)
    real_G = torch.zeros(G, dtype=torch.bool)
    for start, n in zip(cu_seqlens[:-1].tolist(), lengths):
        real_G[start:start + n] = True
    w = torch.randn(G, num_heads, 8, generator=g) * real_G[:, None, None]
    return q, k, v, w, cu_seqlens, real_G


def check_against_reference(per_rank_results, ring_size):
    for i, (lengths, num_heads, num_kv_heads, _) in enumerate(CASES):
        q, k, v, w, cu, real_G = case_inputs(lengths, ring_size, num_heads, num_kv_heads, seed=i)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = varlen_attention_reference(q, k, v, cu, causal=True)
        (ref * w).sum().backward()
        got = [zigzag_unshard([rank_res[i][j] for rank_res in per_rank_results], cu) for j in range(4)]
        torch.testing.assert_close(got[0][real_G], ref.detach()[real_G], atol=1e-5, rtol=1e-5)
        for name, g, want in zip("qkv", got[1:], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name, c=i: f"d{n} case {c}: {m}")


def simulated_ring(q, k, v, w, cu, ring_size, block_kernel, head_stride=None, window=None, softcap=None):
    """Every rank's ring pass of `ring_attention`, run one after the other in this process (the K/V and dK/dV
    blocks are taken from the other ranks' shards instead of being sent): global (out, dq, dk, dv) in fp32.
    window / softcap: a sliding window and a logit soft-cap (einsum blocks)."""
    import importlib

    ring = importlib.import_module("rlhf.kernels.ring_attention")
    K, D = k.shape[1], q.shape[-1]
    scale = D ** -0.5
    shards = [[zigzag_shard(t, cu, r, ring_size) for t in (q, k, v, w)] for r in range(ring_size)]
    layouts = [ring._RingLayout.build(cu, r, ring_size, True, q.device, window) for r in range(ring_size)]
    kernels = [ring.block_kernel_for(q, block_kernel, window, softcap) for _ in range(ring_size)]
    outs, lses = [], []
    for r, (layout, kernel) in enumerate(zip(layouts, kernels)):
        q_KRND = ring._to_KRND(shards[r][0], K)
        out = torch.zeros(q_KRND.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q_KRND.shape[:3], float("-inf"), device=q.device)
        for heads in ring._head_groups(K, head_stride):
            for src in range(ring_size):
                rows, cols = layout.block(src)
                k_KMD, v_KMD = (shards[src][i].transpose(0, 1)[heads] for i in (1, 2))
                block_out, block_lse = kernel.forward(layout, src, rows, cols, q_KRND[heads][:, :, rows],
                                                      k_KMD[:, cols], v_KMD[:, cols], scale)
                sub_out, sub_lse = out[heads], lse[heads]
                ring._merge_into(sub_out, sub_lse, rows, block_out, block_lse)
                out[heads], lse[heads] = sub_out, sub_lse
        outs.append(out)
        lses.append(lse)
    grads = [[torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in shards[r][:3]]
             for r in range(ring_size)]
    for r, (layout, kernel) in enumerate(zip(layouts, kernels)):
        q_KRND = ring._to_KRND(shards[r][0], K)
        dout_KRND = ring._to_KRND(shards[r][3], K).float()
        out_KRND = outs[r].to(q.dtype)  # the saved output is in the input dtype
        delta = (dout_KRND * out_KRND.float()).sum(-1)
        for heads in ring._head_groups(K, head_stride):
            h = slice(heads.start * q.shape[1] // K, heads.stop * q.shape[1] // K)
            for src in range(ring_size):
                rows, cols = layout.block(src)
                k_KMD, v_KMD = (shards[src][i].transpose(0, 1)[heads] for i in (1, 2))
                dq, dk, dv = kernel.backward(layout, src, rows, cols, dout_KRND[heads][:, :, rows],
                                             q_KRND[heads][:, :, rows], k_KMD[:, cols], v_KMD[:, cols],
                                             out_KRND[heads][:, :, rows], lses[r][heads][:, :, rows],
                                             delta[heads][:, :, rows], scale)
                dq_NHD = torch.zeros(q_KRND.shape[2], h.stop - h.start, D, device=q.device)
                dq_NHD[rows] = ring._to_NHD(dq)
                grads[r][0][:, h] += dq_NHD
                grads[src][1][cols, heads] += dk.transpose(0, 1)
                grads[src][2][cols, heads] += dv.transpose(0, 1)
    out = zigzag_unshard([ring._to_NHD(o) for o in outs], cu)
    return (out, *(zigzag_unshard([g[i] for g in grads], cu) for i in range(3)))
