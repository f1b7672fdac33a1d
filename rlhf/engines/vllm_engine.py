"""In-process vLLM rollout engine (external launcher): one engine per TP group of consecutive ranks.

Requires torch.distributed to be initialised first; every rank of the world must construct one
(vLLM builds its groups over the whole world). Owns the vLLM-specific workarounds measured in
ENVIRONMENT.md: V1 multiprocessing off, explicit KV-cache size on CPU, RNG and threading state
restored after construction, and whole-model weight reloads in one call.

Weight push, path chosen at start-up: an unquantized model without LoRA (`_copy_in_place_supported`) takes
the direct copy (`_copy_weights_on_worker`: the model's `load_weights` copies into the live parameters, then
the layers vLLM post-processes, on CPU the oneDNN-packed linears, are processed again as at start-up);
otherwise vLLM whose model runner's `reload_weights` takes `weights_iterator` (0.32 here) reloads in place
through `collective_rpc("reload_weights", ...)`; older releases (its `reload_weights` takes no arguments and
re-reads the checkpoint) get the tensors through the model's own `load_weights` alone, as OpenRLHF does with
vLLM 0.17 (CUDA backend only: on CPU that fails on the packed linear weights, which the direct copy restores).
Sleep mode (CUDA, `--vllm_enable_sleep`, level 2): the engine sleeps right after it is built; a push wakes
the weights first, loads, frees PyTorch's cache, then wakes the KV cache.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import warnings
from collections.abc import Callable, Iterable

import torch

from rlhf.distributed.launch_env import close_before_groups
from rlhf.engines.rollout import MAX_REQUEST_SEED, Generation, SamplingSpec
from rlhf.engines.weight_sync import CheckpointLayout
from rlhf.utils.console import native_output_routed
from rlhf.utils.heap import freeze_heap

COPY_IN_PLACE = "copy_in_place"
RELOAD_IN_PLACE = "reload_weights"
LOAD_WEIGHTS = "load_weights"


def _reload_weights_parameters(worker) -> list[str]:
    """(runs on each vLLM worker) the parameter names of the model runner's `reload_weights`."""
    reload = getattr(worker.model_runner, "reload_weights", None)
    return [] if reload is None else list(inspect.signature(reload).parameters)


def _load_weights_on_worker(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """(runs on each vLLM worker) the fallback push: the model's own `load_weights`."""
    worker.model_runner.model.load_weights(weights=weights)


def _reprocessed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers whose quant method post-processes loaded weights (on CPU: packs them for oneDNN)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), QuantizeMethodBase)]


