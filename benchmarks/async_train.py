"""Asynchronous against synchronous RL training at equal settings, measured in one run.

    python benchmarks/async_train.py [--steps 100] [--world 4] [--engines 2] [--keep DIR] [-- more train_ppo flags]

Runs `train_ppo` twice under torchrun on WORLD ranks with vLLM and the embedded tiny demo (its policy, prompts and
rule-based reward; GRPO, 8 samples x 16 prompts, 8 new tokens, two optimizer steps per batch, the off-policy
correction on in both): synchronous (every rank generates, then every rank trains) and `--async_train
--vllm_num_engines ENGINES` (ENGINES ranks generate a step ahead while the other ranks train). Prints seconds per
step (rank 0's `time/step`, steps 3..STEPS), their ratio, each run's reward curve (mean `reward_mean` over
fifths of the run) and the async run's off-policy gap (`rollout/logprob_abs_diff`, `rollout/is_weight_mean`)
against the synchronous one's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FLAGS = ["--param_dtype", "fp32", "--attn_implementation", "sdpa", "--rollout_engine", "vllm",
         "--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--n_samples_per_prompt", "8",
         "--rollout_batch_size", "16", "--micro_rollout_batch_size", "32", "--train_batch_size", "64",
         "--micro_train_batch_size", "16", "--generate_max_len", "8", "--prompt_max_len", "16",
         "--label_key", "label", "--actor_learning_rate", "3e-3", "--lr_warmup_ratio", "0.05", "--zero_stage", "2",
         "--num_episodes", "8", "--seed", "1", "--enable_vllm_is_correction"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(out: str, world: int, flags: list[str]) -> list[dict]:
    """One torchrun of train_ppo into `out`; its metrics rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), "-m", "rlhf.cli.train_ppo", *flags, "--save_path", out]
    with open(out + ".log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        with open(out + ".log") as log:
            sys.stderr.write(log.read()[-6000:])
        raise SystemExit(f"train_ppo failed (exit {code}); log: {out}.log")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "time/step" in row]


def fifths(rows: list[dict], key: str) -> list[float]:
    size = max(len(rows) // 5, 1)
    return [statistics.fmean(r[key] for r in rows[i:i + size]) for i in range(0, size * 5, size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--engines", type=int, default=2, help="generation ranks of the async run")
    parser.add_argument("--keep", default=None, help="write the runs here (default: a removed temp dir)")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train_ppo flags (both runs)")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]
    work = args.keep or tempfile.mkdtemp(prefix="async_train_")
    os.makedirs(work, exist_ok=True)
    flags = [*FLAGS, "--max_steps", str(args.steps), *extra]
    try:
        runs = {"sync": train(os.path.join(work, "sync"), args.world, flags),
                "async": train(os.path.join(work, "async"), args.world,
                               [*flags, "--async_train", "--vllm_num_engines", str(args.engines)])}
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    seconds = {name: statistics.fmean(r["time/step"] for r in rows[2:]) for name, rows in runs.items()}
    print(f"{args.world} ranks, {args.steps} steps; async: {args.engines} generation ranks, "
          f"{args.world - args.engines} training ranks, queue 1")
    print(f"{'run':6} {'s/step':>8} {'steps/s':>8}   reward_mean by fifths of the run          "
          f"logprob gap  IS weight")
    for name, rows in runs.items():
        curve = " ".join(f"{v:.3f}" for v in fifths(rows, "reward_mean"))
        gap = statistics.fmean(r["rollout/logprob_abs_diff"] for r in rows[2:])
        weight = statistics.fmean(r["rollout/is_weight_mean"] for r in rows[2:])
        print(f"{name:6} {seconds[name]:8.3f} {1 / seconds[name]:8.3f}   {curve:40}  {gap:11.4f}  {weight:9.4f}")
    print(f"async / sync steps per second: {seconds['sync'] / seconds['async']:.2f}x")


if __name__ == "__main__":
    main()
