"""The RL step on CPU with and without the libraries `rlhf.cli.launch` preloads for vLLM's CPU backend, measured
in one run: the embedded GRPO demo (`train_ppo` without --pretrain, vLLM when installed) on WORLD ranks for
STEPS steps, once per LD_PRELOAD choice (none; libiomp5; tcmalloc; both), each in a fresh launch; prints the
mean of time/step and of each stage over the steps after the first, and each choice's ratio to none.

    python benchmarks/cpu_preload.py [--steps 8] [--world 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

from rlhf.utils.preload import PRELOAD_NAMES, cpu_preload, search_dirs

STAGES = ("time/step", "time/generation", "time/experience", "time/train", "time/weight_sync")


def library(names: tuple[str, ...]) -> str | None:
    _, added = cpu_preload("", search_dirs())
    return next((path for path in added if os.path.basename(path) in names), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out: str, preload: list[str], steps: int, world: int) -> dict[str, float]:
    env = {**os.environ, "LD_PRELOAD": ":".join(preload)}
    cmd = [sys.executable, "-m", "rlhf.cli.launch", "--no_preload", f"--nproc_per_node={world}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "rlhf.cli.train_ppo",
           "--max_steps", str(steps), "--save_path", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][1:]
    return {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in STAGES}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--keep", default=None)
    args = parser.parse_args()
    tcmalloc, iomp = library(PRELOAD_NAMES[0]), library(PRELOAD_NAMES[1])
    choices = {"none": [], "libiomp5": [iomp], "tcmalloc": [tcmalloc], "both": [tcmalloc, iomp]}
    root = args.keep or tempfile.mkdtemp(prefix="cpu_preload_")
    results = {}
    for name, libs in choices.items():
        if None in libs:
            print(f"{name:9} skipped: not installed", flush=True)
            continue
        results[name] = run(os.path.join(root, name), libs, args.steps, args.world)
        r = results[name]
        print(f"{name:9} " + "  ".join(f"{k[5:]} {v:.3f} s" for k, v in r.items())
              + (f"  step vs none {r['time/step'] / results['none']['time/step']:.2f}x" if name != "none" else ""),
              flush=True)


if __name__ == "__main__":
    main()
