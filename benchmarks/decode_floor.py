"""Generation's floor below the engine on CPU: vLLM's decode step against the time its linear layers alone take
when their weights come from memory, as in a decode step (every layer's weights read once a step, more bytes than
the cache keeps between steps).

    python benchmarks/decode_floor.py [--sizes 4m 30m] [--prompts 4] [--samples 4] [--tokens 128] [--calls 4]

Per size, one child process (one thread, the LD_PRELOAD a job runs with: `rl_step.preload_env`) on `rl_step.py`'s
random Llama (fp32, the embedded 64-word tokenizer):

1. vLLM, built as `train_ppo` builds it (in-process, compiled, fp32): CALLS `generate` calls of PROMPTS prompts x
   SAMPLES samples (one rank's share in `trl_compare.py`), natural lengths up to TOKENS. A decode step's time is a
   call's seconds over its longest response (the engine steps that many times); the rows a step carries on average
   are the tokens generated over that. Then one more call under torch.profiler splits the step: vLLM's oneDNN
   linear layers (`_C::onednn_mm`), its attention, and the rest (scheduler, input preparation, sampler, outputs).
2. The same model's linear layers in a decode step's order (per layer the fused q/k/v, o, fused gate/up and down,
   then the output head), each its own weight tensor, at the step's average rows and at 1, 4, 8 and 16 rows:
   packed for oneDNN as vLLM's CPU backend packs them (`create_onednn_mm`, the engine's own kernel), and torch's
   `F.linear` (MKL). Each time is a pass over all of them, so each layer's weights come from memory.
3. The machine's read bandwidth (a sum over 256 MiB, one thread) and the weights' bytes over it: the time one
   step needs just to read the weights.

Prints per size: vLLM's step, its linears and its rest; the linears alone at the same rows (the floor of any engine
that reads fp32 weights with these kernels); their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ROWS = (1, 4, 8, 16)
TOP = 12  # the profiled call's operators shown, by their own time


def read_bandwidth() -> float:
    """Bytes/s of one thread summing a 256 MiB fp32 tensor (best of 3)."""
    import torch

    x = torch.ones(64 << 20)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def decode_linears(model_dir: str) -> list:
    """The model's linear weights as one decode step meets them: per layer q/k/v fused, o, gate/up fused, down;
    then the output head."""
    import torch

    from rlhf.models.loading import load_causal_lm

    model = load_causal_lm(model_dir, torch.float32, "sdpa", False)
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight,
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
    weights.append(model.lm_head.weight)
    return [w.detach().contiguous() for w in weights]


def linears_seconds(weights: list, rows: int, kernel: str, repeats: int = 8) -> float:
    """Seconds of one pass over every weight at `rows` input rows (median of `repeats` passes, after one)."""
    import torch
    import torch.nn.functional as F
    from vllm import _custom_ops as ops

    if kernel == "onednn":
        handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        calls = [lambda x, h=h: ops.onednn_mm(h, x, None) for h in handlers]
    else:
        calls = [lambda x, w=w: F.linear(x, w) for w in weights]
    inputs = [torch.randn(rows, w.shape[1]) for w in weights]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for call, x in zip(calls, inputs):
            call(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def vllm_steps(model_dir: str, prompts: int, samples: int, tokens: int, calls: int) -> dict:
    """vLLM's decode step: seconds per step, rows per step, and the profiled split of one more call."""
    import torch
    import torch.distributed as dist

    from rlhf.engines.rollout import SamplingSpec, request_seed
    from rlhf.engines.vllm_engine import VLLMEngine
    from rlhf.models.loading import load_tokenizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("DECODE_FLOOR_PORT", "29741"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    engine = VLLMEngine(model_dir, dtype=torch.float32, tp_size=1, seed=1, max_model_len=256,
                        kv_cache_bytes=256 << 20, gpu_memory_utilization=0.0, enforce_eager=False,
                        enable_prefix_caching=False, enable_sleep=False)
    tok = load_tokenizer(model_dir)
    ids = [tok(f"copy {i % 10} {i} :", add_special_tokens=False)["input_ids"] for i in range(prompts)]
    spec = SamplingSpec(n=samples, temperature=1.0, top_p=1.0, max_tokens=tokens)

    def call(index: int) -> tuple[float, int, int]:
        start = time.perf_counter()
        out = engine.generate(ids, spec, [request_seed(1, index, i) for i in range(prompts)])
        lengths = [len(g.token_ids) for per_prompt in out for g in per_prompt]
        return time.perf_counter() - start, max(lengths), sum(lengths)

    call(0)  # warm-up (the compiled graphs' first shapes)
    seconds, steps, generated = map(sum, zip(*(call(1 + i) for i in range(calls))))
    with torch.profiler.profile() as prof:
        profiled_s, profiled_steps, _ = call(1 + calls)
    own = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    linears = sum(v for k, v in own.items() if "onednn_mm" in k)
    attention = sum(v for k, v in own.items() if "cpu_attention" in k or "cpu_attn" in k)
    top = sorted(own.items(), key=lambda kv: -kv[1])[:TOP]
    return {"step_s": seconds / steps, "rows": generated / steps, "calls": calls, "mean_longest": steps / calls,
            "profiled_step_s": profiled_s / profiled_steps, "linears_share": linears / profiled_s,
            "attention_share": attention / profiled_s,
            "top": [(name, t / profiled_steps, t / profiled_s) for name, t in top]}


def child(size: str, args: argparse.Namespace) -> dict:
    import torch
    from rl_step import build_model_dir

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        params = build_model_dir(work, size)
        engine = vllm_steps(work, args.prompts, args.samples, args.tokens, args.calls)
        weights = decode_linears(work)
    rows = sorted({*ROWS, max(1, round(engine["rows"]))})
    # JSON keys are strings: rows as text
    linears = {kernel: {str(r): linears_seconds(weights, r, kernel) for r in rows} for kernel in ("onednn", "F.linear")}
    weight_bytes = sum(w.numel() * 4 for w in weights)
    return {"size": size, "params": params, "weight_bytes": weight_bytes, "bandwidth": read_bandwidth(),
            "engine": engine, "linears": linears, "step_rows": str(max(1, round(engine["rows"])))}


def report(r: dict) -> None:
    e, step_rows = r["engine"], r["step_rows"]
    floor = r["linears"]["onednn"][step_rows]
    print(f"\n== {r['size']} ({r['params'] / 1e6:.1f}M parameters, {r['weight_bytes'] / 2**20:.1f} MiB of linear "
          f"weights a step) ==")
    print(f"vLLM decode step: {e['step_s'] * 1e3:.2f} ms ({e['calls']} calls, longest response {e['mean_longest']:.0f}"
          f" tokens on average, {e['rows']:.1f} rows a step on average)")
    print(f"  profiled call: {e['profiled_step_s'] * 1e3:.2f} ms a step; oneDNN linears "
          f"{e['linears_share']:.0%}, attention {e['attention_share']:.0%}, the rest (scheduler, inputs, sampler, "
          f"outputs, the graph's other ops) {1 - e['linears_share'] - e['attention_share']:.0%}")
    print("  its operators by own time, ms a step (share of the call): " + "; ".join(
        f"{name} {t * 1e3:.2f} ({share:.0%})" for name, t, share in e["top"]))
    print(f"linears alone, weights from memory, ms a step ({len(r['linears']['onednn'])} row counts):")
    print("| rows | " + " | ".join(str(n) for n in r["linears"]["onednn"]) + " |")
    print("| --- |" + " --- |" * len(r["linears"]["onednn"]))
    for kernel, times in r["linears"].items():
        print(f"| {kernel} | " + " | ".join(f"{t * 1e3:.2f}" for t in times.values()) + " |")
    print(f"reading the weights once at {r['bandwidth'] / 1e9:.1f} GB/s (one thread's sum over 256 MiB): "
          f"{r['weight_bytes'] / r['bandwidth'] * 1e3:.2f} ms")
    print(f"vLLM's step / oneDNN linears at {step_rows} rows: {e['step_s'] / floor:.2f}x "
          f"({e['step_s'] * 1e3:.2f} against {floor * 1e3:.2f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["4m", "30m"], choices=["4m", "30m"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)), flush=True)
        return
    import torch
    from rl_step import preload_env

    env = {**os.environ, **preload_env(), "OMP_NUM_THREADS": "1"}
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, one thread, LD_PRELOAD {env.get('LD_PRELOAD', '')}; "
          f"{args.prompts} prompts x {args.samples} samples, up to {args.tokens} new tokens")
    for size in args.sizes:
        flags = ["--child", size, "--prompts", str(args.prompts), "--samples", str(args.samples),
                 "--tokens", str(args.tokens), "--calls", str(args.calls)]
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *flags], env=env, capture_output=True,
                              text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
            sys.exit(f"the {size} child failed (exit {done.returncode})")
        report(json.loads(lines[-1][len("RESULT "):]))


if __name__ == "__main__":
    main()
