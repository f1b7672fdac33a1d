"""Chunked token log-probs and entropies equal the full log_softmax references on random inputs."""

import math

import pytest
import torch
from rlhf.kernels import (
    chunked_logprobs_entropy,
    token_entropy,
    token_entropy_reference,
    token_logprobs,
    token_logprobs_reference,
)


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


def test_entropy_chunked_equals_reference_and_hand_value():
    g = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(2, 7, 31, generator=g)
    torch.testing.assert_close(token_entropy(logits, chunk_tokens=3), token_entropy_reference(logits))
    uniform = torch.zeros(1, 1, 8)  # entropy of a uniform distribution over 8 tokens is log 8
    torch.testing.assert_close(token_entropy(uniform), torch.full((1, 1), math.log(8)))


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_logprobs_entropy_values_and_gradients(chunk):
    g = torch.Generator().manual_seed(chunk)
    logits = (4 * torch.randn(3, 5, 23, generator=g)).requires_grad_()
    targets = torch.randint(0, 23, (3, 5), generator=g)
    w_lp, w_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    logprobs, entropy = chunked_logprobs_entropy(logits, targets, chunk_tokens=chunk)
    logprobs_ref, entropy_ref = token_logprobs_reference(logits, targets), token_entropy_reference(logits)
    torch.testing.assert_close(logprobs, logprobs_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, entropy_ref, atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad((logprobs * w_lp + entropy * w_ent).sum(), logits)
    (grad_ref,) = torch.autograd.grad((logprobs_ref * w_lp + entropy_ref * w_ent).sum(), logits)
    torch.testing.assert_close(grad, grad_ref, atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_entropy_bf16_gradient_dtype():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 19, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, 19, (4,), generator=g)
    logprobs, _ = chunked_logprobs_entropy(logits, targets, chunk_tokens=3)
    logprobs.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    (grad_ref,) = torch.autograd.grad(token_logprobs_reference(logits, targets).sum(), logits)
    torch.testing.assert_close(logits.grad.float(), grad_ref.float(), atol=1e-2, rtol=1e-2)
