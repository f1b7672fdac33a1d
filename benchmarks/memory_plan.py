"""The memory plan against measured peaks on CPU: SFT, DPO and PPO at ZeRO 0/2/3, padded, packed and with ring
attention, each a short run on 2 ranks under torchrun; prints, per job and stage, rank 0's measured peak (growth
of the resident set since start-up, `rlhf.core.throughput.MemoryPeaks`), the plan's estimate and their ratio.

    python benchmarks/memory_plan.py                    # the whole grid (~15 min on 2 cores)
    python benchmarks/memory_plan.py --jobs sft --zero 2 --layouts padded
    python benchmarks/memory_plan.py --cuda --jobs sft  # on 2 GPUs (bf16; CUDA's max_memory_allocated)
    python benchmarks/memory_plan.py --readme           # the README's --dry_run plans for 7B and 70B shapes

Model: a random Llama (hidden 512, 8 blocks, 8 heads of 64, intermediate 2048, vocabulary 4096; 37.7M
parameters, fp32) with the embedded tokenizer, so that weights, gradients, optimizer states and activations
dominate the few tens of MiB the runtime allocates after start-up. Data: synthetic rows long enough that every
sequence is cut at its limit (the plan's worst case); PPO generates with transformers (vLLM's CPU runtime
is not in the plan). MALLOC_MMAP_THRESHOLD_ is fixed at 64 KiB so that freed tensors leave the resident set
(glibc's adaptive threshold otherwise keeps them, and the next stage would count them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

SHAPE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, vocab_size=4096)
MAX_LEN = 128
DEVICE_FLAGS = {False: ["--param_dtype", "fp32", "--attn_implementation", "sdpa"],
                True: ["--param_dtype", "bf16", "--attn_implementation", "sdpa"]}
"""CPU runs (False) in fp32, CUDA runs (True) in bf16; SDPA on both (flash-attn is optional)."""
COMMON = ["--max_steps", "2", "--logging_steps", "1",
          "--lr_warmup_ratio", "0", "--watchdog_interval", "0", "--perf"]
JOBS = {
    "sft": ("train_sft", ["--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_len", str(MAX_LEN),
                          "--input_template", "{} ", "--output_key", "output", "--learning_rate", "1e-5"]),
    "dpo": ("train_dpo", ["--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_len", str(MAX_LEN),
                          "--input_template", "{} ", "--prompt_key", "prompt", "--learning_rate", "1e-6"]),
    "ppo": ("train_ppo", ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
                          "--rollout_batch_size", "2", "--train_batch_size", "8", "--micro_train_batch_size", "4",
                          "--micro_rollout_batch_size", "4", "--prompt_max_len", "64", "--generate_max_len", "64",
                          "--init_kl_coef", "0.01", "--rollout_engine", "hf", "--label_key", "label",
                          "--actor_learning_rate", "1e-6"]),
}
LAYOUTS = {"padded": [], "packed": ["--packing_samples"], "ring": ["--packing_samples", "--ring_attn_size", "2"]}
ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": ROOT}


def build_inputs(out: str) -> dict[str, str]:
    """The random model and the three jobs' data under `out`; returns the flags that name them."""
    sys.path.insert(0, HERE)
    import torch
    from weight_sync import save_random_llama

    from rlhf.assets import EMBEDDED_REWARD

    torch.manual_seed(0)
    model = os.path.join(out, "model")
    save_random_llama(model, max_position_embeddings=512, **SHAPE)
    words = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    rows = {"sft.jsonl": [{"input": text(8), "output": text(2 * MAX_LEN)} for _ in range(32)],
            "pairs.jsonl": [{"prompt": text(8), "chosen": text(2 * MAX_LEN), "rejected": text(2 * MAX_LEN)}
                            for _ in range(32)],
            "prompts.jsonl": [{"input": text(60), "label": "a"} for _ in range(32)]}
    for name, items in rows.items():
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in items)
    return {"sft": ["--pretrain", model, "--dataset", os.path.join(out, "sft.jsonl")],
            "dpo": ["--pretrain", model, "--dataset", os.path.join(out, "pairs.jsonl")],
            "ppo": ["--pretrain", model, "--prompt_data", os.path.join(out, "prompts.jsonl"),
                    "--remote_rm_url", EMBEDDED_REWARD]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_argv(job: str, zero: int, layout: str, inputs: dict[str, list[str]], save: str, cuda: bool = False
             ) -> list[str]:
    """`-m rlhf.cli.<job module>` and its flags for one run of the grid, saving under `save`."""
    module, flags = JOBS[job]
    return ["-m", f"rlhf.cli.{module}", *DEVICE_FLAGS[cuda], *COMMON, *flags, *inputs[job], "--zero_stage", str(zero),
            *LAYOUTS[layout], "--save_path", save]


def read_peaks(save: str) -> dict:
    """rank -> stage -> {measured, estimated} bytes of the run that saved under `save` (memory_peaks.json)."""
    with open(os.path.join(save, "memory_peaks.json")) as f:
        return json.load(f)


def measure(job: str, zero: int, layout: str, inputs: dict[str, list[str]], out: str, cuda: bool = False) -> dict:
    """One run on 2 ranks (`cuda`: on the GPUs, 2 where there are, else 1), its `read_peaks`."""
    save = os.path.join(out, f"{job}-z{zero}-{layout}{'-cuda' if cuda else ''}")
    ranks = min(2, torch.cuda.device_count()) if cuda else 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), *job_argv(job, zero, layout, inputs, save, cuda)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{job} zero {zero} {layout} failed:\n{proc.stderr[-4000:]}")
    return read_peaks(save)


