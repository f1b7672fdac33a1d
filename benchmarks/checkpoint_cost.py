"""What a checkpoint after every step costs, written at once and in the background: the chaos job
(benchmarks/chaos.py's PPO with a critic, ZeRO-2, 2 CPU ranks, rewards from `serve_rm`) launched with
`--save_steps -1`, with `--save_steps 1`, and with `--save_steps 1 --async_save`, interleaved.

    python benchmarks/checkpoint_cost.py [--steps 60] [--repeats 2]

Prints each launch's wall time and its logged step time (`time/step`, which leaves the save out), then the extra
seconds a step's checkpoint adds (the launches' difference over the steps) against the step itself, for each way of
writing it.
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


def launch(flags: list[str], save: list[str], out: str) -> tuple[float, float]:
    """(wall seconds, mean logged step seconds) of one launch of the job (`chaos.launch`, no restarts) with the
    checkpoint flags `save` (--save_steps N, and --async_save)."""
    flags = list(flags)
    flags[flags.index("--save_steps") + 1] = save[1]
    flags += save[2:]
    os.makedirs(out, exist_ok=True)
    began = time.monotonic()
    with open(os.path.join(out, "console.log"), "w") as log:
        returncode = chaos.launch(flags, out, 0, log).wait()
    wall = time.monotonic() - began
    if returncode != 0:
        raise SystemExit(f"checkpoint_cost: the launch with {' '.join(save)} failed: see {out}/console.log")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [row["time/step"] for row in map(json.loads, f) if row.get("time/step")]
    return wall, sum(steps) / len(steps)


VARIANTS = {"no checkpoints": ["--save_steps", "-1"], "a checkpoint every step": ["--save_steps", "1"],
            "one written in the background (--async_save)": ["--save_steps", "1", "--async_save"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from rlhf.assets import TINY_DIR

    work = tempfile.mkdtemp(prefix="checkpoint_cost_")
    reward = chaos.RewardServer(TINY_DIR, open(os.path.join(work, "reward_server.log"), "w"))
    reward.start()
    extra: dict[str, list[float]] = {name: [] for name in list(VARIANTS)[1:]}
    step_s = []
    try:
        flags = chaos.ppo_flags(TINY_DIR, args.steps, reward.url, dist_timeout_min=2)
        for repeat in range(args.repeats):
            runs = {name: launch(flags, save, os.path.join(work, f"{i}-{repeat}")) for i, (name, save) in
                    enumerate(VARIANTS.items())}
            (none_wall, none_step), *_ = runs.values()
            for name in extra:
                extra[name].append((runs[name][0] - none_wall) / args.steps)
            step_s.append(sum(step for _, step in runs.values()) / len(runs))
            print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {wall:.1f} s ({step:.3f} s/step logged)"
                                                      for name, (wall, step) in runs.items()), flush=True)
    finally:
        reward.stop()
    mean_step = sum(step_s) / len(step_s)
    for name, values in extra.items():
        mean = sum(values) / len(values)
        print(f"{args.steps} steps x {args.repeats}: {name} adds {mean:.3f} s to a {mean_step:.3f} s step "
              f"({mean / mean_step:.0%}; per repeat {', '.join(f'{e:.3f}' for e in values)})")


if __name__ == "__main__":
    main()
