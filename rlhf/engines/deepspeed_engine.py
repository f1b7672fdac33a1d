"""A trainable HF model on DeepSpeed: ZeRO 0-3, AdamW, LR schedule, clipping, checkpointed activations.

Owns the DeepSpeed config and engine of one role over that role's data-parallel group. Knows
nothing about RL: callers compute losses. `backward` takes a loss already normalised by the global
token count of the optimizer step and undoes DeepSpeed's own averaging, so the gradient is the
same for any split of the step over DP ranks and micro-batches.

A model built with LoRA adapters (`adapt`, see `rlhf.models.lora`) trains only its adapters: the optimizer and
the checkpoints hold them alone, `full_parameters` and `gathered_state_dict` give the merged weights under the
base model's names, and `save_hf` writes the adapter.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext

import deepspeed
import torch
import torch.distributed as dist

from rlhf.config.errors import UsageError
from rlhf.config.shared_config import EngineConfig, OptimConfig
from rlhf.engines import portable_state
from rlhf.engines.deepspeed_compat import (
    arch_list_for_deepspeed_builds,
    barriers_scoped_to,
    build_cpu_comm_op,
    hpz_scoped_to,
    use_tensor_parallel_groups,
    zero3_construction,
)
from rlhf.engines.weight_ema import WeightEMA
from rlhf.models import lora
from rlhf.utils.checkpoint_files import decided_by_rank0
from rlhf.utils.snapshot import Snapshot


def ds_config(engine: EngineConfig, optim: OptimConfig, *, bf16: bool, micro_batch_size: int,
              grad_accum_steps: int, fp16: bool = False) -> dict:
    """The DeepSpeed JSON config for one trainable model (pure)."""
    zero: dict = {"stage": engine.zero_stage, "overlap_comm": engine.overlap_comm,
                  "reduce_bucket_size": "auto" if engine.zero_stage == 3 else 5e8,
                  "zero_hpz_partition_size": engine.zpg}
    if engine.zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=5e7,
                    stage3_max_live_parameters=1e9, stage3_gather_16bit_weights_on_model_save=True)
        zero["reduce_bucket_size"] = 5e8
    if engine.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": optim.max_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": fp16},
        "data_types": {"grad_accum_dtype": engine.grad_accum_dtype},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronizes the device at every micro-batch's forward and step, for
        # figures nothing reads (our own timers and perf/* do not sync): off, so the host can run ahead
        "timers": {"throughput": {"enabled": False}},
    }


def _scheduler(optimizer, optim: OptimConfig, num_optimizer_steps: int):
    from transformers import get_scheduler

    kwargs = {"min_lr_rate": optim.lr_floor_ratio} if optim.lr_scheduler == "cosine_with_min_lr" else None
    return get_scheduler(optim.lr_scheduler, optimizer,
                         num_warmup_steps=math.ceil(optim.lr_warmup_ratio * num_optimizer_steps),  # as OpenRLHF
                         num_training_steps=num_optimizer_steps, scheduler_specific_kwargs=kwargs)


def offload_include(zero_stage: int, adam_offload: bool) -> list[str]:
    """DeepSpeed `OffloadStateTypeEnum` names a trainable ZeRO-1/2 model moves to the host between its
    training phases (--deepspeed_enable_sleep): optimizer states, fp32 master weights and gradient partitions,
    as OpenRLHF does. Never `lp_params`: the low-precision weights run the next experience forward on the
    device. Empty with --adam_offload (those states already live on the host) and for ZeRO-0/3."""
    if adam_offload or zero_stage not in (1, 2):
        return []
    return ["optim_states", "hp_params", "lp_grads"]


# The first DeepSpeed release whose ZeRO-1/2 optimizer has `offload_states` (OpenRLHF v0.9.5 refuses <= 0.17.5).
MIN_DEEPSPEED_STAGE12_OFFLOAD = "0.17.6"


def check_sleep_supported(zero_stage: int, adam_offload: bool) -> None:
    """At start-up, before any model is built: --deepspeed_enable_sleep at ZeRO-1/2 (without --adam_offload)
    needs the stage-1/2 optimizer's `offload_states`, which older DeepSpeed releases lack."""
    if not offload_include(zero_stage, adam_offload):
        return
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    _require_stage12_offload_states(DeepSpeedZeroOptimizer)


