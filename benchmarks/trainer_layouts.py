"""The trainer's own path, timed: experience-time log-probs (`Actor.logprobs`) and one optimizer step
(`Actor.train_batch`, DeepSpeed ZeRO-2) of a small Llama on a skewed (lognormal) length distribution,
laid out as padded micro-batches, packed micro-batches (`--packing_samples`) and packed token-budget
micro-batches (`--packing_samples --use_dynamic_batch`). Prints real tokens per second and the ratio to
the padded layout, all measured in this run. One rank (gloo), CPU by default; CUDA if available.

Run: python benchmarks/trainer_layouts.py [--num-seqs 32] [--micro-batch 8] [--max-tokens 2048] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from packing_throughput import build_model, make_lengths, timed

from rlhf.config.ppo_config import AlgoConfig
from rlhf.config.shared_config import EngineConfig, OptimConfig
from rlhf.data.records import Experience
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.layout import SequenceLayout
from rlhf.models.micro_batches import MicroBatcher
from rlhf.trainers.actor import Actor

PROMPT_LEN = 8
LAYOUTS = {"padded": (False, False), "packed": (True, False), "packed+dynamic": (True, True)}


def experience(lengths: list[int], vocab: int) -> Experience:
    g = torch.Generator().manual_seed(0)
    B, T = len(lengths), max(lengths)
    seq = torch.randint(1, vocab, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    action = ((torch.arange(T - 1)[None] >= PROMPT_LEN - 1) & (mask[:, 1:] > 0)).float()
    adv = torch.randn(B, T - 1, generator=g) * action
    zeros = torch.zeros(B, T - 1)
    return Experience(seq * mask, mask, action, zeros, zeros.clone(), adv, torch.zeros(B))


def build_actor(name: str, args, device: torch.device) -> Actor:
    packing, dynamic = LAYOUTS[name]
    layout = SequenceLayout(packing=packing)
    model = DeepSpeedModel(lambda: build_model(layout.attn_implementation("sdpa"), "cpu"),
                           EngineConfig(zero_stage=2), OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"),
                           learning_rate=1e-5, bf16=False, micro_batch_size=args.micro_batch, grad_accum_steps=1,
                           num_optimizer_steps=1_000, device=device, dp_group=dist.group.WORLD)
    budget = args.max_tokens if dynamic else None
    return Actor(model, dist.group.WORLD, device, temperature=1.0, algo=AlgoConfig(),
                 infer_batcher=MicroBatcher(args.micro_batch, budget, dist.group.WORLD, layout),
                 train_batcher=MicroBatcher(args.micro_batch, budget, dist.group.WORLD, layout))


def measure(actor: Actor, exp: Experience, repeats: int, device: torch.device) -> tuple[float, float, int]:
    """(best seconds of Actor.logprobs over the batch, of one Actor.train_batch over it, micro-batches)."""
    micro = [exp.select(torch.tensor(rows)).trimmed() for rows in actor.train_batcher.split(exp.attention_mask_BT)]
    infer = min(timed(lambda: actor.logprobs(exp.sequences_BT, exp.attention_mask_BT), device.type)
                for _ in range(repeats))
    train = min(timed(lambda: actor.train_batch(micro, kl_coef=0.0), device.type) for _ in range(repeats))
    return infer, train, len(micro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch (fixed layouts)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget per micro-batch (dynamic)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lengths = make_lengths(args.num_seqs, args.seed)
    real_tokens = sum(lengths)
    print(f"{args.num_seqs} sequences, {real_tokens} real tokens, lengths {min(lengths)}..{max(lengths)} "
          f"(median {int(statistics.median(lengths))}), device {device.type}")
    results = {}
    for name in LAYOUTS:
        actor = build_actor(name, args, device)
        exp = experience(lengths, actor.model.module.config.vocab_size)
        exp.old_logprobs_BT1 = actor.logprobs(exp.sequences_BT, exp.attention_mask_BT)  # warm-up
        results[name] = measure(actor, exp, args.repeats, device)
        del actor
    base_infer, base_train, _ = results["padded"]
    print(f"{'layout':<16}{'micro-batches':>14}{'logprobs tok/s':>16}{'ratio':>7}{'train tok/s':>14}{'ratio':>7}")
    for name, (infer, train, count) in results.items():
        print(f"{name:<16}{count:>14}{real_tokens / infer:>16.0f}{base_infer / infer:>7.2f}"
              f"{real_tokens / train:>14.0f}{base_train / train:>7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
