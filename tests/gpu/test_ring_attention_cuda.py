"""Ring attention on CUDA: over NCCL ranks, on one GPU in bf16, and with the flash block kernel against fp32 blocks.

Shape legend: G global packed tokens, N local tokens, H/K query/kv heads, D head dim."""

import pytest
import torch
from rlhf.kernels import (
    ring_attention,
    varlen_attention_reference,
    zigzag_shard,
)

from tests.ring_cases import CASES, case_inputs, check_against_reference, simulated_ring


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
        q, k, v, w, cu, _ = case_inputs(lengths, ring_size, num_heads, num_kv_heads, seed=i)
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
    check_against_reference(_run_on_nccl_ranks(ring_size, _nccl_ring_worker, ring_size, "float32"), ring_size)


def test_ring_attention_single_gpu_bf16():
    q, k, v, w, cu, real_G = case_inputs([5, 11, 16], 1, 4, 2, seed=3)
    q, k, v = (t.cuda().bfloat16().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, cu.cuda(), group=None)
    ref = varlen_attention_reference(q.float(), k.float(), v.float(), cu.cuda())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("ring_size", [1, 2, 4])
def test_flash_block_kernel_on_cuda_matches_fp32_blocks(ring_size):
    """The real aten flash op in every zigzag block (simulated ring on one GPU), bf16, against fp32 blocks."""
    import importlib

    ring = importlib.import_module("rlhf.kernels.ring_attention")
    lengths, num_heads, num_kv_heads = [37, 90, 128], 8, 2
    q, k, v, w, cu, real_G = case_inputs(lengths, ring_size, num_heads, num_kv_heads, seed=5)
    q, k, v, w = (torch.cat([t] * 8, dim=-1).cuda() for t in (q, k, v, w))  # head dim 64
    cu = cu.cuda()
    assert ring.block_kernel_for(q.bfloat16()).name.startswith("flash")
    flash = simulated_ring(q.bfloat16(), k.bfloat16(), v.bfloat16(), w.bfloat16(), cu, ring_size, "flash")
    exact = simulated_ring(q, k, v, w, cu, ring_size, "einsum")
    for name, got, want in zip(("out", "dq", "dk", "dv"), flash, exact):
        rows = real_G.cuda() if name == "out" else slice(None)
        err = (got[rows].float() - want[rows]).abs().max() / want[rows].abs().max()
        assert err < 2e-2, f"{name}: relative error {float(err):.3g}"
