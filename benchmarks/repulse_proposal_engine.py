"""RePULSe's proposal q on the rollout engine: one engine with q's weights swapped in and p's pushed back
every step (what `RepulseTrainer.step` does), against a second engine that holds q, measured in one run.

    python benchmarks/repulse_proposal_engine.py [--engine vllm|hf] [--model DIR]
        [--hidden 576 --layers 30 --vocab 49152] [--prompts 8 --samples 8 --new-tokens 16 --repeats 5]

Per RePULSe step, both schemes generate K samples per prompt from p and from q, and both must refresh the
weights of p *and* q after the update (q is trained every step, by CTL). So:
  one engine, swapped:  generate p | push q | generate q | (updates) | push p       (2 pushes, 1 engine)
  two engines:          generate p on E_p | generate q on E_q | (updates) | push p to E_p, push q to E_q
                                                                                      (2 pushes, 2 engines)
Prints the median and best push and generate times of each scheme, push / (push + generate), the bytes
pushed per step (push time scales with parameter bytes, generation with tokens x parameters: extrapolate from
those), the resident memory and build time the second engine adds, and whether the swap gives the same
samples as a dedicated engine (same seeds). vLLM LoRA slots are not built: q is a full copy of the policy,
not an adapter (printed as a note). The vLLM KV cache is sized to hold one whole batch (vLLM on CPU allocates
128-token blocks per sample; the project's 64 MiB default makes a 135M-class model preempt and crawl).

p and q are plain HF models on the host (q = p plus noise); a push streams a private copy of each tensor, as
`DeepSpeedModel.full_parameters` does under ZeRO 0-2 (ZeRO-3 adds a gather: see `weight_sync.py`). The
default model is the embedded tiny policy (`rlhf.assets`); `--hidden/--layers/--vocab` build a random Llama
of that shape instead (with the embedded tokenizer), e.g. SmolLM-135M's 576 x 30 x 49152. One process,
CPU, or one GPU (HF engine; vLLM on CUDA untested here).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_KV_CACHE_BYTES = 64 << 20  # --vllm_kv_cache_bytes's default
CPU_BLOCK_TOKENS = 128  # vLLM's KV-cache block size on CPU (0.32)
MIN_EXTRAPOLATION_BYTES = 64 << 20  # below this a push is mostly per-call overhead
EXAMPLE_PARAMS, EXAMPLE_BYTES_PER_PARAM = 135e6, 2  # SmolLM-135M (the paper's policy) in bf16
LORA_NOTE = ("vLLM LoRA slots (not built): they do not apply. q is a full copy of the policy and CTL trains every "
             "weight of it, so q - p is not a low-rank adapter; the actor pushes full (LoRA-merged) weights. Slots "
             "would fit only if p and q were both adapters on one frozen base (then only adapter bytes would move), "
             "and vLLM loads adapters from a directory per LoRARequest, i.e. a write to disk per q update.")


def rss_mib() -> float:
    """This process's resident set size (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def device_mib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def stream(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, private copy) per parameter: what the actor's `full_parameters()` yields below ZeRO-3."""
    for name, p in model.named_parameters():
        yield name, p.detach().clone()


def perturbed_copy(policy: torch.nn.Module, scale: float = 0.5) -> torch.nn.Module:
    """q: a full copy of p whose weights drifted (noise of `scale` x each tensor's std), as after training."""
    q = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in q.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * float(p.float().std()) * scale
            p.add_(noise.to(p.device, p.dtype))
    return q


def kv_cache_bytes(config, num_seqs: int, max_model_len: int, dtype: torch.dtype, requested: int | None) -> int:
    """The requested size, or the project default grown to hold one whole batch (no preemption in the timings).
    vLLM on CPU allocates in blocks of 128 tokens and the K samples of a prompt do not share blocks here."""
    if requested is not None:
        return requested
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
    tokens_per_seq = -(-max_model_len // CPU_BLOCK_TOKENS) * CPU_BLOCK_TOKENS
    return max(DEFAULT_KV_CACHE_BYTES, int(1.1 * num_seqs * tokens_per_seq * per_token))


def build_engine(args, model_dir: str, device: torch.device, tokenizer, max_model_len: int, kv_bytes: int):
    dtype = DTYPES[args.dtype]
    if args.engine == "vllm":
        from rlhf.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, dtype=dtype, tp_size=1, seed=0, max_model_len=max_model_len,
                          kv_cache_bytes=kv_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
                          enforce_eager=True, enable_prefix_caching=False, enable_sleep=False)
    from rlhf.engines.hf_engine import HFGenerateEngine

    return HFGenerateEngine(model_dir, dtype=dtype, device=device, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)


def measured_build(build: Callable[[], object], device: torch.device) -> tuple[object, dict[str, float | None]]:
    """The engine, and its construction's seconds, RSS growth (MiB) and device-memory growth (MiB, CUDA only)."""
    gc.collect()
    rss, dev, start = rss_mib(), device_mib(device), time.perf_counter()
    engine = build()
    seconds = time.perf_counter() - start
    gc.collect()
    grown_dev = None if dev is None else device_mib(device) - dev
    return engine, {"seconds": seconds, "rss": rss_mib() - rss, "device": grown_dev}


class Run:
    """The two schemes over the same prompts, seeds and weights; per-repeat seconds in `times`, sample
    agreement counts in `matches`."""

    def __init__(self, engine_p, engine_q, p, q, prompts: list[list[int]], spec, device: torch.device) -> None:
        self.engine_p, self.engine_q, self.p, self.q = engine_p, engine_q, p, q
        self.prompts, self.spec, self.device = prompts, spec, device
        self.times: dict[str, list[float]] = {}
        self.matches = {"q differs from p": 0, "swap q == dedicated q": 0, "p after swap-back == p before": 0}

    def warm_up(self) -> None:
        """One untimed generate per engine, on the same seeds: q's weights really differ from p's."""
        seeds = self._seeds(-1)
        self._count("q differs from p", self._generate(self.engine_p, seeds),
                    self._generate(self.engine_q, seeds), equal=False)

    def step(self, repeat: int) -> None:
        seeds_p, seeds_q = self._seeds(repeat), self._seeds(repeat + 10_000)
        e_p, e_q = self.engine_p, self.engine_q
        # one engine, weights swapped (e_p holds p on entry and on exit)
        p_before = self._timed("swap generate p", lambda: self._generate(e_p, seeds_p))
        self._timed("swap push q", lambda: e_p.load_weights(stream(self.q)))
        q_swapped = self._timed("swap generate q", lambda: self._generate(e_p, seeds_q))
        self._timed("swap push p", lambda: e_p.load_weights(stream(self.p)))
        # two engines: each generates from its own weights, and each gets its model's update pushed
        p_after = self._timed("two generate p", lambda: self._generate(e_p, seeds_p))
        q_own = self._timed("two generate q", lambda: self._generate(e_q, seeds_q))
        self._timed("two push p", lambda: e_p.load_weights(stream(self.p)))
        self._timed("two push q", lambda: e_q.load_weights(stream(self.q)))
        self._count("swap q == dedicated q", q_swapped, q_own, equal=True)
        self._count("p after swap-back == p before", p_after, p_before, equal=True)

    def stat(self, reduce: Callable[[list[float]], float], *keys: str) -> float:
        """The sum over `keys` of each stage's reduced (median or best) seconds."""
        return sum(reduce(self.times[k]) for k in keys)

    def _seeds(self, repeat: int) -> list[int]:
        return [(repeat + 1) * 1000 + i for i in range(len(self.prompts))]

    def _generate(self, engine, seeds: list[int]):
        return engine.generate(self.prompts, self.spec, seeds)

    def _timed(self, key: str, fn: Callable[[], object]) -> object:
        seconds, out = timed(fn, self.device)
        self.times.setdefault(key, []).append(seconds)
        return out

    def _count(self, key: str, a, b, equal: bool) -> None:
        pairs = [(x.token_ids, y.token_ids) for ga, gb in zip(a, b) for x, y in zip(ga, gb)]
        self.matches[key] += sum((x == y) == equal for x, y in pairs)


def load_inputs(args, model_dir: str):
    import json

    from transformers import AutoTokenizer

    from rlhf.assets import EMBEDDED_PROMPTS
    from rlhf.models.loading import load_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    with open(EMBEDDED_PROMPTS) as f:
        texts = [json.loads(line)["input"] for line in f][: args.prompts]
    prompts = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    policy = load_causal_lm(model_dir, DTYPES[args.dtype], "sdpa")
    return tokenizer, prompts, policy


def report_times(args, run: Run) -> tuple[float, float]:
    """The scheme table (median and best of the repeats); returns the best swapped (push, generate) seconds."""
    print(f"\n{'scheme':<22}{'stat':>7}{'push s':>9}{'generate s':>12}{'step s':>9}{'push/(push+gen)':>17}")
    steps = {}
    for stat, reduce in (("median", statistics.median), ("best", min)):
        for name, scheme in (("one engine, swapped", "swap"), ("two engines", "two")):
            push = run.stat(reduce, f"{scheme} push q", f"{scheme} push p")
            gen = run.stat(reduce, f"{scheme} generate p", f"{scheme} generate q")
            steps[stat, scheme] = push, gen
            print(f"{name:<22}{stat:>7}{push:>9.3f}{gen:>12.3f}{push + gen:>9.3f}{push / (push + gen):>17.1%}")
    print("per stage, seconds of each repeat:")
    for key, seconds in run.times.items():
        print(f"  {key:<16} " + " ".join(f"{s:.3f}" for s in seconds))
    for stat in ("median", "best"):
        (sp, sg), (tp, tg) = steps[stat, "swap"], steps[stat, "two"]
        print(f"two engines / one engine ({stat}): step {(tp + tg) / (sp + sg):.2f}x, generate {tg / sg:.2f}x, "
              f"push {tp / sp:.2f}x")
    return steps["best", "swap"]


def report_scale(push_bytes: int, push_s: float, tokens: int, generate_s: float) -> None:
    """Throughputs to extrapolate from: pushes scale with parameter bytes, generation with tokens x parameters."""
    bandwidth = push_bytes / (push_s / 2)
    example = EXAMPLE_PARAMS * EXAMPLE_BYTES_PER_PARAM
    if push_bytes < MIN_EXTRAPOLATION_BYTES:
        print(f"push (best): {push_s / 2:.3f} s for {push_bytes / 2**20:.2f} MiB, per-call overhead rather than "
              f"bandwidth; measure bandwidth on a larger model, e.g. --hidden 576 --layers 30 --vocab 49152")
    else:
        print(f"push (best): {bandwidth / 2**30:.2f} GiB/s, i.e. a {EXAMPLE_PARAMS / 1e6:.0f}M model in bf16 "
              f"({example / 1e6:.0f} MB per push) would take ~{example / bandwidth:.2f} s per push, "
              f"~{2 * example / bandwidth:.2f} s per step at this rate")
    print(f"generation (best): {2 * tokens / generate_s:.0f} new tokens/s for this model; another model's "
          f"push/(push+gen) ~ (2 x its bytes / push bandwidth) vs (2 x tokens / its generation rate)")


def report_memory(args, built: list[dict], weight_bytes: int, kv_bytes: int, device: torch.device) -> None:
    """What each engine's construction added (the first also pays one-time start-up: imports, threads)."""
    first, second = built
    expected = f"weights {weight_bytes / 2**20:.1f} MiB"
    if args.engine == "vllm" and device.type == "cpu":
        expected += f" + KV cache {kv_bytes / 2**20:.0f} MiB (kv_cache_memory_bytes)"
    print(f"\nmemory, RSS growth while building: first engine +{first['rss']:.0f} MiB in {first['seconds']:.1f} s "
          f"(with one-time start-up), second engine +{second['rss']:.0f} MiB in {second['seconds']:.1f} s "
          f"(expected: {expected})")
    if first["device"] is not None:
        print(f"device memory, torch.cuda.memory_allocated growth: first +{first['device']:.0f} MiB, "
              f"second +{second['device']:.0f} MiB")
    if args.engine == "vllm" and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        share = args.gpu_memory_utilization
        print(f"vLLM on CUDA: each engine takes gpu_memory_utilization={share} of the GPU ({share * total / 2**30:.1f} "
              f"GiB, weights + KV cache); two engines split one budget")


def engine_version(engine: str) -> str:
    if engine != "vllm":
        return "transformers " + importlib.metadata.version("transformers")
    import vllm

    return f"vllm {vllm.__version__}"


def report(args, run: Run, model: str, built: list[dict], kv_bytes: int, device: torch.device) -> None:
    params = list(run.p.parameters())
    push_bytes = sum(t.numel() * t.element_size() for t in params)
    tokens = args.prompts * args.samples * args.new_tokens
    print(f"\nengine {args.engine} ({engine_version(args.engine)}), device {device}, {os.cpu_count()} CPU cores, "
          f"torch {torch.__version__}")
    print(f"model {model}: {sum(t.numel() for t in params) / 1e6:.2f}M parameters, {args.dtype}; "
          f"{push_bytes / 2**20:.2f} MiB per push, {2 * push_bytes / 2**20:.2f} MiB pushed per RePULSe step (2 pushes)")
    print(f"shape: {args.prompts} prompts x K={args.samples} x {args.new_tokens} new tokens = {tokens} tokens per "
          f"generate, 2 generates per step; {args.repeats} repeats after a warm-up, schemes interleaved")
    push_s, generate_s = report_times(args, run)
    report_scale(push_bytes, push_s, tokens, generate_s)
    report_memory(args, built, push_bytes, kv_bytes, device)
    per_step = args.prompts * args.samples
    totals = {"q differs from p": per_step}
    print("\nsamples, same seeds: " + "; ".join(f"{k}: {v}/{totals.get(k, args.repeats * per_step)}"
                                               for k, v in run.matches.items()))
    print(LORA_NOTE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("vllm", "hf"), default=None, help="default: vllm when installed")
    parser.add_argument("--model", default=None, help="HF model dir; default: the embedded tiny policy")
    parser.add_argument("--hidden", type=int, default=None, help="build a random Llama of this width instead")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="K, samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-cache-mib", type=int, default=None, help="vLLM on CPU; default: fits one batch")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM on CUDA, per engine")
    args = parser.parse_args()
    if args.engine is None:
        from rlhf.engines.rollout import vllm_available

        args.engine = "vllm" if vllm_available() else "hf"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        label = model_dir
        if args.hidden is not None:
            from weight_sync import build_model_dir  # benchmarks/ is on sys.path when run as a script

            build_model_dir(args, tmp)
            model_dir, label = tmp, f"random Llama (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab})"
        if model_dir is None:
            from rlhf.assets import EMBEDDED_MODEL_DIR

            model_dir, label = EMBEDDED_MODEL_DIR, "embedded tiny policy"
        measure(args, model_dir, label)


