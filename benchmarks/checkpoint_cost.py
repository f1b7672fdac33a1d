"""What checkpoints cost a run, written at once and in the background (`--async_save`), in two cases:

    ppo  the chaos job (benchmarks/chaos.py's PPO with a critic, ZeRO-2, 2 CPU ranks, rewards from `serve_rm`), a
         checkpoint after every step: a tiny model, so a save is mostly fixed work (barriers, directories, the
         manifest, the rename) rather than bytes;
    sft  SFT of a random 39M-parameter Qwen2 (`SMALL`: 0.6 GB a checkpoint with its Adam states), 1 rank, a
         checkpoint every 3 steps: a save is mostly bytes, and the machine's second core is free for the writer, as
         a GPU node's host cores are while its GPUs compute.

    python benchmarks/checkpoint_cost.py [--cases ppo,sft] [--repeats 2]

Each case is launched without checkpoints, with them, and with them and --async_save, interleaved. Prints each
launch's wall time and its logged step time (`time/step`, which leaves the save out), then what the checkpoints add
to the run's wall time, per checkpoint and against the step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
spec = importlib.util.spec_from_file_location("chaos", os.path.join(HERE, "chaos.py"))
chaos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chaos)

SMALL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=1408, vocab_size=32000, max_position_embeddings=4096)
"""The sft case's model: a Qwen2 of 39M parameters (fp32 weights 0.16 GB; with ZeRO-2's fp32 master copy and Adam's
two moments a checkpoint is 0.6 GB)."""
SFT_STEPS, SFT_SAVE_STEPS = 13, 3  # saves at steps 3, 6, 9, 12: the last one's writing overlaps step 13
VARIANTS = {"no checkpoints": [], "checkpoints": [], "checkpoints written in the background": ["--async_save"]}


def run(cmd: list[str], out: str) -> tuple[float, float]:
    """(wall seconds, mean logged step seconds) of one launch `cmd` writing into `out`."""
    import subprocess

    os.makedirs(out, exist_ok=True)
    began = time.monotonic()
    with open(os.path.join(out, "console.log"), "w") as log:
        returncode = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}).returncode
    wall = time.monotonic() - began
    if returncode != 0:
        raise SystemExit(f"checkpoint_cost: a launch failed (exit {returncode}): see {out}/console.log")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [row["time/step"] for row in map(json.loads, f) if row.get("time/step")]
    return wall, sum(steps) / len(steps)


def ppo_case(work: str, steps: int):
    """(launch(variant, out), steps, checkpoints, stop) of the ppo case."""
    from rlhf.assets import TINY_DIR

    reward = chaos.RewardServer(TINY_DIR, open(os.path.join(work, "reward_server.log"), "w"))
    reward.start()
    flags = chaos.ppo_flags(TINY_DIR, steps, reward.url, dist_timeout_min=2)

    def launch(variant: str, out: str) -> tuple[float, float]:
        save = ["--save_steps", "-1" if variant == "no checkpoints" else "1"]
        cmd = [sys.executable, "-m", "rlhf.cli.launch", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={chaos.free_port()}", "-m", "rlhf.cli.train_ppo", *flags, *save, *VARIANTS[variant],
               "--save_path", out, "--ckpt_path", os.path.join(out, "ckpt"), "--no_plots"]
        return run(cmd, out)

    return launch, steps, steps, reward.stop


def sft_case(work: str):
    """(launch(variant, out), steps, checkpoints, stop) of the sft case."""
    import torch

    sys.path.insert(0, HERE)
    from gpu_throughput_inputs import QWEN25, SHAPES, build_model_dir, write_rows

    SHAPES.setdefault("checkpoint_cost", dict(QWEN25, **SMALL))
    model, data = os.path.join(work, "small_model"), os.path.join(work, "data")
    os.makedirs(data, exist_ok=True)
    params = build_model_dir(model, "checkpoint_cost", "cpu", torch.float32)
    sft = write_rows(data, 128, 16, 256)["sft"]
    print(f"sft case: a {params / 1e6:.0f}M-parameter Qwen2, a checkpoint every {SFT_SAVE_STEPS} steps", flush=True)

    def launch(variant: str, out: str) -> tuple[float, float]:
        save = ["--save_steps", "-1" if variant == "no checkpoints" else str(SFT_SAVE_STEPS)]
        cmd = [sys.executable, "-m", "rlhf.cli.launch", "--nproc_per_node=1", "--master_addr=127.0.0.1",
               f"--master_port={chaos.free_port()}", "-m", "rlhf.cli.train_sft", "--pretrain", model,
               "--dataset", sft, "--input_key", "input", "--output_key", "output", "--input_template", "{} ",
               "--max_len", "136", "--train_batch_size", "4", "--micro_train_batch_size", "4", "--max_epochs", "1",
               "--max_steps", str(SFT_STEPS), "--param_dtype", "fp32", "--attn_implementation", "sdpa",
               "--zero_stage", "2", "--learning_rate", "1e-5", "--max_ckpt_num", "2", "--logging_steps", "1",
               *save, *VARIANTS[variant], "--save_path", out, "--ckpt_path", os.path.join(out, "ckpt"), "--no_plots"]
        return run(cmd, out)

    return launch, SFT_STEPS, SFT_STEPS // SFT_SAVE_STEPS, lambda: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="ppo,sft")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ppo_steps", type=int, default=60)
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if set(cases) - {"ppo", "sft"}:
        raise SystemExit(f"--cases: {', '.join(sorted(set(cases) - {'ppo', 'sft'}))} unknown; choose ppo, sft")
    work = tempfile.mkdtemp(prefix="checkpoint_cost_")
    for case in cases:
        launch, steps, saves, stop = ppo_case(work, args.ppo_steps) if case == "ppo" else sft_case(work)
        extra: dict[str, list[float]] = {name: [] for name in list(VARIANTS)[1:]}
        step_s = []
        try:
            for repeat in range(args.repeats):
                runs = {name: launch(name, os.path.join(work, f"{case}-{i}-{repeat}"))
                        for i, name in enumerate(VARIANTS)}
                none_wall = runs["no checkpoints"][0]
                for name in extra:
                    extra[name].append((runs[name][0] - none_wall) / saves)
                step_s.append(runs["no checkpoints"][1])
                print(f"{case}, repeat {repeat + 1}: " + ", ".join(
                    f"{name} {wall:.1f} s ({step:.3f} s/step logged)" for name, (wall, step) in runs.items()),
                    flush=True)
        finally:
            stop()
        mean_step = sum(step_s) / len(step_s)
        for name, values in extra.items():
            mean = sum(values) / len(values)
            each = ", ".join(f"{e:.3f}" for e in values)
            print(f"{case}: {steps} steps, {saves} {name}: each adds {mean:.3f} s to the run, against a "
                  f"{mean_step:.3f} s step ({mean / mean_step:.0%}; per repeat {each})", flush=True)


if __name__ == "__main__":
    main()
