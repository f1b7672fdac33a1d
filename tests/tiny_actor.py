"""The tiny actor and batches that the distributed equivalence tests share: a DeepSpeed actor on the embedded
tiny policy over the whole world, four synthetic experiences of different lengths, and a random two-layer Llama."""

from __future__ import annotations

import torch

GLOBAL_BATCH = 4
MICRO = 2


def synthetic_experiences(vocab: int):
    """Four samples of different lengths (so token-level aggregation matters), with advantages of
    both signs and old log-probs offset from the current ones (so some ratios are clipped)."""
    from rlhf.data.records import Experience

    g = torch.Generator().manual_seed(7)
    prompt_lens, response_lens = [3, 5, 2, 4], [6, 2, 9, 4]
    T = max(p + r for p, r in zip(prompt_lens, response_lens))
    seq = torch.zeros(GLOBAL_BATCH, T, dtype=torch.long)
    attn = torch.zeros(GLOBAL_BATCH, T, dtype=torch.long)
    action = torch.zeros(GLOBAL_BATCH, T - 1)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        seq[b, : p + r] = torch.randint(4, vocab, (p + r,), generator=g)
        attn[b, : p + r] = 1
        action[b, p - 1: p - 1 + r] = 1
    adv = torch.randn(GLOBAL_BATCH, T - 1, generator=g) * action
    old_offset = 0.3 * torch.randn(GLOBAL_BATCH, T - 1, generator=g)
    return Experience(seq, attn, action, old_offset, torch.zeros_like(old_offset), adv, torch.zeros(GLOBAL_BATCH))


def build_actor(zero_stage: int, lr: float, grad_accum_steps: int, layout=None, max_tokens: int | None = None,
                algo=None):
    """A DeepSpeed actor on the embedded tiny policy over the whole world (`layout`: padded by default;
    `max_tokens`: dynamic batching with that per-rank budget)."""
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.config.ppo_config import AlgoConfig
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.layout import PADDED
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.trainers.actor import Actor

    layout = layout or PADDED
    model = DeepSpeedModel(lambda: load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32,
                                                  layout.attn_implementation("sdpa")),
                           EngineConfig(zero_stage=zero_stage),
                           OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"), learning_rate=lr, bf16=False,
                           micro_batch_size=MICRO, grad_accum_steps=grad_accum_steps, num_optimizer_steps=1,
                           device=torch.device("cpu"), dp_group=dist.group.WORLD)
    infer = MicroBatcher(16, max_tokens, dist.group.WORLD, layout, "--rollout_max_tokens_per_gpu")
    train = MicroBatcher(MICRO, max_tokens, dist.group.WORLD, layout)
    return Actor(model, dist.group.WORLD, torch.device("cpu"), temperature=1.0, algo=algo or AlgoConfig(),
                 infer_batcher=infer, train_batcher=train)


def tiny_llama(attn_implementation: str):
    """A random two-layer Llama (vocabulary 64, hidden 64), seeded: the same weights on every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                         attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()
