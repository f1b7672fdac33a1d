"""The fused Triton log-prob/entropy kernel natively on CUDA equals the log_softmax references, fp32 and bf16.

Shape legend: N rows, V vocabulary."""


import pytest
import torch
from rlhf.kernels import token_entropy_reference, token_logprobs_reference

pytest.importorskip("triton")


def _check_against_reference(device: str, dtype: torch.dtype, shapes, atol: float) -> None:
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


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_kernel_native_cuda(dtype, atol):
    _check_against_reference("cuda", dtype, [(64, 1000, 256), (7, 32000, 4096), (3, 128256, 4096)], atol=atol)