def _require_stage12_offload_states(zero_optimizer) -> None:
    if not hasattr(zero_optimizer, "offload_states"):
        raise UsageError(f"--deepspeed_enable_sleep at --zero_stage 1/2 needs DeepSpeed >= "
                           f"{MIN_DEEPSPEED_STAGE12_OFFLOAD} (ZeRO-1/2 offload_states; installed "
                           f"{deepspeed.__version__}): upgrade DeepSpeed, or use --zero_stage 3 or --adam_offload")


def fused_adam(adam_offload: bool) -> bool | None:
    """torch's fused AdamW (True) where --adam_offload puts the fp32 master partitions and Adam's moments on the
    host: one vectorised pass over each tensor, where the default runs about ten element-wise ops one after
    another over the whole flat ZeRO partition (`benchmarks/host_adam.py`, 2 CPU cores, 2.1M-100M elements: the
    fused one 2.5-4.2x faster with tcmalloc, as jobs run, 7-11x on glibc's malloc). Elsewhere None, torch's
    default (foreach on a GPU). A CPU run keeps the default too: the fused kernel rounds differently in the last
    bit, which moves the learning examples' printed figures (the quickstart's final reward 0.670 -> 0.672), for
    under 1% of a CPU step."""
    return True if adam_offload else None


def _steps_to_host(optimizer: torch.optim.Optimizer) -> None:
    """Put torch Adam's scalar `step` counters back on the host (non-capturable Adam expects them there)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")) and state["step"].device.type != "cpu":
            state["step"] = state["step"].cpu()


def _empty_device_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient reached an optimizer step, or non-finite weights a save. Raised on every
    rank of the model's group alike (the decision is agreed over the group before anything is applied)."""


_GRADIENT_TERM = "gradient is non-finite"


NonfiniteFlags = tuple[list[str], torch.Tensor | None]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of `tensor` is finite, read on the host. One summing pass decides almost always: a NaN
    or an infinity makes the sum non-finite, so a finite sum means finite elements. Only a non-finite sum (a bad
    element, or finite ones whose sum overflows) is checked element by element. On the host `isfinite(t).all()` makes
    several passes and a bool copy: 10-60x the time of this check over 2.1M-100M-element fp32 partitions (36-44 ms
    against 2.0-2.6 ms for the 30M model's 14.7M-element ZeRO-2 partition on 2 ranks, one thread;
    `benchmarks/host_adam.py`); with --adam_offload every partition is checked on the host."""
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def nonfinite_flags(terms: dict[str, torch.Tensor | None]) -> NonfiniteFlags:
    """The present terms' names and, on the device of the first, a bool [n, 2]: whether each holds a non-finite
    value, and a NaN. Nothing is read back: `first_flagged` reads the flags of a whole optimizer step at once, so
    the check costs the host no wait per micro-batch."""
    present = {name: value.detach() for name, value in terms.items() if value is not None}
    if not present:
        return [], None
    device = next(iter(present.values())).device
    flags = torch.stack([torch.stack([~torch.isfinite(v).all(), torch.isnan(v).any()]).to(device)
                         for v in present.values()])
    return list(present), flags


def first_flagged(checks: Sequence[NonfiniteFlags]) -> str | None:
    """"<name> is nan" (or inf) for the first flagged term of the first check that has one (None: all finite)."""
    for names, flags in checks:
        if flags is None:
            continue
        for name, (bad, nan) in zip(names, flags.tolist()):
            if bad:
                return f"{name} is {'nan' if nan else 'inf'}"
    return None


def mark_moe_leaf_modules(model: torch.nn.Module) -> list[str]:
    """ZeRO-3: gather each sparse MoE block's parameters whole at the block's entry (DeepSpeed's z3 leaf modules,
    microsoft/DeepSpeed#4966), as OpenRLHF does for every `*SparseMoeBlock`: a rank whose tokens reach other experts
    than its peers' then still fetches the same parameters in the same order. Returns the classes marked."""
    from deepspeed.utils import set_z3_leaf_modules

    classes = sorted({type(m) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")},
                     key=lambda c: c.__name__)
    if classes:
        set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]


def _discard_gradients(engine, zero_stage: int) -> None:
    """Drop the accumulated gradients of the current optimizer step without applying them, the way
    DeepSpeed's own overflow path does (ZeRO-1/2 `step`, ZeRO-3 `_overflow_clean_up`), and count the step
    as skipped, as DeepSpeed counts an overflow (LR schedule not advanced)."""
    opt = engine.optimizer
    if zero_stage == 3:
        opt._overflow_clean_up(opt.loss_scale)
    elif zero_stage in (1, 2):
        opt.zero_grad(set_to_none=True)
        opt._release_preflattened_grad_buffers()
        if opt.cpu_offload:
            opt.reset_cpu_buffers()
        else:
            for k in opt.averaged_gradients:
                opt.averaged_gradients[k] = None
                opt.all_grad_tensors[k] = None
        opt.micro_step_id = -1  # INITIAL_MICRO_STEP_ID: the next backward starts a fresh accumulation
    else:
        opt.zero_grad()
        engine.zero_grad()
    engine.skipped_steps += 1
    engine.global_steps += 1
    engine.micro_steps += 1


def _layout_key(layout: dict) -> tuple[int, int, int]:
    """(ZeRO stage, data-parallel size, tensor-parallel size) of a saved or running layout (`DeepSpeedModel.layout`;
    a layout recorded before tensor parallelism has none)."""
    return layout["zero_stage"], layout["dp_size"], layout.get("tp_size", 1)


def layout_words(layout: dict) -> str:
    """A saved or running layout (`DeepSpeedModel.layout`) in words: "ZeRO-2 over 2 ranks", or with tensor
    parallelism "ZeRO-2 over 1 x 2 ranks (data x tensor parallel)"."""
    tp = layout.get("tp_size", 1)
    dp = layout["dp_size"]
    ranks = f"{dp} x {tp} ranks (data x tensor parallel)" if tp > 1 else f"{dp} rank{'s' if dp != 1 else ''}"
    return f"ZeRO-{layout['zero_stage']} over {ranks}"


class GroupMPU:
    """The `mpu` DeepSpeed asks for when a model's data-parallel group is a subgroup of the world: data
    parallelism over `dp_group`, model parallelism over `mp_group` (a single-rank group, or with
    --ds_tensor_parallel_size the tensor-parallel group)."""

    def __init__(self, dp_group: dist.ProcessGroup, mp_group: dist.ProcessGroup) -> None:
        self.dp_group, self.mp_group = dp_group, mp_group

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.mp_group)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.mp_group)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


