"""Peak memory of the knowledge-distillation loss, forward + backward: the float32 reference against the
chunked kernel of `rlhf.kernels` (which recomputes chunk by chunk in its backward).

Run: python benchmarks/kd_loss_memory.py [--rows 4096] [--vocab 32000] [--dtype bf16] [--chunks 1024 256]
The student and teacher logits exist before the measurement and are not counted; the student gradient
(one [N, V] tensor in the logits' dtype) is. Shape legend: N rows (tokens), V vocabulary.
"""

from __future__ import annotations

import argparse
import time

import torch
from memory_tracking import mib, peak_allocated_bytes, warm_up_profiler
from rlhf.kernels import kd_loss_chunked, kd_loss_reference


def forward_backward(loss_fn, student_NV, teacher_NV, mask_N) -> float:
    loss = loss_fn(student_NV[None], teacher_NV[None], mask_N[None])
    loss.backward()
    student_NV.grad = None
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 256])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    student_NV = (3 * torch.randn(args.rows, args.vocab, generator=g)).to(device=device, dtype=dtype)
    teacher_NV = (3 * torch.randn(args.rows, args.vocab, generator=g)).to(device=device, dtype=dtype)
    student_NV.requires_grad_()
    mask_N = (torch.rand(args.rows, generator=g) < 0.9).to(device)
    methods = {"kd_loss_reference (float32 [N, V])": kd_loss_reference}
    for chunk in args.chunks:
        methods[f"kd_loss_chunked (chunk_tokens={chunk})"] = (
            lambda s, t, m, c=chunk: kd_loss_chunked(s, t, m, chunk_tokens=c))
    if device == "cpu":
        warm_up_profiler()
    logits_bytes = student_NV.numel() * student_NV.element_size()
    print(f"device={device} rows={args.rows} vocab={args.vocab} dtype={args.dtype} "
          f"logits={mib(logits_bytes).strip()} MiB each for student and teacher (inputs, not counted)")
    print(f"{'method':40s} {'peak MiB':>9s} {'x logits':>9s} {'vs ref':>9s} {'seconds':>8s} {'loss':>10s}")
    baseline = None
    for name, method in methods.items():
        losses = []
        start = time.perf_counter()
        peak = peak_allocated_bytes(
            lambda m=method, out=losses: out.append(forward_backward(m, student_NV, teacher_NV, mask_N)), device)
        seconds = time.perf_counter() - start
        baseline = baseline or peak
        print(f"{name:40s} {mib(peak)} {peak / logits_bytes:9.2f} {peak / baseline:9.3f} {seconds:8.2f} "
              f"{losses[0]:10.5f}")


if __name__ == "__main__":
    main()
