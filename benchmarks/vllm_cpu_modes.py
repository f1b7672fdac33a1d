"""vLLM on CPU, eager (`--enforce_eager`) against compiled (torch.compile of the model: vLLM's default and
OpenRLHF's, `--enforce_eager` off), measured in one run: for each model and mode a fresh process builds the
engine the way `train_ppo` does (in-process, external launcher) and times engine start-up, the first generate
call, and the mean of the next calls (P prompts x K samples x T new tokens, every call different seeds), then
pushes new weights and checks that generation follows them (a compiled graph must not keep the old weights).
Prints one row per (model, mode), the ratios compiled/eager, and the calls after which compiled mode's start-up
is paid back. Models: `tiny`, the embedded demo policy (0.14M parameters); `4m` and `30m`, rl_step.py's random
Llamas (3.2M and 30M, the embedded 64-word tokenizer). vLLM caches compiled graphs (~/.cache/vllm, or
VLLM_CACHE_ROOT): a second run of the same model starts faster; point VLLM_CACHE_ROOT and
TORCHINDUCTOR_CACHE_DIR at empty folders to time a first run.

    python benchmarks/vllm_cpu_modes.py [--prompts 64] [--samples 4] [--tokens 16] [--calls 5] [--models tiny,4m,30m]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the other benchmarks' models

from hf_rollout_engine import model_dir  # noqa: E402  (the demo policy, or rl_step.py's random Llama of a size)


def child(path: str, eager: bool, prompts: int, samples: int, tokens: int, calls: int) -> dict:
    """One engine in this process; returns its timings."""
    import torch

    from rlhf.engines.rollout import SamplingSpec, request_seed
    from rlhf.engines.vllm_engine import VLLMEngine
    from rlhf.models.loading import load_tokenizer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + eager))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    tok = load_tokenizer(path)
    ids = [tok(f"copy {i % 10} :", add_special_tokens=False)["input_ids"] for i in range(prompts)]
    start = time.perf_counter()
    engine = VLLMEngine(path, dtype=torch.float32, tp_size=1, seed=1, max_model_len=64,
                        kv_cache_bytes=256 << 20, gpu_memory_utilization=0.0, enforce_eager=eager,
                        enable_prefix_caching=False, enable_sleep=False)
    init_s = time.perf_counter() - start
    spec = SamplingSpec(n=samples, temperature=1.0, top_p=1.0, max_tokens=tokens)
    seconds = []
    for call in range(calls + 1):
        seeds = [request_seed(1, call, i) for i in range(prompts)]
        start = time.perf_counter()
        engine.generate(ids, spec, seeds)
        seconds.append(time.perf_counter() - start)
    # the weights the engine samples with follow a push (zeroed weights: every logit equal)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    greedy = SamplingSpec(n=1, temperature=0.0, top_p=1.0, max_tokens=tokens)
    before = engine.generate(ids[:4], greedy, [0, 1, 2, 3])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    engine.load_weights(list(model.named_parameters()))
    after = engine.generate(ids[:4], greedy, [0, 1, 2, 3])
    follows = [g[0].token_ids for g in before] != [g[0].token_ids for g in after]
    return {"init_s": init_s, "first_call_s": seconds[0], "call_s": sum(seconds[1:]) / calls,
            "weights_follow_push": follows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--models", default="tiny,4m,30m", help="comma-separated: tiny, 4m, 30m")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, mode = args.child.rsplit(":", 1)
        print(json.dumps(child(path, mode == "eager", args.prompts, args.samples, args.tokens, args.calls)))
        return
    rows = {}
    work = tempfile.mkdtemp(prefix="vllm_cpu_modes_")
    try:
        for name in args.models.split(","):
            path = model_dir(name, work)
            for mode in ("eager", "compiled"):
                cmd = [sys.executable, __file__, "--child", f"{path}:{mode}", "--prompts", str(args.prompts),
                       "--samples", str(args.samples), "--tokens", str(args.tokens), "--calls", str(args.calls)]
                out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
                if out.returncode:
                    print(out.stderr[-3000:])
                    raise SystemExit(f"{name} {mode} failed")
                rows[name, mode] = json.loads(out.stdout.strip().splitlines()[-1])
                r = rows[name, mode]
                print(f"{name:5} {mode:8} init {r['init_s']:6.1f} s  first call {r['first_call_s']:6.2f} s  "
                      f"call {r['call_s']:6.3f} s  weights follow a push: {r['weights_follow_push']}", flush=True)
            e, c = rows[name, "eager"], rows[name, "compiled"]
            extra = (c["init_s"] + c["first_call_s"]) - (e["init_s"] + e["first_call_s"])
            saved = e["call_s"] - c["call_s"]
            payback = f"{extra / saved:.0f} calls" if saved > 0 else "never"
            print(f"{name:5} compiled/eager: call {c['call_s'] / e['call_s']:.2f}x, start-up + first call "
                  f"{extra:+.1f} s, paid back after {payback}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
