"""CUDA paths of the trainer's forwards: packed batches through flash-attn's varlen kernel, the fused
Triton log-prob/entropy kernel picked by `logprobs_entropy`, and `--use_liger_kernel`, each against the
plain padded path on the same GPU. Skipped without CUDA (tests/conftest.py)."""

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.models.layout import PADDED, SequenceLayout
from rlhf.models.lm_logprobs import logprobs_entropy, policy_forward
from rlhf.models.loading import load_causal_lm


def _batch(vocab: int, lengths=(37, 5, 120, 64)):
    g = torch.Generator().manual_seed(0)
    T = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return (ids * mask).cuda(), mask.cuda()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_forward_backward_on_cuda_matches_padded(dtype):
    packed_layout = SequenceLayout(packing=True)
    padded_model = load_causal_lm(EMBEDDED_MODEL_DIR, dtype, "sdpa").cuda()
    packed_model = load_causal_lm(EMBEDDED_MODEL_DIR, dtype, packed_layout.attn_implementation("sdpa")).cuda()
    ids, mask = _batch(padded_model.config.vocab_size)
    weights = mask[:, 1:].float()
    outs, grads = [], []
    for model, layout in ((padded_model, PADDED), (packed_model, packed_layout)):
        out = policy_forward(model, ids, mask, temperature=0.7, with_entropy=True, layout=layout)
        ((out.logprobs_BT1 + 0.1 * out.entropy_BT1) * weights).sum().backward()
        outs.append(out)
        grads.append(_grads(model))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(outs[1].logprobs_BT1 * weights, outs[0].logprobs_BT1 * weights, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[1].entropy_BT1 * weights, outs[0].entropy_BT1 * weights, atol=tol, rtol=tol)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name].float(), g.float(), atol=tol * 10, rtol=tol * 10, msg=name)


def test_cuda_logprobs_entropy_uses_fused_kernel_and_matches_reference():
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(4, 33, 50_000, generator=g)).cuda().requires_grad_()
    targets = torch.randint(0, 50_000, (4, 33), generator=g).cuda()
    logprobs, entropy = logprobs_entropy(logits, targets)
    ref_logp = logits.float().log_softmax(-1)
    torch.testing.assert_close(logprobs, ref_logp.gather(-1, targets[..., None])[..., 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(entropy, -(ref_logp.exp() * ref_logp).sum(-1), atol=1e-3, rtol=1e-4)


def test_liger_patched_policy_matches_unpatched():
    pytest.importorskip("liger_kernel")
    from rlhf.models.loading import apply_liger_kernel

    plain = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa").cuda()
    patched = apply_liger_kernel(load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa")).cuda()
    ids, mask = _batch(plain.config.vocab_size)
    weights = mask[:, 1:].float()
    with torch.no_grad():
        expected = policy_forward(plain, ids, mask).logprobs_BT1 * weights
        got = policy_forward(patched, ids, mask).logprobs_BT1 * weights
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
