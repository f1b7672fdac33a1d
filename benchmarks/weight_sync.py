"""Weight sync benchmark: time to push a DeepSpeed actor's weights into the in-process vLLM engine,
against a plain copy of the same bytes, measured in one run.

    python benchmarks/weight_sync.py [--hidden 768 --layers 12 --vocab 32000] [--zero_stage 3] [--repeats 3]

Prints the model size, the sync time (DeepSpeed gather + vLLM reload), the plain-copy time of the same
bytes (tensor.copy_ into preallocated buffers), their ratio and the effective bandwidth. One process,
CPU (gloo) or one GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist


def build_model_dir(args: argparse.Namespace, out: str) -> int:
    return save_random_llama(out, vocab_size=args.vocab, hidden_size=args.hidden,
                             intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                             num_attention_heads=args.hidden // 64, max_position_embeddings=512)


def save_random_llama(out: str, **shape) -> int:
    """A random-initialised Llama of `shape` (LlamaConfig fields; heads of 64) saved to `out` with the embedded
    tokenizer; returns its parameter count. Shared by the benchmarks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.assets import EMBEDDED_MODEL_DIR

    config = LlamaConfig(num_key_value_heads=shape["num_attention_heads"], head_dim=64, tie_word_embeddings=False,
                         bos_token_id=2, eos_token_id=3, pad_token_id=0, **shape)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    for name in os.listdir(EMBEDDED_MODEL_DIR):
        if name.startswith(("tokenizer", "chat_template")):
            shutil.copy(os.path.join(EMBEDDED_MODEL_DIR, name), out)
    return sum(p.numel() for p in model.parameters())


def plain_copy_seconds(tensors: list[torch.Tensor]) -> float:
    buffers = [torch.empty_like(t) for t in tensors]
    start = time.perf_counter()
    for dst, src in zip(buffers, tensors):
        dst.copy_(src)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29611"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from rlhf.config.common import EngineConfig, OptimConfig
    from rlhf.distributed.launch import init_distributed, read_launch_env
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.engines.vllm_engine import VLLMEngine
    from rlhf.models.loading import load_causal_lm

    device = init_distributed(read_launch_env())
    with tempfile.TemporaryDirectory() as model_dir:
        num_params = build_model_dir(args, model_dir)
        engine = VLLMEngine(model_dir, dtype=torch.float32, tp_size=1, seed=0, max_model_len=256,
                            kv_cache_bytes=64 << 20, gpu_memory_utilization=0.3, enforce_eager=True,
                            enable_prefix_caching=False, enable_sleep=False)
        actor = DeepSpeedModel(lambda: load_causal_lm(model_dir, torch.float32, "sdpa"),
                               EngineConfig(zero_stage=args.zero_stage), OptimConfig(), learning_rate=1e-5,
                               bf16=False, micro_batch_size=1, grad_accum_steps=1, num_optimizer_steps=1,
                               device=device, dp_group=dist.group.WORLD)
        tensors = [t for _, t in actor.full_parameters()]
        num_bytes = sum(t.numel() * t.element_size() for t in tensors)
        sync, copy = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.load_weights(actor.full_parameters())
            sync.append(time.perf_counter() - start)
            copy.append(plain_copy_seconds(tensors))
    s, c = min(sync), min(copy)
    print(f"model: {num_params / 1e6:.1f}M parameters, {num_bytes / 2**20:.0f} MiB fp32, ZeRO-{args.zero_stage}, "
          f"device {device}")
    print(f"weight sync (gather + vLLM reload), best of {args.repeats}: {s:.3f} s = {num_bytes / s / 2**30:.2f} GiB/s")
    print(f"plain copy of the same bytes, best of {args.repeats}:      {c:.3f} s = {num_bytes / c / 2**30:.2f} GiB/s")
    print(f"ratio sync / plain copy: {s / c:.1f}x")


if __name__ == "__main__":
    main()