def _copy_in_place_supported(worker) -> bool:
    """(runs on each vLLM worker) whether `_copy_weights_on_worker` reproduces a fresh load for this model: no
    quantization, LoRA or model-level post-load hook; every post-processing layer unquantized (its processing
    only derives kernel state from checkpoint-format weights) with recorded checkpoint-format metadata; no
    attention layer other than plain `Attention` (MLA derives weights from kv_b_proj after loading)."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else None  # a stand-in runner has none
    if not isinstance(model, torch.nn.Module):
        return False
    try:  # vLLM internals (0.32's layer-wise reload records); another release takes `reload_weights`
        from vllm.model_executor.layers.attention import Attention, is_deferred_attention_layer
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor  # noqa: F401
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs  # noqa: F401
    except ImportError:
        return False

    config = runner.vllm_config
    if config.model_config.quantization is not None or config.lora_config is not None:
        return False
    if hasattr(model, "process_weights_after_loading"):
        return False
    if any(is_deferred_attention_layer(m) and type(m) is not Attention for m in model.modules()):
        return False
    return all(type(m.quant_method) in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
               and m in LAYERWISE_INFO for m in _reprocessed_layers(model))


def _rematerialize_checkpoint_params(layer: torch.nn.Module) -> None:
    """Give back `layer` the checkpoint-format parameters its post-processing removed or reshaped (on CPU a
    linear's weight becomes an empty tensor once oneDNN holds the packed copy), fresh and uninitialised, with
    their weight loaders; parameters still in checkpoint format stay, and are then loaded in place."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    info = LAYERWISE_INFO[layer]
    for name, meta in info.restore_metadata[0].items():
        live = layer._parameters.get(name)
        if live is not None and live.shape == meta.shape and live.dtype == meta.dtype:
            continue
        with info.restore_device:
            setattr(layer, name, restore_layer_refs(materialize_meta_tensor(meta), layer))


def _copy_weights_on_worker(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """(runs on each vLLM worker) the push when `_copy_in_place_supported`: the model's own `load_weights` copies
    each tensor into its parameter on arrival (fused q/k/v and gate/up by vLLM's shard loaders), then each
    post-processing layer is processed again, as at start-up. vLLM's `reload_weights` does the same through a
    layer-wise buffer that first moves every tensor to the meta device, binds and replays each loader call
    and copies the result back; that bookkeeping made the engine's side of a push 1.3x (a 134M model) to 2x (a
    3M one) slower on CPU (benchmarks/README.md).
    Checks that every parameter was loaded: a partial push would leave the engine on stale weights silently.
    Memory: on CPU the unpacked linear weights of the whole model exist at once during the push (one extra copy
    of them at peak, besides the packed ones); on CUDA nothing is allocated (processing is a no-op there)."""
    runner = worker.model_runner
    model = runner.get_model()
    layers = _reprocessed_layers(model)
    for layer in layers:
        _rematerialize_checkpoint_params(layer)
    loaded = model.load_weights(weights)
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)
        if hasattr(layer, "update_param_tp_status"):  # as vLLM's loader: processing may re-create parameters
            layer.update_param_tp_status()
    missing = {name for name, _ in model.named_parameters()} - set(loaded)
    if missing:
        raise RuntimeError(f"weight push left {len(missing)} engine parameters unloaded: {sorted(missing)[:5]}")
    runner.reset_encoder_cache()
    runner.reset_mm_cache()


def _cpu_prepacked_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(MoE layer, its experts kernel) for every layer whose experts prepack their weights on CPU at start-up."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # another vLLM release, or a CUDA build without the CPU experts
        return []
    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            found.append((module, experts))
    return found


def _repack_cpu_experts_on_worker(worker) -> int:
    """(runs on each vLLM worker, after `reload_weights`) prepack the MoE experts' weights again. vLLM 0.32's
    CPU experts prepack w13/w2 into their grouped-GEMM layout once, when the kernel is built; a weight update
    copies checkpoint-layout weights into those parameters and does not prepack them (the kernel is not rebuilt:
    `UnquantizedFusedMoEMethod._setup_kernel`), so every expert computes with scrambled weights (measured on the
    zoo's Mixtral: log-probs off by 2.9 nats after pushing the engine's own weights back). The same class of bug
    as vllm-project/vllm#42821 on the FlashInfer backends. Returns the number of layers repacked."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else None  # a stand-in runner has none
    layers = _cpu_prepacked_experts(model) if isinstance(model, torch.nn.Module) else []
    for layer, experts in layers:
        experts.process_weights_after_loading(layer)
    return len(layers)


def weight_push_path(reload_parameters: list[str], copy_in_place: bool = False) -> str:
    """COPY_IN_PLACE when the worker supports it (`_copy_in_place_supported`), else RELOAD_IN_PLACE when
    `reload_weights` accepts `weights_iterator`, else LOAD_WEIGHTS (pure)."""
    if copy_in_place:
        return COPY_IN_PLACE
    return RELOAD_IN_PLACE if "weights_iterator" in reload_parameters else LOAD_WEIGHTS


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


def kv_cache_shortfall(kv_cache_bytes: int, num_blocks: int, block_size: int, max_model_len: int,
                       sequences: int) -> str | None:
    """Why a CPU engine's KV cache of `num_blocks` blocks of `block_size` tokens (from `kv_cache_bytes`) is too
    small for `sequences` sequences of `max_model_len` tokens at once, with the size that would hold them; None
    when it is large enough. vLLM then schedules fewer sequences at a time, and preempts and recomputes those
    that outgrow the cache: generation can be many times slower."""
    blocks_per_sequence = -(-max_model_len // block_size)
    fit = num_blocks // blocks_per_sequence
    if fit >= sequences:
        return None
    need = -(-sequences * blocks_per_sequence * kv_cache_bytes // num_blocks)
    return (f"--vllm_kv_cache_bytes {kv_cache_bytes} ({kv_cache_bytes / 2**20:.3g} MiB) holds {fit} sequences of "
            f"{max_model_len} tokens (the longest prompt plus the longest generation) at once, fewer than the "
            f"{sequences} each engine would run at once in a generate call: vLLM runs the rest later or preempts and "
            f"recomputes them, which can make generation many times slower. Set --vllm_kv_cache_bytes {need} "
            f"({need / 2**20:.3g} MiB) or more if memory allows.")


def tag_cpu_shm_names(tag: str) -> None:
    """Put this run's tag (`RLHF_RUN_TAG`, agreed by every rank in `init_distributed`) in the names of vLLM's CPU
    tensor-parallel shared-memory segments. vLLM names them after the group's ranks only (an external launcher's
    init method is `env://`, so every run on a machine gets `/dev/shm/-tp:0-[0-1]-cpushm...`): two runs at once
    would share them, and the segments a killed run leaves behind break the next run of the same layout."""
    if not tag:
        raise RuntimeError("RLHF_RUN_TAG is not set: a CPU vLLM engine of TP > 1 needs init_distributed first")
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    untagged = getattr(shm, "_rlhf_untagged", None) or shm.make_group_name
    shm._rlhf_untagged = untagged
    # a shared-memory name has no "/" past its first character (vLLM's starts with the "//" of `env://`)
    shm.make_group_name = staticmethod(lambda communicator: f"rlhf{tag}" + untagged(communicator).replace("/", ""))


def _shutdown_at_exit(llm) -> Callable[[], None]:
    """Shuts the in-process engine core down at exit (once: vLLM's own finalizer is detached by it); it destroys
    vLLM's groups and then the default group, while they all exist. It holds the engine core until then: vLLM's
    finalizer, run whenever the garbage collector reaches an engine nothing else holds, would destroy the default
    group under a process that goes on (the next job of a process that runs several, as the tests do).

    vLLM's shutdown unfreezes the garbage collector's heap and collects it twice: 1-3 s a rank on 2 CPU cores, to
    free objects of a process that is about to end. Everything alive is frozen first and stays frozen through it
    (as `rlhf.cli.entry_point.end_program` means it to), so those collections walk nothing."""
    engine_core = llm.llm_engine.engine_core

    def shutdown() -> None:
        gc.freeze()
        unfreeze, gc.unfreeze = gc.unfreeze, lambda: None
        try:
            engine_core.shutdown()
        finally:
            gc.unfreeze = unfreeze

    return shutdown


def register_cpu_kernels_once() -> None:
    """Register vLLM's C++ stand-ins for its Triton kernels (its CPU platform's `register_triton_kernel_overrides`)
    in this process once; later calls, vLLM's own at each engine's worker start among them, do nothing. vLLM
    registers them at every worker start, each time with a scan of every attribute of every module loaded (about
    6000 with torch, transformers and DeepSpeed: 0.3-0.7 s a rank on 2 CPU cores) and each time over the stand-ins
    of the last time (with a warning per kernel). The launcher's warm start calls this before it forks the workers
    (`rlhf.cli.warm_start.prepare_workers`), so they inherit the registration; a new interpreter registers them at
    its first engine. A no-op where the platform has no stand-ins (CUDA)."""
    from vllm.platforms import current_platform

    # read from the class and the instance's own attributes: a vLLM platform answers any other attribute through
    # torch's device module, with a warning where it has none
    register = getattr(type(current_platform), "register_triton_kernel_overrides", None)  # None: a vLLM without
    if register is None or vars(current_platform).get("_rlhf_kernels_registered", False):
        return
    register()
    current_platform.register_triton_kernel_overrides = lambda: None  # this process's platform object only
    current_platform._rlhf_kernels_registered = True


class VLLMEngine:
    """`RolloutEngine` backed by `vllm.LLM` in this process."""

    eager_sampler = False
    """Generate with every torch.compile'd function run eagerly (`--enforce_eager` on CPU, which promises no
    torch.compile at all): vLLM's sampler compiles a helper of its own (each sampled token's rank,
    `batched_count_greater_than`) at the first call for log-probs, 2-4 s of Inductor per engine start on 2 cores."""

    def __init__(self, model_path: str, *, dtype: torch.dtype, tp_size: int, seed: int, max_model_len: int,
                 kv_cache_bytes: int, gpu_memory_utilization: float, enforce_eager: bool,
                 enable_prefix_caching: bool, enable_sleep: bool, trust_remote_code: bool = False,
                 max_num_seqs: int | None = None, sequences_per_call: int = 0) -> None:
        """sequences_per_call: how many sequences one generate call of this engine samples (0: unknown); on CPU,
        a KV cache (kv_cache_bytes) too small to hold them all at max_model_len tokens is warned about."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not torch.cuda.is_available():
            # vLLM 0.32's CPU build saves its AOT-compiled model but cannot load it back ("'function' object has no
            # attribute 'finalize_loading'"): every engine start compiled the model again (about 10 CPU-seconds).
            # Its older compile cache loads; a user's own setting wins.
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        _quiet_vllm_logs()
        from vllm import LLM

        freeze_heap()  # vLLM's modules too, as the job's libraries (`rlhf.cli.entry_point.deferred`)
        _quiet_vllm_logs()
        on_cuda = torch.cuda.is_available()
        kwargs = dict(
            model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
            tensor_parallel_size=tp_size, distributed_executor_backend="external_launcher",
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs", trust_remote_code=trust_remote_code,
            enforce_eager=enforce_eager,  # on CPU too, as OpenRLHF (benchmarks/vllm_cpu_modes.py)
        )
        if max_num_seqs is not None:
            kwargs.update(max_num_seqs=max_num_seqs)
        if on_cuda:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep)
        else:
            kwargs.update(kv_cache_memory_bytes=kv_cache_bytes)
        if not on_cuda and tp_size > 1:
            tag_cpu_shm_names(os.environ.get("RLHF_RUN_TAG", ""))
        register_cpu_kernels_once()
        set_num_threads = torch.set_num_threads
        num_threads = torch.get_num_threads()
        # on CPU vLLM's extension warns of its NUMA binding from C++ on every rank: routed as library output
        with native_output_routed() if not on_cuda else contextlib.nullcontext():
            llm = LLM(**kwargs)
        if enable_sleep and not on_cuda:
            warnings.warn("--vllm_enable_sleep has no effect on CPU (vLLM has no sleep mode there)", stacklevel=2)
        if not on_cuda and sequences_per_call:
            cache, scheduler = llm.llm_engine.vllm_config.cache_config, llm.llm_engine.vllm_config.scheduler_config
            note = kv_cache_shortfall(kv_cache_bytes, cache.num_gpu_blocks, cache.block_size, max_model_len,
                                      min(sequences_per_call, scheduler.max_num_seqs))
            if note:
                warnings.warn(note, stacklevel=2)
        # vLLM re-seeds global RNGs and replaces set_num_threads with a no-op. It also freezes the GC after
        # collecting (its heap: the engine and its model, alive as long as the engine): kept, as after our
        # own freezes.
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        close_before_groups(_shutdown_at_exit(llm))
        self._attach(llm, sleep_enabled=on_cuda and enable_sleep)
        self.eager_sampler = enforce_eager and not on_cuda
        self.checkpoint_layout = CheckpointLayout(model_path, trust_remote_code)

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
        self.checkpoint_layout = CheckpointLayout(None)
        self.sleep_enabled = sleep_enabled
        self.asleep: set[str] = set()  # sleep tags still released: "weights", "kv_cache"
        self.push_path = weight_push_path(llm.collective_rpc(_reload_weights_parameters)[0],
                                          all(llm.collective_rpc(_copy_in_place_supported)))
        self.sleep()

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[list[Generation]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert len(seeds) == len(prompts) and all(0 <= s <= MAX_REQUEST_SEED for s in seeds), "one seed per prompt"
        assert "weights" not in self.asleep, "generate after sleep without a weight push: level 2 dropped the weights"
        self._wake({"kv_cache"})
        # One SamplingParams per prompt: a single shared seed would give the k-th sample of every prompt
        # the same random stream. vLLM seeds the k-th of a prompt's n samples with seed + k. No detokenizing:
        # only the token ids are read (vLLM's text of each new token costs 3% of a decode step on CPU).
        params = [SamplingParams(n=spec.n, temperature=spec.temperature, top_p=spec.top_p,
                                 max_tokens=spec.max_tokens, repetition_penalty=spec.repetition_penalty, logprobs=0,
                                 seed=seed, detokenize=False) for seed in seeds]
        with torch.compiler.set_stance("force_eager") if self.eager_sampler else contextlib.nullcontext():
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
        named_tensors = self.checkpoint_layout(named_tensors)  # vLLM reads the checkpoint files' names
        if self.push_path == COPY_IN_PLACE:
            self.llm.collective_rpc(_copy_weights_on_worker, args=(iter(named_tensors),))
        elif self.push_path == RELOAD_IN_PLACE:
            self.llm.collective_rpc(RELOAD_IN_PLACE, kwargs={"weights_iterator": iter(named_tensors)})
            if not torch.cuda.is_available():
                self.llm.collective_rpc(_repack_cpu_experts_on_worker)
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
