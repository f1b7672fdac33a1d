"""What a checkpoint after every step costs: the chaos job (benchmarks/chaos.py's PPO with a critic, ZeRO-2, 2 CPU
ranks, rewards from `serve_rm`) launched with `--save_steps 1` and with `--save_steps -1`, interleaved.

    python benchmarks/checkpoint_cost.py [--steps 60] [--repeats 2]

Prints each launch's wall time and its logged step time (`time/step`, which leaves the save out), then the extra
seconds a step's checkpoint adds (the launches' difference over the steps) against the step itself: the most an
asynchronous snapshot (a copy in host memory written in the background) could win back per step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("chaos", os.path.join(HERE, "chaos.py"))
chaos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chaos)


def launch(flags: list[str], save_steps: str, out: str) -> tuple[float, float]:
    """(wall seconds, mean logged step seconds) of one launch of the job (`chaos.launch`, no restarts) saving every
    `save_steps` steps."""
    flags = list(flags)
    flags[flags.index("--save_steps") + 1] = save_steps
    os.makedirs(out, exist_ok=True)
    began = time.monotonic()
    with open(os.path.join(out, "console.log"), "w") as log:
        returncode = chaos.launch(flags, out, 0, log).wait()
    wall = time.monotonic() - began
    if returncode != 0:
        raise SystemExit(f"checkpoint_cost: the launch with --save_steps {save_steps} failed: see {out}/console.log")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [row["time/step"] for row in map(json.loads, f) if row.get("time/step")]
    return wall, sum(steps) / len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from rlhf.assets import TINY_DIR

    work = tempfile.mkdtemp(prefix="checkpoint_cost_")
    reward = chaos.RewardServer(TINY_DIR, open(os.path.join(work, "reward_server.log"), "w"))
    reward.start()
    try:
        flags = chaos.ppo_flags(TINY_DIR, args.steps, reward.url, dist_timeout_min=2)
        extra, step_s = [], []
        for repeat in range(args.repeats):
            (none_wall, none_step), (every_wall, every_step) = (
                launch(flags, save_steps, os.path.join(work, f"{name}{repeat}"))
                for name, save_steps in (("none", "-1"), ("every", "1")))
            extra.append((every_wall - none_wall) / args.steps)
            step_s.append((none_step + every_step) / 2)
            print(f"repeat {repeat + 1}: no checkpoints {none_wall:.1f} s ({none_step:.3f} s/step logged), a "
                  f"checkpoint every step {every_wall:.1f} s ({every_step:.3f} s/step logged): "
                  f"{extra[-1]:.3f} s a checkpoint", flush=True)
    finally:
        reward.stop()
    mean_extra, mean_step = sum(extra) / len(extra), sum(step_s) / len(step_s)
    print(f"{args.steps} steps x {args.repeats}: a checkpoint every step adds {mean_extra:.3f} s to a "
          f"{mean_step:.3f} s step ({mean_extra / mean_step:.0%}; per repeat {', '.join(f'{e:.3f}' for e in extra)})")


if __name__ == "__main__":
    main()