def grid(args: argparse.Namespace) -> None:
    out = tempfile.mkdtemp(prefix="memory_plan_")
    try:
        inputs = build_inputs(out)
        print(f"{'job':<5}{'zero':>5} {'layout':<8}{'stage':<12}{'measured MiB':>14}{'planned MiB':>13}"
              f"{'planned/measured':>18}", flush=True)
        results = []
        for job in args.jobs:
            for zero in args.zero:
                for layout in args.layouts:
                    table = measure(job, zero, layout, inputs, out, args.cuda)["0"]
                    for stage, v in table.items():
                        ratio = v["estimated"] / v["measured"] if v["measured"] else float("nan")
                        results.append(dict(job=job, zero=zero, layout=layout, stage=stage, **v))
                        print(f"{job:<5}{zero:>5} {layout:<8}{stage:<12}{v['measured'] / 2**20:>14.0f}"
                              f"{v['estimated'] / 2**20:>13.0f}{ratio:>18.2f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        shutil.rmtree(out, ignore_errors=True)


READMES = {
    "7B PPO, one node of 8 x 80 GB (hybrid engine, ZeRO-3, vLLM TP 2)": (8, [
        "--pretrain", "{qwen2.5-7b}", "--prompt_data", "prompts.jsonl", "--reward_pretrain", "{qwen2.5-7b}",
        "--colocate_all_models",
        "--vllm_tensor_parallel_size", "2", "--vllm_gpu_memory_utilization", "0.5", "--vllm_enable_sleep",
        "--deepspeed_enable_sleep", "--zero_stage", "3", "--param_dtype", "bf16", "--gradient_checkpointing",
        "--packing_samples", "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "8",
        "--prompt_max_len", "1024", "--generate_max_len", "1024", "--gpu_memory_gb", "80"]),
    "70B PPO, four nodes of 8 x 80 GB (hybrid engine, ZeRO-3, vLLM TP 8)": (32, [
        "--pretrain", "{llama-3-70b}", "--prompt_data", "prompts.jsonl", "--reward_pretrain", "{llama-3-70b}",
        "--colocate_all_models",
        "--vllm_tensor_parallel_size", "8", "--vllm_gpu_memory_utilization", "0.6", "--vllm_enable_sleep",
        "--deepspeed_enable_sleep", "--zero_stage", "3", "--param_dtype", "bf16", "--gradient_checkpointing",
        "--packing_samples", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4",
        "--prompt_max_len", "1024", "--generate_max_len", "1024", "--gpu_memory_gb", "80"]),
}
"""The README's "Will it fit?" plans: world size and train_ppo flags ({shape}: a shipped config.json)."""


def readme() -> None:
    """What `--dry_run` prints for the README's jobs, from the planner on the shipped shapes (no weights here:
    the plan is made from the flags and the rank plan exactly as `--dry_run` makes it after its checks)."""
    from rlhf.config.flags import parse_config
    from rlhf.config.ppo_config import TrainPPOConfig
    from rlhf.distributed.topology import plan_ranks
    from rlhf.planning.job_memory import job_memory
    from rlhf.planning.model_shapes import shape_path
    from rlhf.planning.report import report
    from rlhf.trainers.ppo_build import placement_from_config

    for title, (world, argv) in READMES.items():
        argv = [shape_path(a[1:-1]) if a.startswith("{") else a for a in argv]
        cfg = parse_config(TrainPPOConfig, argv)
        plan = plan_ranks(placement_from_config(cfg), world)
        shown = " ".join(a if not a.startswith("/") else os.path.basename(a) for a in argv)
        nodes = f"--nnodes {world // 8} " if world > 8 else ""
        launcher = f"python -m rlhf.cli.launch {nodes}--nproc_per_node 8 ..."
        print(f"### {title}\n\n```\n$ {launcher} -m rlhf.cli.train_ppo {shown} --dry_run")
        print(report(cfg, job_memory(cfg, plan), plan, world) + "\n```\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="*", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--zero", nargs="*", type=int, default=[0, 2, 3])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--cuda", action="store_true", help="run on the GPUs (2, or the one there is) in bf16 "
                        "(peaks: max_memory_allocated)")
    parser.add_argument("--readme", action="store_true", help="print the README's --dry_run plans instead")
    args = parser.parse_args()
    readme() if args.readme else grid(args)


if __name__ == "__main__":
    main()
