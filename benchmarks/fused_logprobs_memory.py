"""Peak memory of token log-probs (+ entropy) forward and backward at a 128k vocabulary: the naive
float32 log_softmax + gather against the chunked and fused kernels of `rlhf.kernels`.

Run: python benchmarks/fused_logprobs_memory.py [--rows 256] [--vocab 128256] [--dtype bf16]
On CPU the Triton kernel is skipped (it would run in the interpreter, whose memory use says nothing).
Shape legend: N rows (tokens), V vocabulary.
"""

from __future__ import annotations

import argparse
import time

import torch
from memory_tracking import mib, peak_allocated_bytes, warm_up_profiler
from rlhf.kernels import (
    chunked_logprobs_entropy,
    token_entropy_reference,
    token_logprobs,
    token_logprobs_reference,
)


def naive(logits_NV, targets_N):
    return token_logprobs_reference(logits_NV, targets_N), token_entropy_reference(logits_NV)


def naive_logprobs_only(logits_NV, targets_N):
    return (token_logprobs_reference(logits_NV, targets_N),)


def chunked_forward_only_chunking(logits_NV, targets_N):
    return (token_logprobs(logits_NV[None], targets_N[None], chunk_tokens=32)[0],)


def chunked_recompute(logits_NV, targets_N):
    return chunked_logprobs_entropy(logits_NV, targets_N, chunk_tokens=32)


def fused_triton(logits_NV, targets_N):
    from rlhf.kernels import fused_logprobs_entropy

    return fused_logprobs_entropy(logits_NV, targets_N)


def forward_backward(method, logits_NV, targets_N, weights_N) -> None:
    outputs = method(logits_NV, targets_N)
    loss = sum((out * weights_N).sum() for out in outputs)
    loss.backward()
    logits_NV.grad = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    logits_NV = (3 * torch.randn(args.rows, args.vocab, generator=g)).to(device=device, dtype=dtype)
    logits_NV.requires_grad_()
    targets_N = torch.randint(0, args.vocab, (args.rows,), generator=g).to(device)
    weights_N = torch.randn(args.rows, generator=g).to(device)
    methods = {
        "naive log_softmax+gather (+entropy)": naive,
        "naive log_softmax+gather (logprob only)": naive_logprobs_only,
        "token_logprobs (chunked fwd, autograd bwd)": chunked_forward_only_chunking,
        "chunked_logprobs_entropy (chunked fwd+bwd)": chunked_recompute,
    }
    if device == "cuda":
        methods["fused_logprobs_entropy (Triton)"] = fused_triton
    else:
        warm_up_profiler()
    logits_mib = logits_NV.numel() * logits_NV.element_size()
    print(f"device={device} rows={args.rows} vocab={args.vocab} dtype={args.dtype} "
          f"logits={mib(logits_mib).strip()} MiB (input, not counted; its gradient is counted)")
    print(f"{'method':45s} {'peak MiB':>9s} {'x logits':>9s} {'vs naive':>9s} {'seconds':>8s}")
    baseline = None
    for name, method in methods.items():
        start = time.perf_counter()
        peak = peak_allocated_bytes(lambda m=method: forward_backward(m, logits_NV, targets_N, weights_N), device)
        seconds = time.perf_counter() - start
        baseline = baseline or peak
        print(f"{name:45s} {mib(peak)} {peak / logits_mib:9.2f} {peak / baseline:9.3f} {seconds:8.2f}")


if __name__ == "__main__":
    main()
