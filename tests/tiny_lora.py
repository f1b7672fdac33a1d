"""LoRA models and batches that the LoRA tests share: a DeepSpeed model of the embedded tiny policy (or a value model
on it) with peft adapters, an Actor or Critic over the world on it, a small padded batch, and the vLLM parity worker
with a LoRA actor (`torchrun --nproc_per_node 2 -m tests.tiny_lora OUT.json`)."""

from __future__ import annotations

import sys

import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.shared_config import LoRAConfig

LORA = LoRAConfig(lora_rank=4, lora_alpha=16)
FP32 = torch.float32


def lora_model(kind: str, zero_stage: int, lr: float = 2e-2):
    import torch.distributed as dist

    from rlhf.config.shared_config import EngineConfig, OptimConfig
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


def lora_role(kind: str, zero_stage: int, lr: float = 2e-2):
    """An Actor or Critic on a LoRA DeepSpeedModel over the world (2 samples per micro-batch)."""
    import torch.distributed as dist

    from rlhf.config.ppo_config import AlgoConfig
    from rlhf.models.layout import PADDED
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.trainers.actor import Actor
    from rlhf.trainers.critic import Critic

    model, world, cpu = lora_model(kind, zero_stage, lr), dist.group.WORLD, torch.device("cpu")
    infer, train = MicroBatcher(16, None, world, PADDED), MicroBatcher(2, None, world, PADDED)
    if kind == "actor":
        return Actor(model, world, cpu, temperature=1.0, algo=AlgoConfig(), infer_batcher=infer, train_batcher=train)
    return Critic(model, world, cpu, None, infer_batcher=infer, train_batcher=train)


def lora_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 64, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids.masked_fill(mask == 0, 0), mask  # pad id 0, as the sequence-classification head expects


def vllm_parity_worker(out_path: str) -> None:
    """tests/workers/vllm_parity.py's check, its actor replaced by a LoRA actor (ZeRO-3, TP 1)."""
    from tests.workers import vllm_parity

    vllm_parity.build_actor = lambda zero_stage, lr, grad_accum_steps: lora_role("actor", zero_stage, lr)
    vllm_parity.main(out_path, 3, 1)


if __name__ == "__main__":
    vllm_parity_worker(sys.argv[1])
