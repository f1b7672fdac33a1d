"""The packed policy forward equals the padded one (log-probs, entropy and gradients), with and without gradient
checkpointing."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_policy_forward_matches_padded_with_and_without_checkpointing(checkpointing):
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.models.layout import PADDED, SequenceLayout
    from rlhf.models.lm_logprobs import policy_forward
    from rlhf.models.loading import load_causal_lm

    g = torch.Generator().manual_seed(0)
    lengths, T = torch.tensor([5, 9, 3]), 9
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.randint(4, 30, (3, T), generator=g) * mask
    results = []
    for layout in (PADDED, SequenceLayout(packing=True)):
        model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, layout.attn_implementation("sdpa"))
        if checkpointing and layout.packing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        out = policy_forward(model, ids, mask, temperature=0.8, with_entropy=True, layout=layout)
        ((out.logprobs_BT1 + 0.5 * out.entropy_BT1) * mask[:, 1:]).sum().backward()
        results.append((out.logprobs_BT1.detach() * mask[:, 1:], out.entropy_BT1.detach() * mask[:, 1:],
                        {n: p.grad for n, p in model.named_parameters()}))
    (lp, ent, grads), (lp_packed, ent_packed, grads_packed) = results
    torch.testing.assert_close(lp_packed, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_packed, ent, atol=1e-5, rtol=0)
    assert float(lp.abs().sum()) > 1 and all(float(g.abs().sum()) > 0 for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grads_packed[name], grad, atol=1e-5, rtol=1e-4, msg=name)