class DeepSpeedModel:
    """One model on DeepSpeed over `dp_group`; construct on every rank of the group, same arguments.

    `build()` returns the torch module; under ZeRO-3 it runs while transformers' DeepSpeed config is
    alive so `from_pretrained` partitions and initialises weights as transformers intends. `adapt(module)`
    (LoRA) runs after that context, so the adapters are created whole and initialised as peft intends
    (DeepSpeed partitions them when the engine starts).
    Trainable models get AdamW over their trainable parameters and the LR schedule; frozen ones (reference,
    reward) are plain modules below ZeRO-3 and parameter-sharded DeepSpeed engines at ZeRO-3.
    `hpz_group` (--zpg > 1 at ZeRO-3): this rank's ZeRO++ secondary-partition group, --zpg consecutive ranks of
    `dp_group` (`Topology.hpz_group`). `checkpoint_reentrant`: torch's reentrant activation checkpointing.
    `ema_beta` (trainable, no LoRA): keep an exponential moving average of the weights (`WeightEMA`), updated
    after every applied optimizer step, checkpointed with the engine's state, and written by `save_hf` instead
    of the weights themselves (OpenRLHF's --enable_ema); `full_parameters` (the weight push) stays live.
    """

    def __init__(self, build: Callable[[], torch.nn.Module], engine_cfg: EngineConfig, optim_cfg: OptimConfig, *,
                 learning_rate: float, bf16: bool, micro_batch_size: int, grad_accum_steps: int, fp16: bool = False,
                 num_optimizer_steps: int, device: torch.device, dp_group: dist.ProcessGroup | None = None,
                 mpu: GroupMPU | None = None, tp_group: dist.ProcessGroup | None = None, trainable: bool = True,
                 gradient_checkpointing: bool = False,
                 checkpoint_reentrant: bool = False, hpz_group: dist.ProcessGroup | None = None,
                 ema_beta: float | None = None, name: str = "model",
                 adapt: Callable[[torch.nn.Module], torch.nn.Module] | None = None) -> None:
        self.name = name
        self.max_nonfinite_steps = optim_cfg.max_nonfinite_steps
        self.optimizer_steps = 0  # boundaries reached, applied or skipped
        self.nonfinite_skipped = 0
        self.dp_group = dp_group
        self.mpu_group = mpu.get_data_parallel_group() if mpu else None
        self.dp_size = dist.get_world_size(group=dp_group)
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(group=tp_group) if tp_group is not None else 1
        self.zero_stage = engine_cfg.zero_stage
        self.adam_offload = engine_cfg.adam_offload
        self.trainable = trainable
        self.hpz_group = hpz_group if engine_cfg.hpz_size > 1 else None
        assert engine_cfg.hpz_size == 1 or hpz_group is not None, "--zpg at ZeRO-3 needs the topology's hpz group"
        self.config = ds_config(engine_cfg, optim_cfg, bf16=bf16, fp16=fp16, micro_batch_size=micro_batch_size,
                                grad_accum_steps=grad_accum_steps)
        build_cpu_comm_op(dist.get_rank())
        deepspeed.init_distributed(dist_backend="nccl" if "nccl" in dist.get_backend() else "gloo",
                                   auto_mpi_discovery=False)
        model = self._build(build)
        if adapt is not None:
            model = adapt(model)
        self.adapted = lora.is_adapted(model)
        if self.zero_stage == 3:
            mark_moe_leaf_modules(model)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpoint_reentrant})
        self.scheduler = None
        if trainable and engine_cfg.deepcompile:  # as OpenRLHF: trained models only (CUDA: `for_this_machine`)
            self.config["compile"] = {"deepcompile": True}
        if self.tp_size > 1:  # AutoTP splits the linear layers when the engine starts, trained or frozen
            self.config["tensor_parallel"] = {"autotp_size": self.tp_size}
        use_tensor_parallel_groups(tp_group, dp_group if tp_group is not None else None)
        with barriers_scoped_to(self.mpu_group), hpz_scoped_to(self.hpz_group):
            if trainable:
                # frozen (LoRA base) weights get no optimizer states
                trained = [p for p in model.parameters() if p.requires_grad]
                optimizer = torch.optim.AdamW(trained, lr=learning_rate, betas=tuple(optim_cfg.adam_betas),
                                              weight_decay=optim_cfg.l2,
                                              fused=fused_adam(engine_cfg.adam_offload))
                scheduler = _scheduler(optimizer, optim_cfg, num_optimizer_steps)
                self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                    model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.config, mpu=mpu,
                    dist_init_required=False)
                if engine_cfg.deepcompile:
                    from deepspeed.compile.util import get_deepcompile_handle

                    with arch_list_for_deepspeed_builds(dist.get_rank()):
                        get_deepcompile_handle()  # DeepCompile's op, JIT-built here (once) rather than lazily
                        self.engine.compile()
            elif self.zero_stage == 3 or self.tp_size > 1:
                frozen = self.config if self.zero_stage == 3 else {  # no ZeRO-1/2 without an optimizer
                    **self.config, "zero_optimization": {**self.config["zero_optimization"], "stage": 0}}
                self.engine, *_ = deepspeed.initialize(model=model, config=frozen, mpu=mpu,
                                                       dist_init_required=False)
                self.engine.eval()
            else:
                self.engine = model.to(device).eval().requires_grad_(False)
        assert ema_beta is None or (trainable and not self.adapted), "an EMA averages a trained full model"
        self.ema = None if ema_beta is None else WeightEMA(
            [(n, p) for n, p in self.module.named_parameters() if p.requires_grad], ema_beta,
            zero3=self.zero_stage == 3, group=dp_group)

    def _build(self, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        if self.zero_stage != 3:
            return build()
        with zero3_construction(self.config, self.dp_group, self.hpz_group):
            return build()

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module if hasattr(self.engine, "module") else self.engine

    def train(self) -> None:
        assert self.trainable, "frozen model"
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Backward of a loss already divided by the global token count of the optimizer step.

        DeepSpeed averages gradients over DP ranks; multiplying by the DP size turns that average
        back into the sum over ranks. Gradient-accumulation scaling is switched off for the same reason.
        The caller says which micro-batch ends the optimizer step (their number may change from step to
        step with dynamic batching), so DeepSpeed's own micro-step count is never relied on.
        """
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        self.engine.backward(loss * self.dp_size, scale_wrt_gas=False)

    def step(self, nonfinite: str | None = None) -> bool:
        """Call after every micro-batch; DeepSpeed steps the optimizer at accumulation boundaries.

        `nonfinite`: the first loss term this rank saw non-finite during the current optimizer step (None:
        all finite). At the boundary, before DeepSpeed applies anything, it is agreed over the DP group
        (with each rank's part of the reduced gradient checked too, at every ZeRO stage); if any rank
        is bad, every rank raises `NonFiniteError` naming the optimizer step, the term and the rank, or,
        while fewer than --max_nonfinite_steps were skipped, drops the gradients and skips the update.
        A non-finite global gradient norm found after DeepSpeed's step (a backstop: the check above should
        have caught it) is handled the same way, and raises if DeepSpeed applied the update.
        Returns whether an update was applied. Collective over the DP group at boundaries.
        """
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()
            return False
        self.optimizer_steps += 1
        if nonfinite is None and self._local_grads_nonfinite():
            nonfinite = _GRADIENT_TERM
        bad = self._agree_nonfinite(nonfinite)
        if bad is not None:
            rank, term = bad
            self._skip_or_raise(f"{term} on rank {rank}" if term != _GRADIENT_TERM else
                                f"{term} (every loss term was finite; checked after the reduction over the "
                                f"{self.dp_size} rank{'s' if self.dp_size > 1 else ''}, before the update)")
            _discard_gradients(self.engine, self.zero_stage)
            return False
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if norm is not None and not math.isfinite(float(norm)):
            if self.engine.skipped_steps == skipped_before:
                self._skip_or_raise(f"gradient norm is {float(norm)} and the update was applied", force=True)
            self._skip_or_raise(f"gradient norm is {float(norm)} (DeepSpeed skipped the update)")
            return False
        if self.ema is not None:
            self.ema.update()
        return True

    def _local_grads_nonfinite(self) -> bool:
        """Whether this rank's part of the step's reduced gradient holds a non-finite value. Read at the
        accumulation boundary, after DeepSpeed's reduction and before its optimizer step: whole gradients at
        ZeRO-0, this rank's gradient partition at ZeRO-1/2/3 (a non-finite value lands in some rank's
        partition, and the ranks agree on the result)."""
        return any(not all_finite(g) for g in self._local_gradients())

    def _local_gradients(self) -> Iterator[torch.Tensor]:
        opt = self.engine.optimizer
        if self.zero_stage == 0:
            yield from (p.grad for p in self.module.parameters() if p.grad is not None)
        elif self.zero_stage in (1, 2):
            if opt.cpu_offload:  # reduced straight into the fp32 host partitions
                yield from (p.grad for p in opt.single_partition_of_fp32_groups if p.grad is not None)
            else:
                for grads in opt.averaged_gradients.values() if isinstance(opt.averaged_gradients, dict) \
                        else opt.averaged_gradients:
                    yield from ([grads] if torch.is_tensor(grads) else [g for g in grads or [] if g is not None])
        elif opt.offload_optimizer:  # ZeRO-3 offload: reduced into the fp32 partitions
            yield from (p.grad for p in opt.fp32_partitioned_groups_flat if p.grad is not None)
        else:
            yield opt.grad_partitions_flat_buffer

    def _agree_nonfinite(self, term: str | None) -> tuple[int, str] | None:
        """(group rank, term) of the first rank that saw a non-finite term, the same on every rank."""
        width = 64
        codes = torch.zeros(self.dp_size, width, dtype=torch.int32, device=self.engine.device)
        if term is not None:
            raw = list(term.encode()[:width]) or [ord("?")]
            codes[dist.get_rank(self.dp_group), :len(raw)] = torch.tensor(raw, dtype=torch.int32)
        dist.all_reduce(codes, group=self.dp_group)
        found = [(rank, bytes(c for c in row if c).decode(errors="replace"))
                 for rank, row in enumerate(codes.cpu().tolist()) if any(row)]
        # a loss term is the cause; the (all-reduced, so everywhere bad) gradient only its consequence
        return next((f for f in found if f[1] != _GRADIENT_TERM), found[0] if found else None)

    def _skip_or_raise(self, problem: str, force: bool = False) -> None:
        """Count a skipped optimizer step, or raise when the budget is spent (or `force`)."""
        message = f"optimizer step {self.optimizer_steps}: {self.name} {problem}"
        if force:
            raise NonFiniteError(f"{message}; stopping (these weights are never saved); lower the learning rate "
                                 "or check the data")
        if self.nonfinite_skipped >= self.max_nonfinite_steps:
            raise NonFiniteError(f"{message}; stopping before the non-finite values reach the weights "
                                 f"(--max_nonfinite_steps {self.max_nonfinite_steps} skipped steps allowed, "
                                 f"{self.nonfinite_skipped} used); lower the learning rate or check the data")
        self.nonfinite_skipped += 1
        warnings.warn(f"{message}: update skipped ({self.nonfinite_skipped} of --max_nonfinite_steps "
                      f"{self.max_nonfinite_steps})", stacklevel=3)

    def grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def _gather(self, params: list[torch.nn.Parameter], module: torch.nn.Module | None = None):
        """A context in which `params` (of `module`) are whole: a collective gather under ZeRO-3, or over the
        tensor-parallel group of a layer AutoTP split."""
        if self.tp_size > 1:
            from deepspeed.module_inject.layers import GatherReplacedLayerParams

            return GatherReplacedLayerParams(params, module, enabled=True)
        if self.zero_stage != 3:
            return nullcontext()
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def full_parameters(self, keep: bool = True, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every parameter, gathering ZeRO-3 shards one module at a time. With LoRA:
        the base model's parameters with the adapters merged in (W + scale x B @ A), under the base model's
        names and in its order, so the stream is what the unadapted model would yield.

        Collective under ZeRO-3: every rank of the DP group iterates it to the end, in the same order.
        Yielded tensors are private copies (valid after the gather is released). With `keep=False` the
        gathers still run (so a rank can take part without holding the model) but nothing is copied or
        yielded. With `copy=False`, for a consumer that copies each tensor before the model's next optimizer
        step (the weight push): below ZeRO-3 the live parameters themselves (read-only views), under ZeRO-3
        views of the gathered buffers (DeepSpeed allocates one per gather and releases it by dropping the
        parameter's reference, so the view keeps it valid). LoRA's merged tensors are always new.
        """
        if self.adapted:
            yield from lora.merged_parameters(self.module, self._gather, keep)
            return
        seen: set[int] = set()
        for module_name, module in self.module.named_modules():
            params = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for _, p in params)
            if not params:
                continue
            with self._gather([p for _, p in params], module):
                copies = [(f"{module_name}.{n}" if module_name else n, p.detach().clone() if copy else p.detach())
                          for n, p in params] if keep else []
            yield from copies

    def gathered_state_dict(self, is_writer: bool) -> dict[str, torch.Tensor]:
        """The full state dict (HF names; with LoRA the merged weights, see `full_parameters`) on the writer,
        {} elsewhere: non-writers take part in every ZeRO-3 gather but drop each tensor at once, so only one
        rank ever holds the whole model. Collective: every DP rank calls it. Raises `NonFiniteError` on the
        writer if a weight is not finite (such a model is never saved)."""
        return self._finite(dict(self.full_parameters(keep=is_writer)))

    def _finite(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        bad = [name for name, t in state.items() if t.is_floating_point() and not all_finite(t)]
        if bad:
            raise NonFiniteError(f"{self.name} weights are non-finite ({', '.join(bad[:5])}"
                                 f"{', ...' if len(bad) > 5 else ''}): refusing to save them")
        return state

    def _with_averages(self, state: dict[str, torch.Tensor], is_writer: bool) -> dict[str, torch.Tensor]:
        """`state` with each trained weight replaced by its moving average, in the weight's dtype (frozen ones
        never move). Collective under ZeRO-3 (the averages' partitions are gathered)."""
        for name, param in self.ema.params:
            average = self.ema.full(name, param)
            if is_writer:
                state[name] = average.to(state[name].dtype)
        return self._finite(state) if is_writer else state

    def offload(self) -> None:
        """Move what training alone needs to host memory until `reload`: for a trainable model the optimizer
        states, fp32 master weights and gradient partitions (`offload_include`; the low-precision weights stay,
        the next experience forward runs on them), nothing with --adam_offload (already on the host); for a
        frozen model below ZeRO-3 the parameters. Frees PyTorch's cached device memory afterwards. On a CPU
        job the tensors are still really moved to new buffers."""
        if self.trainable and self.adam_offload:
            return
        if self.trainable and self.zero_stage == 3:
            self._move_zero3_states(torch.device("cpu"), offload=True)
        elif self.trainable and self.zero_stage > 0:
            from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

            _require_stage12_offload_states(self.engine.optimizer)
            include = [OffloadStateTypeEnum(n) for n in offload_include(self.zero_stage, self.adam_offload)]
            # on CPU too: copies into separate host buffers
            self.engine.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=True)
        elif not self.trainable and self.zero_stage < 3:
            self.engine.to("cpu")
        _empty_device_cache()

    def reload(self, device: torch.device) -> None:
        """Bring back what `offload` moved (Adam's `step` counters stay on the host, where torch keeps them)."""
        if self.trainable and self.adam_offload:
            return
        if self.trainable and self.zero_stage == 3:
            self._move_zero3_states(device, offload=False)
        elif self.trainable and self.zero_stage > 0:
            self.engine.reload_states()
            _steps_to_host(self.engine.optimizer.optimizer)  # DeepSpeed moved every state tensor, `step` too
        elif not self.trainable and self.zero_stage < 3:
            self.engine.to(device)

    def _move_zero3_states(self, device: torch.device, offload: bool) -> None:
        """ZeRO-3's own offload_states needs DeepSpeed's CUDA FusedAdam for the optimizer states and master
        weights; with a torch optimizer we move the fp32 master partitions and the optimizer's moment tensors
        ourselves (always into new buffers). torch's AdamW keeps its `step` counters on the host (a device
        `step` costs a sync per tensor). The gradient shard and the reduce bucket, which the optimizer allocates
        at start-up and would otherwise keep on the device through every stage (5e8 elements for the bucket
        alone), go through DeepSpeed's offload_states, which needs no FusedAdam for them."""
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        zero = self.engine.optimizer
        zero.empty_partition_cache()
        tensors = list(zero.fp32_partitioned_groups_flat)
        tensors += [v for state in zero.optimizer.state.values() for k, v in state.items()
                    if torch.is_tensor(v) and k != "step"]
        for t in tensors:
            t.data = t.data.to(device, copy=True)
        if offload:
            zero.offload_states(include=[OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer],
                                device=OffloadDeviceEnum.cpu, pin_memory=torch.cuda.is_available())
        else:
            zero.reload_states()

    def save_state(self, directory: str, snapshot: Snapshot | None = None, what: str = "") -> None:
        """Weights, optimizer and LR-schedule state (DeepSpeed format); with LoRA the trainable (adapter)
        weights only, the frozen base being the --pretrain model. Collective over the DP group. With a
        `snapshot` (--async_save) the files are copied into it, to be written in the background; `what` names
        them in a failed write's line."""
        capture = snapshot.capturing(self.engine, what) if snapshot is not None else nullcontext()
        with barriers_scoped_to(self.mpu_group), capture:
            self.engine.save_checkpoint(directory, tag="state", save_latest=False,
                                        exclude_frozen_parameters=self.adapted)
        if self.ema is not None:  # this rank's averages (its partitions under ZeRO-3)
            if snapshot is not None:
                snapshot.save(self.ema.state_dict(), self._ema_file(directory), what)
            else:
                torch.save(self.ema.state_dict(), self._ema_file(directory))
        if dist.get_rank(self.dp_group) == 0 and (self.tp_group is None or dist.get_rank(self.tp_group) == 0):
            portable_state.write_layout(directory, **self.layout)

    @property
    def layout(self) -> dict:
        """What shapes this engine's saved state: ZeRO stage, data-parallel size, tensor-parallel size, dtype."""
        dtype = "bf16" if self.config["bf16"]["enabled"] else "fp16" if self.config["fp16"]["enabled"] else "fp32"
        return {"zero_stage": self.zero_stage, "dp_size": self.dp_size, "tp_size": self.tp_size, "dtype": dtype}

    def load_state(self, directory: str, universal: bool = False) -> str | None:
        """Restore what `save_state` wrote (with LoRA the frozen base weights stay as loaded). Collective over
        the DP group. A state saved by another layout (ZeRO stage, DP or TP size: another world size, placement or
        --ds_tensor_parallel_size), or any state with `universal` (--use_ds_universal_ckpt), loads through its
        universal form (`rlhf.engines.portable_state`); returns a line saying so, else None."""
        saved = portable_state.saved_layout(directory)
        moved = saved is not None and _layout_key(saved) != _layout_key(self.layout)
        # DeepSpeed's own loader takes a stage-0 state without tensor parallelism at any DP size: it is whole
        whole = saved is not None and all(_layout_key(layout)[::2] == (0, 1) for layout in (saved, self.layout))
        if universal or (moved and not whole):
            return self._load_moved(directory, saved)
        with barriers_scoped_to(self.mpu_group):
            path, _ = self.engine.load_checkpoint(directory, tag="state", load_optimizer_states=True,
                                                  load_lr_scheduler_states=True, load_module_strict=not self.adapted)
        if path is None:
            raise ValueError(f"no DeepSpeed state under {directory}/state")
        if self.ema is not None:
            file = self._ema_file(directory)
            if not os.path.isfile(file):
                raise ValueError(f"{file} is missing: the checkpoint was written without --enable_ema; resume with "
                                 "the flags of the run that wrote it")
            self.ema.load_state_dict(torch.load(file, weights_only=True))
        return None

    def _load_moved(self, directory: str, saved: dict | None) -> str:
        was = layout_words(saved) if saved else "its saved layout"
        now = layout_words(self.layout)
        if self.ema is not None:
            raise UsageError(f"{directory}: the {self.name}'s --enable_ema averages were saved by {was} and cannot "
                             f"move to {now}: resume with that layout, or start a new --ckpt_path")
        stages = {self.zero_stage} | ({saved["zero_stage"]} if saved else set())
        if 0 in stages and len(stages) > 1 and self.layout["dtype"] != "fp32":
            raise UsageError(f"{directory}: the {self.name}'s state cannot move between --zero_stage 0 and "
                             f"--zero_stage {max(stages)} in {self.layout['dtype']} (DeepSpeed's stage-0 "
                             f"{self.layout['dtype']} optimizer keeps its own master copies): resume at --zero_stage "
                             f"{saved['zero_stage'] if saved else 0}, or start a new --ckpt_path")
        params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

        def convert() -> str:  # DeepSpeed's converter fails with assertions and key errors too
            try:
                return portable_state.to_universal(directory, [n for n, _ in params])
            except (OSError, RuntimeError, ValueError, KeyError, AssertionError) as err:
                raise ValueError(f"converting {directory} (the {self.name}'s DeepSpeed state) to its universal "
                                 f"form failed: {type(err).__name__}: {err}") from err

        def in_data_group() -> str:
            return decided_by_rank0(convert, dist.get_rank(self.dp_group), self.dp_group)

        # once per model: on the first rank of the data group of each tensor-parallel group's first ranks
        tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        universal = (decided_by_rank0(in_data_group, tp_rank, self.tp_group) if self.tp_group is not None
                     else in_data_group())
        portable_state.load_universal(self.engine, self.scheduler, universal, zero_stage=self.zero_stage,
                                      params=params, tp_rank=tp_rank, tp_size=self.tp_size)
        return f"the {self.name}'s state moved from {was} to {now} (through {universal})"

    def _ema_file(self, directory: str) -> str:
        return os.path.join(directory, f"ema_rank{dist.get_rank(self.dp_group)}.pt")

    def save_hf(self, path: str, tokenizer, is_writer: bool, extra_config: dict | None = None) -> None:
        """Write the model in HF format (with the tokenizer); with LoRA the adapter, as OpenRLHF saves it
        (`rlhf.models.lora.save_adapter`; `extra_config` goes into its config.json; merge it into the base
        with `python -m rlhf.cli.lora_combiner`). Collective: every DP rank calls it."""
        if self.adapted:
            state = self._finite(lora.adapter_state_dict(self.module, self._gather, keep=is_writer))
            if is_writer:
                lora.save_adapter(self.module, state, path, tokenizer, extra_config)
            return
        assert extra_config is None, "extra_config applies to adapters (a full model's config is saved as it is)"
        state = self.gathered_state_dict(is_writer)
        if self.ema is not None:
            state = self._with_averages(state, is_writer)
        if is_writer:
            save_pretrained_on_this_rank(self.module, path, state)
            tokenizer.save_pretrained(path)


def save_pretrained_on_this_rank(module: torch.nn.Module, path: str, state: dict[str, torch.Tensor]) -> None:
    """`module.save_pretrained` with `state`, written by this rank whatever its global rank: transformers >= 5
    writes weights only on global rank 0 once torch.distributed is initialised (`should_save_on_this_rank`),
    which would leave a role on ranks of its own (a critic, RePULSe's proposal) saved without its weights."""
    module.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        module.save_pretrained(path, state_dict=state, safe_serialization=True)
    finally:
        del module.should_save_on_this_rank
