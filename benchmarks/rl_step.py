"""One RL step of `train_ppo`, stage by stage, against each stage's floor, measured in the same run.

    python benchmarks/rl_step.py [--steps 30] [--world 2] [--model DIR] [--lengths fixed,natural] [--keep DIR]

Runs `torchrun --nproc_per_node WORLD -m rlhf.cli.train_ppo` (through `rl_step_trainer.py`, which adds probes)
on the benchmark config below, once per response-length mode: `fixed` (EOS ignored, every response is
--generate_max_len tokens; a benchmark-only hook, the product has no such flag) and `natural`. Then one
torchrun of `rl_step_floors.py` replays each rank's recorded work with no trainer around (see its docstring).
Prints, over steps 2..STEPS (step 1 is warm-up), each stage's seconds per step (rank 0's StageTimer, the
time/* of metrics.jsonl) against its floor, the remainder of the step's wall time (end of one step's logging
to the next's) as overhead, what the probes saw inside each stage, samples/s, generated tokens/s and the
peak RSS of every rank.

Config (a benchmark, not a test): a random-initialised Llama (hidden 256, 4 layers, 4 heads of 64,
intermediate 1024) with the embedded 64-word tokenizer, the embedded prompts and reward, 2 ranks, GRPO
(group_norm, 4 samples x 8 prompts), train batch 32, micro-batch 16, 128 new tokens, ZeRO-2, fp32, SDPA.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STAGES = ("generation", "experience", "train", "weight_sync")
RUN_FLAGS = ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8",
             "--train_batch_size", "32", "--micro_train_batch_size", "16", "--generate_max_len", "128",
             "--prompt_max_len", "16", "--init_kl_coef", "0", "--actor_learning_rate", "1e-6", "--zero_stage", "2",
             "--param_dtype", "fp32", "--attn_implementation", "sdpa"]
SAMPLES_PER_STEP = 8 * 4


def build_model_dir(out: str) -> int:
    """The benchmark's random Llama with the embedded tokenizer; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.assets import EMBEDDED_MODEL_DIR

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    for name in os.listdir(EMBEDDED_MODEL_DIR):
        if name.startswith(("tokenizer", "chat_template")):
            shutil.copy(os.path.join(EMBEDDED_MODEL_DIR, name), out)
    return sum(p.numel() for p in model.parameters())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, world: int, flags: list[str], env: dict[str, str], log_path: str) -> float:
    """Run `script` on `world` ranks; its output goes to `log_path` (its tail is printed on failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), os.path.join(HERE, script), *flags]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        with open(log_path) as log:
            sys.stderr.write(log.read()[-6000:])
        raise SystemExit(f"{script} failed (exit {code}); full log: {log_path}")
    return time.perf_counter() - start


def read_metrics(path: str) -> dict[int, dict[str, float]]:
    import json

    with open(path) as f:
        return {row["step"]: row for row in map(json.loads, f) if "time/step" in row}


def mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def summarize(run_dir: str, floor_records: list[dict], mode: str, steps: list[int]) -> dict:
    """Per-step means over `steps` of the run's stages, wall time, probes and floors (floors: the slowest rank
    of each step, as a stage ends at a collective that waits for every rank)."""
    metrics = read_metrics(os.path.join(run_dir, "save", "metrics.jsonl"))
    ranks = []
    while os.path.exists(os.path.join(run_dir, f"rank{len(ranks)}.pt")):
        ranks.append(torch.load(os.path.join(run_dir, f"rank{len(ranks)}.pt"), weights_only=False))
    end = ranks[0]["step_end"]
    out = {"wall": mean(end[s] - end[s - 1] for s in steps),
           "step": mean(metrics[s]["time/step"] for s in steps),
           "run": {k: mean(metrics[s][f"time/{k}"] for s in steps) for k in STAGES},
           "floor": {k: mean(max(f["floors"][mode][s][k] for f in floor_records) for s in steps)
                     for k in (*STAGES, "grad_allreduce")},
           "response_length": mean(metrics[s]["response_length"] for s in steps),
           "floor_tokens": mean(sum(f["floors"][mode][s]["generated_tokens"] for f in floor_records) for s in steps),
           "run_rss": [r["peak_rss_bytes"] for r in ranks]}
    names = {n for r in ranks for s in steps for n in r["seconds"].get(s, {})}
    out["probe"] = {n: [mean(r["seconds"].get(s, {}).get(n, 0.0) for s in steps) for r in ranks] for n in names}
    return out


def print_report(mode: str, s: dict, num_steps: int) -> None:
    wall, run, floor = s["wall"], s["run"], s["floor"]
    p = {n: v[0] for n, v in s["probe"].items()}  # rank 0, like the StageTimer
    overhead = wall - sum(run.values())
    title = "fixed length (EOS ignored)" if mode == "fixed" else "natural length"
    print(f"\n== {title}: steps 2..{num_steps}, mean seconds per step ==")
    print(f"{'stage':14s} {'measured':>9s} {'floor':>9s} {'ratio':>7s} {'share of step':>14s}")
    for k in STAGES:
        print(f"{k:14s} {run[k]:9.3f} {floor[k]:9.3f} {run[k] / floor[k]:6.1f}x {run[k] / wall:13.1%}")
    print(f"{'overhead':14s} {overhead:9.3f} {'':>9s} {'':>7s} {overhead / wall:13.1%}")
    print(f"{'step (wall)':14s} {wall:9.3f} {sum(floor[k] for k in STAGES):9.3f} "
          f"{wall / sum(floor[k] for k in STAGES):6.1f}x {1:13.1%}")
    tokens = s["response_length"] * SAMPLES_PER_STEP
    print(f"samples/s {SAMPLES_PER_STEP / wall:.2f}; generated tokens/s {tokens / wall:.0f} over the step, "
          f"{tokens / run['generation']:.0f} in the generation stage ({floor['generation'] and s['floor_tokens'] / floor['generation']:.0f} "
          f"standalone); mean response {s['response_length']:.1f} tokens (standalone replay: "
          f"{s['floor_tokens'] / SAMPLES_PER_STEP:.1f})")
    print("peak RSS per rank: " + ", ".join(f"rank {i} {b / 2**20:.0f} MiB" for i, b in enumerate(s["run_rss"])))
    print("inside the stages (rank 0 probes, s/step):")
    gen = p.get("engine_generate", 0.0)
    print(f"  generation: engine.generate {gen:.3f} (standalone {floor['generation']:.3f}); "
          f"rest (prompt slicing, to_rollout/decode, sleep) {run['generation'] - gen:.3f}")
    fwd, rew, gat = p.get("actor_logprobs", 0.0), p.get("reward", 0.0), p.get("all_gather_rollout", 0.0)
    print(f"  experience: actor forward {fwd:.3f} (plain {floor['experience']:.3f}), reward {rew:.3f}, "
          f"all_gather_rollout {gat:.3f}, rest (advantages, metrics) {run['experience'] - fwd - rew - gat:.3f}")
    tb, bwd, st = p.get("actor_train_batch", 0.0), p.get("ds_backward", 0.0), p.get("ds_step", 0.0)
    print(f"  train: Actor.train_batch {tb:.3f} = forward+loss+counts {tb - bwd - st:.3f} + DeepSpeed backward "
          f"{bwd:.3f} + DeepSpeed step {st:.3f}; rest (shuffle, split, metric reduce) {run['train'] - tb:.3f}; "
          f"plain fwd+bwd+AdamW {floor['train']:.3f}; gloo all-reduce of one fp32 gradient {floor['grad_allreduce']:.3f}")
    load, clone = p.get("engine_load_weights", 0.0), p.get("actor_full_parameters", 0.0)
    print(f"  weight sync: engine.load_weights {load:.3f} = actor full_parameters (clones) {clone:.3f} + engine "
          f"reload {load - clone:.3f}; plain copy {floor['weight_sync']:.3f}")
    print(f"  overhead: inside the step, between stages {s['step'] - sum(run.values()):.3f}; after the step "
          f"(metrics reduce/log, progress bar) {wall - s['step']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run; 2..STEPS are timed")
    parser.add_argument("--world", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--model", default=None, help="HF model dir (default: the random Llama 256x4)")
    parser.add_argument("--lengths", default="fixed,natural", help="comma-separated: fixed, natural")
    parser.add_argument("--keep", default=None, help="write runs and logs here (default: a removed temp dir)")
    args = parser.parse_args()
    modes = args.lengths.split(",")
    if args.steps < 2 or not set(modes) <= {"fixed", "natural"}:
        parser.error("--steps must be >= 2 and --lengths a list of fixed, natural")
    from rlhf.assets import EMBEDDED_PROMPTS, EMBEDDED_REWARD

    work = args.keep or tempfile.mkdtemp(prefix="rl_step_")
    os.makedirs(work, exist_ok=True)
    try:
        model = args.model or os.path.join(work, "model")
        if args.model is None:
            print(f"random Llama: {build_model_dir(model) / 1e6:.2f}M parameters", flush=True)
        flags = ["--pretrain", model, "--prompt_data", EMBEDDED_PROMPTS, "--label_key", "label", "--remote_rm_url",
                 EMBEDDED_REWARD, *RUN_FLAGS, "--max_steps", str(args.steps)]
        runs = []
        for mode in modes:
            run_dir = os.path.join(work, mode)
            os.makedirs(run_dir, exist_ok=True)
            took = torchrun("rl_step_trainer.py", args.world, [*flags, "--save_path", os.path.join(run_dir, "save")],
                            {"RL_STEP_OUT": run_dir, "RL_STEP_IGNORE_EOS": str(int(mode == "fixed"))},
                            os.path.join(run_dir, "train.log"))
            print(f"{mode}: train_ppo run {took:.0f} s with start-up", flush=True)
            runs.append(run_dir)
        floors_dir = os.path.join(work, "floors")
        os.makedirs(floors_dir, exist_ok=True)
        took = torchrun("rl_step_floors.py", args.world, [*flags, "--save_path", os.path.join(floors_dir, "save")],
                        {"RL_STEP_RUNS": ",".join(runs), "RL_STEP_MODES": ",".join(modes),
                         "RL_STEP_FLOORS": floors_dir}, os.path.join(floors_dir, "floors.log"))
        print(f"floors: {took:.0f} s with start-up", flush=True)
        floor_records = [torch.load(os.path.join(floors_dir, f"rank{r}.pt"), weights_only=False)
                         for r in range(args.world)]
        f0 = floor_records[0]
        import vllm

        print(f"\nworld {args.world}, {os.cpu_count()} CPUs, torch {torch.__version__}, vllm {vllm.__version__}, "
              f"engine {f0['engine']}, {f0['num_params'] / 1e6:.2f}M parameters ({f0['param_bytes'] / 2**20:.1f} MiB)"
              f"; floor process peak RSS per rank: "
              + ", ".join(f"{f['peak_rss_bytes'] / 2**20:.0f} MiB" for f in floor_records))
        for mode, run_dir in zip(modes, runs):
            print_report(mode, summarize(run_dir, floor_records, mode, list(range(2, args.steps + 1))), args.steps)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
