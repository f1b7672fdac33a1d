"""Weight sync benchmark: time to push a DeepSpeed actor's weights into the in-process vLLM engine,
against a plain copy of the same bytes, measured in one run.

    python benchmarks/weight_sync.py [--hidden 768 --layers 12 --vocab 32000] [--zero_stage 2 3] [--repeats 5]

Per ZeRO stage (one actor after the other, one engine): the push as the trainer does it (the engine's chosen
path fed by `full_parameters(copy=False)`), the previous push (vLLM's `reload_weights` fed by cloned tensors),
the plain copy of the same bytes (`tensor.copy_` into fresh buffers), interleaved, best of `--repeats`; their
ratios; and where the push's time goes: the actor's stream alone (ZeRO-3: the gathers), the engine fed from
ready tensors, and oneDNN's weight packing inside it (CPU). One process, CPU (gloo) or one GPU.
"""

from __future__ import annotations

import argparse
import gc
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
    gc.collect()
    start = time.perf_counter()
    for dst, src in zip(buffers, tensors):
        dst.copy_(src)
    return time.perf_counter() - start


def seconds(fn) -> float:
    gc.collect()  # garbage of the previous measurement (vLLM's reload leaves plenty) is not this one's cost
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def count_packing() -> list[float]:
    """Seconds spent in vLLM's oneDNN weight packing (CPU linear layers), appended per call."""
    import vllm._custom_ops as ops

    spent: list[float] = []
    create = ops.create_onednn_mm

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = create(*args, **kwargs)
        spent.append(time.perf_counter() - start)
        return out

    ops.create_onednn_mm = timed
    return spent


def measure(engine, actor, repeats: int, packing: list[float]) -> dict[str, float]:
    """Best-of-`repeats` seconds of each way to move the actor's weights, interleaved."""
    from rlhf.engines.vllm_engine import RELOAD_IN_PLACE

    chosen = engine.push_path
    named = [(n, t) for n, t in actor.full_parameters()]
    tensors = [t for _, t in named]
    times: dict[str, list[float]] = {k: [] for k in ("push", "previous", "copy", "stream", "engine", "packing",
                                                     "previous_engine")}
    for _ in range(repeats):
        del packing[:]
        times["push"].append(seconds(lambda: engine.load_weights(actor.full_parameters(copy=False))))
        times["packing"].append(sum(packing))
        times["copy"].append(plain_copy_seconds(tensors))
        times["stream"].append(seconds(lambda: sum(1 for _ in actor.full_parameters(copy=False))))
        times["engine"].append(seconds(lambda: engine.load_weights(iter(named))))
        engine.push_path = RELOAD_IN_PLACE
        times["previous"].append(seconds(lambda: engine.load_weights(actor.full_parameters())))
        times["previous_engine"].append(seconds(lambda: engine.load_weights(iter(named))))
        engine.push_path = chosen
    return {k: min(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--zero_stage", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29611"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.distributed.launch_env import init_distributed, read_launch_env
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.engines.vllm_engine import VLLMEngine
    from rlhf.models.loading import load_causal_lm

    device = init_distributed(read_launch_env())
    with tempfile.TemporaryDirectory() as model_dir:
        num_params = build_model_dir(args, model_dir)
        engine = VLLMEngine(model_dir, dtype=torch.float32, tp_size=1, seed=0, max_model_len=256,
                            kv_cache_bytes=64 << 20, gpu_memory_utilization=0.3, enforce_eager=True,
                            enable_prefix_caching=False, enable_sleep=False)
        packing = count_packing() if device.type == "cpu" else []
        num_bytes = num_params * 4
        print(f"model: {num_params / 1e6:.2f}M parameters, {num_bytes / 2**20:.1f} MiB fp32, device {device}, "
              f"push path {engine.push_path}, best of {args.repeats}, torch threads {torch.get_num_threads()}")
        for stage in args.zero_stage:
            actor = DeepSpeedModel(lambda: load_causal_lm(model_dir, torch.float32, "sdpa"),
                                   EngineConfig(zero_stage=stage), OptimConfig(), learning_rate=1e-5, bf16=False,
                                   micro_batch_size=1, grad_accum_steps=1, num_optimizer_steps=1, device=device,
                                   dp_group=dist.group.WORLD)
            engine.load_weights(actor.full_parameters(copy=False))  # warm-up
            t = measure(engine, actor, args.repeats, packing)
            c = t["copy"]
            print(f"ZeRO-{stage}: push {t['push']:.4f} s = {num_bytes / t['push'] / 2**30:.2f} GiB/s; "
                  f"plain copy {c:.4f} s = {num_bytes / c / 2**30:.2f} GiB/s; ratio push / copy {t['push'] / c:.2f}x")
            print(f"  previous push (vLLM reload_weights, cloned stream) {t['previous']:.4f} s = "
                  f"{t['previous'] / c:.2f}x copy ({t['previous'] / t['push']:.2f}x the push); its engine side, "
                  f"fed ready tensors, {t['previous_engine']:.4f} s ({t['previous_engine'] / c:.2f}x copy)")
            print(f"  actor stream alone {t['stream']:.4f} s ({t['stream'] / c:.2f}x copy); engine fed ready "
                  f"tensors {t['engine']:.4f} s ({t['engine'] / c:.2f}x copy), of which oneDNN packing "
                  f"{t['packing']:.4f} s ({t['packing'] / c:.2f}x copy)")
            del actor


if __name__ == "__main__":
    main()
