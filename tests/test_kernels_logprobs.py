"""Chunked token log-probs equal the full log_softmax gather (fp32) on random inputs."""

import pytest
import torch
from rlhf.kernels import token_logprobs, token_logprobs_reference


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_reference(chunk, dtype):
    g = torch.Generator().manual_seed(chunk)
    logits = (3 * torch.randn(3, 11, 97, generator=g)).to(dtype)
    targets = torch.randint(0, 97, (3, 11), generator=g)
    out = token_logprobs(logits, targets, chunk_tokens=chunk)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, token_logprobs_reference(logits, targets), atol=1e-5, rtol=1e-5)


def test_gradients_match_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 13, generator=g, requires_grad=True)
    targets = torch.randint(0, 13, (2, 5), generator=g)
    (grad_chunked,) = torch.autograd.grad(token_logprobs(logits, targets, chunk_tokens=3).sum(), logits)
    (grad_ref,) = torch.autograd.grad(token_logprobs_reference(logits, targets).sum(), logits)
    torch.testing.assert_close(grad_chunked, grad_ref)
