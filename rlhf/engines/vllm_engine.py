"""In-process vLLM rollout engine (external launcher): one engine per TP group of consecutive ranks.

Requires torch.distributed to be initialised first; every rank of the world must construct one
(vLLM builds its groups over the whole world). Owns the vLLM-specific workarounds measured in
ENVIRONMENT.md: V1 multiprocessing off, explicit KV-cache size on CPU, RNG and threading state
restored after construction, and whole-model weight reloads in one call.
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from collections.abc import Iterable

import torch

from rlhf.engines.rollout import MAX_REQUEST_SEED, Generation, SamplingSpec


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


class _DropRotaryReloadWarning(logging.Filter):
    """vLLM warns on every in-place reload that rotary embeddings (which have no weights) were not
    loaded; the parity test proves the reload is complete, so the line is only noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


def _quiet_vllm_logs() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in ("vllm", "vllm.model_executor.model_loader.reload.layerwise"):
        logger = logging.getLogger(name)
        logger.addFilter(_DropRotaryReloadWarning())
        for handler in logger.handlers:
            handler.addFilter(_DropRotaryReloadWarning())


class VLLMEngine:
    """`RolloutEngine` backed by `vllm.LLM` in this process."""

    def __init__(self, model_path: str, *, dtype: torch.dtype, tp_size: int, seed: int, max_model_len: int,
                 kv_cache_bytes: int, gpu_memory_utilization: float, enforce_eager: bool,
                 enable_prefix_caching: bool, enable_sleep: bool, trust_remote_code: bool = False,
                 max_num_seqs: int | None = None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        _quiet_vllm_logs()
        from vllm import LLM

        _quiet_vllm_logs()
        on_cuda = torch.cuda.is_available()
        kwargs = dict(
            model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
            tensor_parallel_size=tp_size, distributed_executor_backend="external_launcher",
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs", trust_remote_code=trust_remote_code,
            enforce_eager=enforce_eager or not on_cuda,
        )
        if max_num_seqs is not None:
            kwargs.update(max_num_seqs=max_num_seqs)
        if on_cuda:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep)
        else:
            kwargs.update(kv_cache_memory_bytes=kv_cache_bytes)
        set_num_threads = torch.set_num_threads
        num_threads = torch.get_num_threads()
        self.llm = LLM(**kwargs)
        self.sleep_enabled = on_cuda and enable_sleep
        if enable_sleep and not on_cuda:
            warnings.warn("--vllm_enable_sleep has no effect on CPU (vLLM has no sleep mode there)", stacklevel=2)
        # vLLM re-seeds global RNGs, replaces set_num_threads with a no-op and freezes the GC.
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        gc.unfreeze()

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[list[Generation]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert len(seeds) == len(prompts) and all(0 <= s <= MAX_REQUEST_SEED for s in seeds), "one seed per prompt"
        # One SamplingParams per prompt: a single shared seed would give the k-th sample of every prompt
        # the same random stream. vLLM seeds the k-th of a prompt's n samples with seed + k.
        params = [SamplingParams(n=spec.n, temperature=spec.temperature, top_p=spec.top_p,
                                 max_tokens=spec.max_tokens, repetition_penalty=spec.repetition_penalty, logprobs=0,
                                 seed=seed) for seed in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        result = []
        for out in outputs:
            gens = []
            for c in out.outputs:
                ids = list(c.token_ids)
                logprobs = [step[tok].logprob for tok, step in zip(ids, c.logprobs)]
                gens.append(Generation(ids, logprobs, "length" if c.finish_reason == "length" else "stop"))
            result.append(gens)
        return result

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # One call for the whole model: vLLM fuses q/k/v and gate/up, and splitting a fused module's
        # tensors across calls silently corrupts it.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        if self.sleep_enabled:
            self.llm.sleep(level=2)

    def wake_up(self) -> None:
        if self.sleep_enabled:
            self.llm.wake_up()
