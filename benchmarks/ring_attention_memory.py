"""Per-rank activation memory of ring attention (forward + backward) at ring sizes 1, 2 and 4, on gloo
processes on CPU: bytes saved for the backward, and the peak allocated during forward + backward.

Run: python benchmarks/ring_attention_memory.py [--lengths 1024 512 256 256] [--heads 8 --kv-heads 2]
Shape legend: G global packed tokens, N local tokens, H/K query/kv heads, D head dim.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from memory_tracking import mib, peak_allocated_bytes, saved_for_backward_bytes, warm_up_profiler
from rlhf.kernels import cu_seqlens_from_lengths, ring_attention, varlen_attention_sdpa, zigzag_shard


def _global_inputs(args):
    cu_seqlens = cu_seqlens_from_lengths(args.lengths)
    G = int(cu_seqlens[-1])
    g = torch.Generator().manual_seed(0)
    q_GHD = torch.randn(G, args.heads, args.head_dim, generator=g)
    k_GKD, v_GKD = (torch.randn(G, args.kv_heads, args.head_dim, generator=g) for _ in range(2))
    return cu_seqlens, q_GHD, k_GKD, v_GKD


def _measure(attention, q, k, v) -> dict:
    """Saved-for-backward bytes, peak allocated over forward + backward, and seconds of one step."""
    def step():
        out, saved = saved_for_backward_bytes(lambda: attention(q, k, v))
        out.sum().backward()
        q.grad = k.grad = v.grad = None
        return saved

    saved = step()  # also warms up the ring's communication
    start = time.perf_counter()
    peak = peak_allocated_bytes(step)
    return {"saved": saved, "peak": peak, "seconds": time.perf_counter() - start}


def _worker(rank: int, ring_size: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ring_size)
    group = dist.new_group(list(range(ring_size)))  # explicit sequence-parallel group
    cu_seqlens, *global_qkv = _global_inputs(args)
    q, k, v = (zigzag_shard(t, cu_seqlens, rank, ring_size).requires_grad_() for t in global_qkv)
    warm_up_profiler()
    row = _measure(lambda q, k, v: ring_attention(q, k, v, cu_seqlens, group, head_stride=args.head_stride), q, k, v)
    if ring_size == 1:
        row["sdpa"] = _measure(lambda q, k, v: varlen_attention_sdpa(q, k, v, cu_seqlens), q, k, v)
    results.put((rank, row))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ring(ring_size: int, args) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(ring_size, _free_port(), args, results), nprocs=ring_size, start_method="spawn")
    rows = dict(results.get() for _ in range(ring_size))
    return [rows[r] for r in range(ring_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 512, 256, 256])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--head-stride", type=int, default=None, help="kv heads per ring pass (ring_head_stride)")
    parser.add_argument("--ring-sizes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    print(f"packed lengths {args.lengths} (G={sum(args.lengths)}), H={args.heads} K={args.kv_heads} "
          f"D={args.head_dim}, fp32, head_stride={args.head_stride}; per-rank numbers are the max over ranks")
    print(f"{'ring size':>9s} {'local N':>8s} {'saved MiB':>10s} {'peak MiB':>9s} {'saved x1':>9s} "
          f"{'peak x1':>8s} {'step s':>7s}")
    base = None
    for ring_size in args.ring_sizes:
        rows = run_ring(ring_size, args)
        saved, peak = max(r["saved"] for r in rows), max(r["peak"] for r in rows)
        base = base or (saved, peak)
        print(f"{ring_size:9d} {sum(args.lengths) // ring_size:8d} {mib(saved):>10s} {mib(peak)} "
              f"{saved / base[0]:9.3f} {peak / base[1]:8.3f} {max(r['seconds'] for r in rows):7.2f}")
        if "sdpa" in rows[0]:
            sdpa = rows[0]["sdpa"]
            print(f"{'(sdpa loop, unsharded)':>18s} {mib(sdpa['saved']):>10s} {mib(sdpa['peak'])} "
                  f"{'':9s} {'':8s} {sdpa['seconds']:7.2f}")


if __name__ == "__main__":
    main()
