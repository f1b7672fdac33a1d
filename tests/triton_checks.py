"""The fused Triton log-prob/entropy kernel against the log_softmax references, forward and backward, shared by the
CPU test (Triton's interpreter, in a subprocess that imports `interpreted_fp32_checks`) and the CUDA test.

Shape legend: N rows, V vocabulary."""

import os

import torch
from rlhf.kernels import token_entropy_reference, token_logprobs_reference


def check_against_reference(device: str, dtype: torch.dtype, shapes, atol: float) -> None:
    from rlhf.kernels.logprobs_triton import fused_logprobs_entropy

    for seed, (N, V, block_v) in enumerate(shapes):
        g = torch.Generator().manual_seed(seed)
        logits = (4 * torch.randn(N, V, generator=g)).to(device=device, dtype=dtype).requires_grad_()
        targets = torch.randint(0, V, (N,), generator=g).to(device)
        w_lp, w_ent = (torch.randn(N, generator=g).to(device) for _ in range(2))
        logprobs, entropy = fused_logprobs_entropy(logits, targets, block_v=block_v)
        logprobs_ref, entropy_ref = token_logprobs_reference(logits, targets), token_entropy_reference(logits)
        torch.testing.assert_close(logprobs, logprobs_ref, atol=atol, rtol=atol)
        torch.testing.assert_close(entropy, entropy_ref, atol=atol, rtol=atol)
        (grad,) = torch.autograd.grad((logprobs * w_lp + entropy * w_ent).sum(), logits, retain_graph=True)
        (grad_ref,) = torch.autograd.grad((logprobs_ref * w_lp + entropy_ref * w_ent).sum(), logits,
                                          retain_graph=True)
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.float(), grad_ref.float(), atol=atol, rtol=atol)
        (grad_lp_only,) = torch.autograd.grad(logprobs.sum(), logits)  # entropy unused: its grad is None
        (grad_lp_ref,) = torch.autograd.grad(logprobs_ref.sum(), logits)
        torch.testing.assert_close(grad_lp_only.float(), grad_lp_ref.float(), atol=atol, rtol=atol)


def interpreted_fp32_checks() -> None:
    """Entry point of the subprocess below; V not a multiple of block_v exercises the masked tail."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_against_reference("cpu", torch.float32, [(6, 97, 32), (3, 300, 128), (2, 16, 16)], atol=1e-5)
    print("interpreted fp32 checks passed")
