"""This product's GRPO step against TRL's `GRPOTrainer` on the same model, prompts and settings, interleaved:

    python benchmarks/trl_compare.py --trl-python PYTHON [--sizes 4m 30m] [--steps 12] [--rounds 2]
                                     [-- more train_ppo flags, e.g. --rollout_engine hf]

PYTHON is an interpreter that imports `trl` (TRL is not a dependency of this product: for example a venv with
`pip install trl` whose site-packages also see this one's torch and transformers, so both sides run the same
versions). Each round runs TRL (`trl_grpo_worker.py`, under torchrun) and then `train_ppo` (under
`rlhf.cli.launch`, as users run it), each on 2 ranks (`OMP_NUM_THREADS=1` per rank), and reads the seconds of each
step after the first two (warm-up): TRL's from a step-end callback, ours from `metrics.jsonl`'s `time/step`.

Settings of both: `rl_step.py`'s random Llama of the size (the embedded 64-word tokenizer), the embedded prompts
and copy reward, GRPO with 4 samples x 8 prompts a step (16 per rank), up to 128 new tokens (natural lengths,
EOS ends a sample), temperature 1, top-p 1, no KL term, learning rate 1e-6, fp32, SDPA, one optimizer step per
generation. TRL generates with transformers' `generate` (its default without vLLM); ours with
`--packing_samples --use_dynamic_batch` (OpenRLHF's throughput pair: padding-free rows, and the replicas' training
tokens balanced) and the rollout engine its defaults choose unless the extra flags say otherwise. The
responses are sampled, so their lengths differ between the two: both means are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from rl_step import ROOT, RUN_FLAGS, SAMPLES_PER_STEP, STAGES, build_model_dir, free_port  # noqa: E402

WARMUP = 2


def run_logged(cmd: list[str], log_path: str, what: str) -> None:
    """Run `cmd` from the repository root with one OpenMP thread per process, its output into `log_path`; on
    failure, print the log's tail and exit naming `what`."""
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        with open(log_path) as log:
            sys.stderr.write(log.read()[-6000:])
        sys.exit(f"the {what} run failed (exit {code}); full log: {log_path}")


def trl_run(python: str, model: str, prompts: str, steps: int, work: str) -> tuple[float, float]:
    """(seconds per step after the warm-up, mean completion length) of one TRL run (under torchrun)."""
    out = os.path.join(work, "trl.json")
    run_logged([python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                os.path.join(HERE, "trl_grpo_worker.py"), model, prompts, str(steps), out],
               os.path.join(work, "trl.log"), "TRL")
    with open(out) as f:
        record = json.load(f)
    ends = record["step_ends"]
    per_step = [b - a for a, b in zip(ends, ends[1:])][WARMUP - 1:]
    return statistics.mean(per_step), statistics.mean(record["mean_completion_length"][WARMUP:])


def our_run(model: str, prompts: str, reward: str, steps: int, work: str, extra: list[str]
            ) -> tuple[float, float, str]:
    """(seconds per step after the warm-up, mean response length, each stage's share) of one train_ppo run, on 2
    ranks through the product's launcher (`rlhf.cli.launch`: torchrun with the allocator and OpenMP libraries that
    vLLM's CPU backend asks for preloaded, as a user runs it)."""
    save = os.path.join(work, "ours")
    flags = [*RUN_FLAGS, "--packing_samples", "--use_dynamic_batch", "--pretrain", model, "--prompt_data", prompts,
             "--input_key", "input", "--label_key", "label", "--remote_rm_url", reward, "--max_steps", str(steps),
             "--save_path", save, "--ckpt_path", os.path.join(work, "ckpt"), "--save_steps", "-1",
             "--logging_steps", "1", *extra]
    run_logged([sys.executable, "-m", "rlhf.cli.launch", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), "-m", "rlhf.cli.train_ppo", *flags],
               os.path.join(work, "ours.log"), "train_ppo")
    with open(os.path.join(save, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][WARMUP:]
    step = statistics.mean(r["time/step"] for r in rows)
    shares = ", ".join(f"{stage} {statistics.mean(r[f'time/{stage}'] for r in rows) / step:.0%}" for stage in STAGES)
    return step, statistics.mean(r["response_length"] for r in rows), shares


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", required=True, help="a Python interpreter that imports trl")
    parser.add_argument("--sizes", nargs="+", default=["4m", "30m"], choices=["4m", "30m"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    from rlhf.assets import TINY_DIR

    prompts, reward = str(TINY_DIR / "prompts.jsonl"), str(TINY_DIR / "reward.py")
    print(f"{SAMPLES_PER_STEP} samples a step, 2 ranks, steps {WARMUP + 1}..{args.steps}; extra flags of ours: "
          f"{' '.join(extra) or '(none)'}", flush=True)
    print("| model | round | TRL s/step (samples/s, mean length) | ours s/step (samples/s, mean length) | ours / TRL "
          "| our stages |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as work:
            model = os.path.join(work, "model")
            params = build_model_dir(model, size)
            for round_ in range(1, args.rounds + 1):
                rdir = os.path.join(work, f"round{round_}")
                os.makedirs(rdir)
                trl_s, trl_len = trl_run(args.trl_python, model, prompts, args.steps, rdir)
                our_s, our_len, shares = our_run(model, prompts, reward, args.steps, rdir, extra)
                print(f"| {size} ({params / 1e6:.1f}M) | {round_} | {trl_s:.3f} ({SAMPLES_PER_STEP / trl_s:.1f}, "
                      f"{trl_len:.1f}) | {our_s:.3f} ({SAMPLES_PER_STEP / our_s:.1f}, {our_len:.1f}) | "
                      f"**{trl_s / our_s:.2f}x** | {shares} |", flush=True)


if __name__ == "__main__":
    main()
