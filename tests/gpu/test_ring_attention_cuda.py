"""Ring attention over 2 and 4 gloo ranks equals unsharded varlen attention: outputs and dq, dk, dv,
for several sequence-length mixes (segments padded to a multiple of 2 * ring size), GQA and head strides;
and a tiny Llama with `rlhf_ring` attention gives the unsharded model's log-probs and gradients.

Shape legend: G global packed tokens, N local tokens, H/K query/kv heads, D head dim.
"""

import pytest
import torch
from rlhf.kernels import (
    cu_seqlens_from_lengths,
    ring_attention,
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


def _case_inputs(lengths, ring_size, num_heads, num_kv_heads, seed):
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


def _check_against_reference(per_rank_results, ring_size):
    for i, (lengths, num_heads, num_kv_heads, _) in enumerate(CASES):
        q, k, v, w, cu, real_G = _case_inputs(lengths, ring_size, num_heads, num_kv_heads, seed=i)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = varlen_attention_reference(q, k, v, cu, causal=True)
        (ref * w).sum().backward()
        got = [zigzag_unshard([rank_res[i][j] for rank_res in per_rank_results], cu) for j in range(4)]
        torch.testing.assert_close(got[0][real_G], ref.detach()[real_G], atol=1e-5, rtol=1e-5)
        for name, g, want in zip("qkv", got[1:], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name, c=i: f"d{n} case {c}: {m}")


def _nccl_entry(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    import os
    import pickle

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    try:
        result = fn(*args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def _run_on_nccl_ranks(world_size: int, fn, *args) -> list:
    """Like tests.distributed.run_on_ranks, with NCCL and one GPU per rank."""
    import os
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    from tests.distributed import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_nccl_entry, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size,
                           start_method="spawn")
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _nccl_ring_worker(ring_size: int, dtype_name: str) -> list:
    """All CASES on CUDA over the default NCCL group; returns CPU copies of local (out, dq, dk, dv)."""
    import torch.distributed as dist

    rank, dtype = dist.get_rank(), getattr(torch, dtype_name)
    results = []
    for i, (lengths, num_heads, num_kv_heads, head_stride) in enumerate(CASES):
        q, k, v, w, cu, _ = _case_inputs(lengths, ring_size, num_heads, num_kv_heads, seed=i)
        q, k, v, w = (zigzag_shard(t, cu, rank, ring_size).cuda().to(dtype) for t in (q, k, v, w))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = ring_attention(q, k, v, cu.cuda(), None, causal=True, head_stride=head_stride)
        (out.float() * w.float()).sum().backward()
        results.append(tuple(t.detach().float().cpu() for t in (out, q.grad, k.grad, v.grad)))
    return results


@pytest.mark.parametrize("ring_size", [2, 4])
def test_ring_attention_nccl(ring_size):
    if torch.cuda.device_count() < ring_size:
        pytest.skip(f"needs {ring_size} GPUs")
    _check_against_reference(_run_on_nccl_ranks(ring_size, _nccl_ring_worker, ring_size, "float32"), ring_size)


def test_ring_attention_single_gpu_bf16():
    q, k, v, w, cu, real_G = _case_inputs([5, 11, 16], 1, 4, 2, seed=3)
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, cu.cuda(), group=None)
    ref = varlen_attention_reference(q.float(), k.float(), v.float(), cu.cuda())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _simulated_ring(q, k, v, w, cu, ring_size, block_kernel, head_stride=None):
    """Every rank's ring pass of `ring_attention`, run one after the other in this process (the K/V and dK/dV
    blocks are taken from the other ranks' shards instead of being sent): global (out, dq, dk, dv) in fp32."""
    import importlib

    ring = importlib.import_module("rlhf.kernels.ring_attention")
    K, D = k.shape[1], q.shape[-1]
    scale = D ** -0.5
    shards = [[zigzag_shard(t, cu, r, ring_size) for t in (q, k, v, w)] for r in range(ring_size)]
    layouts = [ring._RingLayout.build(cu, r, ring_size, True, q.device) for r in range(ring_size)]
    kernels = [ring.block_kernel_for(q, block_kernel) for _ in range(ring_size)]
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


@pytest.mark.parametrize("ring_size", [1, 2, 4])
def test_flash_block_kernel_on_cuda_matches_fp32_blocks(ring_size):
    """The real aten flash op in every zigzag block (simulated ring on one GPU), bf16, against fp32 blocks."""
    import importlib

    ring = importlib.import_module("rlhf.kernels.ring_attention")
    lengths, num_heads, num_kv_heads = [37, 90, 128], 8, 2
    q, k, v, w, cu, real_G = _case_inputs(lengths, ring_size, num_heads, num_kv_heads, seed=5)
    q, k, v, w = (torch.cat([t] * 8, dim=-1).cuda() for t in (q, k, v, w))  # head dim 64
    cu = cu.cuda()
    assert ring.block_kernel_for(q.bfloat16()).name.startswith("flash")
    flash = _simulated_ring(q.bfloat16(), k.bfloat16(), v.bfloat16(), w.bfloat16(), cu, ring_size, "flash")
    exact = _simulated_ring(q, k, v, w, cu, ring_size, "einsum")
    for name, got, want in zip(("out", "dq", "dk", "dv"), flash, exact):
        rows = real_G.cuda() if name == "out" else slice(None)
        err = (got[rows].float() - want[rows]).abs().max() / want[rows].abs().max()
        assert err < 2e-2, f"{name}: relative error {float(err):.3g}"
