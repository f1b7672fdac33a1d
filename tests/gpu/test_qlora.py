"""LoRA / QLoRA (peft) on every trained model: the flags and their OpenRLHF defaults; after training (B != 0) the
merged weights give the adapter model's log-probs and values; checkpoints hold the adapters alone and resume
exactly; the rollout engine fed the merged weights agrees with the actor (the vLLM parity check); SFT learns
with only adapters trainable; `lora_combiner` output loads with plain transformers; --load_in_4bit is refused
without CUDA and trains on a GPU.

    torchrun --nproc_per_node 2 -m tests.test_lora OUT.json    (the vLLM parity worker)
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.common import LoRAConfig

LORA = LoRAConfig(lora_rank=4, lora_alpha=16)
FP32 = torch.float32


def _lora_model(kind: str, zero_stage: int, lr: float = 2e-2):
    import torch.distributed as dist

    from rlhf.config.common import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.lora import apply_lora
    from rlhf.models.value import load_scalar_head_model

    def build():
        if kind == "actor":
            return load_causal_lm(EMBEDDED_MODEL_DIR, FP32, "sdpa")
        return load_scalar_head_model(EMBEDDED_MODEL_DIR, "score", FP32, "sdpa", fresh_head=True)

    return DeepSpeedModel(build, EngineConfig(zero_stage=zero_stage),
                          OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"), learning_rate=lr, bf16=False,
                          micro_batch_size=2, grad_accum_steps=1, num_optimizer_steps=10, device=torch.device("cpu"),
                          dp_group=dist.group.WORLD, adapt=lambda module: apply_lora(module, LORA), name=kind)


def _role(kind: str, zero_stage: int, lr: float = 2e-2):
    """An Actor or Critic on a LoRA DeepSpeedModel over the world (2 samples per micro-batch)."""
    import torch.distributed as dist

    from rlhf.config.ppo import AlgoConfig
    from rlhf.models.layout import PADDED
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.trainers.actor import Actor
    from rlhf.trainers.critic import Critic

    model, world, cpu = _lora_model(kind, zero_stage, lr), dist.group.WORLD, torch.device("cpu")
    infer, train = MicroBatcher(16, None, world, PADDED), MicroBatcher(2, None, world, PADDED)
    if kind == "actor":
        return Actor(model, world, cpu, temperature=1.0, algo=AlgoConfig(), infer_batcher=infer, train_batcher=train)
    return Critic(model, world, cpu, None, infer_batcher=infer, train_batcher=train)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 64, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids.masked_fill(mask == 0, 0), mask  # pad id 0, as the sequence-classification head expects


def _vllm_parity_worker(out_path: str) -> None:
    """tests/workers/vllm_parity.py's check, its actor replaced by a LoRA actor (ZeRO-3, TP 1)."""
    from tests.workers import vllm_parity

    vllm_parity.build_actor = lambda zero_stage, lr, grad_accum_steps: _role("actor", zero_stage, lr)
    vllm_parity.main(out_path, 3, 1)


# ---------------------------------------------------------------- QLoRA (CUDA)


def test_qlora_trains_adapters_on_a_4bit_base_and_merges():
    pytest.importorskip("bitsandbytes")
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.logprobs import sequence_logprobs
    from rlhf.models.lora import apply_lora, check_lora, is_quantized, merged_parameters

    cfg = LoRAConfig(lora_rank=8, lora_alpha=16, load_in_4bit=True)
    check_lora(cfg)
    model = apply_lora(load_causal_lm(EMBEDDED_MODEL_DIR, torch.bfloat16, "sdpa", load_in_4bit=True), cfg)
    assert is_quantized(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.bfloat16 for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids, mask = (t.cuda() for t in _batch())
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


if __name__ == "__main__":
    _vllm_parity_worker(sys.argv[1])
