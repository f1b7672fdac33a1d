"""Training throughput (real tokens per second of forward + backward) of a small Llama on a skewed
(lognormal) length distribution: right-padded micro-batches with SDPA against packed micro-batches
under a token budget with the `rlhf_varlen` attention. CPU by default; CUDA if available.

Run: python benchmarks/packing_throughput.py [--num-seqs 32] [--batch-size 8] [--repeats 2]
Shape legend: B batch, T padded positions, N packed tokens, V vocabulary.
"""

from __future__ import annotations

import argparse
import time

import torch
from rlhf.kernels import dynamic_micro_batches, next_token_targets, pack_sequences, token_logprobs
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf.models.attention import register_varlen_attention


def make_lengths(num_seqs: int, seed: int) -> list[int]:
    """Lognormal lengths (median ~80 tokens, a few up to 1024): most short, few long."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(num_seqs, generator=g) * 0.9 + 4.4).round().clamp(16, 1024)
    return [int(n) for n in lengths]


def build_model(attn_implementation: str, device: str) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                         attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def padded_step(model, sequences, batch_size: int, num_targets: int) -> int:
    """One pass over all sequences in right-padded micro-batches; returns the positions computed."""
    positions = 0
    for b0 in range(0, len(sequences), batch_size):
        chunk = sequences[b0:b0 + batch_size]
        T = max(len(s) for s in chunk)
        ids_BT = torch.zeros(len(chunk), T, dtype=torch.long, device=chunk[0].device)
        mask_BT = torch.zeros_like(ids_BT)
        for i, s in enumerate(chunk):
            ids_BT[i, :len(s)], mask_BT[i, :len(s)] = s, 1
        logits = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=(mask_BT.cumsum(-1) - 1).clamp(min=0),
                       use_cache=False).logits
        logprobs_BT = token_logprobs(logits[:, :-1], ids_BT[:, 1:])
        (-(logprobs_BT * mask_BT[:, 1:]).sum() / num_targets).backward()
        positions += ids_BT.numel()
    return positions


def packed_step(model, sequences, micro_batches, num_targets: int) -> int:
    """One pass over all sequences in packed micro-batches; returns the positions computed."""
    positions = 0
    for mb in micro_batches:
        packed = pack_sequences([sequences[i] for i in mb])
        targets_1N = next_token_targets(packed)
        valid_1N = torch.ones_like(targets_1N, dtype=torch.bool)
        valid_1N[0, packed.cu_seqlens[1:].long() - 1] = False
        logprobs_1N = token_logprobs(model(**packed.forward_kwargs()).logits, targets_1N)
        (-(logprobs_1N * valid_1N).sum() / num_targets).backward()
        positions += packed.num_tokens
    return positions


def timed(step, device: str) -> float:
    start = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per padded micro-batch")
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget per packed micro-batch")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = make_lengths(args.num_seqs, seed=0)
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(1, 2048, (n,), generator=g).to(device) for n in lengths]
    num_targets = sum(n - 1 for n in lengths)
    micro_batches = dynamic_micro_batches(lengths, 1, args.max_tokens)[0]
    padded_model, packed_model = build_model("sdpa", device), build_model(register_varlen_attention(), device)
    runs = {
        f"padded, {args.batch_size} seqs/micro-batch (sdpa)": lambda: padded_step(padded_model, sequences,
                                                                                  args.batch_size, num_targets),
        f"packed, <= {args.max_tokens} tokens/micro-batch (varlen)": lambda: packed_step(packed_model, sequences,
                                                                                         micro_batches, num_targets),
    }
    positions = {name: run() for name, run in runs.items()}  # warm-up pass, also counts computed positions
    seconds = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so background load hits both alike
        for name, run in runs.items():
            seconds[name].append(timed(run, device))
    print(f"device={device} threads={torch.get_num_threads()} sequences={len(lengths)} real tokens={sum(lengths)} "
          f"lengths min/median/max={min(lengths)}/{sorted(lengths)[len(lengths) // 2]}/{max(lengths)}")
    print(f"{'layout':48s} {'positions':>9s} {'micro-batches':>13s} {'best s':>7s} {'real tok/s':>10s}")
    rates = {}
    for name in runs:
        best = min(seconds[name])
        rates[name] = sum(lengths) / best
        count = len(micro_batches) if name.startswith("packed") else -(-len(lengths) // args.batch_size)
        print(f"{name:48s} {positions[name]:9d} {count:13d} {best:7.2f} {rates[name]:10.0f}")
    padded_rate, packed_rate = rates.values()
    print(f"packed / padded throughput: {packed_rate / padded_rate:.2f}x")


if __name__ == "__main__":
    main()
