"""QLoRA on CUDA: adapters train on a 4-bit base and merge."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.shared_config import LoRAConfig
from tests.tiny_lora import lora_batch

# ---------------------------------------------------------------- QLoRA (CUDA)


def test_qlora_trains_adapters_on_a_4bit_base_and_merges():
    pytest.importorskip("bitsandbytes")
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.lora import apply_lora, check_lora, is_quantized, merged_parameters
    from tests.references import sequence_logprobs

    cfg = LoRAConfig(lora_rank=8, lora_alpha=16, load_in_4bit=True)
    check_lora(cfg)
    model = apply_lora(load_causal_lm(EMBEDDED_MODEL_DIR, torch.bfloat16, "sdpa", load_in_4bit=True), cfg)
    assert is_quantized(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.bfloat16 for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids, mask = (t.cuda() for t in lora_batch())
    losses = []
    for _ in range(8):
        loss = -(sequence_logprobs(model, ids, mask) * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    merged = dict(merged_parameters(model, lambda _: nullcontext()))
    plain = load_causal_lm(EMBEDDED_MODEL_DIR, torch.bfloat16, "sdpa").cuda()
    plain.load_state_dict(merged, strict=True)
    with torch.no_grad():
        diff = (sequence_logprobs(model, ids, mask) - sequence_logprobs(plain, ids, mask)).abs() * mask[:, 1:]
    assert float(diff.max()) < 0.1  # bf16 activations: the adapter path and the merged weight round differently

