"""In-process vLLM rollout engine (external launcher): one engine per TP group of consecutive ranks.

Requires torch.distributed to be initialised first; every rank of the world must construct one
(vLLM builds its groups over the whole world). Owns the vLLM-specific workarounds measured in
ENVIRONMENT.md: V1 multiprocessing off, explicit KV-cache size on CPU, RNG and threading state
restored after construction, and whole-model weight reloads in one call.

Weight push: vLLM whose model runner's `reload_weights` takes `weights_iterator` (checked at start-up; 0.32
here) reloads in place through `collective_rpc("reload_weights", ...)`; older releases (its `reload_weights`
takes no arguments and re-reads the checkpoint) get the tensors through the model's own `load_weights`, as
OpenRLHF does with vLLM 0.17 (CUDA backend only: on CPU that path fails on repacked linear weights).
Sleep mode (CUDA, `--vllm_enable_sleep`, level 2): the engine sleeps right after it is built; a push wakes
the weights first, loads, frees PyTorch's cache, then wakes the KV cache.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import warnings
from collections.abc import Iterable

import torch

from rlhf.engines.rollout import MAX_REQUEST_SEED, Generation, SamplingSpec

RELOAD_IN_PLACE = "reload_weights"
LOAD_WEIGHTS = "load_weights"


def _reload_weights_parameters(worker) -> list[str]:
    """(runs on each vLLM worker) the parameter names of the model runner's `reload_weights`."""
    reload = getattr(worker.model_runner, "reload_weights", None)
    return [] if reload is None else list(inspect.signature(reload).parameters)


def _load_weights_on_worker(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """(runs on each vLLM worker) the fallback push: the model's own `load_weights`."""
    worker.model_runner.model.load_weights(weights=weights)


def weight_push_path(reload_parameters: list[str]) -> str:
    """RELOAD_IN_PLACE when `reload_weights` accepts `weights_iterator`, else LOAD_WEIGHTS (pure)."""
    return RELOAD_IN_PLACE if "weights_iterator" in reload_parameters else LOAD_WEIGHTS


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
        llm = LLM(**kwargs)
        if enable_sleep and not on_cuda:
            warnings.warn("--vllm_enable_sleep has no effect on CPU (vLLM has no sleep mode there)", stacklevel=2)
        # vLLM re-seeds global RNGs, replaces set_num_threads with a no-op and freezes the GC.
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        gc.unfreeze()
        self._attach(llm, sleep_enabled=on_cuda and enable_sleep)

    @classmethod
    def from_llm(cls, llm, *, sleep_enabled: bool) -> VLLMEngine:
        """An engine around an existing `vllm.LLM` (or a stand-in with the same methods, for tests)."""
        engine = cls.__new__(cls)
        engine._attach(llm, sleep_enabled)
        return engine

    def _attach(self, llm, sleep_enabled: bool) -> None:
        """Choose the weight-push path from the worker's `reload_weights` signature, and with sleep on put
        the engine to sleep before anything else (DeepSpeed) allocates device memory."""
        self.llm = llm
        self.sleep_enabled = sleep_enabled
        self.asleep: set[str] = set()  # sleep tags still released: "weights", "kv_cache"
        self.push_path = weight_push_path(llm.collective_rpc(_reload_weights_parameters)[0])
        self.sleep()

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[list[Generation]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert len(seeds) == len(prompts) and all(0 <= s <= MAX_REQUEST_SEED for s in seeds), "one seed per prompt"
        assert "weights" not in self.asleep, "generate after sleep without a weight push: level 2 dropped the weights"
        self._wake({"kv_cache"})
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
        """Push the whole model in one call (vLLM fuses q/k/v and gate/up, and splitting a fused module's
        tensors across calls silently corrupts it). From sleep: weights woken first, the KV cache after the
        push and after PyTorch's cached blocks (the actor's gathers) are returned to the device."""
        self._wake({"weights"})
        if self.push_path == RELOAD_IN_PLACE:
            self.llm.collective_rpc(RELOAD_IN_PLACE, kwargs={"weights_iterator": iter(named_tensors)})
        else:
            self.llm.collective_rpc(_load_weights_on_worker, args=(iter(named_tensors),))
        self.llm.reset_prefix_cache()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._wake({"kv_cache"})

    def sleep(self) -> None:
        """Level 2 (weights discarded, KV cache released); the next `load_weights` must push every weight."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Wake the weights only: the KV cache follows the weight push (`load_weights`), or the next
        `generate` when no push comes."""
        self._wake({"weights"})

    def _wake(self, tags: set[str]) -> None:
        for tag in ("weights", "kv_cache"):  # weights before the KV cache, one tag per call
            if tag in tags and tag in self.asleep:
                self.llm.wake_up(tags=[tag])
                self.asleep.discard(tag)
