"""Long responses: one RL step of `train_ppo` with ring attention of size 1, 2 and 4 on 4 ranks, per response
length: seconds per step (and its stages) and the peak RSS of every rank, and the longest response each ring
size trains under a per-rank memory cap.

    python benchmarks/long_context.py [--lengths 2048,4096,8192] [--rings 1,2,4] [--world 4] [--steps 1]
                                      [--cap_mib N] [--keep DIR [--report_only]] [-- more train_ppo flags]

Each (length, ring size) is one `torchrun --nproc_per_node WORLD` of `train_ppo` through `rl_step_trainer.py`
(the probes of `rl_step.py`: stage boundaries on the shared clock, the peak RSS at each stage's end; EOS is
ignored, so every response is exactly LENGTH tokens). Config: `rl_step.py`'s random Llama (hidden 256, 4
layers, 4 heads of 64, intermediate 1024, the embedded 64-word tokenizer) with positions for the longest
length; GRPO (group_norm, 2 samples x 4 prompts = 8 sequences of 16 + LENGTH tokens per step, one vLLM engine
per rank, one prompt each), `--packing_samples --micro_train_batch_size 1 --train_batch_size 8` (one sequence
per micro-batch: a ring of R ranks shares each sequence, R/2 zigzag pairs of chunks per rank), ZeRO-2, fp32.
The data-parallel size is WORLD / R, so every ring size does the same work per step.

Timed: step STEPS, from its first rank's generation to the end of its logging (earlier steps are warm-up; the
peak RSS covers all of them). The default is one step: at these lengths a step takes minutes and its first-call
costs are a few percent (2048 tokens, ring 1: step 1 86.8 s, step 2 83.3 s). "train growth" is how far the
rank's peak rose during the train stage above its peak before it (the engine's weights and KV cache, the
actor, DeepSpeed's buffers and generation are below that line). Under `--cap_mib` (default: the smallest peak
that lets some ring size train the longest length, rounded up to 256 MiB), the report names, per length, the
ring sizes whose every rank stayed under the cap. The cap is applied to the measured peaks, not enforced.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from rl_step import (
    STAGES,
    add_run_arguments,
    build_model_dir,
    critical_path,
    rank_records,
    read_metrics,
    run_and_report,
    torchrun,
)

PROMPTS, SAMPLES = 4, 2
KV_BYTES_PER_TOKEN = 2 * 4 * 256 * 4  # k and v, 4 layers, 256 dims, fp32


def run_flags(length: int, ring: int) -> list[str]:
    # each engine holds one prompt's samples: 2 x (16 + length) tokens, plus 128-token blocks and room
    kv_bytes = 2 * SAMPLES * (length + 16 + 256) * KV_BYTES_PER_TOKEN
    return ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(SAMPLES), "--rollout_batch_size",
            str(PROMPTS), "--train_batch_size", str(PROMPTS * SAMPLES), "--micro_train_batch_size", "1",
            "--micro_rollout_batch_size", "1", "--generate_max_len", str(length), "--prompt_max_len", "16",
            "--init_kl_coef", "0", "--actor_learning_rate", "1e-6", "--zero_stage", "2", "--param_dtype", "fp32",
            "--packing_samples", "--ring_attn_size", str(ring), "--vllm_kv_cache_bytes", str(kv_bytes)]


def measure(args: argparse.Namespace, work: str, extra: list[str]) -> None:
    from rlhf.assets import EMBEDDED_PROMPTS, EMBEDDED_REWARD

    model = os.path.join(work, "model")
    if not os.path.exists(model):
        positions = -(-(max(args.lengths) + 16 + 1) // 1024) * 1024
        print(f"random Llama: {build_model_dir(model, '4m', positions) / 1e6:.2f}M parameters, {positions} "
              "positions", flush=True)
    for length in args.lengths:
        for ring in args.rings:
            run_dir = os.path.join(work, f"len{length}_ring{ring}")
            os.makedirs(run_dir, exist_ok=True)
            flags = ["--pretrain", model, "--prompt_data", EMBEDDED_PROMPTS, "--label_key", "label",
                     "--remote_rm_url", EMBEDDED_REWARD, *run_flags(length, ring), "--max_steps", str(args.steps),
                     "--save_path", os.path.join(run_dir, "save"), *extra]
            took = torchrun("rl_step_trainer.py", args.world, flags,
                            {"RL_STEP_OUT": run_dir, "RL_STEP_IGNORE_EOS": "1"}, os.path.join(run_dir, "train.log"))
            print(f"length {length}, ring {ring}: {took:.0f} s with start-up", flush=True)


def summarize(run_dir: str, step: int) -> dict:
    ranks = rank_records(run_dir)
    for r in ranks:  # step 1 starts with the first generation (not at start-up)
        r["step_end"].setdefault(0, min(t0 for name, t0, _, _ in r["stages"] if name == STAGES[0]))
    path = critical_path(ranks, step)
    metrics = read_metrics(os.path.join(run_dir, "save", "metrics.jsonl"))[step]

    def growth(record: dict) -> int:
        """How far the peak rose during train stages above the peak before each of them."""
        rises, before = [], 0
        for name, peak in record["stage_peak_rss"]:
            if name == "train":
                rises.append(peak - before)
            before = peak
        return max(rises)

    return {"path": path, "rss": [r["peak_rss_bytes"] for r in ranks], "growth": [growth(r) for r in ranks],
            "response_length": metrics["response_length"]}


def report(args: argparse.Namespace, work: str) -> None:
    rows = {(length, ring): summarize(os.path.join(work, f"len{length}_ring{ring}"), args.steps)
            for length in args.lengths for ring in args.rings}
    mib = 2 ** 20
    print(f"\nworld {args.world}, {os.cpu_count()} CPUs, torch {torch.__version__}; step {args.steps} timed, "
          f"{PROMPTS * SAMPLES} sequences of 16 + LENGTH tokens per step; seconds, MiB")
    print(f"{'length':>6s} {'ring':>4s} {'dp':>3s} {'step s':>7s} " + " ".join(f"{k:>11s}" for k in STAGES)
          + f" {'peak RSS max rank':>17s} {'ranks':>23s} {'train growth max':>16s} {'mean len':>8s}")
    for (length, ring), s in rows.items():
        p = s["path"]
        print(f"{length:6d} {ring:4d} {args.world // ring:3d} {p['wall']:7.1f} "
              + " ".join(f"{p[k]:11.2f}" for k in STAGES)
              + f" {max(s['rss']) / mib:17.0f} {'/'.join(f'{b / mib:.0f}' for b in s['rss']):>23s}"
              f" {max(s['growth']) / mib:16.0f} {s['response_length']:8.0f}")
    longest = max(args.lengths)
    cap = args.cap_mib or -(-min(max(rows[longest, r]["rss"]) for r in args.rings) // (256 * mib)) * 256
    print(f"\nper-rank cap {cap} MiB (measured peaks, not enforced): ring sizes whose every rank fits")
    for length in args.lengths:
        fits = [r for r in args.rings if max(rows[length, r]["rss"]) <= cap * mib]
        print(f"  length {length}: " + (", ".join(map(str, fits)) if fits else "none"))
    for ring in args.rings:
        fits = [length for length in args.lengths if max(rows[length, ring]["rss"]) <= cap * mib]
        print(f"  ring {ring}: longest length that fits " + (str(max(fits)) if fits else "none of these"))
    slow = {ring: statistics.fmean(rows[length, ring]["path"]["wall"] / rows[length, args.rings[0]]["path"]["wall"]
                                   for length in args.lengths) for ring in args.rings}
    print("step time against ring " + str(args.rings[0]) + " (mean over lengths): "
          + ", ".join(f"ring {r} {v:.2f}x" for r, v in slow.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096,8192", help="comma-separated response lengths (tokens)")
    parser.add_argument("--rings", default="1,2,4", help="comma-separated --ring_attn_size values")
    parser.add_argument("--world", type=int, default=4, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--steps", type=int, default=1, help="RL steps per run; the last one is timed")
    parser.add_argument("--cap_mib", type=int, default=None, help="per-rank memory cap for the fit report")
    add_run_arguments(parser, "more train_ppo flags")
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.rings = [int(x) for x in args.rings.split(",")]
    if args.steps < 1 or any(args.world % r or (PROMPTS * SAMPLES) % (args.world // r) for r in args.rings):
        parser.error(f"--steps must be >= 1, and every ring size must divide --world into a data-parallel size "
                     f"that divides the {PROMPTS * SAMPLES} sequences per step")
    if PROMPTS % args.world:
        parser.error(f"--world must divide the {PROMPTS} prompts per step (one vLLM engine per rank)")
    run_and_report(parser, args, "long_context_", lambda work, extra: measure(args, work, extra),
                   lambda work: report(args, work))

if __name__ == "__main__":
    main()
