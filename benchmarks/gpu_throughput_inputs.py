"""The inputs of `gpu_throughput.sh`: random-initialised model directories of Qwen2.5 shapes (config only, nothing
downloaded) and synthetic JSONL rows of an exact token length for SFT, DPO and GRPO. Knows nothing about the jobs
that read them.

Token counts: the embedded word-level tokenizer (64 words, whitespace split, no BOS) gives one token per word, and
the SFT and preference samples append an EOS; the model's `vocab_size` is the shape's (151936 for the Qwen2.5 shapes),
so the embedding and output matrices are full size while the rows use the tokenizer's 64 ids.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import torch

QWEN25 = dict(num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
              rms_norm_eps=1e-6, max_position_embeddings=32768)
SHAPES = {  # public config facts of Qwen2.5-0.5B and -1.5B; "tiny" is for CPU runs of the benchmark itself
    "0.5b": dict(QWEN25, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864),
    "1.5b": dict(QWEN25, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, intermediate_size=8960),
    "tiny": dict(QWEN25, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=4096),  # head dim 32: vLLM's CPU
                                                                                       # attention refuses 16
}
WORDS = [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]  # all in the tokenizer


def build_model_dir(out: str, shape: str, device: str, dtype: torch.dtype) -> int:
    """A random-initialised Qwen2 causal LM of `shape` (built on `device`, saved in `dtype`) with the embedded
    tokenizer in `out`; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.assets import EMBEDDED_MODEL_DIR

    config = Qwen2Config(bos_token_id=2, eos_token_id=3, pad_token_id=0, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(out, max_shard_size="100GB")  # one file (the floor reads model.safetensors too)
    for name in os.listdir(EMBEDDED_MODEL_DIR):
        if name.startswith(("tokenizer", "chat_template")):
            shutil.copy(os.path.join(EMBEDDED_MODEL_DIR, name), out)
    return sum(p.numel() for p in model.parameters())


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_rows(directory: str, row_tokens: int, prompt_tokens: int, num_rows: int, seed: int = 0) -> dict[str, str]:
    """sft.jsonl (`input` of `prompt_tokens` words, `output` of the rest: `row_tokens` tokens with the EOS),
    pairs.jsonl (`prompt`, `chosen`, `rejected`: each side `row_tokens` tokens with its EOS) and prompts.jsonl
    (`input` of `prompt_tokens` words, `label`), `num_rows` each; returns their paths by name."""
    if not 0 < prompt_tokens < row_tokens - 1:
        raise ValueError(f"PROMPT_TOKENS {prompt_tokens} must be in 1 .. ROW_TOKENS - 2 ({row_tokens - 2})")
    rng = random.Random(seed)
    response = row_tokens - prompt_tokens - 1  # the EOS is the last token
    rows = {
        "sft": [{"input": _words(rng, prompt_tokens), "output": _words(rng, response)} for _ in range(num_rows)],
        "pairs": [{"prompt": _words(rng, prompt_tokens), "chosen": _words(rng, response),
                   "rejected": _words(rng, response)} for _ in range(num_rows)],
        "prompts": [{"input": _words(rng, prompt_tokens), "label": rng.choice(WORDS[:10])} for _ in range(num_rows)],
    }
    paths = {}
    for name, items in rows.items():
        paths[name] = os.path.join(directory, f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
    return paths
