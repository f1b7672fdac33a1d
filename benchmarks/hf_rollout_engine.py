"""The HF rollout engine (no vLLM): the previous per-prompt loop over `model.generate` against the batched
decode of `HFGenerateEngine`, same model and weights, in one run.

    python benchmarks/hf_rollout_engine.py [--models tiny 4m] [--shapes 64x4 16x4] [--new-tokens 64]
        [--repeats 3] [--threads N]

Per model and shape (prompts x samples per prompt): tokens per second of each path (generated tokens, EOS
included, over seconds of the `generate` call; best of the repeats, the two paths interleaved), and the ratio
new / old. Prompts are the embedded tiny prompts (`rlhf/assets/tiny/prompts.jsonl`), temperature 1, top-p 1,
per-prompt seeds as the PPO trainer derives them. The two paths draw different random streams, so their samples
(and token counts) differ; both are printed. Models: `tiny` is the embedded demo policy (`rlhf.assets`, 2 layers,
hidden 64, 256 positions); `4m` is rl_step.py's random Llama (4 layers, hidden 256, the embedded 64-word
tokenizer). One process, CPU (or `--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rlhf.assets import EMBEDDED_MODEL_DIR, EMBEDDED_PROMPTS  # noqa: E402
from rlhf.engines.hf_engine import HFGenerateEngine  # noqa: E402
from rlhf.engines.rollout import Generation, SamplingSpec, request_seed  # noqa: E402
from rlhf.models.loading import load_tokenizer  # noqa: E402


@torch.no_grad()
def old_generate_one(model, prompt: list[int], spec: SamplingSpec, eos: int, pad: int,
                     device: torch.device) -> list[Generation]:
    """The engine before batching (verbatim): one `model.generate` call for the n samples of one prompt."""
    input_ids = torch.tensor([prompt] * spec.n, device=device)
    greedy = spec.temperature == 0
    sampling = {} if greedy else dict(temperature=spec.temperature, top_p=spec.top_p, top_k=0)
    out = model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=not greedy, **sampling,
        repetition_penalty=spec.repetition_penalty, max_new_tokens=spec.max_tokens,
        eos_token_id=eos, pad_token_id=pad, use_cache=True,
        output_logits=True, return_dict_in_generate=True,
    )
    new_BT = out.sequences[:, len(prompt):]
    logprobs_BT = torch.stack(out.logits, dim=1).float().div(1.0 if greedy else spec.temperature).log_softmax(-1)
    picked_BT = logprobs_BT.gather(-1, new_BT[:, :, None]).squeeze(-1)
    gens = []
    for b in range(spec.n):
        ids = new_BT[b].tolist()
        stop = ids.index(eos) + 1 if eos in ids else len(ids)
        reason = "stop" if stop < len(ids) or (ids and ids[-1] == eos) else "length"
        gens.append(Generation(ids[:stop], picked_BT[b, :stop].tolist(), reason))
    return gens


def old_generate(engine: HFGenerateEngine, prompts: list[list[int]], spec: SamplingSpec,
                 seeds: list[int]) -> list[list[Generation]]:
    """The previous `HFGenerateEngine.generate`: prompts one after another, global RNG re-seeded per prompt."""
    devices = [engine.device] if engine.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        gens = []
        for prompt, seed in zip(prompts, seeds):
            torch.manual_seed(seed)
            gens.append(old_generate_one(engine.model, prompt, spec, engine.eos_token_id, engine.pad_token_id,
                                         engine.device))
        return gens


def model_dir(name: str, work: str) -> str:
    if name == "tiny":
        return EMBEDDED_MODEL_DIR
    from rl_step import build_model_dir  # benchmarks/ is on sys.path

    out = os.path.join(work, name)
    build_model_dir(out, name)
    return out


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    gens = fn()
    seconds = time.perf_counter() - start
    return seconds, sum(len(g.token_ids) for gs in gens for g in gs)


def measure(engine: HFGenerateEngine, prompts: list[list[int]], spec: SamplingSpec, repeats: int) -> dict:
    seeds = [request_seed(0, 0, i) for i in range(len(prompts))]
    engine.generate(prompts[:2], spec, seeds[:2])  # warm-up
    best = {"old": (float("inf"), 0), "new": (float("inf"), 0)}
    for _ in range(repeats):
        for name, fn in (("old", lambda: old_generate(engine, prompts, spec, seeds)),
                         ("new", lambda: engine.generate(prompts, spec, seeds))):
            seconds, tokens = timed(fn)
            best[name] = min(best[name], (seconds, tokens))
    row = {f"{k}_{name}": v for name, (s, t) in best.items() for k, v in (("s", s), ("tokens", t), ("tps", t / s))}
    row["ratio"] = row["tps_new"] / row["tps_old"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "4m"], choices=["tiny", "4m", "30m"])
    parser.add_argument("--shapes", nargs="+", default=["64x4", "16x4"], help="PROMPTSxSAMPLES")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    with open(EMBEDDED_PROMPTS) as f:
        texts = [json.loads(line)["input"] for line in f]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}, "
          f"{args.new_tokens} new tokens, temperature 1, top_p 1")
    print(f"{'model':6} {'shape':6} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8}  "
          "old s (tokens)   new s (tokens)")
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            engine = HFGenerateEngine(model_dir(name, work), dtype=torch.float32, device=device,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            for shape in args.shapes:
                num_prompts, n = (int(x) for x in shape.split("x"))
                prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:num_prompts]]
                spec = SamplingSpec(n=n, temperature=1.0, top_p=1.0, max_tokens=args.new_tokens)
                r = measure(engine, prompts, spec, args.repeats)
                print(f"{name:6} {shape:6} {r['tps_old']:10.0f} {r['tps_new']:10.0f} {r['ratio']:7.1f}x  "
                      f"{r['s_old']:6.2f} ({r['tokens_old']:5d})   {r['s_new']:6.2f} ({r['tokens_new']:5d})",
                      flush=True)


if __name__ == "__main__":
    main()