def measure(args, model_dir: str, label: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    from rlhf.distributed.launch_env import init_distributed, read_launch_env
    from rlhf.engines.rollout import SamplingSpec

    device = init_distributed(read_launch_env())  # vLLM's external launcher reuses the default group
    tokenizer, prompts, p = load_inputs(args, model_dir)
    q = perturbed_copy(p)
    p, q = p.to(device), q.to(device)
    max_model_len = max(map(len, prompts)) + args.new_tokens
    requested = None if args.kv_cache_mib is None else args.kv_cache_mib << 20
    kv_bytes = kv_cache_bytes(p.config, args.prompts * args.samples, max_model_len, DTYPES[args.dtype], requested)
    built = [measured_build(lambda: build_engine(args, model_dir, device, tokenizer, max_model_len, kv_bytes), device)
             for _ in range(2)]
    (engine_p, _), (engine_q, _) = built
    engine_p.load_weights(stream(p))
    engine_q.load_weights(stream(q))
    spec = SamplingSpec(n=args.samples, temperature=1.0, top_p=1.0, max_tokens=args.new_tokens)
    run = Run(engine_p, engine_q, p, q, prompts, spec, device)
    run.warm_up()
    for repeat in range(args.repeats):
        run.step(repeat)
    report(args, run, label, [costs for _, costs in built], kv_bytes, device)


if __name__ == "__main__":
    main()
