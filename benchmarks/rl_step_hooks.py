"""Probes of `rl_step.py`, installed in its own torchrun processes only: per-step seconds of the calls inside
the trainer's stages, when each rank enters and leaves each stage, the arguments of the calls its floors replay,
and the benchmark's fixed response length.

They wrap methods of the product's classes from outside (nothing under rlhf/ changes) and add a
`perf_counter` pair and a list append per call. Steps are keyed 1-based, as in metrics.jsonl. Times are
`time.perf_counter()` (CLOCK_MONOTONIC on Linux, shared by the processes of one machine), so the ranks'
stage boundaries can be compared with each other; each stage also records this process's CPU seconds
(`time.process_time()`, all threads), which a busy machine usually inflates less than wall seconds
(OpenMP threads spinning on shared cores aside).
"""

from __future__ import annotations

import contextlib
import functools
import resource
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

IGNORE_EOS = {"on": False}
"""Whether the engines' generate calls in this process run to `max_tokens` (EOS ignored); read per call."""


class Probe:
    """Seconds per (step, call name) on this rank, (stage name, enter, leave, CPU seconds) of every
    StageTimer stage in order, the process's peak RSS so far at each stage's end, the time each step ended
    (after its logging) and the recorded arguments of the calls the floors replay."""

    def __init__(self) -> None:
        self.step = 0
        self.seconds: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.stages: list[tuple[str, float, float, float]] = []
        self.step_end: dict[int, float] = {}
        self.calls: dict[str, list] = defaultdict(list)
        self.stage_peak_rss: list[tuple[str, int]] = []

    def add(self, name: str, seconds: float) -> None:
        self.seconds[self.step][name] += seconds

    def record(self) -> dict:
        """Everything as plain containers (for torch.save), with this process's peak RSS so far."""
        return {"seconds": {s: dict(v) for s, v in self.seconds.items()}, "stages": list(self.stages),
                "step_end": dict(self.step_end),
                "calls": dict(self.calls), "peak_rss_bytes": peak_rss_bytes(), "threads": torch_threads(),
                "stage_peak_rss": list(self.stage_peak_rss)}


PROBE = Probe()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed_method(owner: type, attr: str, name: str, capture: Callable | None = None) -> None:
    """Wrap `owner.attr` so each call adds its seconds to `name`; `capture(*args)` (if given) is recorded
    under `name` with the step."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if capture is not None:
            PROBE.calls[name].append((PROBE.step, capture(*args, **kwargs)))
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            PROBE.add(name, time.perf_counter() - start)

    setattr(owner, attr, wrapper)


def timed_iterator(owner: type, attr: str, name: str) -> None:
    """Wrap a generator method so the time spent producing its items (not the consumer's) adds to `name`."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args, **kwargs) -> Iterator:
        items = iter(original(*args, **kwargs))
        while True:
            start = time.perf_counter()
            try:
                item = next(items)
            except StopIteration:
                PROBE.add(name, time.perf_counter() - start)
                return
            PROBE.add(name, time.perf_counter() - start)
            yield item

    setattr(owner, attr, wrapper)


def install_ignore_eos() -> None:
    """Make both engine kinds honour `IGNORE_EOS`: vLLM through `SamplingParams(ignore_eos=True)` (the engine
    imports the name at each call, so the module attribute is replaced), HF generate through
    `min_new_tokens = max_new_tokens` (EOS masked until the last token). The product has no such flag."""
    from rlhf.engines.hf_engine import HFGenerateEngine
    from rlhf.engines.vllm_engine import VLLMEngine

    vllm_generate, hf_generate = VLLMEngine.generate, HFGenerateEngine.generate

    @functools.wraps(vllm_generate)
    def vllm_wrapper(self, prompts, spec, seeds):
        import vllm

        if not hasattr(vllm.SamplingParams, "rl_step_original"):
            original = vllm.SamplingParams

            def params(*args, **kwargs):
                return original(*args, ignore_eos=IGNORE_EOS["on"], **kwargs)

            params.rl_step_original = original
            vllm.SamplingParams = params
        return vllm_generate(self, prompts, spec, seeds)

    @functools.wraps(hf_generate)
    def hf_wrapper(self, prompts, spec, seeds):
        self.model.generation_config.min_new_tokens = spec.max_tokens if IGNORE_EOS["on"] else None
        return hf_generate(self, prompts, spec, seeds)

    VLLMEngine.generate, HFGenerateEngine.generate = vllm_wrapper, hf_wrapper


def install_trainer_probes() -> None:
    """Time the calls inside `PPOTrainer.step`'s stages and record what the floors replay: each engine
    generate call's (prompts, spec, seeds), each experience forward's (sequences, mask: the actor's and the
    reference model's) and each optimizer step's micro-batches."""
    import rlhf.trainers.experience as experience_module
    import rlhf.trainers.ppo_trainer as ppo_module
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.engines.hf_engine import HFGenerateEngine
    from rlhf.engines.vllm_engine import VLLMEngine
    from rlhf.trainers.actor import Actor
    from rlhf.utils.logging import MetricsLogger
    from rlhf.utils.timers import StageTimer

    stage = StageTimer.stage

    @contextlib.contextmanager
    def stage_wrapper(self, name: str):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            with stage(self, name):
                yield
        finally:
            PROBE.stages.append((name, start, time.perf_counter(), time.process_time() - cpu))
            PROBE.stage_peak_rss.append((name, peak_rss_bytes()))  # the process's peak so far, at the stage's end

    StageTimer.stage = stage_wrapper
    step = ppo_module.PPOTrainer.step

    @functools.wraps(step)
    def step_wrapper(self, index: int):
        PROBE.step = index + 1
        return step(self, index)

    ppo_module.PPOTrainer.step = step_wrapper
    advance = MetricsLogger.advance

    @functools.wraps(advance)
    def advance_wrapper(self, metrics):
        out = advance(self, metrics)
        PROBE.step_end[PROBE.step] = time.perf_counter()
        return out

    MetricsLogger.advance = advance_wrapper
    for engine_cls in (VLLMEngine, HFGenerateEngine):
        timed_method(engine_cls, "generate", "engine_generate", lambda self, *args: args)
        timed_method(engine_cls, "load_weights", "engine_load_weights")
    timed_method(Actor, "logprobs", "actor_logprobs", lambda self, seq, mask: (seq, mask))
    # the reference model's experience forward (with a KL term): the same architecture, replayed the same way
    timed_method(experience_module, "batched_logprobs", "ref_logprobs", lambda model, seq, mask, *a, **k: (seq, mask))
    timed_method(Actor, "train_batch", "actor_train_batch", lambda self, micro, *a, **k: micro)
    timed_method(DeepSpeedModel, "backward", "ds_backward")
    timed_method(DeepSpeedModel, "step", "ds_step")
    timed_iterator(DeepSpeedModel, "full_parameters", "actor_full_parameters")
    timed_method(experience_module.ExperienceMaker, "_rewards", "reward")
    gather = ppo_module.all_gather_rollout

    @functools.wraps(gather)
    def gather_wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return gather(*args, **kwargs)
        finally:
            PROBE.add("all_gather_rollout", time.perf_counter() - start)

    ppo_module.all_gather_rollout = gather_wrapper
